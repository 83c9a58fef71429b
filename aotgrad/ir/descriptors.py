"""Descriptors name every input and output of the joint graph."""
from __future__ import annotations

import re
from dataclasses import dataclass

_KINDS = {
    "param": "param '{}'", "buffer": "buffer '{}'", "input": "{}",
    "tangent": "tangent of {}", "grad": "grad of {}", "output": "output {}",
    "mutation": "new value of {}", "base": "base of {}", "saved": "saved {}",
}


@dataclass(frozen=True)
class Desc:
    kind: str
    name: str

    def __str__(self) -> str:
        return _KINDS[self.kind].format(self.name)

    def ident(self) -> str:
        """A Python identifier for graph node names: ``param 'h.0.w'`` -> ``p_h_0_w``."""
        prefix = {"param": "p_", "buffer": "b_", "input": "", "tangent": "tangent_",
                  "grad": "grad_", "output": "out_", "mutation": "new_", "base": "base_",
                  "saved": "saved_"}[self.kind]
        body = re.sub(r"\W+", "_", self.name).strip("_") or "x"
        return prefix + body


def of(kind: str, inner: "Desc") -> Desc:
    return Desc(kind, str(inner))
