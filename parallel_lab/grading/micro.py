"""The small shapes the exercises' tests train on CPU ranks, and the one-process references they compare with.

``MICRO`` (llama flavour, 2 blocks, h=32, 4 heads / 2 kv heads, ffn 64, vocab 64) trains a step in a few
milliseconds, so a hidden test can run it on 2 or 4 ranks and against one process within its time limit.
The plans are fp32 (``adam-fp32``): gradients and messages are 4 bytes per element.
"""

from __future__ import annotations

from parallel_lab.specs import ModelSpec, Plan

MICRO = ModelSpec(layers=2, hidden=32, heads=4, kv_heads=2, ffn=64, vocab=64, flavour="llama", name="micro")
SEQ = 16


def micro_plan(**kw: object) -> Plan:
    """An fp32 plan of ``MICRO`` at ``SEQ`` tokens, 2 sequences per micro-batch, with ``kw`` changed."""
    base = {"seq": SEQ, "micro_batch": 2, "optimizer": "adam-fp32", "dtype": "fp32"}
    return Plan(**{**base, **kw})
