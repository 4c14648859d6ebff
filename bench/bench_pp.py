"""Our pipeline executor running 1F1B against ``torch.distributed.pipelining``'s ``Schedule1F1B``: step time.

Same tiny model (tiny-llama, seq 128, 4 sequences per micro-batch, m = 8 micro-batches), the same stage
modules (our ``keep_stage`` cut of the same weights: embedding on the first stage, head on the last), the same
ranks, the same optimizer (AdamW, foreach=False), in one run: each rank alternates one step of each
implementation after warm-up, and a step's time is the slowest rank's. Prints the median step times and the
ratio ours / torch (goal <= 1.0), for p = 2 and p = 4 stages. Ours runs with no measurement attached (no
comm tracer, no saved-tensor meter: torch has neither) and records its timeline. With 4 ranks on a 2-core
host the cores are oversubscribed, so those figures are noisier.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from bench.common import our_runtime, side_by_side, slowest_rank_median
from parallel_lab.distributed.model.data import synthetic_batch
from parallel_lab.distributed.model.model import build_model, loss_fn, make_context, make_optimizer
from parallel_lab.distributed.pipeline_parallel.stages import keep_stage, stage_layout
from parallel_lab.distributed.runtime.grid import Grid
from parallel_lab.distributed.runtime.launch import launch
from parallel_lab.specs import ModelSpec, Plan

SPEC = ModelSpec.preset("tiny-llama")
M = 8
WARMUP, STEPS = 3, 15


class _Stage(nn.Module):
    """One stage of our Transformer as torch's pipelining wants it: ``forward(tensor) -> tensor``."""

    def __init__(self, model: nn.Module, blocks: list[int], first: bool, last: bool):
        super().__init__()
        self.model, self.blocks, self.first, self.last = model, blocks, first, last

    def forward(self, x: Tensor) -> Tensor:
        ctx = make_context(torch.arange(x.shape[1], device=x.device))
        h = self.model.embed(x, ctx.positions) if self.first else x
        for i in self.blocks:
            h = self.model.blocks[str(i)](h, ctx)
        return self.model.head(h) if self.last else h


def _ours(grid: Grid, plan: Plan):
    rt = our_runtime(grid, SPEC, plan)
    micro = rt.micro_batches(synthetic_batch(SPEC, plan, 0))

    def step() -> None:
        rt.train_step(micro)
        rt.timeline.spans.clear()
    return step


def _torch_1f1b(grid: Grid, plan: Plan):
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    layout = stage_layout(SPEC, plan, grid.pp_rank)
    model = keep_stage(build_model(SPEC, device=grid.device), layout)
    module = _Stage(model, layout.layers, layout.has_embedding, layout.has_head)
    stage = PipelineStage(module, grid.pp_rank, plan.pp, grid.device, group=grid.groups["pp"])
    schedule = Schedule1F1B(stage, M, loss_fn=loss_fn)
    opt = make_optimizer(model.parameters(), plan)
    batch = synthetic_batch(SPEC, plan, 0)

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        if layout.has_embedding:
            schedule.step(batch.tokens)
        elif layout.has_head:
            schedule.step(target=batch.targets, losses=[])
        else:
            schedule.step()
        opt.step()
    return step


def _bench_rank(grid: Grid, plan: Plan) -> dict[str, list[float]]:
    steps = {"ours 1F1B": _ours(grid, plan), "torch Schedule1F1B": _torch_1f1b(grid, plan)}
    times, _ = side_by_side({k: (lambda i, f=f: f()) for k, f in steps.items()}, WARMUP, STEPS)
    return times


def measure(p: int) -> dict[str, float]:
    plan = Plan(pp=p, grad_accum=M, micro_batch=4, seq=128, schedule="1f1b", optimizer="adam-fp32",
                dtype="fp32")
    return slowest_rank_median(launch(_bench_rank, plan, plan, timeout_s=600))

def main() -> None:
    print(f"{SPEC.summary()}; seq 128, micro-batch 4, m={M}, AdamW; median of {STEPS} steps")
    for p in (2, 4):
        t = measure(p)
        print(f"p={p} stages: " + ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in t.items()))
        print(f"  ratio ours / torch Schedule1F1B = {t['ours 1F1B'] / t['torch Schedule1F1B']:.2f}"
              "  (goal <= 1.0)")


if __name__ == "__main__":
    main()
