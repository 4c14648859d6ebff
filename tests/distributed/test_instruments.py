"""Instruments: traced message bytes per the conventions, call-by-call comparison, memory meters."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from parallel_lab.comm import Collective
from parallel_lab.distributed.instruments.memory import memtracker_snapshot
from parallel_lab.distributed.instruments.saved import SavedTensorMeter
from parallel_lab.distributed.instruments.timeline import Timeline
from parallel_lab.distributed.instruments.tracer import CommTracer, TracedCall, compare_calls, payload_by_dim
from parallel_lab.distributed.model.state import measure_state
from parallel_lab.distributed.runtime.launch import launch
from parallel_lab.specs import ModelSpec, Plan


def _every_call(grid):
    """Each tracer method once on known tensors; returns the events and a few results to check."""
    tr = CommTracer(grid.rank, grid.groups_by_dim())
    r, n = grid.rank, grid.world
    x = torch.full((10,), float(r + 1))                              # 40 bytes
    tr.all_reduce(x, "dp")
    gathered = torch.empty(n * 6)
    tr.all_gather(gathered, torch.full((6,), float(r)), "dp")       # output n*6*4 bytes
    shard = torch.empty(5)
    tr.reduce_scatter(shard, torch.arange(n * 5, dtype=torch.float32), "dp")   # input n*5*4
    a2a = torch.empty(n * 3)
    tr.all_to_all(a2a, torch.full((n * 3,), float(r)), "cp")         # input n*3*4
    b = torch.full((7,), float(r))
    with tr.phase_as("forward"):
        tr.broadcast(b, src=0, dim="dp")
    peer = 1 - r
    got = torch.empty(4, dtype=torch.bfloat16)
    world = dist.group.WORLD                     # the plan's pp groups are single ranks: pass a group
    if r == 0:
        tr.send(torch.ones(4, dtype=torch.bfloat16), peer, "pp", group=world)
        tr.recv(got, peer, "pp", group=world)
    else:
        tr.recv(got, peer, "pp", group=world)
        tr.send(torch.ones(4, dtype=torch.bfloat16) * 2, peer, "pp", group=world)
    w = [tr.isend(torch.ones(3), peer, "cp"), tr.irecv(torch.empty(3), peer, "cp")]
    for work in w:
        work.wait()
    works = tr.batch_isend_irecv([("send", torch.ones(8), peer), ("recv", torch.empty(8), peer)], "cp")
    for work in works:
        work.wait()
    work = tr.all_reduce(torch.ones(2), "dp", async_op=True)
    work.wait()
    return tr.events, x, gathered, shard, a2a, b, got


@pytest.mark.distributed
@pytest.mark.timeout(60)
def test_traced_message_bytes_follow_the_conventions():
    out = launch(_every_call, Plan(cp=2), timeout_s=60)      # dp (= dp x cp) and cp groups of 2
    for rank, (events, x, gathered, shard, a2a, b, got) in enumerate(out):
        assert [(e.dim, e.kind, e.message_bytes, e.group_size) for e in events] == [
            ("dp", "all_reduce", 40, 2), ("dp", "all_gather", 48, 2), ("dp", "reduce_scatter", 40, 2),
            ("cp", "all_to_all", 24, 2), ("dp", "broadcast", 28, 2),
            ("pp", "send" if rank == 0 else "recv", 8, 2), ("pp", "recv" if rank == 0 else "send", 8, 2),
            ("cp", "send", 12, 2), ("cp", "recv", 12, 2), ("cp", "send", 32, 2), ("cp", "recv", 32, 2),
            ("dp", "all_reduce", 8, 2)]
        assert all(e.rank == rank and e.t_end is not None and e.t_end >= e.t_start for e in events)
        assert events[4].phase == "forward" and events[0].phase == "forward"        # the tracer's default
        assert events[5].peer == 1 - rank
        assert torch.equal(x, torch.full((10,), 3.0))                   # the calls did their job
        assert torch.equal(gathered, torch.tensor([0.0] * 6 + [1.0] * 6))
        assert torch.equal(shard, 2 * torch.arange(5.0) + 10 * rank)
        assert torch.equal(a2a, torch.tensor([0.0] * 3 + [1.0] * 3))
        assert torch.equal(b, torch.zeros(7))
        assert torch.equal(got, torch.full((4,), 2.0 if rank == 0 else 1.0, dtype=torch.bfloat16))


def test_compare_calls_is_a_multiset_with_counts():
    ev = [TracedCall(0, Collective("dp", "all_reduce", 100, 2), 0.0, 1.0)] * 3
    ev += [TracedCall(0, Collective("tp", "all_gather", 8, 4), 0.0, 1.0)]
    pred = [Collective("dp", "all_reduce", 100, 2, count=3), Collective("tp", "all_gather", 8, 4)]
    assert compare_calls(ev, pred) == {"missing": {}, "extra": {}}
    assert payload_by_dim(ev) == payload_by_dim(pred) == {"dp": 300, "tp": 8}
    diff = compare_calls(ev[1:], pred)
    assert diff["missing"] == {("dp", "all_reduce", 100, 2): 1} and not diff["extra"]
    diff = compare_calls(ev + ev[:1], pred)
    assert diff["extra"] == {("dp", "all_reduce", 100, 2): 1}
    assert compare_calls(ev * 2, pred, times=2) == {"missing": {}, "extra": {}}


def test_state_is_measured_from_storages_each_once():
    torch.manual_seed(0)
    emb = torch.nn.Embedding(10, 4)
    head = torch.nn.Linear(4, 10, bias=False)
    head.weight = emb.weight                                     # tied: one storage
    frozen = torch.nn.Linear(4, 4)
    frozen.requires_grad_(False)
    model = torch.nn.ModuleDict({"emb": emb, "head": head, "frozen": frozen})
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], foreach=False)
    x = emb(torch.tensor([1, 2]))
    head(frozen(x)).sum().backward()
    opt.step()
    s = measure_state(model.parameters(), opt)
    assert s == {"parameters": (40 + 16 + 4) * 4, "gradients": 40 * 4, "optimizer_states": 2 * 40 * 4}


def test_saved_tensor_meter_counts_storages_once_skips_parameters_and_tracks_the_peak():
    lin = torch.nn.Linear(8, 8, bias=False)
    meter = SavedTensorMeter(lin, scopes={})
    x = torch.randn(4, 8, requires_grad=True)
    with meter:
        y1 = lin(x)                     # saves x (128 B) and the weight (a parameter: skipped)
        y2 = (x * 2).sum()              # mul by a scalar saves nothing
        z = torch.tanh(x[1:])           # saves its output (a new 96 B storage)
        w = z * x[1:]                   # saves z (counted already) and a view of x (counted already)
    assert meter.live_total == 128 + 96 and meter.peak_total == 224
    (y1.sum() + y2 + w.sum()).backward()
    assert meter.live_total == 0 and meter.peak_total == 224


def test_memtracker_agrees_on_model_state():
    from parallel_lab.distributed.model.data import synthetic_batch
    from parallel_lab.distributed.model.model import build_model, loss_fn, make_optimizer

    spec = ModelSpec.preset("tiny-llama").with_(layers=1)
    plan = Plan(micro_batch=1, seq=16, optimizer="adam-fp32", dtype="fp32")
    model = build_model(spec)
    opt = make_optimizer(model.parameters(), plan)
    batch = synthetic_batch(spec, plan, 0)

    def step():
        opt.zero_grad(set_to_none=True)
        loss_fn(model(batch.tokens, batch.positions), batch.targets).backward()
        opt.step()

    step()
    torch_view = memtracker_snapshot(model, opt, step)["current"]
    ours = measure_state(model.parameters(), opt)
    assert torch_view["Parameter"] == ours["parameters"] == 4 * spec.n_params
    assert torch_view["Gradient"] == ours["gradients"] == 4 * spec.n_params
    n_tensors = len(list(model.parameters()))            # torch also counts one 4-byte step per tensor
    assert torch_view["Optstate"] == ours["optimizer_states"] + 4 * n_tensors
    assert ours["optimizer_states"] == 8 * spec.n_params


def test_timeline_spans_and_comm():
    tl = Timeline(rank=0)
    with tl.span("F", micro_batch=0):
        pass
    ev = TracedCall(0, Collective("pp", "send", 8, 2), tl.spans[0].t_end, tl.spans[0].t_end + 1e-3)
    spans = tl.with_comm([ev])
    assert [s.kind for s in spans] == ["compute", "comm"] and spans[1].name == "pp:send"


DETACHED_PLAN = Plan(pp=2, micro_batch=2, grad_accum=2, seq=32, schedule="1f1b", optimizer="adam-fp32", dtype="fp32")


def _detached_and_attached(grid, plan: Plan):
    """Two runtimes of one plan from the same weights: one with the comm tracer attached, one with nothing
    (``parallelize(..., None, meter=False)``, what the benchmarks time); two steps of each."""
    from parallel_lab.distributed.model.data import synthetic_batch
    from parallel_lab.distributed.model.model import build_model
    from parallel_lab.distributed.runtime.train import parallelize

    spec = ModelSpec.preset("tiny-llama")
    out = {}
    for name, tracer in (("attached", CommTracer(grid.rank, grid.groups_by_dim())), ("detached", None)):
        rt = parallelize(build_model(spec, 0, device=grid.device), grid, plan, tracer, meter=False)
        losses = [rt.train_step(rt.micro_batches(synthetic_batch(spec, plan, s))) for s in range(2)]
        out[name] = (losses, {k: v.clone() for k, v in rt.dp.local_parameters().items()},
                     len(tracer.events) if tracer is not None else 0)
    return out


@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_a_step_with_no_measurement_attached_trains_the_same_numbers():
    for r in launch(_detached_and_attached, DETACHED_PLAN, DETACHED_PLAN, timeout_s=90):
        (la, pa, events), (ld, pd, _) = r["attached"], r["detached"]
        assert events > 0                                    # the attached tracer saw the step's messages
        assert la == ld
        assert pa.keys() == pd.keys() and all(torch.equal(pa[k], pd[k]) for k in pa)
