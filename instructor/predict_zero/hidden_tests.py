"""Hidden tests of predict_zero: against the ledger and comm, then against a real run of each stage."""

from __future__ import annotations

import functools

from parallel_lab import comm, ledger
from parallel_lab.grading.feedback import check_revealed as check
from parallel_lab.grading.harness import Fail, points, run_ranks
from parallel_lab.grading.micro import MICRO, measured_rank, micro_plan, ring_wire_bytes
from parallel_lab.specs import ModelSpec, Plan

CASES = [(psi, g, st) for psi in (7_000_000_000, 1_300_000_001, 70_000_000_000) for g in (2, 8, 64)
         for st in (0, 1, 2, 3)]


@points(3)
def test_state_equals_ledger(sub):
    for psi, g, st in CASES:
        m = ModelSpec.from_params(psi)
        for bpp, opt in (((2, 2, 12), "adam-mixed"), ((4, 4, 8), "adam-fp32")):
            want = {k: float(v) for k, v in ledger.state_bytes(m, Plan(dp=g, zero=st, optimizer=opt)).items()}
            fb = check(sub.zero_state(psi, g, st, bpp), want, rtol=1e-6, unit="B",
                       name=f"Psi={psi:,}, g={g}, stage {st}, {opt}")
            if not fb:
                raise Fail(fb.message)


@points(3)
def test_bytes_equal_comm(sub):
    for psi, g, st in CASES:
        m = ModelSpec.from_params(psi)
        want = comm.per_step_bytes(comm.collectives(m, Plan(dp=g, zero=st, zero_unit="root")))["dp"]
        fb = check(sub.zero_dp_bytes(psi, g, st, 2), want, rtol=1e-6, unit="B",
                   name=f"bytes sent per GPU per step, Psi={psi:,}, g={g}, stage {st}")
        if not fb:
            raise Fail(fb.message)


def session_values():
    """Each ZeRO stage run for one step on 2 ranks: measured state and traced calls (once per session)."""
    out = {}
    for stage in (0, 1, 2, 3):
        plan = micro_plan(dp=2, zero=stage, zero_unit="root")
        out[stage] = run_ranks(measured_rank, 2, plan, plan=plan, timeout_s=120)[0]
    return out


SESSION: dict = {}


def measured(stage):
    return (SESSION or _cached())[stage]


@functools.cache
def _cached():
    return session_values()


@points(2)
def test_against_a_real_run(sub):
    n = MICRO.n_params
    for st in (0, 1, 2, 3):
        got = measured(st)
        mem = {k: float(got["memory"][k]) for k in ("parameters", "gradients", "optimizer_states")}
        fb = check(sub.zero_state(n, 2, st, (4, 4, 8)), mem, rtol=1e-6, unit="B",
                   name=f"stage {st} on 2 CPU ranks, measured from the tensors")
        if not fb:
            raise Fail(fb.message)
        wire = sum(ring_wire_bytes(k, b, g) for dim, k, b, g in got["calls"] if dim == "dp")
        fb = check(sub.zero_dp_bytes(n, 2, st, 4), wire, rtol=1e-6, unit="B",
                   name=f"stage {st} on 2 CPU ranks, bytes sent (from the traced messages)")
        if not fb:
            raise Fail(fb.message)
