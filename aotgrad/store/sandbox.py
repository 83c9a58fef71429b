"""What a graph in an export artifact may call: the format's operator allowlist.

A file anyone can hand you must not touch the file system, the network or the process, so a
loaded step runs only operators that compute tensors from tensors. :func:`refusal` is the rule,
derived from what capture can emit (a functionalized trace at the dispatcher) and checked for
every node of every graph when a step is exported and when one is loaded
(docs/export-format.md, "The operator allowlist"):

1. a dispatcher operator of ``aten`` or ``prims`` (not a TorchScript-only builtin such as
   ``aten::save``, ``aten::grad``, ``aten::warn``: a trace never records one), or one of the
   runtime's own ops in :data:`RUNTIME_OPS`;
2. functional: its schema writes no argument (no in-place, ``out=``, ``set_``, ``resize_``,
   ``copy_``; a functionalized trace has none) and returns a value (an op that returns nothing,
   ``_print``, ``_assert_async``, exists for its side effect);
3. every argument is data the format writes (tensors, numbers, dtypes, devices, layouts, memory
   formats, lists and optionals of them), and a string only as a mode word
   (:data:`MODE_WORDS`: ``rounding_mode``, ``approximate``...), never a file name, message or
   text (``from_file(filename)``, ``_functional_assert_async(assert_msg)``): no ``Storage``,
   ``Stream``, future, dict or class argument;
4. it returns tensors or numbers;
5. it checks its indices (not ``_unsafe_index*``, ``*_unsafe`` sparse constructors, nor the kernels
   of :data:`TRUSTING`, which read or write where an index, offset or length tensor's values say) and
   makes dense tensors (not ``sparse``/``nested`` ones, whose indices nothing checks, nor a backend's
   quantized, packed or MKL-DNN ones: :data:`OPAQUE`), and it is not a ``_test_`` operator.

What stays admitted and takes memory-addressing values as arguments is bounded elsewhere: explicit
strides (``as_strided``, ``_reshape_alias`` and their ``_copy``/``_scatter`` forms) are checked
against the input's storage at load (``export.verify``); the index tensors of the backward kernels in
:data:`INDEX_GUARDS` (emitted for every CNN and embedding) are range-checked as the step runs.
"""
from __future__ import annotations

import math
import operator

import torch

from .._torch import OpOverload, dispatcher_has_kernel

RUNTIME_OPS = frozenset({"aotgrad::rng_state.default", "aotgrad::set_rng_state.default"})   # passes.rng_rewind
# Checks that return nothing and only raise, with eager's message, where a value is bad (a singular
# matrix for linalg.inv, one not positive-definite for cholesky): dropping one would turn eager's error
# into a wrong number; its one text argument names the API in that message.
CHECKS = frozenset({"aten::_linalg_check_errors.default"})
CAPTURE_ONLY = frozenset({"aotgrad::block_fw", "aotgrad::block_bw"})       # capture inlines them
MODE_WORDS = frozenset({"approximate", "rounding_mode", "reduce", "padding", "mode", "equation", "indexing", "side",
                        "interpolation", "driver", "UPLO", "norm", "pad_mode", "ord"})
_DATA = frozenset({"TensorType", "IntType", "SymIntType", "FloatType", "SymFloatType", "BoolType", "SymBoolType",
                   "NumberType", "ComplexType", "DeviceObjType", "ScalarTypeType", "LayoutType",
                   "MemoryFormatType", "GeneratorType"})
_RESULTS = frozenset({"TensorType", "IntType", "SymIntType", "FloatType", "SymFloatType", "BoolType", "SymBoolType",
                      "NumberType"})
_CHECKED_UNSAFE = frozenset({"_unsafe_view", "unsafe_split", "unsafe_split_with_sizes", "unsafe_chunk"})  # views
# Kernels that trust an index, offset or length tensor's values, which no fake tensor sees at load (probed
# on torch 2.13 CPU: a crafted value crashes the process or reads past a storage; tests/export/test_attacks.py).
TRUSTING = frozenset({"_convert_indices_from_coo_to_csr", "_convert_indices_from_csr_to_coo", "segment_reduce",
                      "_segment_reduce_backward", "ctc_loss", "_ctc_loss", "_ctc_loss_backward", "_cudnn_ctc_loss",
                      "miopen_ctc_loss", "_embedding_bag_backward", "_embedding_bag_dense_backward",
                      "_embedding_bag_per_sample_weights_backward", "_pack_padded_sequence",
                      "_pack_padded_sequence_backward", "_pad_packed_sequence", "_jagged_to_padded_dense_forward",
                      "_padded_dense_to_jagged_forward", "_efficientzerotensor"})
# Operators of a backend's own tensor layouts (quantized, packed weights, MKL-DNN): their kernels trust
# the layout's bytes and metadata. By name prefix (``fake_quantize_*``, dense, stays).
OPAQUE = ("quantize_per", "quantized", "_make_per", "_empty_affine", "_empty_per_channel", "empty_quantized",
          "fbgemm", "_dyn_quant", "_weight_int", "_convert_weight", "_cslt", "mkldnn", "_mkldnn", "to_mkldnn",
          "_nnpack", "_wrapped")
# Admitted kernels that index a tensor with another tensor's values without checking them (a crafted
# index writes outside the gradient's storage): ``{operator: (index argument, bound)}``, the bound an
# integer argument's position or ``(tensor argument, n)``: the product of its last ``n`` sizes (one
# pooling plane). The loaded step checks ``0 <= index < bound`` before each runs (``export.rebuild``).
INDEX_GUARDS = {"aten::max_pool2d_with_indices_backward.default": (7, (1, 2)),
                "aten::max_pool3d_with_indices_backward.default": (7, (1, 3)),
                "aten::adaptive_max_pool2d_backward.default": (2, (1, 2)),
                "aten::adaptive_max_pool3d_backward.default": (2, (1, 3)),
                "aten::embedding_dense_backward.default": (1, 2)}
# The Python calls a static graph holds: a tuple result's element, and the scalar arithmetic of an
# optimizer's eager path on numbers read with ``.item()`` (a training step's bias corrections).
ARITHMETIC = (operator.add, operator.sub, operator.mul, operator.truediv, operator.neg, operator.pow)
PY_FUNCTIONS = (operator.getitem, *ARITHMETIC)
# The size arithmetic of a symbolic graph (the disk cache keeps dynamic graphs; an export is static):
# pure functions of numbers.
SIZE_FUNCTIONS = (operator.floordiv, operator.mod, operator.eq, operator.ne, operator.lt, operator.le, operator.gt,
                  operator.ge, operator.and_, operator.or_, operator.not_, operator.pos, math.ceil, math.floor,
                  math.trunc, math.sqrt, torch.sym_float, torch.sym_int, torch.sym_max, torch.sym_min, torch.sym_not,
                  torch.sym_ite, torch.sym_sum)


def qualified_name(op: OpOverload) -> str:
    return f"{op._schema.name}.{op._overloadname}"


def refusal(op) -> str | None:
    """Why a loaded step may not run ``op`` (a sentence), or None when the allowlist admits it."""
    if not isinstance(op, OpOverload):
        return "it is not an operator overload"
    name = qualified_name(op)
    ns, _, base = op._schema.name.partition("::")
    if name in RUNTIME_OPS or name in CHECKS:
        return None
    if op._schema.name in CAPTURE_ONLY:
        return "it exists only while capturing (the capture inlines it)"
    if ns == "aotgrad":
        return ("it is one of aotgrad's own run-time operators, which calls Python code (a tensor hook, retain_grad, "
                "a random fill of a view with gaps: passes.rng_layout)")
    if ns not in ("aten", "prims"):
        return f"namespace {ns} is neither aten, prims nor the runtime's own RNG ops"
    if not dispatcher_has_kernel(op._schema.name if op._overloadname == "default" else name):
        return "it is a TorchScript builtin, not a dispatcher operator a trace records"
    schema = op._schema
    if schema.is_mutable:
        return "it writes one of its arguments (a traced step is functional)"
    if not schema.returns:
        return "it returns nothing: it runs only for a side effect"
    for arg in schema.arguments:
        why = _argument(arg.name, arg.type)
        if why:
            return why
    if not all(_result(r.type) for r in schema.returns):
        return "it returns something other than tensors and numbers"
    if ("unsafe" in base and base not in _CHECKED_UNSAFE) or "sparse" in base or "nested" in base \
            or base.startswith("_test_") or base in TRUSTING:
        return "it skips its index checks, builds a non-dense tensor or is a test operator"
    if base.startswith(OPAQUE):
        return "it makes or reads a backend's quantized, packed or MKL-DNN tensor, whose kernels trust its layout"
    return None


def _argument(name: str, t) -> str | None:
    kind = t.kind()
    if kind in ("OptionalType", "ListType"):
        return next(filter(None, (_argument(name, c) for c in t.containedTypes())), None)
    if kind == "StringType":
        return None if name in MODE_WORDS else f"its argument {name!r} is text (a file name or message), not a mode word"
    return None if kind in _DATA else f"its argument {name!r} is a {t} (not data the format writes)"


def _result(t) -> bool:
    kind = t.kind()
    if kind in ("OptionalType", "ListType"):
        return all(_result(c) for c in t.containedTypes())
    return kind in _RESULTS
