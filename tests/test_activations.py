"""The per-op activation model (layer 1) against Korthikanti et al. 2022 and against what torch saves."""

from __future__ import annotations

import pytest

from parallel_lab import activations, ledger_activations
from parallel_lab.specs import ModelSpec, Plan


def gpt(**kw) -> ModelSpec:
    return ModelSpec(layers=2, hidden=256, heads=8, flavour="gpt", vocab=1000, dropout=0.1, **kw)


@pytest.mark.parametrize("recompute, per_sbh", [("none", None), ("selective", 34), ("full", 2)])
def test_gpt_block_with_dropout_in_bf16_is_korthikantis_formula(recompute, per_sbh):
    """sbh(34 + 5as/h) bytes per layer (2-byte activations, 1-byte masks); the per-op model adds only
    LayerNorm's fp32 mean and rstd (4 vectors of b*s), which the paper leaves out."""
    spec = gpt()
    s, b, h, a = 128, 2, spec.hidden, spec.heads
    plan = Plan(seq=s, micro_batch=b, recompute=recompute, dtype="bf16")
    got = activations.per_op_bytes(spec, plan)["per_block_bytes"]
    stats = 0 if recompute == "full" else 4 * b * s * 4
    want = s * b * h * (34 + 5 * a * s / h) if per_sbh is None else per_sbh * s * b * h
    assert got == want + stats


def test_korthikanti_seed_figure_within_the_norm_statistics():
    """The seed's 104.15 GB (L=32, s=4096, h=4096, a=32, no recompute) from the per-op model."""
    spec = ModelSpec(layers=32, hidden=4096, heads=32, flavour="gpt", dropout=0.1)
    plan = Plan(seq=4096, micro_batch=1, dtype="bf16")
    per_layer = activations.per_op_bytes(spec, plan)["per_block_bytes"]
    assert 32 * per_layer - 104_152_956_928 == 32 * 4 * 4096 * 4      # LayerNorm mean/rstd only


def test_per_op_agrees_with_the_ledgers_generalised_formula_for_llama():
    spec = ModelSpec.preset("llama2-7b")
    plan = Plan(seq=4096, micro_batch=1, dtype="bf16")
    per_op = activations.per_op_bytes(spec, plan)["per_block_bytes"]
    formula = ledger_activations.activation_bytes_per_layer(spec, plan)
    # differences: RMSNorm keeps x*rstd and rstd (2 sbh + small), which the generalised formula omits
    extra = 2 * 4096 * 4096 * 2 + 2 * 4096 * 2
    assert per_op - formula == extra


def test_tensor_and_sequence_parallel_shapes():
    spec = gpt()
    base = Plan(seq=128, micro_batch=1, dtype="bf16")
    one = activations.per_op_bytes(spec, base)["per_block_bytes"]
    tp = activations.per_op_bytes(spec, base.with_(tp=2))["per_block_bytes"]
    sp = activations.per_op_bytes(spec, base.with_(tp=2, sp=True))["per_block_bytes"]
    s, h, a = 128, spec.hidden, spec.heads
    stats = 4 * s * 4
    # Korthikanti Table 2: TP sbh(10 + 24/t + 5as/(ht)); TP+SP sbh/t (34 + 5as/h)
    assert one == s * h * (34 + 5 * a * s / h) + stats
    assert tp == s * h * (10 + 24 / 2 + 5 * a * s / (h * 2)) + stats
    assert sp == s * h / 2 * (34 + 5 * a * s / h) + stats / 2


def test_entries_name_ops_and_totals_add_up():
    spec = ModelSpec.preset("tiny-llama")
    plan = Plan(seq=64, micro_batch=2, dtype="fp32")
    r = activations.per_op_bytes(spec, plan)
    assert r["per_block_bytes"] == sum(e["bytes"] for e in r["block"])
    assert r["activations"] == (spec.layers * r["per_block_bytes"] + sum(e["bytes"] for e in r["shared"])
                                + sum(e["bytes"] for e in r["embedding"]))
    assert r["logits_and_loss"] == sum(e["bytes"] for e in r["head"])
    ops = {e["op"] for e in r["block"]}
    assert {"attn_norm", "core.softmax", "silu", "mlp.down"} <= ops
    assert {e["tensor"] for e in r["shared"]} == {"cos", "sin"}


# --------------------------------------------------------------------------------------------------
# Against torch: the saved-tensor meter on the runnable model
# --------------------------------------------------------------------------------------------------

CASES = [(name, rec, drop, b, s)
         for name in ("tiny-llama", "tiny-gpt")
         for rec, drop, b, s in (("none", 0.0, 2, 32), ("none", 0.1, 1, 48), ("selective", 0.1, 2, 32),
                                 ("full", 0.1, 2, 32))]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name, recompute, dropout, b, s", CASES)
def test_per_op_model_equals_the_bytes_torch_saves(name, recompute, dropout, b, s):
    torch = pytest.importorskip("torch")
    from parallel_lab.distributed.instruments.saved import SavedTensorMeter
    from parallel_lab.distributed.model.data import synthetic_batch
    from parallel_lab.distributed.model.model import build_model, loss_fn

    spec = ModelSpec.preset(name).with_(layers=3, dropout=dropout)
    plan = Plan(micro_batch=b, seq=s, dtype="fp32", recompute=recompute)
    model = build_model(spec, recompute=recompute)
    batch = synthetic_batch(spec, plan, 0)
    meter = SavedTensorMeter(model)
    with meter:
        loss = loss_fn(model(batch.tokens, batch.positions), batch.targets)
    pred = activations.per_op_bytes(spec, plan)
    assert meter.forward_bytes["blocks.1"] == pred["per_block_bytes"]        # one block, exactly
    assert meter.live["activations"] == pred["activations"]                 # embedding + blocks + rope
    assert meter.live["logits_and_loss"] == pred["logits_and_loss"]
    loss.backward()
    assert meter.live_total == 0                                             # all released by backward
    del torch


@pytest.mark.timeout(60)
@pytest.mark.parametrize("name", ["tiny-llama", "tiny-gpt"])
def test_bf16_on_cpu_is_exact_with_cpu_layernorm_statistics(name):
    torch = pytest.importorskip("torch")
    from parallel_lab.distributed.instruments.saved import SavedTensorMeter
    from parallel_lab.distributed.model.data import synthetic_batch
    from parallel_lab.distributed.model.model import build_model, loss_fn

    spec = ModelSpec.preset(name).with_(layers=2, dropout=0.1)
    plan = Plan(micro_batch=2, seq=32, dtype="bf16")
    model = build_model(spec).to(torch.bfloat16)
    batch = synthetic_batch(spec, plan, 0)
    meter = SavedTensorMeter(model)
    with meter:
        _graph = loss_fn(model(batch.tokens, batch.positions), batch.targets)   # keep the graph alive
    exact = activations.per_op_bytes(spec, plan, ln_stats_bytes=2)
    gpu = activations.per_op_bytes(spec, plan)                     # fp32 statistics, as on CUDA
    assert meter.live["activations"] == exact["activations"]
    assert abs(meter.live["activations"] - gpu["activations"]) <= 0.01 * gpu["activations"]


@pytest.mark.parametrize("tp,sp", [(1, False), (2, True), (8, True)])
def test_allgather_cp_keeps_the_gathered_kv_in_both_activation_models(tp, sp):
    """All-gather CP saves every rank's K and V for backward (the runnable core: ``(cp, 2, b, kv, s/cp, d)``),
    ring only its own block: the two models differ from ring by the same ``2 (seq - s/cp) b kv d`` bytes, and
    recomputation (which re-gathers) keeps none of them."""
    m = ModelSpec.preset("llama3-8b")
    pa = Plan(tp=tp, sp=sp, cp=4, seq=8192, cp_kind="allgather", attention="flash")
    pr = pa.with_(cp_kind="ring")
    kv_local = m.kv_heads * m.head_dim // tp
    want = 2 * (8192 - 8192 // 4) * 1 * kv_local * 2
    assert ledger_activations.activation_terms(m, pa)["cp_gathered_kv"] == want
    for formula in ("korthikanti", "per-op"):
        diff = (ledger_activations.activation_bytes_per_layer(m, pa, formula=formula)
                - ledger_activations.activation_bytes_per_layer(m, pr, formula=formula))
        assert diff == want, formula
    assert "cp_gathered_kv" not in ledger_activations.activation_terms(m, pa.with_(recompute="selective"))
