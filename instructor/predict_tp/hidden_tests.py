"""Hidden tests of predict_tp: against parallel_lab.comm on two link tiers, then against traced messages."""

from __future__ import annotations

from parallel_lab import comm
from parallel_lab.grading.feedback import check_revealed as check
from parallel_lab.grading.harness import Fail, points, run_ranks
from parallel_lab.grading.micro import MICRO, SEQ, measured_rank, micro_plan, ring_wire_bytes
from parallel_lab.hardware import CLUSTER_PRESETS
from parallel_lab.specs import ModelSpec, Plan

CASES = [("gpt3-175b", 2048, 1, 8, 1), ("llama2-7b", 4096, 2, 4, 4), ("llama3-70b", 8192, 1, 8, 2),
         ("megatron-22b", 2048, 4, 2, 8)]


def _tp(name, s, b, t, m):
    spec = ModelSpec.preset(name)
    plan = Plan(tp=t, seq=s, micro_batch=b, grad_accum=m)
    return spec, [c for c in comm.collectives(spec, plan) if c.dim == "tp"]


@points(3)
def test_bytes_equal_comm(sub):
    for name, s, b, t, m in CASES:
        spec, colls = _tp(name, s, b, t, m)
        if sub.tp_message_bytes(s, b, spec.hidden, 2) != colls[0].message_bytes:
            raise Fail(f"{name}, s={s}, b={b}: one all-reduce is {colls[0].message_bytes:,} B, you have "
                       f"{sub.tp_message_bytes(s, b, spec.hidden, 2):,}")
        fb = check(sub.tp_bytes_per_step(spec.layers, s, b, spec.hidden, t, 2, m),
                   sum(c.wire_bytes for c in colls), rtol=1e-6, unit="B", name=f"{name}, tp={t}, m={m}: bytes")
        if not fb:
            raise Fail(fb.message)


@points(3)
def test_time_equals_comm(sub):
    h100 = CLUSTER_PRESETS["h100-sxm"]
    for tier in (h100.intra, h100.inter):
        for name, s, b, t, m in CASES:
            spec, colls = _tp(name, s, b, t, m)
            want = sum(c.count * comm.collective_time(c.kind, c.message_bytes, c.group_size, tier) for c in colls)
            got = sub.tp_time_per_step(spec.layers, s, b, spec.hidden, t, 2, m, tier.bandwidth, tier.latency)
            fb = check(got, want, rtol=1e-6, unit="s", name=f"{name}, tp={t} on {tier.name}: time")
            if not fb:
                raise Fail(fb.message)


def session_values():
    """MICRO's TP calls traced on 2 ranks for one step (once per grading session)."""
    plan = micro_plan(tp=2)
    return {"calls": [c for c in run_ranks(measured_rank, 2, plan, plan=plan, timeout_s=120)[0]["calls"]
                      if c[0] == "tp"]}


SESSION: dict = {}


@points(2)
def test_against_traced_messages(sub):
    plan = micro_plan(tp=2)
    calls = (SESSION or session_values())["calls"]
    if any(k != "all_reduce" for _, k, _, _ in calls):
        raise Fail("the traced TP calls are not all all-reduces (unexpected: report this to your teacher)")
    fb = check(sub.tp_bytes_per_step(MICRO.layers, SEQ, plan.micro_batch, MICRO.hidden, 2, 4, 1),
               sum(ring_wire_bytes(k, b, g) for _, k, b, g in calls), rtol=1e-6, unit="B",
               name="MICRO on 2 CPU ranks (fp32), bytes sent per step from the traced messages")
    if not fb:
        raise Fail(fb.message)
