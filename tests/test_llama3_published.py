"""Llama 3 405B as Meta ran it (Dubey et al. 2024, Table 4 and Sec. 3.3.2; shared/reference/published_runs.md):
each of the three Table 4 configurations fits in an H100's 80 GB once the ledger is given Meta's settings.

Settings and how they are spelled here: FSDP sharding optimizer states and gradients but not parameters
(``zero=2``; FSDP reduce-scatters every micro-batch into the gradient shard: ``zero2_accumulate="sharded"``),
gradients accumulated and reduce-scattered in FP32 (``optimizer="adam-mixed-fp32-grad"``: a
bf16 gradient plus an fp32 accumulator, fp32 on the wire), the interleaved schedule with the embedding and
the head in a layer slot of the first and last stage (``schedule="interleaved"``, ``interleave=8``,
``pp_split="embed-head"``: 128 slots in 16 x 8 chunks), FlashAttention-style attention and a fused SwiGLU
(``attention="flash"``, ``mlp="fused"``), sequence parallelism, no activation checkpointing (the 8K stage),
all-gather context parallelism at 128K. Micro-batch 1; ``grad_accum`` is the sequences per DP rank.
"""

from __future__ import annotations

import pytest

from parallel_lab import ledger
from parallel_lab.hardware import ClusterSpec
from parallel_lab.specs import ModelSpec, Plan

L405 = ModelSpec.preset("llama3-405b")
H100 = ClusterSpec.preset("h100-sxm")
META = dict(tp=8, pp=16, zero=2, zero2_accumulate="sharded", sp=True, optimizer="adam-mixed-fp32-grad",
            schedule="interleaved", interleave=8,
            pp_split="embed-head", attention="flash", mlp="fused", recompute="none", micro_batch=1)
#: Table 4: (GPUs, CP, DP, sequence, sequences per DP rank)
TABLE4 = [(8192, 1, 64, 8192, 32), (16384, 1, 128, 8192, 16), (16384, 16, 8, 131072, 16)]


@pytest.mark.parametrize("gpus, cp, dp, seq, per_dp", TABLE4)
def test_each_table4_configuration_fits_in_80_gb(gpus, cp, dp, seq, per_dp):
    plan = Plan(dp=dp, cp=cp, seq=seq, grad_accum=per_dp, cp_kind="allgather", **META).validate(L405, gpus)
    assert plan.global_batch_tokens == 16 * 2**20                      # 16M tokens per batch, every row
    led = ledger.memory(L405, plan, H100)
    assert led.fits and led.total_bytes < 72e9, led.total_bytes         # 80 GB less the 10% margin
    assert led.stage == 1                                               # stage 0 lost a block to the embedding
    # the same plan with eager kernels and Korthikanti's selective recompute (the starting point)
    # does not fit: the MLP's four ffn-wide tensors and the eager stage layout are what was missing
    eager = plan.with_(attention="eager", mlp="eager", recompute="selective", schedule="1f1b", interleave=1,
                       pp_split="layers")
    assert not ledger.memory(L405, eager, H100).fits


def test_the_fused_kernels_are_what_makes_the_8k_run_fit():
    plan = Plan(dp=128, seq=8192, grad_accum=16, **META)
    assert ledger.memory(L405, plan, H100).fits
    assert not ledger.memory(L405, plan.with_(mlp="eager"), H100).fits


# ---- the planner, given Meta's settings, against Meta's configurations -------------------------------------
# The full search (every tp, cp, pp, dp; README "What the planner proposes with Meta's settings", all-gather
# CP as Meta ran it) ranks Meta's 8K degrees 13th, 9.8% behind dp 32 tp 4 pp 16 cp 8 with ZeRO-3
# (a quarter of the bubble, half the TP time), and the 131K ones 6th, 2.3% behind, with the fixed efficiency of
# h100-sxm-prior; with the default h100-sxm (its fitted profile) they are 7th and 2nd (tests/test_calibrate.py,
# docs/validation.md "The default presets, before and after"). The test searches Meta's PP
# degree and TP (time: the embed-head in-flight peaks are traced from action lists).

@pytest.mark.parametrize("seq, cp, dp, kind", [(8192, 1, 128, "allgather"), (131072, 16, 8, "allgather")])
def test_the_planner_with_metas_settings_finds_metas_configuration(seq, cp, dp, kind):
    from parallel_lab.planner import evaluate, plan_search
    from parallel_lab.planner_constraints import Constraints

    cons = Constraints(optimizer="adam-mixed-fp32-grad", attention="flash", mlp="fused", pp_split="embed-head",
                       cp_kind=kind, zero2_accumulate=("unsharded", "sharded"),
                       fixed={"interleave": 8, "pp": 16, "tp": 8, "recompute": "none", "micro_batch": 1})
    res = plan_search(L405, H100, 16384, seq, global_batch_tokens="16M", constraints=cons)
    # Meta's FSDP: ZeRO-2 reduce-scattering every micro-batch into the gradient shard
    rank = res.rank_of(dp=dp, cp=cp, zero=2, zero2_accumulate="sharded")
    assert rank is not None and rank <= 12, rank
    meta = res.top(rank)[-1]
    assert (meta.fields["dp"], meta.fields["cp"], meta.fields["zero"]) == (dp, cp, 2)
    assert meta.step_time_s <= 1.10 * res.top(1)[0].step_time_s
    ref = evaluate(L405, H100, meta.plan)
    assert meta.step_time_s == pytest.approx(ref.step_time_s, rel=1e-9)
    assert meta.memory_bytes == pytest.approx(ref.memory_bytes, rel=1e-12)
    # without the per-micro-batch reduce-scatter Meta's degrees do not fit: ZeRO-1 (= ZeRO-2 holding full
    # gradients) and ZeRO-3 under the pipeline both hold the stage's full gradients in fp32 (FSDP2's and
    # Meta's accumulation), while other degrees still fit
    cons_unsharded = Constraints(**{**cons.__dict__, "zero2_accumulate": ("unsharded",)})
    res2 = plan_search(L405, H100, 16384, seq, global_batch_tokens="16M", constraints=cons_unsharded)
    assert res2.estimates
    assert not [e for e in res2.estimates if (e.fields["dp"], e.fields["cp"]) == (dp, cp)]
