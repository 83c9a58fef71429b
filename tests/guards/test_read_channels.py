"""Reads through channels the bytecode alone does not follow: each is guarded by value, observed as
the trace runs, or refused at capture — never trusted.

Each case is a tiny program (its own module, so the code is the user's) that reads one value through
one channel (``VALUES`` held at one of ``PLACES``, torch's switches, reflective reads), called once,
changed, called again: ``aotgrad.jit`` must return eager's result (recompiling), and a
``capture().compile()`` of the first call must raise ``InputMismatchError``. A refused case raises a
typed error naming the user's line. Every change changes eager's result (checked), so a stale graph
fails the case.
"""
import itertools
import sys
import threading
import types

import pytest
import torch

import aotgrad
from aotgrad import _torch, errors
from aotgrad.runtime import modes

_UNSET = object()

HEADER = """
import array, collections, contextlib, contextvars, functools, inspect, operator, threading, weakref
import numpy as np
import torch
"""

# value kind: (how it is made, how the program reads a number from it, how it is changed in place)
VALUES = {
    "deque": ("collections.deque([2.0])", "{v}[0]", "{v}[0] = 3.0"),
    "deque subclass": ("type('DQ', (collections.deque,), {})([2.0])", "{v}[0]", "{v}.append(1.0); {v}.popleft(); "
                       "{v}[0] = 3.0"),
    "array.array": ("array.array('d', [2.0])", "{v}[0]", "{v}[0] = 3.0"),
    "bytearray": ("bytearray(b'\\x02')", "{v}[0]", "{v}[0] = 3"),
    "numpy array": ("np.array([2.0])", "float({v}[0])", "{v}[0] = 3.0"),
    "list five deep": ("[[[[[2.0]]]]]", "{v}[0][0][0][0][0]", "{v}[0][0][0][0][0] = 3.0"),
    "tensor .item()": ("torch.tensor(2.0)", "{v}.item()", "{v}.fill_(3.0)"),
    "set": ("{2}", "(2.0 if 3 not in {v} else 3.0)", "{v}.add(3)"),
    # a view's bytes are another object's, written through the view or through that object
    "memoryview": ("memoryview(bytearray(b'\\x02'))", "{v}[0]", "{v}[0] = 3"),
    "memoryview of an array": ("memoryview(array.array('d', [2.0]))", "{v}.tolist()[0]", "{v}.obj[0] = 3.0"),
}

# place: (definition of the holder, the expression reaching the value ``{h}``)
PLACES = {
    "global": ("H = {make}", "H"),
    "closure cell": ("def _mk():\n    h = {make}\n    return lambda: h\nGET = _mk()", "GET()"),
    "object attribute": ("class O: pass\nOBJ = O(); OBJ.h = {make}", "OBJ.h"),
    "class attribute": ("class K:\n    h = {make}", "K.h"),
    "list item": ("L = [{make}]", "L[0]"),
    "weakref": ("class O: pass\nOBJ = O(); OBJ.h = {make}\nREF = weakref.ref(OBJ)", "REF().h"),
}

_n = itertools.count()


def _module(src):
    name = f"_read_channels_{next(_n)}"
    mod = types.ModuleType(name)
    sys.modules[name] = mod
    exec(compile(HEADER + src, f"<{name}>", "exec"), vars(mod))
    return vars(mod)


def _value_program(kind, place):
    make, read, change = VALUES[kind]
    define, reach = PLACES[place]
    src = define.format(make=make) + f"\n\ndef f(x):\n    return x * {read.format(v=reach)}\n\n" \
        f"def change():\n    {change.format(v=reach)}\n"
    return _module(src)


@pytest.fixture(autouse=True)
def _no_disk_cache(monkeypatch):
    monkeypatch.setenv("AOTGRAD_CACHE", "0")


def _check(ns, fn, change, x):
    """jit recompiles to eager's result; the staged step refuses the changed state."""
    f = aotgrad.jit(fn)
    torch.testing.assert_close(f(x), fn(x))
    staged = aotgrad.capture(fn, x).compile()
    before = fn(x)
    torch.testing.assert_close(staged(x), before)
    change()
    expected = fn(x)
    assert not torch.equal(expected, before), "the change must change eager's result"
    torch.testing.assert_close(f(x), expected)
    assert len(f.entries) == 2, [e.reason for e in f.entries]
    with pytest.raises(errors.InputMismatchError):
        staged(x)


@pytest.mark.parametrize("kind,place", list(itertools.product(VALUES, PLACES)))
def test_value_read_in_place_changed(kind, place):
    ns = _value_program(kind, place)
    _check(ns, ns["f"], ns["change"], torch.tensor([1.0, -2.0]))


@pytest.mark.parametrize("kind", ["set", "bytearray", "deque", "memoryview", "memoryview of an array"])
def test_container_argument_changed_in_place(kind):
    make, read, change = VALUES[kind]
    ns = _module(f"ARG = {make}\n\ndef f(x, v):\n    return x * {read.format(v='v')}\n\n"
                 f"def change():\n    {change.format(v='ARG')}\n")
    x, arg = torch.tensor([1.0, -2.0]), ns["ARG"]
    f = aotgrad.jit(ns["f"])
    staged = aotgrad.capture(ns["f"], x, arg).compile()
    before = f(x, arg)
    torch.testing.assert_close(before, ns["f"](x, arg))
    ns["change"]()
    torch.testing.assert_close(f(x, arg), ns["f"](x, arg))
    assert not torch.equal(before, ns["f"](x, arg))
    with pytest.raises(errors.InputMismatchError):
        staged(x, arg)


# torch's switches: (the read, the change, the value to put back)
SWITCHES = {
    "deterministic algorithms": ("torch.are_deterministic_algorithms_enabled()",
                                 lambda v: torch.use_deterministic_algorithms(v), torch.are_deterministic_algorithms_enabled),
    "float32 matmul precision": ("torch.get_float32_matmul_precision() == 'highest'",
                                 lambda v: torch.set_float32_matmul_precision("highest" if v else "high"),
                                 lambda: torch.get_float32_matmul_precision() == "highest"),
    "anomaly mode": ("torch.is_anomaly_enabled()", lambda v: torch.set_anomaly_enabled(v), torch.is_anomaly_enabled),
    # the per-backend precision (a getter taking arguments), set apart from the legacy one
    "oneDNN matmul fp32 precision": ("torch.backends.mkldnn.matmul.fp32_precision == 'none'",
                                     lambda v: setattr(torch.backends.mkldnn.matmul, "fp32_precision", "none" if v else "bf16"),
                                     lambda: torch.backends.mkldnn.matmul.fp32_precision == "none"),
    "fp32 precision": ("torch.backends.fp32_precision == 'none'",
                       lambda v: setattr(torch.backends, "fp32_precision", "none" if v else "tf32"),
                       lambda: torch.backends.fp32_precision == "none"),
    "cudnn benchmark": ("torch.backends.cudnn.benchmark",
                        lambda v: setattr(torch.backends.cudnn, "benchmark", v), lambda: torch.backends.cudnn.benchmark),
    "oneDNN": ("torch.backends.mkldnn.enabled", lambda v: setattr(torch.backends.mkldnn, "enabled", v),
               lambda: torch.backends.mkldnn.enabled),
    "default dtype": ("torch.get_default_dtype() == torch.float64",
                      lambda v: torch.set_default_dtype(torch.float64 if v else torch.float32),
                      lambda: torch.get_default_dtype() == torch.float64),
}


@pytest.mark.parametrize("name", list(SWITCHES))
def test_torch_switch_read_by_the_trace(name):
    read, put, get = SWITCHES[name]
    ns = _module(f"def f(x):\n    return x * (2.0 if {read} else 3.0)\n")
    was, precisions = get(), _torch.fp32_precisions()
    try:
        _check(ns, ns["f"], lambda: put(not was), torch.tensor([1.0, -2.0]))
    finally:
        put(was)
        # (a per-backend precision's flag puts back "none" or another value, not the one it had: later
        # tests' legacy getter would raise on the mix)
        _torch.set_fp32_setting(precisions)


# State a library's module holds as an object or a container, read through the module by the
# user's code: followed as the same object is where a user global names it (it was a stale graph
# before). (the library module's setup, the read, the change, its undo)
LIBRARY_STATE = {
    "an object's attribute (torch's print options)": (
        "", "torch._tensor_str.PRINT_OPTS.precision", "torch.set_printoptions(precision=2)",
        "torch.set_printoptions(precision=4)"),
    "the root logger's level": ("", "(2.0 if logging.root.level == logging.WARNING else 3.0)",
                                "logging.root.setLevel(logging.DEBUG)", "logging.root.setLevel(logging.WARNING)"),
    "a list (sys.argv)": ("", "len(sys.argv)", "sys.argv.append('z')", "sys.argv.pop()"),
    "a list another library fills (warnings.filters)": (
        "", "len(warnings.filters)", "warnings.simplefilter('ignore', UserWarning)", "warnings.filters.pop(0)"),
    "a dict in a library's module": ("LIB.TABLE = {'k': 2.0}", "LIB.TABLE['k']", "LIB.TABLE['k'] = 3.0",
                                     "LIB.TABLE['k'] = 2.0"),
    "a plain object in a library's module": ("LIB.CFG = types.SimpleNamespace(scale=2.0)", "LIB.CFG.scale",
                                             "LIB.CFG.scale = 3.0", "LIB.CFG.scale = 2.0"),
}


@pytest.mark.parametrize("case", LIBRARY_STATE)
def test_library_module_state_read_through_the_module(case):
    setup, read, change, undo = LIBRARY_STATE[case]
    lib = types.ModuleType("json._aotgrad_test_lib")     # a library's module (under the standard library's)
    sys.modules[lib.__name__] = lib
    ns = _module(f"import logging, sys, types, warnings\nLIB = sys.modules['{lib.__name__}']\n{setup}\n\n"
                 f"def f(x):\n    return x * {read}\n\ndef change():\n    {change}\n\ndef undo():\n    {undo}\n")
    try:
        _check(ns, ns["f"], ns["change"], torch.tensor([1.0, -2.0]))
    finally:
        ns["undo"]()
        del sys.modules[lib.__name__]


# A library's function or class the user's code loads from its module is its code, read by identity
# and not followed: rebinding it (a monkeypatch after the first call) recompiles; it was a stale graph
# before. (the read, the module attribute the change rebinds, what it rebinds it to)
LIBRARY_CODE = {
    "torch.nn.functional's function (F.gelu)": ("F.gelu(x)", "F", "gelu", "lambda t: t * 3"),
    "the same through the package (torch.nn.functional.silu)": ("torch.nn.functional.silu(x)", "F", "silu",
                                                                "lambda t: t * 3"),
    "torch's own (torch.tanh)": ("torch.tanh(x)", "torch", "tanh", "torch.sigmoid"),
    "a builtin function of the standard library (math.cos)": ("x * math.cos(1.0)", "math", "cos",
                                                              "lambda v: 5.0"),
    "a library's class (string.Formatter)": ("x * len(string.Formatter().format('{}', 'ab'))", "string",
                                             "Formatter", "type('F', (), {'format': lambda *a: 'abc'})"),
}


@pytest.mark.parametrize("case", LIBRARY_CODE)
def test_a_library_function_rebound_after_capture_recompiles(case):
    read, module, name, new = LIBRARY_CODE[case]
    ns = _module(f"import math, string\nimport torch.nn.functional as F\n\ndef f(x):\n    return {read}\n")
    owner = sys.modules[ns[module].__name__]
    was = getattr(owner, name)
    try:
        _check(ns, ns["f"], lambda: setattr(owner, name, eval(new, ns)), torch.tensor([1.0, -2.0]))
    finally:
        setattr(owner, name, was)


# A tensor's method or attribute the user's code loads, patched onto torch.Tensor after the first call
# (a debugging hook, a library's fused kernel): a traced tensor is no root a read chain starts from, so
# it was a stale graph before. (the expression, the name set on torch.Tensor, what it is set to)
TENSOR_ATTRIBUTES = {
    "a TensorBase method shadowed on torch.Tensor (x.relu())": ("x.relu()", "relu", "lambda s: s * 3"),
    "torch.Tensor's own Python method (x.norm())": ("x * x.norm()", "norm", "lambda s, *a, **k: s.sum()"),
    "a TensorBase attribute made a property (x.real)": ("x.real * 2", "real", "property(lambda s: s * 3)"),
    "a method on an intermediate (h.sigmoid())": ("(x * 2).sigmoid()", "sigmoid", "lambda s: s + 1"),
    "an operator (x * 2)": ("x * 2", "__mul__", "lambda s, o: torch.add(s, o)"),
    "a reflected operator (2 - x)": ("2 - x", "__rsub__", "lambda s, o: torch.add(s, o)"),
    "an index (x[1:])": ("x[1:] * 2", "__getitem__", "lambda s, i: torch.neg(s)"),
}


@pytest.mark.parametrize("case", TENSOR_ATTRIBUTES)
def test_a_tensor_method_patched_after_capture_recompiles(case):
    read, name, new = TENSOR_ATTRIBUTES[case]
    ns = _module(f"def f(x):\n    return {read}\n")
    had = vars(torch.Tensor).get(name, _UNSET)
    try:
        _check(ns, ns["f"], lambda: setattr(torch.Tensor, name, eval(new, ns)), torch.tensor([1.0, -2.0]))
    finally:
        if had is _UNSET:
            delattr(torch.Tensor, name)
        else:
            setattr(torch.Tensor, name, had)


# The machinery that calls a module, patched after capture so that a block class's calls return twice
# their value (a profiler's wrapper): on ``nn.Module`` itself, or on the block's class. Each was a stale
# graph, and a jit recompile under the patch traced the joint without it (make_fx calls modules
# through the ``__call__`` it kept at import).
CALL_MACHINERY = ("__call__", "_call_impl")


@pytest.mark.parametrize("owner", ["nn.Module", "the block's class"])
@pytest.mark.parametrize("name", CALL_MACHINERY)
@pytest.mark.parametrize("blocks", [1, 3], ids=["one block", "three twin blocks"])
def test_a_module_call_machinery_patched_after_capture_recompiles(name, owner, blocks):
    ns = _module("class Blk(torch.nn.Module):\n    def __init__(self):\n        super().__init__()\n"
                 "        self.lin = torch.nn.Linear(3, 3)\n    def forward(self, x):\n"
                 "        return torch.relu(self.lin(x)) + x\n")
    torch.manual_seed(0)
    model = torch.nn.Sequential(*(ns["Blk"]() for _ in range(blocks)), torch.nn.Linear(3, 2))
    holder = torch.nn.Module if owner == "nn.Module" else ns["Blk"]
    had = vars(holder).get(name, _UNSET)
    real = getattr(torch.nn.Module, name)

    def doubled(self, *args, **kwargs):
        out = real(self, *args, **kwargs)
        return out * 2 if isinstance(self, ns["Blk"]) else out
    try:
        _check(ns, model, lambda: setattr(holder, name, doubled), torch.randn(4, 3))
    finally:
        if had is _UNSET:
            delattr(holder, name)
        else:
            setattr(holder, name, had)


# A special method of the user's class, which the interpreter looks up on the type where no load names
# it, patched on the class after the capture: each was a stale graph.
SPECIAL_METHODS = {
    "__call__ of an object the code calls": ("class K:\n    def __call__(self, x):\n        return x * 2\nOBJ = K()",
                                             "OBJ(x)", "__call__", "lambda self, x: x * 3"),
    "__init__ of an object built in the trace": ("class K:\n    def __init__(self, x):\n        self.v = x * 2\n"
                                                 "def __init__(self, x):\n    self.v = x * 3",
                                                 "K(x).v", "__init__", "__init__"),
    "__getitem__ (obj[x])": ("class K:\n    def __getitem__(self, x):\n        return x * 2\nOBJ = K()",
                             "OBJ[x]", "__getitem__", "lambda self, x: x * 3"),
    "__add__ (obj + x)": ("class K:\n    def __add__(self, x):\n        return x * 2\nOBJ = K()",
                          "OBJ + x", "__add__", "lambda self, x: x * 3"),
    "__enter__ (with obj as s)": ("class K:\n    def __enter__(self):\n        return 2\n    def __exit__(self, *a):\n"
                                  "        return None\nOBJ = K()\ndef use(x):\n    with OBJ as s:\n        return x * s",
                                  "use(x)", "__enter__", "lambda self: 3"),
}


@pytest.mark.parametrize("case", SPECIAL_METHODS)
def test_a_special_method_patched_on_the_class_after_capture_recompiles(case):
    define, expr, name, new = SPECIAL_METHODS[case]
    ns = _module(f"{define}\n\ndef f(x):\n    return {expr}\n")
    _check(ns, ns["f"], lambda: setattr(ns["K"], name, eval(new, ns)), torch.tensor([1.0, -2.0]))


# What ``Function.apply`` looks up on the user's custom ``autograd.Function``, patched on the class after
# the capture (a kernel swapped in): the output or the gradient was a wrong number.
FUNCTION_METHODS = {
    "forward": ("Base", "forward", "staticmethod(lambda ctx, x: x * 3)"),
    "backward": ("Base", "backward", "staticmethod(lambda ctx, g: g * 5)"),
    "forward given by the subclass after capture": ("Fn", "forward", "staticmethod(lambda ctx, x: x * 3)"),
}


@pytest.mark.parametrize("call", ["Fn.apply(x)", "APPLY(x)"], ids=["Fn.apply", "APPLY = Fn.apply"])
@pytest.mark.parametrize("case", FUNCTION_METHODS)
def test_a_custom_functions_method_patched_after_capture_recompiles(case, call):
    owner, name, new = FUNCTION_METHODS[case]
    ns = _module("class Base(torch.autograd.Function):\n    @staticmethod\n    def forward(ctx, x):\n"
                 "        return x * 2\n    @staticmethod\n    def backward(ctx, g):\n        return g * 2\n"
                 f"class Fn(Base):\n    pass\nAPPLY = Fn.apply\n\ndef f(x):\n    return {call}.sum()\n")
    _check_gradients(ns["f"], lambda: setattr(ns[owner], name, eval(new)), torch.tensor([1.0, -2.0]))


def _check_gradients(f, change, x, match=None):
    """``f``'s output and gradient under ``jit`` and a staged capture equal eager's; after ``change()``
    (which changes eager's), ``jit`` recompiles to eager's and the staged step raises ``InputMismatchError``."""
    x.requires_grad_()

    def grads(fn):
        x.grad = None
        out = fn(x)
        out.backward()
        return out.detach(), x.grad.clone()
    jit, staged = aotgrad.jit(f), aotgrad.capture(f, x).compile()
    before = grads(f)
    for fn in (jit, staged):
        torch.testing.assert_close(grads(fn), before)
    change()
    expected = grads(f)
    assert not all(map(torch.equal, expected, before)), "the change must change eager's result"
    torch.testing.assert_close(grads(jit), expected)
    assert len(jit.entries) == 2
    with pytest.raises(errors.InputMismatchError, match=match):
        staged(x)


@pytest.mark.parametrize("copy", ["copy.copy", "copy.deepcopy"])
def test_a_copy_of_a_users_object_made_in_the_trace_runs_and_is_read(copy):
    """``copy.copy(CFG)`` caches ``__slotnames__`` on the class (``copyreg``), a write the capture refused;
    eager's first call makes the same. The copied value is read where the object holds it."""
    ns = _module(f"import copy\nclass Cfg:\n    def __init__(self):\n        self.s = 2.0\nCFG = Cfg()\n\n"
                 f"def f(x):\n    return x * {copy}(CFG).s\n")
    _check(ns, ns["f"], lambda: setattr(ns["CFG"], "s", 3.0), torch.tensor([1.0, -2.0]))


@pytest.mark.parametrize("called", ["itself", "from the user's function"])
def test_code_exec_d_with_globals_of_its_own_reads_them(called):
    """``exec(src, {"torch": torch, "SCALE": 2.0})``: globals with no module name, the file ``<string>``.
    It was classed as generated code and its globals went unread: a stale graph."""
    g = {"torch": torch, "SCALE": 2.0}
    exec("def f(x):\n    return x * SCALE\n", g)
    fn = g["f"] if called == "itself" else _module("def f(x):\n    return G['f'](x) + 1\n")["f"]
    if called != "itself":
        fn.__globals__["G"] = g
    _check(g, fn, lambda: g.__setitem__("SCALE", 3.0), torch.tensor([1.0, -2.0]))


# A module the user's code imports inside the function (to break an import cycle, to import lazily):
# the module ``sys.modules`` holds, and what the code reads of it, as from a global naming it. Each was
# a stale graph before. (the import and the read, the change: an attribute of the module set, or
# another module put in ``sys.modules`` under its name)
IMPORTS = {
    "import m; m.K": ("import {m}\n    return x * {m}.K", "set"),
    "from m import K": ("from {m} import K\n    return x * K", "set"),
    "import m as alias": ("import {m} as alias\n    return x * alias.K", "set"),
    "from a package, relatively (from . import m)": ("from . import {leaf}\n    return x * {leaf}.K", "set"),
    "a module swapped in sys.modules": ("import {m}\n    return x * {m}.K", "swap"),
}


@pytest.mark.parametrize("case", IMPORTS)
def test_a_module_imported_inside_the_function_is_read(case):
    body, change = IMPORTS[case]
    n = next(_n)
    pkg, leaf = f"_read_channels_pkg{n}", "inner"
    package = types.ModuleType(pkg)
    package.__path__ = []
    inner = types.ModuleType(f"{pkg}.{leaf}")
    inner.K = 2.0
    package.inner = inner
    sys.modules[pkg], sys.modules[inner.__name__] = package, inner
    ns = _module(f"def f(x):\n    {body.format(m=inner.__name__, leaf=leaf)}\n")
    ns["__package__"] = pkg
    other = types.ModuleType(inner.__name__)
    other.K = 3.0

    def swap():
        if change == "set":
            inner.K = 3.0
        else:
            sys.modules[inner.__name__] = package.inner = other
    try:
        _check(ns, ns["f"], swap, torch.tensor([1.0, -2.0]))
    finally:
        sys.modules.pop(pkg), sys.modules.pop(inner.__name__)


def test_a_torch_function_an_installed_library_calls_rebound_after_capture_recompiles():
    """HF's attention calls ``torch.nn.functional.scaled_dot_product_attention`` from its own module: a
    patch of it after the first call (a kernel swapped in) was not seen there, a stale graph."""
    pytest.importorskip("transformers")
    import torch.nn.functional as F
    from tests.models import zoo
    model, batch = zoo._hf("LlamaConfig", "LlamaForCausalLM", ("input_ids", "labels"), zoo.batch_lm,
                           num_hidden_layers=1, hidden_size=32, intermediate_size=64, num_attention_heads=4,
                           num_key_value_heads=2, vocab_size=zoo.VOCAB, max_position_embeddings=16)
    step = aotgrad.jit(model)
    before = model(*batch)
    torch.testing.assert_close(step(*batch), before)
    sdpa = F.scaled_dot_product_attention
    F.scaled_dot_product_attention = lambda *a, **k: sdpa(*a, **k) * 2
    try:
        expected = model(*batch)
        assert not torch.allclose(expected, before), "the patch must change eager's result"
        torch.testing.assert_close(step(*batch), expected)
        assert len(step.entries) == 2, [e.reason for e in step.entries]
    finally:
        F.scaled_dot_product_attention = sdpa


# A function torch's own module calls from ``torch.nn.functional`` (``nn.Linear.forward`` calls
# ``F.linear``), rebound after the capture (a kernel swapped in): each was a stale graph.
NN_FUNCTIONS = {"linear": lambda: torch.nn.Linear(3, 3), "relu": torch.nn.ReLU, "gelu": torch.nn.GELU,
                "layer_norm": lambda: torch.nn.LayerNorm(3), "softmax": lambda: torch.nn.Softmax(-1)}


@pytest.mark.parametrize("name", NN_FUNCTIONS)
def test_a_functional_a_torch_module_calls_rebound_after_capture_recompiles(name):
    import torch.nn.functional as F
    torch.manual_seed(0)
    real = getattr(F, name)
    try:
        _check({}, NN_FUNCTIONS[name](), lambda: setattr(F, name, lambda *a, **k: real(*a, **k) * 2),
               torch.randn(2, 3))
    finally:
        setattr(F, name, real)


def test_a_library_function_is_read_by_identity_not_followed():
    """``F.relu``, ``torch.ops.aten.mul``, ``logging.Logger``: one read each, of the name in its module;
    nothing inside (its code, cells, defaults, attributes) is read."""
    ns = _module("import logging\nimport torch.nn.functional as F\n\n"
                 "def f(x):\n    return F.relu(torch.ops.aten.mul.Tensor(x, x)) * (logging.Logger is not None)\n")
    f, x = aotgrad.jit(ns["f"]), torch.tensor([1.0, -2.0])
    torch.testing.assert_close(f(x), ns["f"](x))
    reads = [r for r in aotgrad.capture(ns["f"], x).state.reads
             if any(s in r.source for s in ("relu", "Logger", "aten.mul"))
             and not r.source.startswith(("torch.Tensor.", "torch._C.TensorBase."))]   # (a tensor's relu)
    assert sorted(r.source for r in reads) == ["F.relu", "logging.Logger", "torch.ops.aten.mul"], reads
    assert all(r.kind == "id" for r in reads)


def test_a_switch_the_trace_did_not_read_recompiles_nothing():
    ns = _module("def f(x):\n    return x * 2.0\n")
    f, x = aotgrad.jit(ns["f"]), torch.tensor([1.0])
    f(x)
    was = torch.are_deterministic_algorithms_enabled()
    try:
        torch.use_deterministic_algorithms(not was)
        f(x)
    finally:
        torch.use_deterministic_algorithms(was)
    assert len(f.entries) == 1


# Reads a C function or a cache makes: (setup, the read, the change)
REFLECTIVE = {
    "object.__getattribute__ of a list item": (
        "class O: pass\no = O(); o.k = 2.0\nL = [o]", "object.__getattribute__(L[0], 'k')", "o.k = 3.0"),
    "vars(vars(x))": ("class O: pass\no = O(); o.k = 2.0\np = O(); p.o = o", "vars(vars(p)['o'])['k']", "o.k = 3.0"),
    "inspect.getattr_static": ("class O: pass\no = O(); o.k = 2.0", "inspect.getattr_static(o, 'k')", "o.k = 3.0"),
    "operator.attrgetter": ("class O: pass\no = O(); o.k = 2.0\nAG = operator.attrgetter('k')", "AG(o)", "o.k = 3.0"),
    "lru_cache hit": ("K = [2.0]\n@functools.lru_cache\ndef scale(n):\n    return K[0] * n\nscale(1)", "scale(1)",
                      "K[0] = 3.0; scale.cache_clear()"),
    "__slots__ objects in a list": ("class S:\n    __slots__ = ('k',)\n    def __init__(s):\n        s.k = 2.0\nL = [S()]",
                                    "[s.k for s in L][0]", "L[0].k = 3.0"),
    "ContextVar": ("V = contextvars.ContextVar('v', default=2.0)", "V.get()", "V.set(3.0)"),
    "threading.local": ("T = threading.local(); T.k = 2.0", "T.k", "T.k = 3.0"),
    "sys.modules[name]": ("import sys\nCFG = type(sys)('_channels_cfg'); CFG.k = 2.0\nsys.modules[CFG.__name__] = CFG",
                          "sys.modules['_channels_cfg'].k", "CFG.k = 3.0"),
    "importlib.import_module": ("import importlib, sys\nCFG = type(sys)('_channels_cfg2'); CFG.k = 2.0\n"
                                "sys.modules[CFG.__name__] = CFG", "importlib.import_module('_channels_cfg2').k",
                                "CFG.k = 3.0"),
}


@pytest.mark.parametrize("name", list(REFLECTIVE))
def test_reflective_read_changed(name):
    setup, read, change = REFLECTIVE[name]
    ns = _module(f"{setup}\n\ndef f(x):\n    return x * {read}\n\ndef change():\n    {change}\n")
    _check(ns, ns["f"], ns["change"], torch.tensor([1.0, -2.0]))


# A name absent when captured, defined after: (the holder, the expression reaching it ``{h}``, the change)
ABSENT_HOLDERS = {
    "user module": ("import sys\nM = type(sys)('_absent_cfg'); sys.modules[M.__name__] = M", "M", "M.k = 3.0"),
    "user class": ("class K: pass", "K", "K.k = 3.0"),
    "user class, set on its base": ("class B: pass\nclass K(B): pass", "K", "B.k = 3.0"),
    "user object": ("class O: pass\nOBJ = O()", "OBJ", "OBJ.k = 3.0"),
    "types.SimpleNamespace": ("import types\nNS = types.SimpleNamespace()", "NS", "NS.k = 3.0"),
    "namespace in an attribute": ("import types\nclass O: pass\nOBJ = O(); OBJ.cfg = types.SimpleNamespace()",
                                  "OBJ.cfg", "OBJ.cfg.k = 3.0"),
    # reached by value (a container's item): no path leads to its attributes
    "object in a list": ("class O: pass\nL = [O()]", "L[0]", "L[0].k = 3.0"),
    "object in a dict": ("class O: pass\nD = {'o': O()}", "D['o']", "D['o'].k = 3.0"),
    "object in a list, set on its class": ("class O: pass\nL = [O()]", "L[0]", "O.k = 3.0"),
    "object in a list an object holds": ("class O: pass\nclass H: pass\nOBJ = H(); OBJ.items = [O()]", "OBJ.items[0]",
                                         "OBJ.items[0].k = 3.0"),
    "object in a dict, by a computed key": ("class O: pass\nD = {'a': O()}\nKEY = 'a'", "D[KEY]", "D['a'].k = 3.0"),
}
ABSENT_READS = {"getattr with a default": "s = getattr({h}, 'k', 2.0)",
                "hasattr": "s = {h}.k if hasattr({h}, 'k') else 2.0",
                "try/except AttributeError": "try:\n        s = {h}.k\n    except AttributeError:\n        s = 2.0",
                "try/except Exception": "try:\n        s = float({h}.k)\n    except Exception:\n        s = 2.0",
                "contextlib.suppress": "s = 2.0\n    with contextlib.suppress(AttributeError):\n        s = {h}.k"}


@pytest.mark.parametrize("holder,read", list(itertools.product(ABSENT_HOLDERS, ABSENT_READS)))
def test_a_name_absent_when_captured_defined_after(holder, read):
    """The absence is read where the name could be defined: a user module's dict, a user class's own
    dict and its user bases', an object's own dict (a library's plain object holding the user's values,
    ``types.SimpleNamespace``, too). Each of these ran the old graph before."""
    setup, h, change = ABSENT_HOLDERS[holder]
    ns = _module(f"{setup}\n\ndef f(x):\n    {ABSENT_READS[read].format(h=h)}\n    return x * s\n\n"
                 f"def change():\n    {change}\n")
    _check(ns, ns["f"], ns["change"], torch.tensor([1.0, -2.0]))


@pytest.mark.parametrize("holder", ["list", "dict"])
def test_a_class_attribute_read_through_an_object_in_a_container(holder):
    """An object reached by value is read at the names the code loads that its class holds, not only
    at those it holds itself."""
    make = {"list": ("L = [O()]", "L[0]"), "dict": ("D = {'o': O()}", "D['o']")}[holder]
    ns = _module(f"class O:\n    k = 2.0\n{make[0]}\n\ndef f(x):\n    return x * {make[1]}.k\n\n"
                 "def change():\n    O.k = 3.0\n")
    _check(ns, ns["f"], ns["change"], torch.tensor([1.0, -2.0]))


# A module found in ``sys.modules`` by a key computed at run time: which module, and what is read of it,
# no guard can follow (``sys.modules["m"]`` with a constant is read by its name, as an import is).
# Before: trusted, a stale graph after the module's K changed.
SYS_MODULES = ["sys.modules[__name__].K", "sys.modules[NAME].K", "getattr(sys.modules[__name__], 'K')",
               "vars(sys.modules[NAME])['K']", "sys.modules.get(NAME).K", "(M := sys.modules)[NAME].K"]


@pytest.mark.parametrize("expr", SYS_MODULES)
def test_a_module_found_in_sys_modules_by_a_computed_key_is_refused_with_the_users_line(expr):
    ns = _module(f"import sys\nK = 2.0\n\ndef f(x):\n    return x * {expr}\n")
    ns["NAME"] = ns["__name__"]
    x = torch.tensor([1.0, -2.0])
    for compile_ in (lambda: aotgrad.jit(ns["f"])(x), lambda: aotgrad.capture(ns["f"], x)):
        with pytest.raises(errors.UnsupportedError, match=r"reads `sys.modules` by a key computed") as info:
            compile_()
        assert info.value.user_line and "in f" in info.value.user_line


@pytest.mark.parametrize("text", ["eval('self.k')", "(exec('r = self.k', globals(), d) or d['r'])",
                                  "(time.time() % 7)", "(time.perf_counter() % 7)"])
def test_evaluated_text_or_a_clock_is_refused_with_the_users_line(text):
    ns = _module(f"""
import time

class M(torch.nn.Module):
    def __init__(s):
        super().__init__()
        s.k = 2.0

    def forward(self, x):
        d = {{'self': self}}
        return x * {text}
""")
    m, x = ns["M"](), torch.tensor([1.0])
    for compile_ in (lambda: aotgrad.jit(m)(x), lambda: aotgrad.capture(m, x)):
        with pytest.raises(errors.UnsupportedError, match=r"calls `(builtins.eval|builtins.exec|time.time|"
                                                         r"time.perf_counter)`") as info:
            compile_()
        assert info.value.user_line and "forward" in info.value.user_line


# The file system, read through the standard library's layers (``Path.exists`` asks ``Path.stat``, which
# asks ``os.stat``): a graph would hold the first answer. ``os.path.exists`` was refused; these were stale.
FILE_SYSTEM = ["P.exists()", "P.is_file()", "P.stat().st_size > 0", "bool(glob.glob(str(P)))",
               "bool(shutil.which('sh'))", "P.read_text() == '1'"]


@pytest.mark.parametrize("expr", FILE_SYSTEM)
def test_the_file_system_read_through_the_standard_library_is_refused(expr, tmp_path):
    ns = _module(f"import glob, shutil\n\ndef f(x):\n    return x * 2 if {expr} else x * 3\n")
    ns["P"] = tmp_path / "flag"
    ns["P"].write_text("1")
    x = torch.tensor([1.0])
    for compile_ in (lambda: aotgrad.jit(ns["f"])(x), lambda: aotgrad.capture(ns["f"], x)):
        with pytest.raises(errors.UnsupportedError, match=r"calls `(posix|nt|io|_io)\.") as info:
            compile_()
        assert info.value.user_line and "in f" in info.value.user_line


def test_reordered_module_dict_runs_in_the_new_order():
    ns = _module("""
class M(torch.nn.Module):
    def __init__(s):
        super().__init__()
        s.d = torch.nn.ModuleDict({'a': torch.nn.Linear(2, 2), 'b': torch.nn.Tanh()})

    def forward(self, x):
        for v in self.d.values():
            x = v(x)
        return x
""")
    torch.manual_seed(0)
    m = ns["M"]()

    def change():
        d = m.d._modules
        d["a"] = d.pop("a")
    _check(ns, m, change, torch.tensor([[1.0, -2.0]]))


def test_a_hooked_modules_mode_is_guarded():
    """A library forward pre-hook (spectral norm's power iteration, here a stand-in) reads the
    module's ``training``: switching to ``eval()`` recompiles."""
    torch.manual_seed(0)
    m = torch.nn.Linear(2, 2)
    m.register_forward_pre_hook(_scale_in_training)
    _check({}, m, m.eval, torch.tensor([[1.0, -2.0]]))


def _scale_in_training(module, args):
    return (args[0] * (2.0 if module.training else 3.0),)


def test_too_deep_a_container_is_refused():
    ns = _module("H = [2.0]\nfor _ in range(12):\n    H = [H]\n\ndef f(x):\n    v = H\n    while isinstance(v, list):\n"
                 "        v = v[0]\n    return x * v\n")
    with pytest.raises(errors.UnsupportedError, match="nested too deep") as info:
        aotgrad.jit(ns["f"])(torch.tensor([1.0]))
    assert info.value.user_line


def _deterministic_in_python():
    return torch.are_deterministic_algorithms_enabled()


def test_an_aten_ops_dispatch_is_watched_for_switch_reads_alone(monkeypatch):
    """While an ATen op dispatches under the read recording, a C profile function notes torch's switch
    getters alone (what a decomposition reads decides the graph); the recording's own watch, a Python
    event per call, is back after the op, also when the op raises."""
    from aotgrad.guards import reads
    if reads._watch_switches is None:
        pytest.skip("aotgrad.guards._tags is not built")
    # (pytest-xdist's threads would make the recording watch for other threads' writes, which keeps
    # the Python watch inside ops: tests/core/test_thread_writes.py runs that way)
    monkeypatch.setattr(threading, "active_count", lambda: 1)
    with reads.record() as rec:
        watch = sys.getprofile()
        with reads.switches_only(watch):
            assert sys.getprofile() is not watch
            _deterministic_in_python()      # Python torch's dispatch would run: not an event now
            torch.backends.mkldnn.is_available()
            # settings read unseen inside an op (runtime.modes: a CUDA op's numerics check) put the
            # switch watch back after them: it was a C profile function's state, not callable
            assert modes.numerics() == modes.numerics()
            torch.get_num_interop_threads()
        assert sys.getprofile() is watch
        with pytest.raises(ZeroDivisionError), reads.switches_only(watch):
            torch.get_num_threads()
            1 / 0
        assert sys.getprofile() is watch
    assert _deterministic_in_python.__code__ not in rec.kinds
    assert "_get_cudnn_allow_tf32" not in rec.switches     # (the settings read unseen)
    assert {"_get_deterministic_algorithms", "get_num_threads", "get_num_interop_threads"} <= set(rec.switches)
    assert rec.switches["_get_deterministic_algorithms"][1] is torch.are_deterministic_algorithms_enabled()


@pytest.mark.parametrize("rnn", ["LSTM", "GRU"])
def test_a_switch_read_inside_an_rnn_ops_dispatch_guards_the_graph(rnn):
    """nn.LSTM's op decomposes in torch's Python, which reads oneDNN's switch: the graph is guarded on
    it (the user's value, not the one the capture sets while the op traces)."""
    m, x = getattr(torch.nn, rnn)(4, 5), torch.randn(3, 2, 4)
    f = aotgrad.jit(m)
    f(x)
    staged = aotgrad.capture(m, x).compile()
    was = torch.backends.mkldnn.enabled
    try:
        torch.backends.mkldnn.enabled = not was
        f(x)
        with pytest.raises(errors.InputMismatchError):
            staged(x)
    finally:
        torch.backends.mkldnn.enabled = was
    assert len(f.entries) == 2
    staged(x)


# Where a custom op's fake kernel finds the number of rows it returns: (the state, how the kernels read it,
# the change). Nothing the traced function reaches leads to the kernel (torch's registry holds it): its
# own frame's globals and free variables are what the guards follow.
FAKE_KERNEL_STATE = {
    "global": ("ROWS = 2", "ROWS", "global ROWS\n    ROWS = 3"),
    "closed-over dict": ("def _state():\n    return {'rows': 2}\nSTATE = _state()", "state['rows']",
                         "STATE['rows'] = 3"),
    "closed-over list": ("def _state():\n    return [2]\nSTATE = _state()", "state[0] * state[-1] // 2",
                         "STATE[0] = 3"),      # (two loads: the list is held once)
    "closed-over object": ("class O: pass\nSTATE = O(); STATE.rows = 2", "state.rows", "STATE.rows = 3"),
}


@pytest.mark.parametrize("where", list(FAKE_KERNEL_STATE))
def test_a_custom_ops_fake_kernel_is_watched_as_user_code(where):
    """A custom op's fake kernel is the user's Python, run inside the op's dispatch: its reads (a
    value deciding the output's size) guard the graph, where an ATen op's dispatch is watched for
    torch's switches alone."""
    define, read, change = FAKE_KERNEL_STATE[where]
    ns = _module(
        f"{define}\n\n"
        "def _make(state):\n"
        f"    @torch.library.custom_op('aotgrad_test::first_rows_{next(_n)}', mutates_args=())\n"
        f"    def first_rows(x: torch.Tensor) -> torch.Tensor:\n        return x[:{read}] * 2\n\n"
        "    @first_rows.register_fake\n"
        f"    def _(x):\n        return x.new_empty(({read}, *x.shape[1:]))\n"
        "    return first_rows\n\n"
        f"OP = _make({'STATE' if where != 'global' else 'None'})\n\n"
        "def f(x):\n    return OP(x) + 1\n\n"
        f"def change():\n    {change}\n")
    x = torch.arange(8.0).reshape(4, 2)
    _check(ns, ns["f"], ns["change"], x)
    state = ns.get("STATE", object())
    held = [r for r in aotgrad.capture(ns["f"], x).state.reads if getattr(r.where, "value", None) is state]
    assert len(held) == (where == "closed-over list")


# A custom op's autograd formula, registered again after the capture (a notebook cell re-run with the
# formula fixed): the joint graph holds the one it traced, so the gradient was a wrong number.
CUSTOM_OP_CHANGES = {
    "backward": "SCALE.register_autograd(lambda ctx, g: g * 100)",
    "setup_context": "SCALE.register_autograd(lambda ctx, g: g * ctx.k, "
                     "setup_context=lambda ctx, inputs, output: setattr(ctx, 'k', 7.0))",
}
CUSTOM_OP_CALLS = {
    "the op's object": "SCALE(x)",
    "torch.ops": "getattr(getattr(torch.ops, NS), 'scale')(x)",
    "two twin blocks": "BLOCKS(x)",
}


@pytest.mark.parametrize("call", CUSTOM_OP_CALLS)
@pytest.mark.parametrize("change", CUSTOM_OP_CHANGES)
def test_a_custom_ops_autograd_registered_again_after_capture_recompiles(change, call):
    ns_name = f"read_channels_op{next(_n)}"
    ns = _module(f"NS = {ns_name!r}\n"
                 f"@torch.library.custom_op('{ns_name}::scale', mutates_args=())\n"
                 "def SCALE(x: torch.Tensor) -> torch.Tensor:\n    return x * 2\n"
                 "@SCALE.register_fake\ndef _(x):\n    return torch.empty_like(x)\n"
                 "SCALE.register_autograd(lambda ctx, g: g * 2)\n"
                 "class Block(torch.nn.Module):\n    def forward(self, x):\n        return SCALE(x).sin()\n"
                 "BLOCKS = torch.nn.Sequential(Block(), Block())\n\n"
                 f"def f(x):\n    return {CUSTOM_OP_CALLS[call]}.sum()\n"
                 f"def change():\n    {CUSTOM_OP_CHANGES[change]}\n")
    _check_gradients(ns["f"], ns["change"], torch.tensor([0.5, -0.25]), match="backward|setup_context")


def test_a_users_autograd_formula_held_by_the_dispatcher_alone_is_refused():
    """``torch.library.register_autograd`` on a ``torch.library.Library`` op gives the formula to the
    dispatcher, where no guard can look: refused at capture, naming the op and the user's line."""
    ns_name = f"read_channels_lib{next(_n)}"
    ns = _module(f"LIB = torch.library.Library({ns_name!r}, 'DEF')\nLIB.define('scale(Tensor x) -> Tensor')\n"
                 "LIB.impl('scale', lambda x: x * 2, 'CompositeExplicitAutograd')\n"
                 "def backward(ctx, g):\n    return g * 2\n"
                 f"torch.library.register_autograd('{ns_name}::scale', backward, lib=LIB)\n\n"
                 f"def f(x):\n    return torch.ops.{ns_name}.scale(x).sum()\n")
    x = torch.tensor([0.5, -0.25], requires_grad=True)
    for compile_ in (lambda: aotgrad.capture(ns["f"], x), lambda: aotgrad.jit(ns["f"])(x)):
        with pytest.raises(errors.UnsupportedError, match=f"{ns_name}::scale.*backward.*custom_op") as e:
            compile_()
        assert "in f" in str(e.value)


def test_precision_set_by_the_per_backend_api_is_no_refusal():
    """With the per-backend setting mixed with the legacy one, torch's legacy getter raises: every capture
    read it for the settings a call runs under, and every program was refused. Now a capture runs, and
    a graph that did not read them runs under the caller's, as eager's ops do."""
    was = torch.backends.cuda.matmul.fp32_precision
    try:
        torch.backends.cuda.matmul.fp32_precision = "tf32"
        f = lambda x: (x @ x.T).tanh()     # noqa: E731
        x = torch.randn(3, 3)
        step = aotgrad.jit(f)
        assert torch.equal(step(x), f(x))
        staged = aotgrad.capture(f, x).compile()
        torch.backends.cuda.matmul.fp32_precision = "ieee"
        assert torch.equal(step(x), f(x))
        assert torch.equal(staged(x), f(x))
    finally:
        torch.backends.cuda.matmul.fp32_precision = was
