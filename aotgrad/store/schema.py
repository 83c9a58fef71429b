"""The stage metadata an artifact may hold, field by field, with the type each field must have.

Loaded values reach generated code (the input guards, the graph's Python), so a field is
accepted only when its value has exactly the type the runtime builds it with: an ``int`` size
is an ``int``, never a string that would be pasted into source.
"""
from __future__ import annotations

import dataclasses
import re

import sympy
import torch

from ..ir import descriptors as d
from ..ir.records import Analysis, InputInfo, JointLayout, OutputInfo, ViewMeta
from ..guards.inputs import TensorSpec
from . import codec, symbolic
from ..ir.values import SymText, TensorMeta


def _int(v) -> bool:
    return type(v) is int


def _bool(v) -> bool:
    return type(v) is bool


def _str(v) -> bool:
    return type(v) is str


def _ints(v) -> bool:
    return type(v) is tuple and all(type(x) is int for x in v)


def _size(v) -> bool:
    """An int, or a symbolic size (a sympy expression: the codec admits one only for a reader that
    asks for them, the disk cache; an artifact's sizes are ints)."""
    return type(v) is int or isinstance(v, sympy.Expr)


def _sizes(v) -> bool:
    return type(v) is tuple and all(map(_size, v))


def _text_size(v) -> bool:
    """A stored graph value's size: an int, or sympy text naming only symbols and size functions."""
    return type(v) is int or symbolic.text_ok(v)


def _tuple_of(cls):
    return lambda v: type(v) is tuple and all(type(x) is cls for x in v)


def _optional(cls):
    return lambda v: v is None or type(v) is cls


def _constant(v) -> bool:
    """An output that is a number or string (``OutputInfo.value``), compared and returned as is; or a
    symbolic output's ``(kind, expression)``."""
    return v is None or type(v) in (bool, int, float, str) or isinstance(v, (torch.dtype, torch.device, sympy.Expr)) \
        or (type(v) is tuple and all(_constant(x) for x in v))


def _desc(v) -> bool:
    return type(v) in d.KINDS


_OUTPUT_KINDS = ("plain", "input", "input_view", "input_detached", "input_set", "output", "output_view",
                 "intermediate_view", "constant", "symbolic")
SCHEMAS = {
    # Descriptors nest as data: ``{"@": "TangentDesc", "output": {"@": "OutputDesc", "index": 0}}``.
    d.ParamDesc: {"name": _str}, d.BufferDesc: {"name": _str}, d.InputDesc: {"name": _str},
    d.SavedDesc: {"name": _str}, d.OutputDesc: {"index": _int}, d.ViewBaseDesc: {"index": _int},
    d.TangentDesc: {"output": _desc}, d.GradDesc: {"of": _desc}, d.MutationDesc: {"of": _desc},
    d.BaseDesc: {"members": lambda v: type(v) is tuple and all(map(_desc, v))},
    TensorSpec: {"dtype": lambda v: isinstance(v, torch.dtype), "device": lambda v: isinstance(v, torch.device),
                 "size": _sizes, "requires_grad": _bool, "layout": _sizes, "filled": _bool},
    ViewMeta: {"size": _sizes, "stride": _sizes, "offset": _size},
    InputInfo: {"requires_grad": _bool, "mutates_data": _bool, "mutates_metadata": _bool, "meta_seen": _bool,
                "mutation_hidden": _bool, "new_meta": _optional(ViewMeta), "new_storage": _optional(OutputInfo),
                "sets_requires_grad": _bool,
                "storage_resize": lambda v: v is None or type(v) is tuple and len(v) == 2 and _bool(v[0]) and _size(v[1])},
    OutputInfo: {"kind": lambda v: v in _OUTPUT_KINDS, "index": _int, "view": _optional(ViewMeta),
                 "requires_grad": _bool, "value": _constant, "is_leaf": _bool, "is_view": _bool,
                 "replay": lambda v: v is None},
    Analysis: {"inputs": _tuple_of(InputInfo), "outputs": _tuple_of(OutputInfo), "base_count": _int,
               "fake_outputs": lambda v: v == (), "fw_requires_grad": lambda v: type(v) is tuple and all(map(_bool, v)),
               "out_spec": lambda v: v is None,     # written once, as the manifest's out_spec
               "eager_saved": _ints, "quiet_writes": _ints, "eager_reruns": _bool,
               "rewritten": lambda v: v == () or type(v) is tuple and len(v) == 2 and _optional(str)(v[0])
               and _bool(v[1])},
    JointLayout: {"n_primals": _int, "tangent_of": _ints, "n_fw": _int, "grad_of": _ints, "mutated": _ints},
    SymText: {"expr": symbolic.text_ok},
    TensorMeta: {"shape": lambda v: type(v) is tuple and all(map(_text_size, v)),
                 "stride": lambda v: type(v) is tuple and all(map(_text_size, v)), "offset": _text_size,
                 "dtype": lambda v: isinstance(v, torch.dtype),
                 "device": lambda v: type(v) is str and re.match(r"^[a-z]+(:\d+)?$", v) is not None,
                 "requires_grad": _bool},
}

for _cls, _fields in SCHEMAS.items():
    codec.register(_cls, _fields)


def stored_analysis(a: Analysis, symbolic: bool) -> Analysis:
    """The analysis as it is stored: without fake values (they only serve tracing), the output
    structure (written once, as the record's ``out_spec``) and view replays (live C++ records: a loaded
    step regenerates views with ``as_strided`` on inputs its guards pin). Raises ``Unserializable`` for an
    output only its replay regenerates, and, unless ``symbolic``, for a number computed from sizes."""
    from ..ir.graphs import Unserializable
    for o in a.outputs:
        if o.replay is not None and o.replay.required:
            raise Unserializable("an output view only replaying its view ops regenerates (view_as_real, conj)")
        if o.kind == "symbolic" and not symbolic:
            raise Unserializable("an output number computed from symbolic sizes")
    outputs = tuple(dataclasses.replace(o, replay=None) for o in a.outputs)
    return dataclasses.replace(a, outputs=outputs, fake_outputs=(), out_spec=None)
