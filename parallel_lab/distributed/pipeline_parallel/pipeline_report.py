"""A pipeline run's measured timeline, read with the simulator's definitions (what ``parallel-lab run`` prints).

The executor (``pipeline_parallel.py`` beside this file) keeps, per step and rank, the rows ``[rank, t_start,
t_end, name, micro_batch, chunk]`` of its F/B/W actions (``simulate.Interval.as_row``: plain data that crosses
the process boundary). Here they become ``simulate.Interval`` again and are measured exactly as the
simulator measures its own timelines (``simulate.timeline_stats``)::

    bubble_ratio = (step - C) / C        idle_fraction = 1 - sum_r busy_r / (p * step)

with ``C`` the busiest rank's compute time. Three timelines are compared: ``predicted`` (the simulator
with textbook costs, F = 1, B = 2, or F = B = W = 1 for ZB-H1), ``measured`` (one step of one pipeline
replica, time 0 at its first forward) and ``replayed`` (the simulator fed every action's measured
duration: what the schedule explains; the rest is communication, the executor and, on 2 cores,
contention). :func:`handoffs` measures what a message between stages costs where a stage waited for it.
``viz.plots.timeline.pipeline_timelines_figure`` draws the simulated and the measured timeline together.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from parallel_lab.distributed.pipeline_parallel.stages import stage_layout
from parallel_lab.schedules.actions import Action, placement_of
from parallel_lab.schedules.execution import execute
from parallel_lab.schedules.generators import build_schedule
from parallel_lab.simulate import Costs, Interval, simulate, timeline_stats
from parallel_lab.specs import ModelSpec, Plan


def _key(i: Interval) -> tuple[int, str, int, int]:
    return (i.rank, i.name, int(i.micro_batch), int(i.chunk))


def measured_step(records: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """One pipeline's step from its ranks' records (``StepRecord.as_dict``), in the simulator's frame: time 0
    is the first compute action (the first stage's first forward, which waits for nothing), the step ends
    when the last rank has finished its list and its last send. ``intervals`` are shifted accordingly,
    ``stats`` is :func:`~parallel_lab.simulate.timeline_stats` of that window. ``start_skew_s``: how long
    before that some rank was already in its list, waiting (ranks leave the previous optimizer step at
    different times; the simulator starts them together, so this wait is reported apart from the bubble)."""
    t0 = min(row[1] for rec in records for row in rec["rows"])
    t1 = max(rec["t_end"] for rec in records)
    intervals = sorted((Interval.from_row([row[0], row[1] - t0, row[2] - t0, *row[3:]])
                        for rec in records for row in rec["rows"]), key=lambda i: (i.rank, i.t_start))
    return {"intervals": intervals, "stats": timeline_stats(intervals, 0.0, t1 - t0),
            "start_skew_s": t0 - min(rec["t_start"] for rec in records),
            "inflight_peak": [rec["inflight_peak"] for rec in sorted(records, key=lambda x: x["rank"])]}


def mean_costs(intervals: Iterable[Interval], split: bool) -> dict[str, float]:
    """Mean measured F, B, W durations (seconds), as ``simulate.Costs`` fields: a full backward is ``b``
    (``w = 0``) when the schedule does not split it."""
    acc: dict[str, list[float]] = {"F": [], "B": [], "W": []}
    for i in intervals:
        acc[i.name].append(i.duration)
    mean = {k: sum(v) / len(v) for k, v in acc.items() if v}
    return {"f": mean.get("F", 0.0), "b": mean.get("B", 0.0), "w": mean.get("W", 0.0) if split else 0.0}


def rank_costs(intervals: Iterable[Interval]) -> list[dict[str, float]]:
    """Per pipeline rank, the mean measured duration (seconds) of each action kind it ran."""
    acc: dict[int, dict[str, list[float]]] = {}
    for i in intervals:
        acc.setdefault(i.rank, {}).setdefault(i.name, []).append(i.duration)
    return [{k: sum(v) / len(v) for k, v in acc[rank].items()} for rank in sorted(acc)]


def replay(schedule: list[list[Action]], intervals: Iterable[Interval]) -> dict[str, Any]:
    """The simulator (``schedules.execute``, instantaneous point-to-point) run with every action's own
    measured duration: the step the schedule would take if the ranks never waited for anything but their
    inputs. Returns its ``intervals`` and their ``stats``."""
    dur = {_key(i): i.duration for i in intervals}
    ex = execute(schedule, lambda rank, a: dur[(rank, a.kind, a.microbatch, a.chunk)], 0.0)
    stages = placement_of(schedule).stages
    out = sorted((Interval(r, "compute", a.kind, t0, t1, a.microbatch, a.chunk, stages[r][a.chunk])
                  for r, t0, t1, a in ex.compute), key=lambda i: (i.rank, i.t_start))
    return {"intervals": out, "stats": timeline_stats(out, 0.0, max(ex.finish))}


def handoffs(intervals: Iterable[Interval], p: int) -> list[float]:
    """Measured point-to-point hand-off times (seconds): from the end of the action that produced a
    tensor (an F's output, a B's input gradient) to the start of the action on the neighbouring stage that
    consumed it, counted only where the consumer sat idle waiting for it (so the gap is the message's
    latency plus the executor's posting and waiting, not queueing behind other work)."""
    rows = sorted(intervals, key=lambda i: (i.rank, i.t_start))
    end = {_key(i): i.t_end for i in rows}
    v = 1 + max(int(i.chunk) for i in rows)
    out, last_end = [], {}
    for i in rows:
        s = i.chunk * p + i.rank                     # virtual stage
        src = s - 1 if i.name == "F" else s + 1
        if i.name in ("F", "B") and 0 <= src < p * v:
            t = end.get((src % p, i.name, i.micro_batch, src // p))
            if t is not None and last_end.get(i.rank, float("-inf")) < t <= i.t_start:
                out.append(i.t_start - t)
        last_end[i.rank] = i.t_end
    return out


def pipeline_report(spec: ModelSpec, plan: Plan, results: Sequence[Any],
                    step: int | None = None, schedule: Any = None, name: str | None = None) -> dict[str, Any]:
    """Measured against simulated, for ``parallel-lab run``: one pipeline replica (the ranks with dp, cp and
    tp coordinates 0), step ``step`` (default: the fastest step after the first, whose allocations warm up;
    the fastest is the one least disturbed by other processes, as ``timeit`` takes the minimum).

    ``bubble_ratio``, ``idle_fraction``: predicted, measured and replayed (module docstring);
    ``step_time_s``: measured and replayed; ``handoff_s``: median and 90th percentile of the measured
    hand-offs; ``peak_inflight``: per pipeline rank, (micro-batch, chunk) pairs alive at once, measured
    against the simulator's count; ``timeline``: the measured rows (``Interval.as_row``). ``schedule``: the
    action lists the run executed instead of ``plan.schedule``'s (e.g. ZB-V), called ``name``.
    """
    if schedule is None:
        schedule = build_schedule(plan.schedule, plan.pp, plan.microbatches, plan.interleave)
    place = placement_of(schedule)
    mine = sorted((r for r in results if r.coords.get("dp", 0) == 0 and r.coords.get("cp", 0) == 0
                   and r.coords.get("tp", 0) == 0), key=lambda r: r.coords["pp"])
    n = len(mine[0].info["pp"]["steps"])
    if step is None:
        steps = [measured_step([r.info["pp"]["steps"][i] for r in mine]) for i in range(min(1, n - 1), n)]
        meas = min(steps, key=lambda x: x["stats"].step_time)
    else:
        meas = measured_step([r.info["pp"]["steps"][step] for r in mine])
    split = any(a.kind == "W" for acts in schedule for a in acts)
    pred = simulate(schedule, Costs())
    m_st, rep = meas["stats"], replay(schedule, meas["intervals"])
    r_st = rep["stats"]
    hand = sorted(handoffs(meas["intervals"], plan.pp))
    layers = [len(stage_layout(spec, plan, r, place).layers) for r in range(plan.pp)]
    return {
        "schedule": name or plan.schedule, "p": plan.pp, "m": plan.microbatches, "v": place.v,
        "head_rank": place.holder(place.n_stages - 1)[0],
        "layers_per_stage": layers, "uneven": len(set(layers)) > 1,
        "bubble_ratio": {"predicted": pred.bubble_ratio, "measured": m_st.bubble_ratio,
                         "replayed": r_st.bubble_ratio},
        "idle_fraction": {"predicted": pred.idle_fraction, "measured": m_st.idle_fraction,
                          "replayed": r_st.idle_fraction},
        "step_time_s": {"measured": m_st.step_time, "replayed": r_st.step_time},
        "start_skew_s": meas["start_skew_s"],
        "handoff_s": {"median": hand[len(hand) // 2] if hand else None,
                      "p90": hand[int(0.9 * len(hand))] if hand else None, "count": len(hand)},
        "peak_inflight": {"predicted": list(pred.peak_inflight), "measured": meas["inflight_peak"]},
        "mean_costs_s": mean_costs(meas["intervals"], split), "rank_costs_s": rank_costs(meas["intervals"]),
        "timeline": [i.as_row() for i in meas["intervals"]],
    }


def format_pipeline_report(rep: dict[str, Any]) -> str:
    """The text block ``parallel-lab run`` prints for a pipeline."""
    v = f", v={rep['v']} chunks per stage" if rep["v"] > 1 else ""
    lines = [f"pipeline: {rep['schedule']}, p={rep['p']} stages, m={rep['m']} micro-batches{v}",
             f"blocks per stage {rep['layers_per_stage']}" + (" (uneven)" if rep["uneven"] else "")
             + f"; embedding on stage 0, final norm + head + loss on stage {rep.get('head_rank', rep['p'] - 1)}",
             "               predicted  measured  replayed (simulator fed the measured durations)"]
    for key in ("bubble_ratio", "idle_fraction"):
        d = rep[key]
        lines.append(f"{key:<14} {d['predicted']:>9.1%} {d['measured']:>9.1%} {d['replayed']:>9.1%}")
    st = rep["step_time_s"]
    lines.append(f"{'step (ms)':<14} {'':>9} {st['measured'] * 1e3:>9.1f} {st['replayed'] * 1e3:>9.1f}")
    lines.append(f"peak in-flight micro-batches per stage: measured {rep['peak_inflight']['measured']}, "
                 f"simulated {rep['peak_inflight']['predicted']}")
    kinds = "F/B/W" if rep["mean_costs_s"]["w"] else "F/B"
    per = ", ".join("/".join(f"{d[k] * 1e3:.1f}" for k in ("F", "B", "W") if k in d)
                    for d in rep["rank_costs_s"])
    lines.append(f"mean {kinds} per stage (ms): {per}")
    h = rep["handoff_s"]
    if h["count"]:
        lines.append(f"hand-off between stages (ms): median {h['median'] * 1e3:.2f}, 90th percentile "
                     f"{h['p90'] * 1e3:.2f} ({h['count']} waits); a rank entered the step "
                     f"{rep['start_skew_s'] * 1e3:.1f} ms before the first forward")
    return "\n".join(lines)
