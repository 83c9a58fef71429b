"""Every stage and pass records its name, duration and a few facts."""
from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Step:
    name: str
    seconds: float
    info: dict = field(default_factory=dict)

    def __str__(self) -> str:
        facts = ", ".join(f"{k}={v}" for k, v in self.info.items())
        return f"{self.name:<22} {self.seconds * 1e3:9.1f} ms  {facts}"


@contextlib.contextmanager
def timed(history: list, name: str, **info):
    """Append a :class:`Step` to ``history`` when the block ends; the block may add to ``info``."""
    start = time.perf_counter()
    yield info
    history.append(Step(name, time.perf_counter() - start, info))
