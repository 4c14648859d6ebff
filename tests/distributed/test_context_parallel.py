"""Context parallelism (ring, all-gather, Ulysses) against single-process attention and training.

Tolerances (fp32, stated): attention output and the gradients of q, k, v agree with the model's own
``DotProductAttention`` on the full sequence within ``ATTN_TOL = 1e-5`` absolute (inputs and weights
standard normal, outputs O(1); observed <= 2e-6: the blockwise online softmax sums in another order).
Training: losses within 1e-5 relative (observed <= 1.3e-7), parameters within ``PARAM_TOL = 5e-5`` after
3 AdamW steps (observed <= 3e-5: AdamW's ``m / sqrt(v)`` turns rounding in tiny gradients, e.g. of rarely
seen token rows, into steps of up to ``lr``; the checker of ``parallel-lab run`` allows 1e-4).

Each launch runs many cases (the attention tests all 12 of kind x causal x documents, and the three kinds
with chunks dealt by attention work; the training tests
all three kinds) to keep the file fast.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from parallel_lab import comm
from parallel_lab.distributed.context_parallel.blockwise_attention import local_attention
from parallel_lab.distributed.context_parallel.context_parallel import ContextParallel, ContextParallelAttention
from parallel_lab.distributed.context_parallel.cp_balance import rank_index, rank_indices, work_per_rank
from parallel_lab.distributed.context_parallel.ring_attention import CPGroup
from parallel_lab.distributed.instruments.tracer import CommTracer, compare_calls
from parallel_lab.distributed.model.data import SyntheticData
from parallel_lab.distributed.model.model import DotProductAttention, make_context
from parallel_lab.distributed.model.reference import reference_train
from parallel_lab.distributed.runtime.launch import launch
from parallel_lab.distributed.runtime.run import predicted_activations, run
from parallel_lab.distributed.runtime.train import global_losses, max_abs_diff, merge_params, train_rank
from parallel_lab.errors import ParallelLabError
from parallel_lab.sharding import kv_replication
from parallel_lab.specs import CP_KINDS, RUN_DEFAULTS, ModelSpec, Plan

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(180)]

ATTN_TOL, LOSS_TOL, PARAM_TOL = 1e-5, 1e-5, 5e-5
LLAMA = ModelSpec.preset("tiny-llama")                    # 4 heads, 2 kv heads, head_dim 32
B, S = 2, 64


# --------------------------------------------------------------------------------------------------
# Attention level: output and gradients, calls and bytes, work per rank
# --------------------------------------------------------------------------------------------------

def _inputs(packed: bool):
    g = torch.Generator().manual_seed(1)
    h, kv, d = LLAMA.heads, LLAMA.kv_heads, LLAMA.head_dim
    q, k, v = (torch.randn(B, n, S, d, generator=g) for n in (h, kv, kv))
    w = torch.randn(B, h, S, d, generator=g)                  # loss = sum(out * w)
    docs = SyntheticData(LLAMA.vocab, packed=True, min_doc=4).batch(0, B, S).doc_ids if packed else None
    return q, k, v, w, docs


def _attention_cases(grid):
    """Every (kind, causal, documents) case on this rank: errors against the full attention, the traced
    calls of the case by phase, and the kernel's computed query/key pairs (for the balance check)."""
    tracer = CommTracer(grid.rank, grid.groups_by_dim())
    grp = CPGroup(grid.ranks["cp"], grid.cp_rank, grid.groups["cp"])
    pos = torch.arange(S)
    out = []
    cases = [(kind, causal, packed, "zigzag") for kind in CP_KINDS for causal in (True, False)
             for packed in (False, True)] + [(kind, True, True, "work") for kind in CP_KINDS]
    for kind, causal, packed, balance in cases:
        q, k, v, w, docs = _inputs(packed)
        qr, kr, vr = (x.clone().requires_grad_() for x in (q, k, v))
        ref = DotProductAttention()(qr, kr, vr, make_context(pos, docs, causal))
        (ref * w).sum().backward()
        cp = ContextParallel(kind, grp, balance=balance, tile=8)
        idx = cp.index(S, docs, causal)
        ql, kl, vl = (x[:, :, idx].clone().requires_grad_() for x in (q, k, v))
        n0 = len(tracer.events)
        with tracer.observe(), tracer.phase_as("forward"):
            o = ContextParallelAttention(cp)(ql, kl, vl, cp.local_context(pos, docs, causal))
        with tracer.observe(), tracer.phase_as("backward"):
            (o * w[:, :, idx]).sum().backward()
        errs = [float((a.detach() - r.detach()[:, :, idx]).abs().max()) for a, r in
                ((o, ref), (ql.grad, qr.grad), (kl.grad, kr.grad), (vl.grad, vr.grad))]
        out.append({"case": (kind, causal, packed, balance), "errs": errs, "events": tracer.events[n0:]})
    pairs = {}
    for balance in ("zigzag", "contiguous"):                 # work the ring kernel does on this rank
        grp.stats.reset()
        cp = ContextParallel("ring", grp, balance=balance)            # default tile: larger than a chunk
        q, k, v, _, _ = _inputs(False)
        idx = cp.index(S)
        ContextParallelAttention(cp)(q[:, :, idx], k[:, :, idx], v[:, :, idx], cp.local_context(pos))
        pairs[balance] = grp.stats.kernel.pairs_computed
    return out, pairs


def _predicted_cp_calls(kind: str, cp: int) -> Counter:
    """comm.py's collectives of one layer and one micro-batch of these shapes, by (phase, kind, bytes)."""
    spec = LLAMA.with_(layers=1)
    plan = Plan(cp=cp, cp_kind=kind, seq=S, micro_batch=B, dtype="fp32", optimizer="adam-fp32")
    out: Counter = Counter()
    for c in comm.collectives(spec, plan):
        if c.dim == "cp":
            out[(c.phase, c.kind, c.message_bytes, c.group_size)] += c.count
    return out


@pytest.mark.parametrize("cp", [2, 4])
def test_attention_equals_single_process_and_comm_prediction(cp):
    results = launch(_attention_cases, Plan(cp=cp, seq=S), timeout_s=150)
    for rank, (cases, pairs) in enumerate(results):
        for c in cases:
            kind = c["case"][0]
            assert max(c["errs"]) <= ATTN_TOL, (rank, c["case"], c["errs"])
            traced = Counter((e.phase, e.kind, e.message_bytes, e.group_size) for e in c["events"])
            assert traced == _predicted_cp_calls(kind, cp), (rank, c["case"])
        # the ring kernel's computed (query, key) pairs: the same on every rank with zigzag chunks
        assert pairs["zigzag"] == results[0][1]["zigzag"]
    contiguous = [r[1]["contiguous"] for r in results]
    assert contiguous == sorted(contiguous) and contiguous[-1] > 2 * contiguous[0]


def test_work_per_rank_equal_with_zigzag_and_not_with_contiguous_slices():
    # causal, no documents: allowed (query, key) pairs per rank; seq 1024 over cp 4, chunks of 128
    assert work_per_rank(1024, 4, "zigzag") == [131200] * 4
    assert work_per_rank(1024, 4, "contiguous") == [32896, 98432, 163968, 229504]   # 7x from first to last
    assert sum(work_per_rank(1024, 4, "zigzag")) == 1024 * 1025 // 2              # the whole triangle
    # non-causal: every layout is balanced
    assert len(set(work_per_rank(1024, 4, "contiguous", causal=False))) == 1
    # packed documents: equal tokens per rank, unequal work, even with zigzag chunks (judge by work)
    docs = SyntheticData(LLAMA.vocab, packed=True).batch(0, 4, 1024).doc_ids
    work = work_per_rank(1024, 4, "zigzag", docs)
    assert [len(rank_index(1024, 4, r)) for r in range(4)] == [256] * 4
    assert work == [84585, 191511, 180619, 145360] and max(work) / (sum(work) / 4) > 1.25
    # dealing 16 chunks by their attention work balances it again (same tokens per rank)
    balanced = work_per_rank(1024, 4, "work", docs)
    assert sum(balanced) == sum(work) and max(balanced) / (sum(balanced) / 4) < 1.05
    assert [len(i) for i in rank_indices(1024, 4, "work", docs)] == [256] * 4
    # without documents, dealing 2 cp chunks by work is the zigzag
    for cp in (2, 3, 4, 8):
        assert all(torch.equal(a, b) for a, b in zip(rank_indices(1536, cp, "work", pieces=1),
                                                    rank_indices(1536, cp, "zigzag"), strict=True))


def test_local_kernel_equals_full_attention_for_any_tile():
    q, k, v, _, docs = _inputs(True)
    for causal in (True, False):
        for d in (None, docs):
            ref = DotProductAttention()(q, k, v, make_context(torch.arange(S), d, causal))
            for tile in (5, 16, 64):
                out = local_attention(q, k, v, torch.arange(S), d, causal, tile)
                assert float((out - ref).abs().max()) <= ATTN_TOL


def test_clear_errors():
    assert kv_replication(4, 2, 4) == 2 and kv_replication(4, 2, 2) == 1 and kv_replication(12, 6, 4) == 2
    with pytest.raises(ParallelLabError, match="cp must divide them: pick cp in"):
        kv_replication(4, 2, 3)
    with pytest.raises(ParallelLabError, match="seq=60 is not divisible by 8 .* pick seq a multiple of 8"):
        rank_index(60, 4, 0)
    with pytest.raises(ParallelLabError, match=r"heads=4 \(query heads per tensor-parallel rank\) on cp=8"):
        Plan(cp=8, cp_kind="ulysses", seq=128).validate(LLAMA)
    # the heads per tensor-parallel rank decide: llama3-8b's 32 heads over tp 8 are 4, which cp 8 cannot split
    with pytest.raises(ParallelLabError, match=r"heads=4 .* on cp=8 ranks; cp must divide them: pick cp in \{1, 2, 4"):
        Plan(tp=8, cp=8, cp_kind="ulysses", seq=8192).validate(ModelSpec.preset("llama3-8b"))
    Plan(tp=8, cp=4, cp_kind="ulysses", seq=8192).validate(ModelSpec.preset("llama3-8b"))


# --------------------------------------------------------------------------------------------------
# Training: the tiny model, every kind, against the single-process reference and the predictions
# --------------------------------------------------------------------------------------------------

def _train_all_kinds(grid, spec, plan, steps, packed):
    return {kind: train_rank(grid, spec, plan.with_(cp_kind=kind), steps, 0, packed=packed)
            for kind in CP_KINDS}


def _check_training(spec: ModelSpec, plan: Plan, packed: bool, steps: int = 3):
    results = launch(_train_all_kinds, plan, spec, plan, steps, packed, timeout_s=170)
    ref = reference_train(spec, plan, steps, 0, packed=packed)
    for kind in CP_KINDS:
        p = plan.with_(cp_kind=kind)
        ranks = [r[kind] for r in results]
        losses = global_losses(ranks)
        assert all(abs(a - b) <= LOSS_TOL * abs(b) for a, b in zip(losses, ref.losses, strict=True)), kind
        assert max_abs_diff(merge_params(ranks), ref.params) <= PARAM_TOL, kind
        predicted = comm.collectives(spec, p, stage=0)
        for r in ranks:
            diff = compare_calls(r.events, predicted, times=steps)
            assert diff == {"missing": {}, "extra": {}}, (kind, r.rank, diff)
            assert r.memory["activations"] == predicted_activations(spec, p), (kind, r.rank)
    return results


def test_training_cp2_with_document_masks_equals_reference():
    plan = Plan(cp=2, **{**RUN_DEFAULTS, "seq": 64, "micro_batch": 2})
    _check_training(LLAMA.with_(layers=2), plan, packed=True)


def test_training_cp4_equals_reference():
    # cp 4: Ulysses replicates tiny-llama's 2 kv heads to 4; grad accumulation 2
    plan = Plan(cp=4, grad_accum=2, **{**RUN_DEFAULTS, "seq": 64, "micro_batch": 1})
    _check_training(LLAMA.with_(layers=2), plan, packed=False)


def test_training_dp2_cp2_gpt_syncs_gradients_over_dp_x_cp():
    # learned positions (gpt): each rank looks up the rows of the chunks it holds
    spec = ModelSpec.preset("tiny-gpt").with_(layers=2)
    plan = Plan(dp=2, cp=2, **{**RUN_DEFAULTS, "seq": 64, "micro_batch": 1})
    results = _check_training(spec, plan, packed=True, steps=2)
    dp_calls = {e.group_size for r in results for e in r["ring"].events if e.dim == "dp"}
    assert dp_calls == {4}


@pytest.mark.parametrize("kind,recompute", [("ulysses", "none"), ("ring", "selective")])
def test_run_report_for_cp2(kind, recompute):
    # selective recomputation reruns the attention core, and with it the core's communication
    plan = Plan(cp=2, cp_kind=kind, recompute=recompute, **{**RUN_DEFAULTS, "seq": 64, "micro_batch": 2})
    rep = run(LLAMA.with_(layers=2), plan, steps=2)
    j = rep.to_json()
    assert j["comm"]["cp"]["measured_bytes"] == j["comm"]["cp"]["predicted_bytes"] > 0
    assert j["memory"]["activations"]["measured_bytes"] == j["memory"]["activations"]["predicted_bytes"]
    assert j["max_abs_param_diff"] <= PARAM_TOL
    # the forward kernel's work per rank (RankResult.info["cp"], whole 16-token tiles of the 4 zigzag chunks): the
    # ring gives each rank 5 of the 10 causal tiles, Ulysses all 10 for half the heads; selective recomputation
    # runs the forward kernel again in backward. 2 sequences x 2 layers x 2 steps.
    tiles = (10 if kind == "ulysses" else 5) * (2 if recompute == "selective" else 1)
    assert [r.info["cp"]["pairs_computed"] for r in rep.ranks] == [tiles * 16 * 16 * 2 * 2 * 2] * 2
