"""The pipeline's stage objects: Setup -> Captured -> Compiled | Exported.

Each is immutable once built and moves forward by a method.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Callable

import torch
import torch.fx as fx

from ._torch import pytree
from . import errors
from .observe import Step
from .errors import OptionError, caller_line
from .ir.records import HookRecord
from .options import CompileOptions, keywords_checked, refuse_unknown
from .partition import Partition
from .runtime.modes import mismatch

if TYPE_CHECKING:       # annotations only: the stages do not import the layers that build them
    from .capture.session import Session
    from .inputs.flatten import Rebase
    from .inputs.flatten import Signature
    from .guards.inputs import InputGuards
    from .guards.state import StateGuards
    from .ir.records import Analysis, JointLayout
    from .partition import Partition
    from .runtime.call import CallPath


@dataclass(frozen=True)
class Modes:
    """The modes a trace ran under: all that a captured stage keeps of its tracing session."""
    dynamic: bool | None
    grad_enabled: bool
    baked: tuple | None = None     # runtime.modes.baked() when traced; None: not known (a jit disk-cache entry: jit keys its entries by modes)
    function_modes: tuple | None = None     # runtime.modes.function_modes() when traced (None: not known, as baked)


@dataclass(frozen=True, repr=False)
class Setup:
    """Stage 0: the user's call flattened, with fake inputs in a tracing session.

    ``flat_fn(*tensors)`` returns the output leaves as a list whose ``spec`` is their tree
    structure (``inputs.flatten.Outputs``). ``session``, ``fake_inputs`` and ``real_inputs``
    serve tracing only: the ``Setup`` a ``Captured`` holds (:meth:`traced`) keeps the session's
    ``Modes`` and neither the user's batch nor the fake inputs.
    """
    fn: Any                      # the user's function or module
    signature: Signature
    input_descs: tuple           # Desc per flat input
    flat_fn: Callable
    session: Session | Modes
    fake_inputs: tuple
    real_inputs: tuple
    rebase: Rebase | None = None  # when aliased inputs are mutated

    def traced(self) -> "Setup":
        """What a ``Captured`` keeps: no example batch, no fake inputs, no live session (its fake
        mode and shape environment live on only in the graph's node values)."""
        return replace(self, session=Modes(self.session.dynamic, self.session.grad_enabled,
                                                 getattr(self.session, "baked", None),
                                                 getattr(self.session, "function_modes", None)),
                       fake_inputs=(), real_inputs=())

    def __repr__(self) -> str:
        from .observe.printing import repr_setup
        return repr_setup(self)


@dataclass(frozen=True, repr=False)
class Captured:
    """Stage 1: the joint forward+backward graph and what it does to its inputs.

    ``joint`` takes ``(*primals, *tangents)`` and returns ``(*forward_values, *grads)``;
    ``input_descs``/``output_descs`` name each of them.
    """
    setup: Setup
    joint: fx.GraphModule
    analysis: Analysis
    layout: JointLayout
    guards: InputGuards
    out_spec: pytree.TreeSpec
    input_descs: tuple
    output_descs: tuple
    history: tuple[Step, ...]
    state: StateGuards | None = None     # Python state the trace read (``capture`` only)
    step: object = None     # a whole training step's ``inputs.step.Binding``: state gathered and installed per call
    hooks: HookRecord = HookRecord()    # what the program registers for autograd (``runtime.hooks``)

    @property
    def is_inference(self) -> bool:
        return self.layout.is_inference

    @property
    def flat_joint(self) -> fx.GraphModule:
        """``joint`` with every call of a repeated block's half (``block0_forward(...)``) replaced by
        a copy of the half's nodes: every operator the program runs, as a flat trace would have them."""
        from .partition.blocks import inline_calls
        return inline_calls(self.joint)

    def compile(self, fw_compiler="eager", bw_compiler=None, partitioner="auto",
                memory_budget=None, *, options: CompileOptions | None = None, **more) -> "Compiled":
        """Partition and compile, with keyword options or one ``options`` (``aotgrad.options.CompileOptions``,
        which documents each; ``cudagraphs={...}`` too). ``memory_budget``: a fraction [0, 1] of the
        default partitioner's saved bytes, or a predicted peak in bytes (an int above 1, or ``"4MB"``,
        ``"512KiB"``: met or ``BudgetError``); ``partitioner="auto"`` then is the budgeted
        min cut (and the min cut for the Inductor compiler). A misspelt option is an ``OptionError``.
        Nothing is written to disk (``aotgrad.jit`` keeps the disk cache)."""
        from .compile import compile_parts
        from .ir.values import VALUES, with_values
        if options is None:
            options = CompileOptions.of("compile", fw_compiler=fw_compiler, bw_compiler=bw_compiler,
                                        partitioner=partitioner, memory_budget=memory_budget, **more)
        elif more:
            raise OptionError(f"compile got options= and keyword options {sorted(more)}: give one or the other",
                              user_line=caller_line())
        if VALUES in self.joint.meta and (options.compiles_with("inductor")
                                          or not isinstance(options.resolved_partitioner(), Partition)):
            with_values(self.joint)     # a joint loaded from the disk cache: partitioners read its values
        return Compiled(self, *compile_parts(self, options))

    def export(self, path: str, *, values: bool = True, partitioner="auto", memory_budget=None, **more) -> str:
        """Write this training step to ``path`` as data (``docs/export-format.md``); ``aotgrad.load(path)``
        runs it in another process without the model's code. ``values=False`` leaves out parameter values."""
        from .store.artifact import export
        if more:    # export compiles nothing: only the partition options apply
            refuse_unknown("export", more, ["values", "partitioner", "memory_budget"])
        opts = CompileOptions(partitioner=partitioner, memory_budget=memory_budget)    # checked before writing
        return export(self, path, values=values, partitioner=opts.resolved_partitioner(), memory_budget=memory_budget)

    @keywords_checked("with_joint")
    def with_joint(self, gm: fx.GraphModule) -> "Captured":
        """The same capture with a user-edited joint graph, after checking its contract."""
        from .ir.verify import verify_joint
        verify_joint(gm, self)
        step = Step("with_joint", 0.0, {"nodes": len(gm.graph.nodes)})
        return replace(self, joint=gm, history=self.history + (step,))

    def explain(self) -> str:
        """Stages with durations, the joint graph's size and the guards (``aotgrad.explain``)."""
        from .observe.explain import explain_captured
        return explain_captured(self)

    def __str__(self) -> str:
        from .observe.printing import format_captured
        return format_captured(self)

    def __repr__(self) -> str:
        from .observe.printing import repr_captured
        return repr_captured(self)


@dataclass(frozen=True, repr=False)
class Compiled:
    """Stage 2: compiled forward and backward, callable like the original function."""
    captured: Captured
    partition: Partition | None  # None for an inference graph
    forward_graph: fx.GraphModule
    backward_graph: fx.GraphModule | None
    path: CallPath               # match(args, kwargs), run(flat)
    history: tuple[Step, ...]

    def __call__(self, *args, **kwargs):
        if self.captured.step is not None:      # a training step: its optimizer's and .grad state around the call
            return self.captured.step.around(self._call, args, kwargs)
        return self._call(*args, **kwargs)

    def _call(self, *args, **kwargs):
        session = self.captured.setup.session
        why = mismatch(session.baked, session.function_modes) if session.baked is not None else None
        if why is not None:
            raise errors.InputMismatchError(f"{why}; capture again under these modes (aotgrad.jit recompiles "
                                            "for you)", user_line=caller_line())
        state = self.captured.state
        failed = state.check() if state is not None else None
        if failed is not None:
            raise errors.InputMismatchError(f"{state.explain(failed)}; capture again "
                                            "(aotgrad.jit recompiles for you)", user_line=caller_line())
        flat, why = self.path.match(args, kwargs)
        if why is not None:
            raise errors.InputMismatchError(why + "; capture again for these inputs (aotgrad.jit does it for you)",
                                            user_line=caller_line())
        return self.path.run(flat)

    @property
    def saved(self) -> tuple:
        return self.partition.saved if self.partition else ()

    @property
    def memory(self):
        """Predicted memory: ``saved_bytes``, ``peak_bytes``, ``saved`` (one entry per
        saved tensor) and ``recompute_flops``; ``None`` for an inference graph."""
        from .ir.values import with_values
        from .partition import estimate
        if self.partition is None:
            return None
        with_values(self.forward_graph), with_values(self.backward_graph)
        return estimate(self.partition)

    def program(self) -> str:
        """The step as the Python a call runs: prologue (modes, Python state, arguments, input guards),
        forward graph, epilogue, and the backward graph. ``print(step.program())``."""
        from .observe.printing import format_program
        return format_program(self)

    def explain(self) -> str:
        """Stages with durations, graph sizes, saved activations and guards (``aotgrad.explain``)."""
        from .observe.explain import explain_compiled
        return explain_compiled(self)

    def compiled_entries(self) -> list:
        """``[(compiled, why it was compiled)]``: what a report shows (a ``Jit`` has one per entry)."""
        return [(self, None)]

    def summary(self) -> None:
        """A ``Jit``'s account of its entries; a ``Compiled`` is one entry and has none."""
        return None

    def __str__(self) -> str:
        from .observe.printing import format_compiled
        return format_compiled(self)

    def __repr__(self) -> str:
        from .observe.printing import repr_compiled
        return repr_compiled(self)


@dataclass(frozen=True, repr=False)
class Exported:
    """Stage 2, from disk: a training step loaded by ``aotgrad.load(path)``, run without the model's code.

    ``loss = step(*batch)``; ``loss.backward()`` fills ``.grad`` of ``step.parameters()`` (hand them to
    an optimizer); buffers (BatchNorm's running statistics) are updated in place in ``step.buffers()``.
    A whole training step (its function called the optimizer) updates its parameters itself: its
    optimizers (``step.optimizers``, torch's, over ``step.parameters()``) hold their state here.
    """
    path: str
    manifest: Any                # the artifact's manifest, read-only (see docs/export-format.md)
    state: Any                   # torch.nn.Module holding the parameters and buffers by name
    compiled: Compiled
    binding: Any = None          # a whole training step's optimizers and .grad (export.held.LoadedBinding)

    def __call__(self, *args, **kwargs):
        if self.binding is None:
            return self._call(args, kwargs)
        return self.binding.around(lambda *a, **k: self._call(a, k), args, kwargs)

    @property
    def optimizers(self) -> dict:
        """A whole training step's optimizers by name (``"AdamW0"``): their ``param_groups`` (the learning
        rate a scheduler may change; other hyperparameters are in the graph) and ``state``."""
        return dict(zip(self.binding.keys, self.binding.optimizers)) if self.binding is not None else {}

    def _call(self, args, kwargs):
        session = self.compiled.captured.setup.session
        why = mismatch(session.baked, session.function_modes)
        if why is not None:
            raise errors.InputMismatchError(f"{why}; an exported step runs under the modes it was exported under, "
                                            "and under no torch function mode: export it again under these "
                                            "modes, or call it outside the function modes", user_line=caller_line())
        flat, why = self.compiled.path.match(args, kwargs)
        if why is not None:
            raise errors.InputMismatchError(f"{why}; an exported step runs only the inputs and grad mode it "
                                            "was captured for: export one per input shape and mode",
                                            user_line=caller_line())
        try:
            return self.compiled.path.run(flat)
        except torch.linalg.LinAlgError:
            raise       # eager's own error for an input's values (a singular matrix), from the graph's check
        except (RuntimeError, IndexError, ValueError) as e:     # a check only running tensors make
            raise errors.ExportFormatError(f"the loaded step failed as it ran: {str(e)[:300]} (the artifact asks "
                                           "an operator or an input write for a value it refuses, or an input's "
                                           "values are out of its range)") from e

    def program(self) -> str:
        """The loaded step as the Python a call runs (``Compiled.program``)."""
        return self.compiled.program()

    def explain(self) -> str:
        return self.compiled.explain()

    def named_parameters(self):
        return self.state.named_parameters()

    def parameters(self):
        return self.state.parameters()

    def named_buffers(self):
        return self.state.named_buffers()

    def buffers(self):
        return self.state.buffers()

    def state_dict(self) -> dict:
        """The parameters and buffers by name. A whole training step's is keyed like a checkpoint of
        eager training: each module by the name the step reached it under, and ``"optimizers"``:
        ``{"model": model.state_dict(), "optimizers": {"AdamW0": opt.state_dict()}}``."""
        if self.binding is None:
            return self.state.state_dict()
        return {**{n: m.state_dict() for n, m in self.state.named_children()},
                "optimizers": {k: o.state_dict() for k, o in self.optimizers.items()}}

    def load_state_dict(self, state_dict: dict) -> None:
        """Copy values in (``state_dict()``'s form): the parameters keep their memory and layout."""
        if self.binding is None:
            self.state.load_state_dict(state_dict)
            return
        want = {*dict(self.state.named_children()), "optimizers"}
        if set(state_dict) != want or set(state_dict["optimizers"]) != set(self.optimizers):
            raise errors.InputMismatchError(f"this training step's state_dict has the keys {sorted(want)} (and "
                                            f"optimizers {sorted(self.optimizers)}), not {sorted(state_dict)}",
                                            user_line=caller_line())
        for n, m in self.state.named_children():
            m.load_state_dict(state_dict[n])
        for k, o in self.optimizers.items():
            o.load_state_dict(state_dict["optimizers"][k])

    def __repr__(self) -> str:
        n_p, n_b = len(list(self.parameters())), len(list(self.buffers()))
        return (f"Exported({self.manifest['name']!r} from {self.path!r}: {self.manifest['kind']}, "
                f"{n_p} parameters, {n_b} buffers)")

    def __str__(self) -> str:
        from .store.inspect import format_exported
        return format_exported(self)
