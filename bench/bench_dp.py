"""Our DDP (bucketed, and naive) against ``torch.nn.parallel.DistributedDataParallel``: step time.

Same tiny model (tiny-llama, seq 128, 4 sequences per rank), same ranks, same optimizer (AdamW,
foreach=False), in one run: each rank alternates one step of every implementation, after warm-up, and a
step's time is the slowest rank's. Prints the median step times and the ratio ours / torch (goal <= 1.0).
With 4 ranks the 2 cores of this machine are oversubscribed, so those figures are noisier.
"""

from __future__ import annotations

import torch

from bench.common import our_step, side_by_side, slowest_rank_median
from parallel_lab.distributed.data import synthetic_batch
from parallel_lab.distributed.grid import Grid
from parallel_lab.distributed.launch import launch
from parallel_lab.distributed.model import build_model, loss_fn, make_optimizer
from parallel_lab.specs import ModelSpec, Plan

SPEC = ModelSpec.preset("tiny-llama")
WARMUP, STEPS = 3, 21


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
    steps = {"ours bucketed": our_step(grid, SPEC, plan),
             "ours naive": our_step(grid, SPEC, plan.with_(dp_kind="naive")),
             "torch DDP": _torch_ddp(grid, plan)}
    batch = synthetic_batch(SPEC, plan, 0).rows(grid.dp_rank * plan.micro_batch,
                                                (grid.dp_rank + 1) * plan.micro_batch)
    times, _ = side_by_side({k: (lambda i, f=f: f(batch)) for k, f in steps.items()}, WARMUP, STEPS)
    return times


def measure(world: int) -> dict[str, float]:
    plan = Plan(dp=world, micro_batch=4, seq=128, optimizer="adam-fp32", dtype="fp32")
    return slowest_rank_median(launch(_bench_rank, plan, plan, timeout_s=600))


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
