"""The re-sharding prediction (parallel_lab/reshard.py) on its own: every element written once, every rank
reading exactly what it holds, a hand count from the ZeRO units, and the Llama 3 8K -> 131K phase change.
Measured against real ranks in tests/distributed/test_reshard.py."""

from __future__ import annotations

import math

import pytest

from parallel_lab import reshard, sharding
from parallel_lab.errors import ParallelLabError
from parallel_lab.hardware import ClusterSpec
from parallel_lab.specs import ModelSpec, Plan

LLAMA = ModelSpec.preset("tiny-llama")                 # units: root 131,200 + 4 blocks of 181,504 elements
GPT = ModelSpec.preset("tiny-gpt")                     # biases, learned positions
FP32 = dict(optimizer="adam-fp32", dtype="fp32")
PLANS = [Plan(**FP32), Plan(dp=2, **FP32), Plan(dp=2, zero=1, **FP32), Plan(dp=4, zero=3, **FP32),
         Plan(tp=2, **FP32), Plan(tp=4, **FP32), Plan(pp=2, grad_accum=2, **FP32),
         Plan(pp=2, interleave=2, schedule="interleaved", grad_accum=2, **FP32),
         Plan(cp=2, dp=2, zero=2, **FP32), Plan(tp=2, pp=2, cp=2, dp=2, zero=1, grad_accum=2, **FP32),
         Plan(dp=2, zero=3, zero_unit="root", **FP32)]


@pytest.mark.parametrize("model", [LLAMA, GPT], ids=["llama", "gpt"])
@pytest.mark.parametrize("plan", PLANS, ids=lambda p: "x".join(map(str, p.shape)) + f"z{p.zero}")
def test_every_element_is_written_exactly_once(model, plan):
    total = sum(p.numel for r in range(plan.world) for p in reshard.rank_pieces(model, plan, r, written=True))
    assert total * reshard.STATE_BYTES == reshard.checkpoint_bytes(model, plan) == 12 * model.n_params


@pytest.mark.parametrize("a,b", [(PLANS[2], PLANS[9]), (PLANS[5], PLANS[3]), (PLANS[7], PLANS[8])])
def test_each_rank_of_b_reads_what_it_holds_and_max_read_is_the_fullest(a, b):
    pairs = reshard.transfers(LLAMA, a, b)
    read = [sum(n for (_, j), n in pairs.items() if j == r) for r in range(b.world)]
    held = [sum(p.numel for p in reshard.rank_pieces(LLAMA, b, r)) * reshard.STATE_BYTES for r in range(b.world)]
    assert read == held
    assert reshard.max_read_bytes(LLAMA, b) == max(held)
    assert [reshard.kept_bytes(LLAMA, a, b, r) for r in range(b.world)] == [
        (held[r], pairs.get((r, r), 0)) for r in range(b.world)]


def test_dp2_zero1_to_one_rank_by_hand():
    """ZeRO-1 over 2 ranks: rank 0 wrote the parameters and the first half of every unit's moments, rank 1
    the second half; one process reads 4 B x 857,216 parameters + 8 B x (65,600 + 4 x 90,752) moments from
    rank 0 and 8 B x the same from rank 1 (shards are ceil(n/2) of units 131,200 and 181,504)."""
    assert sharding.unit_sizes(LLAMA, PLANS[2]) == {"root": 131_200, **{f"blocks.{i}": 181_504 for i in range(4)}}
    pairs = reshard.transfers(LLAMA, PLANS[2], PLANS[0])
    moments = 8 * (65_600 + 4 * 90_752)
    assert pairs == {(0, 0): 4 * 857_216 + moments, (1, 0): moments}


def test_same_plan_without_replicas_moves_nothing():
    plan = Plan(dp=4, zero=3, **FP32)
    pred = reshard.predict(LLAMA, plan, plan, ClusterSpec.preset("cpu-gloo"))
    assert pred.moved == [0] * 4 and pred.time_s == 0.0 and sum(pred.read) == pred.checkpoint_bytes


def test_different_optimizers_are_refused():
    with pytest.raises(ParallelLabError, match="same optimizer"):
        reshard.predict(LLAMA, Plan(**FP32), Plan(optimizer="sgd-momentum", dtype="fp32"),
                        ClusterSpec.preset("cpu-gloo"))


def test_llama3_405b_8k_to_131k():
    """Table 4 of the Llama 3 paper: 8K (tp 8, pp 16, dp 128) -> 131K (tp 8, cp 16, pp 16, dp 8), FSDP keeping
    the fp32 master and Adam's moments sharded over dp (x cp): 128 shards in both phases, so every GPU
    reads 12 B x its stage's TP-local parameters / 128, and the whole checkpoint is 12 B x 405.85e9."""
    model = ModelSpec.preset("llama3-405b")
    common = dict(tp=8, pp=16, zero=2, optimizer="adam-mixed", schedule="interleaved", interleave=8,
                  pp_split="embed-head", sp=True, grad_accum=16)
    a = Plan(dp=128, seq=8192, **common)
    b = Plan(dp=8, cp=16, seq=131072, cp_kind="allgather", **common)
    cluster = ClusterSpec.preset("h100-sxm")
    pred = reshard.predict(model, a, b, cluster)
    assert pred.checkpoint_bytes == 12 * 405_853_388_800
    assert pred.max_read_bytes == max(12 * sum(math.ceil(n / 128) for _, n in sharding.stage_params(model, b, s).units)
                                      for s in range(16))
    assert pred.time_s == pytest.approx(cluster.inter.latency + pred.max_read_bytes / cluster.inter.bandwidth)
    # rank 0 is stage 0, shard 0 in both phases: it keeps everything; rank 8 is stage 1 at 8K but stage 0
    # (cp rank 1) at 131K: it keeps nothing; rank 1 (tp 1, shard 0) keeps all but the TP-replicated norms
    # that tp rank 0 wrote: each block's attn_norm is its unit's first tensor, inside shard 0, and stage 0
    # holds the embedding and 7 blocks
    assert reshard.kept_bytes(model, a, b, 0) == (286_135_296, 286_135_296)
    assert reshard.kept_bytes(model, a, b, 8) == (286_135_296, 0)
    read, kept = reshard.kept_bytes(model, a, b, 1)
    assert sharding.stage_blocks(126, 16, 8, 0, "embed-head") == 7
    assert read - kept == 7 * 16384 * 12 == 1_376_256


def test_cli_prediction_from_two_plan_files(capsys):
    import json

    from parallel_lab import cli
    from parallel_lab.planfile import load_plan

    a, b = "examples/plans/tiny-dp2-zero3.yaml", "examples/plans/tiny-tp2-sp.yaml"
    assert cli.main(["reshard", a, b, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    pa, pb = load_plan(a), load_plan(b)
    pairs = reshard.transfers(pa.model, pa.plan, pb.plan)
    assert out["pairs"] == [[i, j, n] for (i, j), n in sorted(pairs.items())]
    assert out["checkpoint_bytes"] == 12 * LLAMA.n_params and out["cluster"] == "cpu-gloo"
    assert sum(out["read"]) == sum(n for n in pairs.values())


def test_cli_refuses_two_models_in_one_line(capsys):
    from parallel_lab import cli

    assert cli.main(["reshard", "examples/plans/tiny-dp2-zero3.yaml",
                     "examples/plans/llama3-405b-planner-8k.yaml"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("parallel-lab reshard: error: ") and "same model" in err and "\n" not in err


def test_switch_cost_and_payback_by_hand():
    # Llama 3 405B's checkpoint, 12 B x 405.85e9 parameters = 4.87 TB, written and read back at Tectonic's
    # sustained 2 TB/s (Dubey et al. 2024, section 3.3.1): 2 x 4.87 / 2 = 4.87 s, plus a 600 s restart
    assert reshard.switch_seconds(4.87e12, 2e12, 600.0) == pytest.approx(604.87)
    assert reshard.switch_seconds(1e12, 1e11, 0.0, network_s=0.5) == pytest.approx(20.5)
    # 604.87 s recovered at 16.0 - 14.4 = 1.6 s a step: 378.04 steps
    assert reshard.payback_steps(604.87, 16.0, 14.4) == pytest.approx(378.04375)
    assert reshard.payback_steps(100.0, 10.0, 10.0) == math.inf          # no gain: never pays
    assert reshard.payback_steps(100.0, 10.0, 12.0) == math.inf          # a slower plan: never pays
    with pytest.raises(ParallelLabError):
        reshard.switch_seconds(1e12, 0.0, 0.0)
