"""Timelines: what each rank did when, as ``simulate.Interval`` records (the simulator's own type).

``with timeline.span("F", micro_batch=3): ...`` records one compute interval of this rank; the training
step marks every forward (``F``), backward (``B``; ``W`` for a split weight pass) and optimizer step, and
the pipeline executor its whole action list (kind ``"pipeline"``). Traced calls become ``"comm"``
intervals (:meth:`Timeline.with_comm`), named ``dim:kind``.

The clock is ``time.perf_counter``, CLOCK_MONOTONIC on Linux, shared by the processes of one machine, so
the intervals of several ranks can be put on one axis (:func:`align`) and read with the simulator's
definitions (``simulate.timeline_stats``: bubble ratio and idle fraction).
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import replace

from parallel_lab.distributed.instruments.tracer import TracedCall
from parallel_lab.simulate import Interval


class Timeline:
    """One rank's intervals; ``with timeline.span("F", micro_batch=3): ...`` records one."""

    def __init__(self, rank: int):
        self.rank = rank
        self.spans: list[Interval] = []

    @contextmanager
    def span(self, name: str, kind: str = "compute", micro_batch: int | None = None,
             stage: int | None = None) -> Iterator[None]:
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.spans.append(Interval(self.rank, kind, name, t0, time.perf_counter(), micro_batch,
                                       stage=stage))

    def with_comm(self, events: Iterable[TracedCall]) -> list[Interval]:
        """This timeline's intervals plus one "comm" interval per finished traced call, sorted by start."""
        comm = [Interval(e.rank, "comm", f"{e.dim}:{e.kind}", e.t_start, e.t_end) for e in events
                if e.t_end is not None]
        return sorted(self.spans + comm, key=lambda s: s.t_start)


def align(spans: Iterable[Interval]) -> list[Interval]:
    """Intervals of several ranks shifted so that the earliest start is 0 (seconds)."""
    spans = list(spans)
    if not spans:
        return []
    t0 = min(s.t_start for s in spans)
    return [replace(s, t_start=s.t_start - t0, t_end=s.t_end - t0) for s in spans]
