"""Every communication buffer measured on CPU ranks against the ledger's part of it, byte for byte.

The runnable code samples its buffers where they are alive (``tracer.buffers``, one byte count per call):
DDP's buckets beyond the gradients, ZeRO-1/2's flat gradient and gathered unit, ZeRO-3's gathered units
and full gradients, SP's full-sequence tensors, the messages of one pipeline P2P action, all-gather
context parallelism's dK/dV reduce-scatter, ring attention's K/V and dK/dV blocks, Ulysses' all-to-all
buffers, expert parallelism's dispatch and combine all-to-alls. Each rank's parts
(``RankResult.info["comm_buffers"]``) must equal ``ledger_buffers.comm_buffer_parts`` of its stage, and
``parallel-lab run``'s memory table shows the sum beside the prediction. A part the code holds and the
ledger does not know (or the reverse) fails as a key mismatch; a wrong size as a value mismatch.
"""

from __future__ import annotations

import pytest

from parallel_lab import ledger_buffers
from parallel_lab.distributed.runtime.launch import launch
from parallel_lab.distributed.runtime.run import predicted_comm_buffer_parts, run
from parallel_lab.distributed.runtime.train import train_rank
from parallel_lab.specs import ModelSpec, Plan

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(300)]

LLAMA = ModelSpec.preset("tiny-llama")


def plan(**kw) -> Plan:
    return Plan(**{"micro_batch": 2, "seq": 32, "optimizer": "adam-fp32", "dtype": "fp32", **kw})


PLANS = {
    # accumulating over 2 micro-batches: the buckets must not hold a second copy of the gradients
    "ddp-bucketed": plan(dp=2, grad_accum=2, bucket_mb=0.5),
    "zero1": plan(dp=2, zero=1),
    "zero1-allreduce": plan(dp=2, zero=1, zero1_reduce="all_reduce"),      # no output shard: the flat buffer only
    "zero2": plan(dp=2, zero=2, grad_accum=2),          # one reduce-scatter into the shard: no temporary
    "zero2-sharded": plan(dp=2, zero=2, grad_accum=2, zero2_accumulate="sharded"),
    "zero3": plan(dp=2, zero=3),
    "tp-sp": plan(tp=2, sp=True),                     # b = 2: the reordering copy of the gathered sequence
    "tp-sp-b1": plan(tp=2, sp=True, micro_batch=1),
    "pp-1f1b": plan(pp=2, grad_accum=4, schedule="1f1b"),
    "cp-allgather": plan(cp=2, cp_kind="allgather"),
    "cp-allgather-dp": plan(dp=2, cp=2, cp_kind="allgather", micro_batch=1),   # gradients over dp x cp
    "cp-ring": plan(cp=2, cp_kind="ring"),                                    # three blocks: no next one
    "cp-ring-4": plan(cp=4, cp_kind="ring", micro_batch=1),                   # four blocks in backward
    "cp-ulysses": plan(cp=2, cp_kind="ulysses"),
    "cp-ulysses-repeated-kv": plan(cp=4, cp_kind="ulysses", micro_batch=1),   # kv_heads 2 < cp 4: f = 2
    "mixed-zero1": plan(dp=2, zero=1, optimizer="adam-mixed", dtype="bf16"),
    "zero3-pp": plan(dp=2, pp=2, zero=3, grad_accum=2, schedule="1f1b", micro_batch=1),
    "ddp-pp": plan(dp=2, pp=2, grad_accum=2, schedule="1f1b", micro_batch=1),   # DDP accumulating under PP
}
MOE = ModelSpec.preset("tiny-moe")
#: expert parallelism (its own model): the dispatch and combine all-to-alls' input and output
MOE_PLANS = {
    "ep2": plan(dp=2, ep=2),
    "ep2-accumulate": plan(dp=4, ep=2, grad_accum=2, micro_batch=1),
}
CASES = {**{k: (LLAMA, p) for k, p in PLANS.items()}, **{k: (MOE, p) for k, p in MOE_PLANS.items()}}


def _parts(results, p: Plan, model: ModelSpec = LLAMA) -> list[tuple[int, dict[str, int], dict[str, int]]]:
    out = []
    for r in results:
        measured = {k: v for k, v in r.info["comm_buffers"].items() if v}
        out.append((r.rank, measured, predicted_comm_buffer_parts(model, p, r.coords["pp"])))
    return out


@pytest.mark.parametrize("name", list(CASES))
def test_comm_buffers_equal_the_ledger_part_by_part(name):
    model, p = CASES[name]
    results = launch(train_rank, p, model, p, steps=2, seed=0, return_params=False, timeout_s=240)
    for rank, measured, predicted in _parts(results, p, model):
        assert measured == predicted, (name, rank, measured, predicted)
    if p.zero or p.sp or p.pp > 1 or p.cp > 1 or p.ep > 1:
        assert any(m for _, m, _ in _parts(results, p, model)), name       # something was measured


def test_ddp_buckets_would_show_a_second_copy():
    """The DDP sample is not vacuous: the buckets' bytes beyond the gradients, which are zero only because
    the gradients are views into the buckets (here checked against the bucket sizes the ranks built)."""
    p = PLANS["ddp-bucketed"]
    results = launch(train_rank, p, LLAMA, p, steps=1, seed=0, return_params=False, timeout_s=240)
    for r in results:
        assert len(r.info["buckets"]) > 2                          # several buckets, all allocated
        assert r.info["comm_buffers"] == {"ddp_buckets": 0}
    assert ledger_buffers.comm_buffer_parts(LLAMA, p) == {}


def test_run_reports_comm_buffers_of_a_composition():
    """dp 2 x tp 2 (SP) x pp 2 with ZeRO-1: the report's row, and every rank's parts, equal the ledger."""
    p = plan(dp=2, tp=2, sp=True, pp=2, zero=1, grad_accum=2, micro_batch=1, schedule="1f1b")
    rep = run(LLAMA, p, steps=1, timeout_s=280)
    for rank, measured, predicted in _parts(rep.ranks, p):
        assert measured == predicted, (rank, measured, predicted)
        assert set(measured) == {"zero_reduce", "zero_gather", "sp", "pp"}
    row = rep.to_json()["comm_buffers"]
    assert row["measured_bytes"] == row["predicted_bytes"] > 0
    assert "comm_buffers" in rep.summary()


def test_pp_part_where_the_schedule_posts_other_than_two_messages():
    """The ledger's ``pp`` part is the most messages one P2P action of the stage's list posts together
    (``schedules.messages_at_once``): GPipe's last stage posts one at a time, interleaved 1F1B up to four
    at once from 2p micro-batches on (two with m = p = 2); measured against predicted per stage."""
    one = 1 * 32 * LLAMA.hidden * 4                                  # one (b, s, h) fp32 message, b = 1
    for p, want in ((plan(pp=2, grad_accum=2, schedule="gpipe", micro_batch=1), {0: 2 * one, 1: one}),
                    (plan(pp=2, grad_accum=4, schedule="interleaved", interleave=2, micro_batch=1),
                     {0: 4 * one, 1: 4 * one}),
                    (plan(pp=2, grad_accum=2, schedule="interleaved", interleave=2, micro_batch=1),
                     {0: 2 * one, 1: 2 * one})):
        results = launch(train_rank, p, LLAMA, p, steps=1, seed=0, return_params=False, timeout_s=240)
        for r in results:
            assert r.info["comm_buffers"]["pp"] == want[r.coords["pp"]], (p.schedule, r.rank)
            assert predicted_comm_buffer_parts(LLAMA, p, r.coords["pp"])["pp"] == want[r.coords["pp"]]
