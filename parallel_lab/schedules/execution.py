"""Running the action lists under the point-to-point rules, with a cost per action: ``execute``.

A compute action takes ``cost[kind]`` and starts when its rank is free and the receive of its input has
completed; a ``P2P`` batch posts its ops at the rank's clock and takes no time; a send and its receive
complete together at ``max(posted, posted') + t_p2p`` (rendezvous, FIFO matching per ordered pair of
ranks). ``in_order=True`` adds the rule of a single NCCL stream: a rank's batches complete one after
another. The simulator, the validator and the V lists' receive placement all run on it. The rules and
their source (the Zero Bubble authors' Megatron runtime): ``docs/schedules.md``.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass

from ..errors import ParallelLabError
from .actions import Action, Schedule, where


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
                    raise ParallelLabError(f"{where(r, i, acts[i])}: {op} is never matched")
                p2p.append((r, posted[slot[(r, i, j)]], d, op))
                finish[r] = max(finish[r], d)
    return Execution(compute, p2p, finish)
