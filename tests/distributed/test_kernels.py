"""The fused kernels (distributed/model/kernels.py): the same numbers as the eager ops, and exactly the saved
bytes that ``parallel_lab.activations`` predicts for ``Plan.attention`` / ``Plan.mlp``."""

from __future__ import annotations

import itertools

import pytest

torch = pytest.importorskip("torch")

from parallel_lab import activations, ledger_activations  # noqa: E402
from parallel_lab.distributed.instruments.saved import SavedTensorMeter  # noqa: E402
from parallel_lab.distributed.model.data import synthetic_batch  # noqa: E402
from parallel_lab.distributed.model.model import build_model, loss_fn  # noqa: E402
from parallel_lab.errors import ParallelLabError  # noqa: E402
from parallel_lab.specs import ModelSpec, Plan  # noqa: E402

CASES = [(name, att, mlp, rec) for name, att, mlp, rec in itertools.product(
    ("tiny-llama", "tiny-gpt"), ("eager", "flash"), ("eager", "fused"), ("none", "selective", "op-sac"))
    if (att, mlp, rec) != ("eager", "eager", "none") and (rec != "op-sac" or att == "eager")]


def _saved(name: str, plan: Plan, dtype=torch.float32):
    spec = ModelSpec.preset(name).with_(layers=3, dropout=0.0)
    model = build_model(spec, recompute=plan.recompute, attention=plan.attention, mlp=plan.mlp,
                        loss_chunk=plan.loss_chunk).to(dtype)
    batch = synthetic_batch(spec, plan, 0)
    meter = SavedTensorMeter(model)
    with meter:
        loss = loss_fn(model(batch.tokens, batch.positions), batch.targets)
    return spec, model, batch, meter, loss


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name, attention, mlp, recompute", CASES)
def test_fp32_saved_bytes_equal_the_per_op_model_and_gradients_equal_eager(name, attention, mlp, recompute):
    plan = Plan(micro_batch=2, seq=48, dtype="fp32", recompute=recompute, attention=attention, mlp=mlp)
    spec, model, batch, meter, loss = _saved(name, plan)
    pred = activations.per_op_bytes(spec, plan)
    assert meter.forward_bytes["blocks.1"] == pred["per_block_bytes"]
    assert meter.live["activations"] == pred["activations"]
    assert meter.live["logits_and_loss"] == pred["logits_and_loss"]
    loss.backward()
    assert meter.live_total == 0
    ref = build_model(spec)
    ref_loss = loss_fn(ref(batch.tokens, batch.positions), batch.targets)
    ref_loss.backward()
    assert abs(loss.item() - ref_loss.item()) < 1e-5
    for (n, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-6, msg=n)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", ["tiny-llama", "tiny-gpt"])
def test_bf16_within_one_percent_and_exact_with_cpu_norm_statistics(name):
    plan = Plan(micro_batch=2, seq=32, dtype="bf16", attention="flash", mlp="fused")
    spec, _model, _batch, meter, _graph = _saved(name, plan, torch.bfloat16)
    exact = activations.per_op_bytes(spec, plan, ln_stats_bytes=2)
    gpu = activations.per_op_bytes(spec, plan)
    assert meter.live["activations"] == exact["activations"]
    assert abs(meter.live["activations"] - gpu["activations"]) <= 0.01 * gpu["activations"]


def test_flash_drops_korthikantis_score_term_and_keeps_an_fp32_log_sum_exp():
    """Seed shape (s=4096, h=4096, a=32, gpt, bf16, dropout 0.1 replaced by 0 so flash applies)."""
    spec = ModelSpec(layers=32, hidden=4096, heads=32, flavour="gpt", dropout=0.0)
    s, h, a = 4096, 4096, 32
    eager = ledger_activations.activation_bytes_per_layer(spec, Plan(seq=s))
    flash = ledger_activations.activation_bytes_per_layer(spec, Plan(seq=s, attention="flash"))
    assert eager == s * h * 32 + 2 * a * s * s              # no masks without dropout: 32 sbh + 2 a s^2
    assert flash == s * h * 32 + 4 * a * s                  # the score term becomes a s fp32 values
    fused = ledger_activations.activation_bytes_per_layer(spec, Plan(seq=s, attention="flash", mlp="fused"))
    assert flash - fused == s * 4 * h * 2                   # GeLU's output (f = 4h, 2 bytes) is not kept


def test_fused_swiglu_keeps_two_of_four_ffn_tensors():
    spec = ModelSpec.preset("llama2-7b")
    plan = Plan(seq=4096, dtype="bf16")
    eager = ledger_activations.activation_terms(spec, plan)["mlp_intermediate"]
    fused = ledger_activations.activation_terms(spec, plan.with_(mlp="fused"))["mlp_intermediate"]
    assert eager == 4096 * 11008 * 4 * 2 and fused == eager / 2


def test_flash_refuses_attention_dropout():
    with pytest.raises(ParallelLabError, match="attention='flash'"):
        Plan(attention="flash").validate(ModelSpec.preset("tiny-gpt").with_(dropout=0.1))
    with pytest.raises(ParallelLabError, match="pick eager or flash"):
        build_model(ModelSpec.preset("tiny-llama"), attention="sdpa")


def test_op_sac_keeps_every_second_matmul_output_of_a_llama_block():
    """torchtitan's policy on a bias-free llama block: wq, wv, gate and down outputs plus the block input."""
    spec = ModelSpec.preset("llama3-8b")
    s, h, f, kv = 8192, 4096, 14336, 1024
    terms = ledger_activations.activation_terms(spec, Plan(seq=s, recompute="op-sac"))
    assert terms == {"layer_input": s * h * 2, "kept_matmul_outputs": s * (h + kv + f + h) * 2}
    per_op = activations.per_op_bytes(spec, Plan(seq=s, recompute="op-sac"))["per_block_bytes"]
    assert per_op == sum(terms.values())


def test_op_sac_with_tensor_parallelism_is_refused_before_launch():
    from parallel_lab.distributed.runtime.train import check_runnable

    with pytest.raises(ParallelLabError, match="op-sac"):
        check_runnable(ModelSpec.preset("tiny-llama"), Plan(tp=2, dtype="fp32", optimizer="adam-fp32",
                                                            recompute="op-sac", seq=64))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name, chunk", [("tiny-llama", 16), ("tiny-gpt", 100)])
def test_chunked_cross_entropy_saves_no_logits_and_matches_eager(name, chunk):
    """The head's saved bytes against the per-op model, and the loss and gradients against eager."""
    plan = Plan(micro_batch=2, seq=48, dtype="fp32", loss_chunk=chunk)
    spec, model, batch, meter, loss = _saved(name, plan)
    pred = activations.per_op_bytes(spec, plan)
    assert meter.live["logits_and_loss"] == pred["logits_and_loss"]
    eager = activations.per_op_bytes(spec, plan.with_(loss_chunk=0))["logits_and_loss"]
    rows = 2 * 48
    assert eager - pred["logits_and_loss"] == rows * spec.vocab * 4 + 4 - rows * 4   # log-probs + weight - lse
    loss.backward()
    assert meter.live_total == 0
    ref = build_model(spec)
    ref_loss = loss_fn(ref(batch.tokens, batch.positions), batch.targets)
    ref_loss.backward()
    assert abs(loss.item() - ref_loss.item()) < 1e-5
    for (n, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-6, msg=n)


def test_chunked_cross_entropy_in_the_ledger_removes_the_128k_vocabulary_logits():
    spec = ModelSpec.preset("llama3-8b")
    plan = Plan(seq=8192, dtype="bf16")
    eager = ledger_activations.logits_bytes(spec, plan)
    chunked = ledger_activations.logits_bytes(spec, plan.with_(loss_chunk=1024))
    # the fp32 log-probabilities (4.2 GB) and the final norm's and head's bf16 inputs; the bf16 logits themselves
    # are not kept (measured at full size in fake tensors, tests/distributed/test_measure.py)
    assert eager == 8192 * (128256 * 4 + 2 * 4096 * 2)
    assert chunked == 8192 * (4 + 2 * 4096 * 2)                # one fp32 log-sum-exp per token, the same inputs


# ---- the blockwise kernel in fake tensors: a few representative tile pairs, the loop's peak ----------------

def _fake_flash_peaks(b, heads, g, s, d, tile, causal, docs, dtype, chunk=None):
    """Forward and backward of ``FlashAttention`` on fake tensors inside torch's MemTracker (as
    ``parallel-lab memory --measure`` runs it): each phase's peak snapshot, the saved bytes, the ops run."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.mem_tracker import MemTracker
    from torch.utils._python_dispatch import TorchDispatchMode

    from parallel_lab.distributed.context_parallel.blockwise_attention import Tokens
    from parallel_lab.distributed.instruments.measure import _ValuesOfTheBatch
    from parallel_lab.distributed.model.kernels import FlashAttention

    class Ops(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Ops.n += 1
            return func(*args, **(kwargs or {}))

    doc_ids = None
    if docs:                                     # real document ids: 2-4 documents per row, cut differently
        doc_ids = torch.zeros(b, s, dtype=torch.long)
        for i in range(b):
            for c in sorted({(7 * (i + 1) * j) % s for j in range(1, 4)}):
                doc_ids[i, c:] += 1
    toks = Tokens.of(torch.arange(s), doc_ids, tile, chunk)
    with FakeTensorMode(allow_non_fake_inputs=True):
        q = torch.randn(b, s, heads, d, dtype=dtype).transpose(1, 2).requires_grad_()   # the model's layouts
        k, v = (torch.randn(b, s, g, d, dtype=dtype).transpose(1, 2).requires_grad_() for _ in range(2))
        with MemTracker() as fwd, _ValuesOfTheBatch(), Ops():
            out = FlashAttention.apply(q, k, v, toks, causal)
        saved = sum(t.untyped_storage().nbytes() for t in out.grad_fn.saved_tensors)
        with MemTracker() as bwd, _ValuesOfTheBatch(), Ops():
            out.backward(torch.randn(b, heads, s, d, dtype=dtype))
    return fwd.get_tracker_snapshot("peak"), bwd.get_tracker_snapshot("peak"), saved, Ops.n


FAKE_SHAPES = {       # small head_dim: a tile pair's scores outweigh q, k, v, so the loop sets the peak
    "causal": dict(b=1, heads=4, g=2, s=64, d=4, tile=16, causal=True, docs=False, dtype=torch.float32),
    "ragged-bf16": dict(b=2, heads=4, g=2, s=70, d=4, tile=16, causal=True, docs=False, dtype=torch.bfloat16),
    "chunks": dict(b=1, heads=4, g=2, s=64, d=4, tile=16, causal=True, docs=False, dtype=torch.float32,
                   chunk=24),
    "full-mqa": dict(b=2, heads=4, g=1, s=70, d=4, tile=16, causal=False, docs=False, dtype=torch.float32),
    "documents": dict(b=2, heads=6, g=3, s=90, d=2, tile=16, causal=True, docs=True, dtype=torch.bfloat16),
    "documents-full": dict(b=2, heads=6, g=3, s=90, d=2, tile=16, causal=False, docs=True, dtype=torch.float32),
}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("shape", list(FAKE_SHAPES))
def test_fake_tensor_replay_has_the_tile_loops_peak_byte_for_byte(shape, monkeypatch):
    """``blockwise_replay``: in fake tensors the kernel runs a few tile pairs; torch's tracker sees the same
    peak (every category) in forward and in backward as with every pair, and the same saved bytes. Without
    the pairs the peak is lower, so here the pairs set it and the comparison can fail."""
    from parallel_lab.distributed.context_parallel import blockwise_attention

    replay = _fake_flash_peaks(**FAKE_SHAPES[shape])
    monkeypatch.setattr(blockwise_attention, "REPLAY_FAKE", False)
    loop = _fake_flash_peaks(**FAKE_SHAPES[shape])
    assert replay[:3] == loop[:3]
    assert replay[3] < loop[3]                                       # fewer ops
    monkeypatch.setattr(blockwise_attention, "REPLAY_FAKE", True)
    monkeypatch.setattr(blockwise_attention, "replay_runs", lambda *a, **k: [])
    none = _fake_flash_peaks(**FAKE_SHAPES[shape])
    cpu = torch.device("cpu")
    assert none[0][cpu]["Total"] < loop[0][cpu]["Total"] and none[1][cpu]["Total"] < loop[1][cpu]["Total"]


def test_the_replay_runs_three_tile_pairs_at_any_causal_length():
    """Uniform causal tiles: the first (masked) pair, a hidden one, then a visible and a masked pair after
    the last scores: 3 computed pairs instead of n (n + 1) / 2; the stats count the full loop's pairs."""
    from parallel_lab.distributed.context_parallel.blockwise_attention import KernelStats, Tokens, tile_mask
    from parallel_lab.distributed.context_parallel.blockwise_replay import replay_runs

    for s in (2048, 8192, 131072):
        toks, stats = Tokens.of(torch.arange(s), None, 256), KernelStats()
        runs = replay_runs(toks, toks, True, tile_mask, 2, stats)
        n = s // 256
        pairs = [[(qt.start, kt.start) for qt, kt in run] for run in runs]
        assert pairs == [[(0, 0), (0, s - 256), (256, 0), (256, 256)]]     # masked, hidden, visible, masked
        assert stats == KernelStats(n * (n + 1) // 2, n * (n - 1) // 2, 2 * 256 * 256 * n * (n + 1) // 2)


#: attention's backward sets this model's measured peak (a 256-token vocabulary, 32 heads)
ATTENTION_PEAK = ModelSpec(layers=2, hidden=512, heads=32, kv_heads=8, ffn=512, vocab=256, flavour="llama",
                           name="attention-peak")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("plan", [
    Plan(seq=1024, optimizer="adam-mixed", dtype="bf16", attention="flash"),
    Plan(seq=2048, dp=2, zero=3, optimizer="fsdp2-mixed", dtype="bf16", attention="flash", mlp="fused",
         recompute="selective", loss_chunk=256),
    Plan(seq=2048, cp=2, cp_kind="ring", optimizer="adam-mixed", dtype="bf16")], ids=["flash", "all", "ring"])
def test_measure_with_the_replay_equals_measure_with_every_tile_pair(plan, monkeypatch):
    """``parallel-lab memory --measure`` of a small plan, the kernel's replay against its full loop forced on
    the fake tensors: every measured category, torch's categories at the peak, its activations and the
    comm buffers are equal to the byte."""
    from parallel_lab.distributed.context_parallel import blockwise_attention
    from parallel_lab.distributed.instruments.measure import measure_stage

    def measured():
        m = measure_stage(ATTENTION_PEAK, plan)
        return m.measured, m.tracker_peak, m.tracker_activations, m.comm_parts

    replay = measured()
    monkeypatch.setattr(blockwise_attention, "REPLAY_FAKE", False)
    assert replay == measured()
    if plan.cp == 1 and plan.mlp == "eager":                          # and the kernel's pairs set the peak
        monkeypatch.setattr(blockwise_attention, "REPLAY_FAKE", True)
        monkeypatch.setattr(blockwise_attention, "replay_runs", lambda *a, **k: [])
        assert measured()[0]["peak"] < replay[0]["peak"]
