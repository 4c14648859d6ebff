"""torchtitan's own Llama 3 debug model and the lab's model, trained side by side on CPU: the same weights,
the same batches, the same optimizer; the losses of every step agree to fp32 rounding (rtol 1e-5), and so
do the gradients of the first step.

torchtitan's side is its ``llama3`` ``debugmodel`` (6 layers, dim 256, 16 heads, vocab 2048) built by its
``model_registry`` and initialised by its ``init_states``, its ``CrossEntropyLoss`` (summed, divided by the
batch's valid tokens, as its trainer calls it) and its ``OptimizersContainer`` (AdamW, ``for-loop``). The
lab's side is ``ModelSpec(flavour="llama")`` with torchtitan's weights, trained by its runtime
(``train.parallelize`` of a one-rank plan and ``Runtime.train_step``). The differences found, and how each is
handled (none changes a lab default):

* rotary pairs: torchtitan rotates interleaved pairs ``(2i, 2i+1)`` (complex numbers), the lab the halves
  ``(i, i + d/2)``: wq and wk rows are permuted per head (even rows, then odd ones, as Hugging Face's Llama
  conversion does); q.k is unchanged since q and k move alike, and gradients map by the same permutation.
* rotary base 500000 and Llama 3.1's frequency scaling (factor 8 beyond wavelength 8192): the lab's
  ``ModelSpec.rope_theta=500000, rope_scaling="llama3"`` (defaults 10000, "none"). At torchtitan's
  initialisation attention is nearly uniform, so the losses barely see the rotary choices (without the
  scaling they move by 1e-6) but the gradients do (wk off by 1.5%; unpermuted rows: wq off by 166%).
* fused ``wqkv`` (rows grouped per key/value head): split into wq, wk, wv by torchtitan's own state-dict hook.
* attention: torchtitan's flex attention has no backward on CPU; its ``ScaledDotProductAttention`` (causal,
  what its graph_trainer tests use) replaces it, the same mask for unpacked sequences.
* loss: torchtitan sums and divides by the token count, the lab takes the mean: equal up to rounding.
* names: tok_embeddings, attention_norm / ffn_norm, w1 / w3 / w2, norm, lm_head are the lab's tok_emb,
  attn_norm / mlp_norm, gate / up / down, final_norm, lm_head. Same: RMSNorm eps 1e-5, SwiGLU width 768
  (2/3 of 4h rounded up to 256), no biases, untied head. Initialisation is torchtitan's (copied).
* optimizer: AdamW with the lab's hyper-parameters (``model.ADAMW``) on both sides; no gradient clipping and
  no learning-rate schedule (torchtitan's trainer clips at 1.0 and warms up: the lab has neither).
"""

from __future__ import annotations

import torch

from parallel_lab.distributed.instruments.tracer import CommTracer
from parallel_lab.distributed.model.data import synthetic_batch
from parallel_lab.distributed.model.model import ADAMW, build_model, load_full_weights, rope_frequencies
from parallel_lab.distributed.runtime.grid import Grid
from parallel_lab.distributed.runtime.train import parallelize
from parallel_lab.specs import ModelSpec, Plan

STEPS = 4
PLAN = Plan(micro_batch=4, seq=64, optimizer="adam-fp32", dtype="fp32")


def titan_model() -> torch.nn.Module:
    """torchtitan's llama3 debugmodel, causal SDPA attention, its own initialisation (seed 0)."""
    from torchtitan.models.common.attention import ScaledDotProductAttention
    from torchtitan.models.llama3 import model_registry

    config = model_registry("debugmodel").model
    for layer in config.layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    torch.manual_seed(0)
    model = config.build()
    model.init_states()
    return model.train()


def lab_spec(model: torch.nn.Module) -> ModelSpec:
    """The lab's spec of torchtitan's model; its rotary frequencies checked against torchtitan's own cache."""
    attn, ffn = model.layers["0"].attention, model.layers["0"].feed_forward
    rope = attn.rope.config
    assert (rope.scaling, rope.scaling_factor, rope.low_freq_factor, rope.high_freq_factor,
            rope.original_max_position_embeddings) == ("llama", 8.0, 1.0, 4.0, 8192)
    assert model.norm.eps == 1e-5 and not model.enable_weight_tying
    freqs = torch.angle(attn.rope.cache[1]).double()                         # position 1: the frequencies
    torch.testing.assert_close(freqs, rope_frequencies(attn.head_dim, rope.theta, "llama3"), rtol=1e-6, atol=0)
    return ModelSpec(layers=len(model.layers), hidden=model.norm.weight.numel(), heads=attn.n_heads,
                     kv_heads=attn.n_kv_heads, ffn=ffn.w1.out_features, vocab=model.lm_head.out_features,
                     flavour="llama", rope_theta=float(rope.theta), rope_scaling="llama3", name="titan-debugmodel")


def stock_layout(model: torch.nn.Module, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Parameters (or their gradients) by torchtitan name, fused wqkv split by its own state-dict hook."""
    from torchtitan.models.common.attention import FusedQKVLinear

    out = dict(tensors)
    for i, layer in model.layers.items():
        qkv = layer.attention.qkv_linear
        FusedQKVLinear._split_qkv_on_save(qkv, out, f"layers.{i}.attention.qkv_linear.", None)
    return out


def interleaved_to_halves(w: torch.Tensor, head_dim: int) -> torch.Tensor:
    """Rows of a q or k projection: per head, the even rows then the odd ones (rope pairs (2i, 2i+1) -> (i, i+d/2))."""
    heads = w.shape[0] // head_dim
    return w.view(heads, head_dim // 2, 2, -1).transpose(1, 2).reshape(w.shape)


def to_lab(spec: ModelSpec, t: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """torchtitan's stock names and rope layout -> the lab's ``parameter_shapes()`` names."""
    out = {"tok_emb.weight": t["tok_embeddings.weight"], "final_norm.weight": t["norm.weight"],
           "lm_head.weight": t["lm_head.weight"]}
    names = {"attn_norm": "attention_norm", "mlp_norm": "ffn_norm", "attn.wv": "attention.qkv_linear.wv",
             "attn.wo": "attention.wo", "mlp.gate": "feed_forward.w1", "mlp.up": "feed_forward.w3",
             "mlp.down": "feed_forward.w2"}
    for i in range(spec.layers):
        for lab, titan in names.items():
            out[f"blocks.{i}.{lab}.weight"] = t[f"layers.{i}.{titan}.weight"]
        for x in ("q", "k"):
            w = t[f"layers.{i}.attention.qkv_linear.w{x}.weight"]
            out[f"blocks.{i}.attn.w{x}.weight"] = interleaved_to_halves(w, spec.head_dim)
    return {n: out[n] for n, _ in spec.parameter_shapes()}         # the lab's order; a missing name raises


def run_titan(model: torch.nn.Module, spec: ModelSpec) -> tuple[list[float], dict[str, torch.Tensor]]:
    from torchtitan.components.loss import CrossEntropyLoss
    from torchtitan.components.optimizer.optimizer import default_adamw

    loss_fn = CrossEntropyLoss.Config().build()
    config = default_adamw(**ADAMW)
    config.implementation = "for-loop"
    opt = config.build(model_parts=[model])
    losses, grads = [], {}
    for step in range(STEPS):
        batch = synthetic_batch(spec, PLAN, step)
        opt.zero_grad()
        loss, _ = loss_fn(model(batch.tokens), batch.targets, torch.tensor(batch.n_tokens))
        loss.backward()
        if step == 0:
            grads = stock_layout(model, {n: p.grad.clone() for n, p in model.named_parameters()})
        opt.step()
        losses.append(loss.item())
    return losses, grads


def run_lab(spec: ModelSpec, weights: dict[str, torch.Tensor]) -> tuple[list[float], dict[str, torch.Tensor]]:
    model = build_model(spec)
    load_full_weights(model, weights)
    rt = parallelize(model, Grid.create(PLAN, 0), PLAN, CommTracer(0, {}), meter=False)
    losses, grads = [], {}

    def keep() -> None:
        if not grads:
            grads.update({n: p.grad.clone() for n, p in model.named_parameters()})

    for step in range(STEPS):
        losses.append(rt.train_step(rt.micro_batches(synthetic_batch(spec, PLAN, step)), before_step=keep))
    return losses, grads


def test_lab_model_trains_as_torchtitans_llama3_debugmodel():
    import torchtitan  # noqa: F401  (the titan extra; a missing one fails here, it is not skipped)

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        titan = titan_model()
        spec = lab_spec(titan)
        weights = to_lab(spec, stock_layout(titan, {n: p.detach().clone() for n, p in titan.named_parameters()}))
        lab_losses, lab_grads = run_lab(spec, weights)
        titan_losses, titan_grads = run_titan(titan, spec)
    finally:
        torch.set_num_threads(threads)
    assert len(set(titan_losses)) == STEPS and titan_losses[-1] < titan_losses[0] - 0.1, titan_losses
    torch.testing.assert_close(lab_losses, titan_losses, rtol=1e-5, atol=0)
    titan_grads = to_lab(spec, titan_grads)
    err = {n: float((g - titan_grads[n]).abs().max() / titan_grads[n].abs().max()) for n, g in lab_grads.items()}
    worst = max(err, key=err.get)
    assert err[worst] < 1e-5, f"step 1 gradient of {worst}: max|lab - titan| / max|titan| = {err[worst]:.2e}"
