"""Static checks of a schedule and ``validate``: proof that the lists run under the point-to-point rules.

:func:`static_checks`: per-rank order (every B after its F and after the receive of its output gradient, W
after its B, every F after the receive of its input), each (micro-batch, chunk) run once on every rank,
every output sent once, activations freed at the end. :func:`match_checks`: every receive matched by the
send of the same tensor, FIFO per ordered pair of ranks. :func:`validate` adds both deadlock checks
(:func:`~.execution.execute`, free and in order). The rules: ``docs/schedules.md``.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

from ..errors import ParallelLabError
from .actions import (
    COMPUTE_KINDS,
    P2P_OP_KINDS,
    Action,
    Placement,
    Schedule,
    num_microbatches,
    placement_of,
    where,
)
from .execution import execute
from .inflight import inflight_trace, split_backward


@dataclass
class _Rank:
    """What one rank's list has done so far, while :func:`static_checks` walks it."""

    done: dict[str, set[tuple[int, int]]] = field(default_factory=lambda: {"F": set(), "B": set(), "W": set()})
    received: dict[str, set[tuple[int, int]]] = field(default_factory=lambda: {"RECV_F": set(), "RECV_B": set()})
    needs_send: dict[str, dict[tuple[int, int], int]] = field(                        # -> producer index
        default_factory=lambda: {"SEND_F": {}, "SEND_B": {}})


def static_checks(schedule: Schedule) -> None:
    """Per-rank order rules, shape of the actions, once-only compute, data availability, lifetimes."""
    p = len(schedule)
    if p == 0:
        raise ParallelLabError("empty schedule: give one action list per pipeline rank")
    place = placement_of(schedule)
    if place.p != p:
        raise ParallelLabError(f"the placement has {place.p} ranks but the schedule {p} action lists; give one "
                               "list per rank of the placement")
    m = num_microbatches(schedule)
    for r, acts in enumerate(schedule):
        st = _Rank()
        for i, a in enumerate(acts):
            if a.kind == "P2P":
                if not a.ops:
                    raise ParallelLabError(f"{where(r, i, a)}: an empty P2P batch; remove it")
                for op in a.ops:
                    _check_op(r, i, a, op, st, place, m)
                continue
            if a.kind not in COMPUTE_KINDS:
                raise ParallelLabError(f"{where(r, i, a)}: point-to-point ops must sit inside a P2P batch; "
                                       f"write P2P({a})")
            _check_compute(r, i, a, st, place, m)
        _check_rank_end(r, acts, st, place, m)


def _check_op(r: int, i: int, a: Action, op: Action, st: _Rank, place: Placement, m: int) -> None:
    """One point-to-point op of rank ``r``'s batch ``a``: its kind, peer and tensor, sent once, received once."""
    p, v = place.p, place.v
    if op.kind not in P2P_OP_KINDS:
        raise ParallelLabError(f"{where(r, i, a)}: {op} is not a point-to-point op; "
                               f"a P2P batch holds only {', '.join(P2P_OP_KINDS)}")
    if op.peer is None or not 0 <= op.peer < p:
        raise ParallelLabError(f"{where(r, i, a)}: {op} has peer={op.peer}; "
                               f"pick another rank in 0..{p - 1}")
    key = (op.microbatch, op.chunk)
    if not 0 <= op.microbatch < m or not 0 <= op.chunk < v:
        raise ParallelLabError(f"{where(r, i, a)}: {op} names micro-batch or chunk out of "
                               f"range (mb in 0..{m - 1}, chunk in 0..{v - 1})")
    s = place.stage(r, op.chunk)
    step = +1 if op.kind in ("SEND_F", "RECV_B") else -1
    nb = place.neighbour(r, op.chunk, step)
    if nb is None:
        raise ParallelLabError(f"{where(r, i, a)}: {op}: virtual stage {s} is the "
                               f"{'last' if step > 0 else 'first'} one, there is no stage "
                               f"{s + step} to talk to; remove the op")
    if nb[0] == r:
        raise ParallelLabError(f"{where(r, i, a)}: {op}: virtual stage {s + step} is on this "
                               "rank too, the tensor is handed over locally; remove the op")
    if op.peer != nb[0]:
        raise ParallelLabError(f"{where(r, i, a)}: {op} talks to rank {op.peer}, but "
                               f"virtual stage {s}'s neighbour {s + step} lives on rank {nb[0]}")
    if op.kind in st.received:
        if key in st.received[op.kind]:
            raise ParallelLabError(f"{where(r, i, a)}: {op} receives the same tensor twice")
        st.received[op.kind].add(key)
        return
    src = "F" if op.kind == "SEND_F" else "B"
    if key not in st.done[src]:
        raise ParallelLabError(f"{where(r, i, a)}: {op} sends a tensor before its "
                               f"{src}(mb={key[0]}, chunk={key[1]}) has computed it")
    if key not in st.needs_send[op.kind]:
        raise ParallelLabError(f"{where(r, i, a)}: {op} is sent twice or not needed")
    st.needs_send[op.kind].pop(key)


#: F and B: the neighbouring virtual stage their input comes from (-1 the previous, +1 the next; the result
#: goes to the other), what they would run before, and how their input arrives.
_INPUT = {"F": (-1, "forward before its input", "activations were"),
          "B": (+1, "backward before its output gradient", "was")}


def _check_compute(r: int, i: int, a: Action, st: _Rank, place: Placement, m: int) -> None:
    """One F, B or W of rank ``r``: in range, run once, after its input (received or handed over locally)."""
    key = (a.microbatch, a.chunk)
    if not 0 <= a.microbatch < m or not 0 <= a.chunk < place.v:
        raise ParallelLabError(f"{where(r, i, a)}: micro-batch or chunk out of range")
    done = st.done
    if key in done[a.kind]:
        raise ParallelLabError(f"{where(r, i, a)}: {a.kind} of (mb={key[0]}, chunk={key[1]}) "
                               "is done twice")
    if a.kind in _INPUT:
        if a.kind == "B" and key not in done["F"]:
            raise ParallelLabError(f"{where(r, i, a)}: backward before its forward")
        step, waits, arrived = _INPUT[a.kind]
        src, dst = place.neighbour(r, a.chunk, step), place.neighbour(r, a.chunk, -step)
        if src is not None and src[0] == r and (key[0], src[1]) not in done[a.kind]:
            raise ParallelLabError(f"{where(r, i, a)}: {waits}: {a.kind}(mb={key[0]}, chunk={src[1]}) of this "
                                   f"rank (virtual stage {place.stage(r, a.chunk) + step}) has not run")
        if src is not None and src[0] != r and key not in st.received[f"RECV_{a.kind}"]:
            raise ParallelLabError(f"{where(r, i, a)}: {waits} {arrived} received (no earlier "
                                   f"RECV_{a.kind}(mb={key[0]}, chunk={key[1]}))")
        if dst is not None and dst[0] != r:
            st.needs_send[f"SEND_{a.kind}"][key] = i
    elif key not in done["B"]:  # W
        raise ParallelLabError(f"{where(r, i, a)}: weight-gradient pass W before its B")
    done[a.kind].add(key)


def _check_rank_end(r: int, acts: list[Action], st: _Rank, place: Placement, m: int) -> None:
    """At the end of rank ``r``'s list: every (mb, chunk) done exactly once, every output sent, nothing alive."""
    done = st.done
    want_all = {(mb, c) for mb in range(m) for c in range(place.v)}
    for kind in ("F", "B"):
        missing = sorted(want_all - done[kind])
        if missing:
            mb, c = missing[0]
            raise ParallelLabError(f"rank {r}: {kind}(mb={mb}, chunk={c}) never runs; each (micro-batch, "
                                   f"chunk) needs one F and one B on every rank")
    split = split_backward(acts)
    if split - done["B"] or split != done["W"]:
        raise ParallelLabError(f"rank {r}: W passes {sorted(done['W'])} do not match the split backwards")
    unsent = sorted((i, kind, key) for kind, left in st.needs_send.items() for key, i in left.items())
    if unsent:
        i, kind, (mb, c) = unsent[0]
        nb = place.neighbour(r, c, +1 if kind == "SEND_F" else -1)
        raise ParallelLabError(f"{where(r, i, acts[i])}: its output is never sent (no "
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


def match_checks(schedule: Schedule) -> None:
    """Every receive matched by the send of the same tensor, in FIFO order per pair of ranks."""
    place = placement_of(schedule)
    sends, recvs = _channels(schedule)
    for pair in sorted(set(sends) | set(recvs)):
        ss, rr = sends.get(pair, []), recvs.get(pair, [])
        for k in range(max(len(ss), len(rr))):
            if k >= len(ss):
                r, i, op = rr[k]
                raise ParallelLabError(f"{where(r, i, schedule[r][i])}: {op} has no matching send on rank "
                                       f"{pair[0]} (it sends {len(ss)} tensors to rank {pair[1]})")
            if k >= len(rr):
                r, i, op = ss[k]
                raise ParallelLabError(f"{where(r, i, schedule[r][i])}: {op} has no matching receive on "
                                       f"rank {pair[1]} (it receives {len(rr)} tensors from rank {pair[0]})")
            (sr, si, s), (rr_, ri, rc) = ss[k], rr[k]
            s_stage, r_stage = place.stage(sr, s.chunk), place.stage(rr_, rc.chunk)
            ok = s.microbatch == rc.microbatch and (
                (s.kind == "SEND_F" and rc.kind == "RECV_F" and r_stage == s_stage + 1)
                or (s.kind == "SEND_B" and rc.kind == "RECV_B" and r_stage == s_stage - 1))
            if not ok:
                raise ParallelLabError(
                    f"{where(rr_, ri, schedule[rr_][ri])}: receive #{k} from rank {sr} is {rc}, but rank "
                    f"{sr}'s send #{k} to rank {rr_} is {s} (action {si}); sends and receives between two "
                    f"ranks are matched in order, so swap them back")


def validate(schedule: Schedule) -> Schedule:
    """Prove a schedule executable under the module's point-to-point semantics; return it.

    Checks, raising ParallelLabError that names the offending action: per-rank order (every B after
    its F and after the receive of its output gradient, W after its B, every F after the receive of its
    input), each (micro-batch, chunk) forwarded and backwarded exactly once on every rank, every output
    sent once, every receive matched by the send of the same tensor in FIFO order, activations all freed
    at the end, and no deadlock (by executing the lists with the rendezvous rules).
    """
    static_checks(schedule)
    match_checks(schedule)
    unit = {"F": 1.0, "B": 1.0, "W": 1.0}
    execute(schedule, unit)
    execute(schedule, unit, in_order=True)
    return schedule
