"""Public tests of design_plan: the plan file describes the task, it fits, and it beats the step time."""

from __future__ import annotations

from parallel_lab.grading.harness import Fail, checks, points

MODEL, CLUSTER, GPUS, SEQ, BATCH, TARGET_S = "llama3-8b", "h100-sxm", 16, 8192, 64, 4.5


def load_path(sub):
    path = getattr(sub, "PATH", None)
    if path is None:
        raise Fail("submit a plan file (.yaml), e.g. the output of `parallel-lab plan ... --save plan.yaml`")
    return path


def load(sub):
    from parallel_lab.errors import ParallelLabError
    from parallel_lab.planfile import load_plan

    path = load_path(sub)
    try:
        return load_plan(path)
    except ParallelLabError as e:
        raise Fail(str(e)) from None


@points(1)
@checks("the plan file describes the task: model, cluster, GPU count, sequence length, global batch", "the "
        "global batch counts sequences: micro_batch x grad_accum x dp")
def test_describes_the_task(sub):
    pf = load(sub)
    got = (pf.model.name, pf.cluster.name, pf.gpus, pf.plan.seq, pf.plan.global_batch)
    want = (MODEL, CLUSTER, GPUS, SEQ, BATCH)
    for what, g, w in zip(("model", "cluster", "gpus", "seq", "global batch (sequences)"), got, want, strict=True):
        if g != w:
            raise Fail(f"the plan file's {what} is {g!r}; the task is {w!r} (global batch = micro_batch x "
                       "grad_accum x dp)")


@points(2)
@checks("the plan fits: the ledger's total per GPU within the HBM minus a 10% margin", "`parallel-lab memory` "
        "with your degrees shows each category; which one does a degree, a ZeRO stage or recomputation shrink?")
def test_fits(sub):
    from parallel_lab import ledger

    pf = load(sub)
    led = ledger.memory(pf.model, pf.plan, pf.cluster, margin=0.1)
    if not led.fits:
        top = max(led.per_gpu_bytes, key=led.per_gpu_bytes.get)
        raise Fail(f"{led.total_bytes / 1e9:.1f} GB per GPU does not fit in {pf.cluster.hbm_bytes * 0.9 / 1e9:.1f} GB; "
                   f"the largest category is {top} ({led.per_gpu_bytes[top] / 1e9:.1f} GB): what shards or recomputes "
                   "it?")


@points(2)
@checks("the visible target: the planner's estimated step time under 4.5 s", "which communication does the "
        "estimate expose, and which degree or ZeRO stage would hide or shrink it? Is there a bubble?")
def test_beats_the_step_time(sub):
    from parallel_lab import planner

    pf = load(sub)
    est = planner.evaluate(pf.model, pf.cluster, pf.plan)
    if est.step_time_s >= TARGET_S:
        worst = max(est.exposed_s, key=est.exposed_s.get) if est.exposed_s else "none"
        raise Fail(f"estimated step time {est.step_time_s:.2f} s is not under {TARGET_S} s (compute "
                   f"{est.compute_s:.2f} s, bubble ratio {est.bubble_ratio:.3f}, most exposed communication: "
                   f"{worst}); what does your plan spend time on that another would not?")


@points(0)
def test_written_answer(sub):
    """Ungraded: your teacher reads the `# why:` lines of your plan file; this test only reminds you to write them."""
    from parallel_lab.grading.catalog import missing_answer

    msg = missing_answer("design_plan", load_path(sub))
    if msg:
        raise Fail(msg)
