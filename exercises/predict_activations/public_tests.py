"""Public tests of predict_activations: the seed's 7B-class figure (Korthikanti's formula, 2 bytes); then a block
of h=2048, 16 heads at s=1024 under TP 4, with and without SP and selective recomputation (against ``ledger``)."""

from __future__ import annotations

from parallel_lab.grading.feedback import check_revealed as check
from parallel_lab.grading.harness import Fail, checks, points, require


@points(2)
@checks("what one block saves for backward without TP or recomputation (bf16, dropout)", "go through the "
        "block in the order forward runs it and list every tensor backward needs")
def test_seed_figure(sub):
    (fn,) = require(sub, "activations_per_layer")
    fb = check(32 * fn(4096, 1, 4096, 32), 104_152_956_928, rtol=1e-9, unit="B",
               terms={"5 a s / h score term": 32 * 5 * 32 * 4096 * 4096, "34 s b h": 32 * 34 * 4096 * 4096},
               name="32 layers, s=4096, h=4096, a=32")
    if not fb:
        raise Fail(fb.message)


@points(2)
@checks("what tensor parallelism splits (only the parallel regions, unless sequence parallelism splits the rest) "
        "and what selective recomputation drops (the attention scores)", "which activations lie between f and "
        "g, and which before f or after g? Which terms grow with s^2?")
def test_tp_sp_and_selective(sub):
    from parallel_lab import ledger_activations
    from parallel_lab.specs import ModelSpec, Plan

    (fn,) = require(sub, "activations_per_layer")
    h, a, s = 2048, 16, 1024
    spec = ModelSpec(layers=1, hidden=h, heads=a, ffn=4 * h, vocab=32000, flavour="gpt", max_positions=s,
                     dropout=0.1, name="g")
    for sp in (False, True):
        for rec in ("none", "selective"):
            plan = Plan(tp=4, sp=sp, seq=s, recompute=rec, dtype="bf16")
            want = ledger_activations.activation_bytes_per_layer(spec, plan)
            fb = check(fn(s, 1, h, a, 4, sp, rec, 2, True), want, rtol=1e-9,
                       unit="B", terms=ledger_activations.activation_terms(spec, plan),
                       name=f"h={h} a={a} s={s} t=4 sp={sp} recompute={rec} bf16 dropout")
            if not fb:
                raise Fail(fb.message)
