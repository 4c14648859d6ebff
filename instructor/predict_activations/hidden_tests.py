"""Hidden tests of predict_activations: against the ledger over a grid, then against a measured step."""

from __future__ import annotations

import itertools

from parallel_lab import ledger_activations
from parallel_lab.grading.feedback import check_revealed as check
from parallel_lab.grading.harness import Fail, points, run_ranks
from parallel_lab.grading.micro import MICRO_GPT, measured_rank
from parallel_lab.specs import ModelSpec, Plan


@points(4)
def test_against_ledger(sub):
    for (h, a, s), t, sp, rec, dt, drop in itertools.product(((4096, 32, 4096), (12288, 96, 2048)), (1, 2, 8),
                                                             (False, True), ("none", "selective", "full"),
                                                             ("bf16", "fp32"), (True, False)):
        if sp and t == 1:
            continue
        spec = ModelSpec(layers=1, hidden=h, heads=a, ffn=4 * h, vocab=32000, flavour="gpt", max_positions=s,
                         dropout=0.1 if drop else 0.0, name="g")
        plan = Plan(tp=t, sp=sp, seq=s, recompute=rec, dtype=dt)
        want = ledger_activations.activation_bytes_per_layer(spec, plan)
        got = sub.activations_per_layer(s, 1, h, a, t, sp, rec, plan.dtype_bytes, drop)
        fb = check(got, want, rtol=1e-9, unit="B", terms=ledger_activations.activation_terms(spec, plan),
                   name=f"h={h} a={a} s={s} t={t} sp={sp} recompute={rec} {dt} dropout={drop}")
        if not fb:
            raise Fail(fb.message)


PLAN = Plan(seq=16, micro_batch=2, optimizer="adam-fp32", dtype="fp32")


def session_values():
    """The bytes torch saved for backward in one step of MICRO_GPT on one rank (once per grading session)."""
    return {"activations": run_ranks(measured_rank, 1, PLAN, MICRO_GPT, plan=PLAN, timeout_s=120)[0]["memory"]
            ["activations"]}


SESSION: dict = {}


@points(2)
def test_against_a_measured_step(sub):
    measured = (SESSION or session_values())["activations"]
    m = MICRO_GPT
    got = m.layers * sub.activations_per_layer(16, 2, m.hidden, m.heads, 1, False, "none", 4, False)
    fb = check(got, measured, rtol=0.02, unit="B", name="small GPT (fp32, no dropout) measured by torch's "
               "saved-tensor hooks")
    if not fb:
        raise Fail(fb.message)
