"""``parallel-lab run --schedule zb-v|dualpipev``: the V schedules trained on ranks, measured against predicted."""

from __future__ import annotations

import math

import pytest
from conftest import run_cli

from parallel_lab import placed
from parallel_lab.distributed.runtime.run import check_schedule, run
from parallel_lab.errors import ParallelLabError
from parallel_lab.schedules.generators import build_schedule
from parallel_lab.specs import RUN_DEFAULTS, ModelSpec, Plan

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(240)]

LLAMA = ModelSpec.preset("tiny-llama")
PLAN = Plan(pp=2, grad_accum=4, **{**RUN_DEFAULTS, "seq": 32, "micro_batch": 2})


@pytest.mark.parametrize("name", ["zb-v", "dualpipev"])
def test_v_schedule_runs_equal_to_reference_and_prediction(name):
    rep = run(LLAMA, PLAN, steps=2, schedule=name, timeout_s=200)
    j = rep.to_json()
    assert j["max_abs_param_diff"] < 2e-5
    assert max(abs(a - b) for a, b in zip(j["losses"], j["reference_losses"], strict=True)) < 1e-5
    assert j["comm"]["pp"]["measured_bytes"] == j["comm"]["pp"]["predicted_bytes"] > 0
    for cat in ("parameters", "gradients", "optimizer_states"):
        assert j["memory"][cat]["measured_bytes"] == j["memory"][cat]["predicted_bytes"], cat
    act = j["memory"]["activations"]
    assert abs(act["measured_bytes"] - act["predicted_bytes"]) <= 0.02 * act["predicted_bytes"]
    if name == "zb-v":
        assert act["measured_bytes"] == act["predicted_bytes"]
    pipe = j["pipeline"]
    assert pipe["schedule"] == name and pipe["v"] == 2 and pipe["head_rank"] == 0
    assert pipe["peak_inflight"]["measured"] == pipe["peak_inflight"]["predicted"]
    assert f"pipeline: {name}" in rep.summary() and "final norm + head + loss on stage 0" in rep.summary()


def test_placed_state_puts_embedding_and_head_on_rank_0():
    sched = build_schedule("zb-v", 2, 4)
    shapes = dict(LLAMA.parameter_shapes())
    block = LLAMA.params_per_layer
    emb_head = math.prod(shapes["tok_emb.weight"]) + math.prod(shapes["lm_head.weight"]) + LLAMA.hidden
    assert placed.rank_chunks(LLAMA, PLAN, sched, 0) == [[0], [3]]
    assert placed.state_bytes(LLAMA, PLAN, sched, 0)["parameters"] == (2 * block + emb_head) * 4
    assert placed.state_bytes(LLAMA, PLAN, sched, 1)["parameters"] == 2 * block * 4
    # the V's turn stays on rank 1: it sends and receives only across the rank boundary
    assert {c.kind for c in placed.p2p_collectives(LLAMA, PLAN, sched, 1)} == {"send", "recv"}


def test_v_schedules_are_refused_where_their_predictions_are_not_made():
    with pytest.raises(ParallelLabError, match="pipeline alone"):
        check_schedule(LLAMA, PLAN.with_(dp=2), "zb-v")
    with pytest.raises(ParallelLabError, match="layers >= 8"):
        check_schedule(LLAMA, PLAN.with_(pp=4, grad_accum=8), "zb-v")
    p = run_cli("run", "--model", "tiny-llama", "--dp", "2", "--pp", "2", "--grad-accum", "4",
                "--schedule", "dualpipev", "--steps", "1")
    assert p.returncode == 2 and "pipeline alone" in p.stderr and "Traceback" not in p.stderr, p.stderr
