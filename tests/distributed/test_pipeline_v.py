"""ZB-V and DualPipeV on CPU ranks: the same executor, equal to the one-process reference.

One step per configuration (p=2 and p=4), each rank returning its loss, its stage's gradients, its traced
point-to-point calls and its measured timeline. Checked: losses and every gradient against the reference
(fp32; tolerances as in test_pipeline.py, the pipeline runs the same kernels per micro-batch in the same
accumulation order), the layers each rank keeps (the V: rank 0 holds the embedding, the first and the last
chunk, and the head), the traced messages call by call against the action list (one ``(b, s, h)`` fp32
tensor per send, none across the V's turn on rank ``p - 1``), and the measured timeline against the
simulated one (same actions, same in-flight peak per rank; the replay of the measured durations is no
longer than the measured step).
"""

from __future__ import annotations

import pytest

from parallel_lab.distributed.instruments.tracer import CommTracer
from parallel_lab.distributed.model.data import synthetic_batch
from parallel_lab.distributed.model.model import build_model, loss_fn
from parallel_lab.distributed.pipeline_parallel.pipeline_report import measured_step, replay
from parallel_lab.distributed.pipeline_parallel.stages import stage_layout
from parallel_lab.distributed.runtime.launch import launch
from parallel_lab.distributed.runtime.train import parallelize
from parallel_lab.schedules.actions import Placement, Schedule
from parallel_lab.schedules.generators import build_schedule
from parallel_lab.simulate import simulate
from parallel_lab.specs import ModelSpec, Plan

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(200)]

LOSS_TOL = GRAD_TOL = 1e-6

LLAMA = ModelSpec.preset("tiny-llama")                       # 4 blocks: p=2 on a V has 4 one-block chunks
LLAMA8 = LLAMA.with_(layers=8)                               # p=4 on a V: 8 chunks


def make_plan(**kw) -> Plan:
    return Plan(**{"micro_batch": 2, "seq": 32, "optimizer": "adam-fp32", "dtype": "fp32", **kw})


def reference(spec: ModelSpec, plan: Plan) -> tuple[float, dict]:
    """One process: the step's micro-batches one after another, each ``loss / m``, gradients accumulated."""
    model = build_model(spec, 0)
    batch = synthetic_batch(spec, plan, 0, 0)
    m, b, total = plan.grad_accum, plan.micro_batch, 0.0
    for i in range(m):
        mb = batch.rows(i * b, (i + 1) * b)
        loss = loss_fn(model(mb.tokens, mb.positions), mb.targets) / m
        loss.backward()
        total += loss.item()
    return total, {k: p.grad for k, p in model.named_parameters()}


def one_step(grid, spec: ModelSpec, plan: Plan, schedule: Schedule) -> dict:
    model = build_model(spec, 0, device=grid.device)
    tracer = CommTracer(grid.rank, grid.groups_by_dim())
    rt = parallelize(model, grid, plan, tracer, schedule=schedule)
    micro = rt.micro_batches(synthetic_batch(spec, plan, 0, 0))
    with tracer.observe():
        rt.dp.zero_grad()
        loss = rt.forward_backward(rt, micro)
        rt.dp.finish()
    grads = {n: p.grad.detach().clone() for n, p in rt.model.named_parameters() if p.grad is not None}
    return {"rank": grid.rank, "coords": grid.coords, "loss": loss, "owns_loss": rt.owns_loss, "grads": grads,
            "events": [(e.dim, e.kind, e.message_bytes, e.group_size) for e in tracer.events],
            "pp": rt.extras["pipeline"].report()}


def check(spec: ModelSpec, plan: Plan, schedule: Schedule) -> list[dict]:
    res = launch(one_step, plan, spec, plan, schedule, timeout_s=150)
    ref_loss, ref_grads = reference(spec, plan)
    owners = [r for r in res if r["owns_loss"]]
    assert [r["rank"] for r in owners] == [0]                          # the head sits on rank 0 on a V
    assert abs(owners[0]["loss"] - ref_loss) <= LOSS_TOL, (owners[0]["loss"], ref_loss)
    seen, worst = set(), 0.0
    for r in res:
        for name, g in r["grads"].items():
            diff = (g - ref_grads[name]).abs().max().item()
            assert diff <= GRAD_TOL, (name, r["rank"], diff)
            seen.add(name)
            worst = max(worst, diff)
    assert seen == set(ref_grads)
    act_bytes = plan.seq * plan.micro_batch * spec.hidden * 4
    for r in res:
        rank = r["coords"]["pp"]
        # the traced point-to-point calls are exactly the list's ops, each one activation-sized tensor
        want = sorted(("pp", "send" if op.is_send else "recv", act_bytes, 2)
                      for a in schedule[rank] for op in a.ops)
        assert sorted(e for e in r["events"] if e[0] == "pp") == want, rank
    # measured timeline against the simulator's, in the simulator's frame
    records = [r["pp"]["steps"][-1] for r in sorted(res, key=lambda r: r["coords"]["pp"])]
    meas = measured_step(records)
    sim = simulate(schedule)
    key = sorted((i.rank, i.name, i.micro_batch, i.chunk) for i in meas["intervals"])
    assert key == sorted((i.rank, i.name, i.micro_batch, i.chunk) for i in sim.timeline)
    assert meas["inflight_peak"] == sim.peak_inflight
    assert all(rec["inflight_trace"][-1] == 0 for rec in records)
    rep = replay(schedule, meas["intervals"])
    assert rep["stats"].step_time <= meas["stats"].step_time * 1.001
    print(f"p={plan.pp} m={plan.grad_accum}: loss diff {abs(owners[0]['loss'] - ref_loss):.1e}, worst grad diff "
          f"{worst:.1e}; bubble ratio simulated {sim.bubble_ratio:.1%} measured {meas['stats'].bubble_ratio:.1%} "
          f"replayed {rep['stats'].bubble_ratio:.1%}; idle fraction simulated {sim.idle_fraction:.1%} measured "
          f"{meas['stats'].idle_fraction:.1%}")
    return res


@pytest.mark.parametrize("name,m", [("zb-v", 2), ("zb-v", 4), ("dualpipev", 4), ("dualpipev", 6)])
def test_two_stages(name, m):
    plan = make_plan(pp=2, grad_accum=m)
    res = check(LLAMA, plan, build_schedule(name, 2, m))
    assert [r["pp"]["chunks"] for r in res] == [[[0], [3]], [[1], [2]]]        # the V: stages 0,3 and 1,2


@pytest.mark.parametrize("name", ["zb-v", "dualpipev"])
def test_four_stages(name):
    plan = make_plan(pp=4, grad_accum=8)
    res = check(LLAMA8, plan, build_schedule(name, 4, 8))
    assert [r["pp"]["chunks"] for r in sorted(res, key=lambda r: r["rank"])] == [[[0], [7]], [[1], [6]],
                                                                                   [[2], [5]], [[3], [4]]]
    # the simulated and the measured timeline drawn together (the same figure parallel-lab run draws)
    from parallel_lab.viz.plots.timeline import pipeline_timelines_figure

    meas = measured_step([r["pp"]["steps"][-1] for r in sorted(res, key=lambda r: r["coords"]["pp"])])
    sim = simulate(build_schedule(name, 4, 8))
    fig = pipeline_timelines_figure(sim, meas["intervals"], measured_step_time=meas["stats"].step_time)
    sim_ax, meas_ax = fig.axes[:2]
    assert [t.get_text() for t in meas_ax.get_yticklabels()] == [f"rank {r}" for r in range(4)]
    assert f"{sim.idle_fraction:.1%}" in sim_ax.get_title()


def test_v_stage_layout_holds_embedding_and_head_on_rank_0():
    plan = make_plan(pp=4, grad_accum=8)
    v = Placement.v_shape(4)
    first, last = stage_layout(LLAMA8, plan, 0, v), stage_layout(LLAMA8, plan, 3, v)
    assert first.has_embedding and first.has_head and first.chunks == ((0,), (7,))
    assert not last.has_embedding and not last.has_head and last.local_neighbour(0, +1) == 1
    assert last.local_neighbour(1, -1) == 0 and first.local_neighbour(0, +1) is None


LEARNER_CSV = """0F0,0F1,3F0,3B0,3F1,3B1,0B0,0B1
1F0,2F0,1F1,2F1,2B0,1B0,2B1,1B1
"""


def test_a_learners_csv_schedule_runs_on_cpu_ranks(tmp_path):
    """A V schedule written by hand in torch's compute-only CSV format: read, lowered, validated, run."""
    from parallel_lab import schedule_csv

    f = tmp_path / "mine.csv"
    f.write_text(LEARNER_CSV)
    schedule = schedule_csv.load(f)
    assert schedule.placement == Placement.v_shape(2)
    check(LLAMA, make_plan(pp=2, grad_accum=2), schedule)
