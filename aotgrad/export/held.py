"""A loaded whole training step's state, held as eager holds it: each parameter's ``.grad`` on the
loaded parameters, and real ``torch.optim`` optimizers over them whose ``param_groups`` and
``state`` the step reads before each call and writes after it (``inputs.step.Binding``). A
scheduler can drive their learning rates and ``state_dict()`` / ``load_state_dict()`` are torch's.

The artifact holds the step's state argument as data: its tensors as ``step/<leaf>`` and its
other leaves (the hyperparameters) as the signature's constants; the manifest's ``step`` entry names
each optimizer's class and which parameters each of its groups holds.
"""
from __future__ import annotations

import torch

from .._torch import pytree
from ..errors import ExportFormatError
from ..inputs.step import Binding


class LoadedBinding(Binding):
    """A ``Binding`` over the loaded module's parameters and optimizers rebuilt from the artifact. Its
    groups hand the step only the entries the trace saw: a key added later (a scheduler's
    ``initial_lr``) was not in the group when traced, so the graph never read it."""

    made = "the export"
    remedy = "export it again"
    first_step = "export a step captured after one eager step, with zero_grad inside it"

    def __init__(self, root, optimizers: list, name: str, group_keys: list):
        fn = _named(name)
        super().__init__(root, optimizers, fn)
        self.group_keys = group_keys

    def reach(self) -> list:
        """What each call checks, less the optimizers' step functions: the update is in the graph, and a
        scheduler made after loading wraps ``step`` on the instance."""
        return [r for r in super().reach() if not r[0].endswith("step function")]

    def install(self, result):
        for opt in self.optimizers:     # the update ran: an LR scheduler checks that the optimizer stepped
            opt._opt_called = True
        return super().install(result)

    def gather(self) -> dict:
        state = super().gather()
        for key, keys in zip(self.keys, self.group_keys):
            groups = state["optimizer"][key]["groups"]
            state["optimizer"][key]["groups"] = tuple({k: g[k] for k in kept if k in g}
                                                      for g, kept in zip(groups, keys))
        return state


def bind(module: torch.nn.Module, entry, signature, tensors: dict, name: str, item_only=frozenset()) -> LoadedBinding:
    """The loaded step's state from the artifact: ``.grad`` set on ``module``'s parameters, each
    optimizer built over them with its stored groups and per-parameter state. ``item_only``: the state
    leaves the graph reads only with ``.item()`` (a learning rate the group held as a float)."""
    spec = signature.in_spec.children()[0].children()[0]
    tensor_pos = set(signature.tensor_pos)
    leaves = []
    for i in range(spec.num_leaves):
        if i in tensor_pos and f"step/{i}" not in tensors:
            raise ExportFormatError(f"the artifact holds no value for the training step's state leaf {i}")
        leaves.append(tensors[f"step/{i}"] if i in tensor_pos else signature.leaves[i])
    state, where = pytree.tree_unflatten(leaves, spec), pytree.tree_unflatten(list(range(spec.num_leaves)), spec)
    if not isinstance(entry, dict) or not isinstance(state, dict) or set(state) != {"grad", "optimizer"} \
            or not isinstance(entry.get("optimizers"), list) or not isinstance(entry.get("parameters"), list):
        raise ExportFormatError("the artifact's training step entry is malformed")
    params = {n: module.get_parameter(n) for n in entry["parameters"]}
    optimizers, group_keys = [], []
    for o in entry["optimizers"]:
        held = state["optimizer"].get(o.get("key")) if isinstance(o, dict) else None
        if held is None or not _fits(o, held, where["optimizer"][o["key"]], item_only):
            raise ExportFormatError(f"the artifact's optimizer entry {str(o)[:80]} does not match its state and graph")
        groups = [{**g_in, "lr": g_in["lr"] if meta["tensor_lr"] else g_in["lr"].item(),
                   "params": [params[n] for n in meta["params"]]} for meta, g_in in zip(o["groups"], held["groups"])]
        opt = _optimizer_class(o["class"], o["module"])(groups)
        if any(set(g) != {*g_in, "params"} for g, g_in in zip(opt.param_groups, held["groups"])):
            raise ExportFormatError(f"the artifact's optimizer {o['key']} is a {o['class']}, whose groups hold other "
                                    "hyperparameters than its state's")
        for n, st in held["state"].items():
            if st is not None:
                opt.state[params[n]] = dict(st)
        optimizers.append(opt)
        group_keys.append([tuple(g) for g in held["groups"]])
    for n, g in state["grad"].items():
        params[n].grad = g
    binding = LoadedBinding(module, optimizers, name, group_keys)
    if binding.names != tuple(entry["parameters"]) or list(binding.keys) != [o["key"] for o in entry["optimizers"]]:
        raise ExportFormatError("the artifact's training step names other parameters or optimizers than its state")
    return binding


def _fits(o: dict, held: dict, where: dict, item_only) -> bool:
    """The manifest's optimizer entry says what its state and graph say: one group per held group, its
    parameters those the state lists (in order), its learning rate a tensor exactly where the graph
    uses it as one (a float's is read with ``.item()`` only)."""
    groups = o.get("groups")
    if not isinstance(groups, list) or len(groups) != len(held["groups"]) or not all(
            isinstance(g, dict) and type(g.get("tensor_lr")) is bool and isinstance(g.get("params"), list)
            and isinstance(g_in.get("lr"), torch.Tensor) for g, g_in in zip(groups, held["groups"])):
        return False
    return [n for g in groups for n in g["params"]] == list(held["state"]) and all(
        g["tensor_lr"] == (w["lr"] not in item_only) for g, w in zip(groups, where["groups"]))


def _optimizer_class(name: str, module: str):
    """``torch.optim``'s class of that name; for an optimizer defined elsewhere (the user's code, which
    a loaded step does without) a stand-in of the same name that holds groups and state only."""
    if not isinstance(name, str) or not name.isidentifier() or not isinstance(module, str):
        raise ExportFormatError(f"the artifact names an optimizer class {str(name)[:60]!r}")
    cls = getattr(torch.optim, name, None)
    if module.startswith("torch.optim") and isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer):
        if cls.__module__ != module:
            raise ExportFormatError(f"the artifact names torch.optim.{name} in module {module!r:.60}, not its own")
        return cls

    def step(self, closure=None):
        raise NotImplementedError(f"{name} is a stand-in holding a loaded step's optimizer state; its update is "
                                  "in the step's graph: call the loaded step")
    return type(name, (torch.optim.Optimizer,), {"__init__": lambda self, groups: torch.optim.Optimizer.__init__(
        self, groups, {}), "step": step, "__module__": __name__})


def _named(name: str):
    def exported_step(*args, **kwargs):
        raise ExportFormatError("a loaded training step runs its graphs, not this function")
    exported_step.__name__ = name if isinstance(name, str) and name.isidentifier() else "exported_step"
    return exported_step
