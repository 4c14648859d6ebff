"""Routing tokens to experts with a capacity, in pure Python: what the explorer and the lesson simulate.

The rule of the runnable block (``distributed/model/moe.py``, ``route``; a test checks the two agree on the same
choices): per sequence each expert has ``C = ModelSpec.expert_capacity(s)`` slots; every token's first choice
is placed in token order, then every second choice, and so on (GShard's priority); a choice that finds its
expert full is dropped. :func:`capacity_counts` applies it to given choices.

:func:`synthetic_choices` draws choices from a skewed popularity ``p_e ~ (e + 1) ** -skew`` (``skew = 0``:
a perfectly balanced router in expectation; larger: a few experts attract most tokens, the collapse the
load-balancing loss of Switch, Fedus et al. 2021, pushes against). :func:`load_report` sums the tokens each
expert and each expert-parallel rank computes: the busiest rank sets the pace of the layer.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from .errors import ParallelLabError
from .sharding import local_experts
from .specs import ModelSpec


def capacity_counts(choices: list[list[int]], experts: int, capacity: int) -> tuple[list[int], list[int]]:
    """``(routed, kept)`` per expert for one sequence: ``choices[t]`` are token ``t``'s experts, best first."""
    if any(len(set(c)) != len(c) for c in choices):
        raise ParallelLabError("a token's choices must be distinct experts")
    routed, kept = [0] * experts, [0] * experts
    k = max((len(c) for c in choices), default=0)
    for j in range(k):                                   # choice-major: every first choice, then every second
        for c in choices:
            if j < len(c):
                e = c[j]
                routed[e] += 1
                if kept[e] < capacity:
                    kept[e] += 1
    return routed, kept


def synthetic_choices(experts: int, top_k: int, tokens: int, skew: float, seed: int = 0) -> list[list[int]]:
    """``tokens`` tokens, each choosing ``top_k`` distinct experts with popularity ``(e + 1) ** -skew``."""
    if not 1 <= top_k <= experts:
        raise ParallelLabError(f"top_k={top_k} must be in 1..experts={experts}")
    if skew < 0:
        raise ParallelLabError(f"skew={skew} must be >= 0 (0: balanced)")
    rng = random.Random(seed)
    weights = [(e + 1) ** -skew for e in range(experts)]
    out = []
    for _ in range(tokens):
        pool, w, pick = list(range(experts)), list(weights), []
        for _ in range(top_k):
            e = rng.choices(range(len(pool)), weights=w)[0]
            pick.append(pool.pop(e))
            w.pop(e)
        out.append(pick)
    return out


@dataclass(frozen=True)
class LoadReport:
    """Tokens per expert and per expert rank for ``sequences`` sequences of ``seq`` tokens."""

    routed: list[int]
    kept: list[int]
    per_rank: list[int]
    capacity: int          # slots per expert over all the sequences

    @property
    def dropped(self) -> float:
        """Fraction of the choices over capacity."""
        return 1 - sum(self.kept) / sum(self.routed) if sum(self.routed) else 0.0

    @property
    def imbalance(self) -> float:
        """Busiest expert rank's kept tokens over the mean rank's (1.0: balanced)."""
        mean = sum(self.per_rank) / len(self.per_rank)
        return max(self.per_rank) / mean if mean else 1.0


def load_report(model: ModelSpec, seq: int, ep: int = 1, skew: float = 1.0, sequences: int = 4,
                seed: int = 0) -> LoadReport:
    """Route ``sequences`` synthetic sequences of ``seq`` tokens through one MoE block of ``model``."""
    if not model.is_moe:
        raise ParallelLabError(f"{model.name!r} has no experts; pick a mixture-of-experts model (e.g. tiny-moe)")
    if model.experts % ep:
        raise ParallelLabError(f"ep={ep} does not divide experts={model.experts}")
    cap = model.expert_capacity(seq)
    routed, kept = [0] * model.experts, [0] * model.experts
    for i in range(sequences):
        r, k = capacity_counts(synthetic_choices(model.experts, model.top_k, seq, skew, seed + i), model.experts, cap)
        routed = [a + b for a, b in zip(routed, r, strict=True)]
        kept = [a + b for a, b in zip(kept, k, strict=True)]
    per_rank = [sum(kept[e] for e in local_experts(model.experts, ep, j)) for j in range(ep)]
    return LoadReport(routed, kept, per_rank, cap * sequences)
