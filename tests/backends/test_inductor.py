"""The inductor delegate: our graphs through Inductor's graph compiler,
compared with eager. Inductor compiles C++ on CPU, so only the smallest
program runs in ``make test``; whole models are ``slow``."""
import importlib
import warnings

import pytest
import torch
import torch.fx as fx
import torch.nn.functional as F

import aotgrad
from aotgrad._torch import FakeTensorMode
from examples import models
from tests.core.test_block_reuse import make_stack
from tests.eager_check import check, check_training


def test_small_function_forward_and_backward():
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="aotgrad inductor backend")
        check(lambda x, w: (x @ w).relu().sum(), (torch.randn(4, 3, requires_grad=True),
                                                  torch.randn(3, 5, requires_grad=True)),
              fw_compiler="inductor")


def test_failure_falls_back_to_eager_with_a_warning(monkeypatch):
    mod = importlib.import_module("aotgrad.backends.inductor")

    def broken(gm, example_inputs):
        raise RuntimeError("no kernel for you")
    monkeypatch.setattr(mod, "_compile", broken)
    with pytest.warns(UserWarning, match="running .* eagerly .*no kernel for you"):
        check(lambda x: x.sin().sum(), (torch.randn(3, requires_grad=True),), fw_compiler="inductor")


def test_placeholders_sharing_one_example_stay_apart():
    """Graphs stamped from one block template give two placeholders the same example object;
    each must still read its own input (the retrace used to bind both uses to one of them)."""
    mode = FakeTensorMode()
    x = mode.from_tensor(torch.randn(4))
    gm = fx.symbolic_trace(lambda a, b: (torch.ops.aten.add.Tensor(torch.ops.aten.mul.Tensor(a, 2.0), b),))
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="aotgrad inductor backend")
        run = aotgrad.backends.get("inductor")(gm, [x, x])
    a, b = torch.randn(4), torch.randn(4)
    (out,) = run(a, b)
    torch.testing.assert_close(out, a * 2 + b)


def test_outputs_keep_eager_layout_through_decompositions():
    """Inductor lays an output out as its fake value in the decomposed graph says; ``cat`` with an
    empty operand decomposes to a contiguous result where eager keeps the transposed operand's
    layout: the output is laid out as the graph before decomposition says (strides compared)."""
    x = torch.randn(3, 4).t().requires_grad_()
    check(lambda x, e: torch.cat([x, e]) * 2, (x, torch.randn(0, 3, requires_grad=True)), fw_compiler="inductor")


@pytest.mark.slow
def test_repeated_blocks_train_like_eager():
    make = make_stack(n=2)
    model, args = make()
    captured = aotgrad.capture(model, *args)
    assert captured.history and any(s.info.get("reused blocks") for s in captured.history), "no block reused"
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="aotgrad inductor backend")
        check_training(make, steps=1, fw_compiler="inductor", rtol=1e-4, atol=1e-4)


def test_registered():
    assert {"eager", "inductor"} <= set(aotgrad.backends.list())


@pytest.mark.slow
def test_mlp_training_step():
    losses = check_training(lambda: models.make_mlp(), steps=2, fw_compiler="inductor",
                            rtol=1e-4, atol=1e-4)
    assert len(losses) == 2


@pytest.mark.slow
def test_cnn_batchnorm_dropout_training_step():
    losses = check_training(lambda: models.make_cnn(batch=4), steps=2, fw_compiler="inductor",
                            batches=lambda step: models.cnn_batch(batch=4, seed=100 + step),
                            rtol=1e-4, atol=1e-4)
    assert len(losses) == 2


@pytest.mark.slow
def test_dynamic_shapes():
    w = torch.randn(4, 5, requires_grad=True)
    for n in (3, 6):
        check(lambda x, w: (x @ w).relu().sum(), (torch.randn(n, 4), w), dynamic=True,
              fw_compiler="inductor")


@pytest.mark.slow
def test_symbolic_backward_compiled_again_hits_inductors_cache_without_falling_back():
    """A backward with symbolic sizes compiled a second time (another jit, another process) found its
    entry in Inductor's FX graph cache, whose shape guards name the symbols' sources: aotgrad's fakes
    have none, the lookup raised NameError and the backward ran without Inductor."""
    def f(x, w):
        return x[1:] * w
    for _ in range(2):
        step = aotgrad.jit(f, fw_compiler="inductor")
        for n in (4, 6, 7):     # the second size recompiles with symbolic sizes
            x, w = torch.randn(n + 1, 3, requires_grad=True), torch.randn(n, 3, requires_grad=True)
            with warnings.catch_warnings():
                warnings.filterwarnings("error", message="aotgrad inductor backend: running")
                out = step(x, w)
                out.sum().backward()
            torch.testing.assert_close(out, f(x, w))


def test_a_generator_the_program_draws_from_is_never_a_cached_graphs(tmp_path, monkeypatch):
    """A graph holding the torch.Generator a program draws from, compiled again with another
    generator (a second capture, a second model): Inductor's FX graph cache keyed it by the first
    generator's state and its hit drew from that one, not from the caller's (wrong numbers, and the
    caller's generator never moved)."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))     # a cache no other test filled

    def f(x, g):
        return x * torch.rand(x.shape, generator=g)
    x = torch.randn(4, 3)
    for seed in (3, 3):
        mine, eager = torch.Generator().manual_seed(seed), torch.Generator().manual_seed(seed)
        step = aotgrad.capture(f, x, mine).compile(fw_compiler="inductor")
        for _ in range(2):
            torch.testing.assert_close(step(x, mine), f(x, eager))
        assert torch.equal(mine.get_state(), eager.get_state())


def _relaid_forward(gm, example_inputs):
    """A forward compiler that returns what it computes in other layouts than the graph traced
    (as Inductor may: padding, a dense copy of an ``expand``): each 2-d output transposed in memory."""
    run = aotgrad.backends.get("eager")(gm, example_inputs)

    def relaid(*args):
        outs = run(*args)
        return tuple(o.t().contiguous().t() if isinstance(o, torch.Tensor) and o.dim() == 2 else o
                     for o in outs)
    return relaid


def test_backward_compiled_for_the_layouts_the_forward_gives():
    """Inductor's backward asserts the strides it was compiled for: it is compiled on its first
    call for the layouts of the saved tensors it really gets."""
    f = lambda x, w: ((x @ w).exp() * (x @ w).t().sum(0)).sum()  # noqa: E731
    args = (torch.randn(4, 3, requires_grad=True), torch.randn(3, 4, requires_grad=True))
    for _ in range(2):      # the second call reuses the backward compiled on the first
        check(f, args, fw_compiler=_relaid_forward, bw_compiler="inductor")


@pytest.mark.slow
@pytest.mark.parametrize("entry", ["jit", "dynamo"])
def test_hf_llama_gqa_saved_layouts(entry):
    """Grouped-query attention saves an ``expand`` (repeat_kv): the Inductor forward returns it dense."""
    from tests.models.zoo import import_torchvision
    import_torchvision()
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=2)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model, ids = LlamaForCausalLM(cfg), torch.randint(0, 64, (2, 16))
    compile = (lambda fn, a, k: aotgrad.jit(fn, fw_compiler="inductor")) if entry == "jit" else \
        (lambda fn, a, k: torch.compile(fn, backend=aotgrad.backend(fw_compiler="inductor")))
    check(model, (), {"input_ids": ids, "labels": ids, "use_cache": False}, compile=compile, rtol=1e-4, atol=1e-4)

@pytest.mark.slow
@pytest.mark.parametrize("pattern", ["output_written_before_backward", "outputs_kept_across_calls",
                                     "two_forwards_then_one_backward", "retain_graph_twice"])
def test_output_laid_out_again_is_the_saved_one(pattern):
    """An output Inductor lays out again for eager's strides (``_eager_strides``) is also the tensor
    the backward saved: writing it before the backward raises eager's error, keeping it is safe."""
    from tests.differential.usage import KINDS, USAGES
    from tests.eager_check import check_usage
    check_usage(KINDS["saved_exp_laid_out_by_a_decomposition"], USAGES[pattern],
                compile=lambda fn, args, kwargs: aotgrad.capture(fn, *args).compile(fw_compiler="inductor"))


@pytest.mark.slow
@pytest.mark.parametrize("pattern", ["parameter_stepped_before_backward", "parameter_view_written_before_backward",
                                     "input_written_before_backward", "two_forwards_then_one_backward"])
def test_writes_between_forward_and_backward_raise_as_in_eager(pattern):
    """Inductor returns a saved ``weight.t()`` as its own tensor over the weight's memory
    (``reinterpret_tensor``), without the weight's version counter: stepping the weight before the
    backward must still raise eager's error, not run the backward on the new weights."""
    from tests.differential.usage import KINDS, USAGES
    from tests.eager_check import check_usage
    check_usage(KINDS["saved_tanh"], USAGES[pattern],
                compile=lambda fn, args, kwargs: aotgrad.capture(fn, *args).compile(fw_compiler="inductor"))


def test_a_repeated_block_is_compiled_per_layout_its_copies_bring(monkeypatch):
    """Regional compilation compiles a block for the layouts its inputs really have: a copy bringing
    another layout gets a compile of its own (never another layout's code), up to REGION_LAYOUTS;
    then the block runs eagerly."""
    mod = importlib.import_module("aotgrad.backends.inductor")
    compiled = []

    def fake_compile(gm, examples, fake_mode, name):
        layout = tuple(e.stride() for e in examples)
        compiled.append(layout)
        return lambda args: (("compiled", layout),)
    monkeypatch.setattr(mod, "_compiled_or_eager", fake_compile)
    monkeypatch.setattr(mod, "REGION_LAYOUTS", 2)
    gm = fx.symbolic_trace(lambda a: (torch.ops.aten.mul.Tensor(a, 2.0),))
    mode = FakeTensorMode()
    run = mod._by_layout(gm, [mode.from_tensor(torch.randn(4, 3))], mode, "forward_block0")
    x = torch.randn(4, 3)
    assert run([x]) == (("compiled", ((3, 1),)),)
    assert run([torch.randn(3, 4).t()]) == (("compiled", ((1, 4),)),)
    assert run([x]) == (("compiled", ((3, 1),)),) and len(compiled) == 2
    y = torch.randn(8, 6)[::2, ::2]
    (out,) = run([y])       # a third layout: eagerly
    assert torch.equal(out, y * 2) and len(compiled) == 2


@pytest.mark.slow
@pytest.mark.parametrize("n", [2, 4])
def test_repeated_blocks_are_compiled_once(monkeypatch, n):
    """A stack of n blocks compiles each of its forward and backward blocks once (regional
    compilation), whatever n, and trains like eager; without regions the whole graphs compile."""
    from aotgrad.runtime import regions
    mod = importlib.import_module("aotgrad.backends.inductor")
    compiles = []
    inner = mod._compile_inner

    def counted(gm, examples, fake_mode):
        compiles.append(len(gm.graph.nodes))
        return inner(gm, examples, fake_mode)
    monkeypatch.setattr(mod, "_compile_inner", counted)
    make = make_stack(n=n)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="aotgrad inductor backend")
        check_training(make, steps=2, fw_compiler="inductor", rtol=1e-4, atol=1e-4)
    regional = len(compiles)
    assert 2 <= regional <= 4, compiles     # a forward block, one or two backward blocks
    compiles.clear()
    monkeypatch.setattr(regions, "ENABLED", False)
    check_training(make, steps=1, fw_compiler="inductor", rtol=1e-4, atol=1e-4)
    assert len(compiles) == 2 and max(compiles) > 2 * n, compiles


@pytest.mark.parametrize("step", [False, True])
def test_regions_only_where_the_blocks_are_most_of_the_graph(monkeypatch, step):
    """Regional compilation runs what lies between the blocks eagerly: worth it for a GPT's forward
    (embeddings, head and loss around the blocks), not for a whole training step, whose optimizer
    update (most of the graph, and what Inductor fuses best) would run op by op."""
    mod = importlib.import_module("aotgrad.backends.inductor")
    chosen = []
    monkeypatch.setattr(mod, "_regional", lambda gm, found: chosen.append("regional") or gm.forward)
    monkeypatch.setattr(mod, "_compile", lambda gm, examples: chosen.append("whole") or gm.forward)
    model, args = models.make_gpt(models.GPT_SDPA)
    if step:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

        def fn(*a):
            loss = model(*a)
            loss.backward()
            opt.step()
            opt.zero_grad()
            return loss
        fn(*args)
    else:
        fn = model
    aotgrad.capture(fn, *args).compile(fw_compiler="inductor")
    assert chosen[0] == ("whole" if step else "regional")


@pytest.mark.parametrize("entry", [pytest.param("capture", marks=pytest.mark.slow), "torch.compile"])
def test_a_decomposition_laid_out_otherwise_than_eager_is_relaid_before_a_view(entry):
    """``cat`` with an empty operand: the decomposition returns the other operand's (transposed)
    layout, eager's kernel a dense one, and the ``view`` after it was traced on the dense one (HF
    GPT-2's key cache under ``torch.compile``). Inductor compiles it, the result is eager's."""
    def f(x, w):
        past = torch.zeros(2, 2, 0, 16)
        k = torch.cat([past, (x @ w).view(2, 16, 2, 8).transpose(1, 2).transpose(2, 3)], dim=-2)
        return (k.view(4, 8, 16).sin() * 2).sum()

    def compile(fn, args, kwargs):
        if entry == "capture":
            return aotgrad.capture(fn, *args).compile(fw_compiler="inductor")
        torch._dynamo.reset()
        return torch.compile(fn, backend=aotgrad.backend(fw_compiler="inductor"))
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="aotgrad inductor backend")
        check(f, (torch.randn(2, 16, 8, requires_grad=True), torch.randn(8, 16, requires_grad=True)),
              compile=compile, rtol=1e-5, atol=1e-5)


def test_sizes_a_decomposition_fixes_run_other_sizes_without_inductor():
    """F.pad's modes: one decomposes by reading a size as a number, so compiling jit's symbolic
    recapture made it a constant, and its code asserted them while the guards still let every size
    through (the next size raised in the size assert, forward and lazy backward). Calls of other sizes
    run the ATen graph; each size's outputs and gradients are eager's."""
    def f(x):
        return sum((F.pad(x, (2, 1, 1, 2), mode=m) ** 2).sum() for m in ("reflect", "replicate", "circular")) \
            + F.pad(x, (1, 1), value=0.5).sum()
    g = aotgrad.jit(f, fw_compiler="inductor")
    with pytest.warns(UserWarning, match="run the graph without Inductor"):
        for n in (2, 4, 5, 3, 4):
            x = torch.randn(n, 3, 5, 6, requires_grad=True)
            ref = x.detach().clone().requires_grad_()
            out, want = g(x), f(ref)
            out.backward()
            want.backward()
            torch.testing.assert_close(out, want)
            torch.testing.assert_close(x.grad, ref.grad)
