"""Exercise predict_activations (predict): the activation memory of a transformer block.

Korthikanti et al. 2022 count what a GPT block (LayerNorm, multi-head attention with ``a`` heads, a GeLU
MLP of width ``4h``, dropout) saves for backward per micro-batch: ``s b h (34 + 5 a s / h)`` bytes with
2-byte activations and 1-byte dropout masks. Generalised to ``d`` bytes per element, term by term (every
activation ``d`` bytes, every mask 1 byte; ``t`` the TP degree):

* the two LayerNorms' inputs, ``2 s b h``; attention's input ``s b h``; Q, K, V ``3 s b h / t``; the
  output projection's input ``s b h / t``; the dropout mask after attention (``s b h`` bytes, 1 per element);
* the MLP's input ``s b h``; its two ``4 h`` intermediates (GeLU's input and output) ``8 s b h / t``; the
  dropout mask after the MLP;
* the attention scores: the softmax output ``a s^2 b / t`` elements, and with dropout its output (``d``)
  and its mask (1 byte) as many again.

Without dropout the masks and the dropout output are absent. TP splits only what lies inside the
parallel regions (Q, K, V, the projection's input, the MLP intermediates, the scores); sequence
parallelism (``sp``) also splits the rest by ``t``. Selective recomputation drops the score terms; full
recomputation keeps only the block's input, ``s b h d`` (split by ``t`` with SP).

Implement ``activations_per_layer(s, b, h, a, t=1, sp=False, recompute="none", d=2, dropout=True)`` in
bytes. Graded: the seed's number (32 layers at s=4096, b=1, h=4096, a=32: 104,152,956,928 bytes); against
``parallel_lab.ledger`` (relative 1e-9) over TP, SP, recomputation, dtypes and dropout; against the bytes
torch saves for backward in a real step of a small GPT (fp32, no dropout) within 2% (the embedding's
output and the positions are saved too and are not in your per-layer count).
Check: ``parallel-lab grade predict_activations exercises/predict_activations/starter.py``.
"""

from __future__ import annotations


def activations_per_layer(s: int, b: int, h: int, a: int, t: int = 1, sp: bool = False, recompute: str = "none",
                          d: int = 2, dropout: bool = True) -> float:
    # TODO
    raise NotImplementedError("activations_per_layer")
