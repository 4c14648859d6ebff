"""Point-to-point insertion: the ``P2P`` batches between a rank's compute actions (``with_p2p``).

A rank's compute list is cut into groups; after each group one ``P2P`` holds the sends of the group's
outputs and the receives of the next group's inputs. Receives from one peer are posted in the order that
peer sends (FIFO), early if need be. On a V the receives are posted when the sender sends
(``recv_at="sender"``, as torch's ``_add_send_recv`` lowers a schedule). Two consecutive stages on one rank
hand the tensor over locally (:func:`local_input`): no op. Why groups and early receives avoid deadlock:
``docs/schedules.md``.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Literal

from ..errors import ParallelLabError
from .actions import P2P, Action, Placement, Schedule
from .execution import execute


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
        posted: dict[int, int] = defaultdict(int)        # peer -> receives from it posted so far
        before: list[list[Action]] = []                  # per group, the receives posted just before it
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
            before.append(recvs)
        out.append(_batched(cut, before, r, place))
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
        out.append(_batched(cut, [at[g] for g in range(len(cut))], r, place))
    return out


def _batched(cut: list[list[Action]], before: list[list[Action]], rank: int, place: Placement) -> list[Action]:
    """Rank ``rank``'s list: before each group one ``P2P`` with the previous group's sends and the receives
    ``before`` it (none when both are empty), after the last group one with its sends."""
    actions: list[Action] = []
    pending: list[Action] = []
    for group, recvs in zip(cut, before, strict=True):
        if pending or recvs:
            actions.append(P2P(*(pending + recvs)))
        actions.extend(group)
        pending = [op for a in group for op in _ops_after(a, rank, place)]
    if pending:
        actions.append(P2P(*pending))
    return actions


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
