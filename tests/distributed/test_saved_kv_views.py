"""The per-op activation model against what torch saves when one rank holds a single key/value head.

``repeat_kv`` expands a kv head to the query heads it serves; with one kv head per rank that expansion is a
view, and with a micro-batch of 1 so is matmul's flattening to ``(b * heads, s, d)``: torch then saves the
unrepeated key and value. Measured by ``parallel-lab run`` (saved-tensor meter) against the prediction.
"""

from __future__ import annotations

import pytest

from parallel_lab import activations
from parallel_lab.distributed.runtime.run import run
from parallel_lab.specs import ModelSpec, Plan

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(240)]

MQA = ModelSpec(layers=2, hidden=64, heads=4, kv_heads=1, ffn=172, vocab=256, flavour="llama")
GQA = ModelSpec(layers=2, hidden=64, heads=4, kv_heads=2, ffn=172, vocab=256, flavour="llama")


@pytest.mark.parametrize("spec,tp,micro_batch", [(MQA, 1, 1), (MQA, 1, 2), (GQA, 2, 1), (GQA, 2, 2), (GQA, 1, 1)],
                         ids=["mqa-mb1", "mqa-mb2", "gqa-tp2-mb1", "gqa-tp2-mb2", "gqa-tp1-mb1"])
def test_saved_key_value_bytes_equal_the_prediction(spec, tp, micro_batch):
    plan = Plan(tp=tp, seq=64, micro_batch=micro_batch, optimizer="adam-fp32", dtype="fp32")
    r = run(spec, plan, steps=1, timeout_s=180)
    assert r.memory["activations"]["measured_bytes"] == r.memory["activations"]["predicted_bytes"]
    # the view case saves less than the repeated one (the prediction is not the same either way)
    core = [x for x in activations.block_saves(spec, plan) if x.op in ("core.qk", "core.pv")]
    one_kv_head = (spec.kv_heads // tp if tp <= spec.kv_heads else 1) == 1
    repeated = [x for x in core if x.tensor.startswith(("k^T", "v"))]
    assert all(x.shape[1] == (1 if one_kv_head and micro_batch == 1 else spec.heads // tp) for x in repeated)


def test_the_runnable_tp_refuses_what_the_plan_refuses():
    from parallel_lab.distributed.tensor_parallel.tp_model import check_tp
    from parallel_lab.errors import ParallelLabError

    model = ModelSpec(layers=2, hidden=96, heads=12, kv_heads=6, flavour="llama")
    with pytest.raises(ParallelLabError) as ours:
        check_tp(model, Plan(tp=4))
    with pytest.raises(ParallelLabError) as plan:
        Plan(tp=4).validate(model)
    assert str(ours.value) == str(plan.value)
