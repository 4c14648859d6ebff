"""The memory-bound work of a step: bytes its elementwise ops move through HBM, at the GPU's bandwidth.

    t_mem = bytes / (hbm_bandwidth * hbm_efficiency)

Per block and micro-batch on one rank, the forward reads and writes (``a`` bytes an element, shapes from
``activations.local_dims``: ``s_n`` tokens of the norm/residual region, SP's ``s / tp``; ``s`` of the rest):
two norms ``2 x 2h``, two residual adds ``2 x 3h`` (+ a 1-byte dropout mask each when the model has dropout),
the activation (gelu ``2 ffn``, SwiGLU product ``3 ffn``), rotary ``2 (heads + kv_heads) d``, and an eager
attention core's softmax ``2 heads s`` per token (+ dropout ``2 heads s`` and a mask); a fused core keeps
them on chip. Backward moves twice the forward (grad in, saved input, grad out); recomputation adds the
forward again (``selective``: the core's part only). The last stage adds the final norm and the fp32
cross-entropy over its ``V / tp`` logits (``a + 4`` forward, ``4 + a`` backward). The optimizer step reads
the gradient and the optimizer state and writes the state and the parameter
(``grad + 2 optim + param`` bytes a parameter, ``optimizers.OPTIMIZERS``), on the stage's GEMM parameters,
sharded by ZeRO over ``dp * cp``. Derivation and sources: docs/step_time.md, "Memory-bound work".
"""

from __future__ import annotations

from functools import lru_cache

from . import sharding
from .activations import local_dims
from .flops import matmul_params
from .optimizers import OPTIMIZERS
from .specs import ModelSpec, Plan

LOSS_FP32 = 4        #: the cross-entropy upcasts the logits to fp32 (as ``activations.LOSS_BYTES``)
BACKWARD_OVER_FORWARD = 2.0   #: an elementwise op's backward reads its saved input and the grad, writes a grad


@lru_cache(maxsize=4096)
def block_forward_bytes(model: ModelSpec, seq: int, tp: int, cp: int, sp: bool, mb: int, attention: str,
                        dtype_bytes: int = 2) -> tuple[float, float]:
    """(all, the attention core's part) bytes the forward's memory-bound ops of one block move for one
    micro-batch on one rank (module docstring)."""
    t = local_dims(model, Plan(tp=tp, cp=cp, sp=sp, seq=seq, micro_batch=mb))
    a, drop = dtype_bytes, model.dropout > 0
    region = t.b * t.s_n * (2 * 2 * t.h * a + 2 * 3 * t.h * a + (2 * t.h if drop else 0))   # norms, adds, masks
    act = (2 if model.flavour == "gpt" else 3) * t.b * t.s * t.ffn * a
    rope = 2 * (t.heads + t.kv_heads) * t.d * a * t.b * t.s if model.flavour == "llama" else 0
    core = 0.0
    if attention != "flash" and cp == 1:      # eager core: the probabilities go through HBM
        probs = t.b * t.heads * t.s * t.s
        core = 2 * probs * a + ((2 * a + 1) * probs if drop else 0)
    return region + act + rope + core, core


def block_bytes(model: ModelSpec, seq: int, tp: int, cp: int, sp: bool, mb: int, recompute: str,
                attention: str, dtype_bytes: int = 2) -> float:
    """Forward, backward and recomputed bytes of one block for one micro-batch on one rank."""
    fwd, core = block_forward_bytes(model, seq, tp, cp, sp, mb, attention, dtype_bytes)
    again = {"none": 0.0, "selective": core}.get(recompute, fwd)
    return (1 + BACKWARD_OVER_FORWARD) * fwd + again


def head_bytes(model: ModelSpec, seq: int, tp: int, cp: int, sp: bool, mb: int, dtype_bytes: int = 2) -> float:
    """The last stage's final norm and cross-entropy over its vocabulary shard, forward and backward."""
    t = local_dims(model, Plan(tp=tp, cp=cp, sp=sp, seq=seq, micro_batch=mb))
    a = dtype_bytes
    vocab = sharding.vocab_local(model, tp)
    norm = 2 * t.h * a * t.b * t.s_n
    loss = 2 * (a + LOSS_FP32) * vocab * t.b * t.s
    return (1 + BACKWARD_OVER_FORWARD) * norm + loss


def optimizer_bytes(model: ModelSpec, optimizer: str, tp: int, n_layers: int, last: bool, shards: int) -> float:
    """Bytes of one optimizer step on one rank: the stage's GEMM parameters (``n_layers`` blocks, the head on
    the last stage) over ``tp``, over ``shards`` (ZeRO's ``dp * cp``, 1 without ZeRO), times
    ``grad + 2 optim + param`` bytes a parameter."""
    o = OPTIMIZERS[optimizer]
    n_blocks, n_head = matmul_params(model)
    params = (n_blocks * n_layers / model.layers + (n_head if last else 0)) / tp / shards
    return params * (o.grad_bytes + 2 * o.optim_bytes + o.param_bytes)
