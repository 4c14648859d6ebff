"""Expert parallelism on CPU ranks: equal to the one-process reference, bytes and memory equal to prediction."""

from __future__ import annotations

import pytest
import torch

from parallel_lab import comm
from parallel_lab.distributed.instruments.tracer import collective_counts, event_counts
from parallel_lab.distributed.model.model import build_model, loss_fn
from parallel_lab.distributed.model.moe import route, token_counts
from parallel_lab.distributed.runtime import train
from parallel_lab.distributed.runtime.run import run
from parallel_lab.errors import ParallelLabError
from parallel_lab.specs import RUN_DEFAULTS, ModelSpec, Plan

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(240)]

SPEC = ModelSpec.preset("tiny-moe")
BASE = {**RUN_DEFAULTS, "seq": 32, "micro_batch": 2}


def _check_report(rep, plan, steps):
    j = rep.to_json()
    assert j["max_abs_param_diff"] < 1e-5
    assert max(abs(a - b) for a, b in zip(j["losses"], j["reference_losses"], strict=True)) < 1e-5
    for dim, c in j["comm"].items():
        assert c["measured_bytes"] == c["predicted_bytes"], dim
    for cat, c in j["memory"].items():
        assert c["measured_bytes"] == c["predicted_bytes"], cat
    # call by call: every rank's traced calls are the predicted collectives of its stage
    for r in rep.ranks:
        stage = r.coords["pp"]
        want = collective_counts(comm.collectives(SPEC, plan, stage=stage), steps)
        assert event_counts(r.events) == want, r.rank
    return j


def test_ep2_with_dp_and_pp_equals_the_reference_and_the_prediction():
    plan = Plan(dp=2, ep=2, pp=2, grad_accum=2, **BASE)
    rep = run(SPEC, plan, steps=2, timeout_s=200)
    j = _check_report(rep, plan, 2)
    ranks, steps, blocks_per_stage, calls = 4, 2, 1, 4 * plan.grad_accum     # 4 calls per block, micro-batch
    assert j["comm"]["ep"]["measured_bytes"] == ranks * steps * blocks_per_stage * calls * comm.ep_dispatch_bytes(
        SPEC, plan)
    moe = j["moe"]
    # every choice of every token is counted once: 2 blocks x 2 steps x global batch x seq x top_k
    assert sum(moe["routed"]) == 2 * 2 * plan.global_batch * plan.seq * SPEC.top_k
    assert sum(moe["per_ep_rank"]) == sum(moe["kept"]) <= sum(moe["routed"])


def test_ep2_inside_dp4_averages_expert_gradients_over_edp():
    plan = Plan(dp=4, ep=2, **BASE)
    rep = run(SPEC, plan, steps=1, timeout_s=200)
    _check_report(rep, plan, 1)
    edp = [e for r in rep.ranks for e in r.events if e.collective.dim == "dp" and e.collective.group_size == 2]
    assert len(edp) == 4 * SPEC.moe_layers * 2 * 3          # 4 ranks, 2 local experts of 3 tensors per block


def test_routing_counts_match_the_single_process_model():
    """The parallel run routes exactly as one process does: capacity is counted per sequence."""
    plan = Plan(dp=2, ep=2, **BASE)
    rep = run(SPEC, plan, steps=1, timeout_s=200)
    from parallel_lab.distributed.model.data import synthetic_batch

    model = build_model(SPEC, 0)
    batch = synthetic_batch(SPEC, plan, 0, 0)
    model(batch.tokens, batch.positions)
    ref = token_counts(model)
    assert rep.extra["moe"]["routed"] == [sum(ref[b]["routed"][e] for b in ref) for e in range(SPEC.experts)]
    assert rep.extra["moe"]["kept"] == [sum(ref[b]["kept"][e] for b in ref) for e in range(SPEC.experts)]


def test_capacity_drops_tokens_in_priority_order():
    probs = torch.tensor([[[0.7, 0.2, 0.1], [0.6, 0.3, 0.1], [0.5, 0.1, 0.4], [0.1, 0.8, 0.1]]])
    gate, expert, slot = route(probs, top_k=2, capacity=2)
    assert expert[0, :, 0].tolist() == [0, 0, 0, 1]
    # first choices fill expert 0's two slots in token order; token 2's first choice is dropped
    assert slot[0, :, 0].tolist() == [0, 1, -1, 0]
    # second choices come after every first choice: expert 1 has one slot left, expert 0 none
    assert expert[0, :, 1].tolist() == [1, 1, 2, 0] and slot[0, :, 1].tolist() == [1, -1, 0, -1]


def test_aux_loss_pushes_the_router_and_capacity_bounds_the_drops():
    x = torch.randint(0, SPEC.vocab, (4, 32))
    grads = {}
    for coef in (0.0, 1.0):
        model = build_model(SPEC.with_(aux_loss_coef=coef), 0)
        loss_fn(model(x), x).backward()
        grads[coef] = model.blocks["0"].mlp.router.weight.grad.clone()
    assert not torch.allclose(grads[0.0], grads[1.0])          # the aux loss's gradient reaches the router
    dropped = {}
    for cf in (0.5, 2.0):                                      # 2.0 = experts / top_k: room for every choice
        model = build_model(SPEC.with_(capacity_factor=cf), 0)
        model(x)
        c = token_counts(model)["0"]
        dropped[cf] = sum(c["routed"]) - sum(c["kept"])
    assert dropped[2.0] == 0 and dropped[0.5] >= 4 * 32 * 2 // 2


def test_plans_expert_parallelism_cannot_run_are_refused():
    with pytest.raises(ParallelLabError, match="B and W"):
        train.check_runnable(SPEC, Plan(dp=2, ep=2, pp=2, grad_accum=2, schedule="zb-h1", **BASE))
    with pytest.raises(ParallelLabError, match="recompute"):
        train.check_runnable(SPEC, Plan(dp=2, ep=2, **{**BASE, "recompute": "full"}))
    with pytest.raises(ParallelLabError, match="experts=4"):
        train.check_runnable(SPEC, Plan(dp=3, ep=3, **BASE))


def test_the_block_routes_by_the_rule_the_explorer_simulates():
    from parallel_lab.routing import capacity_counts

    g = torch.Generator().manual_seed(3)
    probs = torch.softmax(torch.randn(3, 40, 8, generator=g) * 2, dim=-1)
    _, expert, slot = route(probs, top_k=2, capacity=7)
    for b in range(3):
        routed, kept = capacity_counts(expert[b].tolist(), 8, 7)
        assert kept == torch.bincount(expert[b][slot[b] >= 0], minlength=8).tolist()
        assert routed == torch.bincount(expert[b].flatten(), minlength=8).tolist()
