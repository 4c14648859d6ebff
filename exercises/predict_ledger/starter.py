"""Exercise predict_ledger (predict): the memory ledger of a plan, by hand.

A Llama-style decoder (RMSNorm, grouped-query attention, SwiGLU MLP, no biases, untied embeddings) of
``L`` layers, width ``h``, ``a`` query heads of ``d = h / a`` and ``kv`` key/value heads, MLP width ``f``
and vocabulary ``V`` holds, per block: two norm weights (``h`` each), ``wq`` and ``wo`` (``h x h``),
``wk`` and ``wv`` (``kv d x h``), ``gate`` and ``up`` (``f x h``) and ``down`` (``h x f``); outside the
blocks: the token embedding (``V x h``), the final norm (``h``) and the LM head (``V x h``).

Mixed-precision Adam keeps 2 + 2 + 12 bytes per parameter (bf16 weights, bf16 gradients, fp32 master,
momentum and variance: the ZeRO paper's ledger). Tensor parallelism over ``t <= kv`` ranks splits every
matrix ``t`` ways and the embedding and head by vocabulary rows (``ceil(V / t)`` each); the norm weights
are replicated on every rank.

1. ``n_params(...)``: the exact parameter count.
2. ``state_per_gpu(..., tp, bytes_per_param)``: ``{"parameters", "gradients", "optimizer_states"}`` in
   bytes on one GPU.
3. ``ANSWER``: those three numbers for *your* assignment, ``ASSIGNMENT`` below (set ``LEARNER`` to your
   id first), worked out by hand (or with your functions, once you trust them).

Graded: exact counts against ``ModelSpec.n_params``; bytes against ``parallel_lab.ledger.state_bytes``
(exact) for several presets and TP degrees; against the bytes measured on a real torch model after an
AdamW step (fp32: 4 + 4 + 8); your ANSWER within 0.5%. ``check(...)`` (``parallel_lab.grading``) gives
inline feedback on each number. Check: ``parallel-lab grade predict_ledger exercises/predict_ledger/starter.py``.
"""

from __future__ import annotations

from parallel_lab.grading.feedback import learner_params

LEARNER = "your-id"
ASSIGNMENT = learner_params(LEARNER, "predict_ledger", {"model": ["llama2-7b", "llama2-13b", "llama3-8b",
                                                                  "llama3-70b"], "tp": [1, 2, 4, 8]})


def n_params(layers: int, hidden: int, heads: int, kv_heads: int, ffn: int, vocab: int) -> int:
    # TODO
    raise NotImplementedError("n_params")


def state_per_gpu(layers: int, hidden: int, heads: int, kv_heads: int, ffn: int, vocab: int, tp: int = 1,
                  bytes_per_param: tuple[int, int, int] = (2, 2, 12)) -> dict[str, int]:
    # TODO
    raise NotImplementedError("state_per_gpu")


ANSWER: dict[str, float] = {"parameters": ..., "gradients": ..., "optimizer_states": ...}
