"""All-reduce algorithms under the alpha-beta(-gamma) model: ring, binomial tree, recursive doubling and
halving (Rabenseifner), and a hierarchical all-reduce over nodes.

A :class:`Cost` prices one call of ``m`` bytes on ``p`` ranks as ``steps * alpha + wire * m * beta +
reduce * m * gamma`` (``alpha``: seconds per message, a link tier's latency; ``beta``: seconds per byte,
1 / its bandwidth; ``gamma``: seconds per byte reduced, 0 unless given). The closed forms are those of
Thakur, Rabenseifner and Gropp (2005), "Optimization of collective communication operations in MPICH";
the ring's is ``comm.ring_steps`` and ``comm.Collective``'s wire bytes (comm.py's one description).
:func:`hierarchical_all_reduce_seconds` reduce-scatters inside each node, all-reduces each GPU's shard
across the nodes, and all-gathers inside the node. :func:`crossover_bytes` finds where two times cross;
:func:`fair_share_seconds` splits one link among transfers that run at the same time.
Derivations and the table of forms: docs/collectives.md.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from .comm import Collective, ring_steps
from .errors import ParallelLabError, check_positive_int
from .hardware import LinkTier


@dataclass(frozen=True)
class Cost:
    """``steps`` alphas, ``wire`` times ``m`` bytes on the wire, ``reduce`` times ``m`` bytes reduced."""

    algorithm: str
    steps: float
    wire: float
    reduce: float = 0.0

    def seconds(self, message_bytes: float, tier: LinkTier, gamma: float = 0.0) -> float:
        """Time of one call of ``message_bytes`` on ``tier`` (``gamma``: seconds per byte reduced)."""
        m = message_bytes
        return self.steps * tier.latency + self.wire * m / tier.bandwidth + self.reduce * m * gamma


def _lg(p: int, algorithm: str) -> int:
    check_positive_int(algorithm, "p", p)
    if p & (p - 1):
        raise ParallelLabError(f"{algorithm}: p={p} ranks; the closed form holds for a power of two (2, 4, 8, ...)")
    return p.bit_length() - 1


def ring_all_reduce(p: int) -> Cost:
    """Ring: a reduce-scatter then an all-gather, ``2 (p-1)`` steps, ``2 (p-1)/p m`` on the wire."""
    check_positive_int("ring all-reduce", "p", p)
    wire = Collective("dp", "all_reduce", 1 << 20, p).wire_bytes_per_call / (1 << 20)
    return Cost("ring", ring_steps("all_reduce", p), wire, (p - 1) / p)


def recursive_doubling_all_reduce(p: int) -> Cost:
    """Recursive doubling: ``lg p`` exchanges of the whole message (latency-optimal, short messages)."""
    lg = _lg(p, "recursive doubling")
    return Cost("recursive doubling", lg, lg, lg)


def rabenseifner_all_reduce(p: int) -> Cost:
    """Rabenseifner: recursive-halving reduce-scatter then recursive-doubling all-gather."""
    lg = _lg(p, "Rabenseifner")
    return Cost("Rabenseifner", 2 * lg, 2 * (p - 1) / p, (p - 1) / p)


def binomial_tree_all_reduce(p: int) -> Cost:
    """Binomial-tree reduce to one rank then binomial-tree broadcast: ``2 ceil(lg p)`` hops of the whole message."""
    check_positive_int("binomial tree", "p", p)
    lg = math.ceil(math.log2(p)) if p > 1 else 0
    return Cost("binomial tree", 2 * lg, 2 * lg, lg)


#: algorithm name -> its cost on ``p`` ranks of one link tier
ALL_REDUCE: dict[str, Callable[[int], Cost]] = {
    "ring": ring_all_reduce,
    "binomial tree": binomial_tree_all_reduce,
    "recursive doubling": recursive_doubling_all_reduce,
    "Rabenseifner": rabenseifner_all_reduce,
}


def hierarchical_all_reduce_seconds(message_bytes: float, nodes: int, gpus_per_node: int, intra: LinkTier,
                                    inter: LinkTier) -> float:
    """Ring reduce-scatter inside each node (``g`` GPUs), ring all-reduce of each GPU's ``m / g`` shard across
    the ``nodes`` (every GPU on its own NIC, in parallel), ring all-gather inside the node."""
    check_positive_int("hierarchical all-reduce", "nodes", nodes)
    g = gpus_per_node
    inside = ring_all_reduce(g).seconds(message_bytes, intra)         # reduce-scatter + all-gather in the node
    return inside + ring_all_reduce(nodes).seconds(message_bytes / g, inter)


def crossover_bytes(t_a: Callable[[float], float], t_b: Callable[[float], float]) -> float | None:
    """The message size at which two alpha-beta times (linear in the bytes) are equal; None if they never
    cross at a positive size."""
    big = 1e9
    ia, ib = t_a(0.0), t_b(0.0)
    sa, sb = (t_a(big) - ia) / big, (t_b(big) - ib) / big
    if sa == sb:
        return None
    m = (ib - ia) / (sa - sb)
    return m if m > 0 else None


def fair_share_seconds(wire_bytes: Sequence[float], bandwidth: float) -> list[float]:
    """When each of several transfers that start together on one link ends, the link shared equally among
    those still running (``k`` transfers: ``bandwidth / k`` each; a finished one frees its share)."""
    left = {i: float(b) for i, b in enumerate(wire_bytes)}
    done, now = [0.0] * len(left), 0.0
    while left:
        share = bandwidth / len(left)
        step = min(left.values()) / share               # until the smallest remaining one finishes
        now += step
        for i in list(left):
            left[i] -= step * share
            if left[i] <= 1e-9 * max(1.0, wire_bytes[i]):
                done[i] = now
                del left[i]
    return done
