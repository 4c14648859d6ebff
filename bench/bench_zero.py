"""Our ZeRO-3 against torch's FSDP2 ``fully_shard``: step time, per block + root and root only.

Same tiny model (tiny-llama, seq 128, 4 sequences per rank), same ranks, same optimizer (AdamW,
foreach=False, fp32), in one run: each rank alternates one step of every implementation (order rotated),
after warm-up, and a step's time is the slowest rank's. FSDP2 wraps each block and then the root, like our
``zero_unit="block"``; "root only" wraps just the model (our ``zero_unit="root"``). Prints the median
step times and the ratios ours / torch (goal <= 1.0). With 4 ranks on a 2-core host the cores are
oversubscribed, so those figures are noisier. FSDP2's parameters are DTensors: the launcher's teardown
(``gc.collect()`` + barrier before ``destroy_process_group``) avoids the exit crash seen with them.
"""

from __future__ import annotations

from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from bench.common import our_step, side_by_side, slowest_rank_median
from parallel_lab.distributed.model.data import synthetic_batch
from parallel_lab.distributed.model.model import build_model, loss_fn, make_optimizer
from parallel_lab.distributed.runtime.grid import Grid
from parallel_lab.distributed.runtime.launch import launch
from parallel_lab.specs import ModelSpec, Plan

SPEC = ModelSpec.preset("tiny-llama")
WARMUP, STEPS = 3, 15


def _fsdp2(grid: Grid, plan: Plan, per_block: bool):
    model = build_model(SPEC, device=grid.device)
    mesh = init_device_mesh(grid.device.type, (plan.dp,))
    if per_block:
        for block in model.blocks.values():
            fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = make_optimizer(model.parameters(), plan)

    def step(batch):
        opt.zero_grad(set_to_none=True)
        loss_fn(model(batch.tokens, batch.positions), batch.targets).backward()
        opt.step()
    return step


def _bench_rank(grid: Grid, plan: Plan) -> dict[str, list[float]]:
    steps = {"ours per block": our_step(grid, SPEC, plan), "FSDP2 per block": _fsdp2(grid, plan, True),
             "ours root only": our_step(grid, SPEC, plan.with_(zero_unit="root")),
             "FSDP2 root only": _fsdp2(grid, plan, False)}
    batch = synthetic_batch(SPEC, plan, 0).rows(grid.dp_rank * plan.micro_batch,
                                                (grid.dp_rank + 1) * plan.micro_batch)
    times, _ = side_by_side({k: (lambda i, f=f: f(batch)) for k, f in steps.items()}, WARMUP, STEPS)
    return times


def measure(world: int) -> dict[str, float]:
    plan = Plan(dp=world, zero=3, micro_batch=4, seq=128, optimizer="adam-fp32", dtype="fp32")
    return slowest_rank_median(launch(_bench_rank, plan, plan, timeout_s=900))


def main() -> None:
    print(f"{SPEC.summary()}; seq 128, micro-batch 4 per rank, AdamW fp32; median of {STEPS} steps")
    for world in (2, 4):
        t = measure(world)
        print(f"{world} ranks: " + ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in t.items()))
        for unit in ("per block", "root only"):
            ratio = t["ours " + unit] / t["FSDP2 " + unit]
            print(f"  ratio ours / FSDP2 {unit} = {ratio:.2f}  (goal <= 1.0)")


if __name__ == "__main__":
    main()
