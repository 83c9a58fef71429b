"""Storage swaps of inputs (``set_()``), as PyTorch's AOTAutograd replays them (its epilogue's
``inpt_old.set_(inpt_new)``): each target x aliasing x requires_grad x what follows.

Targets: another input (``x.set_(y)``), a view of one (``y[1:]``, ``y.t()``), a view of the input's own
storage (``x[1:]``), a value the function makes (``y * 3``, a view of one), two swaps in a row, and
``x.data.set_(y)`` (eager changes a detached alias, not ``x``; a write to ``x`` after it is refused:
functionalization froze ``x``'s storage, as in PyTorch's AOTAutograd). After the call the caller's ``x`` holds
the storage eager's holds, at its place: the epilogue regenerates the view of the other input, or sets
``x`` to the value the graph returned. Requires grad: nothing, the other input under ``no_grad`` (the
swap is eager's detached alias), the swapped input itself (a leaf: eager raises, and so does the
compiled program, typed), the other input with grad on (refused: eager's backward through ``x`` raises). What
follows: nothing, a write through ``x`` (into the other input's storage, or the new one), ``x`` returned
with a view of it (a view of the caller's ``x``, as eager's). Also refused, naming the line: a write to ``x`` before the swap (the caller's old
storage must keep it), a swap of an input passed twice.
"""
import contextlib

import torch

from .programs import fn, program, r

D = "aotdispatch"
S = "storage"

# target name -> (the swap on (x, y), y's shape for size n, whether the swap lands in y's storage)
TARGETS = {
    "input": (lambda x, y: x.set_(y), lambda n: (2, n)),
    "input_view": (lambda x, y: x.set_(y[1:]), lambda n: (n, 3)),
    "input_t": (lambda x, y: x.set_(y.t()), lambda n: (n, 2)),
    "own_view": (lambda x, y: x.set_(x[1:]), lambda n: (2, 3)),
    "fresh": (lambda x, y: x.set_(y * 3), lambda n: (2, n)),
    "fresh_view": (lambda x, y: x.set_((y * 3)[1:]), lambda n: (n, 3)),
    "twice": (lambda x, y: (x.set_(y), x.set_(y[:1] + 1)), lambda n: (n, 3)),
    "through_data": (lambda x, y: x.data.set_(y), lambda n: (2, n)),
}
GRADS = ("none", "other_no_grad", "self", "other")
THENS = ("none", "write", "return")


def _body(swap, grad, then):
    def f(x, y):
        if grad == "other_no_grad":
            with torch.no_grad():
                swap(x, y)
        else:
            swap(x, y)
        if then == "write":
            x.mul_(2)
        # (onto a tensor that requires grad: eager's x has a history whose backward raises; not read by it)
        out = (x.detach() if grad == "other" else x) * 2 + y.sum()
        if then == "return":
            return out, x, x[:1]
        return out
    return f


def _register(target, grad, then):
    swap, y_shape = TARGETS[target]
    # A leaf that requires grad swapped (or, after x.data.set_, written) with grad on: eager raises.
    raises = grad == "self" and (target != "through_data" or then == "write")
    # A swap onto a tensor that requires grad, grad on: eager's x gets a history whose backward raises
    # (set_ has no derivative): refused. After x.data.set_ eager writes x in place where functionalization
    # froze x's storage (torch's AOTAutograd fails the same way): refused. A write through a view of x's
    # own storage after the swap: refused (the graph replays writes on storages the caller holds).
    refused = grad == "other" and target != "through_data" or then == "write" and target in ("through_data",
                                                                                             "own_view")

    @program(f"set__{target}_{grad}_{then}", S, D, eager_raises=raises, must_match=not raises and not refused)
    def _(n=3):
        return fn(_body(swap, grad, then), r(n, 4, rg=grad == "self"),
                  r(*y_shape(n), rg=grad in ("other", "other_no_grad")))


for _t in TARGETS:
    for _g in GRADS:
        for _then in THENS:
            if not (_g == "other" and _then == "return"):      # (returned, its backward raises in eager)
                _register(_t, _g, _then)


@program("set__written_before", S, D)
def _(n=3):
    def f(x, y):
        x.mul_(2)           # the caller's x keeps its old storage's write in eager
        x.set_(y)
        return x + 1
    return fn(f, r(n, 4), r(2, n))


@program("set__same_tensor_twice", S, D)
def _(n=3):
    def f(a, b, y):
        a.set_(y)
        return a + 1, b * 2         # b is a: eager's b holds y's storage too
    x = r(n, 4)
    return fn(f, x, x, r(2, n))


@program("set__leaf_requires_grad_under_no_grad", S, D)
def _(n=3):
    def f(w, y):
        with torch.no_grad():
            w.set_(y)       # eager: w stays a leaf requiring grad, its gradient of y's shape
        return w * 2
    return fn(f, r(n, 4, rg=True), r(2, n))


@program("set__module_buffer", S, D, must_match=True)
def _(n=3):
    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("b", torch.zeros(n, 4))
            self.w = torch.nn.Parameter(torch.randn(4))

        def forward(self, x):
            with torch.no_grad():
                self.b.set_(x.detach()[:, :4] * 2)     # a buffer re-pointed at a value made inside
            return (x[:, :4] * self.w).sum() + self.b.sum()
    return fn(M(), r(n, 5, rg=True))


@program("set__other_input_written_too", S, D, must_match=True)
def _(n=3):
    def f(x, y):
        x.set_(y)
        y.add_(1)           # the swapped x sees it: one storage
        return x * 2
    return fn(f, r(n, 4), r(2, n))


@program("set__swap_into_each_other", S, D, must_match=True)
def _(n=3):
    def f(x, y):
        t = x.detach()      # x's storage, kept
        x.set_(y)
        y.set_(t)           # the two swap storages: the epilogue reads both before either is swapped
        return x + 1, y * 2
    return fn(f, r(n, 4), r(2, n))


@program("set__input_size_read", S, D, must_match=True)
def _(n=3):
    def f(x, y):
        x.set_(y)
        return x.new_ones(x.shape) * x.shape[0] + x     # x's sizes after the swap are y's, as eager reads them
    return fn(f, r(n, 4), r(2, n))


# --- set_() of a tensor made inside onto an input, set_() with no source, out= resizing an input -------------
# y = torch.empty(0); y.set_(x): eager's y is a tensor of its own over the caller's storage (not x, no view of it),
# so writes through it land in x, in the call and after it; returned alone, written, next to a view of x, viewed
# itself; onto x or a view of it; under no_grad onto x requiring grad. x.set_(): the caller's x gets a fresh empty
# storage. An out= op resizing an input (empty, or of another size): the resize is the caller's before the values,
# with another input written too; code reading its size after the op reads eager's.

ONTO = {
    "fresh": lambda x: torch.empty(0).set_(x),
    "new_empty": lambda x: x.new_empty(0).set_(x),
    "input_view": lambda x: torch.empty(0).set_(x[1:]),
}


def _onto(onto, then, grad):
    def f(x, w):
        with torch.no_grad() if grad else contextlib.nullcontext():
            y = onto(x)     # (onto x requiring grad: under no_grad, as eager's backward through set_ raises)
        if then == "write":
            y.mul_(2)       # writes x
        out = x * w
        if then == "with_view":
            return out, y, x[:1]
        return (out, y, y[:1]) if then == "viewed" else (out, y)
    return f


# (target, then, x requires grad); y = x[1:] alone or next to a view of x was eager's already (left out)
ONTO_CASES = [(_o, _then, False) for _o in ("fresh", "new_empty") for _then in ("return", "write", "with_view",
                                                                                "viewed")] + \
    [("input_view", "write", False), ("input_view", "viewed", False), ("input_view", "viewed", True)] + \
    [(_o, "write", True) for _o in ONTO]
for _o, _then, _grad in ONTO_CASES:
    @program(f"set__onto_input_{_o}_{_then}{'_no_grad' if _grad else ''}", S, D, must_match=True)
    def _(n=3, f=_onto(ONTO[_o], _then, _grad), grad=_grad):
        return fn(f, r(n, 4, rg=grad), r(n, 4, rg=True))


def _emptied(then):
    def f(x, w):
        x.set_()                    # a fresh empty storage: the caller's other views keep the old one
        if then == "regrow":
            x.resize_(4, 2)
            x.fill_(0.5)
        out = w * 2 + x.sum()
        return (out, x) if then != "none" else out
    return f


for _then in ("none", "return", "regrow"):
    # (regrow: a bigger resize_ is refused where functionalization will not grow the storage: see resize__bigger)
    @program(f"set__empty_{_then}", S, D, must_match=_then != "regrow")
    def _(n=3, f=_emptied(_then)):
        return fn(f, r(n, 4), r(3, rg=True))


OUT_OPS = {     # name -> (the out= op on (a, b, c), c's shape for size n)
    "add_from_empty": (lambda a, b, c: torch.add(a, b, out=c), lambda n: (0,)),
    "cat_other_size": (lambda a, b, c: torch.cat([a, b], out=c), lambda n: (2,)),
    "add_from_bigger": (lambda a, b, c: torch.add(a, b, out=c), lambda n: (n + 4,)),
    "mm_from_empty": (lambda a, b, c: torch.mm(a.view(-1, 1), b.view(1, -1), out=c), lambda n: (0,)),
}


def _out(op, then):
    def f(a, b, c):
        if then == "other_written":
            b.mul_(10)
        op(a, b, c)
        if then == "size_read":
            return c * 2, a.new_ones(c.shape) * c.shape[0]
        return (c, c.view(-1)[:2]) if then == "viewed" else c
    return f


for _name, (_op, _c_shape) in OUT_OPS.items():
    for _then in ("none", "other_written", "size_read", "viewed"):
        @program(f"out__resizes_input_{_name}_{_then}", S, D, must_match=True)
        def _(n=3, f=_out(_op, _then), c_shape=_c_shape):
            return fn(f, r(n), r(n), torch.empty(c_shape(n)))


# --- resize_() of an input (no grad: eager refuses resizing a tensor that requires grad) ----------------
# Under dynamic shapes a contiguous input resized to no more elements is traced as as_strided_ with the new
# size's contiguous strides (fake tensors with symbolic sizes cannot resize); a bigger or non-contiguous
# one is refused there (torch.compile graph-breaks on resize_ of an input), exact with static shapes.

RESIZES = {
    "smaller": (lambda n: (n, 4), lambda x: x.resize_(2, 3)),
    "flat": (lambda n: (n, 4), lambda x: x.resize_(x.shape[0] * 2)),
    "same_numel": (lambda n: (n, 4), lambda x: x.resize_(4, x.shape[0])),
    "bigger": (lambda n: (n,), lambda x: x.resize_(2 * x.shape[0])),
}
def _resized(resize, then, grows):
    def f(x, w):
        resize(x)
        if then == "write" or grows:    # (a grown tensor's new elements hold whatever the storage held)
            x.fill_(0.5)
        out = x.sum() * w
        return (out, x, x.view(-1)[:2]) if then == "return" else out
    return f


for _name, (_shape, _resize) in RESIZES.items():
    for _then in ("none", "write", "return"):
        @program(f"resize__{_name}_{_then}", S, D, *(("isolate",) if _name == "bigger" else ()),
                 must_match=_name != "bigger")
        def _(n=3, f=_resized(_resize, _then, _name == "bigger"), shape=_shape):
            return fn(f, r(*shape(n)), r(3, rg=True))


# --- storage resize of an input (FSDP's free and re-allocate), as PyTorch's AOTAutograd replays it -------------
# The graph holds values: the resize is replayed on the caller's storage after the call, before the data written
# into it (none when it ends freed). Start sizes are guarded (a call with another size recompiles under jit). A
# use of an input whose storage does not hold its values, a resize of anything but an input, a resize between two
# non-zero sizes, and a resized input that shares its storage with another input are refused naming the line
# (tests/differential/test_storage_resize.py). Isolated: a wrong replay reads freed memory.

def _freed(*shape, rg=False):
    t = r(*shape)
    t.untyped_storage().resize_(0)
    return t.requires_grad_(rg)


def _grow(a, how):
    # to the bytes its elements reach (the offset and stride variants lay it out wider than numel)
    nbytes = (a.storage_offset() + 1 + sum((n - 1) * s for n, s in zip(a.shape, a.stride()))) * a.element_size()
    if how == "op":
        torch.ops.inductor.resize_storage_bytes_(a, nbytes)
    else:
        a.untyped_storage().resize_(nbytes)


def _free(a, how):
    if how == "op":
        torch.ops.inductor.resize_storage_bytes_(a, 0)
    else:
        a.untyped_storage().resize_(0)


# name -> (body(a, src, x, how), whether a starts freed, whether a requires grad)
RESIZE_STORAGE = {
    # grown, filled, read: the caller's storage ends full, holding the copy
    "up_fill_read": (lambda a, s, x, how: (_grow(a, how), _fill(a, s), a * x)[-1], True, False),
    # grown and filled, the read before a second write: the caller's holds the last one
    "up_fill_twice": (lambda a, s, x, how: (_grow(a, how), _fill(a, s), a + x + _fill(a, s * 2).sum())[-1],
                      True, False),
    # read, then freed: the caller's storage ends freed, the output keeps the read
    "read_down": (lambda a, s, x, how: (a.sin() * x, _free(a, how))[0], False, False),
    # grown, filled, read, freed: nothing written back (the storage ends freed; an add: eager's mul would save
    # a for its backward, which would then read the freed storage)
    "up_down": (lambda a, s, x, how: (_grow(a, how), _fill(a, s), (a + x).sum(), _free(a, how))[2],
                True, False),
    # FSDP's unsharded parameter: requires grad, freed on entry, filled under no_grad, used, freed again
    "fsdp_param": (lambda a, s, x, how: (_grow(a, how), _fill(a, s), x.sin() + a, _free(a, how))[2],
                   True, True),
    # FSDP's parameter filled and left allocated: its gradient and its new values are eager's
    "fsdp_param_up": (lambda a, s, x, how: (_grow(a, how), _fill(a, s), x.sin() * 2 + a)[-1], True, True),
    # written after the free is undone by a second grow: the last fill is what the caller holds
    "down_up": (lambda a, s, x, how: (_free(a, how), _grow(a, how), _fill(a, s + 1), a + x)[-1], False, False),
    # returned as it is, grown and filled: the caller's very tensor comes back
    "up_return": (lambda a, s, x, how: (_grow(a, how), _fill(a, s), (a, a * x))[-1], True, False),
}


def _fill(a, src):
    with torch.no_grad():
        a.copy_(src)
    return a


def _resize_storage_program(name, body, freed, rg, how):
    # A caller's freed storage is never deep-copied or read outside a child process; nor one a call frees
    # before a read (a second call, the export entry's second step, would read it in eager).
    isolate = freed or name == "read_down"
    # A CUDA graph's static inputs cannot take a freed storage: that entry refuses, typed (its documented limit).
    @program(f"resize_storage_{name}_{how}", S, D, *(("isolate",) if isolate else ()), must_match=True,
             may_refuse=("capture_cudagraphs",) if freed else ())
    def _(n=4):
        def f(a, src, x):
            return body(a, src, x, how)
        a = _freed(n, 3, rg=rg) if freed else r(n, 3, rg=rg)
        return fn(f, a, r(n, 3), r(n, 3, rg=True))


for _name, (_resize_body, _freed_on_entry, _rg) in RESIZE_STORAGE.items():
    for _how in ("storage", "op"):
        _resize_storage_program(_name, _resize_body, _freed_on_entry, _rg, _how)


@program("resize_storage_module_param", S, D, "isolate", must_match=True)
def _(n=4):
    class Unsharded(torch.nn.Module):      # FSDP's pattern: the parameter's storage lives only during forward
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.randn(n))
            self.register_buffer("shard", torch.randn(n))
            self.w.untyped_storage().resize_(0)

        def forward(self, x):
            self.w.untyped_storage().resize_(n * 4)
            with torch.no_grad():
                self.w.copy_(self.shard)
            out = (x * 2 + self.w).sum(0)
            self.w.untyped_storage().resize_(0)
            return out
    return fn(Unsharded(), r(3, n, rg=True))


@program("resize_storage_aliased_view_passed", S, D)
def _(n=4):
    def f(a, v):        # v views a's storage: the freed storage would lose v's values; refused
        out = v * 2 + a.sum()
        a.untyped_storage().resize_(0)
        return out
    a = r(n, 3)
    return fn(f, a, a[1:])
