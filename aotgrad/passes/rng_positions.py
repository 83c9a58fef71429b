"""Where in the RNG stream each random op of a joint graph draws.

Traced with fake tensors, nothing draws for real, so code that saves and
restores the RNG state (``torch.utils.checkpoint`` before recomputing its
region, ``torch.random.fork_rng``) does nothing visible in the graph. While a
joint graph is traced, :func:`traced_with_positions` records those saves and
restores, and afterwards tags every random node with the position it draws
at: ``node.meta["aotgrad_rng"] = (device, epoch, index)``. ``epoch`` is
``"fw"`` for the forward stream, whose positions are known at capture, and
``"bw"`` for draws the backward makes from whatever the global RNG holds when
``backward()`` runs. A checkpoint's recomputation restores a forward state,
so its dropout is tagged with the forward dropout's position: the same draw,
whatever order the backward recomputes regions in.

    dropout (fw, 0) ... checkpoint restores (fw, 0) ... recomputed dropout (fw, 0)
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch
import torch.fx as fx

from .. import errors
from ..analysis.ops import RNG_META as META, is_random

ENDS = "aotgrad_rng_ends"     # gm.meta: {(device, phase): (epoch, index) the stream stands at when the phase ends}
PHASE = "aotgrad_rng_phase"   # node.meta: "fw" or "bw", the pass the node was traced in


@dataclass
class _Log:
    """What tracing did to the RNG state, each event anchored after the last node traced before it."""
    events: list = field(default_factory=list)   # (anchor node | None, kind, device, token index)
    states: dict = field(default_factory=dict)   # id(state tensor) -> (tensor, token index)
    tokens: int = 0

    def anchor(self):
        mode = _proxy_mode()
        if mode is None:
            return False, None
        nodes = mode.tracer.graph.nodes
        return True, (next(reversed(nodes)) if len(nodes) else None)


_ACTIVE: list[_Log] = []


def _proxy_mode():
    get = getattr(torch.fx.experimental.proxy_tensor, "get_proxy_mode", None)
    return get() if get is not None else None


def _device(dev=None, default="cpu") -> str:
    d = torch.device(dev if dev is not None else default)
    if d.type != "cpu" and d.index is None:
        d = torch.device(d.type, getattr(torch, d.type).current_device())
    return str(d)


def _getter(real, default):
    def get_rng_state(device=None):
        state = real() if default == "cpu" else real(device if device is not None else default)
        log = _ACTIVE[-1] if _ACTIVE else None
        tracing, node = log.anchor() if log else (False, None)
        if tracing:
            log.events.append((node, "get", _device(device, default), log.tokens))
            log.states[id(state)] = (state, log.tokens)
            log.tokens += 1
        return state
    return get_rng_state


def _setter(real, default):
    def set_rng_state(new_state, device=None):
        log = _ACTIVE[-1] if _ACTIVE else None
        tracing, node = log.anchor() if log else (False, None)
        if tracing:
            held = log.states.get(id(new_state))
            if held is None or held[0] is not new_state:
                raise errors.UnsupportedError(
                    "torch.set_rng_state with a state that was not taken inside the captured function: the "
                    "compiled graph cannot replay it; save and restore the state inside the function or "
                    "outside it", user_line=errors.caller_line())
            log.events.append((node, "set", _device(device, default), held[1]))
        return real(new_state) if default == "cpu" else real(new_state, device if device is not None else default)
    return set_rng_state


def _patch_targets():
    """(module, attribute, wrapper factory, default device) for each RNG-state function to watch."""
    targets = [(m, name, make, "cpu") for m in (torch, torch.random)
               for name, make in (("get_rng_state", _getter), ("set_rng_state", _setter))]
    cuda = getattr(torch, "cuda", None)
    if cuda is not None and cuda.is_available():
        targets += [(cuda, "get_rng_state", _getter, "cuda"), (cuda, "set_rng_state", _setter, "cuda")]
    return targets


@contextlib.contextmanager
def _recording(log: _Log):
    """Watch RNG-state saves and restores; let checkpoint's selective contexts act as they do
    eagerly (under a proxy mode they would cache every op and leave recomputation to a compiler)."""
    from torch.utils import checkpoint as ckpt
    targets = _patch_targets()
    originals = [getattr(m, name) for m, name, _, _ in targets]
    compiling = getattr(ckpt, "_is_compiling", None)
    for (m, name, make, default), real in zip(targets, originals):
        setattr(m, name, make(real, default))
    if compiling is not None:
        ckpt._is_compiling = lambda *a, **k: False
    _ACTIVE.append(log)
    try:
        yield log
    finally:
        _ACTIVE.pop()
        if compiling is not None:
            ckpt._is_compiling = compiling
        for (m, name, _, _), real in zip(targets, originals):
            setattr(m, name, real)


def backward_begins() -> None:
    """Called by the joint function right before ``autograd.grad``: draws from here on read the
    RNG as it stands when the user calls ``backward()``, not the forward's stream."""
    log = _ACTIVE[-1] if _ACTIVE else None
    tracing, node = log.anchor() if log else (False, None)
    if tracing:
        log.events.append((node, "backward", None, None))


def traced_with_positions(trace) -> fx.GraphModule:
    """``trace()`` (which returns a joint graph) with every random node tagged with its position."""
    log = _Log()
    with _recording(log):
        gm = trace()
    tag(gm, log)
    return gm


def _node_device(n: fx.Node) -> str:
    val = n.meta.get("val")
    val = val[0] if isinstance(val, (tuple, list)) and val else val
    return _device(getattr(val, "device", None))


def tag(gm: fx.GraphModule, log: _Log) -> None:
    """Walk the graph in trace order, replaying the recorded saves and restores."""
    after: dict = {}
    for node, kind, dev, token in log.events:
        after.setdefault(node, []).append((kind, dev, token))
    pos: dict = {}                 # device -> (epoch, index)
    tokens: dict = {}              # token index -> (epoch, index)
    ends: dict = {}
    phase = ["fw"]

    def end_phase():
        ends.update({(d, phase[0]): (e, i) for d, (e, i) in pos.items()})
        pos.clear()

    def apply(kind, dev, token):
        if kind == "get":
            tokens[token] = pos.get(dev, (phase[0], 0))
        elif kind == "set":
            pos[dev] = tokens[token]
        else:
            end_phase()
            phase[0] = "bw"

    for ev in after.get(None, ()):
        apply(*ev)
    for n in gm.graph.nodes:
        if is_random(n):
            dev = _node_device(n)
            e, i = pos.get(dev, (phase[0], 0))
            n.meta[META] = (dev, e, i)
            n.meta[PHASE] = phase[0]
            pos[dev] = (e, i + 1)
        for ev in after.get(n, ()):
            apply(*ev)
    end_phase()
    gm.meta[ENDS] = ends
