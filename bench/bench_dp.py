"""Our DDP (bucketed, and naive) against ``torch.nn.parallel.DistributedDataParallel``: step time.

Same tiny model (tiny-llama, seq 128, 4 sequences per rank), same ranks, same optimizer (AdamW,
foreach=False), in one run: each rank alternates one step of every implementation, after warm-up, and a
step's time is the slowest rank's. Prints the median step times and the ratio ours / torch (goal <= 1.0).

Two bucket settings. At the default cap (25 MB) the whole 3.4 MB of gradients is ONE bucket of ours, so
its all-reduce starts only after backward; torch's DDP always closes its first bucket at 1 MiB
(``dist._DEFAULT_FIRST_BUCKET_BYTES``), so part of its all-reduce overlaps backward. At a 1 MB cap both
have about the same buckets (ours: 1e6 bytes each; torch: 1 MiB first, then 1e6), the like-for-like
comparison. Then a profile of one rank (``torch.profiler``, self CPU time per op over the timed steps)
shows where each implementation spends its step. With 4 ranks on a 2-core host the cores are
oversubscribed, so those figures are noisier.
"""

from __future__ import annotations

import torch

from bench.common import our_step, side_by_side, slowest_rank_median
from parallel_lab.distributed.model.data import synthetic_batch
from parallel_lab.distributed.model.model import build_model, loss_fn, make_optimizer
from parallel_lab.distributed.runtime.grid import Grid
from parallel_lab.distributed.runtime.launch import launch
from parallel_lab.specs import ModelSpec, Plan

SPEC = ModelSpec.preset("tiny-llama")
WARMUP, STEPS, PROFILED = 3, 21, 10
MiB = 1024 * 1024


def _torch_ddp(grid: Grid, plan: Plan):
    model = build_model(SPEC, device=grid.device)
    # torch counts bucket_cap_mb in MiB, ours in 10^6 bytes: the same cap in bytes
    ddp = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=plan.bucket_mb * 1e6 / MiB)
    opt = make_optimizer(model.parameters(), plan)

    def step(batch):
        opt.zero_grad(set_to_none=True)
        loss_fn(ddp(batch.tokens, batch.positions), batch.targets).backward()
        opt.step()
    return step


def _steps(grid: Grid, plan: Plan) -> dict[str, object]:
    return {"ours bucketed": our_step(grid, SPEC, plan),
            "ours naive": our_step(grid, SPEC, plan.with_(dp_kind="naive")),
            "torch DDP": _torch_ddp(grid, plan)}


def _my_rows(grid: Grid, plan: Plan):
    return synthetic_batch(SPEC, plan, 0).rows(grid.dp_rank * plan.micro_batch,
                                               (grid.dp_rank + 1) * plan.micro_batch)


def _bench_rank(grid: Grid, plan: Plan) -> dict[str, list[float]]:
    batch = _my_rows(grid, plan)
    times, _ = side_by_side({k: (lambda i, f=f: f(batch)) for k, f in _steps(grid, plan).items()},
                            WARMUP, STEPS)
    return times


def _profile_rank(grid: Grid, plan: Plan) -> dict[str, str] | None:
    """Rank 0's profile table per implementation (self CPU time per op over PROFILED steps)."""
    batch = _my_rows(grid, plan)
    out = {}
    for name, step in _steps(grid, plan).items():
        if name == "ours naive":
            continue
        for _ in range(WARMUP):
            step(batch)
        torch.distributed.barrier()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            for _ in range(PROFILED):
                step(batch)
        torch.distributed.barrier()
        out[name] = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=10, max_name_column_width=40)
    return out if grid.rank == 0 else None


def measure(world: int, bucket_mb: float = 25.0) -> dict[str, float]:
    plan = Plan(dp=world, micro_batch=4, seq=128, optimizer="adam-fp32", dtype="fp32", bucket_mb=bucket_mb)
    return slowest_rank_median(launch(_bench_rank, plan, plan, timeout_s=600))


def profile(world: int = 2, bucket_mb: float = 25.0) -> dict[str, str]:
    plan = Plan(dp=world, micro_batch=4, seq=128, optimizer="adam-fp32", dtype="fp32", bucket_mb=bucket_mb)
    return launch(_profile_rank, plan, plan, timeout_s=600)[0]


def main() -> None:
    print(f"{SPEC.summary()}; seq 128, micro-batch 4 per rank, AdamW; median of {STEPS} steps")
    for world, bucket_mb in ((2, 25.0), (2, 1.0), (4, 25.0), (4, 1.0)):
        t = measure(world, bucket_mb)
        ref = t["torch DDP"]
        print(f"{world} ranks, {bucket_mb:g} MB buckets: " + ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in t.items()))
        for k in ("ours bucketed", "ours naive"):
            print(f"  ratio {k} / torch DDP = {t[k] / ref:.2f}  (goal <= 1.0)")
    print(f"\nprofile of rank 0 of 2, 25 MB buckets, {PROFILED} steps (self CPU time per op):")
    for name, table in profile().items():
        print(f"--- {name}\n{table}")


if __name__ == "__main__":
    main()
