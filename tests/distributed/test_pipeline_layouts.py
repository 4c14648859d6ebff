"""Stage layouts real runs use, executed on the tiny model: the embedding and the head as layer slots
(Meta's Llama 3 layout), and interleaving whose chunks are unequal. Losses against the one-process
reference, bytes and memory against the ledger."""

from __future__ import annotations

import pytest

from parallel_lab import rank_view
from parallel_lab.distributed.pipeline_parallel.stages import layers_per_stage, stage_layout
from parallel_lab.distributed.runtime.run import run
from parallel_lab.specs import RUN_DEFAULTS, ModelSpec, Plan

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(300)]


def test_embed_head_layout_puts_one_block_fewer_on_the_first_and_last_stage():
    spec = ModelSpec.preset("tiny-llama").with_(layers=6)
    plan = Plan(pp=2, grad_accum=2, pp_split="embed-head", **RUN_DEFAULTS)
    assert layers_per_stage(spec, plan) == [3, 3]             # 8 slots: [emb 0 1 2] [3 4 5 head]
    plan = Plan(pp=4, grad_accum=4, pp_split="embed-head", **RUN_DEFAULTS).with_(seq=64)
    assert layers_per_stage(spec, plan) == [1, 2, 2, 1]       # 8 slots of 2: emb+0, 1 2, 3 4, 5+head
    assert stage_layout(spec, plan, 0).chunks == ((0,),)


@pytest.mark.parametrize("layers, split", [(4, "embed-head"), (5, "layers")])
def test_interleaved_with_unequal_chunks_runs_and_matches_the_ledger(layers, split):
    """4 blocks + 2 slots in 4 chunks: [emb 0] [1 2] [3] [head]; 5 blocks in 4 chunks: [0 1] [2] [3] [4]."""
    spec = ModelSpec.preset("tiny-llama").with_(layers=layers)
    plan = Plan(pp=2, schedule="interleaved", interleave=2, grad_accum=4, pp_split=split,
                **{**RUN_DEFAULTS, "seq": 64, "micro_batch": 2}, attention="flash", mlp="fused")
    rep = run(spec, plan, steps=2)
    # flash and fused kernels sum in another order than the eager reference; AdamW's normalised first
    # steps (lr 3e-3) turn fp32 rounding into ~1e-5 parameter differences
    assert rep.max_abs_param_diff <= 1e-4
    for a, b in zip(rep.losses, rep.reference_losses, strict=True):
        assert a == pytest.approx(b, abs=1e-5)
    for dim, c in rep.comm.items():
        assert c["measured_bytes"] == c["predicted_bytes"], dim
    for cat in ("parameters", "gradients", "optimizer_states"):
        assert rep.memory[cat]["measured_bytes"] == rep.memory[cat]["predicted_bytes"], cat
    act = rep.memory["activations"]
    # the blocks of each chunk are weighed by the schedule's own action list (rank_view.block_inflight); the
    # rotary tables are shared by a micro-batch's chunks, which the per-unit count approximates (< 1%)
    assert act["measured_bytes"] == pytest.approx(act["predicted_bytes"], rel=0.01)
    blocks = [rank_view.block_inflight(layers, "interleaved", 2, 4, 2, s, split) for s in (0, 1)]
    even = [len(stage_layout(spec, plan, s).layers) * rank_view.inflight_microbatches("interleaved", 2, 4, 2, s)
            for s in (0, 1)]
    assert blocks != even                                    # unequal chunks change the peak
