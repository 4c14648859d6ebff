"""Mixture of experts, layer 1: published parameter counts, the rules of ep, all-to-all bytes, memory, FLOPs."""

from __future__ import annotations

import math

import pytest

from parallel_lab import comm, flops, ledger, mesh, sharding
from parallel_lab.errors import ParallelLabError
from parallel_lab.specs import ModelSpec, Plan


@pytest.mark.parametrize("name, total, active", [
    ("mixtral-8x7b", 46.7e9, 12.9e9),          # Jiang et al. 2024: 46.7B parameters, 12.9B active per token
    ("deepseekmoe-16b", 16.4e9, 2.8e9),        # Dai et al. 2024: 16.4B parameters, 2.8B activated
])
def test_published_parameter_counts(name, total, active):
    m = ModelSpec.preset(name)
    assert m.n_params == pytest.approx(total, rel=0.005)
    assert m.n_active_params == pytest.approx(active, rel=0.02)


def test_active_params_count_top_k_of_the_routed_experts():
    m = ModelSpec.preset("tiny-moe")
    expert = 3 * m.hidden * m.expert_ffn                       # SwiGLU: gate, up, down
    assert m.n_params - m.n_active_params == m.moe_layers * (m.experts - m.top_k) * expert
    assert ModelSpec.preset("tiny-llama").n_active_params == ModelSpec.preset("tiny-llama").n_params


def test_capacity_is_per_sequence_and_capped_at_the_sequence():
    m = ModelSpec.preset("mixtral-8x7b")
    assert m.expert_capacity(4096) == math.ceil(1.25 * 2 * 4096 / 8) == 1280
    assert m.with_(capacity_factor=100.0).expert_capacity(4096) == 4096


@pytest.mark.parametrize("changes, match", [
    ({"top_k": 9}, "top_k=9 exceeds experts=8"),
    ({"capacity_factor": 0.0}, "capacity_factor=0.0 must be > 0"),
    ({"first_dense": 40}, "first_dense=40 exceeds layers=32"),
    ({"experts": -1}, "experts=-1"),
])
def test_moe_fields_are_validated(changes, match):
    with pytest.raises(ParallelLabError, match=match):
        ModelSpec.preset("mixtral-8x7b").with_(**changes)


@pytest.mark.parametrize("plan, model, match", [
    (Plan(dp=6, ep=3), "mixtral-8x7b", r"ep=3 does not divide experts=8; pick ep in \{1, 2\}"),
    (Plan(dp=4, ep=2), "llama3-8b", "needs a mixture-of-experts model"),
    (Plan(dp=2, tp=2, ep=2), "mixtral-8x7b", "tp=2 with a mixture-of-experts model"),
    (Plan(dp=2, cp=2), "mixtral-8x7b", "cp=2 with a mixture-of-experts model"),
])
def test_ep_rules(plan, model, match):
    with pytest.raises(ParallelLabError, match=match):
        plan.validate(ModelSpec.preset(model))


def test_ep_is_borrowed_from_dp_and_refuses_zero():
    with pytest.raises(ParallelLabError, match=r"ep=4 does not divide dp=6"):
        Plan(dp=6, ep=4)
    with pytest.raises(ParallelLabError, match="ZeRO"):
        Plan(dp=4, ep=2, zero=1)


def test_ep_and_edp_groups_are_lines_inside_dp():
    plan = Plan(dp=4, pp=2, ep=2)                 # ranks = arange(8).view(dp=4, pp=2, 1, 1)
    assert mesh.all_groups(plan, "ep") == [[0, 2], [4, 6], [1, 3], [5, 7]]
    assert mesh.all_groups(plan, "edp") == [[0, 4], [2, 6], [1, 5], [3, 7]]
    assert mesh.ep_coords(plan, 6) == {"ep": 1, "edp": 1}
    assert list(sharding.local_experts(8, 2, 1)) == [4, 5, 6, 7]


def test_switch_dispatch_is_one_activation_per_call():
    """Switch (top-1, capacity factor 1): the dispatched buffer holds exactly the tokens, s b h d bytes; the
    block moves it four times per micro-batch (dispatch, combine, and both again in backward)."""
    m = ModelSpec.preset("mixtral-8x7b").with_(top_k=1, capacity_factor=1.0)
    plan = Plan(dp=8, ep=8, seq=4096, micro_batch=1).validate(m)
    assert comm.ep_dispatch_bytes(m, plan) == 4096 * 4096 * 2
    ep = [c for c in comm.collectives(m, plan) if c.dim == "ep"]
    assert sum(c.count for c in ep) == 4 * 32
    assert all(c.kind == "all_to_all" and c.group_size == 8 for c in ep)
    # a fraction (ep - 1)/ep of each buffer leaves the GPU
    assert comm.per_step_bytes(ep)["ep"] == pytest.approx(4 * 32 * 4096 * 4096 * 2 * 7 / 8)


def test_mixtral_all_to_all_is_capacity_times_top_k_activations():
    m = ModelSpec.preset("mixtral-8x7b")
    plan = Plan(dp=8, ep=8, seq=4096, micro_batch=1).validate(m)
    assert comm.ep_dispatch_bytes(m, plan) == 8 * 1280 * 4096 * 2 == 2.5 * 4096 * 4096 * 2


def test_expert_gradients_are_averaged_over_edp_and_left_out_of_the_buckets():
    m = ModelSpec.preset("tiny-moe")
    plan = Plan(dp=4, ep=2, seq=32, dtype="fp32", optimizer="adam-fp32").validate(m)
    colls = comm.collectives(m, plan)
    experts = [c for c in colls if c.note.startswith("expert grad")]
    per_expert = 3 * m.hidden * m.expert_ffn * 4
    assert len(experts) == m.moe_layers * (m.experts // 2) * 3 and all(c.group_size == 2 for c in experts)
    assert sum(c.message_bytes for c in experts) == m.moe_layers * (m.experts // 2) * per_expert
    dense = sum(c.message_bytes for c in colls if c.note.startswith("bucket"))
    routed = sum(math.prod(s) for n, s in m.parameter_shapes() if ".experts." in n)
    assert dense == (m.n_params - routed) * 4
    assert not [c for c in comm.collectives(m, plan.with_(dp=2)) if c.note.startswith("expert grad")]  # ep == dp


def test_state_memory_splits_the_experts_over_ep():
    m = ModelSpec.preset("mixtral-8x7b")
    routed = sum(math.prod(s) for n, s in m.parameter_shapes() if ".experts." in n)
    one = ledger.state_bytes(m, Plan(dp=8))["parameters"]
    eight = ledger.state_bytes(m, Plan(dp=8, ep=8))["parameters"]
    assert one == m.n_params * 2
    assert eight == (m.n_params - routed + routed // 8) * 2
    assert eight / 1e9 == pytest.approx(14.49, abs=0.01)


def test_flops_use_the_active_parameters():
    m = ModelSpec.preset("mixtral-8x7b")
    n_blocks, n_head = flops.matmul_params(m)
    norms = m.layers * 2 * m.hidden
    assert n_blocks + n_head + m.vocab * m.hidden + norms + m.hidden == m.n_active_params


def test_ep_group_lands_on_the_link_its_ranks_span():
    m = ModelSpec.preset("mixtral-8x7b")
    rep = comm.report(m, Plan(dp=64, ep=8, seq=4096).validate(m))
    assert rep.tiers["ep"] == "nvlink4" and rep.tiers["dp"] == "ib-400g"
    m2 = ModelSpec.preset("deepseekmoe-16b")
    rep2 = comm.report(m2, Plan(dp=8, pp=2, ep=8, seq=4096, grad_accum=2).validate(m2))
    assert rep2.tiers["ep"] == "ib-400g"        # ep neighbours are pp=2 ranks apart: 8 of them span 2 nodes


def test_planner_searches_ep_for_a_mixture_of_experts():
    from parallel_lab.hardware import ClusterSpec
    from parallel_lab.planner import plan_search
    from parallel_lab.planner_constraints import Constraints

    m = ModelSpec.preset("mixtral-8x7b")
    cluster = ClusterSpec.preset("h100-sxm")
    res = plan_search(m, cluster, 64, 4096, global_batch=512,
                      constraints=Constraints(fixed={"zero": 0, "recompute": "selective", "schedule": "1f1b"}))
    eps = {e.fields["ep"] for e in res.estimates}
    assert eps == {2, 4, 8}          # without ZeRO, only splitting the experts makes Mixtral fit in 72 GB
    best = res.estimates[0]
    assert best.fields["ep"] > 1 and best.fields["tp"] == 1 and best.exposed_s["ep"] > 0
    # memory and the all-to-all time are the ledger's and comm's own for that plan
    assert best.memory_bytes == ledger.memory(m, best.plan, cluster).total_bytes
    assert best.comm_s["ep"] == pytest.approx(comm.report(m, best.plan, cluster, stage=0).time_s["ep"])
    assert best.row()["ep"] == best.fields["ep"]


def test_capacity_counts_follow_the_priority_rule():
    from parallel_lab.routing import capacity_counts

    # token 2's first choice (expert 0) finds it full; second choices come after every first choice
    routed, kept = capacity_counts([[0, 1], [0, 1], [0, 2], [1, 0]], experts=3, capacity=2)
    assert routed == [4, 3, 1] and kept == [2, 2, 1]


def test_skew_concentrates_the_load_and_capacity_drops_it():
    from parallel_lab.routing import load_report

    m = ModelSpec.preset("mixtral-8x7b")
    flat, skewed = load_report(m, 512, ep=4, skew=0.0), load_report(m, 512, ep=4, skew=1.5)
    assert flat.imbalance < 1.1 < skewed.imbalance and flat.dropped < skewed.dropped
    assert sum(flat.routed) == 4 * 512 * m.top_k
    roomy = load_report(m.with_(capacity_factor=m.experts / m.top_k), 512, ep=4, skew=1.5)
    assert roomy.dropped == 0 and roomy.per_rank[0] > skewed.per_rank[0]
