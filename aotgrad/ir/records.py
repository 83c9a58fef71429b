"""What a traced program does to its inputs and how its outputs alias (found by
``capture.analyze``), and where each value sits in the joint graph: frozen data every layer reads.

The joint graph takes ``(*primals, *tangents)`` and returns ``(*forward_values, *grads)``; the
forward values are, in order, the new values of data-mutated inputs, the plain outputs and the
hidden bases of outputs that are views of intermediates.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from .._torch import known_true, view_base


def reach(size, stride, offset=0) -> int:
    """Elements of storage a view of ``size`` and ``stride`` at ``offset`` reaches: one past its last
    element (a negative stride reaches back, not past); 0 for a view with no element. A symbolic size
    or stride is read without a guard."""
    if any(known_true(n == 0) for n in size):
        return 0
    return offset + 1 + sum((n - 1) * s for n, s in zip(size, stride) if type(s) is not int or s > 0)


def reached_bytes(t: torch.Tensor) -> int:
    """Bytes of its storage tensor ``t`` reaches, its offset included (:func:`reach`)."""
    return reach(t.shape, t.stride(), t.storage_offset()) * t.element_size()


@dataclass(frozen=True)
class ViewMeta:
    """How to regenerate a view: ``base.as_strided(size, stride, offset)``; ``offset`` is
    absolute, or relative to the base's own storage offset when made by ``relative``
    (a frontend that does not guard storage offsets, Dynamo, may hand the same graph
    inputs at another offset)."""
    size: tuple
    stride: tuple
    offset: Any

    @staticmethod
    def of(t: torch.Tensor) -> "ViewMeta":
        return ViewMeta(tuple(map(symbolic, t.shape)), tuple(map(symbolic, t.stride())),
                        symbolic(t.storage_offset()))

    @staticmethod
    def relative(t: torch.Tensor, base: torch.Tensor) -> "ViewMeta":
        return ViewMeta(tuple(map(symbolic, t.shape)), tuple(map(symbolic, t.stride())),
                        symbolic(t.storage_offset() - base.storage_offset()))

    @property
    def is_static(self) -> bool:
        return all(isinstance(v, int) for v in (*self.size, *self.stride, self.offset))


def symbolic(v):
    """An int stays an int; a SymInt becomes its sympy expression (a fact, not a live symbol)."""
    if isinstance(v, torch.SymInt):
        expr = v.node.expr
        return int(expr) if expr.is_number else expr
    return int(v)


@dataclass(frozen=True)
class InputInfo:
    requires_grad: bool
    mutates_data: bool
    mutates_metadata: bool
    mutation_hidden: bool        # autograd saw no write (no_grad, .data, .detach()): replay without autograd
    new_meta: ViewMeta | None    # metadata after a metadata mutation
    meta_seen: bool = False      # autograd recorded the metadata mutation (``t_()`` of an input that requires
                                 # grad, with grad enabled): replayed with ``as_strided_`` under grad, as eager's
    sets_requires_grad: bool = False    # ``requires_grad_()`` inside on an input that did not require grad:
                                        # set on the caller's tensor before the graph runs (``requires_grad``
                                        # is then True: the graph differentiates it)
    new_storage: Any = None      # ``set_()`` swapped its storage: an ``OutputInfo`` of where it lies after the call,
                                 # in another input's storage (``input_view``) or in the forward value the graph
                                 # computes for it (``plain``; the input counts as data-mutated); replayed by
                                 # ``set_()`` on the caller's tensor (``new_meta`` is its layout)
    storage_resize: tuple | None = None     # ``(held, final)`` where the function resized its storage
                                            # (``untyped_storage().resize_()``, FSDP): whether it held the values on
                                            # entry (then guarded to), and the bytes the caller's is resized to
                                            # before any data write (none when it ends without room)

    @property
    def mutation_needs_autograd(self) -> bool:
        return self.mutates_data and not self.mutation_hidden


@dataclass(frozen=True)
class OutputInfo:
    """``kind``: ``plain`` (computed by the graph), ``input`` (is input ``index``),
    ``input_view`` (a view of input ``index``), ``input_detached`` (``x.detach()``: the input's
    storage, not a view), ``input_set`` (a tensor of its own over input ``index``'s storage: ``y.set_(x)``
    of a tensor made inside), ``output`` (the same object as
    output ``index``), ``output_view`` (a view of plain output ``index``),
    ``intermediate_view`` (a view of hidden base ``index``, an intermediate the
    graph also returns), ``constant`` (a non-tensor leaf, ``value``)."""
    kind: str
    index: int = -1
    view: ViewMeta | None = None
    requires_grad: bool = False
    value: Any = None
    is_leaf: bool = True         # no grad_fn (``requires_grad_()`` inside, or a factory with requires_grad=True)
    is_view: bool = False        # eager's output is a view (a ``plain`` one may come from the graph as one when it is not)
    replay: Any = None           # Replay of the view ops that made it, where they can be replayed


@dataclass(frozen=True)
class Analysis:
    inputs: tuple[InputInfo, ...]
    outputs: tuple[OutputInfo, ...]
    base_count: int                 # intermediate bases returned as extra outputs
    fake_outputs: tuple             # fake values of the graph's forward values (for tangents)
    fw_requires_grad: tuple         # whether each forward value requires grad
    out_spec: Any = None            # the outputs' tree structure (``Outputs.spec`` of the traced call)
    eager_saved: tuple = ()         # inputs eager's autograd saves for the backward (version-checked there)
    quiet_writes: tuple = ()        # inputs the program writes without a version bump (batch norm's statistics)
    eager_reruns: bool = False      # eager's autograd saved no tensor: a second backward through a call runs
    rewritten: tuple = ()           # (line, saved): a custom backward wrote a tensor it holds, saved or not
                                    # (runtime.hooks): a second backward through a call raises

    def mutated(self):
        return [i for i, info in enumerate(self.inputs) if info.mutates_data]

    def plain(self) -> list:
        """``(forward value index, OutputInfo)`` of each output the graph computes: forward values
        are the mutated inputs' new values, then the plain outputs, then hidden bases."""
        n_mut = len(self.mutated())
        return list(enumerate((o for o in self.outputs if o.kind == "plain"), start=n_mut))


@dataclass(frozen=True)
class JointLayout:
    """Positions in the joint graph's inputs and outputs."""
    n_primals: int
    tangent_of: tuple       # forward-value index each tangent belongs to
    n_fw: int               # forward values
    grad_of: tuple          # primal index each grad output belongs to
    mutated: tuple = ()     # primals whose data the runtime overwrites after the forward

    @property
    def is_inference(self) -> bool:
        return not self.grad_of


def layout(analysis: Analysis) -> JointLayout:
    """Tangents for the forward values that require grad as traced: under the captured grad mode and
    any ``no_grad``/``enable_grad`` region inside, so an ``enable_grad`` block called under an outer
    ``no_grad`` still gets a backward (the runtime then applies the graph with grad enabled)."""
    needs = [rg and (v.dtype.is_floating_point or v.dtype.is_complex)
             for v, rg in zip(analysis.fake_outputs, analysis.fw_requires_grad)]
    tangent_of = tuple(i for i, n in enumerate(needs) if n)
    grad_of = tuple(i for i, info in enumerate(analysis.inputs) if info.requires_grad) if tangent_of else ()
    if not grad_of:
        tangent_of = ()
    return JointLayout(len(analysis.inputs), tangent_of, len(analysis.fake_outputs), grad_of,
                       tuple(analysis.mutated()))


def forward_values(call_ins, outs, analysis: Analysis) -> list:
    """The graph's forward values from one run of the flat function."""
    mutated = [call_ins[i] for i in analysis.mutated()]
    plain = [o for o, info in zip(outs, analysis.outputs) if info.kind == "plain"]
    bases = [None] * analysis.base_count
    for o, info in zip(outs, analysis.outputs):
        if info.kind == "intermediate_view":
            bases[info.index] = view_base(o)
    return mutated + plain + bases


@dataclass(frozen=True)
class InputHook:
    """``flat input index``, the registering method's name, the hook (None for retain_grad)."""
    index: int
    method: str
    hook: Any
    line: str | None


@dataclass(frozen=True)
class HookRecord:
    """What a captured program registers for autograd to run later (``runtime.hooks``), as data:
    hooks on its inputs, replayed by every call; the ids (into ``runtime.hooks.HOOKS``) of hooks on
    intermediates, called by the graph's ``aotgrad::tensor_hook`` nodes; ``(output, slot, line)``
    of each returned tensor it called ``retain_grad()`` on; ``(output, input)`` of each input a
    custom Function returned as is."""
    input_hooks: tuple = ()
    graph_hooks: tuple = ()
    retained_outputs: tuple = ()
    returned_inputs: tuple = ()
