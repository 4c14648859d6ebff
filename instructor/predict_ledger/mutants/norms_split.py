"""Mutant: divides the norm weights by tp too."""

from __future__ import annotations

import math

from parallel_lab.grading.feedback import learner_params

LEARNER = "ref-learner"
ASSIGNMENT = learner_params(LEARNER, "predict_ledger", {"model": ["llama2-7b", "llama2-13b", "llama3-8b",
                                                                  "llama3-70b"], "tp": [1, 2, 4, 8]})


def _parts(layers, hidden, heads, kv_heads, ffn, vocab, tp):
    d = hidden // heads
    block_matrices = 2 * hidden * hidden + 2 * kv_heads * d * hidden + 3 * ffn * hidden
    norms = layers * 2 * hidden + hidden
    return layers * block_matrices // tp, norms // tp, 2 * math.ceil(vocab / tp) * hidden


def n_params(layers, hidden, heads, kv_heads, ffn, vocab):
    return sum(_parts(layers, hidden, heads, kv_heads, ffn, vocab, 1))


def state_per_gpu(layers, hidden, heads, kv_heads, ffn, vocab, tp=1, bytes_per_param=(2, 2, 12)):
    n = sum(_parts(layers, hidden, heads, kv_heads, ffn, vocab, tp))
    return dict(zip(("parameters", "gradients", "optimizer_states"), (n * b for b in bytes_per_param), strict=True))


def _answer():
    from parallel_lab.specs import ModelSpec

    m = ModelSpec.preset(ASSIGNMENT["model"])
    return state_per_gpu(m.layers, m.hidden, m.heads, m.kv_heads, m.ffn, m.vocab, ASSIGNMENT["tp"])


ANSWER = _answer()
