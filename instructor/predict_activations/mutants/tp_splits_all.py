"""Mutant: lets TP split every term (forgets the 10 sbh outside the parallel regions)."""

from __future__ import annotations


def activations_per_layer(s, b, h, a, t=1, sp=False, recompute="none", d=2, dropout=True):
    out = t                      # what lies outside the parallel regions
    sbh = s * b * h
    if recompute == "full":
        return sbh * d / out
    mask = 1 if dropout else 0
    total = (2 + 1 + 1) * sbh * d / out       # norm inputs, attention input, MLP input
    total += (3 + 1 + 8) * sbh * d / t        # Q, K, V, projection input, MLP intermediates
    total += 2 * sbh * mask / out             # dropout masks
    if recompute == "none":
        total += a * s * s * b / t * (d + ((d + 1) if dropout else 0))
    return total
