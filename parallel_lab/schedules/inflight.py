"""In-flight micro-batches of a schedule, their peaks in closed form, and messages posted at once.

A ``(mb, c)`` pair is *in flight* on its rank from its ``F`` until its last backward part (``W`` when
the backward is split, else ``B``); its saved activations are then freed. ZB-H1's ``W`` keeps only the
inputs of the linear layers, but counting them until ``W`` is the paper's own bound (Qi et al. 2023:
peak memory no greater than 1F1B's). The closed forms (:func:`peak_inflight`, :func:`head_inflight`,
:func:`messages_at_once`) are what the ledger multiplies by; tests/test_schedules.py checks them against
the action lists.
"""

from __future__ import annotations

import functools

from ..errors import ParallelLabError
from .actions import Action, Schedule
from .generators import SCHEDULE_NAMES, V_SCHEDULES, build_schedule, chunks_per_rank
from .orders import check_interleaved, check_pm


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
    check_pm(name, p, m, v)
    if name == "interleaved" and v > 1:
        check_interleaved(p, m, v)
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
