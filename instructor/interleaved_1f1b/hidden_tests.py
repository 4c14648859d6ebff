"""Hidden tests of interleaved_1f1b: bubble and in-flight peaks over (p, m, v), plain 1F1B at v = 1, the
requirement on m; executed on 2 ranks (v = 2, a 4-block model) vs one process, messages vs parallel_lab.comm."""

from __future__ import annotations

import dataclasses

from parallel_lab import comm
from parallel_lab.grading.harness import Fail, diff_calls, doing, expected_calls, points, run_ranks
from parallel_lab.grading.micro import MICRO, micro_plan

CASES = ((2, 2, 2), (2, 6, 3), (3, 3, 2), (3, 9, 3), (4, 4, 2), (4, 8, 4), (5, 10, 2), (8, 8, 2), (6, 12, 3))
PLAIN = ((2, 5, 1), (3, 3, 1), (4, 8, 1), (5, 3, 1))
SPEC4 = dataclasses.replace(MICRO, layers=4, name="micro-4")


def _built(sub, p, m, v):
    import public_tests

    return public_tests.built(sub, p, m, v)


def _bounds(p, m, v):
    import public_tests

    return [public_tests.inflight_bound(p, m, v, r) for r in range(p)]


@points(2)
def test_bubble_over_cases(sub):
    from parallel_lab.simulate import simulate

    for p, m, v in CASES:
        got = simulate(_built(sub, p, m, v)).bubble_ratio
        if abs(got - (p - 1) / (v * m)) > 1e-9:
            raise Fail(f"p={p}, v={v}, m={m}: simulated bubble {got:.4f}, expected (p - 1) / (v m) = "
                       f"{(p - 1) / (v * m):.4f}")


@points(2)
def test_inflight_over_cases(sub):
    from parallel_lab.simulate import simulate

    for p, m, v in CASES:
        got, want = simulate(_built(sub, p, m, v)).peak_inflight, _bounds(p, m, v)
        if any(g > w for g, w in zip(got, want, strict=True)):
            raise Fail(f"p={p}, v={v}, m={m}: (micro-batch, chunk) pairs in flight per rank {got}, interleaved 1F1B "
                       f"keeps at most {want}: the warm-up is longer than the first backward needs")


@points(2)
def test_one_chunk_is_plain_1f1b(sub):
    from parallel_lab.simulate import simulate

    for p, m, v in PLAIN:
        res = simulate(_built(sub, p, m, v))
        want = [min(p - r, m) for r in range(p)]
        if abs(res.bubble_ratio - (p - 1) / m) > 1e-9 or res.peak_inflight != want:
            raise Fail(f"v=1, p={p}, m={m}: bubble {res.bubble_ratio:.4f} and in flight {res.peak_inflight}; plain "
                       f"1F1B gives (p - 1) / m = {(p - 1) / m:.4f} and {want} (with one chunk the interleaved "
                       "warm-up must fall back to 1F1B's; m need not be a multiple of p)")


@points(1)
def test_m_not_a_multiple_of_p_is_refused(sub):
    for p, m, v in ((4, 6, 2), (3, 4, 3)):
        try:
            sub.interleaved_1f1b(p, m, v)
        except ValueError:
            continue
        raise Fail(f"interleaved_1f1b({p}, {m}, {v}) returned lists; m is not a multiple of p, raise ValueError "
                   "as the statement asks (micro-batches go through the chunks in groups of p)")


def _train(grid, sub):
    from parallel_lab.distributed.instruments.tracer import CommTracer
    from parallel_lab.distributed.model.data import synthetic_batch
    from parallel_lab.distributed.model.model import build_model
    from parallel_lab.distributed.pipeline_parallel.pipeline_parallel import PipelineExecutor
    from parallel_lab.distributed.pipeline_parallel.stages import stage_layout
    from parallel_lab.distributed.runtime.train import parallelize

    plan = _plan()
    schedule = _built(sub, 2, 4, 2)
    model = build_model(SPEC4, seed=0)
    tracer = CommTracer(grid.rank, grid.groups_by_dim())
    rt = parallelize(model, grid, plan, tracer)
    rt.forward_backward = PipelineExecutor(rt, stage_layout(SPEC4, plan, grid.pp_rank), schedule[grid.rank], 4)
    micro = rt.micro_batches(synthetic_batch(SPEC4, plan, 0))
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


def _plan():
    return micro_plan(pp=2, grad_accum=4, micro_batch=1, schedule="interleaved", interleave=2)


def session_values():
    """One process's step of the 4 micro-batches on the 4-block model (computed once per grading session)."""
    from parallel_lab.distributed.model.reference import reference_train

    return {"ref": reference_train(SPEC4, _plan(), 1)}


SESSION: dict = {}


@points(3)
def test_executed_equals_one_process(sub):
    ref = (SESSION or session_values())["ref"]
    out = run_ranks(_train, 2, sub, plan=_plan())
    loss = out[1][0] if out[1][0] is not None else out[0][0]
    if loss is None or abs(loss - ref.losses[0]) > 1e-5:
        raise Fail(f"the loss {loss} of the rank holding the head differs from one process's {ref.losses[0]:.6f}")
    for r, (_, params, calls) in enumerate(out):
        want = expected_calls(c for c in comm.collectives(SPEC4, _plan(), stage=r) if c.dim == "pp")
        msg = diff_calls(calls, want)
        if msg:
            raise Fail(f"rank {r}: point-to-point messages against parallel_lab.comm: {msg}")
        for n, t in params.items():
            err = float((t - ref.params[n]).abs().max())
            if err > 1e-5:
                raise Fail(f"rank {r}: parameter {n} after one step differs from one process's by {err:.2e}")
