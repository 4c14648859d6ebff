"""Hidden tests of predict_ledger: counts, the ledger, a measured torch model, the learner's own answer."""

from __future__ import annotations

from parallel_lab import ledger
from parallel_lab.grading.feedback import check_revealed as check
from parallel_lab.grading.feedback import learner_params
from parallel_lab.grading.harness import Fail, points
from parallel_lab.grading.micro import MICRO
from parallel_lab.specs import ModelSpec, Plan

PRESETS = ("llama2-7b", "llama2-13b", "llama2-70b", "llama3-8b", "llama3-70b", "llama3-405b", "tiny-llama")
CHOICES = {"model": ["llama2-7b", "llama2-13b", "llama3-8b", "llama3-70b"], "tp": [1, 2, 4, 8]}
OPT = {(2, 2, 12): "adam-mixed", (4, 4, 8): "adam-fp32"}


def dims(m: ModelSpec) -> dict:
    return dict(layers=m.layers, hidden=m.hidden, heads=m.heads, kv_heads=m.kv_heads, ffn=m.ffn, vocab=m.vocab)


@points(2)
def test_counts_of_presets(sub):
    for name in PRESETS + ("micro",):
        m = MICRO if name == "micro" else ModelSpec.preset(name)
        got = sub.n_params(**dims(m))
        if got != m.n_params:
            raise Fail(f"n_params({name}) = {got:,}; the model has {m.n_params:,} ({got - m.n_params:+,}; "
                       f"h={m.hidden}, kv_heads={m.kv_heads}, ffn={m.ffn}: which tensor is off by that much?)")


@points(3)
def test_state_equals_ledger(sub):
    for name in PRESETS:
        m = ModelSpec.preset(name)
        for tp in (1, 2, 4, 8):
            if tp > m.kv_heads or m.heads % tp or m.ffn % tp:
                continue
            for bpp, opt in OPT.items():
                want = {k: float(v) for k, v in ledger.state_bytes(m, Plan(tp=tp, optimizer=opt)).items()}
                fb = check(sub.state_per_gpu(**dims(m), tp=tp, bytes_per_param=bpp), want, rtol=0.0, unit="B",
                           name=f"{name}, tp={tp}, {opt}")
                if not fb:
                    raise Fail(fb.message)


def session_values():
    """The state bytes of MICRO measured after an AdamW step (once per grading session)."""
    import torch

    from parallel_lab.distributed.model.data import synthetic_batch
    from parallel_lab.distributed.model.model import build_model, loss_fn, make_optimizer
    from parallel_lab.distributed.model.state import measure_state
    from parallel_lab.grading.micro import micro_plan

    torch.manual_seed(0)
    model = build_model(MICRO, seed=0)
    opt = make_optimizer(model.parameters(), micro_plan())
    b = synthetic_batch(MICRO, micro_plan(), 0)
    loss_fn(model(b.tokens, b.positions), b.targets).backward()
    opt.step()
    return {"measured": {k: float(v) for k, v in measure_state(list(model.parameters()), opt).items()
                         if k in ("parameters", "gradients", "optimizer_states")}}


SESSION: dict = {}


@points(2)
def test_state_equals_measured_model(sub):
    measured = (SESSION or session_values())["measured"]
    fb = check(sub.state_per_gpu(**dims(MICRO), tp=1, bytes_per_param=(4, 4, 8)), measured, rtol=0.0, unit="B",
               name="MICRO measured after an AdamW step (fp32)")
    if not fb:
        raise Fail(fb.message)


@points(3)
def test_your_answer(sub):
    a = learner_params(getattr(sub, "LEARNER", ""), "predict_ledger", CHOICES)
    m = ModelSpec.preset(a["model"])
    want = {k: float(v) for k, v in ledger.state_bytes(m, Plan(tp=a["tp"])).items()}
    fb = check(getattr(sub, "ANSWER", None), want, rtol=0.005, unit="B",
               name=f"ANSWER for learner {getattr(sub, 'LEARNER', '?')!r} ({a['model']}, tp={a['tp']})")
    if not fb:
        raise Fail(fb.message)
