"""The pipeline executor against the one-process reference, comm.py's prediction, the simulator, the ledger.

One step of ``forward_backward`` per configuration; each rank returns its loss, its stage's gradients (before
any optimizer step), its traced calls, its measured in-flight counts and activation peak. The reference is one
process running the same micro-batches one after another with gradient accumulation (``loss / m`` each).

Tolerance (fp32, measured): every pipeline rank runs the same kernels on the same micro-batches, and each
gradient is accumulated over the micro-batches in the same order as the reference, so the losses came out
bitwise equal in every configuration below and the gradients too for the llama flavour, including ZB-H1's
split B/W; gpt differed by at most 1.2e-9 and pp2 x dp2 (the DP all-reduce sums in another order) by 7.5e-9.
The tests allow ``GRAD_TOL = 1e-6`` absolute (gradients are ~1e-2 .. 1e-5) and ``LOSS_TOL = 1e-6``, ``2e-6``
with data parallelism, so that a different but legal summation order does not fail them.

Configurations (a representative subset of p in {2, 4}, m in 1..8, all four schedules; the whole grid is too
slow on 2 cores): p=2 with gpipe, 1f1b and zb-h1 at m=1 and m=4; interleaved p=2 v=2 m=4; p=4 m=8 with gpipe,
1f1b and zb-h1; interleaved p=4 v=2 m=8 on an 8-layer tiny model; uneven stages (5 blocks on p=2, 1f1b, m=3);
the gpt flavour (p=2, 1f1b, m=2); pp=2 x dp=2 on 4 ranks (zb-h1, bucketed DDP); and ``run`` end to end for
``--pp 4 --schedule 1f1b --grad-accum 8``.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from parallel_lab import comm
from parallel_lab.distributed.instruments.tracer import CommTracer, TracedCall, TracedWork, compare_calls, op_waits
from parallel_lab.distributed.model.data import synthetic_batch
from parallel_lab.distributed.model.model import build_model, loss_fn, make_context
from parallel_lab.distributed.pipeline_parallel.pipeline_report import handoffs, measured_step, replay
from parallel_lab.distributed.pipeline_parallel.stages import layers_per_stage, stage_layout
from parallel_lab.distributed.pipeline_parallel.zero_bubble import weight_split_points
from parallel_lab.distributed.runtime.launch import launch
from parallel_lab.distributed.runtime.run import predicted_activations, run
from parallel_lab.distributed.runtime.train import parallelize
from parallel_lab.errors import ParallelLabError
from parallel_lab.schedules.generators import build_schedule
from parallel_lab.simulate import Interval, simulate
from parallel_lab.specs import ModelSpec, Plan

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(150)]

LOSS_TOL, GRAD_TOL, DP_TOL = 1e-6, 1e-6, 2e-6
LLAMA = ModelSpec.preset("tiny-llama")                       # 4 blocks
LLAMA8 = LLAMA.with_(layers=8)                               # p=4, v=2 needs layers divisible by 8
GPT = ModelSpec.preset("tiny-gpt")                           # dropout 0: deterministic


def make_plan(**kw) -> Plan:
    return Plan(**{"micro_batch": 2, "seq": 32, "optimizer": "adam-fp32", "dtype": "fp32", **kw})


# --------------------------------------------------------------------------------------------------
# What each rank does, and the reference
# --------------------------------------------------------------------------------------------------

def one_step(grid, spec: ModelSpec, plan: Plan) -> dict:
    """One pipeline step on this rank: loss, gradients of its stage (after the DP sync), traced calls."""
    model = build_model(spec, 0, device=grid.device)
    tracer = CommTracer(grid.rank, grid.groups_by_dim())
    rt = parallelize(model, grid, plan, tracer)
    micro = rt.micro_batches(synthetic_batch(spec, plan, 0, 0))
    grads = {}

    def keep_grads() -> None:                                # synchronised, before the optimizer step
        grads.update({n: p.grad.detach().clone() for n, p in rt.model.named_parameters() if p.grad is not None})

    loss = rt.train_step(micro, before_step=keep_grads)
    return {"rank": grid.rank, "coords": grid.coords, "loss": loss, "owns_loss": rt.owns_loss,
            "grads": grads, "events": list(tracer.events), "pp": rt.extras["pipeline"].report(),
            "act_peak": int(rt.meter.peak["activations"])}


def reference(spec: ModelSpec, plan: Plan) -> tuple[float, dict[str, torch.Tensor]]:
    """One process, the global batch's micro-batches one after another, each ``loss / (dp m)``."""
    model = build_model(spec, 0)
    batch = synthetic_batch(spec, plan, 0, 0)
    n, b = plan.dp * plan.grad_accum, plan.micro_batch
    total = 0.0
    for i in range(n):
        mb = batch.rows(i * b, (i + 1) * b)
        loss = loss_fn(model(mb.tokens, mb.positions), mb.targets) / n
        loss.backward()
        total += loss.item()
    return total, {k: p.grad for k, p in model.named_parameters()}


def check(spec: ModelSpec, plan: Plan) -> list[dict]:
    res = launch(one_step, plan, spec, plan, timeout_s=120)
    ref_loss, ref_grads = reference(spec, plan)
    tol = GRAD_TOL if plan.dp == 1 else DP_TOL
    # losses: the last stage of each pipeline replica owns the loss of its micro-batches
    owners = [r["loss"] for r in res if r["owns_loss"]]
    assert len(owners) == plan.dp
    assert abs(sum(owners) / plan.dp - ref_loss) <= LOSS_TOL, (owners, ref_loss)   # replicas: mean losses
    # gradients: every parameter is on exactly one stage, equal to the reference's
    seen: set[str] = set()
    worst = 0.0
    for r in res:
        for name, g in r["grads"].items():
            diff = (g - ref_grads[name]).abs().max().item()
            assert diff <= tol, (name, r["rank"], diff)
            seen.add(name)
            worst = max(worst, diff)
    print(f"{plan.schedule} p={plan.pp} v={plan.interleave} m={plan.grad_accum} dp={plan.dp}: "
          f"loss diff {abs(sum(owners) / plan.dp - ref_loss):.2e}, largest gradient diff {worst:.2e}")
    assert seen == set(ref_grads)
    schedule = build_schedule(plan.schedule, plan.pp, plan.microbatches, plan.interleave)
    sim = simulate(schedule)
    act_bytes = plan.seq * plan.micro_batch * spec.hidden * 4            # s b h fp32, one boundary message
    for r in res:
        stage = r["coords"]["pp"]
        # communication: call by call as comm.py predicts (pp: s*b*h elements each way per boundary)
        predicted = comm.collectives(spec, plan, stage=stage)
        assert compare_calls(r["events"], predicted) == {"missing": {}, "extra": {}}, r["rank"]
        pp_events = [e for e in r["events"] if e.dim == "pp"]
        assert all(e.message_bytes == act_bytes and e.group_size == 2 for e in pp_events)
        v = plan.interleave
        boundaries = 2 * v - (stage == 0) - (stage == plan.pp - 1)       # chunk inputs + outputs crossing
        assert len(pp_events) == 2 * boundaries * plan.microbatches     # a message and its gradient each
        send_phases = {e.phase for e in pp_events if e.kind == "send"}
        if boundaries == 1:
            assert send_phases == {"forward" if stage == 0 else "backward"}
        else:
            assert send_phases == {"forward", "backward"}
        # in-flight micro-batches and activation bytes, measured against the simulator and the ledger
        step = r["pp"]["steps"][-1]
        assert step["inflight_peak"] == sim.peak_inflight[stage], (stage, step["inflight_trace"])
        assert step["inflight_trace"][-1] == 0                            # all freed after the step
        pred = predicted_activations(spec, plan, stage)
        assert abs(r["act_peak"] - pred) <= (0 if v == 1 else 0.01 * pred), (r["act_peak"], pred)
    return res


# --------------------------------------------------------------------------------------------------
# Correctness grid
# --------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("m", [1, 4])
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb-h1"])
def test_two_stages(schedule, m):
    check(LLAMA, make_plan(pp=2, schedule=schedule, grad_accum=m))


def test_two_stages_interleaved():
    check(LLAMA, make_plan(pp=2, schedule="interleaved", interleave=2, grad_accum=4))


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb-h1"])
def test_four_stages_eight_microbatches(schedule):
    res = check(LLAMA, make_plan(pp=4, schedule=schedule, grad_accum=8))
    peaks = [r["pp"]["steps"][-1]["inflight_peak"] for r in sorted(res, key=lambda r: r["rank"])]
    # the published shapes: GPipe holds all m everywhere; 1F1B's first stage holds p, then p - r; ZB-H1 p
    assert peaks == {"gpipe": [8, 8, 8, 8], "1f1b": [4, 3, 2, 1], "zb-h1": [4, 4, 4, 4]}[schedule]


def test_four_stages_interleaved():
    res = check(LLAMA8, make_plan(pp=4, schedule="interleaved", interleave=2, grad_accum=8))
    assert [len(r["pp"]["chunks"]) for r in res] == [2, 2, 2, 2]
    assert res[0]["pp"]["chunks"] == [[0], [4]] and res[3]["pp"]["chunks"] == [[3], [7]]


def test_uneven_stages_and_gpt():
    spec = LLAMA.with_(layers=5)
    plan = make_plan(pp=2, schedule="1f1b", grad_accum=3)
    assert layers_per_stage(spec, plan) == [3, 2]
    res = check(spec, plan)
    assert [r["pp"]["layers"] for r in res] == [[0, 1, 2], [3, 4]]
    check(GPT.with_(layers=2), make_plan(pp=2, schedule="1f1b", grad_accum=2))


def test_pipeline_with_data_parallelism():
    plan = make_plan(pp=2, dp=2, schedule="zb-h1", grad_accum=4, dp_kind="bucketed", bucket_mb=0.5)
    res = check(LLAMA, plan)
    for r in res:                   # gradients synchronised once per step, not per micro-batch
        dp_calls = [e for e in r["events"] if e.dim == "dp"]
        predicted = comm.collectives(LLAMA, plan, stage=r["coords"]["pp"])
        n_buckets = sum(c.count for c in predicted if c.dim == "dp")
        assert len(dp_calls) == n_buckets >= 2          # each bucket once (per micro-batch: 4 times as many)
        last_compute = max(row[2] for row in r["pp"]["steps"][-1]["rows"] if row[3] != "W")
        assert all(e.t_start >= last_compute for e in dp_calls)   # launched during the last W, not before


# --------------------------------------------------------------------------------------------------
# The B / W split, in one process
# --------------------------------------------------------------------------------------------------

def test_split_backward_equals_full_backward_bitwise():
    spec = LLAMA.with_(layers=2)
    model = build_model(spec)
    ctx = make_context(torch.arange(16))
    x0 = torch.randn(2, 16, spec.hidden, generator=torch.Generator().manual_seed(0))
    params = [p for p in model.parameters() if p.requires_grad]

    def forward():
        x = x0.clone().requires_grad_()
        return x, model.run_blocks(x, ctx)

    x, y = forward()
    dy = torch.randn_like(y)
    y.backward(dy)
    full = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    x2, y2 = forward()
    points = weight_split_points(y2.grad_fn, x2, params)
    block_params = [p for n, p in model.named_parameters() if n.startswith("blocks.")]
    assert {id(w) for _, ws in points for w in ws} == {id(p) for p in block_params}   # every weight once
    caught = {}
    hooks = [n.register_prehook(lambda g, n=n: caught.__setitem__(n, g)) for n, _ in points]
    torch.autograd.backward(y2, dy, inputs=[x2], retain_graph=True)                  # B
    for h in hooks:
        h.remove()
    assert all(p.grad is None for p in params)                                       # no weight gradient yet
    assert torch.equal(x2.grad, x.grad)
    for node, ws in points:                                                          # W
        edges = [(torch.autograd.graph.GradientEdge(node, i), g) for i, g in enumerate(caught[node])
                 if g is not None]
        torch.autograd.backward([e for e, _ in edges], [g for _, g in edges], inputs=ws)
    for n, p in model.named_parameters():
        if n in full:
            assert torch.equal(p.grad, full[n]), n


def test_a_weight_used_twice_cannot_be_split():
    w = torch.nn.Parameter(torch.randn(4, 4))
    x = torch.randn(2, 4, requires_grad=True)
    y = (x @ w) @ w
    with pytest.raises(ParallelLabError, match="used by two operations"):
        weight_split_points(y.grad_fn, x, [w])


def test_stage_layout_and_errors():
    plan = make_plan(pp=2, schedule="interleaved", interleave=2, grad_accum=4)
    lay = stage_layout(LLAMA, plan, 1)
    assert lay.chunks == ((1,), (3,)) and [lay.virtual(c) for c in range(2)] == [1, 3] and lay.has_head
    with pytest.raises(ParallelLabError, match="pipeline rank 2"):
        stage_layout(LLAMA, plan, 2)
    tied = LLAMA.with_(tied_embeddings=True)
    p2 = make_plan(pp=2, grad_accum=2)
    with pytest.raises(Exception, match="untied embeddings"):
        launch(one_step, p2, tied, p2, timeout_s=60)


def test_completions_for_per_op_and_coalesced_batches():
    class Work:
        def __init__(self):
            self.waited = 0

        def wait(self):
            self.waited += 1
            return True

    def event():
        return TracedCall(0, comm.Collective("pp", "recv", 4, 2), 0.0, None)

    per_op = [TracedWork(Work(), event()), TracedWork(Work(), event())]            # gloo: a work per op
    waits = op_waits(per_op, 2)
    waits[1].wait()
    assert (per_op[0].work.waited, per_op[1].work.waited) == (0, 1) and per_op[1].event.t_end is not None
    batch = Work()                                                                  # NCCL: one work per batch
    coalesced = [TracedWork(batch, None), TracedWork(None, event()), TracedWork(None, event())]
    waits = op_waits(coalesced, 2)
    waits[0].wait()
    assert batch.waited == 1 and coalesced[1].event.t_end is not None and coalesced[2].event.t_end is None
    assert [w.own for w in waits] == coalesced[1:]


def test_measured_timelines_are_read_with_the_simulators_definitions():
    sim = simulate(build_schedule("1f1b", 3, 4))
    assert sim.bubble_ratio == pytest.approx(2 / 4)                  # (p - 1) / m
    ivs = sim.timeline
    rows = [i.as_row() for i in ivs]
    assert [Interval.from_row(r) for r in rows] == [replace(i, stage=None) for i in ivs]
    recs = [{"rank": r, "t_start": 10.0, "t_end": 10.0 + sim.step_time, "inflight_peak": 0,
             "rows": [[x[0], x[1] + 10.0, x[2] + 10.0, *x[3:]] for x in rows if x[0] == r]} for r in range(3)]
    st = measured_step(recs)["stats"]                                # shifted to t = 0, the same figures
    assert st.idle_fraction == pytest.approx(sim.idle_fraction)
    assert st.bubble_ratio == pytest.approx(sim.bubble_ratio)
    # replaying a timeline's own durations gives it back; with zero-latency messages no hand-off waits
    again = replay(build_schedule("1f1b", 3, 4), ivs)
    assert again["stats"].step_time == pytest.approx(sim.step_time) and again["intervals"] == ivs
    assert set(handoffs(ivs, 3)) == {0.0}
    late = [replace(i, t_start=i.t_start + 0.25) if (i.rank, i.name, i.micro_batch) == (1, "F", 0) else i
            for i in ivs]
    assert 0.25 in handoffs(late, 3)                  # rank 1 waited 0.25 for rank 0's output of mb 0


# --------------------------------------------------------------------------------------------------
# parallel-lab run, and the picture
# --------------------------------------------------------------------------------------------------

def test_run_pp4_1f1b_reports_bubble_and_draws_the_timelines():
    from parallel_lab.viz.plots.timeline import pipeline_timelines_figure

    plan = make_plan(pp=4, schedule="1f1b", grad_accum=8)
    rep = run(LLAMA, plan, steps=2)
    j = rep.to_json()
    assert max(abs(a - b) for a, b in zip(j["losses"], j["reference_losses"], strict=True)) <= 1e-5
    assert j["max_abs_param_diff"] <= 2e-5
    assert j["comm"]["pp"]["measured_bytes"] == j["comm"]["pp"]["predicted_bytes"]
    for cat in ("parameters", "gradients", "optimizer_states", "activations"):
        assert j["memory"][cat]["measured_bytes"] == j["memory"][cat]["predicted_bytes"], cat
    pipe = j["pipeline"]
    assert pipe["bubble_ratio"]["predicted"] == pytest.approx(3 / 8)
    assert pipe["peak_inflight"] == {"predicted": [4, 3, 2, 1], "measured": [4, 3, 2, 1]}
    assert 0.0 <= pipe["idle_fraction"]["measured"] < 1.0 and pipe["bubble_ratio"]["measured"] >= 0.0
    assert len(pipe["timeline"]) == 4 * 8 * 2                         # p ranks x m micro-batches x (F, B)
    assert "bubble_ratio" in rep.summary() and "peak in-flight" in rep.summary()
    sim = simulate(build_schedule("1f1b", 4, 8))
    assert pipe["step_time_s"]["replayed"] <= pipe["step_time_s"]["measured"] * 1.001   # waiting costs time
    assert pipe["handoff_s"]["count"] > 0 and pipe["handoff_s"]["median"] > 0
    fig = pipeline_timelines_figure(sim, pipe["timeline"], measured_step_time=pipe["step_time_s"]["measured"])
    sim_ax, meas_ax = fig.axes[:2]
    assert [t.get_text() for t in meas_ax.get_yticklabels()] == [f"rank {r}" for r in range(4)]
    assert f"{pipe['idle_fraction']['measured']:.1%}" in meas_ax.get_title()
    assert f"{sim.idle_fraction:.1%}" in sim_ax.get_title()
