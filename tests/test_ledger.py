"""The memory ledger against the seed article, Korthikanti et al. 2022 and the ZeRO paper."""

from __future__ import annotations

import math

import pytest

from parallel_lab import ledger_buffers
from parallel_lab.errors import ParallelLabError
from parallel_lab.hardware import ClusterSpec
from parallel_lab.ledger import CATEGORIES, memory, state_bytes
from parallel_lab.ledger_activations import activation_bytes_per_layer
from parallel_lab.rank_view import inflight_microbatches
from parallel_lab.sharding import local_parameters
from parallel_lab.specs import ModelSpec, Plan

GB = 1e9

# The seed's 7B-class shape: L=32, h=4096, a=32 (gpt block with dropout, 2-byte activations), s=4096, b=1.
L, H, A, S, B = 32, 4096, 32, 4096, 1
SEED_MODEL = ModelSpec(layers=L, hidden=H, heads=A, max_positions=S)


def seed_plan(**kw) -> Plan:
    return Plan(seq=S, micro_batch=B, **kw)


# ---- seed: activations (Korthikanti et al. 2022 Sec. 4) -----------------------------------------------

def test_seed_activations_no_recompute_exact():
    led = memory(SEED_MODEL, seed_plan(recompute="none"))
    # Korthikanti's per-layer s*b*h*(34 + 5*a*s/h), for 32 layers: 104,152,956,928 bytes = 104.15 GB.
    assert led.per_gpu_bytes["activations"] == 104_152_956_928
    assert L * S * B * H * (34 + 5 * A * S / H) == 104_152_956_928
    # The seed article prints 104.13 GB: an arithmetic slip; its own formula gives 104.15 GB.
    assert round(led.per_gpu_bytes["activations"] / GB, 2) == 104.15 != 104.13


@pytest.mark.parametrize("recompute,per_layer_sbh,gb", [("selective", 34, 18.25), ("full", 2, 1.07)])
def test_seed_activations_recompute(recompute, per_layer_sbh, gb):
    act = memory(SEED_MODEL, seed_plan(recompute=recompute)).per_gpu_bytes["activations"]
    assert act == L * S * B * H * per_layer_sbh
    assert round(act / GB, 2) == gb


def test_seed_long_context_scaling():
    """Seed: from s=4K to 32K the 34-term grows 8x and the 5as/h term 64x."""
    m = SEED_MODEL.with_(max_positions=32768)
    small = activation_bytes_per_layer(m, seed_plan(recompute="none"))
    big = activation_bytes_per_layer(m, Plan(seq=32768, recompute="none"))
    sbh = S * B * H
    assert big == 8 * 34 * sbh + 64 * (small - 34 * sbh)


# ---- Korthikanti Table 2: tensor and sequence parallelism ---------------------------------------------

@pytest.mark.parametrize("t", [2, 4, 8])
def test_korthikanti_table2_tp_sp(t):
    sbh, a_s_h = S * B * H, A * S / H
    per = lambda **kw: activation_bytes_per_layer(SEED_MODEL, seed_plan(tp=t, **kw))  # noqa: E731
    assert per() == pytest.approx(sbh * (10 + 24 / t + 5 * a_s_h / t), rel=1e-12)
    assert per(sp=True) == pytest.approx(sbh / t * (34 + 5 * a_s_h), rel=1e-12)
    assert per(recompute="selective") == pytest.approx(sbh * (10 + 24 / t), rel=1e-12)
    assert per(sp=True, recompute="selective") == pytest.approx(sbh * 34 / t, rel=1e-12)
    assert per(recompute="full") == 2 * sbh
    assert per(sp=True, recompute="full") == 2 * sbh / t


def test_generalisation_no_dropout_and_fp32():
    """The 34 holds two 1-byte masks (after attention and MLP), the 5as/h term the softmax output (2),
    the dropout output (2) and its mask (1): without dropout 32 sbh + 2 as^2 b; in fp32 (masks stay 1 byte)
    66 sbh + 9 as^2 b."""
    sbh, a_s_h = S * B * H, A * S / H
    no_drop = SEED_MODEL.with_(dropout=0.0)
    assert activation_bytes_per_layer(no_drop, seed_plan()) == sbh * (32 + 2 * a_s_h)
    assert activation_bytes_per_layer(SEED_MODEL, seed_plan(dtype="fp32")) == sbh * (66 + 9 * a_s_h)


def test_llama_has_no_masks_and_gqa_shrinks_kv():
    mha = ModelSpec(layers=2, hidden=1024, heads=16, kv_heads=16, ffn=2816, flavour="llama")
    gqa = mha.with_(kv_heads=4)
    p = Plan(seq=512, recompute="selective")
    sb = 512
    # K and V are kv_heads * head_dim wide: GQA saves 2 * (h - kv_dim) elements per token, 2 bytes each.
    saved = activation_bytes_per_layer(mha, p) - activation_bytes_per_layer(gqa, p)
    assert saved == 2 * sb * (1024 - 256) * 2
    # Every term is a multiple of the 2-byte dtype: there are no 1-byte masks in a llama block.
    assert activation_bytes_per_layer(mha, p) % 2 == 0
    assert activation_bytes_per_layer(mha, Plan(seq=512, dtype="fp32")) % 4 == 0


def test_context_parallel_divides_sequence_terms():
    per = activation_bytes_per_layer(SEED_MODEL, seed_plan(recompute="selective"))
    assert activation_bytes_per_layer(SEED_MODEL, seed_plan(recompute="selective", cp=4)) == per / 4
    none1 = activation_bytes_per_layer(SEED_MODEL, seed_plan())
    none4 = activation_bytes_per_layer(SEED_MODEL, seed_plan(cp=4))
    assert none4 == pytest.approx(none1 / 4, rel=1e-12)   # local queries x all keys: scores also / cp


# ---- pipeline: in-flight micro-batches ----------------------------------------------------------------

def test_inflight_microbatches_per_schedule():
    assert inflight_microbatches("1f1b", 1, 8) == 1
    assert inflight_microbatches("gpipe", 4, 8, stage=3) == 8
    assert [inflight_microbatches("1f1b", 4, 8, 1, r) for r in range(4)] == [4, 3, 2, 1]
    assert inflight_microbatches("1f1b", 4, 2, 1, 0) == 2
    assert inflight_microbatches("zb-h1", 4, 8, 1, 0) == 4
    # Korthikanti Sec. 4.2.3: interleaving multiplies the first stage's memory by 1 + (p-1)/(p v).
    for p, v in [(4, 2), (8, 3), (2, 4)]:
        want = p * (1 + (p - 1) / (p * v))
        assert inflight_microbatches("interleaved", p, 4 * p, v, 0) == pytest.approx(want)
    with pytest.raises(ParallelLabError):
        inflight_microbatches("1f1b", 4, 8, 1, 4)


def test_1f1b_first_stage_holds_all_layers_worth():
    """Korthikanti Sec. 4.2.3: with 1F1B the first stage stores p micro-batches of L/p layers: L layers."""
    per = activation_bytes_per_layer(SEED_MODEL, seed_plan(recompute="selective"))
    led = memory(SEED_MODEL, seed_plan(recompute="selective", pp=4, grad_accum=8), stage=0)
    assert led.per_gpu_bytes["activations"] == per * L
    gpipe_plan = seed_plan(recompute="selective", pp=4, grad_accum=8, schedule="gpipe")
    gpipe = memory(SEED_MODEL, gpipe_plan, stage=0)
    assert gpipe.per_gpu_bytes["activations"] == per * L / 4 * 8


# ---- model state (ZeRO paper, the seed's table) -------------------------------------------------------

SEED_STATE = {  # GB per GPU, dp = 8, mixed-precision Adam 2 + 2 + 12 bytes/param
    0: {7e9: 112.0, 13e9: 208.0, 70e9: 1120.0},
    1: {7e9: 38.5, 13e9: 71.5, 70e9: 385.0},
    2: {7e9: 26.25, 13e9: 48.75, 70e9: 262.5},   # the seed prints 26.2 and 48.8 (rounded half-even)
    3: {7e9: 14.0, 13e9: 26.0, 70e9: 140.0},
}


@pytest.mark.parametrize("zero", [0, 1, 2, 3])
@pytest.mark.parametrize("params", [7e9, 13e9, 70e9])
def test_seed_state_table(zero, params):
    state = state_bytes(ModelSpec.from_params(params), Plan(dp=8, zero=zero))
    assert sum(state.values()) / GB == SEED_STATE[zero][params]
    led = memory(ModelSpec.from_params(params), Plan(dp=8, zero=zero))
    assert led.state_bytes / GB == SEED_STATE[zero][params]


#: ZeRO paper (Rajbhandari et al. 2020), Table 1: GB per device for Psi = 7.5B, K = 12 (mixed-precision
#: Adam), as printed (one decimal; 0.12 at 1024), for Nd = 4, 64, 1024 and stages P_os, P_os+g, P_os+g+p.
ZERO_TABLE_1 = {4: (120, 52.5, 41.3, 30), 64: (120, 31.4, 16.6, 1.9), 1024: (120, 30.1, 15.1, 0.12)}


@pytest.mark.parametrize("nd", sorted(ZERO_TABLE_1))
def test_zero_paper_table_1(nd):
    for zero, printed in enumerate(ZERO_TABLE_1[nd]):
        state = state_bytes(ModelSpec.from_params(7.5e9), Plan(dp=nd, zero=zero))
        half_ulp = 0.005 if printed < 1 else 0.05          # printed rounded half up: 41.25 -> 41.3
        assert abs(sum(state.values()) / GB - printed) <= half_ulp + 1e-12, (nd, zero)


def test_zero2_gradients_with_accumulation():
    """ZeRO-2 over several micro-batches: holding the full gradients until the last one (the default)
    costs ZeRO-1's full gradients at the peak; reduce-scattering every micro-batch keeps them sharded."""
    m = ModelSpec.preset("llama2-7b")
    full = 2 * m.n_params                                    # bf16 gradients of adam-mixed
    held = state_bytes(m, Plan(dp=8, zero=2, grad_accum=8))["gradients"]
    sharded = state_bytes(m, Plan(dp=8, zero=2, grad_accum=8, zero2_accumulate="sharded"))["gradients"]
    assert held == state_bytes(m, Plan(dp=8, zero=1, grad_accum=8))["gradients"] == full
    assert sharded == state_bytes(m, Plan(dp=8, zero=2))["gradients"] == pytest.approx(full / 8, rel=1e-6)
    led = memory(m, Plan(dp=8, zero=2, grad_accum=8))
    assert any("holds the full gradients until the last of 8" in n for n in led.notes)


def test_seed_sgd_momentum_12_bytes():
    state = state_bytes(ModelSpec.from_params(7e9), Plan(dp=8, optimizer="sgd-momentum"))
    assert sum(state.values()) == 12 * 7e9


def test_seed_state_rounding_as_printed():
    assert f"{26.25:.1f}" == "26.2" and f"{48.75:.1f}" == "48.8"


def test_zero_sharding_by_units_exact():
    m, dp = ModelSpec.preset("tiny-llama"), 3
    units: dict[str, int] = {}
    for name, shape in m.parameter_shapes():
        u = ".".join(name.split(".")[:2]) if name.startswith("blocks.") else "root"
        units[u] = units.get(u, 0) + math.prod(shape)
    shard = sum(math.ceil(n / dp) for n in units.values())
    assert len(units) == m.layers + 1
    st = state_bytes(m, Plan(dp=dp, zero=3))
    assert st == {"parameters": 2.0 * shard, "gradients": 2.0 * shard, "optimizer_states": 12.0 * shard}
    root_only = state_bytes(m, Plan(dp=dp, zero=3, zero_unit="root"))
    assert root_only["parameters"] == 2 * math.ceil(m.n_params / dp)


def test_tensor_parallel_sharding_llama2_7b():
    """Per TP rank: every weight matrix and the embedding/head split t ways; the 65 RMSNorm weights
    (2 per block + the final norm, 4096 each) replicated."""
    m = ModelSpec.preset("llama2-7b")
    replicated = (2 * 32 + 1) * 4096
    for t in (2, 4, 8):
        local = sum(p.numel for p in local_parameters(m, Plan(tp=t)))
        assert local == (m.n_params - replicated) / t + replicated
        assert state_bytes(m, Plan(tp=t))["parameters"] == 2 * local


def test_gqa_kv_heads_replicated_when_tp_exceeds_them():
    m = ModelSpec.preset("llama3-8b")                       # 8 kv heads of 128
    wk = {p.name: p.numel for p in local_parameters(m, Plan(tp=16, seq=512))}["blocks.0.attn.wk.weight"]
    assert wk == 128 * 4096                                 # one whole kv head per rank
    wk8 = {p.name: p.numel for p in local_parameters(m, Plan(tp=8))}["blocks.0.attn.wk.weight"]
    assert wk8 == 128 * 4096


def test_pipeline_stages_partition_the_parameters():
    m = ModelSpec.preset("llama2-7b")
    plan = Plan(pp=4, grad_accum=4)
    per_stage = [state_bytes(m, plan, stage=s)["parameters"] for s in range(4)]
    assert sum(per_stage) == 2 * m.n_params
    names0 = {p.name for p in local_parameters(m, plan, 0)}
    names3 = {p.name for p in local_parameters(m, plan, 3)}
    assert "tok_emb.weight" in names0 and "lm_head.weight" in names3 and "lm_head.weight" not in names0
    fullest = max((state_bytes(m, plan, s) for s in range(4)), key=lambda d: sum(d.values()))
    assert state_bytes(m, plan) == fullest


def test_tied_embeddings_copy_on_last_stage():
    m = ModelSpec.preset("tiny-gpt").with_(tied_embeddings=True)
    last = {p.name for p in local_parameters(m, Plan(pp=2, grad_accum=2), 1)}
    assert "tok_emb.weight" in last


# ---- the ledger as a whole ----------------------------------------------------------------------------

def test_ledger_categories_and_json():
    led = memory(ModelSpec.preset("llama3-8b"), Plan(seq=8192, tp=4, dp=2))
    assert list(led.per_gpu_bytes) == list(CATEGORIES)
    j = led.to_json()
    assert {"per_gpu_bytes", "total_bytes", "hbm_bytes", "fits", "margin", "notes"} <= set(j)
    assert j["total_bytes"] == sum(j["per_gpu_bytes"].values())
    assert j["hbm_bytes"] == 80e9


def test_bare_count_omits_activations_and_says_so():
    led = memory(ModelSpec.from_params(7e9), Plan(dp=8, zero=2))
    assert "activations" not in led.per_gpu_bytes and "logits_and_loss" not in led.per_gpu_bytes
    assert any("bare parameter count" in n for n in led.notes)


def test_fits_verdict_uses_margin():
    m = ModelSpec.from_params(7e9)
    led = memory(m, Plan(dp=8, zero=3))                     # 14 GB of state + 0 buffers
    assert led.fits
    # 112 GB of state does not fit in 80 GB
    assert not memory(m, Plan(dp=8)).fits
    h200 = ClusterSpec.preset("h200")
    big = memory(ModelSpec.from_params(8e9), Plan(), h200)  # 128 GB > 141 GB * 0.9 = 126.9 GB
    assert big.total_bytes == 128e9 and not big.fits
    assert memory(ModelSpec.from_params(8e9), Plan(), h200, margin=0.05).fits


def test_logits_and_loss_on_last_stage():
    m = ModelSpec.preset("llama3-8b")
    led = memory(m, Plan(seq=4096, tp=4, pp=2, grad_accum=2), stage=1)
    # fp32 log-probabilities for the local vocabulary shard and the final norm's and head's bf16 inputs (the
    # bf16 logits are not kept: measured in fake tensors, tests/distributed/test_measure.py)
    assert led.per_gpu_bytes["logits_and_loss"] == 4096 * 1 * ((128256 / 4) * 4 + 2 * 4096 * 2)
    assert memory(m, Plan(seq=4096, tp=4, pp=2, grad_accum=2), stage=0).per_gpu_bytes["logits_and_loss"] == 0


def test_ddp_buckets_are_the_gradients_not_comm_buffers():
    # the bucketed gradients are views into the buckets (measured: tests/distributed/test_comm_buffers.py,
    # where the code before the fix held a second 3.43 MB copy while accumulating)
    led = memory(ModelSpec.preset("llama2-7b"), Plan(dp=2, seq=1024))
    assert led.per_gpu_bytes["comm_buffers"] == 0
    assert any("views into them" in n for n in led.notes)
    # with SP, the full-sequence tensor is a part of its own (two with b > 1: the reordering copy)
    m = ModelSpec.preset("llama2-7b")
    parts = ledger_buffers.comm_buffer_parts(m, Plan(tp=2, sp=True, seq=1024, micro_batch=2, pp=2, grad_accum=2))
    assert parts == {"sp": 2 * 1024 * 2 * 4096 * 2, "pp": 2 * 1024 * 2 * 4096 * 2 / 2}


def test_per_op_plumbing():
    from parallel_lab import activations
    m, p = ModelSpec.preset("tiny-llama"), Plan(seq=128, micro_batch=4)
    d = activations.per_op_bytes(m, p)
    led = memory(m, p, activation_model="per-op")
    assert led.per_gpu_bytes["activations"] == d["activations"]
    assert led.per_gpu_bytes["logits_and_loss"] == d["logits_and_loss"]


@pytest.mark.parametrize("bad", [dict(activation_model="exact"), dict(margin=1.5), dict(stage=3)])
def test_ledger_rejects_bad_arguments(bad):
    with pytest.raises(ParallelLabError):
        memory(ModelSpec.preset("tiny-llama"), Plan(seq=128), **bad)
