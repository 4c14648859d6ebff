"""Re-sharding on CPU ranks: train under plan A, save one file per rank, load under plan B, train on.

For each pair (between them every axis changes: dp, ZeRO stage, tp with kv heads split and replicated, pp
with and without interleaving, cp), checks: (1) every state tensor (fp32 parameters, Adam's exp_avg and
exp_avg_sq) loaded by B's ranks equals, bit for bit, what A's ranks held; (2) the parameters B's runtime
gathers (its own TP / ZeRO-3 gathers) equal A's bit for bit; (3) the bytes each rank of B read from each
file of A equal ``parallel_lab.reshard.transfers`` pair by pair, and the bytes each rank of A wrote its
``written`` prediction; (4) one more step under B lands on the one-process reference after the same steps
(fp32 rounding: observed up to ~2e-5, as the other parallelisms' tests).
"""

from __future__ import annotations

import pytest

from parallel_lab import reshard
from parallel_lab.distributed.runtime.reshard_run import check_reshardable, reshard_run
from parallel_lab.errors import ParallelLabError
from parallel_lab.hardware import ClusterSpec
from parallel_lab.specs import ModelSpec, Plan

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(300)]

LLAMA = ModelSpec.preset("tiny-llama")
BASE = dict(optimizer="adam-fp32", dtype="fp32", seq=64, micro_batch=2)
PARAM_TOL = 5e-5
PAIRS = {
    "dp2-zero1 -> tp2-pp2": (Plan(dp=2, zero=1, **BASE), Plan(tp=2, pp=2, grad_accum=2, **BASE)),
    "tp2-dp2 -> cp2-dp2-zero3": (Plan(tp=2, dp=2, **BASE), Plan(cp=2, dp=2, zero=3, **BASE)),
    "pp2-interleaved-dp2-zero2 -> tp4": (
        Plan(pp=2, dp=2, zero=2, schedule="interleaved", interleave=2, grad_accum=2, micro_batch=1,
             **{k: v for k, v in BASE.items() if k != "micro_batch"}),
        Plan(tp=4, grad_accum=2, **BASE)),
}


@pytest.mark.parametrize("name", list(PAIRS))
def test_reshard_is_bitwise_and_bytes_are_predicted(name):
    a, b = PAIRS[name]
    res = reshard_run(LLAMA, a, b, steps=1, more_steps=1)
    assert res.bitwise == {"param": True, "exp_avg": True, "exp_avg_sq": True}
    assert res.params_equal
    assert res.measured == res.predicted
    pred = reshard.predict(LLAMA, a, b, ClusterSpec.preset("cpu-gloo"))
    assert res.written == pred.written and sum(res.written) == pred.checkpoint_bytes
    assert res.resume_diff is not None and res.resume_diff < PARAM_TOL


def test_mixed_precision_is_refused_before_any_process():
    with pytest.raises(ParallelLabError, match="adam-fp32"):
        check_reshardable(LLAMA, Plan(dp=2, optimizer="adam-mixed", dtype="bf16"))
