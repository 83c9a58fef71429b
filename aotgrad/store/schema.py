"""The stage metadata an artifact may hold, field by field, with the type each field must have.

Loaded values reach generated code (the input guards, the graph's Python), so a field is
accepted only when its value has exactly the type the runtime builds it with: an ``int`` size
is an ``int``, never a string that would be pasted into source.
"""
from __future__ import annotations

import re

import torch

from ..ir import descriptors as d
from ..ir.records import Analysis, InputInfo, JointLayout, OutputInfo, ViewMeta
from ..guards.inputs import TensorSpec
from . import codec
from ..ir.values import TensorMeta


def _int(v) -> bool:
    return type(v) is int


def _bool(v) -> bool:
    return type(v) is bool


def _str(v) -> bool:
    return type(v) is str


def _ints(v) -> bool:
    return type(v) is tuple and all(type(x) is int for x in v)


def _tuple_of(cls):
    return lambda v: type(v) is tuple and all(type(x) is cls for x in v)


def _optional(cls):
    return lambda v: v is None or type(v) is cls


def _constant(v) -> bool:
    """An output that is a number or string (``OutputInfo.value``), compared and returned as is."""
    return v is None or type(v) in (bool, int, float, str) or isinstance(v, (torch.dtype, torch.device)) \
        or (type(v) is tuple and all(_constant(x) for x in v))


def _desc(v) -> bool:
    return type(v) in d.KINDS


_OUTPUT_KINDS = ("plain", "input", "input_view", "input_detached", "output", "output_view", "intermediate_view",
                 "constant")
SCHEMAS = {
    # Descriptors nest as data: ``{"@": "TangentDesc", "output": {"@": "OutputDesc", "index": 0}}``.
    d.ParamDesc: {"name": _str}, d.BufferDesc: {"name": _str}, d.InputDesc: {"name": _str},
    d.SavedDesc: {"name": _str}, d.OutputDesc: {"index": _int}, d.ViewBaseDesc: {"index": _int},
    d.TangentDesc: {"output": _desc}, d.GradDesc: {"of": _desc}, d.MutationDesc: {"of": _desc},
    d.BaseDesc: {"members": lambda v: type(v) is tuple and all(map(_desc, v))},
    TensorSpec: {"dtype": lambda v: isinstance(v, torch.dtype), "device": lambda v: isinstance(v, torch.device),
                 "size": _ints, "requires_grad": _bool, "layout": _ints},
    ViewMeta: {"size": _ints, "stride": _ints, "offset": _int},
    InputInfo: {"requires_grad": _bool, "mutates_data": _bool, "mutates_metadata": _bool,
                "mutation_hidden": _bool, "new_meta": _optional(ViewMeta)},
    OutputInfo: {"kind": lambda v: v in _OUTPUT_KINDS, "index": _int, "view": _optional(ViewMeta),
                 "requires_grad": _bool, "value": _constant, "is_leaf": _bool, "is_view": _bool,
                 "replay": lambda v: v is None},
    Analysis: {"inputs": _tuple_of(InputInfo), "outputs": _tuple_of(OutputInfo), "base_count": _int,
               "fake_outputs": lambda v: v == (), "fw_requires_grad": lambda v: type(v) is tuple and all(map(_bool, v)),
               "out_spec": lambda v: v is None},    # written once, as the manifest's out_spec
    JointLayout: {"n_primals": _int, "tangent_of": _ints, "n_fw": _int, "grad_of": _ints, "mutated": _ints},
    TensorMeta: {"shape": _ints, "stride": _ints, "offset": _int, "dtype": lambda v: isinstance(v, torch.dtype),
                 "device": lambda v: type(v) is str and re.match(r"^[a-z]+(:\d+)?$", v) is not None,
                 "requires_grad": _bool},
}

for _cls, _fields in SCHEMAS.items():
    codec.register(_cls, _fields)
