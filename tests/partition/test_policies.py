"""Named recompute policies save what their JAX namesakes save.

``save_nothing`` is JAX's ``nothing_saveable``, ``save_matmuls`` its ``dots_saveable``: the
backward recomputes every value the policy does not name from the nearest values it may
save. Here those are the policy's ops, plus what cannot be recomputed at all: inputs, random
draws (the backward must see the forward's), and values read from an input that may be
updated in place before the backward runs. The expected saved set is computed by a plain
walk back from what the backward reads, independently of the minimum cut.
"""
import functools
import operator

import pytest
from dataclasses import replace
import torch

import aotgrad
from aotgrad.ir.ops import is_expensive, is_random
from aotgrad.partition import default_partition, estimate, min_cut, min_cut_partition
from aotgrad.partition.default import ancestors, forward_nodes, is_sym, split_nodes
from aotgrad.partition.min_cut import stale_inputs
from tests.eager_check import check
from tests.partition.test_min_cut import MODELS

NAMED = {"save_nothing": lambda n: False, "save_matmuls": is_expensive}


@functools.cache
def _captured(name):
    """One capture per model for the module: partitioners read the joint, never change it. The
    flat joint (a repeated block's halves copied in): the sets below are counted per operator."""
    model, args = MODELS[name]()
    captured = aotgrad.capture(model, *args)
    return replace(captured, joint=captured.flat_joint)


def expected_saved(joint, lay, policy) -> set[str]:
    """The frontier JAX's partial evaluation saves: walk back from each forward value the
    backward reads through values that must be recomputed, stopping at ones that may be saved."""
    fw = forward_nodes(joint, lay)
    primals, _, _, grads = split_nodes(joint, lay)
    bw = ancestors([g for g in grads if g is not None], stop=fw) - fw
    stale = stale_inputs(primals, lay, bw)

    def kept(n):        # saved when needed: cannot be recomputed, or the policy names it
        if n.target is operator.getitem:
            return kept(n.args[0])
        return (n.op != "call_function" or is_random(n) or is_sym(n) or NAMED[policy](n)
                or any(a in stale for a in n.all_input_nodes))
    frontier, seen = set(), set()
    stack = [n for n in fw if any(u in bw for u in n.users)]
    while stack:
        n = stack.pop()
        if n in seen or n.op == "get_attr":      # constants are copied, not saved
            continue
        seen.add(n)
        if kept(n) and not isinstance(n.meta.get("val"), (tuple, list)):
            frontier.add(n.name)
        else:
            stack.extend(n.all_input_nodes)
    return frontier


@pytest.mark.parametrize("policy", NAMED)
@pytest.mark.parametrize("name", ["mlp", "cnn", "gpt", "gpt_dropout"])
def test_policy_saves_exactly_its_jax_set(name, policy):
    captured = _captured(name)
    part = min_cut_partition(captured.joint, captured.layout, policy)
    assert set(part.saved) == expected_saved(captured.joint, captured.layout, policy)


@pytest.mark.parametrize("name", ["cnn", "gpt_dropout"])
def test_policies_differ_from_the_default(name):
    """Regression: a tuple-valued op that cannot be recomputed (BatchNorm reading its running
    stats) made the cut unbounded, and both policies silently saved the default's set."""
    captured = _captured(name)
    j, lay = captured.joint, captured.layout
    default = estimate(default_partition(j, lay)).saved_bytes
    nothing = estimate(min_cut_partition(j, lay, "save_nothing")).saved_bytes
    matmuls = estimate(min_cut_partition(j, lay, "save_matmuls")).saved_bytes
    assert nothing < matmuls < default


def test_save_matmuls_keeps_every_matmul_the_backward_needs():
    captured = _captured("gpt")
    part = min_cut_partition(captured.joint, captured.layout, "save_matmuls")
    mms = {n.name for n in part.forward.graph.nodes if is_expensive(n)}
    assert mms and mms <= set(part.saved)
    recomputed = [n for n in part.backward.graph.nodes if n.name in part.recomputed]
    assert recomputed and not any(is_expensive(n) for n in recomputed)


@pytest.mark.parametrize("policy", NAMED)
@pytest.mark.parametrize("name", ["cnn", "gpt_dropout"])
def test_policies_match_eager(name, policy):
    check(None, make=lambda: (*MODELS[name](), {}), partitioner=min_cut(policy=policy), calls=2,
          rtol=1e-5, atol=1e-5)


def test_policy_on_a_function_recomputes_through_a_random_draw():
    def f(x, w):
        return torch.nn.functional.dropout((x @ w).tanh(), 0.5).exp().sum()
    args = (torch.randn(8, 16, requires_grad=True), torch.randn(16, 16, requires_grad=True))
    run = check(f, args, partitioner=min_cut(policy="save_nothing"))
    part = run.compiled.partition
    saved = [n for n in part.forward.graph.nodes if n.name in part.saved and n.op == "call_function"]
    assert saved and all(is_random(n) or is_random(n.args[0]) for n in saved), [n.name for n in saved]
