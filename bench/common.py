"""What the distributed benchmarks share: our step on a plan, and timing implementations side by side.

Every benchmark runs its implementations in ONE launch, on the same ranks and the same data: each round
runs every implementation once (the order rotated, so no one always goes first), each after a barrier;
a step's time is the slowest rank's, and the figure reported is the median over the rounds after warm-up.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

from parallel_lab.distributed.model.data import Batch
from parallel_lab.distributed.model.model import build_model
from parallel_lab.distributed.runtime.grid import Grid
from parallel_lab.distributed.runtime.runtime import Runtime
from parallel_lab.distributed.runtime.train import parallelize
from parallel_lab.specs import ModelSpec, Plan


def our_runtime(grid: Grid, spec: ModelSpec, plan: Plan, schedule: Any = None) -> Runtime:
    """Our parallel runtime for ``plan`` (the same composition ``parallel-lab run`` uses) with no measurement
    attached: no comm tracer and no saved-tensor meter (torch's side has neither). ``schedule``: pipeline
    action lists instead of ``plan.schedule``'s."""
    return parallelize(build_model(spec, device=grid.device), grid, plan, None, meter=False, schedule=schedule)


def our_step(grid: Grid, spec: ModelSpec, plan: Plan) -> Callable[[Batch], float]:
    """One optimizer step of our implementation (``Runtime.train_step``) on one micro-batch: the loss."""
    rt = our_runtime(grid, spec, plan)

    def step(batch: Batch) -> float:
        loss = rt.train_step([batch])
        rt.timeline.spans.clear()
        return loss
    return step


def side_by_side(impls: dict[str, Callable[[int], Any]], warmup: int, steps: int
                 ) -> tuple[dict[str, list[float]], dict[str, list[Any]]]:
    """Run ``impls[name](round)`` for ``warmup + steps`` rounds; return this rank's step times (after
    warm-up) and every returned value, per implementation."""
    names = list(impls)
    times: dict[str, list[float]] = {k: [] for k in names}
    values: dict[str, list[Any]] = {k: [] for k in names}
    for i in range(warmup + steps):
        k = i % len(names)
        for name in names[k:] + names[:k]:
            dist.barrier()
            t0 = time.perf_counter()
            values[name].append(impls[name](i))
            if i >= warmup:
                times[name].append(time.perf_counter() - t0)
    return times, values


def slowest_rank_median(per_rank_times: list[dict[str, list[float]]]) -> dict[str, float]:
    """Per implementation: the median over rounds of the slowest rank's step time."""
    names = per_rank_times[0]
    return {n: statistics.median(max(ts) for ts in zip(*(r[n] for r in per_rank_times), strict=True))
            for n in names}
