"""Specs: presets against published parameter counts, validation messages, the pipeline layer split."""

from __future__ import annotations

import pytest

from parallel_lab.errors import ParallelLabError
from parallel_lab.hardware import CLUSTER_PRESETS, ClusterSpec
from parallel_lab.sharding import chunk_layers, stage_layers
from parallel_lab.specs import ModelSpec, Plan

# (preset, published count, relative tolerance, source)
PUBLISHED = [
    ("llama2-7b", 6.74e9, 0.001, "Touvron et al. 2023, Llama 2, Table 1 / model card"),
    ("llama2-13b", 13.0e9, 0.003, "Llama 2 model card"),
    ("llama2-70b", 69.0e9, 0.003, "Llama 2 model card (69B)"),
    ("llama3-8b", 8.03e9, 0.001, "Llama 3 model card"),
    ("llama3-70b", 70.6e9, 0.001, "Llama 3 model card"),
    ("llama3-405b", 405.8e9, 0.001, "Llama 3.1 model card"),
    ("gpt3-175b", 175.0e9, 0.005, "Brown et al. 2020, Table 2.1"),
    ("gpt3-1.3b", 1.3e9, 0.015, "Brown et al. 2020, Table 2.1 (GPT-3 XL; a rounded name)"),
    # Korthikanti et al. 2022, Table 3 names the configurations by size; the round names are not exact.
    ("megatron-22b", 22e9, 0.02, "Korthikanti et al. 2022, Table 3"),
    ("megatron-175b", 175e9, 0.02, "Korthikanti et al. 2022, Table 3"),
    ("megatron-530b", 530e9, 0.02, "Korthikanti et al. 2022, Table 3"),
    ("megatron-1t", 1e12, 0.02, "Korthikanti et al. 2022, Table 3"),
    # Narayanan et al. 2021, Table 1 prints the same shapes to a tenth of a billion (embedding tied).
    ("megatron-175b", 174.6e9, 0.0003, "Narayanan et al. 2021, Table 1"),
    ("megatron-530b", 529.6e9, 0.0003, "Narayanan et al. 2021, Table 1"),
    ("megatron-1t", 1008.0e9, 0.0003, "Narayanan et al. 2021, Table 1"),
]


@pytest.mark.parametrize("name,published,rel,source", PUBLISHED,
                         ids=[f"{p[0]}-{i}" for i, p in enumerate(PUBLISHED)])
def test_preset_matches_published_count(name, published, rel, source):
    n = ModelSpec.preset(name).n_params
    assert abs(n - published) <= rel * published, f"{name}: {n:,} vs {published:,} ({source})"


def test_llama2_7b_exact_count():
    # The meta-device torch model of Llama-2-7B has exactly this many parameters
    # (shared/reference/torch_cpu_notes.md; also the Hugging Face model card's count).
    assert ModelSpec.preset("llama2-7b").n_params == 6_738_415_616


def test_parameter_shapes_cover_every_block_and_tie():
    m = ModelSpec.preset("tiny-gpt")
    names = [n for n, _ in m.parameter_shapes()]
    assert names[:2] == ["tok_emb.weight", "pos_emb.weight"]
    assert names[-1] == "lm_head.weight"
    per_block = [sum(n.startswith(f"blocks.{i}.") for n in names) for i in range(m.layers)]
    assert len(set(per_block)) == 1 and per_block[0] == 16   # norms 2+2, 6 linears with biases
    tied = m.with_(tied_embeddings=True)
    assert tied.n_params == m.n_params - m.vocab * m.hidden


def test_bare_count_model():
    m = ModelSpec.from_params(7e9)
    assert m.n_params == 7_000_000_000 and not m.shape_known
    with pytest.raises(ParallelLabError, match="parameter count"):
        m.parameter_shapes()
    with pytest.raises(ParallelLabError, match="--params"):
        ModelSpec.from_params(0)


@pytest.mark.parametrize("kwargs,words", [
    (dict(tp=3), ["tp=3", "heads=32", "pick tp in"]),
    (dict(pp=64), ["pp*interleave", "layers=32"]),
    (dict(cp=3, seq=4096), ["seq=4096", "2*cp=6"]),
])
def test_plan_validate_names_bad_value_and_fix(kwargs, words):
    with pytest.raises(ParallelLabError) as e:
        Plan(**kwargs).validate(ModelSpec.preset("llama2-7b"))
    for w in words:
        assert w in str(e.value)


@pytest.mark.parametrize("kwargs", [dict(zero=2), dict(sp=True), dict(interleave=2), dict(dp=0),
                                    dict(optimizer="lion"), dict(bucket_mb=0)])
def test_plan_rejects_invalid_fields(kwargs):
    with pytest.raises(ParallelLabError):
        Plan(**kwargs)


def test_plan_global_batch_and_world():
    p = Plan(dp=4, tp=2, pp=2, cp=2, micro_batch=3, grad_accum=5, seq=1024)
    assert p.world == 32 and p.global_batch == 60 and p.global_batch_tokens == 60 * 1024
    assert p.shape == (4, 2, 2, 2)
    with pytest.raises(ParallelLabError, match="gpus=16"):
        p.validate(ModelSpec.preset("tiny-llama"), gpus=16)


def test_cluster_presets():
    h100 = ClusterSpec.preset("h100-sxm")
    assert h100.hbm_bytes == 80e9 and h100.peak_flops == 989e12
    assert h100.intra.bandwidth == 450e9 and h100.inter.bandwidth == 400e9 / 8
    assert {"h100-sxm", "a100-80gb", "h200", "cpu-gloo"} <= set(CLUSTER_PRESETS)
    assert h100.tier(8) is h100.intra and h100.tier(9) is h100.inter
    with pytest.raises(ParallelLabError, match="pick one of"):
        ClusterSpec.preset("tpu")


def test_chunk_layers_split():
    assert chunk_layers(8, 4) == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert [len(c) for c in chunk_layers(10, 4)] == [3, 3, 2, 2]
    assert sum(map(len, chunk_layers(126, 16))) == 126
    # interleaved: stage r holds chunks r, r + p, ...
    assert stage_layers(8, 2, 2, 0) == [0, 1, 4, 5]
    assert stage_layers(8, 2, 2, 1) == [2, 3, 6, 7]
    with pytest.raises(ParallelLabError, match="stage=2"):
        stage_layers(8, 2, 1, 2)
    with pytest.raises(ParallelLabError):
        chunk_layers(4, 8)


def test_one_answer_everywhere_for_kv_heads_tp_does_not_split():
    """kv_heads=6 on tp=4 can be neither split nor replicated evenly: the plan, the ledger, the comm module,
    the per-op activation model and the runnable TP all refuse it with the same rule (sharding.check_tp)."""
    from parallel_lab import activations, comm, ledger, sharding

    model = ModelSpec(layers=2, hidden=96, heads=12, kv_heads=6, flavour="llama")
    plan = Plan(tp=4)
    calls = [lambda: plan.validate(model), lambda: ledger.memory(model, plan), lambda: comm.collectives(model, plan),
             lambda: activations.per_op_bytes(model, plan), lambda: sharding.check_tp(model, 4)]
    messages = set()
    for call in calls:
        with pytest.raises(ParallelLabError, match="cannot split kv_heads=6") as e:
            call()
        messages.add(str(e.value))
    assert len(messages) == 1 and "pick tp in {1, 2}" in messages.pop()
    assert 3 not in sharding.valid_tp(model) and sharding.valid_tp(model) == [1, 2]


@pytest.mark.parametrize("bad,match", [({"rope_theta": 1.0}, "rope_theta=1.0 must be > 1"),
                                       ({"rope_theta": "1e4"}, "must be a number"),
                                       ({"rope_scaling": "yarn"}, "rope_scaling='yarn' is not known")])
def test_rope_settings_are_checked(bad, match):
    """Llama 3's rotary base and Llama 3.1's scaling (tests/test_torchtitan_losses.py); defaults 10000, none."""
    m = ModelSpec(layers=2, hidden=64, heads=4, flavour="llama")
    assert (m.rope_theta, m.rope_scaling) == (10000.0, "none")
    assert m.with_(rope_theta=500000.0, rope_scaling="llama3").rope_scaling == "llama3"
    with pytest.raises(ParallelLabError, match=match):
        m.with_(**bad)
