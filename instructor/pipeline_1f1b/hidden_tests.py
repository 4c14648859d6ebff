"""Hidden tests of pipeline_1f1b: bubble and in-flight peaks over (p, m); executed on 2 ranks vs one process,
its point-to-point messages vs parallel_lab.comm."""

from __future__ import annotations

from parallel_lab import comm
from parallel_lab.grading.harness import Fail, diff_calls, doing, expected_calls, points, run_ranks
from parallel_lab.grading.micro import MICRO, micro_plan

CASES = ((2, 2), (2, 5), (3, 3), (4, 4), (4, 8), (8, 4), (5, 12))


def _built(sub, p, m):
    import public_tests

    return public_tests.built(sub, p, m)


@points(2)
def test_bubble_over_cases(sub):
    from parallel_lab.simulate import simulate

    for p, m in CASES:
        got = simulate(_built(sub, p, m)).bubble_ratio
        if abs(got - (p - 1) / m) > 1e-9:
            raise Fail(f"p={p}, m={m}: simulated bubble {got:.4f}, expected (p - 1) / m = {(p - 1) / m:.4f}")


@points(3)
def test_inflight_peaks(sub):
    from parallel_lab.simulate import simulate

    for p, m in CASES:
        got = simulate(_built(sub, p, m)).peak_inflight
        want = [min(p - r, m) for r in range(p)]
        if got != want:
            raise Fail(f"p={p}, m={m}: micro-batches in flight per stage {got}, 1F1B keeps {want}: stage r runs "
                       "p - r - 1 warm-up forwards before its first backward")


def _train(grid, sub):
    from parallel_lab.distributed.instruments.tracer import CommTracer
    from parallel_lab.distributed.model.data import synthetic_batch
    from parallel_lab.distributed.model.model import build_model
    from parallel_lab.distributed.pipeline_parallel.pipeline_parallel import PipelineExecutor
    from parallel_lab.distributed.pipeline_parallel.stages import stage_layout
    from parallel_lab.distributed.runtime.train import parallelize

    plan = micro_plan(pp=2, grad_accum=4, micro_batch=1)
    schedule = _built(sub, 2, 4)
    model = build_model(MICRO, seed=0)
    tracer = CommTracer(grid.rank, grid.groups_by_dim())
    rt = parallelize(model, grid, plan, tracer)
    rt.forward_backward = PipelineExecutor(rt, stage_layout(MICRO, plan, grid.pp_rank), schedule[grid.rank], 4)
    micro = rt.micro_batches(synthetic_batch(MICRO, plan, 0))
    rt.dp.zero_grad()
    doing(grid, "running your schedule in the pipeline executor")
    with rt.meter, tracer.observe():
        loss = rt.forward_backward(rt, micro)
    rt.dp.finish()
    for fn in rt.finalize_grads:
        fn()
    rt.dp.step()
    rt.meter.remove()
    params = {n: t.detach().clone() for n, t in rt.dp.local_parameters().items()}
    calls = [(e.kind, e.message_bytes, e.group_size) for e in tracer.events if e.dim == "pp"]
    return float(loss) if rt.owns_loss else None, params, calls


def session_values():
    """One process's step of the 4 micro-batches (computed once per grading session)."""
    from parallel_lab.distributed.model.reference import reference_train

    return {"ref": reference_train(MICRO, micro_plan(pp=2, grad_accum=4, micro_batch=1), 1)}


SESSION: dict = {}


@points(3)
def test_executed_equals_one_process(sub):
    plan = micro_plan(pp=2, grad_accum=4, micro_batch=1)
    ref = (SESSION or session_values())["ref"]
    out = run_ranks(_train, 2, sub, plan=plan)
    loss = out[1][0]
    if loss is None or abs(loss - ref.losses[0]) > 1e-5:
        raise Fail(f"the last stage's loss {loss} differs from one process's {ref.losses[0]:.6f}")
    for r, (_, params, calls) in enumerate(out):
        msg = diff_calls(calls, expected_calls(c for c in comm.collectives(MICRO, plan, stage=r) if c.dim == "pp"))
        if msg:
            raise Fail(f"stage {r}: point-to-point messages against parallel_lab.comm: {msg}")
        for n, t in params.items():
            err = float((t - ref.params[n]).abs().max())
            if err > 1e-5:
                raise Fail(f"stage {r}: parameter {n} after one step differs from one process's by {err:.2e}")
