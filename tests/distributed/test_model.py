"""The tiny reference model: layout, determinism, data, the reference step, document masks, recompute."""

from __future__ import annotations

import pytest
import torch

from parallel_lab.distributed.model.data import SyntheticData, synthetic_batch
from parallel_lab.distributed.model.model import build_model, init_weights, loss_fn, make_context
from parallel_lab.distributed.model.reference import reference_train
from parallel_lab.specs import ModelSpec, Plan

pytestmark = pytest.mark.timeout(120)

FLAVOURS = ("tiny-llama", "tiny-gpt")


def small(name: str, **kw) -> ModelSpec:
    return ModelSpec.preset(name).with_(layers=2, **kw)


@pytest.mark.parametrize("name", FLAVOURS)
@pytest.mark.parametrize("tied", [False, True])
def test_parameter_names_and_shapes_follow_the_spec(name, tied):
    spec = ModelSpec.preset(name).with_(tied_embeddings=tied)
    model = build_model(spec)
    got = [(n, tuple(p.shape)) for n, p in model.named_parameters()]
    assert got == spec.parameter_shapes()
    assert sum(p.numel() for p in model.parameters()) == spec.n_params


@pytest.mark.parametrize("name", FLAVOURS)
def test_same_seed_same_weights_other_seed_other_weights(name):
    spec = small(name)
    a, b, c = init_weights(spec, 3), init_weights(spec, 3), init_weights(spec, 4)
    assert all(torch.equal(a[n], b[n]) for n in a)
    assert any(not torch.equal(a[n], c[n]) for n in a if n.endswith("weight") and "norm" not in n)
    m1, m2 = build_model(spec, 3), build_model(spec, 3)
    assert all(torch.equal(p, q) for p, q in zip(m1.parameters(), m2.parameters(), strict=True))
    # residual projections get the smaller GPT-2 init
    std = a["blocks.0.mlp." + ("down" if name == "tiny-llama" else "proj") + ".weight"].std().item()
    assert std == pytest.approx(0.02 / (2 * spec.layers) ** 0.5, rel=0.05)


def test_global_batch_is_the_same_for_every_plan_with_the_same_global_batch():
    spec = small("tiny-llama")
    p1 = Plan(dp=1, micro_batch=8, seq=32)
    p2 = Plan(dp=2, micro_batch=2, grad_accum=2, seq=32)
    b1, b2 = synthetic_batch(spec, p1, 5, seed=1), synthetic_batch(spec, p2, 5, seed=1)
    assert torch.equal(b1.tokens, b2.tokens) and torch.equal(b1.targets, b2.targets)
    assert torch.equal(b1.tokens[:, 1:], b1.targets[:, :-1])
    assert not torch.equal(b1.tokens, synthetic_batch(spec, p1, 6, seed=1).tokens)


def test_packed_documents_start_with_bos_and_number_documents_per_row():
    data = SyntheticData(vocab=64, seed=2, packed=True, min_doc=4)
    b = data.batch(0, n_seq=3, seq=64)
    assert b.doc_ids is not None and b.doc_ids.shape == (3, 64)
    starts = torch.zeros_like(b.doc_ids, dtype=torch.bool)
    starts[:, 0] = True
    starts[:, 1:] = b.doc_ids[:, 1:] != b.doc_ids[:, :-1]
    assert (b.tokens[starts] == 0).all()
    assert int(b.doc_ids.max()) >= 1                  # several documents
    assert ((b.doc_ids[:, 1:] - b.doc_ids[:, :-1]) >= 0).all()


@pytest.mark.parametrize("name", FLAVOURS)
def test_reference_training_decreases_the_loss(name):
    spec = small(name)
    plan = Plan(micro_batch=8, seq=64, optimizer="adam-fp32", dtype="fp32")
    losses = reference_train(spec, plan, steps=3).losses
    assert losses[-1] < losses[0] - 0.05, losses


@pytest.mark.parametrize("name", FLAVOURS)
def test_document_masked_attention_equals_separate_documents(name):
    """A packed row with document ids gives, token for token, the logits of each document run alone
    (with the same positions, passed explicitly)."""
    spec = small(name)
    model = build_model(spec, seed=1).eval()
    torch.manual_seed(0)
    tokens = torch.randint(0, spec.vocab, (1, 48))
    cuts = [0, 13, 30, 48]
    doc_ids = torch.zeros(1, 48, dtype=torch.long)
    for i, (a, b) in enumerate(zip(cuts[:-1], cuts[1:], strict=True)):
        doc_ids[:, a:b] = i
    positions = torch.arange(48)
    with torch.no_grad():
        packed = model(tokens, positions, doc_ids)
        for a, b in zip(cuts[:-1], cuts[1:], strict=True):
            alone = model(tokens[:, a:b], positions[a:b])
            torch.testing.assert_close(packed[:, a:b], alone, rtol=0, atol=2e-6)
        unmasked = model(tokens, positions)
    assert not torch.allclose(unmasked[:, 13:], packed[:, 13:], atol=1e-4)   # the mask matters


def test_rope_attention_depends_on_relative_positions_only():
    spec = small("tiny-llama")
    model = build_model(spec, seed=1).eval()
    tokens = torch.randint(0, spec.vocab, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        a = model(tokens, torch.arange(24))
        b = model(tokens, torch.arange(100, 124))
    torch.testing.assert_close(a, b, rtol=0, atol=1e-4)


def test_attention_core_is_swappable_and_sees_kv_heads():
    spec = small("tiny-llama")
    model = build_model(spec).eval()
    seen = []

    class Spy(torch.nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, q, k, v, ctx):
            seen.append((tuple(q.shape), tuple(k.shape), tuple(ctx.positions.shape)))
            return self.inner(q, k, v, ctx)

    for blk in model.blocks.values():
        blk.attn.core = Spy(blk.attn.core)
    model(torch.zeros(2, 16, dtype=torch.long), torch.arange(16))
    assert seen == [((2, spec.heads, 16, spec.head_dim), (2, spec.kv_heads, 16, spec.head_dim), (16,))] * 2


@pytest.mark.parametrize("name", FLAVOURS)
@pytest.mark.parametrize("recompute", ["selective", "full"])
def test_recompute_gives_the_same_gradients(name, recompute):
    spec = small(name, dropout=0.1)
    plan = Plan(micro_batch=2, seq=32)
    batch = synthetic_batch(spec, plan, 0)
    grads = []
    for mode in ("none", recompute):
        model = build_model(spec, seed=2, recompute=mode)
        torch.manual_seed(7)                       # same dropout masks (checkpoint replays the RNG)
        loss_fn(model(batch.tokens, batch.positions), batch.targets).backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
    for n in grads[0]:
        torch.testing.assert_close(grads[1][n], grads[0][n], rtol=0, atol=0)


def test_pipeline_pieces_compose_to_the_whole_model():
    spec = small("tiny-gpt")
    model = build_model(spec).eval()
    tokens, pos = torch.randint(0, spec.vocab, (2, 16)), torch.arange(16)
    ctx = make_context(pos)
    with torch.no_grad():
        h = model.embed(tokens, pos)
        h = model.blocks["0"](h, ctx)
        h = model.blocks["1"](h, ctx)
        torch.testing.assert_close(model.head(h), model(tokens, pos), rtol=0, atol=0)
        del model.blocks["0"]
        assert [n for n, _ in model.named_parameters() if n.startswith("blocks.")][0].startswith("blocks.1.")
