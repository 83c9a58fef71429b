"""Backends read ``gm.meta["aotgrad"]`` (GraphInfo), not placeholder names: a graph whose
placeholders a pass renamed compiles the same, and a plain graph is read from its names."""
import torch
import torch.fx as fx

import aotgrad
from aotgrad.backends import cudagraphs as cg
from aotgrad.backends import inductor
from aotgrad.backends.cudagraphs.static import static_inputs
from aotgrad.backends.graph_info import info_of
from examples import models
from tests.eager_check import check_training


def _rename(gm: fx.GraphModule) -> fx.GraphModule:
    """What a user's pass may do: placeholders named ``in_<i>`` (no ``tangent_``/``p_`` prefix)."""
    for i, n in enumerate(n for n in gm.graph.nodes if n.op == "placeholder"):
        n._rename(f"in_{i}")
    gm.recompile()
    return gm


def _examples(gm):
    return [n.meta["val"] for n in gm.graph.nodes if n.op == "placeholder"]


def _mlp_compiled():
    m, args = models.make_mlp(depth=2)
    return m, aotgrad.capture(m, *args).compile()


def test_renamed_backward_is_still_a_backward():
    _, c = _mlp_compiled()
    fw, bw = _rename(c.forward_graph), _rename(c.backward_graph)
    assert not any(n.name.startswith("tangent_") for n in bw.graph.nodes)
    assert inductor._is_backward(bw) and not inductor._is_backward(fw)
    assert info_of(bw).kind == "backward" and info_of(fw).kind == "forward"


def test_renamed_graphs_pair_and_keep_parameters_in_place_under_the_null_runner():
    m, c = _mlp_compiled()
    fw_gm, bw_gm = _rename(c.forward_graph), _rename(c.backward_graph)
    n_params = len(list(m.parameters()))
    assert len(static_inputs(fw_gm)) == n_params        # found from GraphInfo, not from p_ names
    backend = cg.configure(runner="null")
    fw = backend(fw_gm, _examples(fw_gm))
    bw = backend(bw_gm, _examples(bw_gm))
    assert bw.forward is fw and bw.pool is fw.pool


def test_renaming_backend_trains_like_eager():
    backend = cg.configure(runner="null", warmup=0)
    seen = []

    def renaming(gm, example_inputs):
        seen.append(info_of(gm).kind)
        return backend(_rename(gm), example_inputs)
    check_training(lambda: models.make_mlp(depth=2), steps=3, fw_compiler=renaming)
    assert seen == ["forward", "backward"]
    assert backend.last_compiled().forward is not None     # the backward paired with its forward


def test_plain_graph_without_graph_info_is_read_from_its_names():
    def bw(saved, tangent_1):
        return saved * tangent_1
    gm = fx.symbolic_trace(bw)
    info = info_of(gm)
    assert info.kind == "backward" and info.saved_inputs == (0,) and info.function_id == -1
    fw = fx.symbolic_trace(lambda p_w, x: p_w * x)
    assert info_of(fw).kind == "forward" and info_of(fw).static_inputs == (0,)
    assert inductor._is_backward(gm) and not inductor._is_backward(fw)
