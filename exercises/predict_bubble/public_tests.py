"""Public tests of predict_bubble: the README's example, 1F1B on 4 stages with 8 micro-batches; then every schedule
on small pipelines, against the simulated timelines of the library's action lists (``parallel_lab.simulate``)."""

from __future__ import annotations

from parallel_lab.grading.feedback import check_revealed as check
from parallel_lab.grading.harness import Fail, checks, points, require

CASES = [("gpipe", 3, 5, 1), ("1f1b", 3, 6, 1), ("interleaved", 2, 6, 2), ("interleaved", 3, 6, 2), ("zb-h1", 2, 4, 1),
         ("zb-h1", 3, 6, 1)]


@points(2)
@checks("1F1B's bubble and its in-flight micro-batches per stage", "draw the timeline of p=4, m=8: how long "
        "does the last stage wait before its first forward, and how many forwards has stage r run before its "
        "first backward?")
def test_readme_example(sub):
    fn, peak = require(sub, "bubble_ratio", "peak_inflight")
    fb = check(fn("1f1b", 4, 8), 0.375, rtol=1e-9, name="1F1B p=4 m=8 bubble")   # `parallel-lab bubble` prints 0.3750
    if not fb:
        raise Fail(fb.message)
    got = [peak("1f1b", 4, 8, r) for r in range(4)]
    if got != [4, 3, 2, 1]:
        raise Fail(f"peak in-flight per stage {got}; `parallel-lab bubble` shows 4 3 2 1")


@points(2)
@checks("the bubble of every schedule, interleaving and the split backward included, against simulated timelines",
        "with v chunks per stage, how long is one chunk's forward? With B and W split, what can the last "
        "stages do while they wait? `parallel-lab bubble` draws the timelines")
def test_schedules_against_simulation(sub):
    from parallel_lab.schedules.generators import build_schedule
    from parallel_lab.simulate import simulate

    (fn,) = require(sub, "bubble_ratio")
    for name, p, m, v in CASES:
        sim = simulate(build_schedule(name, p, m, v)).bubble_ratio
        fb = check(fn(name, p, m, v), sim, rtol=1e-9, name=f"{name} p={p} m={m} v={v} bubble")
        if not fb:
            raise Fail(fb.message)


@points(0)
def test_written_answer(sub):
    """Ungraded: your teacher reads BUBBLE_VS_MEMORY; this test only reminds you to write it."""
    from parallel_lab.grading.catalog import missing_answer

    msg = missing_answer("predict_bubble", sub.__file__)
    if msg:
        raise Fail(msg)
