"""Hidden tests of design_plan: the expected block, and a scaled-down run on CPU ranks."""

from __future__ import annotations

import math

from parallel_lab.grading.harness import Fail, limit, points


def _pub():
    import public_tests

    return public_tests


@points(1)
def test_expected_block_is_accurate(sub):
    from parallel_lab.planfile import expectations

    pf = _pub().load(sub)
    want = expectations(pf.model, pf.cluster, pf.plan)
    got = pf.expected
    pairs = [("memory total", got.memory_bytes_per_gpu.get("total"), want.memory_bytes_per_gpu["total"]),
             ("step time", got.step_time_s, want.step_time_s)]
    for what, g, w in pairs:
        if g is None or w is None or not math.isclose(g, w, rel_tol=0.01):
            raise Fail(f"the plan file's expected {what} is {g}, the library says {w}: write the file with save_plan "
                       "(or `parallel-lab plan --save`) after the last change")


def scaled_down(plan):
    """The degrees capped at 2 each and at 4 ranks in all (dropping cp, then pp, then dp), for ``MICRO``."""
    deg = {k: min(getattr(plan, k), 2) for k in ("dp", "tp", "pp", "cp")}
    for k in ("cp", "pp", "dp"):
        if math.prod(deg.values()) > 4:
            deg[k] = 1
    pp = deg["pp"]
    schedule = plan.schedule if pp > 1 else "1f1b"
    return plan.with_(**deg, zero=plan.zero if deg["dp"] > 1 else 0, sp=plan.sp and deg["tp"] > 1, seq=32,
                      micro_batch=1, grad_accum=2 * pp, optimizer="adam-fp32", dtype="fp32", schedule=schedule,
                      interleave=plan.interleave if schedule == "interleaved" and 4 % (pp * plan.interleave) == 0
                      else 1, bucket_mb=0.5)


@points(3)
@limit(240)
def test_scaled_down_run(sub):
    from parallel_lab.distributed.runtime.run import run
    from parallel_lab.grading.micro import MICRO

    pf = _pub().load(sub)
    small = scaled_down(pf.plan)
    rep = run(MICRO, small, steps=1, timeout_s=180)
    where = f"scaled down to dp={small.dp} tp={small.tp} pp={small.pp} cp={small.cp} zero={small.zero}"
    if rep.max_abs_param_diff > 1e-4:
        raise Fail(f"{where}: parameters differ from one process by {rep.max_abs_param_diff:.2e}")
    for dim, c in rep.comm.items():
        if c["measured_bytes"] != c["predicted_bytes"]:
            raise Fail(f"{where}: {dim} moved {c['measured_bytes']:,} B, predicted {c['predicted_bytes']:,} B")
