"""One frozen ``CompileOptions`` behind ``Captured.compile``, ``aotgrad.jit``, the torch.compile
backend and the disk cache's key: unknown names and a budget the partitioner cannot honour fail
when given, and ``partitioner="auto"`` is the budgeted min cut only when a budget is given."""
import dataclasses

import pytest
import torch

import aotgrad
from aotgrad.errors import OptionError
from aotgrad.guards import cache
from aotgrad.options import CompileOptions
from tests.eager_check import check


class _Loss(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 32),
                                       torch.nn.Tanh(), torch.nn.Linear(32, 1))

    def forward(self, x):
        return self.net(x).pow(2).sum()


def _mlp():
    torch.manual_seed(0)
    return _Loss(), (torch.randn(8, 16),)


def test_frozen_and_every_field_says_whether_it_is_keyed():
    opts = CompileOptions()
    with pytest.raises(dataclasses.FrozenInstanceError):
        opts.partitioner = "min_cut"
    assert all("cache_key" in f.metadata for f in dataclasses.fields(CompileOptions))


@pytest.mark.parametrize("make", [
    lambda: CompileOptions.of(memory_budjet=0.5),
    lambda: aotgrad.jit(lambda x: x, partioner="min_cut"),
    lambda: aotgrad.backend(bw_compler="eager"),
])
def test_unknown_option_fails_when_given_with_the_close_match(make):
    with pytest.raises(OptionError, match=r"unknown option .*did you mean (memory_budget|partitioner|bw_compiler)="):
        make()


def test_torch_compile_names_point_to_ours():
    with pytest.raises(OptionError, match="did you mean fw_compiler='inductor'"):
        aotgrad.jit(lambda x: x, backend="inductor")


@pytest.mark.parametrize("make", [
    lambda c: c.compile(partitioner="default", memory_budget=0.5),
    lambda c: aotgrad.jit(_mlp()[0], partitioner="default", memory_budget=0.5),
    lambda c: aotgrad.backend(partitioner="default", memory_budget=0.5),
    lambda c: CompileOptions(memory_budget=1.5),
    lambda c: CompileOptions(partitioner="fast"),
])
def test_a_budget_the_partitioner_cannot_honour_is_refused(make):
    m, args = _mlp()
    captured = aotgrad.capture(m, *args)
    with pytest.raises(OptionError, match="memory_budget|partitioner"):
        make(captured)


def test_auto_is_the_budgeted_min_cut_only_with_a_budget():
    m, args = _mlp()
    captured = aotgrad.capture(m, *args)
    auto = captured.compile(memory_budget=0.3)
    explicit = captured.compile(partitioner="min_cut", memory_budget=0.3)
    plain = captured.compile()
    assert auto.saved == explicit.saved
    assert plain.saved == captured.compile(partitioner="default").saved
    assert auto.memory.saved_bytes < plain.memory.saved_bytes     # the budget was applied
    check(m, args, memory_budget=0.3)


def test_options_object_is_accepted_everywhere():
    m, args = _mlp()
    opts = CompileOptions(memory_budget=0.3)
    by_object = aotgrad.capture(m, *args).compile(options=opts)
    assert by_object.saved == aotgrad.capture(m, *args).compile(memory_budget=0.3).saved
    jitted = aotgrad.jit(m, options=opts)
    assert jitted.options is opts
    torch.testing.assert_close(jitted(*args), m(*args))
    assert jitted.entries[0].compiled.saved == by_object.saved


def test_cache_key_holds_the_keyed_fields_with_auto_made_concrete():
    key = cache._options
    assert key(CompileOptions()) == key(CompileOptions(partitioner="default"))
    assert key(CompileOptions(memory_budget=0.3)) == key(CompileOptions(partitioner="min_cut", memory_budget=0.3))
    assert key(CompileOptions(memory_budget=0.3)) != key(CompileOptions(memory_budget=0.5))
    assert key(CompileOptions(fw_compiler="inductor")) != key(CompileOptions())
    assert key(CompileOptions(fw_compiler="inductor")) == key(CompileOptions(fw_compiler="inductor",
                                                                             partitioner="min_cut"))


def test_auto_is_the_min_cut_for_inductor():
    """Inductor fuses what a backward recomputes (torch.compile's own choice); other compilers keep
    the default partition, and an explicit partitioner is kept."""
    assert CompileOptions(fw_compiler="inductor").resolved_partitioner() == "min_cut"
    assert CompileOptions(bw_compiler="inductor").resolved_partitioner() == "min_cut"
    assert CompileOptions(fw_compiler="inductor", partitioner="default").resolved_partitioner() == "default"
    assert CompileOptions(fw_compiler=lambda gm, ex: gm).resolved_partitioner() == "default"


def test_export_checks_its_partitioner_options_before_writing(tmp_path):
    m, args = _mlp()
    captured = aotgrad.capture(m, *args)
    path = tmp_path / "step.aotgrad"
    with pytest.raises(OptionError, match="partitioner='min_cut'"):
        captured.export(str(path), partitioner="default", memory_budget=0.5)
    assert not path.exists()


@pytest.mark.parametrize("chosen", ["default", lambda joint, lay: None, "auto"])
def test_partition_get_never_switches_a_budgeted_partitioner(chosen):
    """``partition.get`` takes a concrete partitioner: a budget with one that has none is refused
    (it used to turn "default" into min cut silently)."""
    from aotgrad import partition
    with pytest.raises(OptionError, match="memory_budget=0.5 needs partitioner='min_cut'"):
        partition.get(chosen, 0.5)


def test_auto_with_a_budget_saves_what_the_budgeted_min_cut_saves():
    from aotgrad import partition
    from aotgrad.passes.views import fold_views
    m, args = _mlp()
    captured = aotgrad.capture(m, *args)
    joint = fold_views(captured.joint, captured.layout.n_fw)     # as compile partitions it
    by_get = partition.get("min_cut", 0.3)(joint, captured.layout)
    direct = partition.min_cut(budget=0.3)(joint, captured.layout)
    assert captured.compile(partitioner="auto", memory_budget=0.3).saved == by_get.saved == direct.saved
    assert by_get.saved != partition.get("default")(joint, captured.layout).saved


def _step(x):
    return (x * 2).sum()


def _captured():
    return aotgrad.capture(_step, torch.randn(3, requires_grad=True))


# Every public entry taking keywords: a misspelt one is an OptionError naming the close match and the
# user's line (one mechanism: options.refuse_unknown, through keywords_checked for plain signatures).
MISSPELT = {
    "compile": (lambda: _captured().compile(partitionr="min_cut"), "partitioner"),
    "CompileOptions": (lambda: CompileOptions(partitionr="min_cut"), "partitioner"),
    "export": (lambda: _captured().export("unused.aotgrad", memory_budjet=0.5), "memory_budget"),
    "jit": (lambda: aotgrad.jit(_step, recompile_limt=2), "recompile_limit"),
    "backend": (lambda: aotgrad.backend(memory_budgt=0.5), "memory_budget"),
    "cudagraphs options": (lambda: _captured().compile(fw_compiler="cudagraphs", cudagraphs={"warmpu": 0}), "warmup"),
    "load": (lambda: aotgrad.load("unused.aotgrad", stat={}), "state"),
    "compiled_autograd": (lambda: aotgrad.compiled_autograd(compilr="eager"), "compiler"),
    "trace": (lambda: aotgrad.trace(pth="t.json"), "path"),
    "with_joint": (lambda: (lambda c: c.with_joint(gmm=c.joint))(_captured()), "gm"),
    "partition.min_cut": (lambda: aotgrad.partition.min_cut(polcy="save_nothing"), "policy"),
    "partition.get": (lambda: aotgrad.partition.get("min_cut", memory_budgett=0.5), "memory_budget"),
}


@pytest.mark.parametrize("entry", list(MISSPELT))
def test_every_public_entry_refuses_a_misspelt_keyword_with_the_close_match(entry):
    make, meant = MISSPELT[entry]
    with pytest.raises(OptionError, match=f"unknown option .*did you mean {meant}=") as e:
        make()
    assert isinstance(e.value, TypeError)           # Python's own signature error type, still
    assert "test_options.py" in str(e.value)        # the user's line


@pytest.mark.parametrize("how", ["string", "configured"])
def test_torch_compile_options_dict_is_checked_and_used(how):
    backend = "aotgrad" if how == "string" else aotgrad.backend()
    torch._dynamo.reset()
    with pytest.raises(Exception) as e:     # Dynamo wraps a backend's error; the typed one is inside
        torch.compile(_step, backend=backend, options={"partitionr": "min_cut"})(torch.randn(3))
    inner = getattr(e.value, "inner_exception", e.value)
    assert isinstance(inner, OptionError) and "did you mean partitioner='min_cut'" in str(inner)
    torch._dynamo.reset()
    x = torch.randn(3, requires_grad=True)
    check(lambda x: _step(x), (x,),
          compile=lambda f, a, k: torch.compile(f, backend=backend, options={"partitioner": "min_cut"}))
    torch._dynamo.reset()
