"""Communication per step against the seed article, the ZeRO paper and the conventions' counting rules."""

from __future__ import annotations

import math

import pytest

from parallel_lab.comm import Collective, collective_time, collectives, payload_bytes, per_step_bytes, report
from parallel_lab.errors import ParallelLabError
from parallel_lab.hardware import ClusterSpec, LinkTier
from parallel_lab.mesh import group_ranks
from parallel_lab.sharding import ddp_buckets
from parallel_lab.specs import ModelSpec, Plan

L, H, A, S = 32, 4096, 32, 4096
SEED_MODEL = ModelSpec(layers=L, hidden=H, heads=A, max_positions=S)
SEED_PLAN = Plan(seq=S, micro_batch=1, tp=8)
SEED_TP_BYTES = 7_516_192_768


def by(colls, **kw):
    return [c for c in colls if all(getattr(c, k) == v for k, v in kw.items())]


# ---- the seed's tensor-parallel figure --------------------------------------------------------------

def test_seed_tp_bytes_per_step():
    colls = collectives(SEED_MODEL, SEED_PLAN)
    # seed: L * 4 all-reduces of s*b*h*2 bytes, each sending 2 (t-1)/t of it on a ring
    assert L * 4 * (S * H * 2) * 2 * 7 / 8 == SEED_TP_BYTES
    assert per_step_bytes(colls)["tp"] == SEED_TP_BYTES
    tp = by(colls, dim="tp")
    assert sum(c.count for c in tp) == 4 * L and {c.kind for c in tp} == {"all_reduce"}
    assert {c.message_bytes for c in tp} == {S * H * 2}


def test_seed_tp_time():
    """Seed: 'about 8 ms at 900 GB/s (NVLink 4), about 150 ms at 50 GB/s (one 400 Gb/s port)'."""
    def seconds(bandwidth):
        tier = LinkTier("seed", bandwidth, 0.0)
        return sum(c.count * collective_time(c.kind, c.message_bytes, c.group_size, tier)
                   for c in collectives(SEED_MODEL, SEED_PLAN) if c.dim == "tp")

    assert seconds(900e9) == pytest.approx(8.35e-3, rel=1e-3)      # "about 8 ms"
    assert seconds(50e9) == pytest.approx(150.3e-3, rel=1e-3)      # "about 150 ms"
    # The seed divides by NVLink 4's *bidirectional* 900 GB/s; a ring sends and receives at once, so the
    # per-direction 450 GB/s of the h100-sxm preset is the right divisor: twice as long.
    assert seconds(450e9) == pytest.approx(16.7e-3, rel=1e-3)
    rep = report(SEED_MODEL, SEED_PLAN, ClusterSpec.preset("h100-sxm"))
    latency = 4 * L * 2 * 7 * 3e-6                                  # 128 calls x 14 ring steps x 3 us
    assert rep.time_s["tp"] == pytest.approx(SEED_TP_BYTES / 450e9 + latency, rel=1e-9)
    assert rep.tiers["tp"] == "nvlink4"


# ---- the record type (docs/conventions.md) ----------------------------------------------------------

@pytest.mark.parametrize("kind,factor", [("all_reduce", 2 * 3 / 4), ("all_gather", 3 / 4),
                                         ("reduce_scatter", 3 / 4), ("all_to_all", 3 / 4), ("send", 1.0),
                                         ("recv", 0.0)])
def test_wire_bytes_per_conventions(kind, factor):
    c = Collective("dp", kind, 1000, 4, count=3)
    assert c.wire_bytes == 3 * factor * 1000
    assert c.payload_bytes == 3000


def test_collective_rejects_unknown_kind():
    with pytest.raises(ParallelLabError, match="all_reduce"):
        Collective("dp", "allreduce", 10, 2)


# ---- data parallelism and ZeRO ----------------------------------------------------------------------

def test_ddp_naive_one_all_reduce_per_tensor_in_ready_order():
    m = ModelSpec.preset("tiny-llama")
    colls = collectives(m, Plan(dp=2, dp_kind="naive", grad_accum=4))
    names = [n for n, _ in m.parameter_shapes()]
    assert [c.note for c in colls] == [f"grad {n}" for n in reversed(names)]
    assert all(c.count == 1 for c in colls)                 # synced once per step, not per micro-batch
    assert payload_bytes(colls)["dp"] == 2 * m.n_params


def test_ddp_bucket_rule():
    m = ModelSpec.preset("tiny-llama")
    plan = Plan(dp=2, bucket_mb=0.1)
    cap = 0.1e6
    buckets = ddp_buckets(m, plan)
    flat = [name for b in buckets for name, _ in b]
    assert flat == [n for n, _ in reversed(m.parameter_shapes())]
    for i, b in enumerate(buckets):
        size = sum(x for _, x in b)
        assert size <= cap or len(b) == 1                        # never over the cap, unless one tensor
        if i + 1 < len(buckets):
            assert size + buckets[i + 1][0][1] > cap             # closed only when the next would overflow
    colls = collectives(m, plan)
    assert [c.message_bytes for c in colls] == [sum(x for _, x in b) for b in buckets]
    assert payload_bytes(colls)["dp"] == 2 * m.n_params


def test_ddp_sends_twice_the_gradients():
    """Ring all-reduce: each GPU sends 2 (n-1)/n of the gradient bytes (Patarasuk & Yuan 2009)."""
    m = ModelSpec.preset("llama2-7b")
    for n in (2, 8):
        want = 2 * (n - 1) / n * 2 * m.n_params
        assert per_step_bytes(collectives(m, Plan(dp=n)))["dp"] == pytest.approx(want)


def test_zero_volumes_match_the_zero_paper():
    """ZeRO paper (Rajbhandari et al. 2020) Sec. 7: DDP's all-reduce moves 2 Psi per GPU; ZeRO-1 and ZeRO-2
    reduce-scatter the gradients (Psi) and all-gather the updated parameters (Psi): 2 Psi, "the same
    communication volume as baseline DP" (7.2); ZeRO-3 gathers the parameters in forward and again in
    backward and reduce-scatters the gradients: 3 Psi, 1.5x (7.3). So 1 : 1 : 1 : 1.5 for ZeRO 0..3, on a
    bare count (taken as block units) as on a shaped model (whose root unit is gathered once)."""
    bare = ModelSpec.from_params(8 * 10**9)                  # divisible by dp: no padding
    ddp = per_step_bytes(collectives(bare, Plan(dp=8)))["dp"]
    assert ddp == pytest.approx(2 * 7 / 8 * 2 * 8e9)           # ring all-reduce of bf16 gradients
    for zero, ratio in ((1, 1.0), (2, 1.0), (3, 1.5)):
        got = per_step_bytes(collectives(bare, Plan(dp=8, zero=zero)))["dp"]
        assert got == pytest.approx(ratio * ddp, rel=1e-12), zero
    # torch's ZeroRedundancyOptimizer under DDP all-reduces, then gathers: 1.5x, under its own name
    variant = collectives(bare, Plan(dp=8, zero=1, zero1_reduce="all_reduce"))
    assert [c.kind for c in variant] == ["all_reduce", "all_gather"]
    assert per_step_bytes(variant)["dp"] == pytest.approx(1.5 * ddp, rel=1e-12)
    # a single root unit given explicitly is gathered once (kept from forward to backward): 1x
    root = per_step_bytes(collectives(bare, Plan(dp=8, zero=3, zero_unit="root")))["dp"]
    assert root == pytest.approx(ddp, rel=1e-12)
    m = ModelSpec.preset("llama2-7b")
    n_blocks = sum(math.prod(s) for n, s in m.parameter_shapes() if n.startswith("blocks."))
    n_root = m.n_params - n_blocks
    ring = 2 * 7 / 8 * 2                                      # all-reduce factor x bf16
    for zero in (1, 2):
        got = per_step_bytes(collectives(m, Plan(dp=8, zero=zero, seq=1024)))["dp"]
        assert got == pytest.approx(ring * m.n_params, rel=1e-6), zero         # 1e-6: unit padding
    got = per_step_bytes(collectives(m, Plan(dp=8, zero=3, seq=1024)))["dp"]
    assert got == pytest.approx(ring * (1.5 * n_blocks + n_root), rel=1e-6)


def test_zero2_accumulation_variants():
    """ZeRO-2 over m micro-batches: holding the full gradients reduce-scatters once per step; keeping them
    sharded reduce-scatters every micro-batch (m times the gradient bytes). ZeRO-1 always once."""
    bare = ModelSpec.from_params(8 * 10**9)
    base = Plan(dp=8, grad_accum=4)
    rs = [c for c in collectives(bare, base.with_(zero=2)) if c.kind == "reduce_scatter"]
    assert [c.count for c in rs] == [1]
    rs = [c for c in collectives(bare, base.with_(zero=2, zero2_accumulate="sharded"))
          if c.kind == "reduce_scatter"]
    assert [(c.count, c.message_bytes) for c in rs] == [(4, 2 * 8 * 10**9)]
    assert [c.count for c in collectives(bare, base.with_(zero=1))] == [1, 1]
    with pytest.raises(ParallelLabError, match="zero2_accumulate='sharded' is a ZeRO-2 variant"):
        Plan(dp=8, zero=1, zero2_accumulate="sharded")
    with pytest.raises(ParallelLabError, match="zero1_reduce='all_reduce' is a ZeRO-1 variant"):
        Plan(dp=8, zero=2, zero1_reduce="all_reduce")
    with pytest.raises(ParallelLabError, match="zero1_reduce"):
        Plan(dp=8, zero=1, zero1_reduce="allreduce")


def test_zero3_per_block_units_and_padding():
    m = ModelSpec.preset("tiny-llama")
    dp, mb = 3, 2
    colls = collectives(m, Plan(dp=dp, zero=3, grad_accum=mb))
    block = sum(math.prod(s) for n, s in m.parameter_shapes() if n.startswith("blocks.0."))
    padded = dp * math.ceil(block / dp)
    b0 = [c for c in colls if c.note.endswith("unit blocks.0") or c.note.endswith("unit blocks.0 again")]
    assert sorted((c.kind, c.phase) for c in b0) == [("all_gather", "backward"), ("all_gather", "forward"),
                                                      ("reduce_scatter", "backward")]
    assert all(c.message_bytes == 2 * padded and c.count == mb for c in b0)
    root = [c for c in colls if "unit root" in c.note]
    assert sorted(c.kind for c in root) == ["all_gather", "reduce_scatter"]


def test_frozen_parameters_do_not_sync():
    m = ModelSpec.preset("tiny-llama")
    full = payload_bytes(collectives(m, Plan(dp=2)))["dp"]
    frozen = payload_bytes(collectives(m, Plan(dp=2), frozen=("blocks.0", "tok_emb.weight")))["dp"]
    block0 = sum(math.prod(s) for n, s in m.parameter_shapes() if n.startswith("blocks.0."))
    assert full - frozen == 2 * (block0 + 512 * 128)


# ---- tensor, sequence, pipeline and context parallelism ---------------------------------------------

def test_sp_moves_what_tp_moves_plus_regathers_and_replicated_grads():
    """Korthikanti Sec. 4.2.2: all-gather + reduce-scatter replace each all-reduce at the same volume; the
    column-parallel linears keep only their sequence shard and gather it again in backward (Megatron), one
    all-gather per region, i.e. a quarter of TP's block traffic more."""
    m = ModelSpec.preset("llama2-7b")
    tp = per_step_bytes(collectives(m, Plan(tp=8, seq=4096)))["tp"]
    sp_colls = collectives(m, Plan(tp=8, seq=4096, sp=True))
    extra = [c for c in sp_colls if c.note.startswith("SP: grads")]
    assert len(extra) == 1 and extra[0].message_bytes == 2 * (2 * 32 + 1) * 4096   # 65 RMSNorm weights, bf16
    regather = [c for c in sp_colls if c.note.startswith("SP: the saved input")]
    assert len(regather) == 1 and regather[0].count == 2 * 32 and regather[0].phase == "backward"
    assert per_step_bytes(sp_colls)["tp"] == pytest.approx(1.25 * tp + extra[0].wire_bytes)


def test_full_recompute_repeats_forward_tp_traffic():
    base = per_step_bytes(collectives(SEED_MODEL, SEED_PLAN))["tp"]
    full = per_step_bytes(collectives(SEED_MODEL, SEED_PLAN.with_(recompute="full")))["tp"]
    assert full == pytest.approx(1.5 * base)


def test_vocab_parallel_and_cross_entropy():
    colls = collectives(SEED_MODEL, SEED_PLAN)
    ce = [c for c in colls if c.note.startswith("cross-entropy")]
    assert len(ce) == 1 and ce[0].count == 3 and ce[0].message_bytes == S * 4


def test_pipeline_point_to_point_per_stage():
    m = ModelSpec.preset("llama2-7b")
    plan = Plan(pp=4, grad_accum=8, seq=2048)
    M = 2048 * 4096 * 2
    sends = {s: sum(c.count for c in collectives(m, plan, stage=s) if c.kind == "send") for s in range(4)}
    recvs = {s: sum(c.count for c in collectives(m, plan, stage=s) if c.kind == "recv") for s in range(4)}
    assert sends == {0: 8, 1: 16, 2: 16, 3: 8} and recvs == sends
    first = collectives(m, plan, stage=0)
    assert {(c.kind, c.phase) for c in first} == {("send", "forward"), ("recv", "backward")}
    assert all(c.message_bytes == M for c in first)
    assert report(m, plan).stage in (1, 2)                    # a middle stage sends the most
    inter = Plan(pp=4, grad_accum=8, seq=2048, schedule="interleaved", interleave=2)
    assert sum(c.count for c in collectives(m, inter, stage=0) if c.kind == "send") == 8 * (2 + 1)


@pytest.mark.parametrize("kind,per_layer_fwd", [("ring", 3), ("allgather", 1), ("ulysses", 2)])
def test_context_parallel_calls_per_layer(kind, per_layer_fwd):
    # K and V travel as one message (dist/context_parallel.py; tests/distributed/test_context_parallel.py traces it)
    m = ModelSpec.preset("llama3-8b")
    cp = 4
    colls = collectives(m, Plan(cp=cp, seq=8192, cp_kind=kind))
    fwd = [c for c in colls if c.dim == "cp" and c.phase == "forward" and c.kind != "recv"]
    assert sum(c.count for c in fwd) == per_layer_fwd * m.layers
    kv_block = 2 * 8192 // cp * 8 * 128 * 2                  # K and V: local tokens x kv width x bf16
    if kind == "ring":
        assert {c.message_bytes for c in colls if c.dim == "cp"} == {kv_block}
        bwd = [c for c in colls if c.dim == "cp" and c.phase == "backward" and c.kind == "send"]
        assert sum(c.count for c in bwd) == 2 * (cp - 1) * m.layers      # K/V again + dK/dV accumulators
    if kind == "allgather":
        assert {c.message_bytes for c in fwd} == {cp * kv_block}
    if kind == "ulysses":                                    # Q (32 heads) + K + V (8 kv heads), then output
        tokens = 8192 // cp
        assert sorted(c.message_bytes for c in fwd) == [tokens * 4096 * 2, tokens * (4096 + 2 * 1024) * 2]
    dp = [c for c in colls if c.dim == "dp"]
    assert dp and all(c.group_size == cp for c in dp)        # gradients sync over dp x cp


def test_placement_tiers():
    h100 = ClusterSpec.preset("h100-sxm")
    m = ModelSpec.preset("llama2-7b")
    rep = report(m, Plan(dp=2, tp=8, seq=2048), h100)
    assert rep.tiers == {"dp": "ib-400g", "tp": "nvlink4", "tp_vocab": "nvlink4"}
    assert group_ranks(Plan(dp=2, tp=8), "dp") == [0, 8]
    assert group_ranks(Plan(tp=4, cp=2, seq=2048), "cp") == [0, 4]
    rep = report(m, Plan(tp=4, pp=4, grad_accum=4, seq=2048), h100, stage=1)
    assert rep.tiers["pp"] == "ib-400g"                      # stage 1 (ranks 4-7) talks to stage 2 (8-11)


def test_payload_bytes_are_integers():
    colls = collectives(ModelSpec.preset("tiny-llama"), Plan(dp=2, tp=2, zero=1, seq=128, sp=True))
    assert all(isinstance(v, int) for v in payload_bytes(colls).values())
    assert all(isinstance(c.message_bytes, int) for c in colls)


def test_every_recompute_that_reruns_the_core_repeats_its_cp_traffic():
    """``flops.recomputed`` is the one rule: the ledger drops all-gather's kept K/V under it (the backward gathers
    them again), and comm charges that gather (op-sac included)."""
    from parallel_lab import comm, ledger_activations
    from parallel_lab.flops import recomputed
    model = ModelSpec.preset("llama3-8b")
    for recompute in ("none", "selective", "op-sac", "full"):
        plan = Plan(cp=4, seq=8192, cp_kind="allgather", recompute=recompute, attention="flash")
        again = [c for c in comm.cp_layer_collectives(model, plan) if c.note.startswith("recomputed")]
        assert bool(again) == recomputed(model, recompute)[1], recompute
        assert ("cp_gathered_kv" in ledger_activations.activation_terms(model, plan)) == (not again), recompute


# ---- all-reduce algorithms against Thakur, Rabenseifner & Gropp (2005), "Optimization of collective
# communication operations in MPICH": each expected value is the paper's closed form written out by hand

def test_all_reduce_algorithms_match_the_papers_closed_forms():
    from parallel_lab.comm_algorithms import ALL_REDUCE

    p, m, alpha, bandwidth, gamma = 8, 2**20, 10e-6, 50e9, 1e-10
    beta, lg = 1 / bandwidth, 3
    tier = LinkTier("t", bandwidth, alpha)
    paper = {
        # ring reduce-scatter (pairwise exchange) + ring all-gather: 2(p-1) a + 2 (p-1)/p m b + (p-1)/p m g
        "ring": 2 * (p - 1) * alpha + 2 * (p - 1) / p * m * beta + (p - 1) / p * m * gamma,
        # recursive doubling: lg p a + m lg p b + m lg p g
        "recursive doubling": lg * alpha + m * lg * beta + m * lg * gamma,
        # Rabenseifner: 2 lg p a + 2 (p-1)/p m b + (p-1)/p m g
        "Rabenseifner": 2 * lg * alpha + 2 * (p - 1) / p * m * beta + (p - 1) / p * m * gamma,
        # binomial reduce ceil(lg p)(a + m b + m g), then binomial broadcast ceil(lg p)(a + m b)
        "binomial tree": lg * (alpha + m * beta + m * gamma) + lg * (alpha + m * beta),
    }
    # the same, as numbers worked out on paper (microseconds)
    by_hand_us = {"ring": 268.45056, "recursive doubling": 407.48736, "Rabenseifner": 188.45056,
                  "binomial tree": 500.40192}
    for name, cost in ALL_REDUCE.items():
        got = cost(p).seconds(m, tier, gamma)
        assert got == pytest.approx(paper[name], rel=1e-12), name
        assert got * 1e6 == pytest.approx(by_hand_us[name], rel=1e-9), name


def test_ring_all_reduce_is_comm_collective_time():
    from parallel_lab.comm_algorithms import ring_all_reduce

    tier = ClusterSpec.preset("h100-sxm").inter
    for p in (2, 3, 8, 12):
        for m in (0, 1_000, 10**8):
            assert ring_all_reduce(p).seconds(m, tier) == pytest.approx(collective_time("all_reduce", m, p, tier))


def test_hierarchical_all_reduce_by_hand():
    from parallel_lab.comm_algorithms import hierarchical_all_reduce_seconds

    h100 = ClusterSpec.preset("h100-sxm")                     # NVLink 450 GB/s, 3 us; IB 50 GB/s, 10 us
    nodes, g, m = 4, 8, 10**9
    # in the node: 2 (g-1) alphas + 2 (g-1)/g m / B_nvlink; across: 2 (N-1) alphas + 2 (N-1)/N (m/g) / B_ib
    by_hand = 14 * 3e-6 + 1.75e9 / 450e9 + 6 * 10e-6 + 1.5 * 1.25e8 / 50e9
    assert hierarchical_all_reduce_seconds(m, nodes, g, h100.intra, h100.inter) == pytest.approx(by_hand, rel=1e-12)
    assert by_hand == pytest.approx(0.0077408889, rel=1e-8)   # 42 us + 3.889 ms + 60 us + 3.75 ms
    # one node: the plain ring of the node
    assert hierarchical_all_reduce_seconds(m, 1, g, h100.intra, h100.inter) == pytest.approx(
        14 * 3e-6 + 1.75e9 / 450e9)


def test_crossover_of_ring_and_tree():
    from parallel_lab.comm_algorithms import binomial_tree_all_reduce, crossover_bytes, ring_all_reduce

    tier = LinkTier("t", 50e9, 10e-6)
    # p = 4: ring 6 a + 1.5 m b, tree 4 a + 4 m b: equal at m = 2 a / (2.5 b) = 0.8 a B = 400 kB
    m = crossover_bytes(lambda x: ring_all_reduce(4).seconds(x, tier),
                        lambda x: binomial_tree_all_reduce(4).seconds(x, tier))
    assert m == pytest.approx(400_000, rel=1e-9)
    # two algorithms with the same slope never cross
    assert crossover_bytes(lambda x: 1 + x, lambda x: 2 + x) is None


def test_power_of_two_forms_refuse_other_sizes():
    from parallel_lab.comm_algorithms import rabenseifner_all_reduce, recursive_doubling_all_reduce

    for f in (rabenseifner_all_reduce, recursive_doubling_all_reduce):
        with pytest.raises(ParallelLabError, match="power of two"):
            f(6)


def test_fair_share_of_one_link_by_hand():
    from parallel_lab.comm_algorithms import fair_share_seconds

    # 1 GB and 3 GB on 50 GB/s: 25 GB/s each until the first ends (2 GB moved: 0.04 s), then the second
    # has 2 GB left at the full 50 GB/s (0.04 s more)
    assert fair_share_seconds([1e9, 3e9], 50e9) == pytest.approx([0.04, 0.08])
    # two equal transfers each take twice as long as alone; alone: bytes / bandwidth
    assert fair_share_seconds([1e9, 1e9], 50e9) == pytest.approx([0.04, 0.04])
    assert fair_share_seconds([1e9], 50e9) == pytest.approx([0.02])
