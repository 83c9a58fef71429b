"""Every kind of Python read the tracer sees, from every place code runs inside a trace: changed after
the first call, ``jit`` recompiles (the result is eager's, ``explain`` names the read) and a
``capture().compile()`` step raises ``InputMismatchError`` naming it, before anything runs.

Kinds: an attribute of the module, a class attribute (also through ``type(self)``,
``self.__class__``, the class's ``__dict__`` and ``__mro__``, ``super``), a global, a dict item of a
global, an item of a global list, another module's state, a module's ``training`` flag, an attribute
of an object argument, a ``__slots__`` member, a closure cell of the function (read in nested code
too), and every way of naming an attribute as a value (``getattr``, ``object.__getattribute__``,
``inspect.getattr_static``, ``operator.attrgetter``, a dict's ``get``, ``vars``, ``hasattr``), and an
object's attribute read through a variable that holds it (a loop's, a comprehension's) or through
what a call returned.
Locations: the function itself, a list comprehension and a generator expression (their own code
objects), a lambda, a nested function, ``functools.partial``, a property, the class's
``__getattr__``, and the function itself where nested code closes over ``self`` (then a cell of its
frame). Also: state read by the module's own ``named_parameters``, by an installed library's code,
per thread (``threading.local``) or per context (``ContextVar``), and ``functools.cached_property``;
the process environment (``os.environ[...]``, ``.get``, ``in``, ``os.getenv``)."""
import collections
import contextvars
import dataclasses
import functools
import inspect
import operator
import os
import re
import sys
import threading
import types

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import aotgrad
from aotgrad import errors

CONFIG = {"scale": 2.0}
SHIFT = 1.0


class Knob:
    def __init__(self):
        self.k = 3.0

    def apply(self, t):
        return t * self.k


READ = {"attr": "self.k", "class_attr": "self.ck", "global": "SHIFT", "global_item": 'CONFIG["scale"]',
        "training": "(1.0 if self.training else 0.5)",
        # the class reached through the object: a call of ``type`` and the ``__class__`` attribute
        "type_of_self": "type(self).ck", "class_of_self": "self.__class__.ck",
        # the attribute named to a builtin, or read through the object's dict
        "getattr": 'getattr(self, "k")', "getattr_default": 'getattr(self, "k", 0.5)',
        "getattr_computed": "getattr(self, NAMES[0])", "own_dict": 'self.__dict__["k"]', "vars": 'vars(self)["k"]',
        "hasattr": '(2.0 if hasattr(self, "extra") else 0.5)', "namespace": "NS.k",
        # reads through the object model itself, and getters that name the attribute as a value
        "object_getattribute": 'object.__getattribute__(self, "k")', "own_getattribute": 'self.__getattribute__("k")',
        "getattr_static": 'inspect.getattr_static(self, "k")', "dict_get": 'self.__dict__.get("k", 0.5)',
        "vars_get": 'vars(self).get("k", 0.5)', "attrgetter": 'operator.attrgetter("k")(self)',
        "attrgetter_held": "GET_K(self)",
        # the class's value, named at run time or through ``type``'s own getter; a class attribute set later
        "class_computed": "getattr(self, CLASS_NAMES[0])", "type_getattribute": 'type.__getattribute__(type(self), "ck")',
        "hasattr_class": '(2.0 if hasattr(self, "class_extra") else 0.5)',
        "class_dict": 'type(self).__dict__["ck"]', "mro": "type(self).__mro__[0].ck",
        "super_explicit": "super(Made, self).bk", "slots": "SLOTS.k",
        "list_item": "SCALES[1]", "other_module": "HELPERS.FLAG",
        # the process environment: one variable by name, and through calls that read all of it
        "environ_get": '(2.0 if os.environ.get("AOTGRAD_TEST_READ") == "1" else 0.5)',
        "environ_in": '(2.0 if "AOTGRAD_TEST_READ" in os.environ else 0.5)',
        "getenv": '(2.0 if os.getenv("AOTGRAD_TEST_READ") else 0.5)',
        # an object's attribute read through a variable holding it (a loop's, a comprehension's), or
        # through what a call returned: the object is reached by value, its attributes by name
        "loop_variable": "sum(o.w for o in OBJS)", "attr_items": "[o.w for o in self.objs][0]",
        "call_result": "self.first().w", "dict_values": "[v.w for v in TABLE.values()][0]",
        "namespace_held": "[n.k for n in (NS,)][0]", "getattr_held": '[getattr(o, "w") for o in OBJS][0]',
        # a user dataclass read by library code (every field), a namedtuple held in a global
        "dataclass_fields": 'dataclasses.asdict(self.dc)["dcw"]', "namedtuple": "PAIR.a"}
NAMES, CLASS_NAMES = ["k"], ["ck"]


class Based(nn.Module):
    bk = 4.0


class Slotted:
    __slots__ = ("k",)

    def __init__(self):
        self.k = 1.5


class Obj:
    def __init__(self, w):
        self.w = w


@dataclasses.dataclass
class _DC:
    dcw: float = 1.25


Pair = collections.namedtuple("Pair", "a b")
DC, PAIR = _DC(), Pair(1.75, 0.5)
SLOTS = Slotted()
OBJS, TABLE = [Obj(1.5)], {"a": Obj(2.5)}
SCALES = [1.0, 2.5]
HELPERS = types.ModuleType("read_location_helpers")     # another (user) module's state
HELPERS.FLAG = 1.5
GET_K = operator.attrgetter("k")
NS = types.SimpleNamespace(k=1.5)     # a library class's instance holding the user's values

# The read written out at each place (not through a helper: a helper's own frame would be recorded).
AT = {
    "function": "h * {r}",
    "listcomp": "sum([t * {r} for t in (h, h)])",
    "genexpr": "sum(t * {r} for t in (h, h))",
    "lambda": "(lambda t: t * {r})(h)",
    "nested": "_nested(self, h)",
    "partial": "functools.partial(lambda mm, t: t * {rm}, self)(h)",
    "property": "h * self.prop",
    # ``self`` closed over by nested code is a cell of forward's frame: read there with LOAD_DEREF.
    "beside_closure": "(lambda: self) and h * {r}",
    "getattr_hook": "h * self.dyn",         # the class's own ``__getattr__`` makes the read
}


_SELF = re.compile(r"\bself\b")


def _module(kind, where):
    """A module class whose forward makes the read at ``where``; its code is compiled from this
    file's globals, so it is user code of this module."""
    r = READ[kind]
    src = (f"class Made(Based):\n"
           f"    ck = 5.0\n"
           f"    def __init__(self):\n"
           f"        super().__init__()\n"
           f"        self.k, self.fc, self.objs, self.dc = 2.0, nn.Linear(3, 3), [Obj(3.5)], DC\n"
           f"    def first(self):\n"
           f"        return self.objs[0]\n"
           f"    @property\n"
           f"    def prop(self):\n"
           f"        return {r}\n"
           f"    def __getattr__(self, name):\n"
           f"        if name == 'dyn':\n"
           f"            return {r}\n"
           f"        return nn.Module.__getattr__(self, name)\n"
           f"    def forward(self, x):\n"
           f"        h = self.fc(x)\n"
           f"        def _nested(self, h):\n"
           f"            def inner(t):\n"
           f"                return t * {r}\n"
           f"            return inner(h)\n"
           f"        return F.relu({AT[where].format(r=r, rm=_SELF.sub('mm', r))})\n")
    exec(compile(src, __file__, "exec"), globals())      # its globals are this module's
    return globals()["Made"]()


def _change(m, kind):
    global SHIFT, PAIR
    if kind in ("attr", "getattr", "getattr_default", "getattr_computed", "own_dict", "vars", "object_getattribute",
                "own_getattribute", "getattr_static", "dict_get", "vars_get", "attrgetter", "attrgetter_held"):
        m.k = -m.k
    elif kind == "hasattr":
        m.extra = 1
    elif kind == "hasattr_class":
        type(m).class_extra = 1
    elif kind == "namespace":
        NS.k = -NS.k
    elif kind == "slots":
        SLOTS.k = -SLOTS.k
    elif kind == "list_item":
        SCALES[1] = -SCALES[1]
    elif kind == "other_module":
        HELPERS.FLAG = -HELPERS.FLAG
    elif kind == "super_explicit":
        Based.bk = -Based.bk
    elif kind in ("class_attr", "type_of_self", "class_of_self", "class_computed", "type_getattribute",
                  "class_dict", "mro"):
        type(m).ck = -type(m).ck
    elif kind == "global":
        SHIFT = -SHIFT
    elif kind == "global_item":
        CONFIG["scale"] = -CONFIG["scale"]
    elif kind == "training":
        m.train(not m.training)
    elif kind in ("loop_variable", "getattr_held"):
        OBJS[0].w = -OBJS[0].w
    elif kind in ("attr_items", "call_result"):
        m.objs[0].w = -m.objs[0].w
    elif kind == "dict_values":
        TABLE["a"].w = -TABLE["a"].w
    elif kind == "namespace_held":
        NS.k = -NS.k
    elif kind == "dataclass_fields":
        DC.dcw = -DC.dcw
    elif kind == "namedtuple":
        PAIR = Pair(-PAIR.a, PAIR.b)
    elif kind in ("environ_get", "environ_in", "getenv"):
        os.environ["AOTGRAD_TEST_READ"] = "1"


KINDS = tuple(READ)
WHERE = tuple(AT)


@pytest.fixture(autouse=True)
def _restore():
    global SHIFT, PAIR
    saved, shift, ns, slots, bk, scales, flag = dict(CONFIG), SHIFT, NS.k, SLOTS.k, Based.bk, list(SCALES), HELPERS.FLAG
    held = OBJS[0].w, TABLE["a"].w, DC.dcw, PAIR
    os.environ.pop("AOTGRAD_TEST_READ", None)
    yield
    os.environ.pop("AOTGRAD_TEST_READ", None)
    NS.k, SLOTS.k, Based.bk, SCALES[:], HELPERS.FLAG = ns, slots, bk, scales, flag
    OBJS[0].w, TABLE["a"].w, DC.dcw, PAIR = held
    CONFIG.clear()
    CONFIG.update(saved)
    SHIFT = shift


@pytest.mark.parametrize("where", WHERE)
@pytest.mark.parametrize("kind", KINDS)
def test_a_changed_read_recompiles_or_is_refused(kind, where):
    torch.manual_seed(0)
    m, x = _module(kind, where), torch.randn(4, 3)
    step, captured = aotgrad.jit(m), aotgrad.capture(m, x).compile()
    assert torch.equal(step(x), m(x))
    _change(m, kind)
    assert torch.equal(step(x), m(x)), f"{kind} read in {where}: a stale graph"
    assert len(step.entries) == 2, f"{kind} read in {where}: not guarded"
    with pytest.raises(errors.InputMismatchError):
        captured(x)


def test_an_object_arguments_attribute_read_in_a_generator_is_guarded():
    knob = Knob()

    def f(x, knob):
        return sum(knob.apply(t) for t in (x, x * 2))
    x = torch.randn(3)
    step = aotgrad.jit(f)
    step(x, knob)
    knob.k = 7.0
    assert torch.equal(step(x, knob), f(x, knob))
    assert "k" in str(aotgrad.explain(step))


# A closure cell of the traced function, read where the function reads it: nested code closes over the
# same cell (a lambda, a comprehension, an inner function), so each such load reads the function's cell.
CELL_AT = {
    "function": "x * box[0]",
    "listcomp": "sum([t * box[0] for t in (x, x)])",
    "genexpr": "sum(t * box[0] for t in (x, x))",
    "lambda": "(lambda t: t * box[0])(x)",
    "nested": "_inner(x)",
    "lambda_in_lambda": "(lambda t: (lambda u: u * box[0])(t))(x)",
}


@pytest.mark.parametrize("where", CELL_AT)
def test_a_changed_closure_cell_recompiles_or_is_refused(where):
    src = (f"def _factory():\n"
           f"    box = [2.0]\n"
           f"    def step(x):\n"
           f"        def _inner(t):\n"
           f"            return t * box[0]\n"
           f"        return {CELL_AT[where]}\n"
           f"    return step, box\n")
    scope: dict = {}
    exec(compile(src, __file__, "exec"), {**globals(), "__builtins__": __builtins__}, scope)
    fn, box = scope["_factory"]()
    x = torch.randn(3)
    jitted, captured = aotgrad.jit(fn), aotgrad.capture(fn, x).compile()
    assert torch.equal(jitted(x), fn(x))
    box[0] = -5.0
    assert torch.equal(jitted(x), fn(x)), f"a cell read in {where}: a stale graph"
    assert len(jitted.entries) == 2 and "box" in aotgrad.explain(jitted), f"a cell read in {where}: not guarded"
    with pytest.raises(errors.InputMismatchError, match="box"):
        captured(x)


def test_a_changed_setting_read_by_an_installed_model_library_recompiles():
    """HF's model code (an installed package) reads ``self.config.output_hidden_states``; the user
    changes the config after the first call. The config is a library class's instance holding the
    user's values, read by a library module's method: both are followed."""
    from tests.models.zoo import make_gpt2
    model, (ids, labels) = make_gpt2()
    hf = model.model
    step = aotgrad.jit(hf)
    assert step(ids).hidden_states is None
    hf.config.output_hidden_states = True
    out, want = step(ids), hf(ids)
    assert out.hidden_states is not None and len(out.hidden_states) == len(want.hidden_states)
    assert len(step.entries) == 2 and "output_hidden_states" in aotgrad.explain(step)


class _OwnBuffers(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(3, 3)
        self.register_buffer("b", torch.tensor([3.0]))

    def forward(self, x):
        return self.fc(x) * self._buffers["b"][0] + self._parameters.get("missing", 0.0)


def test_reading_a_modules_own_parameter_and_buffer_dicts_is_a_read_not_a_write():
    """``self._buffers["b"]`` inside the trace reads the capture's own layer of the dict (the traced
    value); that is not a change to the user's dict (it was refused as one)."""
    torch.manual_seed(0)
    m, x = _OwnBuffers(), torch.randn(2, 3)
    step = aotgrad.jit(m)
    assert torch.equal(step(x), m(x))
    m.b.mul_(-1)
    assert torch.equal(step(x), m(x)) and len(step.entries) == 1


class _Hiding(nn.Module):
    """A module whose own ``named_parameters`` (which capture calls to lift the parameters) reads a flag."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.hide = nn.Linear(3, 3), nn.Linear(3, 3), False

    def named_parameters(self, *args, **kwargs):
        for name, p in super().named_parameters(*args, **kwargs):
            if not (self.hide and name.startswith("b.")):
                yield name, p

    def forward(self, x):
        return self.b(self.a(x)).sum()


def test_a_flag_read_by_the_modules_own_named_parameters_is_guarded():
    """Capture's setup runs the module's ``named_parameters``: its reads decide which tensors are lifted,
    so a change to them recompiles (here the new lifting hides a parameter that needs a gradient, which
    is refused) and a staged step refuses the call, instead of running the graph lifted before."""
    m, x = _Hiding(), torch.randn(2, 3)
    step, captured = aotgrad.jit(m), aotgrad.capture(m, x).compile()
    step(x).backward()
    m.hide = True
    with pytest.raises(errors.UnsupportedError, match="requires grad but is not an input"):
        step(x)
    with pytest.raises(errors.InputMismatchError, match="hide"):
        captured(x)


class _Super(Based):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(3, 3)

    def forward(self, x):
        return self.fc(x) * super().bk


def test_a_class_attribute_read_through_super_is_guarded():
    """``super().bk`` loads no chain the bytecode names (3.11: a call of ``super``; 3.12: its own
    instruction): it reads ``bk`` in every class of ``self`` (a value set on any of them later counts)."""
    m, x = _Super(), torch.randn(2, 3)
    step, captured = aotgrad.jit(m), aotgrad.capture(m, x).compile()
    assert torch.equal(step(x), m(x))
    _Super.bk = 7.0             # now shadows Based.bk for super() too
    try:
        assert torch.equal(step(x), m(x)) and len(step.entries) == 2
        with pytest.raises(errors.InputMismatchError, match="bk"):
            captured(x)
    finally:
        del _Super.bk
    Based.bk = -Based.bk
    assert torch.equal(step(x), m(x)) and len(step.entries) == 3


_LIBRARY = '''
import torch

_SCALE = 2.0


def set_scale(value):
    global _SCALE
    _SCALE = value


def scaled(x):
    return x * _SCALE


class Scaled(torch.nn.Module):
    def forward(self, x):
        return x * _SCALE + 1
'''


@pytest.fixture
def installed_library(tmp_path, monkeypatch):
    """A package installed in a ``site-packages`` folder: library code, as far as the guards can tell."""
    root = tmp_path / "site-packages"
    (root / "aotgrad_fakelib").mkdir(parents=True)
    (root / "aotgrad_fakelib" / "__init__.py").write_text(_LIBRARY)
    monkeypatch.syspath_prepend(str(root))
    import aotgrad_fakelib
    yield aotgrad_fakelib
    sys.modules.pop("aotgrad_fakelib", None)


@pytest.mark.parametrize("through", ["function", "module"])
def test_a_setting_an_installed_library_reads_from_its_module_is_guarded(installed_library, through):
    """An installed library's function or module method reads its own module's flag, which its
    ``set_...`` function changes after the first call (timm's ``set_fused_attn`` style)."""
    lib = installed_library
    layer = lib.Scaled()

    def f(x):
        return lib.scaled(x).relu() if through == "function" else layer(x).relu()
    x = torch.randn(3)
    step, captured = aotgrad.jit(f), aotgrad.capture(f, x).compile()
    assert torch.equal(step(x), f(x))
    lib.set_scale(-3.0)
    assert torch.equal(step(x), f(x)) and len(step.entries) == 2
    assert "aotgrad_fakelib._SCALE" in aotgrad.explain(step)
    with pytest.raises(errors.InputMismatchError, match="_SCALE"):
        captured(x)


class _Cached(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc, self.k = nn.Linear(3, 3), 2.0

    @functools.cached_property
    def factor(self):
        return self.k * 2

    @functools.cached_property
    def weight_norm(self):
        return self.fc.weight.norm()

    def forward(self, x):
        return self.fc(x) * self.factor


def test_a_cached_property_caches_like_eager_and_is_guarded():
    """``functools.cached_property`` writes the instance's dict on the first call (eager's too, and
    never again): a plain cached value is kept, not refused as a write, and guarded; a cache emptied
    by the user recompiles with the value computed anew."""
    m, x = _Cached(), torch.randn(2, 3)
    step = aotgrad.jit(m)
    assert torch.equal(step(x), _Cached.forward(m, x)) and m.__dict__["factor"] == 4.0
    captured = aotgrad.capture(m, x).compile()
    del m.__dict__["factor"]
    m.k = -1.0
    assert torch.equal(step(x), m(x)) and len(step.entries) == 2
    with pytest.raises(errors.InputMismatchError, match="factor"):
        captured(x)


def test_a_cached_property_holding_a_traced_tensor_is_refused():
    class Held(_Cached):
        def forward(self, x):
            return self.fc(x) * self.weight_norm
    m, x = Held(), torch.randn(2, 3)
    with pytest.raises(errors.UnsupportedError, match="weight_norm"):
        aotgrad.jit(m)(x)
    assert "weight_norm" not in m.__dict__         # nothing of the trace left in the user's module


PER_THREAD = threading.local()
PER_CONTEXT = contextvars.ContextVar("PER_CONTEXT", default=1.0)


@pytest.mark.parametrize("kind", ["thread_local", "context_var"])
def test_a_per_thread_or_per_context_setting_is_read_where_the_call_runs(kind):
    """``threading.local()`` and ``ContextVar`` hold one value per thread (per context): a guard must
    read the calling thread's, not the one the capture ran in."""
    PER_THREAD.scale = 2.0

    def f(x):
        return (x * (PER_THREAD.scale if kind == "thread_local" else PER_CONTEXT.get())).relu()
    x = torch.randn(4)
    step, captured = aotgrad.jit(f), aotgrad.capture(f, x).compile()
    assert torch.equal(step(x), f(x))
    seen = {}

    def other():
        if kind == "thread_local":
            PER_THREAD.scale = -5.0
        else:
            PER_CONTEXT.set(-5.0)
        seen["same"] = torch.equal(step(x), f(x))
        with pytest.raises(errors.InputMismatchError):
            captured(x)
        seen["refused"] = True
    t = threading.Thread(target=other)
    t.start()
    t.join()
    assert seen == {"same": True, "refused": True} and len(step.entries) == 2
    assert torch.equal(step(x), f(x)) and len(step.entries) == 2      # this thread's value: the first entry


class _Inner(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(3, 3)

    def forward(self, x, slope=0.0):
        return F.leaky_relu(self.fc(x), slope)


class _Outer(nn.Module):
    def __init__(self):
        super().__init__()
        self.inner, self.out = _Inner(), nn.Linear(3, 3)

    def forward(self, x):
        return self.out(self.inner(x))


def _sigmoid_forward(self, x):
    return self.fc(x).sigmoid()


def _tripled_forward(self, x):
    return self.out(self.inner(x)) * 3


_REPLACED = {
    "a child's forward on the instance": lambda m: setattr(m.inner, "forward", types.MethodType(_sigmoid_forward,
                                                                                                m.inner)),
    "a child's class forward": lambda m: setattr(_Inner, "forward", _sigmoid_forward),
    "the root's forward on the instance": lambda m: setattr(m, "forward", types.MethodType(_tripled_forward, m)),
    "the root's class forward": lambda m: setattr(_Outer, "forward", _tripled_forward),
    "a torch class's forward": lambda m: setattr(nn.Linear, "forward", lambda self, x: F.linear(x, self.weight) * 2),
    # the same function, another default for an argument the caller leaves out, or other code
    "a child's forward defaults": lambda m: setattr(_Inner.forward, "__defaults__", (0.5,)),
    "a child's forward code": lambda m: setattr(_Inner.forward, "__code__", _sigmoid_forward.__code__),
}


@pytest.mark.parametrize("how", sorted(_REPLACED))
def test_a_replaced_forward_recompiles_or_is_refused(how):
    """Monkeypatching ``forward`` (on the instance, as libraries' hooks do, or on a class, torch's
    included) after the first call: the call runs another program."""
    saved = _Inner.forward, _Outer.forward, nn.Linear.forward
    inner = _Inner.forward.__defaults__, _Inner.forward.__code__
    try:
        torch.manual_seed(0)
        m, x = _Outer(), torch.randn(2, 3)
        step, captured = aotgrad.jit(m), aotgrad.capture(m, x).compile()
        assert torch.equal(step(x), m(x))
        _REPLACED[how](m)
        assert torch.equal(step(x), m(x)) and len(step.entries) == 2, f"{how}: a stale graph"
        assert "forward" in aotgrad.explain(step)
        with pytest.raises(errors.InputMismatchError, match="forward"):
            captured(x)
    finally:
        _Inner.forward, _Outer.forward, nn.Linear.forward = saved
        _Inner.forward.__defaults__, _Inner.forward.__code__ = inner


@functools.lru_cache(maxsize=None)
def _mask(n):
    return torch.triu(torch.ones(n, n), 1)


AFTER = 2.0


def _after(t):
    return t * AFTER


def test_reads_of_a_trace_retried_with_static_sizes_are_recorded():
    """A new length makes ``jit`` try symbolic sizes first; a memoized call keyed by the size fails
    there and the capture is retried with static sizes. The read recording had stopped where the
    symbolic trace failed, so what the code read after that point (``AFTER``) went unguarded."""
    global AFTER

    def f(x):
        return _after((x @ x.T * _mask(x.shape[0])).sum(-1))     # a helper entered after the failure point
    x4, x6 = torch.randn(4, 3), torch.randn(6, 3)
    f(x4), f(x6)        # the masks are cached for real
    step = aotgrad.jit(f)
    step(x4)
    assert torch.equal(step(x6), f(x6)) and len(step.entries) == 2
    AFTER = -3.0
    try:
        assert torch.equal(step(x6), f(x6)) and len(step.entries) == 3, "a stale graph"
    finally:
        AFTER = 2.0


GRAD_SCALE = 2.0


class _Scaled(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        return g * GRAD_SCALE


def _scaled_function(x):
    return _Scaled.apply(x).square().sum()


class _BackwardHooked(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(3, 3)
        self.fc.register_full_backward_hook(lambda mod, grad_in, grad_out: (grad_in[0] * GRAD_SCALE,))

    def forward(self, x):
        return self.fc(x).square().sum()


def _unpacked(x):
    with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t * GRAD_SCALE):
        return (x * x).sum()


@pytest.mark.parametrize("where", ["Function.backward", "module backward hook", "saved-tensor unpack hook"])
def test_a_read_made_only_by_code_the_backward_runs_is_guarded(where):
    """Code only the backward runs (a custom Function's ``backward``, a module's full backward hook,
    a saved-tensor hook's unpack) reads ``GRAD_SCALE``: the forward's read recording had stopped when
    the function returned, so a changed value reused a graph with the old gradients."""
    global GRAD_SCALE
    fn = {"Function.backward": _scaled_function, "module backward hook": _BackwardHooked(),
          "saved-tensor unpack hook": _unpacked}[where]
    x = torch.randn(2, 3)

    def grad(f):
        t = x.clone().requires_grad_(True)
        f(t).backward()
        return t.grad
    step = aotgrad.jit(fn)
    captured = aotgrad.capture(fn, x.clone().requires_grad_(True)).compile()
    assert torch.equal(grad(step), grad(fn))
    GRAD_SCALE = -3.0
    try:
        assert torch.equal(grad(step), grad(fn)), f"{where}: stale gradients"
        assert len(step.entries) == 2 and "GRAD_SCALE" in aotgrad.explain(step)
        with pytest.raises(errors.InputMismatchError, match="GRAD_SCALE"):
            grad(captured)
    finally:
        GRAD_SCALE = 2.0
