"""The planner's speed: every plan for Llama 2 7B and Llama 3 405B on 16,384 H100s, and why the fast path exists.

Prints, in one run: the wall and CPU time of the whole search for 7B at 4K (4M tokens) and 405B at 8K and
131K (16M tokens), median of 3, with the load average (the app's goal is under 1 s in the browser kernel;
the searches aim at 0.6 s of CPU on an idle machine, to keep that under load), candidates per second, and
side by side the cost of estimating one plan through the fast path against ``planner.evaluate``
(``ledger.memory`` + ``comm.report`` on two stages), plus the schedule simulator against the closed-form
bubble it is tested against. And what a search leaves to the garbage collector: the objects its result
keeps tracked, and one full collection with the 7B result alive (the app's kernel runs such collections
now and then, between or during later changes) and without it.
"""

from __future__ import annotations

import gc
import os
import statistics
import time

from parallel_lab.hardware import ClusterSpec
from parallel_lab.planner import evaluate, plan_search
from parallel_lab.planner_constraints import Constraints
from parallel_lab.planner_fast import FastPath
from parallel_lab.schedules.generators import build_schedule
from parallel_lab.simulate import Costs, bubble_formula, simulate
from parallel_lab.specs import ModelSpec


def _timed(fn, runs: int = 3):
    walls, cpus, out = [], [], None
    for _ in range(runs):
        out = None                      # free the previous result outside the timed region
        w, c = time.perf_counter(), time.process_time()
        result = fn()
        walls.append(time.perf_counter() - w)
        cpus.append(time.process_time() - c)
        out = result
        del result
    return statistics.median(walls), statistics.median(cpus), out


def main() -> None:
    model, cluster = ModelSpec.preset("llama3-405b"), ClusterSpec.preset("h100-sxm")
    print(f"load average {os.getloadavg()[0]:.2f} (1 min)")
    for name, seq, tokens in (("llama2-7b", 4096, "4M"), ("llama3-405b", 8192, "16M"), ("llama3-405b", 131072, "16M")):
        searched = ModelSpec.preset(name)

        def search(s: int = seq, m: ModelSpec = searched, t: str = tokens):
            return plan_search(m, cluster, 16384, s, global_batch_tokens=t)

        t = time.perf_counter()
        first = search()
        cold = time.perf_counter() - t
        del first
        wall, cpu, res = _timed(search)
        best = res.top(1)[0].fields
        print(f"plan_search {name}, 16,384 x h100-sxm, seq {seq:>6,}, {tokens} tokens: "
              f"first run {cold:.3f} s, then wall {wall:.3f} s, cpu {cpu:.3f} s (median of 3; goal < 0.6 s cpu) | "
              f"{res.families} families, "
              f"{res.candidates:,} candidates ({res.candidates / wall:,.0f}/s), {len(res.estimates):,} fit | "
              f"best dp={best['dp']} tp={best['tp']} pp={best['pp']} cp={best['cp']} {best['schedule']} "
              f"MFU {res.top(1)[0].mfu:.1%}")

    # what the 7B result leaves to the garbage collector (its plans are tuples of numbers: untracked)
    gc.collect()
    without = len(gc.get_objects())
    t = time.perf_counter()
    gc.collect()
    t_without = time.perf_counter() - t
    res = plan_search(ModelSpec.preset("llama2-7b"), cluster, 16384, 4096, global_batch_tokens="4M")
    gc.collect()
    held = len(gc.get_objects()) - without
    t = time.perf_counter()
    gc.collect()
    t_with = time.perf_counter() - t
    t = time.perf_counter()
    del res
    t_free = time.perf_counter() - t
    print(f"llama2-7b result ({16384:,} GPUs): {held:,} gc-tracked objects held; one full collection "
          f"{t_with * 1e3:.1f} ms with it alive, {t_without * 1e3:.1f} ms without; freeing it {t_free * 1e3:.1f} ms")

    # one plan: the reference path against the fast path (alone, and amortised inside a search)
    res = plan_search(model, cluster, 16384, 8192, global_batch_tokens="16M")
    plans = [e.plan for e in res.estimates[:: max(1, len(res.estimates) // 40)]][:40]
    t = time.perf_counter()
    for p in plans:
        evaluate(model, cluster, p)
    slow = (time.perf_counter() - t) / len(plans)
    fast = FastPath(model, cluster, 8192, Constraints())
    t = time.perf_counter()
    for p in plans:
        for s in sorted({0, p.pp - 1}):
            fast.memory(p, s)
            fast.times(p, s)
    alone = (time.perf_counter() - t) / len(plans)
    per_candidate = res.elapsed_s / res.candidates
    print(f"one plan: evaluate() (ledger.memory + comm.report, 2 stages) {slow * 1e3:.2f} ms; fast path "
          f"{alone * 1e6:.0f} us alone ({slow / alone:,.0f}x), {per_candidate * 1e6:.1f} us per candidate "
          f"inside a search ({slow / per_candidate:,.0f}x); {res.candidates:,} candidates through "
          f"evaluate() would take about {slow * res.candidates:,.0f} s")

    # the simulator against the closed form the planner uses
    sched = build_schedule("interleaved", 16, 128, 2)
    t = time.perf_counter()
    sim = simulate(sched, Costs())
    t_sim = time.perf_counter() - t
    t = time.perf_counter()
    for _ in range(1000):
        closed = bubble_formula("interleaved", 16, 128, 2)
    t_cf = (time.perf_counter() - t) / 1000
    n_actions = sum(len(r) for r in sched)
    print(f"bubble of interleaved p=16 m=128 v=2: simulate {t_sim * 1e3:.1f} ms ({n_actions:,} actions) "
          f"= {sim.bubble_ratio:.6f}; closed form {t_cf * 1e6:.2f} us = {closed:.6f}; {t_sim / t_cf:,.0f}x")


if __name__ == "__main__":
    main()
