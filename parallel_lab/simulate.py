"""Timeline simulator: a schedule (per-rank action lists) plus per-action costs -> when each action runs.

The lists run under the point-to-point rules of :mod:`parallel_lab.schedules` (docs/schedules.md). Costs are
per action (one micro-batch through one model chunk): ``f`` forward, ``b`` input-gradient backward, ``w``
weight-gradient backward (an unsplit backward costs ``b + w``), ``p2p`` one message.

Figures, both printed and named (:data:`BUBBLE_DEFINITIONS`):

* ``bubble_ratio = (step_time - C) / C`` over the busiest rank's compute ``C`` (Narayanan et al. 2021):
  GPipe and 1F1B ``(p - 1) / m``, interleaved ``(p - 1) / (v m)``, ZB-H1 a third of 1F1B's when
  ``f = b = w`` (Qi et al. 2024); ZB-V ``(p - 1) / (6 m)`` and DualPipeV ``(p - 1) / (3 m)`` once the V
  is full. :func:`bubble_closed_form` holds each expression with its conditions.
* ``idle_fraction``: idle time of all ranks over ``p * step_time`` (``(p - 1) / (m + p - 1)`` for 1F1B,
  what a profiler shows); ``peak_inflight``: the (micro-batch, chunk) pairs alive per rank.

The derivations of the V schedules' expressions are in docs/simulator.md.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from .errors import ParallelLabError
from .schedules.actions import Action, Schedule, num_chunks, placement_of
from .schedules.execution import execute
from .schedules.generators import SCHEDULE_NAMES, build_schedule
from .schedules.inflight import peak_inflight_of, split_backward

BUBBLE_DEFINITIONS: dict[str, str] = {
    "bubble_ratio": "bubble time / ideal compute time of the busiest rank",
    "idle_fraction": "idle time of all ranks / (p x step time)",
}


@dataclass(frozen=True)
class Costs:
    """Time of one action (one micro-batch through one model chunk), in any unit."""

    f: float = 1.0
    b: float = 1.0
    w: float = 1.0
    p2p: float = 0.0

    def __post_init__(self) -> None:
        for name in ("f", "b"):
            if not getattr(self, name) > 0:
                raise ParallelLabError(f"Costs.{name}={getattr(self, name)} must be > 0; e.g. {name}=1")
        for name in ("w", "p2p"):
            if getattr(self, name) < 0:
                raise ParallelLabError(f"Costs.{name}={getattr(self, name)} must be >= 0; e.g. {name}=0")

    @property
    def full_backward(self) -> float:
        return self.b + self.w


@dataclass(frozen=True)
class Interval:
    """One interval on one rank's timeline: simulated here, measured by ``distributed.instruments``.

    ``kind``: ``"compute"`` for an action (``name`` ``F``, ``B`` or ``W``; ``"step"`` for the optimizer
    step), ``"comm"`` for a traced call (``name`` ``dim:kind``), ``"pipeline"`` for a whole action list.
    ``micro_batch`` and ``chunk`` (the rank's model chunk) locate an action; ``stage`` is its virtual
    stage ``chunk * p + rank``. Times in any unit (the simulator's cost unit, or seconds).
    """

    rank: int
    kind: str
    name: str
    t_start: float
    t_end: float
    micro_batch: int | None = None
    chunk: int | None = None
    stage: int | None = None

    @property
    def duration(self) -> float:
        return self.t_end - self.t_start

    def as_row(self) -> list:
        """``[rank, t_start, t_end, name, micro_batch, chunk]``: the JSON row of ``bubble`` and ``run``."""
        return [self.rank, self.t_start, self.t_end, self.name, self.micro_batch, self.chunk]

    @classmethod
    def from_row(cls, row: list | tuple) -> Interval:
        """The compute interval of a JSON row (:meth:`as_row`)."""
        rank, t0, t1, name, mb, chunk = row
        return cls(int(rank), "compute", str(name), t0, t1, mb, chunk)


@dataclass(frozen=True)
class TimelineStats:
    """Bubble and idle time of a timeline over the window ``[t_start, t_end]`` (module docstring)."""

    step_time: float
    busy: dict[int, float]
    bubble_ratio: float
    idle_fraction: float


def timeline_stats(intervals: Iterable[Interval], t_start: float | None = None, t_end: float | None = None,
                   ranks: int | None = None) -> TimelineStats:
    """``step = t_end - t_start`` (default: first start to last end), ``busy`` compute time per rank,
    ``bubble_ratio = (step - C) / C`` with ``C`` the busiest rank's compute time, ``idle_fraction =
    1 - sum(busy) / (ranks * step)`` (``ranks``: default, the ranks that appear). Only ``"compute"``
    intervals count. The one definition for simulated and measured timelines."""
    rows = [i for i in intervals if i.kind == "compute"]
    if not rows:
        return TimelineStats(0.0, {}, 0.0, 0.0)
    t0 = min(i.t_start for i in rows) if t_start is None else t_start
    t1 = max(i.t_end for i in rows) if t_end is None else t_end
    busy: dict[int, float] = {}
    for i in rows:
        busy[i.rank] = busy.get(i.rank, 0.0) + (i.t_end - i.t_start)
    step = t1 - t0
    ideal = max(busy.values())
    n = len(busy) if ranks is None else ranks
    return TimelineStats(step, busy, (step - ideal) / ideal if ideal else 0.0,
                         1.0 - sum(busy.values()) / (n * step) if step else 0.0)


@dataclass
class SimResult:
    """The timeline of one schedule and the figures derived from it (see the module docstring)."""

    p: int
    m: int
    v: int
    costs: Costs
    timeline: list[Interval]
    p2p: list[tuple[int, float, float, Action]]
    finish: list[float]
    step_time: float
    compute_time: list[float]
    bubble_ratio: float
    idle_fraction: float
    peak_inflight: list[int]
    idle_gaps: list[list[tuple[float, float]]] = field(default_factory=list)

    @property
    def peak_activation_units(self) -> list[float]:
        return [n / self.v for n in self.peak_inflight]

    @property
    def bubble_time(self) -> float:
        return self.step_time - max(self.compute_time)

    def to_dict(self) -> dict:
        """The JSON shape of ``parallel-lab bubble --json``."""
        return {
            "p": self.p, "m": self.m, "v": self.v,
            "costs": {"f": self.costs.f, "b": self.costs.b, "w": self.costs.w, "p2p": self.costs.p2p},
            "step_time": self.step_time,
            "bubble_ratio": self.bubble_ratio,
            "idle_fraction": self.idle_fraction,
            "peak_inflight": self.peak_inflight,
            "peak_activation_units": self.peak_activation_units,
            "bubble_definitions": dict(BUBBLE_DEFINITIONS),
            "timeline": [i.as_row() for i in self.timeline],
        }

    def bubble_lines(self, schedule: str | None = None) -> list[str]:
        """The two bubble figures, each with its definition and, for a generated ``schedule`` whose bubble has
        one, its closed form (:func:`bubble_closed_form`; what ``parallel-lab bubble`` prints)."""
        closed = None if schedule is None else bubble_closed_form(schedule, self.p, self.m, self.v, self.costs)
        text = None if closed is None else closed[1]
        idle = "(p-1)/(m+p-1)" if schedule in ("gpipe", "1f1b") and self.costs.p2p == 0 else None
        return [f"bubble_ratio  {self.bubble_ratio:.4f} ({self.bubble_ratio:.1%}): "
                f"{BUBBLE_DEFINITIONS['bubble_ratio']}" + (f"; {schedule}: {text}" if text else ""),
                f"idle fraction {self.idle_fraction:.4f} ({self.idle_fraction:.1%}) of {self.p} x "
                f"{self.step_time:g} time units: {BUBBLE_DEFINITIONS['idle_fraction']}"
                + (f"; {schedule}: {idle}" if idle else "")]


def simulate(schedule: Schedule, costs: Costs | None = None) -> SimResult:
    """Time a schedule: start and end of every compute action per rank, idle gaps, bubble, in-flight peak."""
    costs = costs or Costs()
    p = len(schedule)
    splits = [split_backward(acts) for acts in schedule]

    def cost_of(rank: int, a: Action) -> float:
        if a.kind == "F":
            return costs.f
        if a.kind == "W":
            return costs.w
        return costs.b if (a.microbatch, a.chunk) in splits[rank] else costs.full_backward

    run = execute(schedule, cost_of, costs.p2p)
    stages = placement_of(schedule).stages
    timeline = sorted((Interval(r, "compute", a.kind, s, e, a.microbatch, a.chunk, stages[r][a.chunk])
                       for r, s, e, a in run.compute), key=lambda i: (i.rank, i.t_start))
    step = max(run.finish) if run.finish else 0.0
    stats = timeline_stats(timeline, 0.0, step, ranks=p)
    gaps: list[list[tuple[float, float]]] = [[] for _ in range(p)]
    last = [0.0] * p
    for i in timeline:
        if i.t_start > last[i.rank] + 1e-12:
            gaps[i.rank].append((last[i.rank], i.t_start))
        last[i.rank] = i.t_end
    for r in range(p):
        if step > last[r] + 1e-12:
            gaps[r].append((last[r], step))
    m = 1 + max((i.micro_batch for i in timeline), default=-1)
    return SimResult(
        p=p, m=m, v=num_chunks(schedule), costs=costs, timeline=timeline, p2p=run.p2p, finish=run.finish,
        step_time=step, compute_time=[stats.busy.get(r, 0.0) for r in range(p)],
        bubble_ratio=stats.bubble_ratio, idle_fraction=stats.idle_fraction,
        peak_inflight=peak_inflight_of(schedule), idle_gaps=gaps,
    )


def bubble_closed_form(name: str, p: int, m: int, v: int = 1, costs: Costs | None = None) -> tuple[float, str] | None:
    """``(bubble_ratio, the expression as text)`` of a generated schedule where one expression holds
    (``p2p = 0``), else None (the lists' timing is then simulated). The one home of these expressions:

    * GPipe, 1F1B: ``(p - 1) / m`` (GPipe, Huang et al. 2019; Narayanan et al. 2021 eq. 1).
    * interleaved: ``(p - 1) / (v m)`` (Narayanan et al. 2021, section 2.2.2).
    * ZB-H1: ``((p - 1)(f + b) - (min(m, p) - 1) w) / (m (f + b + w))``. For ``m >= p`` the bubble time is
      ``(p - 1)(f + b - w)``, Qi et al. 2023's ZB-H1 bubble ``(p - 1)(T_F + T_B - T_W)``; with
      ``f = b = w`` the ratio is ``(p - 1) / (3 m)``, a third of 1F1B's. The expression holds while
      ``w <= min(f, b)`` (the W passes fit in the drain's gaps).
    * ZB-V (Qi et al. 2024, section 6), ``f = b = w``: ``max(p - 1, 4 p - 2 m - 2) / (6 m)``.
    * DualPipeV (DeepSeek-V3's DualPipe on a V), ``f = b = w``, ``m >= 2 p``: ``(p - 1) / (3 m)``.
    """
    costs = costs or Costs()
    f, b, w = costs.f, costs.b, costs.w
    if name not in SCHEDULE_NAMES:
        raise ParallelLabError(f"schedule {name!r} is not known; pick one of {', '.join(SCHEDULE_NAMES)}")
    if costs.p2p != 0:
        return None
    if name in ("gpipe", "1f1b"):
        return (p - 1) / m, "(p-1)/m"
    if name == "interleaved":
        return (p - 1) / (v * m), "(p-1)/(v m)"
    if name == "zb-h1" and w <= min(f, b):
        text = ("(2(p-1) - (min(m,p)-1))/(3 m), (p-1)/(3 m) once m >= p" if f == b == w
                else "((p-1)(f+b) - (min(m,p)-1) w)/(m (f+b+w))")
        return ((p - 1) * (f + b) - (min(m, p) - 1) * w) / (m * (f + b + w)), text
    if name == "zb-v" and f == b == w:
        return max(p - 1, 4 * p - 2 * m - 2) / (6 * m), "max(p-1, 4p-2m-2)/(6 m)"
    if name == "dualpipev" and f == b == w:
        build_schedule(name, p, m)                      # the same error as the lists for m < 2p
        return (p - 1) / (3 * m), "(p-1)/(3 m)"
    return None


def bubble_formula(name: str, p: int, m: int, v: int = 1, costs: Costs | None = None) -> float:
    """``bubble_ratio`` of a generated schedule with ``p2p = 0`` (what :func:`simulate` gives): its
    :func:`bubble_closed_form` where one holds, else the simulated lists."""
    costs = costs or Costs()
    zero = Costs(costs.f, costs.b, costs.w)
    closed = bubble_closed_form(name, p, m, v, zero)
    if closed is not None:
        return closed[0]
    return simulate(build_schedule(name, p, m, v if name == "interleaved" else 1), zero).bubble_ratio


def text_timeline(result: SimResult, width: int = 120) -> str:
    """One row per rank; each compute action a block of characters proportional to its duration.

    A block shows its kind and micro-batch padded with ``-`` (``F3--``, ``B3-----``; ``F3b-`` for chunk 1
    when interleaving: chunk letters a, b, c, ...) when it is wide enough, else repeats the kind's
    letter; ``.`` is idle. The scale (time units per character) is printed in the header.
    """
    if result.step_time <= 0:
        return ""
    scale = max(result.step_time / width, min(result.costs.f, result.costs.b) / 3)  # time per character
    cols = max(1, round(result.step_time / scale))
    rows = []
    for r in range(result.p):
        line = ["."] * cols
        for i in (x for x in result.timeline if x.rank == r):
            a, z = round(i.t_start / scale), max(round(i.t_end / scale), round(i.t_start / scale) + 1)
            n = min(z, cols) - a
            if n <= 0:
                continue
            label = f"{i.name}{i.micro_batch}" + (chr(ord("a") + i.chunk) if result.v > 1 else "")
            text = label + "-" * n if len(label) < n else i.name * n
            line[a:a + n] = list(text[:n])
        rows.append(f"rank {r:>2} |" + "".join(line) + "|")
    c = result.costs
    head = f"time per character: {scale:g} (F={c.f:g}, B={c.b:g}, W={c.w:g}); step {result.step_time:g}"
    return "\n".join([head] + rows)
