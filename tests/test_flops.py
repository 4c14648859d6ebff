"""FLOPs per step against published formulas, the Llama 3 paper, and torch's FLOP counter."""

from __future__ import annotations

import pytest

from parallel_lab.errors import ParallelLabError
from parallel_lab.flops import mfu, step_flops
from parallel_lab.hardware import ClusterSpec
from parallel_lab.specs import ModelSpec, Plan


def test_llama3_405b_training_flops():
    """Llama 3 paper: 405B parameters trained on 15.6T tokens, 'about 3.8e25 FLOPs' (= 6 N D)."""
    m = ModelSpec.preset("llama3-405b")
    assert 6 * m.n_params * 15.6e12 == pytest.approx(3.8e25, rel=0.01)
    # Per token at 8K context our model FLOPs add the attention products and drop the embedding look-up:
    plan = Plan(dp=128, tp=8, pp=16, grad_accum=16, seq=8192)
    rep = step_flops(m, plan)
    assert rep.tokens_per_step == 16 * 128 * 8192                    # Llama 3: 16M tokens per step at 8K
    ratio = rep.model_flops_per_step / (6 * m.n_params * rep.tokens_per_step)
    assert 1.05 < ratio < 1.10


@pytest.mark.parametrize("name", ["gpt3-175b", "megatron-22b", "megatron-530b", "megatron-1t"])
def test_narayanan_formulas_for_gpt_blocks(name):
    """Narayanan et al. 2021 (Megatron-LM at scale), eq. (3): a step of B sequences costs
    72 B s L h^2 (1 + s/(6h) + V/(12 h L)) model FLOPs, and 96 B s L h^2 (1 + s/(6h) + V/(16 h L)) with
    full activation recomputation (one more forward of the blocks)."""
    m = ModelSpec.preset(name)
    s, L, h, V, B = 2048, m.layers, m.hidden, m.vocab, 8
    plan = Plan(seq=s, micro_batch=2, grad_accum=4)
    model = 72 * B * s * L * h**2 * (1 + s / (6 * h) + V / (12 * h * L))
    hardware = 96 * B * s * L * h**2 * (1 + s / (6 * h) + V / (16 * h * L))
    assert step_flops(m, plan).model_flops_per_step == pytest.approx(model, rel=1e-12)
    full = step_flops(m, plan.with_(recompute="full"))
    assert full.hardware_flops_per_step == pytest.approx(hardware, rel=1e-12)
    sel = step_flops(m, plan.with_(recompute="selective"))
    assert sel.hardware_flops_per_step == pytest.approx(model + 4 * B * s * s * h * L, rel=1e-12)
    assert sel.model_flops_per_step == step_flops(m, plan).model_flops_per_step


def test_flops_do_not_depend_on_the_split():
    m = ModelSpec.preset("llama2-7b")
    one = step_flops(m, Plan(seq=4096, grad_accum=16)).model_flops_per_step
    split = step_flops(m, Plan(seq=4096, dp=2, tp=4, pp=2, grad_accum=8)).model_flops_per_step
    assert one == split


def test_llama3_table4_tflops_and_mfu():
    """Llama 3 paper, Table 4: 400 TFLOPs/GPU is 41% BF16 MFU on H100 (peak 989 TFLOP/s dense bf16);
    430 -> 43%, 380 -> 38% (the paper rounds its measured numbers)."""
    m = ModelSpec.preset("llama3-405b")
    plan = Plan(dp=128, tp=8, pp=16, grad_accum=16, seq=8192)
    h100 = ClusterSpec.preset("h100-sxm")
    flops = step_flops(m, plan).model_flops_per_step
    for tflops, pct in ((430, 43), (400, 41), (380, 38)):
        step_time = flops / (plan.world * tflops * 1e12)
        assert abs(100 * mfu(m, plan, step_time, h100) - pct) <= 1.0
    with pytest.raises(ParallelLabError):
        mfu(m, plan, 0.0, h100)


def test_matches_torch_flop_counter():
    """Measured: torch's FlopCounterMode over forward + backward of a small Llama-style model (explicit
    attention matmuls) agrees with 6 N T + 12 L d S T (shared/reference/torch_cpu_notes.md: within 0.1%)."""
    torch = pytest.importorskip("torch")
    from torch.utils.flop_counter import FlopCounterMode

    spec = ModelSpec(layers=2, hidden=64, heads=4, kv_heads=2, ffn=96, vocab=128, flavour="llama")
    b, s = 2, 32
    torch.manual_seed(0)
    nn = torch.nn
    hd, kv = spec.head_dim, spec.kv_dim

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.wq, self.wk = nn.Linear(64, 64, bias=False), nn.Linear(64, kv, bias=False)
            self.wv, self.wo = nn.Linear(64, kv, bias=False), nn.Linear(64, 64, bias=False)
            self.gate, self.up = nn.Linear(64, 96, bias=False), nn.Linear(64, 96, bias=False)
            self.down = nn.Linear(96, 64, bias=False)

        def forward(self, x):
            q = self.wq(x).view(b, s, 4, hd).transpose(1, 2)
            k = self.wk(x).view(b, s, 2, hd).transpose(1, 2).repeat_interleave(2, dim=1)
            v = self.wv(x).view(b, s, 2, hd).transpose(1, 2).repeat_interleave(2, dim=1)
            mask = torch.ones(s, s, dtype=torch.bool).tril()
            p = (q @ k.transpose(-1, -2) / hd**0.5).masked_fill(~mask, float("-inf")).softmax(-1)
            x = x + self.wo((p @ v).transpose(1, 2).reshape(b, s, 64))
            return x + self.down(torch.nn.functional.silu(self.gate(x)) * self.up(x))

    emb, head = nn.Embedding(128, 64), nn.Linear(64, 128, bias=False)
    blocks = nn.ModuleList([Block(), Block()])
    tokens = torch.randint(0, 128, (b, s))
    with FlopCounterMode(display=False) as counter:
        x = emb(tokens)
        for blk in blocks:
            x = blk(x)
        loss = torch.nn.functional.cross_entropy(head(x).flatten(0, 1), tokens.flatten())
        loss.backward()
    measured = counter.get_total_flops()
    predicted = step_flops(spec, Plan(seq=s, micro_batch=b)).model_flops_per_step
    assert measured == pytest.approx(predicted, rel=1e-3), (measured, predicted)


def test_causal_convention_counts_the_pairs_the_runnable_mask_leaves():
    """The causal convention's (s + 1) / 2 keys per query: the zeros of the model's own causal mask."""
    torch = pytest.importorskip("torch")
    from parallel_lab.distributed.model.model import make_context
    from parallel_lab.flops import attention_keys, flops_per_token

    s = 96
    bias = make_context(torch.arange(s)).mask_bias(torch.float32)
    visible = int((bias == 0).sum())
    assert visible == s * (s + 1) // 2 == attention_keys(s, "causal") * s
    m = ModelSpec.preset("llama3-405b")
    q, L = m.heads * m.head_dim, m.layers
    assert flops_per_token(m, 8192) - flops_per_token(m, 8192, "causal") == 12 * L * q * (8192 - 8193 / 2)
    rep = step_flops(m, Plan(seq=8192, dp=128, tp=8, pp=16, grad_accum=16))
    assert rep.model_flops_causal_per_step / rep.model_flops_per_step == pytest.approx(0.9614, abs=1e-4)
