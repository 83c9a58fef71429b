"""Whole training steps: a function that calls ``loss.backward()``, the optimizer's ``step()`` and
``zero_grad()`` is captured as one graph (``aotgrad/inputs/step.py``).

Each case is ``(make, steps)``: ``make()`` builds a fresh model, optimizer and batch under one seed
and returns ``(step_fn, objects, between)``; ``objects`` are the modules and optimizers whose state
the comparison reads, ``between(i)`` runs between steps (a scheduler). The twins differ in one
thing a whole-step capture could get wrong: state the optimizer creates on its first step, a
learning rate a scheduler changes, gradients accumulated over two backwards, ``.grad`` zeroed in
place or set to None (before or after the update), a frozen parameter, a parameter the loss does
not reach (no gradient: the optimizer skips it), two optimizers, tied weights, BatchNorm buffers,
dropout (eager's random stream), gradient clipping, optimizer state loaded back between steps.
"""
from __future__ import annotations

import torch
import torch.nn as nn

CASES: dict = {}
OPTIMIZERS = {
    "sgd": lambda p: torch.optim.SGD(p, lr=0.1),
    "sgd_momentum_nesterov_wd": lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, nesterov=True,
                                                          weight_decay=0.01),
    "adam": lambda p: torch.optim.Adam(p, lr=0.01),
    "adam_amsgrad_maximize": lambda p: torch.optim.Adam(p, lr=0.01, amsgrad=True, maximize=True),
    "adam_foreach": lambda p: torch.optim.Adam(p, lr=0.01, foreach=True),
    "adamw": lambda p: torch.optim.AdamW(p, lr=0.01, weight_decay=0.1),
    "adamw_foreach": lambda p: torch.optim.AdamW(p, lr=0.01, weight_decay=0.1, foreach=True),
    "rmsprop_centered_momentum": lambda p: torch.optim.RMSprop(p, lr=0.01, momentum=0.5, centered=True),
    "adagrad": lambda p: torch.optim.Adagrad(p, lr=0.1, lr_decay=0.01),
}


def case(name, steps=5):
    def register(make):
        CASES[name] = (make, steps)
        return make
    return register


def _mlp(d=6, dropout=0.0, norm=False):
    layers = [nn.Linear(d, 8), nn.Tanh()]
    layers += [nn.BatchNorm1d(8)] if norm else []
    layers += [nn.Dropout(dropout)] if dropout else []
    return nn.Sequential(*layers, nn.Linear(8, 1))


def _batch(n=12, d=6):
    return torch.randn(n, d), torch.randn(n, 1)


def _plain(opt_name, *, clip=None, zero="end", set_to_none=True, accumulate=1, dropout=0.0, norm=False,
           frozen=False, unused=False, scheduler=False):
    def make():
        model = _mlp(dropout=dropout, norm=norm)
        if frozen:
            model[0].bias.requires_grad_(False)
        spare = nn.Linear(3, 3) if unused else None
        params = list(model.parameters()) + (list(spare.parameters()) if unused else [])
        opt = OPTIMIZERS[opt_name](params)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5) if scheduler else None
        x, y = _batch()
        holder = nn.ModuleList([model] + ([spare] if unused else []))

        def step(x, y):
            if zero == "start":
                opt.zero_grad(set_to_none=set_to_none)
            for k in range(accumulate):
                loss = ((holder[0](x[k::accumulate]) - y[k::accumulate]) ** 2).mean() / accumulate
                loss.backward()
            if clip is not None:
                torch.nn.utils.clip_grad_norm_(holder[0].parameters(), clip)
            opt.step()
            if zero == "end":
                opt.zero_grad(set_to_none=set_to_none)
            return loss
        return step, (x, y), [holder, opt], (lambda i: sched.step()) if sched else None
    return make


for _name in OPTIMIZERS:
    case(_name)(_plain(_name))
case("adam_clip")(_plain("adam", clip=0.05))
case("adamw_accumulate_clip")(_plain("adamw", accumulate=2, clip=0.5))
case("sgd_momentum_zero_in_place")(_plain("sgd_momentum_nesterov_wd", set_to_none=False))
case("adam_zero_first")(_plain("adam", zero="start"))
case("adam_zero_first_in_place")(_plain("adam", zero="start", set_to_none=False))
case("adam_never_zeroed")(_plain("adam", zero="never"))
case("adam_scheduler", steps=6)(_plain("adam", scheduler=True))
case("sgd_scheduler_momentum", steps=6)(_plain("sgd_momentum_nesterov_wd", scheduler=True))
case("adamw_frozen_bias")(_plain("adamw", frozen=True))
case("adam_unused_module")(_plain("adam", unused=True))
case("adam_dropout")(_plain("adam", dropout=0.3))
case("sgd_batchnorm")(_plain("sgd_momentum_nesterov_wd", norm=True))
case("rmsprop_accumulate3")(_plain("rmsprop_centered_momentum", accumulate=3))


def _set_hyper(opt_name, **values):
    """A twin whose other hyperparameters change between steps (by hand, or as OneCycleLR's momentum
    cycling does): each is baked into the trace, so the graph must not be reused after a change."""
    def make():
        step, args, objects, _ = _plain(opt_name)()

        def between(i):
            if i == 1:
                objects[1].param_groups[0].update(values)
        return step, args, objects, between
    return make


def _reloaded(opt_name):
    """A twin whose optimizer state is loaded back between steps (a checkpoint restored): the same
    values in new tensor objects, which the step must read and write from then on."""
    def make():
        import copy
        step, args, objects, _ = _plain(opt_name)()

        def between(i):
            if i == 1:
                objects[1].load_state_dict(copy.deepcopy(objects[1].state_dict()))
        return step, args, objects, between
    return make


case("adam_state_reloaded")(_reloaded("adam"))
case("sgd_momentum_state_reloaded")(_reloaded("sgd_momentum_nesterov_wd"))
case("adamw_betas_weight_decay_changed")(_set_hyper("adamw", betas=(0.5, 0.9), weight_decay=0.5))
case("sgd_momentum_changed")(_set_hyper("sgd_momentum_nesterov_wd", momentum=0.5))
case("adam_maximize_eps_changed")(_set_hyper("adam", maximize=True, eps=1e-3))


@case("two_optimizers")
def _two_optimizers():
    enc, head = nn.Linear(6, 8), nn.Linear(8, 1)
    o1, o2 = torch.optim.Adam(enc.parameters(), lr=0.01), torch.optim.SGD(head.parameters(), lr=0.1, momentum=0.9)
    x, y = _batch()

    def step(x, y):
        loss = ((head(enc(x).relu()) - y) ** 2).mean()
        loss.backward()
        o1.step()
        o2.step()
        o1.zero_grad()
        o2.zero_grad()
        return loss
    return step, (x, y), [enc, head, o1, o2], None


@case("tied_weights")
def _tied():
    emb = nn.Embedding(10, 6)
    out = nn.Linear(6, 10, bias=False)
    out.weight = emb.weight
    model = nn.ModuleDict({"emb": emb, "out": out})
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    tokens = torch.randint(0, 10, (4, 5))

    def step(tokens):
        logits = model["out"](model["emb"](tokens[:, :-1]))
        loss = nn.functional.cross_entropy(logits.reshape(-1, 10), tokens[:, 1:].reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.detach(), logits.argmax(-1)
    return step, (tokens,), [model, opt], None


class Trainer:
    """A step as a method: the model and optimizer reached through ``self``."""

    def __init__(self):
        self.model = _mlp()
        self.opt = torch.optim.Adam(self.model.parameters(), lr=0.01)

    def step(self, x, y):
        loss = ((self.model(x) - y) ** 2).mean()
        loss.backward()
        self.opt.step()
        self.opt.zero_grad()
        return {"loss": loss}


@case("bound_method")
def _method():
    t = Trainer()
    return t.step, _batch(), [t.model, t.opt], None


class MomentumSGD(torch.optim.Optimizer):
    """An optimizer the user wrote: a subclass with its own ``step()``, state made on its first step."""

    def __init__(self, params, lr=0.1, momentum=0.9):
        super().__init__(params, dict(lr=lr, momentum=momentum))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                st = self.state[p]
                if "buf" not in st:
                    st["buf"] = p.grad.clone()
                else:
                    st["buf"].mul_(group["momentum"]).add_(p.grad)
                p.add_(st["buf"], alpha=-group["lr"])


@case("user_optimizer")
def _user_optimizer():
    model = _mlp()
    opt = MomentumSGD(model.parameters(), lr=0.05)
    x, y = _batch()

    def step(x, y):
        loss = ((model(x) - y) ** 2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.detach()
    return step, (x, y), [model, opt], None


def _scaled(g):
    return g * 0.5


def _clamped(p):
    p.grad.clamp_(-0.05, 0.05)


@case("param_grad_hooks")
def _param_grad_hooks():
    """Hooks registered on the parameters before the step: eager's AccumulateGrad runs them."""
    model = _mlp()
    for p in model.parameters():
        p.register_hook(_scaled)
        p.register_post_accumulate_grad_hook(_clamped)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    x, y = _batch()

    def step(x, y):
        loss = ((model(x) - y) ** 2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.detach()
    return step, (x, y), [model, opt], None


@case("flat_grad_buffer")
def _flat_grad_buffer():
    """Gradient-as-bucket-view: every ``.grad`` a view of one flat buffer, zeroed in place, the
    buffer's norm read after ``backward()``."""
    model = _mlp()
    flat = torch.zeros(sum(p.numel() for p in model.parameters()))
    at = 0
    for p in model.parameters():
        p.grad = flat[at:at + p.numel()].view_as(p)
        at += p.numel()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    x, y = _batch()

    def step(x, y):
        loss = ((model(x) - y) ** 2).mean()
        loss.backward()
        norm = flat.norm()
        opt.step()
        opt.zero_grad(set_to_none=False)
        return loss.detach(), norm
    return step, (x, y), [model, opt], None
