"""Public tests of interleaved_1f1b: the library's validator accepts it (p=2, v=2, m=4; p=3, v=3, m=6; p=4, v=2,
m=4), its simulated bubble is (p - 1) / (v m) for p=4, v=2, m=8, and rank r's peak of chunk-micro-batches in
flight stays within the interleaved bound for p=3, v=2, m=6 and p=2, v=3, m=4."""

from __future__ import annotations

from parallel_lab.errors import ParallelLabError
from parallel_lab.grading.harness import Fail, checks, points, require


def rounds(order, v):
    """The groups whose messages are posted together: with ``v > 1`` a forward followed directly by a backward is
    one round (Megatron's ``send_forward_recv_backward``), except after the rank's last forward; any other action,
    and every action of plain 1F1B (``v = 1``, as the library's own), is a group of its own."""
    last_f = max((i for i, a in enumerate(order) if a.kind == "F"), default=-1)
    sizes, i = [], 0
    while i < len(order):
        pair = v > 1 and i + 1 < len(order) and i != last_f and order[i].kind == "F" and order[i + 1].kind == "B"
        sizes.append(2 if pair else 1)
        i += sizes[-1]
    return sizes


def built(sub, p, m, v):
    """The submission's lists for ``(p, m, v)`` with their point-to-point batches, proven runnable."""
    from parallel_lab.schedules.actions import Action, Placement
    from parallel_lab.schedules.checks import validate
    from parallel_lab.schedules.p2p import with_p2p

    (fn,) = require(sub, "interleaved_1f1b")
    orders = fn(p, m, v)
    if len(orders) != p:
        raise Fail(f"interleaved_1f1b({p}, {m}, {v}) returned {len(orders)} lists; expected one per rank, {p}")
    for r, order in enumerate(orders):
        bad = [a for a in order if not isinstance(a, Action) or a.kind not in ("F", "B")]
        if bad:
            raise Fail(f"rank {r}: {bad[0]} is not an F or a B action; return compute actions only")
    try:
        return validate(with_p2p(orders, v, [rounds(o, v) for o in orders], Placement.interleaved(p, v)))
    except ParallelLabError as e:
        raise Fail(f"interleaved_1f1b({p}, {m}, {v}) is not a valid schedule: {e}") from None


def inflight_bound(p, m, v, r):
    """The most (micro-batch, chunk) pairs interleaved 1F1B keeps alive on rank ``r`` (its warm-up plus one)."""
    from parallel_lab.schedules.inflight import peak_inflight

    return peak_inflight("interleaved", p, m, v, r)


@points(2)
@checks("a valid interleaved schedule: every (micro-batch, chunk) forwarded and backwarded once on every rank, "
        "each after its input arrived (from the previous virtual stage, on this rank or another), no deadlock",
        "chunk c of rank r is virtual stage c p + r: which stage does a backward of chunk c wait for, and which "
        "chunk must therefore come first among the backwards?")
def test_valid(sub):
    for p, m, v in ((2, 4, 2), (3, 6, 3), (4, 4, 2)):
        built(sub, p, m, v)


@points(2)
@checks("interleaving divides 1F1B's bubble by v: (p - 1) / (v m)", "the warm-up must be long enough that no "
        "rank waits in the steady state; count how many forwards of the rank run before its first backward "
        "can arrive")
def test_bubble_p4_v2_m8(sub):
    from parallel_lab.simulate import simulate

    got = simulate(built(sub, 4, 8, 2)).bubble_ratio
    if abs(got - 3 / 16) > 1e-9:
        raise Fail(f"simulated bubble {got:.4f}; interleaved 1F1B's is (p - 1) / (v m) = 0.1875 for p=4, v=2, m=8 "
                   f"(1F1B's is (p - 1) / m = 0.375)")


@points(2)
@checks("interleaved 1F1B's memory bound: rank r never holds more (micro-batch, chunk) pairs than its warm-up "
        "forwards plus one, fewer on later ranks", "a pair is in flight from its F to its B on that rank; a "
        "warm-up longer than needed keeps more alive, one shorter makes ranks wait")
def test_inflight_bound(sub):
    from parallel_lab.simulate import simulate

    for p, m, v in ((3, 6, 2), (2, 4, 3)):
        got = simulate(built(sub, p, m, v)).peak_inflight
        want = [inflight_bound(p, m, v, r) for r in range(p)]
        if any(g > w for g, w in zip(got, want, strict=True)):
            raise Fail(f"p={p}, v={v}, m={m}: (micro-batch, chunk) pairs in flight per rank {got}; interleaved "
                       f"1F1B holds at most {want}")
