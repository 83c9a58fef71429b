"""A whole training step captured as one graph: what is refused (typed, before anything runs, with
nothing of the user's changed) and what a staged capture says when the step's state changed.
The numbers are compared with eager in ``tests/differential/test_step.py``."""
import pytest
import torch
import torch.nn as nn

import aotgrad
from aotgrad import errors


def _setup(opt_cls=torch.optim.Adam, **kw):
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    opt = opt_cls(model.parameters(), **kw)
    return model, opt, torch.randn(8, 4), torch.randn(8, 1)


def _train_step(model, opt):
    """A plain step closing over the model and optimizer (how the step path finds them)."""
    def step(x, y):
        loss = ((model(x) - y) ** 2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss
    return step


def _unchanged(model, opt):
    """What a failed capture must leave as it was: the values, .grad, the optimizer's groups and state."""
    return ([p.detach().clone() for p in model.parameters()], [p.grad for p in model.parameters()],
            [list(g["params"]) for g in opt.param_groups], [dict(g) for g in opt.param_groups],
            {id(p): dict(s) for p, s in opt.state.items()}, "step" in opt.__dict__)


def _same(a, b):
    values, grads, params, groups, state, patched = a
    values2, grads2, params2, groups2, state2, patched2 = b
    assert all(torch.equal(x, y) for x, y in zip(values, values2))
    assert all(x is y for x, y in zip(grads, grads2))
    assert all(all(p is q for p, q in zip(g, h)) for g, h in zip(params, params2))
    assert [{k: v for k, v in g.items() if k != "params"} for g in groups] == \
        [{k: v for k, v in g.items() if k != "params"} for g in groups2]
    assert state.keys() == state2.keys() and patched == patched2


def _refused(step, model, opt, *args, match):
    before = _unchanged(model, opt)
    rng = torch.random.get_rng_state()
    with pytest.raises(errors.UnsupportedError, match=match):
        aotgrad.capture(step, *args)
    _same(before, _unchanged(model, opt))
    assert torch.equal(rng, torch.random.get_rng_state())


def test_lbfgs_is_refused():
    model, opt, x, y = _setup(torch.optim.LBFGS)

    def step(x, y):
        def closure():
            opt.zero_grad()
            loss = ((model(x) - y) ** 2).mean()
            loss.backward()
            return loss
        return opt.step(closure)
    _refused(step, model, opt, x, y, match="LBFGS")


def test_scheduler_inside_the_step_is_refused():
    model, opt, x, y = _setup(lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)

    def step(x, y):
        ((model(x) - y) ** 2).mean().backward()
        opt.step()
        sched.step()
        opt.zero_grad()
    step(x, y)      # the optimizer's state exists
    _refused(step, model, opt, x, y, match="learning rate inside the captured")


def test_double_backward_inside_the_step_is_refused():
    model, opt, x, y = _setup()

    def step(x, y):
        ((model(x) - y) ** 2).mean().backward(create_graph=True)
        opt.step()
    _refused(step, model, opt, x, y, match="create_graph")


def test_backward_into_an_input_is_refused():
    model, opt, x, y = _setup()
    x.requires_grad_()

    def step(x, y):
        ((model(x) - y) ** 2).mean().backward()
        opt.step()
        opt.zero_grad()
    _refused(step, model, opt, x, y, match="not a parameter of a module")


def test_optimizer_over_tensors_the_step_cannot_reach_is_refused():
    model, opt, x, y = _setup()
    forward = model.forward       # the module is reached only through a bound method of it

    def step(x, y):
        ((forward(x) - y) ** 2).mean().backward()
        opt.step()
    _refused(step, model, opt, x, y, match="not a parameter of a module step reaches")


def test_step_hooks_are_refused():
    model, opt, x, y = _setup()
    opt.register_step_post_hook(lambda *a: None)

    def step(x, y):
        ((model(x) - y) ** 2).mean().backward()
        opt.step()
    _refused(step, model, opt, x, y, match="step hooks")


def test_staged_capture_says_the_state_changed():
    """Captured before the optimizer's first step, the graph creates its state; the second call has it."""
    model, opt, x, y = _setup()

    step = _train_step(model, opt)
    compiled = aotgrad.capture(step, x, y).compile()
    compiled(x, y)
    assert set(opt.state[model.weight]) == {"step", "exp_avg", "exp_avg_sq"}
    with pytest.raises(errors.InputMismatchError, match="capture after one eager step, or use aotgrad.jit"):
        compiled(x, y)


def test_returned_loss_cannot_be_backwarded_again():
    """Eager's loss still requires grad after the step, and its graph is freed: so is ours."""
    model, opt, x, y = _setup()

    step = _train_step(model, opt)
    loss = aotgrad.jit(step)(x, y)
    assert loss.requires_grad and not loss.is_leaf
    with pytest.raises(RuntimeError, match="backward through the graph a second time"):
        loss.backward()
    eager = step(x, y)
    with pytest.raises(RuntimeError, match="backward through the graph a second time"):
        eager.backward()


def test_backward_with_the_deprecated_grad_variables_matches_eager():
    """``torch.autograd.backward(..., grad_variables=...)`` still scales the gradient in eager."""
    runs = []
    for compiled in (False, True):
        model, opt, x, y = _setup(torch.optim.SGD, lr=0.1)

        def step(x, y):
            loss = ((model(x) - y) ** 2).mean()
            torch.autograd.backward([loss], grad_variables=[torch.tensor(3.0)])
            opt.step()
            opt.zero_grad()
            return loss.detach()
        run = aotgrad.jit(step) if compiled else step
        with pytest.warns(FutureWarning, match="grad_variables"):     # as eager warns (when traced)
            run(x, y)
        runs.append([p.detach().clone() for p in model.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*runs))


@pytest.mark.parametrize("entry", ["jit", "capture"])
def test_param_groups_changed_after_binding_are_refused(entry):
    """A group added (or a group's params replaced) after the step was built would leave the new
    parameters out of the graph's update: refused, with the parameters untouched."""
    model, opt, x, y = _setup(torch.optim.SGD, lr=0.1)
    extra = nn.Linear(4, 1)
    step = _train_step(model, opt)
    step(x, y)
    compiled = aotgrad.jit(step) if entry == "jit" else aotgrad.capture(step, x, y).compile()
    compiled(x, y)
    opt.add_param_group({"params": list(extra.parameters()), "lr": 0.5})
    before = [p.detach().clone() for p in [*model.parameters(), *extra.parameters()]]
    # jit binds again, and refuses the new group's parameters, which no module the step reaches holds
    error, match = (errors.UnsupportedError, "not a parameter of a module") if entry == "jit" else \
        (errors.InputMismatchError, "SGD's parameter groups changed since the capture")
    with pytest.raises(error, match=match):
        compiled(x, y)
    assert all(torch.equal(a, b) for a, b in zip(before, [*model.parameters(), *extra.parameters()]))


@pytest.mark.parametrize("entry", ["jit", "capture"])
def test_parameter_replaced_after_binding_is_refused(entry):
    """A new tensor assigned to the module after the step was built: eager's forward uses it while
    the optimizer still updates (and zeroes the .grad of) the old one; the graph, which reads the
    module's tensor and the optimizer's state as one parameter, would train a mixture. Refused, with
    both tensors untouched."""
    model, opt, x, y = _setup(torch.optim.Adam, lr=0.1)
    step = _train_step(model, opt)
    step(x, y)
    compiled = aotgrad.jit(step) if entry == "jit" else aotgrad.capture(step, x, y).compile()
    compiled(x, y)
    old = model.weight
    model.weight = nn.Parameter(torch.ones(1, 4))
    before = [old.detach().clone(), model.weight.detach().clone()]
    error, match = (errors.UnsupportedError, "not a parameter of a module") if entry == "jit" else \
        (errors.InputMismatchError, "a parameter of the modules changed since the capture")
    with pytest.raises(error, match=match):
        compiled(x, y)
    assert torch.equal(before[0], old) and torch.equal(before[1], model.weight) and model.weight.grad is None


@pytest.mark.parametrize("opt_cls", [torch.optim.RAdam, torch.optim.ASGD])
def test_optimizer_branching_on_its_state_is_refused_by_name(opt_cls):
    """RAdam's eager path branches on ``rho_t > 5``, ASGD's on its ``mu``: values of its state."""
    model, opt, x, y = _setup(opt_cls)
    step = _train_step(model, opt)
    step(x, y)
    _refused(step, model, opt, x, y, match=rf"{opt_cls.__name__}.step\(\) branches in Python on a value")


_SWAPPED = {}


def _global_step(x, y):
    loss = ((_SWAPPED["model"](x) - y) ** 2).mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss


def test_reassigned_optimizer_is_captured_again():
    """A step bound to ``model``/``opt`` whose variable later names another object would train the
    old one: ``jit`` binds the new one and captures again (trained as eager trains it), a staged
    step refuses before anything runs, the new object untouched."""
    global opt
    runs = []
    for entry in ("eager", "jit", "capture"):
        model, opt, x, y = _setup(torch.optim.SGD, lr=0.1)
        _SWAPPED["model"] = model
        _global_step(x, y)
        g = {"eager": _global_step, "jit": aotgrad.jit(_global_step),
             "capture": aotgrad.capture(_global_step, x, y).compile()}[entry]
        g(x, y)
        opt = torch.optim.Adam(model.parameters(), lr=0.05)
        if entry == "capture":
            before = [p.detach().clone() for p in model.parameters()]
            with pytest.raises(errors.InputMismatchError, match="the modules and optimizers the step reaches changed"):
                g(x, y)
            assert all(torch.equal(a, b) for a, b in zip(before, model.parameters())) and not opt.state
            continue
        for _ in range(3):
            g(x, y)
        runs.append([p.detach().clone() for p in model.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*runs))
