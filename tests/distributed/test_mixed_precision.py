"""Mixed precision (``optimizer="adam-mixed"``, ``dtype="bf16"``) for DDP and ZeRO-1/2
(distributed/model/mixed_precision.py).

Two references for every run:

* the **bf16 mixed-precision reference** (``reference_train(..., mixed=True)``): one process doing the same
  arithmetic (bf16 model, fp32 master and AdamW, the global batch as micro-batches whose bf16 gradients
  accumulate). With two micro-batches in all (dp=2, or one rank with grad_accum=2) the data-parallel run
  rounds the gradient exactly as the reference does (``g0 / 2 + g1 / 2`` rounded once to bf16, whether
  by autograd's accumulation or by gloo's bf16 sum; the scalings by 1/2 are exact), so losses and fp32
  master weights are **bitwise equal**. With four ranks the all-reduce sums four bf16 gradients in
  another order than the reference's sequential accumulation: the first loss is still bitwise equal (same
  bf16 weights, same rows), later ones within the bf16 bounds below.
* the **fp32 reference** (``reference_train``): losses within one bf16 rounding step of the loss
  (``2^-8`` relative; observed up to 1.5e-3 of 0.025); fp32 master weights within Adam's bound on a step
  (Kingma & Ba 2015, Sec. 2.1: ``|step| <= lr`` when ``1 - beta1 <= sqrt(1 - beta2)``), so two runs whose
  gradients differ drift apart by at most ``2 lr`` per step, plus the bf16 rounding of the initial
  weights the master starts from (``2^-9 max |w0|``): 1.8e-2 for 3 steps (observed 1.3e-2 to 1.4e-2,
  tiny gradients whose sign bf16 flips; also observed between the two references themselves).

And, per rank: the traced collectives equal ``comm.collectives`` call by call (bf16 gradients and
gathered parameters: exactly half the bytes of the fp32 plan's messages), the measured state memory
equals ``ledger.state_bytes`` (2 + 2 + 12 bytes per parameter, sharded per ZeRO stage), activations
within 2% of the per-op model (bf16: 2 bytes per saved element).
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from parallel_lab import comm, layout, ledger
from parallel_lab.distributed.model.model import ADAMW, init_weights
from parallel_lab.distributed.model.reference import reference_train
from parallel_lab.distributed.runtime.launch import launch
from parallel_lab.distributed.runtime.run import predicted_activations
from parallel_lab.distributed.runtime.train import (
    check_runnable,
    global_losses,
    max_abs_diff,
    merge_params,
    train_rank,
)
from parallel_lab.specs import ModelSpec, ParallelLabError, Plan

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(180)]

STEPS = 3
LLAMA = ModelSpec.preset("tiny-llama").with_(layers=2)      # units: root 131,200 + 2 blocks of 181,504
#: Odd-sized units (uneven shards for dp = 4), tied embeddings, LayerNorm, biases.
ODD_GPT = ModelSpec.preset("tiny-gpt").with_(layers=2, hidden=33, heads=3, kv_heads=3, ffn=50, vocab=101,
                                             max_positions=64, tied_embeddings=True)


def plan(**kw) -> Plan:
    return Plan(**{"micro_batch": 2, "seq": 32, "optimizer": "adam-mixed", "dtype": "bf16", **kw})


def bounds(spec: ModelSpec, losses: list[float]) -> tuple[float, float]:
    """(loss tolerance, parameter tolerance) against the fp32 reference; module docstring."""
    w0 = max(float(t.abs().max()) for t in init_weights(spec).values())
    return 2**-8 * max(losses), 2 * STEPS * ADAMW["lr"] + 2**-9 * w0


def run_and_check(spec: ModelSpec, p: Plan, bitwise: bool):
    results = launch(train_rank, p, spec, p, STEPS, 0, timeout_s=150)
    losses, params = global_losses(results), merge_params(results)
    mixed, fp32 = reference_train(spec, p, STEPS, 0, mixed=True), reference_train(spec, p, STEPS, 0)
    assert all(t.dtype == torch.float32 for t in params.values())         # the fp32 masters
    if bitwise:
        assert losses == mixed.losses
        assert max_abs_diff(params, mixed.params) == 0.0
    else:
        assert losses[0] == mixed.losses[0]
    loss_tol, param_tol = bounds(spec, fp32.losses)
    for ref in (mixed, fp32):
        assert max(abs(a - b) for a, b in zip(losses, ref.losses, strict=True)) <= loss_tol, (losses, ref.losses)
        assert max_abs_diff(params, ref.params) <= param_tol
    assert losses[-1] < losses[0]

    predicted = comm.collectives(spec, p, stage=0)
    fp32_plan = p.with_(optimizer="adam-fp32", dtype="fp32")
    assert comm.payload_bytes(predicted)["dp"] * 2 == comm.payload_bytes(comm.collectives(spec, fp32_plan))["dp"]
    want_calls = Counter()
    for c in predicted:
        want_calls[(c.dim, c.kind, c.message_bytes, c.group_size, c.phase)] += c.count * STEPS
    want_state = {k: int(v) for k, v in ledger.state_bytes(spec, p).items()}
    want_act = predicted_activations(spec, p)
    for r in results:
        got = Counter((e.dim, e.kind, e.message_bytes, e.group_size, e.phase) for e in r.events)
        assert got == want_calls, (r.rank, got - want_calls, want_calls - got)
        assert {k: r.memory[k] for k in want_state} == want_state, (r.rank, r.memory)
        assert abs(r.memory["activations"] - want_act) <= 0.02 * want_act, (r.memory["activations"], want_act)
    return results, want_state


@pytest.mark.parametrize("kw", [{"zero": 0, "dp_kind": "naive"}, {"zero": 0, "bucket_mb": 0.2},
                                {"zero": 1}, {"zero": 2}], ids=["ddp-naive", "ddp-bucketed", "zero1", "zero2"])
def test_two_ranks_are_bitwise_the_mixed_reference(kw):
    p = plan(dp=2, **kw)
    results, state = run_and_check(LLAMA, p, bitwise=True)
    n, shard = LLAMA.n_params, sum(-(-u // 2) for u in layout.unit_sizes(LLAMA, p, 0).values())
    assert state["parameters"] == 2 * n                                   # the ZeRO paper's 2 + 2 + 12
    assert state["gradients"] == 2 * (shard if p.zero == 2 else n)
    assert state["optimizer_states"] == 12 * (shard if p.zero else n)
    if p.dp_kind == "bucketed" and not p.zero:                            # several bf16 buckets, as predicted
        sizes = [sum(b for _, b in bucket) for bucket in comm.ddp_buckets(LLAMA, p)]
        assert len(sizes) > 2 and results[0].info["buckets"] == sizes


def test_four_ranks_zero2_with_accumulation_and_uneven_shards():
    """dp=4, ZeRO-2, two micro-batches per rank accumulating bf16 gradients; odd units (uneven shards)."""
    p = plan(dp=4, zero=2, grad_accum=2, micro_batch=1)
    assert any(n % 4 for n in layout.unit_sizes(ODD_GPT, p, 0).values())
    run_and_check(ODD_GPT, p, bitwise=False)


def test_one_rank_accumulating_two_micro_batches_is_bitwise_the_mixed_reference():
    p = plan(grad_accum=2)
    (r,) = launch(train_rank, p, LLAMA, p, STEPS, 0, timeout_s=60)
    ref = reference_train(LLAMA, p, STEPS, 0, mixed=True)
    assert r.losses == ref.losses and max_abs_diff(r.params, ref.params) == 0.0 and not r.events
    assert {k: r.memory[k] for k in ("parameters", "gradients", "optimizer_states")} == \
        {k: int(v) for k, v in ledger.state_bytes(LLAMA, p).items()} == \
        {"parameters": 2 * LLAMA.n_params, "gradients": 2 * LLAMA.n_params, "optimizer_states": 12 * LLAMA.n_params}


@pytest.mark.parametrize("kw, match", [
    ({"dtype": "fp32"}, "--dtype bf16"),
    ({"dp": 2, "zero": 3}, "fsdp2-mixed"),
    ({"optimizer": "adam-mixed-fp32-grad"}, "not runnable here; use adam-mixed"),
])
def test_unrunnable_mixed_plans_are_refused_before_launch(kw, match):
    with pytest.raises(ParallelLabError, match=match):
        check_runnable(LLAMA, plan(**kw))
