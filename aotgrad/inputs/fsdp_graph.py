"""FSDP2 in one graph: ``capture`` of a ``fully_shard``-ed model, or of a whole step over one.

Eagerly, FSDP2's hooks all-gather a unit's parameters before its forward, reshard them after, and
reduce-scatter their gradients from autograd hooks. A capture runs none of those hooks. While it
traces, a call of an FSDP unit gathers the unit's sharded parameters inside the graph and runs the
unit's own forward on them (:class:`Lowered`). Each parameter's gather is one :class:`_Gather`:

* forward: the local shard, cast to the mixed-precision parameter dtype, padded on dim 0 as FSDP
  pads it, all-gathered (a functional collective), cut to the parameter's size;
* backward: FSDP's reduce-scatter of that parameter's gradient: cast to the reduce dtype, padded,
  FSDP's pre-divide, reduce op and post-divide (``_get_gradient_divide_factors``), cast back to
  the parameter's dtype, cut to this rank's shard.

The gather takes the sharded DTensor's local tensor, so the parameter's gradient is the sharded
DTensor eager's hooks assign to ``.grad``. Collectives are issued by the compiled forward and
backward on the unit's process group. The FSDP settings the arithmetic depends on (gradient sync,
divide factor, sum-only reductions) are guarded; a setting the lowering does not model is a
``GraphBreakError`` before anything runs, naming the unit: ``capture`` refuses it, ``jit`` of a whole
step hands the step to Dynamo.
"""
from __future__ import annotations

import contextlib
import math

import torch

from .. import errors
from .._torch import Fsdp2, fsdp2_divide_factors, functional_all_gather, functional_reduce_scatter, pytree
from ..guards.state import _GLOBAL_HOOKS, Read
from .. import tracing
from ..tracing.patches import MODULE_CALLS, flat_call
from ..tracing.views import holding
from .distributed import _UnitForward, _fsdp2_class

_OPS = {"SUM": "sum", "AVG": "avg"}
# The param group's settings that change the gradients' arithmetic, guarded per call.
GUARDED = ("reduce_grads", "all_reduce_grads", "gradient_divide_factor", "force_sum_reduction_for_comms")


def units(module) -> list:
    """The FSDP2 modules in ``module``'s tree (every unit, inner and outer); none under ``jit``'s own
    compile of a unit's forward between FSDP's eager hooks (``distributed._UnitForward``)."""
    fsdp2 = _fsdp2_class()
    if fsdp2 is None or not isinstance(module, torch.nn.Module) or isinstance(module, _UnitForward):
        return []
    return [m for m in module.modules() if isinstance(m, fsdp2)]


def _refuse(name: str, why: str):
    """A ``GraphBreakError``: ``capture`` refuses it; ``jit`` of a whole step hands the step to Dynamo,
    which runs FSDP's hooks eagerly between its graphs."""
    return errors.GraphBreakError(
        f"FSDP unit {name!r}: {why}; one graph holds FSDP2's all-gathers and reduce-scatters for the default "
        "sharding (one module per fully_shard, Shard(0) on a 1-D mesh, gradients reduced every call); "
        "aotgrad.jit and torch.compile(backend='aotgrad') run FSDP's hooks eagerly around compiled graphs",
        user_line=errors.caller_line())


def check(module, found) -> list:
    """The reads that guard the FSDP settings of ``module``'s units ``found`` (``guards.state.Read``);
    raises ``GraphBreakError`` for what the lowering does not model."""
    names = {id(m): n or type(module).__name__ for n, m in module.named_modules()}
    reads = []
    for unit in found:
        name, state = names[id(unit)], Fsdp2(unit)
        _check_unit(unit, name, state)
        for obj, _ in state.groups:
            reads += [Read(f"FSDP unit {name!r} {attr}", None, obj, attr, getattr(obj, attr), "eq")
                      for attr in GUARDED]
    return reads


@contextlib.contextmanager
def lowering(fn):
    """While a capture of ``fn`` traces, FSDP units' calls are :class:`Lowered`; yields the reads that
    guard their settings (``None`` where ``fn`` holds no FSDP2 unit: nothing changes)."""
    found = units(fn)
    if not found:
        yield None
        return
    reads = check(fn, found)
    with MODULE_CALLS(), tracing.scope(blocks=Lowered(found)):
        yield reads


def _check_unit(unit, name, state) -> None:
    if len(state.modules) != 1:
        raise _refuse(name, "fully_shard of several modules at once")
    if len(state.groups) > 1:
        raise _refuse(name, "parameters on more than one mesh")
    if not state.idle:
        raise _refuse(name, "captured while FSDP runs a forward or backward")
    if state.offload:
        raise _refuse(name, "CPU offload")
    # The lowered call runs the unit's own forward: hooks other than FSDP's would not run.
    for hooks in (unit._forward_pre_hooks, unit._forward_hooks, unit._backward_pre_hooks, unit._backward_hooks):
        if any(getattr(h, "__self__", None) is not state.owner for h in hooks.values()):
            raise _refuse(name, "it has module hooks of its own beside FSDP's")
    if any(getattr(torch.nn.modules.module, g, None) for g in _GLOBAL_HOOKS):
        raise _refuse(name, "a global module hook (register_module_forward_hook and the like) is registered")
    for obj, group in state.groups:
        if not obj.reduce_grads:
            raise _refuse(name, "set_requires_gradient_sync(False): eager accumulates unsharded gradients "
                                "across calls, which one graph does not hold")
        if obj.gradient_divide_factor is not None or obj.force_sum_reduction_for_comms or group.has_hook:
            raise _refuse(name, "a gradient divide factor, sum-only reductions or an all-reduce hook")
        if group.mesh.ndim != 1:
            raise _refuse(name, "a 2-D (HSDP) mesh")
        for p in group.params:
            if p.dim != 0 or p.extension:
                raise _refuse(name, f"parameter {p.name!r} is sharded on dim {p.dim} (None: also on another "
                                    "mesh, as with tensor parallelism) or has all-gather extensions")
            if p.held is not _home(p.module, p.name):
                raise _refuse(name, f"parameter {p.name!r} is unsharded now (reshard_after_forward=False between "
                                    "a forward and its backward)")


def _home(module, name):
    return module._parameters.get(name)


class Lowered:
    """Module calls while a capture of FSDP2 modules traces. An FSDP unit's call gathers its
    parameters in the graph and runs its forward on them. What autograd saves of a gathered
    parameter (a linear's weight, for its input's gradient) is gathered again where the backward
    unpacks it, as FSDP reshards after the forward and all-gathers again in the backward: the
    forward's unsharded parameters are freed at their last forward use (not for the root unit,
    which FSDP does not reshard). The call of a module inside a unit while that unit is not running
    (checkpoint's recomputation in the backward) runs on parameters gathered again too. Other calls
    run as ``Module.__call__`` does."""

    def __init__(self, found):
        self.fsdp2 = _fsdp2_class()
        self.root = found[0]        # FSDP's root: it does not reshard after the forward
        self.owner = {id(m): u for u in found for m in u.modules()}     # inner units come later: they win
        self.latest: dict = {}      # id(unit) -> [(local shard, spec, places)] of its last call
        self.bases: dict = {}       # id(a gathered value or its base) -> (it, local shard, spec)
        self.running: set = set()

    def call(self, module, args, kwargs):
        if isinstance(module, self.fsdp2):
            return self._unit(module, args, kwargs)
        unit = self.owner.get(id(module))
        if unit is None or id(unit) in self.running or id(unit) not in self.latest:
            return flat_call(module, *args, **kwargs)
        latest = self.latest[id(unit)]
        with torch.no_grad():       # values only: the gradients flow through the forward's gathers
            # requiring grad as the forward's did, so checkpoint's recompute saves what the forward saved
            again = [_Gather.gather(local, spec).requires_grad_(local.requires_grad) for local, spec, _ in latest]
        with self._on(unit, latest, again):
            return flat_call(module, *args, **kwargs)

    @contextlib.contextmanager
    def _on(self, unit, latest, gathered):
        """``unit`` running, each parameter of ``latest`` (and its tied twins) held as ``gathered``."""
        self.running.add(id(unit))
        try:
            with holding([(md, "_parameters", attr, i) for i, (_, _, places) in enumerate(latest)
                          for md, attr in places], gathered):
                yield
        finally:
            self.running.discard(id(unit))

    def _unit(self, module, args, kwargs):
        state = Fsdp2(module)
        gathered, latest = [], []
        for obj, group in state.groups:
            for p in group.params:
                sharded = _home(p.module, p.name)
                local, spec = sharded.to_local(), _Spec(p, obj, group, sharded)
                full = _Gather.apply(local, spec)
                if group.reshards and not (module is self.root and state.auto_reshard):
                    self.bases.update({id(t): (t, local, spec) for t in (full, full._base) if t is not None})
                gathered.append(full)
                latest.append((local, spec, [(mod.__dict__, attr) for mod, attr in ((p.module, p.name), *p.shared)]))
        self.latest[id(module)] = latest
        policy = state.policy
        if policy.cast_forward_inputs and policy.param_dtype is not None:
            args, kwargs = _cast(policy.param_dtype, (args, kwargs))
        with self._on(module, latest, gathered), torch.autograd.graph.saved_tensors_hooks(self._pack, _unpack):
            out = type(module).forward(module, *args, **kwargs)
        return out if policy.output_dtype is None else _cast(policy.output_dtype, out)

    def _pack(self, t):
        """A saved gathered parameter (or a view of one) as what gathers it again."""
        for v in (t, t._base):
            if v is not None and id(v) in self.bases and self.bases[id(v)][0] is v:
                _, local, spec = self.bases[id(v)]
                return _Again(local, spec, t.size(), t.stride(), t.storage_offset())
        return t


class _Again:
    """A saved value of a gathered parameter, made again when the backward unpacks it."""

    def __init__(self, local, spec, size, stride, offset):
        self.local, self.spec, self.size, self.stride, self.offset = local, spec, size, stride, offset


def _unpack(saved):
    if not isinstance(saved, _Again):
        return saved
    with torch.no_grad():
        base = _Gather.gather(saved.local, saved.spec, cut=False)
        return base.as_strided(saved.size, saved.stride, saved.offset)


def _cast(dtype, tree):
    """FSDP's ``_cast_fp_tensor`` over a pytree: floating tensors to ``dtype``."""
    return pytree.tree_map_only(torch.Tensor, lambda t: t.to(dtype) if t.is_floating_point() else t, tree)


class _Spec:
    """What one parameter's gather and reduce-scatter need: sizes, dtypes, the group's collective."""

    def __init__(self, p, obj, group, sharded):
        self.world, self.rank, self.group_name = group.world, group.rank, group.group_name
        self.size = tuple(sharded.shape)
        self.rows = math.ceil(self.size[0] / self.world) if self.size else 0
        self.local = max(0, min(self.rows, self.size[0] - self.rank * self.rows)) if self.size else 0
        self.param_dtype, self.orig_dtype = p.param_dtype, sharded.dtype
        self.reduce_dtype = group.reduce_dtype
        self.pre, self.post, op = fsdp2_divide_factors(obj, self.reduce_dtype or p.param_dtype or sharded.dtype)
        if op not in _OPS:
            raise _refuse(p.name, f"FSDP's reduce op {op}")
        self.op = _OPS[op]


def _pad(t: torch.Tensor, rows: int) -> torch.Tensor:
    return t if t.shape[0] == rows else torch.cat([t, t.new_zeros((rows - t.shape[0], *t.shape[1:]))])


class _Gather(torch.autograd.Function):
    """FSDP's all-gather of one parameter (forward) and its reduce-scatter (backward)."""

    @staticmethod
    def gather(local, spec, cut: bool = True):
        """The full parameter from this rank's shard (``cut=False``: with FSDP's padding rows)."""
        x = local if spec.param_dtype is None else local.to(spec.param_dtype)
        if spec.world == 1:
            return x.clone()
        full = functional_all_gather(_pad(x, spec.rows).contiguous(), spec.world, spec.group_name)
        return full.narrow(0, 0, spec.size[0]) if cut and full.shape[0] != spec.size[0] else full

    @staticmethod
    def forward(ctx, local, spec):
        ctx.spec = spec
        return _Gather.gather(local, spec)

    @staticmethod
    def backward(ctx, grad):
        spec = ctx.spec
        g = grad if spec.reduce_dtype is None else grad.to(spec.reduce_dtype)
        if spec.pre not in (None, 1):
            g = g / spec.pre
        if spec.world > 1:
            g = _pad(g, spec.rows * spec.world).contiguous()
            g = functional_reduce_scatter(g, spec.op, spec.world, spec.group_name).narrow(0, 0, spec.local)
        if spec.post not in (None, 1):
            g = g / spec.post
        return g.to(spec.orig_dtype), None
