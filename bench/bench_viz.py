"""Explorers: server-side time from a widget value change to a finished redraw.

Each explorer gets 50 value changes, set the way the browser sets them (``widget.value = x``, which fires
the change event and runs the whole refresh synchronously: the analytic core, the matplotlib artists, the
Agg frame and the PNG handed to the Image widget). Printed per explorer: median and p95 wall time, median
and p95 CPU time of the process (less sensitive to other work on the machine), ``full``: how many of the
changes drew some background (axes, ticks, legends) instead of only the artists that move
(``viz.frames.Frames``), and the median split into compute / artists / render. The explorers are fresh,
so the first visit of each setting is in the sample. "second view" and "stages" change the charts'
structure (another chart on an axes; another figure for each number of stages, the last 3 kept).
"new search": every change runs a planner search (the explorer keeps the current search only).
Goal: p95 under 50 ms. The browser's own work (sending the PNG over the websocket, decoding it) comes on
top and is not measured here.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable
from typing import Any

CHANGES = 50


def _p95(xs: list[float]) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(0.95 * (len(xs) - 1))))]


def measure(ex: Any, changes: list[tuple[str, Any]]) -> dict[str, Any]:
    wall, cpu, full, parts = [], [], 0, {"compute_s": [], "artists_s": [], "render_s": []}
    for name, value in changes:
        c0, t0 = time.process_time(), time.perf_counter()
        ex.widgets[name].value = value                     # the change event runs the refresh
        wall.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
        if ex.error is not None:
            raise RuntimeError(f"{type(ex).__name__}: {name}={value!r} gave an error: {ex.error}")
        for k in parts:
            parts[k].append(ex.timings.get(k, 0.0))
        full += int(ex.timings.get("full", 1.0))
    return {"median": statistics.median(wall), "p95": _p95(wall), "cpu": statistics.median(cpu),
            "cpu_p95": _p95(cpu), "full": full, **{k: statistics.median(v) for k, v in parts.items()},
            "n": len(wall)}


def _cycle(pairs: list[tuple[str, Any]], n: int = CHANGES) -> list[tuple[str, Any]]:
    return [pairs[i % len(pairs)] for i in range(n)]


def cases() -> list[tuple[str, Callable[[], Any], list[tuple[str, Any]]]]:
    from parallel_lab.viz.explorers.comm import CommExplorer
    from parallel_lab.viz.explorers.memory import MemoryExplorer
    from parallel_lab.viz.explorers.pipeline import PipelineExplorer
    from parallel_lab.viz.explorers.planner import PlannerExplorer

    return [
        ("MemoryExplorer (ZeRO view)", lambda: MemoryExplorer(sweep="ZeRO stage"),
         _cycle([("zero", 1), ("seq", 8192), ("zero", 2), ("recompute", "selective"), ("zero", 3),
                 ("seq", 4096), ("zero", 0), ("recompute", "none")])),
        ("MemoryExplorer (sequence view)", lambda: MemoryExplorer(sweep="sequence"),
         _cycle([("seq", 8192), ("zero", 1), ("seq", 2048), ("zero", 0), ("seq", 4096)])),
        ("CommExplorer", lambda: CommExplorer(),
         _cycle([("tp_across_nodes", True), ("seq", 8192), ("tp_across_nodes", False), ("tp", 4),
                 ("seq", 4096), ("tp", 8)])),
        ("PipelineExplorer", lambda: PipelineExplorer(schedule="1f1b", stages=4, microbatches=8),
         _cycle([("microbatches", m) for m in (9, 10, 11, 12, 13, 14, 15, 16, 8)]
                + [("schedule", "zb-h1"), ("schedule", "gpipe"), ("schedule", "1f1b")])),
        ("MemoryExplorer (second view)", lambda: MemoryExplorer(),
         _cycle([("sweep", w) for w in ("sequence", "dp", "ZeRO stage")])),
        ("PipelineExplorer (stages 2..8)", lambda: PipelineExplorer(stages=4, microbatches=8),
         _cycle([("stages", p) for p in (5, 6, 7, 8, 2, 3, 4)])),
        ("PlannerExplorer (show plan #k)", lambda: PlannerExplorer(),
         _cycle([("chosen", k) for k in (2, 3, 4, 5, 6, 7, 8, 1)])),
        ("PlannerExplorer (new search)", lambda: PlannerExplorer(),
         _cycle([("seq", s) for s in (2048, 4096, 8192)], 12)),
    ]


def main() -> None:
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(f"server-side redraw per explorer ({CHANGES} changes; the last line 12); goal p95 < 50 ms; "
          f"load average {load:.2f} on {os.cpu_count()} CPUs")
    print(f"{'explorer':<32} {'median':>8} {'p95':>8} {'cpu':>8} {'cpu p95':>8} {'full':>5}   "
          "compute / artists / render (medians)")
    for label, make, changes in cases():
        ex = make()
        r = measure(ex, changes)
        goal = "ok" if r["p95"] < 0.05 else "over the 50 ms goal"
        split = " / ".join(f"{r[k] * 1e3:.1f}" for k in ("compute_s", "artists_s", "render_s"))
        print(f"{label:<32} {r['median'] * 1e3:6.1f}ms {r['p95'] * 1e3:6.1f}ms {r['cpu'] * 1e3:6.1f}ms "
              f"{r['cpu_p95'] * 1e3:6.1f}ms {r['full']:>2}/{r['n']:<2}  {split} ms  {goal}")


if __name__ == "__main__":
    main()
