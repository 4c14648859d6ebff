"""Hidden tests of predict_bubble: against closed forms and simulated timelines of the action lists."""

from __future__ import annotations

from parallel_lab.grading.feedback import check_revealed as check
from parallel_lab.grading.harness import Fail, points
from parallel_lab.schedules.generators import build_schedule
from parallel_lab.simulate import bubble_formula, simulate

CASES = [("gpipe", 4, 8, 1), ("1f1b", 2, 3, 1), ("1f1b", 8, 16, 1), ("interleaved", 4, 8, 2),
         ("interleaved", 2, 4, 3), ("interleaved", 4, 12, 4), ("zb-h1", 4, 8, 1), ("zb-h1", 3, 3, 1),
         ("zb-h1", 8, 24, 1)]


@points(3)
def test_bubble_against_simulation(sub):
    for name, p, m, v in CASES:
        sim = simulate(build_schedule(name, p, m, v)).bubble_ratio
        if abs(sim - bubble_formula(name, p, m, v)) > 1e-9:        # the target itself is checked first
            raise Fail(f"internal: simulation and closed form disagree for {name} p={p} m={m} v={v}")
        fb = check(sub.bubble_ratio(name, p, m, v), sim, rtol=1e-9, name=f"{name} p={p} m={m} v={v} bubble")
        if not fb:
            raise Fail(fb.message)


@points(2)
def test_inflight_against_simulation(sub):
    for name in ("gpipe", "1f1b"):
        for p, m in ((2, 2), (4, 8), (4, 3), (8, 16)):
            want = simulate(build_schedule(name, p, m)).peak_inflight
            got = [sub.peak_inflight(name, p, m, r) for r in range(p)]
            if got != want:
                raise Fail(f"{name} p={p} m={m}: peak in-flight per stage {got}, the simulated schedule holds {want}")
