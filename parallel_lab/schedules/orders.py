"""The compute order of each schedule, per rank: GPipe, 1F1B, interleaved 1F1B, ZB-H1, ZB-V, DualPipeV.

Each generator returns, per pipeline rank, its ``F``/``B``/``W`` actions in order; :mod:`.p2p` then puts
the point-to-point batches between them. Sources: GPipe (Huang et al. 2019); 1F1B (PipeDream-Flush,
Narayanan et al. 2021a); interleaved 1F1B (Narayanan et al. 2021, "Efficient Large-Scale Language Model
Training on GPU Clusters", section 2.2); ZB-H1 (Qi et al. 2023, "Zero Bubble Pipeline Parallelism",
section 2.1); ZB-V (the same paper, section 6); DualPipe (DeepSeek-AI 2024, "DeepSeek-V3 Technical
Report", section 3.2.1) in its V form, DualPipeV. The V lists equal, action for action, those of torch's
``ScheduleZBVZeroBubble`` and ``ScheduleDualPipeV`` (tests/test_schedules_v.py).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable

from ..errors import ParallelLabError
from .actions import Action, B, F, W


def check_pm(name: str, p: int, m: int, v: int = 1) -> None:
    for label, x in (("p", p), ("m", m), ("v", v)):
        if isinstance(x, bool) or not isinstance(x, int) or x < 1:
            raise ParallelLabError(f"{name}: {label}={x!r} must be a positive integer; e.g. {label}=4")


def gpipe_order(p: int, m: int) -> list[list[Action]]:
    """GPipe (Huang et al. 2019): all ``m`` forwards, then all ``m`` backwards, on every rank."""
    check_pm("gpipe", p, m)
    return [[F(i) for i in range(m)] + [B(i) for i in range(m)] for _ in range(p)]


def one_f_one_b_order(p: int, m: int) -> list[list[Action]]:
    """1F1B (PipeDream-Flush): rank ``r`` runs ``min(p - r - 1, m)`` warm-up forwards, then alternates
    one forward and one backward, then drains the remaining backwards."""
    check_pm("1f1b", p, m)
    return [_warmup_steady_drain(min(p - r - 1, m), m, F, B) for r in range(p)]


def _warmup_steady_drain(warm: int, total: int, fwd: Callable[[int], Action],
                         bwd: Callable[[int], Action]) -> list[Action]:
    """One rank's 1F1B list: forwards ``0..warm-1``; then forward ``warm + k`` and backward ``k`` in turn;
    then the remaining backwards. ``fwd(k)``/``bwd(k)``: the rank's ``k``-th forward / backward."""
    order = [fwd(k) for k in range(warm)]
    for k in range(total - warm):
        order += [fwd(warm + k), bwd(k)]
    return order + [bwd(k) for k in range(total - warm, total)]


def interleaved_warmup(p: int, m: int, v: int, r: int) -> int:
    """Megatron's warm-up forwards on rank ``r``: ``2 (p - r - 1) + (v - 1) p``, at most ``m v``.

    (Megatron runs all ``m v`` forwards first when ``m == p``, for its blocking exchanges; these lists
    do not need that, :func:`.checks.validate` proves them deadlock-free, and it saves memory on later ranks.)
    """
    return min(m * v, 2 * (p - r - 1) + (v - 1) * p)


def check_interleaved(p: int, m: int, v: int) -> None:
    """What interleaved 1F1B (``v > 1``) needs of ``p`` and ``m``."""
    if m % p:
        ok = [k * p for k in range(1, 5)]
        raise ParallelLabError(f"interleaved 1F1B runs micro-batches in groups of p={p}; m={m} is not a "
                               f"multiple of it; pick m in {{{', '.join(map(str, ok))}}}")
    if p == 1:
        raise ParallelLabError(f"interleaving v={v} chunks needs at least 2 pipeline ranks (p=1); "
                               "set p >= 2 or v = 1")


def interleaved_order(p: int, m: int, v: int) -> list[list[Action]]:
    """Interleaved 1F1B (Narayanan et al. 2021, section 2.2), Megatron's ordering.

    Micro-batches go through the ``v`` chunks of a rank in groups of ``p``: the ``k``-th forward of a
    rank is micro-batch ``(k // (p v)) p + k % p`` on chunk ``(k // p) % v``; backwards run the chunks
    in reverse. Rank ``r`` warms up with ``2 (p - r - 1) + (v - 1) p`` forwards, then alternates one
    forward and one backward, then drains. With ``v = 1`` this is plain 1F1B.
    """
    check_pm("interleaved", p, m, v)
    if v == 1:
        return one_f_one_b_order(p, m)
    check_interleaved(p, m, v)
    total = m * v

    def fwd(k: int) -> Action:
        return F((k // (p * v)) * p + k % p, (k // p) % v)

    def bwd(k: int) -> Action:
        return B((k // (p * v)) * p + k % p, v - 1 - (k // p) % v)

    return [_warmup_steady_drain(interleaved_warmup(p, m, v, r), total, fwd, bwd) for r in range(p)]


def zb_h1_order(p: int, m: int) -> list[list[Action]]:
    """ZB-H1 (Qi et al. 2023, section 2.1): 1F1B with the backward split into B (input gradient, on
    the critical path) and W (weight gradient), and rank ``r``'s W passes delayed by ``r`` micro-batches.

    Rank ``r``: ``min(p - r - 1, m)`` warm-up forwards; ``r`` rounds of (F, B) without W; then rounds of
    (F, B, W); then (B, W) while backwards remain; then the remaining W. Every rank then holds at most
    ``p`` micro-batches (counted until their W), the first rank's 1F1B peak, and the delayed W passes
    fill the drain bubble: with F = B = W the bubble is a third of 1F1B's.
    """
    check_pm("zb-h1", p, m)
    orders = []
    for r in range(p):
        w = min(p - r - 1, m)
        order = [F(i) for i in range(w)]
        f, b, wg = w, 0, 0
        for _ in range(r):
            if f == m:
                break
            order += [F(f), B(b)]
            f, b = f + 1, b + 1
        while f < m:
            order += [F(f), B(b), W(wg)]
            f, b, wg = f + 1, b + 1, wg + 1
        while b < m:
            order += [B(b), W(wg)]
            b, wg = b + 1, wg + 1
        order += [W(i) for i in range(wg, m)]
        orders.append(order)
    return orders


class _Counter:
    """Appends compute actions to one rank's order, numbering micro-batches per (kind, chunk) in turn."""

    def __init__(self) -> None:
        self.order: list[Action] = []
        self.next: dict[tuple[str, int], int] = defaultdict(int)
        self.pending_w: list[Action] = []            # W passes owed, oldest first (DualPipeV)

    def add(self, kind: str, chunk: int, split: bool = True) -> Action:
        """The next ``kind`` on ``chunk``; a B with ``split`` owes a W (queued), a B without is a full one."""
        key = ("B" if kind == "W" and not split else kind, chunk)
        a = Action(kind, self.next[key], chunk)
        self.next[key] += 1
        self.order.append(a)
        if kind == "B" and split:
            self.pending_w.append(Action("W", a.microbatch, chunk))
        return a

    def repeat(self, n: int, *steps: tuple[str, int]) -> None:
        """``n`` rounds of the ``(kind, chunk)`` steps, in turn."""
        for _ in range(n):
            for kind, chunk in steps:
                self.add(kind, chunk)

    def count(self, kind: str, chunk: int) -> int:
        return self.next[(kind, chunk)]

    def owed_w(self) -> None:
        """The oldest W still owed, if any."""
        if self.pending_w:
            self.order.append(self.pending_w.pop(0))


def zb_v_order(p: int, m: int) -> list[list[Action]]:
    """ZB-V (Qi et al. 2024, "Zero Bubble Pipeline Parallelism", section 6), on the V placement.

    Rank ``r`` holds chunk 0 = virtual stage ``r`` and chunk 1 = stage ``2 p - 1 - r``; every backward is
    split into B and W. The list is built for ``n = max(m, 2 p - 1)`` micro-batches (the fewest that fill
    the V) and the actions of micro-batches ``>= m`` are dropped, as torch's ``ScheduleZBVZeroBubble`` does:

    1. warm-up: ``2 (p - r) - 1`` forwards of chunk 0, then ``r`` pairs (F chunk 1, F chunk 0), then
       ``p - r`` rounds (F, B, W) of chunk 1;
    2. steady state, while forwards remain: (F, B, W) of chunk 0 (no F once all ``n`` are in), then
       (F, B, W) of chunk 1;
    3. drain: ``r`` pairs (B chunk 0, B chunk 1) with their W delayed, ``p - r`` rounds (B, W) of chunk 0,
       then the delayed W of chunk 1 and of chunk 0. The delayed W passes fill the drain's bubble.
    """
    check_pm("zb-v", p, m)
    n = max(m, 2 * p - 1)
    orders = []
    for r in range(p):
        c = _Counter()
        c.repeat(2 * (p - r) - 1, ("F", 0))
        c.repeat(r, ("F", 1), ("F", 0))
        c.repeat(p - r, ("F", 1), ("B", 1), ("W", 1))
        while c.count("F", 1) < c.count("F", 0) or c.count("F", 0) < n:
            if c.count("F", 0) < n:
                c.add("F", 0)
            for chunk in (0, 1):
                if chunk == 1:
                    c.add("F", 1)
                c.add("B", chunk)
                c.add("W", chunk)
        c.repeat(r, ("B", 0), ("B", 1))
        c.repeat(p - r, ("B", 0), ("W", 0))
        for chunk in (1, 0):
            while c.count("W", chunk) < c.count("B", chunk):
                c.add("W", chunk)
        orders.append([a for a in c.order if a.microbatch < m])
    return orders


def dualpipev_order(p: int, m: int) -> tuple[list[list[Action]], list[set[tuple[Action, Action]]]]:
    """DualPipeV: DeepSeek-V3's DualPipe (DeepSeek-AI 2024, section 3.2.1) folded onto a V (the "cut in
    half" form torch ships as ``ScheduleDualPipeV``). Returns the orders and, per rank, the (F, B) pairs that
    run overlapped (one forward chunk and one backward chunk of another micro-batch at once: on a GPU one
    computes while the other's messages travel).

    Rank ``r`` (chunk 0 = stage ``r``, chunk 1 = stage ``2 p - 1 - r``), ``m >= 2 p`` micro-batches:

    1. ``2 (p - r - 1)`` forwards of chunk 0; ``r + 1`` pairs (F chunk 0, F chunk 1);
    2. ``p - r - 1`` rounds (B chunk 1 split, the oldest owed W, F chunk 1): zero-bubble warm-up;
    3. main phase, ``m - 2 p + r + 1`` rounds of two overlapped pairs (F chunk 0 & full B chunk 1), (F chunk 1
       & full B chunk 0); on the last rank the first pair runs apart;
    4. ``p - r - 1`` rounds (full B chunk 1, overlapped F chunk 1 & full B chunk 0);
    5. ``r + 1`` rounds (B chunk 1, B chunk 0), full at first, split into B and W from the middle one on;
       ``p - r - 1`` rounds (owed W, B chunk 0); finally the ``r + 1`` owed W passes.
    """
    check_pm("dualpipev", p, m)
    if m < 2 * p:
        raise ParallelLabError(f"dualpipev needs at least 2p = {2 * p} micro-batches (one per virtual stage); "
                               f"m={m}; pick m >= {2 * p}")
    orders, pairs = [], []
    for r in range(p):
        c, mine = _Counter(), set()

        def overlap(f_chunk: int, b_chunk: int, c: _Counter = c, mine: set = mine) -> None:
            f = c.add("F", f_chunk)
            mine.add((f, c.add("B", b_chunk, split=False)))

        c.repeat(2 * (p - r - 1), ("F", 0))
        c.repeat(r + 1, ("F", 0), ("F", 1))
        for _ in range(p - r - 1):
            c.add("B", 1)
            c.owed_w()
            c.add("F", 1)
        for i in range(m - 2 * p + r + 1):
            if i == 0 and r == p - 1:
                c.add("F", 0)
                c.add("B", 1, split=False)
            else:
                overlap(0, 1)
            overlap(1, 0)
        for _ in range(p - r - 1):
            c.add("B", 1, split=False)
            overlap(1, 0)
        split = False
        for i in range(r + 1):
            split = split or (i == (r + 1) // 2 and r % 2 == 1)
            c.add("B", 1, split=split)
            split = split or (i == (r + 1) // 2 and r % 2 == 0)
            c.add("B", 0, split=split)
        for _ in range(p - r - 1):
            c.owed_w()
            c.add("B", 0, split=split)
        for _ in range(r + 1):
            c.owed_w()
        orders.append(c.order)
        pairs.append(mine)
    return orders, pairs
