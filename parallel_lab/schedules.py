"""Pipeline schedules as data: GPipe, 1F1B, interleaved 1F1B, ZB-H1, ZB-V and DualPipeV as per-rank action lists.

A *schedule* is ``list[list[Action]]``: one list per pipeline rank, executed in list order by that
rank. These lists are the only definition of a schedule in parallel_lab: the simulator
(:mod:`parallel_lab.simulate`) times them, the memory ledger counts their in-flight micro-batches, and
the pipeline executor (``parallel_lab.distributed.pipeline_parallel.pipeline_parallel``) runs them.
Adding a schedule means adding a generator here.

Actions
-------
Compute actions (``peer`` is ``None``, ``ops`` empty):

* ``F(mb, c)``: forward of micro-batch ``mb`` through model chunk ``c`` of this rank.
* ``B(mb, c)``: backward. If the schedule also holds a ``W(mb, c)`` on this rank, ``B`` computes only
  the gradient with respect to the chunk's *input* (ZB-H1's B pass); otherwise ``B`` is the full
  backward (input and weight gradients).
* ``W(mb, c)``: the weight-gradient part of a split backward (ZB-H1's W pass), after its ``B``.

Chunks and placement (Megatron's interleaved placement, Narayanan et al. 2021): with ``p`` ranks and
``v`` chunks per rank, chunk ``c`` of rank ``r`` is the global *virtual stage* ``s = c * p + r`` of
``V = p * v`` stages. Virtual stage ``s`` holds the ``s``-th contiguous slice of the layers; stage 0
holds the embedding, stage ``V - 1`` the head and loss. Without interleaving ``v = 1`` and ``s = r``.
ZB-V and DualPipeV use the *V* placement instead (rank ``r`` holds stages ``r`` and ``2 p - 1 - r``).
The chunk -> virtual stage table is data, a :class:`Placement` carried by the :class:`Schedule`; every
rule below about neighbours and peers reads it. Where two consecutive stages sit on the same rank (the
V's turn on rank ``p - 1``) the tensor is handed over locally: no point-to-point op, and the consumer
waits only for the earlier action of its own list (:func:`local_input`).

Point-to-point ops (only inside a ``P2P`` action, below), each naming a tensor by the *local* chunk of
the rank that holds the op:

* ``SEND_F(mb, c, peer)``: send the output activations of local chunk ``c`` (virtual stage ``s``) to
  ``peer``, which holds virtual stage ``s + 1``.
* ``RECV_F(mb, c, peer)``: receive the input activations of local chunk ``c`` from ``peer``
  (virtual stage ``s - 1``).
* ``SEND_B(mb, c, peer)``: send the gradient with respect to local chunk ``c``'s input to ``peer``
  (virtual stage ``s - 1``).
* ``RECV_B(mb, c, peer)``: receive the gradient with respect to local chunk ``c``'s output from
  ``peer`` (virtual stage ``s + 1``).

``P2P(ops)``: a *batch* of point-to-point ops performed together, like Megatron's
``send_forward_recv_backward`` or ``torch.distributed.batch_isend_irecv``.

Point-to-point semantics (what the executor implements, and what :func:`validate` simulates)
------------------------------------------------------------------------------------------
1. A rank runs its list strictly in order.
2. ``P2P(ops)`` *posts* every op of the batch at once, in the order of ``ops``, and does not wait:
   ``works = dist.batch_isend_irecv([P2POp(...) for op in ops])``. The rank keeps each receive's
   buffer and work under the key ``(op.kind, op.microbatch, op.chunk)`` and each send's work in a list.
3. A compute action first waits for the receive that delivers its input (``F``: the ``RECV_F`` of
   the same micro-batch and chunk; ``B``: the ``RECV_B``), which an earlier ``P2P`` of the same list
   has posted; the first virtual stage's ``F``, the last one's ``B``, and every ``W`` need none.
4. At the end of its list the rank waits for all its sends (the step is not over before that).
5. Matching is FIFO per ordered pair of ranks: the ``k``-th send posted by rank ``a`` to rank ``b``
   (ops counted in list order, then in ``ops`` order) carries the tensor of the ``k``-th receive that
   ``b`` posts from ``a``; one tag for all messages. The validator checks that each such pair names
   the same micro-batch, the same kind (activation or gradient) and adjacent virtual stages.
6. Rendezvous: a send and its receive complete together, once both are posted (no buffering is
   assumed; with a point-to-point time ``t_p2p`` they complete at ``max(posted, posted') + t_p2p``).

This is the pattern of the Zero Bubble authors' Megatron runtime (post non-blocking, wait for a
receive just before its consumer, wait for sends at the end of the step). :func:`validate` also checks a
stricter rule, the one a single NCCL stream imposes: a rank's batches complete one after another
(batch ``j`` waits for batch ``j - 1``). Every generated list is deadlock-free under both.

Every generator cuts a rank's compute list into groups and puts one ``P2P`` after each group with the
sends of the group's outputs and the receives of the next group's inputs (:func:`with_p2p`). Groups
are single actions, except in interleaved 1F1B whose steady state pairs each forward with the
following backward (Megatron's rounds), and in DualPipeV whose overlapped (F, B) pairs are groups;
without that pairing two ranks of an interleaved pipeline can each wait, under the stricter rule, for a
receive the other posts only later. A rank posts its receives from a peer in the order the peer sends
(rule 5), early if need be. On a V two streams flow between the same two ranks (activations of the first
leg, gradients of the second), and receives posted only just before their consumers can then deadlock
one in-order stream; the V lists post each receive when the sender sends (``with_p2p(recv_at="sender")``,
as torch's lowering does), which both rules accept.

Activation lifetime: a ``(mb, c)`` pair is *in flight* on its rank from its ``F`` until its last
backward part (``W`` when the backward is split, else ``B``); its saved activations are then freed.
ZB-H1's ``W`` keeps only the inputs of the linear layers, but counting them until ``W`` is the
paper's own bound (peak memory no greater than 1F1B's).

Sources: GPipe (Huang et al. 2019); 1F1B (PipeDream-Flush, Narayanan et al. 2021a); interleaved 1F1B
(Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU Clusters", section 2.2);
ZB-H1 (Qi et al. 2023, "Zero Bubble Pipeline Parallelism", section 2.1); ZB-V (the same paper, section 6);
DualPipe (DeepSeek-AI 2024, "DeepSeek-V3 Technical Report", section 3.2.1) in its V form, DualPipeV. The
V lists equal, action for action, those of torch's ``ScheduleZBVZeroBubble`` and ``ScheduleDualPipeV``
(tests/test_schedules_v.py); :mod:`parallel_lab.schedule_csv` moves lists to and from torch's CSV format.
"""

from __future__ import annotations

import functools
from collections import defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Literal

from .errors import ParallelLabError
from .specs import SCHEDULES

ActionKind = Literal["F", "B", "W", "SEND_F", "RECV_F", "SEND_B", "RECV_B", "P2P"]

COMPUTE_KINDS: tuple[str, ...] = ("F", "B", "W")
P2P_OP_KINDS: tuple[str, ...] = ("SEND_F", "RECV_F", "SEND_B", "RECV_B")


@dataclass(frozen=True)
class Action:
    """One step of a rank's list: a compute action, a point-to-point op, or a ``P2P`` batch of ops."""

    kind: ActionKind
    microbatch: int = -1
    chunk: int = 0
    peer: int | None = None
    ops: tuple[Action, ...] = ()

    @property
    def is_compute(self) -> bool:
        return self.kind in COMPUTE_KINDS

    @property
    def is_send(self) -> bool:
        return self.kind in ("SEND_F", "SEND_B")

    def __str__(self) -> str:
        if self.kind == "P2P":
            return "P2P[" + ", ".join(str(o) for o in self.ops) + "]"
        s = f"{self.kind}(mb={self.microbatch}, chunk={self.chunk}"
        if self.peer is not None:
            s += f", peer={self.peer}"
        return s + ")"


@dataclass(frozen=True)
class Placement:
    """Which virtual stage each model chunk of each rank holds: ``stages[rank][chunk]``.

    Chunks of a rank are numbered in model order (chunk 0 holds the rank's earliest layers). Two
    placements are generated: Megatron's *interleaved* one (``stages[r][c] = c p + r``; ``v = 1`` is the
    plain pipeline) and the *V* one of ZB-V and DualPipeV (Qi et al. 2024, section 6): ``v = 2`` and rank
    ``r`` holds virtual stages ``r`` and ``2 p - 1 - r``, so rank 0 holds the embedding and the head and
    the turn from stage ``p - 1`` to stage ``p`` stays on rank ``p - 1`` (no message). A learner's schedule
    may bring any other table; every rule about neighbours and peers is read off this table.
    """

    stages: tuple[tuple[int, ...], ...]
    name: str = "custom"

    def __post_init__(self) -> None:
        if not self.stages or any(len(row) != len(self.stages[0]) or not row for row in self.stages):
            raise ParallelLabError(f"placement {self.stages}: every rank must hold the same number (>= 1) of "
                                   "chunks; e.g. ((0, 3), (1, 2)) for two ranks in a V")
        flat = sorted(s for row in self.stages for s in row)
        if flat != list(range(len(flat))):
            raise ParallelLabError(f"placement {self.stages}: the virtual stages held must be 0..{len(flat) - 1}, "
                                   "each exactly once")
        if any(list(row) != sorted(row) for row in self.stages):
            raise ParallelLabError(f"placement {self.stages}: a rank's chunks are numbered in model order; "
                                   f"write each rank's stages in increasing order")

    @classmethod
    def interleaved(cls, p: int, v: int = 1) -> Placement:
        """Megatron's placement: chunk ``c`` of rank ``r`` is virtual stage ``c p + r``."""
        return cls(tuple(tuple(c * p + r for c in range(v)) for r in range(p)),
                   "interleaved" if v > 1 else "contiguous")

    @classmethod
    def v_shape(cls, p: int) -> Placement:
        """ZB-V's and DualPipeV's placement: rank ``r`` holds virtual stages ``r`` and ``2 p - 1 - r``."""
        return cls(tuple((r, 2 * p - 1 - r) for r in range(p)), "v")

    @classmethod
    def from_stage_ranks(cls, rank_of: dict[int, int]) -> Placement:
        """The placement that puts virtual stage ``s`` on rank ``rank_of[s]`` (what a CSV file implies)."""
        p = 1 + max(rank_of.values(), default=-1)
        rows = tuple(tuple(sorted(s for s, r in rank_of.items() if r == rank)) for rank in range(p))
        made = cls(rows)
        for known in (cls.interleaved(p, made.v), cls.v_shape(p)):
            if known.stages == rows:
                return known
        return made

    @property
    def p(self) -> int:
        return len(self.stages)

    @property
    def v(self) -> int:
        return len(self.stages[0])

    @property
    def n_stages(self) -> int:
        return self.p * self.v

    def stage(self, rank: int, chunk: int) -> int:
        """The virtual stage of ``chunk`` on ``rank``."""
        return self.stages[rank][chunk]

    def holder(self, stage: int) -> tuple[int, int]:
        """``(rank, chunk)`` that holds virtual stage ``stage``."""
        for r, row in enumerate(self.stages):
            if stage in row:
                return r, row.index(stage)
        raise ParallelLabError(f"virtual stage {stage} is not in 0..{self.n_stages - 1}")

    def neighbour(self, rank: int, chunk: int, step: int) -> tuple[int, int] | None:
        """``(rank, chunk)`` of the virtual stage ``step`` (+1: next, -1: previous) away, None past an end."""
        s = self.stage(rank, chunk) + step
        return self.holder(s) if 0 <= s < self.n_stages else None


class Schedule(list):
    """One action list per pipeline rank (a ``list[list[Action]]``), with the :class:`Placement` of the
    chunks it names (None: the interleaved placement, inferred from the chunks used) and, per rank, the
    (F, B) pairs that run overlapped (DualPipe's F&B: one group, their messages posted together)."""

    def __init__(self, ranks: Iterable[Iterable[Action]] = (), placement: Placement | None = None,
                 overlapped: Iterable[Iterable[tuple[Action, Action]]] | None = None):
        super().__init__(list(r) for r in ranks)
        self.placement = placement
        self.overlapped: list[set[tuple[Action, Action]]] = (
            [set(x) for x in overlapped] if overlapped is not None else [set() for _ in self])


def placement_of(schedule: list[list[Action]]) -> Placement:
    """The schedule's placement: its own, or the interleaved one for the chunks its actions use."""
    own = getattr(schedule, "placement", None)
    if own is not None:
        return own
    v = 1 + max((a.chunk for acts in schedule for a in acts if a.is_compute), default=0)
    return Placement.interleaved(max(len(schedule), 1), v)


def F(mb: int, chunk: int = 0) -> Action:
    return Action("F", mb, chunk)


def B(mb: int, chunk: int = 0) -> Action:
    return Action("B", mb, chunk)


def W(mb: int, chunk: int = 0) -> Action:
    return Action("W", mb, chunk)


def P2P(*ops: Action) -> Action:
    """A batch of point-to-point ops, posted together and waited for together."""
    return Action("P2P", ops=tuple(ops))


# --------------------------------------------------------------------------------------------------
# Generators: a compute order per rank, then the point-to-point batches between compute actions
# --------------------------------------------------------------------------------------------------

def _check_pm(name: str, p: int, m: int, v: int = 1) -> None:
    for label, x in (("p", p), ("m", m), ("v", v)):
        if isinstance(x, bool) or not isinstance(x, int) or x < 1:
            raise ParallelLabError(f"{name}: {label}={x!r} must be a positive integer; e.g. {label}=4")


def _ops_after(a: Action, rank: int, place: Placement) -> list[Action]:
    """The sends a compute action's output needs: activations forward, input gradients backward (none
    when the neighbouring virtual stage is on the same rank: the tensor is handed over locally)."""
    if a.kind not in ("F", "B"):
        return []
    nb = place.neighbour(rank, a.chunk, +1 if a.kind == "F" else -1)
    if nb is None or nb[0] == rank:
        return []
    return [Action("SEND_F" if a.kind == "F" else "SEND_B", a.microbatch, a.chunk, nb[0])]


def _ops_before(a: Action, rank: int, place: Placement) -> list[Action]:
    """The receives a compute action's input needs (none for a local hand-off)."""
    if a.kind not in ("F", "B"):
        return []
    nb = place.neighbour(rank, a.chunk, -1 if a.kind == "F" else +1)
    if nb is None or nb[0] == rank:
        return []
    return [Action("RECV_F" if a.kind == "F" else "RECV_B", a.microbatch, a.chunk, nb[0])]


def with_p2p(orders: list[list[Action]], v: int = 1, groups: list[list[int]] | None = None,
             placement: Placement | None = None,
             overlapped: list[set[tuple[Action, Action]]] | None = None,
             recv_at: Literal["consumer", "sender"] = "consumer") -> Schedule:
    """Insert the point-to-point batches into per-rank compute orders.

    A rank's compute list is cut into consecutive *groups* (``groups[r]`` gives their sizes; default:
    every compute action is its own group). After each group comes one ``P2P`` holding the sends of the
    group's outputs, then the receives of the next group's inputs; a receive that the first group needs
    goes in a batch before it. Interleaved 1F1B uses Megatron's groups (each steady-state forward and
    backward pair is one group, so that a rank's sends of a round go out together with its receives for
    the next round); DualPipeV's overlapped (F, B) pairs are groups too; the other schedules use single
    actions. ``placement`` (default: interleaved with ``v`` chunks) says which neighbour is remote.

    Receives from one peer are always posted in the order that peer sends (the FIFO rule), so a receive
    may come early to keep that order. ``recv_at="consumer"``: each receive goes, at the latest, in the batch
    just before the group that consumes it. ``recv_at="sender"`` (the V schedules): each receive goes in the
    batch before the first group of the receiver that starts, on a unit-cost run of the lists, once the
    sender has posted its send (no later than its consumer), the way torch's ``_add_send_recv`` lowers a
    schedule. On a V two streams flow between the same two ranks (activations down the first leg,
    gradients of the second), and receives posted only at their consumers can then wait, on one in-order
    stream, behind a send the peer has not matched yet.
    """
    p = len(orders)
    place = placement or Placement.interleaved(p, v)
    cuts: list[list[list[Action]]] = []
    for r, order in enumerate(orders):
        sizes = groups[r] if groups is not None else [1] * len(order)
        if sum(sizes) != len(order):
            raise ParallelLabError(f"rank {r}: groups {sizes} do not cover its {len(order)} compute actions")
        cut, start = [], 0
        for n in sizes:
            cut.append(order[start:start + n])
            start += n
        cuts.append(cut)
    # what each rank sends each peer, in order: the receiver posts its receives from that peer in this order
    sent: dict[tuple[int, int], list[tuple[str, int, int]]] = defaultdict(list)
    for r, cut in enumerate(cuts):
        for a in (a for group in cut for a in group):
            for op in _ops_after(a, r, place):
                nb = place.neighbour(r, a.chunk, +1 if a.kind == "F" else -1)
                sent[(r, op.peer)].append(("RECV_F" if a.kind == "F" else "RECV_B", a.microbatch, nb[1]))
    out = Schedule([], place)
    for r, cut in enumerate(cuts):
        actions: list[Action] = []
        pending: list[Action] = []
        posted: dict[int, int] = defaultdict(int)        # peer -> receives from it posted so far
        for group in cut:
            recvs: list[Action] = []
            for op in (op for a in group for op in _ops_before(a, r, place)):
                seq = sent[(op.peer, r)]
                key = (op.kind, op.microbatch, op.chunk)
                if key in seq[:posted[op.peer]]:
                    continue
                if key not in seq[posted[op.peer]:]:     # never sent: validate() will say where and why
                    recvs.append(op)
                    continue
                upto = seq.index(key, posted[op.peer]) + 1
                recvs += [Action(k, mb, c, op.peer) for k, mb, c in seq[posted[op.peer]:upto]]
                posted[op.peer] = upto
            if pending or recvs:
                actions.append(P2P(*(pending + recvs)))
            actions.extend(group)
            pending = [op for a in group for op in _ops_after(a, r, place)]
        if pending:
            actions.append(P2P(*pending))
        out.append(actions)
    out.overlapped = [set(x) for x in overlapped] if overlapped is not None else [set() for _ in range(p)]
    return out if recv_at == "consumer" else _receives_when_sent(out, cuts)


def _receives_when_sent(schedule: Schedule, cuts: list[list[list[Action]]]) -> Schedule:
    """``with_p2p(recv_at="sender")``: move every receive to the batch before the first group of its rank
    that starts (unit costs) once the send is posted; never after its consumer, never before an earlier
    receive from the same peer (FIFO)."""
    place = schedule.placement
    run = execute(schedule, {"F": 1.0, "B": 1.0, "W": 1.0})
    posted: dict[tuple[int, str, int, int], float] = {}         # (receiver, RECV kind, mb, its chunk) -> t
    for r, t0, _t1, op in run.p2p:
        if op.is_send:
            nb = place.neighbour(r, op.chunk, +1 if op.kind == "SEND_F" else -1)
            posted[(op.peer, "RECV_F" if op.kind == "SEND_F" else "RECV_B", op.microbatch, nb[1])] = t0
    start = {(r, a): t0 for r, t0, _t1, a in run.compute}
    out = Schedule([], place, schedule.overlapped)
    for r, (acts, cut) in enumerate(zip(schedule, cuts, strict=True)):
        recvs = [op for a in acts for op in a.ops if not op.is_send]            # FIFO order per peer kept
        consumer = {key: g for g, group in enumerate(cut) for a in group
                    if (key := input_recv(a, r, place.p, place.v, place)) is not None}
        at: dict[int, list[Action]] = defaultdict(list)
        last: dict[int, int] = defaultdict(int)                                 # peer -> group of last recv
        for op in recvs:
            key = (op.kind, op.microbatch, op.chunk)
            t = posted[(r, *key)]
            g = next((g for g, group in enumerate(cut) if start[(r, group[0])] >= t), len(cut))
            g = max(min(g, consumer[key]), last[op.peer])
            last[op.peer] = g
            at[g].append(op)
        actions: list[Action] = []
        pending: list[Action] = []
        for g, group in enumerate(cut):
            if pending or at[g]:
                actions.append(P2P(*(pending + at[g])))
            actions.extend(group)
            pending = [op for a in group for op in _ops_after(a, r, place)]
        if pending:
            actions.append(P2P(*pending))
        out.append(actions)
    return out


def gpipe_order(p: int, m: int) -> list[list[Action]]:
    """GPipe (Huang et al. 2019): all ``m`` forwards, then all ``m`` backwards, on every rank."""
    _check_pm("gpipe", p, m)
    return [[F(i) for i in range(m)] + [B(i) for i in range(m)] for _ in range(p)]


def one_f_one_b_order(p: int, m: int) -> list[list[Action]]:
    """1F1B (PipeDream-Flush): rank ``r`` runs ``min(p - r - 1, m)`` warm-up forwards, then alternates
    one forward and one backward, then drains the remaining backwards."""
    _check_pm("1f1b", p, m)
    orders = []
    for r in range(p):
        w = min(p - r - 1, m)
        order = [F(i) for i in range(w)]
        for i in range(m - w):
            order += [F(w + i), B(i)]
        order += [B(i) for i in range(m - w, m)]
        orders.append(order)
    return orders


def _interleaved_warmup(p: int, m: int, v: int, r: int) -> int:
    """Megatron's warm-up forwards on rank ``r``: ``2 (p - r - 1) + (v - 1) p``, at most ``m v``.

    (Megatron runs all ``m v`` forwards first when ``m == p``, for its blocking exchanges; these lists
    do not need that, :func:`validate` proves them deadlock-free, and it saves memory on later ranks.)
    """
    return min(m * v, 2 * (p - r - 1) + (v - 1) * p)


def _check_interleaved(p: int, m: int, v: int) -> None:
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
    _check_pm("interleaved", p, m, v)
    if v == 1:
        return one_f_one_b_order(p, m)
    _check_interleaved(p, m, v)
    total = m * v

    def fwd(k: int) -> Action:
        return F((k // (p * v)) * p + k % p, (k // p) % v)

    def bwd(k: int) -> Action:
        return B((k // (p * v)) * p + k % p, v - 1 - (k // p) % v)

    orders = []
    for r in range(p):
        warm = _interleaved_warmup(p, m, v, r)
        order = [fwd(k) for k in range(warm)]
        for k in range(total - warm):
            order += [fwd(warm + k), bwd(k)]
        order += [bwd(k) for k in range(total - warm, total)]
        orders.append(order)
    return orders


def zb_h1_order(p: int, m: int) -> list[list[Action]]:
    """ZB-H1 (Qi et al. 2023, section 2.1): 1F1B with the backward split into B (input gradient, on
    the critical path) and W (weight gradient), and rank ``r``'s W passes delayed by ``r`` micro-batches.

    Rank ``r``: ``min(p - r - 1, m)`` warm-up forwards; ``r`` rounds of (F, B) without W; then rounds of
    (F, B, W); then (B, W) while backwards remain; then the remaining W. Every rank then holds at most
    ``p`` micro-batches (counted until their W), the first rank's 1F1B peak, and the delayed W passes
    fill the drain bubble: with F = B = W the bubble is a third of 1F1B's.
    """
    _check_pm("zb-h1", p, m)
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
    _check_pm("zb-v", p, m)
    n = max(m, 2 * p - 1)
    orders = []
    for r in range(p):
        c = _Counter()
        for _ in range(2 * (p - r) - 1):
            c.add("F", 0)
        for _ in range(r):
            c.add("F", 1)
            c.add("F", 0)
        for _ in range(p - r):
            c.add("F", 1)
            c.add("B", 1)
            c.add("W", 1)
        while c.count("F", 1) < c.count("F", 0) or c.count("F", 0) < n:
            if c.count("F", 0) < n:
                c.add("F", 0)
            for chunk in (0, 1):
                if chunk == 1:
                    c.add("F", 1)
                c.add("B", chunk)
                c.add("W", chunk)
        for _ in range(r):
            c.add("B", 0)
            c.add("B", 1)
        for _ in range(p - r):
            c.add("B", 0)
            c.add("W", 0)
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
    _check_pm("dualpipev", p, m)
    if m < 2 * p:
        raise ParallelLabError(f"dualpipev needs at least 2p = {2 * p} micro-batches (one per virtual stage); "
                               f"m={m}; pick m >= {2 * p}")
    orders, pairs = [], []
    for r in range(p):
        c, mine = _Counter(), set()

        def overlap(f_chunk: int, b_chunk: int, c: _Counter = c, mine: set = mine) -> None:
            f = c.add("F", f_chunk)
            mine.add((f, c.add("B", b_chunk, split=False)))

        for _ in range(2 * (p - r - 1)):
            c.add("F", 0)
        for _ in range(r + 1):
            c.add("F", 0)
            c.add("F", 1)
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


def gpipe(p: int, m: int) -> Schedule:
    return with_p2p(gpipe_order(p, m))


def one_f_one_b(p: int, m: int) -> Schedule:
    return with_p2p(one_f_one_b_order(p, m))


def interleaved_1f1b(p: int, m: int, v: int) -> Schedule:
    if v == 1:
        return one_f_one_b(p, m)
    orders = interleaved_order(p, m, v)
    groups = []
    for r in range(p):
        # warm-up forwards one by one, (forward, backward) pairs, then the drain's backwards one by one
        warm = _interleaved_warmup(p, m, v, r)
        groups.append([1] * warm + [2] * (m * v - warm) + [1] * warm)
    return with_p2p(orders, v, groups)


def zb_h1(p: int, m: int) -> Schedule:
    return with_p2p(zb_h1_order(p, m))


def zb_v(p: int, m: int) -> Schedule:
    return with_p2p(zb_v_order(p, m), 2, placement=Placement.v_shape(p), recv_at="sender")


def dualpipev(p: int, m: int) -> Schedule:
    orders, pairs = dualpipev_order(p, m)
    groups = []
    for order, mine in zip(orders, pairs, strict=True):
        sizes, i = [], 0
        while i < len(order):                  # an overlapped (F, B) pair is one group: posted together
            n = 2 if i + 1 < len(order) and (order[i], order[i + 1]) in mine else 1
            sizes.append(n)
            i += n
        groups.append(sizes)
    return with_p2p(orders, 2, groups, Placement.v_shape(p), pairs, recv_at="sender")


V_SCHEDULES: tuple[str, ...] = ("zb-v", "dualpipev")
SCHEDULE_NAMES: tuple[str, ...] = SCHEDULES + V_SCHEDULES   # every name build_schedule knows


def chunks_per_rank(name: str, v: int = 1) -> int:
    """Model chunks one rank holds under schedule ``name``: ``v`` for interleaved, 2 for the V schedules."""
    return 2 if name in V_SCHEDULES else v


def _check_name(name: str, v: int) -> None:
    if name not in SCHEDULE_NAMES:
        raise ParallelLabError(f"schedule {name!r} is not known; pick one of {', '.join(SCHEDULE_NAMES)}")
    if name in V_SCHEDULES:
        if v not in (1, 2):
            raise ParallelLabError(f"{name} places exactly 2 chunks per rank in a V; v={v}: pass v=1 or 2")
    elif v != 1 and name != "interleaved":
        raise ParallelLabError(f"v={v} model chunks per rank needs schedule 'interleaved' (got {name!r}); "
                               "or set v=1")


@functools.lru_cache(maxsize=1024)
def compute_orders(name: str, p: int, m: int, v: int = 1) -> tuple[tuple[Action, ...], ...]:
    """Each rank's compute actions (F, B, W) of :func:`build_schedule`, in order, without the point-to-point
    ops it places between them: all that memory needs (``rank_view.block_inflight``), at a fraction of the cost
    (tests/test_schedules.py checks they are ``build_schedule``'s compute actions)."""
    _check_name(name, v)
    if name == "gpipe":
        orders = gpipe_order(p, m)
    elif name == "1f1b" or (name == "interleaved" and v == 1):
        orders = one_f_one_b_order(p, m)
    elif name == "interleaved":
        orders = interleaved_order(p, m, v)
    elif name == "zb-h1":
        orders = zb_h1_order(p, m)
    elif name == "zb-v":
        orders = zb_v_order(p, m)
    else:
        orders = dualpipev_order(p, m)[0]
    return tuple(tuple(order) for order in orders)


def build_schedule(name: str, p: int, m: int, v: int = 1) -> Schedule:
    """The schedule named ``name``: ``Plan.schedule`` (``gpipe``, ``1f1b``, ``interleaved``, ``zb-h1``) or a V
    schedule (``zb-v``, ``dualpipev``: two chunks per rank by construction, ``v`` is 1 or 2)."""
    _check_name(name, v)
    if name in V_SCHEDULES:
        return zb_v(p, m) if name == "zb-v" else dualpipev(p, m)
    if name == "gpipe":
        return gpipe(p, m)
    if name == "1f1b":
        return one_f_one_b(p, m)
    if name == "interleaved":
        return interleaved_1f1b(p, m, v)
    return zb_h1(p, m)


def messages_at_once(name: str, p: int, m: int, v: int = 1) -> tuple[int, ...]:
    """Per rank, the most point-to-point messages one ``P2P`` batch of :func:`build_schedule` posts together
    (the executor's comm-buffer part ``pp``; ``ledger_buffers.activation_buffer_parts``). In closed form for the
    Plan schedules, as counted on their lists (tests/test_schedules.py checks every ``m`` up to ``4 p``
    against the lists, and interleavings up to ``p = 16``):

    * GPipe: a send and a receive (2); its last rank only receives (1);
    * 1F1B, ZB-H1: 2 on every rank; with one micro-batch the last rank only receives (1);
    * interleaved 1F1B (``m`` a multiple of ``p``): from ``2 p`` micro-batches on a forward's and a
      backward's send and receive go out together (4) on every rank; with ``m = p`` only ranks ``r``
      with ``2 r >= p`` do, ``2 r = p - 1`` posts 3, the others and the last rank 2.

    The V schedules (ZB-V, DualPipeV) are counted on the list of ``min(m, 2 p)`` micro-batches (their
    steady state only repeats beyond ``2 p``)."""
    _check_pm(name, p, m, v)
    if name == "interleaved" and v > 1:
        _check_interleaved(p, m, v)
        if m >= 2 * p:
            return (4,) * p
        return tuple(2 if r == p - 1 else 4 if 2 * r >= p else 3 if 2 * r == p - 1 else 2 for r in range(p))
    if name in ("gpipe", "1f1b", "zb-h1", "interleaved"):
        last = 1 if name == "gpipe" or m == 1 else 2
        return (2,) * (p - 1) + (last,) if p > 1 else (0,)
    return _messages_on_the_list(name, p, min(m, 2 * p), v)


@functools.lru_cache(maxsize=256)
def _messages_on_the_list(name: str, p: int, m: int, v: int) -> tuple[int, ...]:
    return tuple(max((len(a.ops) for a in rank if a.kind == "P2P"), default=0)
                 for rank in build_schedule(name, p, m, v))


# --------------------------------------------------------------------------------------------------
# Shape of a schedule, in-flight micro-batches
# --------------------------------------------------------------------------------------------------

def virtual_stage(rank: int, chunk: int, p: int, placement: Placement | None = None) -> int:
    """The virtual stage of ``chunk`` on pipeline rank ``rank``: ``placement.stage(rank, chunk)``; without a
    placement Megatron's ``chunk * p + rank``."""
    if placement is not None:
        return placement.stage(rank, chunk)
    return chunk * p + rank


def input_recv(a: Action, rank: int, p: int, v: int = 1,
               placement: Placement | None = None) -> tuple[str, int, int] | None:
    """The key ``(kind, microbatch, chunk)`` of the receive whose tensor compute action ``a`` consumes
    (an earlier ``P2P`` of the same rank posted it), or None: the first virtual stage's ``F``, the last
    one's ``B``, every ``W``, everything without a pipeline, and a hand-off between two chunks of the same
    rank (:func:`local_input`) take no input from another rank."""
    if p == 1 or a.kind not in ("F", "B"):
        return None
    place = placement or Placement.interleaved(p, v)
    nb = place.neighbour(rank, a.chunk, -1 if a.kind == "F" else +1)
    if nb is None or nb[0] == rank:
        return None
    return ("RECV_F" if a.kind == "F" else "RECV_B", a.microbatch, a.chunk)


def local_input(a: Action, rank: int, placement: Placement) -> tuple[str, int, int] | None:
    """``(kind, microbatch, chunk)`` of the compute action on the *same* rank whose output ``a`` consumes
    (the V's turn: F of stage ``p`` takes F of stage ``p - 1``'s output, B of stage ``p - 1`` takes B of
    stage ``p``'s input gradient), or None when the input comes from another rank or from nowhere."""
    if a.kind not in ("F", "B"):
        return None
    nb = placement.neighbour(rank, a.chunk, -1 if a.kind == "F" else +1)
    if nb is None or nb[0] != rank:
        return None
    return (a.kind, a.microbatch, nb[1])


def num_chunks(schedule: list[list[Action]]) -> int:
    """``v``: model chunks per rank (the placement's; else 1 + the largest chunk index used)."""
    return placement_of(schedule).v


def num_microbatches(schedule: Schedule) -> int:
    return 1 + max((a.microbatch for acts in schedule for a in acts if a.is_compute), default=-1)


def split_backward(actions: list[Action]) -> set[tuple[int, int]]:
    """The ``(mb, chunk)`` pairs of one rank whose backward is split into B and W."""
    return {(a.microbatch, a.chunk) for a in actions if a.kind == "W"}


def inflight_trace(actions: list[Action]) -> list[int]:
    """The number of ``(mb, chunk)`` pairs in flight after each compute action of one rank's list."""
    split = split_backward(actions)
    n, out = 0, []
    for a in actions:
        if a.kind == "F":
            n += 1
        elif (a.kind == "B" and (a.microbatch, a.chunk) not in split) or a.kind == "W":
            n -= 1
        else:
            continue
        out.append(n)
    return out


def peak_inflight_of(schedule: Schedule) -> list[int]:
    """Per rank, the peak number of ``(mb, chunk)`` pairs whose activations are alive at once."""
    return [max(inflight_trace(acts), default=0) for acts in schedule]


def peak_inflight(name: str, p: int, m: int, v: int = 1, stage: int = 0) -> int:
    """Closed form of :func:`peak_inflight_of` for a generated schedule: ``(mb, chunk)`` pairs alive at
    once on pipeline rank ``stage``. Checked against the action lists in tests/test_schedules.py.

    * GPipe: ``m`` (every forward before any backward).
    * 1F1B: ``min(p - stage, m)`` (the warm-up forwards plus one).
    * interleaved (``v > 1``): ``min(m v, 2 (p - stage - 1) + (v - 1) p + 1)``; divided by ``v`` this is
      Korthikanti et al.'s first-stage factor ``p (1 + (p - 1) / (p v))``. With ``v = 1``: 1F1B.
    * ZB-H1: ``min(p, m)`` on every rank (W delayed by ``stage`` rounds), counted until W.
    * ZB-V (two chunks per rank): ``min(2 p, m + stage + 1, 2 m)``; for ``m >= 2 p - 1`` every rank holds
      ``2 p`` chunk-micro-batches, i.e. ``p`` micro-batches of a whole stage: 1F1B's first-stage peak, as
      Qi et al. 2024 (section 6) state for ZB-V.
    * DualPipeV: ``2 p + 1`` on every rank (``m >= 2 p``): with ``2 p`` stages, DeepSeek-V3's "PP + 1"
      activation figure for DualPipe (section 3.2.1, table 2), one chunk-micro-batch more than ZB-V.
    """
    if not 0 <= stage < p:
        raise ParallelLabError(f"stage={stage} is not a pipeline rank of p={p}; pick stage in 0..{p - 1}")
    if name == "gpipe":
        return m
    if name == "1f1b":
        return min(p - stage, m)
    if name == "interleaved":
        if v == 1:
            return min(p - stage, m)
        return min(m * v, 2 * (p - stage - 1) + (v - 1) * p + 1)
    if name == "zb-h1":
        return min(p, m)
    if name == "zb-v":
        return min(2 * p, m + stage + 1, 2 * m)
    if name == "dualpipev":
        return 2 * p + 1
    raise ParallelLabError(f"schedule {name!r} is not known; pick one of {', '.join(SCHEDULE_NAMES)}")


def head_inflight(name: str, p: int, m: int, v: int = 1) -> int:
    """Micro-batches whose head (logits and loss) the last pipeline rank keeps alive at once.

    The head lives in the last chunk of the last rank. GPipe runs every forward before any backward, so
    it keeps ``m``; ZB-H1 keeps a micro-batch's graph until its delayed W, ``min(p, m)``; 1F1B and
    interleaved 1F1B run each last-chunk forward straight into its backward: 1. ZB-V and DualPipeV put the
    head on rank 0's second chunk and run its B (and W) right after its F: 1. Without a pipeline: 1.
    Checked against the action lists (:func:`inflight_trace` of the last chunk) in tests/test_schedules.py.
    """
    if p == 1:
        return 1
    if name == "gpipe":
        return m
    if name == "zb-h1":
        return min(p, m)
    if name in ("1f1b", "interleaved") + V_SCHEDULES:
        return 1
    raise ParallelLabError(f"schedule {name!r} is not known; pick one of {', '.join(SCHEDULE_NAMES)}")


def peak_activation_units(name: str, p: int, m: int, v: int = 1, stage: int = 0) -> float:
    """Peak activation memory of pipeline rank ``stage`` in units of one micro-batch's activations of the
    whole stage (all its chunks, ``v``, or 2 for the V schedules): ``peak_inflight / chunks``, each chunk
    holding ``1/chunks`` of the layers.

    This is the factor the memory ledger multiplies one micro-batch's per-stage activations by.
    """
    return peak_inflight(name, p, m, v, stage) / chunks_per_rank(name, v)


# --------------------------------------------------------------------------------------------------
# Validation
# --------------------------------------------------------------------------------------------------

def _where(rank: int, idx: int, a: Action) -> str:
    return f"rank {rank}, action {idx} {a}"


def _static_checks(schedule: Schedule) -> None:
    """Per-rank order rules, shape of the actions, once-only compute, data availability, lifetimes."""
    p = len(schedule)
    if p == 0:
        raise ParallelLabError("empty schedule: give one action list per pipeline rank")
    place = placement_of(schedule)
    if place.p != p:
        raise ParallelLabError(f"the placement has {place.p} ranks but the schedule {p} action lists; give one "
                               "list per rank of the placement")
    v = place.v
    m = num_microbatches(schedule)
    for r, acts in enumerate(schedule):
        done: dict[str, set[tuple[int, int]]] = {"F": set(), "B": set(), "W": set()}
        received: dict[str, set[tuple[int, int]]] = {"RECV_F": set(), "RECV_B": set()}
        needs_send: dict[str, dict[tuple[int, int], int]] = {"SEND_F": {}, "SEND_B": {}}   # -> producer index
        split = split_backward(acts)
        for i, a in enumerate(acts):
            if a.kind == "P2P":
                if not a.ops:
                    raise ParallelLabError(f"{_where(r, i, a)}: an empty P2P batch; remove it")
                for op in a.ops:
                    if op.kind not in P2P_OP_KINDS:
                        raise ParallelLabError(f"{_where(r, i, a)}: {op} is not a point-to-point op; "
                                               f"a P2P batch holds only {', '.join(P2P_OP_KINDS)}")
                    if op.peer is None or not 0 <= op.peer < p:
                        raise ParallelLabError(f"{_where(r, i, a)}: {op} has peer={op.peer}; "
                                               f"pick another rank in 0..{p - 1}")
                    key = (op.microbatch, op.chunk)
                    if not 0 <= op.microbatch < m or not 0 <= op.chunk < v:
                        raise ParallelLabError(f"{_where(r, i, a)}: {op} names micro-batch or chunk out of "
                                               f"range (mb in 0..{m - 1}, chunk in 0..{v - 1})")
                    s = place.stage(r, op.chunk)
                    step = +1 if op.kind in ("SEND_F", "RECV_B") else -1
                    nb = place.neighbour(r, op.chunk, step)
                    if nb is None:
                        raise ParallelLabError(f"{_where(r, i, a)}: {op}: virtual stage {s} is the "
                                               f"{'last' if step > 0 else 'first'} one, there is no stage "
                                               f"{s + step} to talk to; remove the op")
                    if nb[0] == r:
                        raise ParallelLabError(f"{_where(r, i, a)}: {op}: virtual stage {s + step} is on this "
                                               "rank too, the tensor is handed over locally; remove the op")
                    if op.peer != nb[0]:
                        raise ParallelLabError(f"{_where(r, i, a)}: {op} talks to rank {op.peer}, but "
                                               f"virtual stage {s}'s neighbour {s + step} lives on rank {nb[0]}")
                    if op.kind in received:
                        if key in received[op.kind]:
                            raise ParallelLabError(f"{_where(r, i, a)}: {op} receives the same tensor twice")
                        received[op.kind].add(key)
                    else:
                        src = "F" if op.kind == "SEND_F" else "B"
                        if key not in done[src]:
                            raise ParallelLabError(f"{_where(r, i, a)}: {op} sends a tensor before its "
                                                   f"{src}(mb={key[0]}, chunk={key[1]}) has computed it")
                        if key not in needs_send[op.kind]:
                            raise ParallelLabError(f"{_where(r, i, a)}: {op} is sent twice or not needed")
                        needs_send[op.kind].pop(key)
                continue
            if a.kind not in COMPUTE_KINDS:
                raise ParallelLabError(f"{_where(r, i, a)}: point-to-point ops must sit inside a P2P batch; "
                                       f"write P2P({a})")
            key = (a.microbatch, a.chunk)
            if not 0 <= a.microbatch < m or not 0 <= a.chunk < v:
                raise ParallelLabError(f"{_where(r, i, a)}: micro-batch or chunk out of range")
            if key in done[a.kind]:
                raise ParallelLabError(f"{_where(r, i, a)}: {a.kind} of (mb={key[0]}, chunk={key[1]}) "
                                       "is done twice")
            prev, nxt = place.neighbour(r, a.chunk, -1), place.neighbour(r, a.chunk, +1)
            s = place.stage(r, a.chunk)
            if a.kind == "F":
                if prev is not None and prev[0] == r and (key[0], prev[1]) not in done["F"]:
                    raise ParallelLabError(f"{_where(r, i, a)}: forward before its input: F(mb={key[0]}, "
                                           f"chunk={prev[1]}) of this rank (virtual stage {s - 1}) has not run")
                if prev is not None and prev[0] != r and key not in received["RECV_F"]:
                    raise ParallelLabError(f"{_where(r, i, a)}: forward before its input activations were "
                                           f"received (no earlier RECV_F(mb={key[0]}, chunk={key[1]}))")
                if nxt is not None and nxt[0] != r:
                    needs_send["SEND_F"][key] = i
            elif a.kind == "B":
                if key not in done["F"]:
                    raise ParallelLabError(f"{_where(r, i, a)}: backward before its forward")
                if nxt is not None and nxt[0] == r and (key[0], nxt[1]) not in done["B"]:
                    raise ParallelLabError(f"{_where(r, i, a)}: backward before its output gradient: "
                                           f"B(mb={key[0]}, chunk={nxt[1]}) of this rank (virtual stage "
                                           f"{s + 1}) has not run")
                if nxt is not None and nxt[0] != r and key not in received["RECV_B"]:
                    raise ParallelLabError(f"{_where(r, i, a)}: backward before its output gradient was "
                                           f"received (no earlier RECV_B(mb={key[0]}, chunk={key[1]}))")
                if prev is not None and prev[0] != r:
                    needs_send["SEND_B"][key] = i
            else:  # W
                if key not in done["B"]:
                    raise ParallelLabError(f"{_where(r, i, a)}: weight-gradient pass W before its B")
            done[a.kind].add(key)
        # every (mb, chunk) of this rank done exactly once, activations freed at the end
        want_all = {(mb, c) for mb in range(m) for c in range(v)}
        for kind in ("F", "B"):
            missing = sorted(want_all - done[kind])
            if missing:
                mb, c = missing[0]
                raise ParallelLabError(f"rank {r}: {kind}(mb={mb}, chunk={c}) never runs; each (micro-batch, "
                                       f"chunk) needs one F and one B on every rank")
        if split - done["B"] or split != done["W"]:
            raise ParallelLabError(f"rank {r}: W passes {sorted(done['W'])} do not match the split backwards")
        unsent = sorted((i, kind, key) for kind, left in needs_send.items() for key, i in left.items())
        if unsent:
            i, kind, (mb, c) = unsent[0]
            nb = place.neighbour(r, c, +1 if kind == "SEND_F" else -1)
            raise ParallelLabError(f"{_where(r, i, acts[i])}: its output is never sent (no "
                                   f"{kind}(mb={mb}, chunk={c}, peer={nb[0]}) in a later P2P)")
        trace = inflight_trace(acts)
        if trace and trace[-1] != 0:
            raise ParallelLabError(f"rank {r}: {trace[-1]} micro-batch activations still alive at the end")


def _channels(schedule: Schedule) -> tuple[dict, dict]:
    """FIFO queues per ordered pair (src, dst): sends and receives in posting order."""
    sends: dict[tuple[int, int], list[tuple[int, int, Action]]] = defaultdict(list)
    recvs: dict[tuple[int, int], list[tuple[int, int, Action]]] = defaultdict(list)
    for r, acts in enumerate(schedule):
        for i, a in enumerate(acts):
            for op in a.ops:
                if op.is_send:
                    sends[(r, op.peer)].append((r, i, op))
                else:
                    recvs[(op.peer, r)].append((r, i, op))
    return sends, recvs


def _match_checks(schedule: Schedule) -> None:
    """Every receive matched by the send of the same tensor, in FIFO order per pair of ranks."""
    place = placement_of(schedule)
    sends, recvs = _channels(schedule)
    for pair in sorted(set(sends) | set(recvs)):
        ss, rr = sends.get(pair, []), recvs.get(pair, [])
        for k in range(max(len(ss), len(rr))):
            if k >= len(ss):
                r, i, op = rr[k]
                raise ParallelLabError(f"{_where(r, i, schedule[r][i])}: {op} has no matching send on rank "
                                       f"{pair[0]} (it sends {len(ss)} tensors to rank {pair[1]})")
            if k >= len(rr):
                r, i, op = ss[k]
                raise ParallelLabError(f"{_where(r, i, schedule[r][i])}: {op} has no matching receive on "
                                       f"rank {pair[1]} (it receives {len(rr)} tensors from rank {pair[0]})")
            (sr, si, s), (rr_, ri, rc) = ss[k], rr[k]
            s_stage, r_stage = place.stage(sr, s.chunk), place.stage(rr_, rc.chunk)
            ok = s.microbatch == rc.microbatch and (
                (s.kind == "SEND_F" and rc.kind == "RECV_F" and r_stage == s_stage + 1)
                or (s.kind == "SEND_B" and rc.kind == "RECV_B" and r_stage == s_stage - 1))
            if not ok:
                raise ParallelLabError(
                    f"{_where(rr_, ri, schedule[rr_][ri])}: receive #{k} from rank {sr} is {rc}, but rank "
                    f"{sr}'s send #{k} to rank {rr_} is {s} (action {si}); sends and receives between two "
                    f"ranks are matched in order, so swap them back")


@dataclass
class Execution:
    """What running a schedule under the point-to-point rules produced.

    ``compute``: ``(rank, start, end, action)`` of every F, B, W. ``p2p``: ``(rank, posted, completed,
    op)`` of every point-to-point op. ``finish``: per rank, when its last action and its last send are
    done (the step ends at the largest).
    """

    compute: list[tuple[int, float, float, Action]]
    p2p: list[tuple[int, float, float, Action]]
    finish: list[float]


def _input_key(a: Action) -> tuple[str, int, int]:
    return ("RECV_F" if a.kind == "F" else "RECV_B", a.microbatch, a.chunk)


def execute(schedule: Schedule, cost: dict[str, float] | Callable[[int, Action], float],
            p2p_time: float = 0.0, in_order: bool = False) -> Execution:
    """Run the lists under the module's point-to-point rules and time them.

    A compute action takes ``cost[kind]`` (or ``cost(rank, action)``) and starts when its rank is free
    and the receive of its input has completed. A ``P2P`` batch takes no time on its rank: its ops are
    posted at the rank's clock. A send and its receive complete together at
    ``max(send posted, receive posted) + p2p_time``.
    With ``in_order=True`` a rank's batches also complete one after another (``batch j`` no earlier than
    ``batch j - 1``, and only once all ops of both are matched): the stricter behaviour of a single
    NCCL stream, used by :func:`validate` as a second deadlock check.

    Raises ParallelLabError naming every waiting rank when none can progress (deadlock).
    """
    p = len(schedule)
    cost_of = cost if callable(cost) else (lambda _r, a: cost[a.kind])
    # FIFO slot of every op: (pair, k, is_send); key (rank, action index, op index)
    slot: dict[tuple[int, int, int], tuple[tuple[int, int], int, bool]] = {}
    counters: dict[tuple[tuple[int, int], bool], int] = defaultdict(int)
    where_recv: list[dict[tuple[str, int, int], tuple[int, int]]] = [{} for _ in range(p)]
    batches: list[list[int]] = [[] for _ in range(p)]       # action indices of P2P batches per rank
    batch_of: list[dict[int, int]] = [{} for _ in range(p)]  # action index -> batch number
    for r, acts in enumerate(schedule):
        for i, a in enumerate(acts):
            if a.kind == "P2P":
                batch_of[r][i] = len(batches[r])
                batches[r].append(i)
            for j, op in enumerate(a.ops):
                pair = (r, op.peer) if op.is_send else (op.peer, r)
                k = counters[(pair, op.is_send)]
                counters[(pair, op.is_send)] += 1
                slot[(r, i, j)] = (pair, k, op.is_send)
                if not op.is_send:
                    where_recv[r][(op.kind, op.microbatch, op.chunk)] = (i, j)
    posted: dict[tuple[tuple[int, int], int, bool], float] = {}
    batch_done: list[list[float]] = [[] for _ in range(p)]   # completion times, filled in order

    def op_done(r: int, i: int, j: int) -> float | None:
        pair, k, is_send = slot[(r, i, j)]
        mine, theirs = posted.get((pair, k, is_send)), posted.get((pair, k, not is_send))
        if mine is None or theirs is None:
            return None
        return max(mine, theirs) + p2p_time

    def batch_completion(r: int, b: int) -> float | None:
        """In-order completion time of rank r's batch b (None while some op is unmatched)."""
        while len(batch_done[r]) <= b:
            nb = len(batch_done[r])
            i = batches[r][nb]
            if (r, i, 0) not in slot or posted.get(slot[(r, i, 0)]) is None:
                return None
            t = batch_done[r][-1] if batch_done[r] else 0.0
            for j in range(len(schedule[r][i].ops)):
                d = op_done(r, i, j)
                if d is None:
                    return None
                t = max(t, d)
            batch_done[r].append(t)
        return batch_done[r][b]

    pc = [0] * p
    clock = [0.0] * p
    compute: list[tuple[int, float, float, Action]] = []
    remaining = sum(len(a) for a in schedule)
    while remaining:
        progressed = False
        for r in range(p):
            acts = schedule[r]
            while pc[r] < len(acts):
                i = pc[r]
                a = acts[i]
                if a.kind == "P2P":
                    for j in range(len(a.ops)):
                        posted[slot[(r, i, j)]] = clock[r]
                else:
                    ready = clock[r]
                    src = where_recv[r].get(_input_key(a)) if a.kind in ("F", "B") else None
                    if src is not None:
                        done = batch_completion(r, batch_of[r][src[0]]) if in_order else op_done(r, *src)
                        if done is None:
                            break
                        ready = max(ready, done)
                    clock[r] = ready + cost_of(r, a)
                    compute.append((r, ready, clock[r], a))
                pc[r] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            blocked = [f"rank {r} waits at action {pc[r]} {schedule[r][pc[r]]}" for r in range(p)
                       if pc[r] < len(schedule[r])]
            raise ParallelLabError("deadlock: every waiting rank needs a tensor from a rank that is itself "
                                   "waiting: " + "; ".join(blocked))
    p2p: list[tuple[int, float, float, Action]] = []
    finish = list(clock)
    for r, acts in enumerate(schedule):
        for b, i in enumerate(batches[r]):
            for j, op in enumerate(acts[i].ops):
                d = batch_completion(r, b) if in_order else op_done(r, i, j)
                if d is None:
                    raise ParallelLabError(f"{_where(r, i, acts[i])}: {op} is never matched")
                p2p.append((r, posted[slot[(r, i, j)]], d, op))
                finish[r] = max(finish[r], d)
    return Execution(compute, p2p, finish)


def validate(schedule: Schedule) -> Schedule:
    """Prove a schedule executable under the module's point-to-point semantics; return it.

    Checks, raising ParallelLabError that names the offending action: per-rank order (every B after
    its F and after the receive of its output gradient, W after its B, every F after the receive of its
    input), each (micro-batch, chunk) forwarded and backwarded exactly once on every rank, every output
    sent once, every receive matched by the send of the same tensor in FIFO order, activations all freed
    at the end, and no deadlock (by executing the lists with the rendezvous rules).
    """
    _static_checks(schedule)
    _match_checks(schedule)
    unit = {"F": 1.0, "B": 1.0, "W": 1.0}
    execute(schedule, unit)
    execute(schedule, unit, in_order=True)
    return schedule
