"""Our DDP (bucketed, and naive) against ``torch.nn.parallel.DistributedDataParallel``: step time.

Same tiny model (tiny-llama, seq 128, 4 sequences per rank), same ranks, same optimizer (AdamW,
foreach=False), in one run: each rank alternates one step of every implementation, after warm-up, and a
step's time is the slowest rank's. Prints the median step times and the ratio ours / torch (goal <= 1.0).
With 4 ranks the 2 cores of this machine are oversubscribed, so those figures are noisier.
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist

from parallel_lab.dist.grid import Grid
from parallel_lab.dist.instruments import CommTracer
from parallel_lab.dist.launch import launch
from parallel_lab.dist.model import build_model, loss_fn, make_optimizer, synthetic_batch
from parallel_lab.dist.train import parallelize
from parallel_lab.specs import ModelSpec, Plan

SPEC = ModelSpec.preset("tiny-llama")
WARMUP, STEPS = 3, 21


def _ours(grid: Grid, plan: Plan):
    tracer = CommTracer(grid.rank, grid.groups_by_dim())
    rt = parallelize(build_model(SPEC, device=grid.device), grid, plan, tracer)

    def step(batch):
        rt.dp.zero_grad()
        rt.dp.set_sync(True)
        loss_fn(rt.model(batch.tokens, batch.positions), batch.targets).backward()
        rt.dp.finish()
        rt.dp.step()
        rt.tracer.clear()
    return step


def _torch_ddp(grid: Grid, plan: Plan):
    model = build_model(SPEC, device=grid.device)
    ddp = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=plan.bucket_mb)
    opt = make_optimizer(model.parameters(), plan)

    def step(batch):
        opt.zero_grad(set_to_none=True)
        loss_fn(ddp(batch.tokens, batch.positions), batch.targets).backward()
        opt.step()
    return step


def _bench_rank(grid: Grid, plan: Plan) -> dict[str, list[float]]:
    impls = {"ours bucketed": _ours(grid, plan), "ours naive": _ours(grid, plan.with_(dp_kind="naive")),
             "torch DDP": _torch_ddp(grid, plan)}
    batch = synthetic_batch(SPEC, plan, 0).rows(grid.dp_rank * plan.micro_batch,
                                                (grid.dp_rank + 1) * plan.micro_batch)
    times: dict[str, list[float]] = {k: [] for k in impls}
    names = list(impls)
    for i in range(WARMUP + STEPS):
        for name in names[i % 3:] + names[:i % 3]:          # rotate the order: no one always goes first
            step = impls[name]
            dist.barrier()
            t0 = time.perf_counter()
            step(batch)
            if i >= WARMUP:
                times[name].append(time.perf_counter() - t0)
    return times


def measure(world: int) -> dict[str, float]:
    plan = Plan(dp=world, micro_batch=4, seq=128, optimizer="adam-fp32", dtype="fp32")
    per_rank = launch(_bench_rank, plan, plan, timeout_s=600)
    return {name: statistics.median(max(r[name][i] for r in per_rank) for i in range(STEPS))
            for name in per_rank[0]}


def main() -> None:
    print(f"{SPEC.summary()}; seq 128, micro-batch 4 per rank, AdamW; median of {STEPS} steps")
    for world in (2, 4):
        t = measure(world)
        ref = t["torch DDP"]
        print(f"{world} ranks: " + ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in t.items()))
        for k in ("ours bucketed", "ours naive"):
            print(f"  ratio {k} / torch DDP = {t[k] / ref:.2f}  (goal <= 1.0)")


if __name__ == "__main__":
    main()
