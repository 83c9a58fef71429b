"""Where in the RNG stream each random op of a joint graph draws.

Traced with fake tensors, nothing draws for real, so code that saves and
restores the RNG state (``torch.utils.checkpoint`` before recomputing its
region, ``torch.random.fork_rng``) does nothing visible in the graph. While a
joint graph is traced, :func:`traced_with_positions` follows those saves and
restores and tags every random node with the position it draws at:
``node.meta["aotgrad_rng"] = (device, epoch, index)``. ``epoch`` is
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
from .. import tracing
from ..tracing.patches import RNG_STATE
from ..ir.ops import RNG_META as META, RNG_PHASE as PHASE, is_random

ENDS = "aotgrad_rng_ends"     # gm.meta: {(device, phase): (epoch, index) the stream stands at when the phase ends}


@dataclass
class _Log:
    """The stream position of each device while a graph is traced, replayed on its random nodes
    as they appear: a node is tagged before the next save or restore of the RNG state."""
    pos: dict = field(default_factory=dict)      # device -> (epoch, index) the next draw takes
    states: dict = field(default_factory=dict)   # id(state tensor) -> (tensor, (epoch, index))
    lines: dict = field(default_factory=dict)    # its storage -> the user's line that took it
    ends: dict = field(default_factory=dict)     # (device, phase) -> (epoch, index) when the phase ended
    phase: str = "fw"
    seen: set = field(default_factory=set)       # nodes already walked

    def sync(self) -> bool:
        """Tag the random nodes traced since the last call; False when no graph is being traced.
        New nodes are appended at the end (only symbolic sizes are inserted earlier), so walking
        back to the first node already seen finds them all."""
        mode = _proxy_mode()
        if mode is None:
            return False
        fresh = []
        for n in reversed(mode.tracer.graph.nodes):
            if n in self.seen:
                break
            fresh.append(n)
        self.seen.update(fresh)
        self._tag(n for n in reversed(fresh) if is_random(n))
        return True

    def sync_final(self, gm: fx.GraphModule) -> None:
        """Tag what was traced after the last event; record where each phase left the stream."""
        self._tag(n for n in gm.graph.nodes if is_random(n) and META not in n.meta)
        self.end_phase()
        gm.meta[ENDS] = self.ends

    def _tag(self, nodes) -> None:
        for n in nodes:
            dev = node_device(n)
            epoch, index = self.pos.get(dev, (self.phase, 0))
            n.meta[META], n.meta[PHASE] = (dev, epoch, index), self.phase
            self.pos[dev] = (epoch, index + 1)

    def end_phase(self) -> None:
        self.ends.update({(d, self.phase): at for d, at in self.pos.items()})
        self.pos.clear()

    def got(self, state, device, default: str) -> None:
        """``get_rng_state`` returned ``state``: it stands where the stream is now."""
        if self.sync():
            self.states[id(state)] = (state, self.pos.get(_device(device, default), (self.phase, 0)))
            self.lines[state.untyped_storage().data_ptr()] = errors.caller_line()

    def setting(self, new_state, device, default: str) -> None:
        """``set_rng_state(new_state)``: the stream goes back to where that state was taken."""
        if self.sync():
            held = self.states.get(id(new_state))
            if held is None or held[0] is not new_state:
                raise errors.UnsupportedError(
                    "torch.set_rng_state with a state that was not taken inside the captured function: the "
                    "compiled graph cannot replay it; save and restore the state inside the function or "
                    "outside it", user_line=errors.caller_line())
            self.pos[_device(device, default)] = held[1]


def _proxy_mode():
    get = getattr(torch.fx.experimental.proxy_tensor, "get_proxy_mode", None)
    return get() if get is not None else None


def _device(dev=None, default="cpu") -> str:
    d = torch.device(dev if dev is not None else default)
    if d.type != "cpu" and d.index is None:
        d = torch.device(d.type, getattr(torch, d.type).current_device())
    return str(d)


@contextlib.contextmanager
def _recording(log: _Log):
    """Watch RNG-state saves and restores; let checkpoint's selective contexts act as they do
    eagerly (under a proxy mode they would cache every op and leave recomputation to a compiler)."""
    with RNG_STATE(), tracing.scope(rng=log):
        yield log


def backward_begins() -> None:
    """Called by the joint function right before ``autograd.grad``: draws from here on read the
    RNG as it stands when the user calls ``backward()``, not the forward's stream."""
    log = tracing.current().rng
    if log is not None and log.sync():
        log.end_phase()
        log.phase = "bw"


def reserve(devices) -> tuple | None:
    """Stream positions for draws made by nodes that will be stamped into the graph later (a repeated
    block's random ops, see :mod:`aotgrad.capture.block_graph`), one per device in ``devices``, taken
    here in the stream as if they were traced now: ``((device, epoch, index), phase)`` each, or None
    when no graph is being traced with positions."""
    log = tracing.current().rng
    if log is None or not log.sync():
        return None
    out = []
    for dev in devices:
        epoch, index = log.pos.get(dev, (log.phase, 0))
        out.append(((dev, epoch, index), log.phase))
        log.pos[dev] = (epoch, index + 1)
    return tuple(out)


def tag(node: fx.Node, position) -> None:
    """Give a stamped random node the position :func:`reserve` took for it."""
    node.meta[META], node.meta[PHASE] = position


def traced_with_positions(trace) -> fx.GraphModule:
    """``trace()`` (which returns a joint graph) with every random node tagged with its position."""
    log = _Log()
    with _recording(log):
        gm = trace()
    log.sync_final(gm)
    _refuse_computed_states(gm, log)
    return gm


def _refuse_computed_states(gm: fx.GraphModule, log: _Log) -> None:
    """A state ``get_rng_state`` returned is a real tensor: computed with, it is a constant of the
    graph, which would hold the stream as it stood at capture on every call."""
    for node in gm.graph.find_nodes(op="get_attr") if log.lines else ():
        t = getattr(gm, node.target, None)
        if type(t) is torch.Tensor and t.device.type != "meta" and t.untyped_storage().data_ptr() in log.lines:
            raise errors.UnsupportedError(
                "the traced code computes with an RNG state it took (torch.get_rng_state()): the graph would hold "
                "the state as it stood at capture on every call; only restoring it (set_rng_state) is replayed",
                user_line=log.lines[t.untyped_storage().data_ptr()])


def node_device(n: fx.Node) -> str:
    """The device a node's value lives on (its first value's, for a tuple)."""
    val = n.meta.get("val")
    val = val[0] if isinstance(val, (tuple, list)) and val else val
    return _device(getattr(val, "device", None))
