"""Our executor running ZB-V and DualPipeV against torch's ``ScheduleZBVZeroBubble`` and ``ScheduleDualPipeV``.

Same tiny model (tiny-llama, 4 blocks for p = 2 and 8 blocks for p = 4, so that each of the 2p virtual
stages holds one block; seq 128, 4 sequences per micro-batch, m = 8), the same V placement (rank r holds
stages r and 2p - 1 - r: rank 0 the embedding and the head), the same weights cut the same way, the same
optimizer (AdamW, foreach=False), in one launch: each round runs one step of each of the four
implementations after a barrier, and a step's time is the slowest rank's median after warm-up. Prints the
step times and the ratios ours / torch per schedule (goal <= 1.0). Our lists are action for action torch's
(tests/test_schedules_v.py); ours runs with no measurement attached and records its timeline. On a host with
2 cores p = 4 oversubscribes them: those figures are noisier. Nothing here is asserted.
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
from parallel_lab.schedules.actions import Placement
from parallel_lab.schedules.generators import build_schedule
from parallel_lab.specs import ModelSpec, Plan

SPEC = ModelSpec.preset("tiny-llama")
M = 8
WARMUP, STEPS = 3, 12
TORCH_CLASS = {"zb-v": "ScheduleZBVZeroBubble", "dualpipev": "ScheduleDualPipeV"}


class _Chunk(nn.Module):
    """One virtual stage as torch's pipelining wants it, ``forward(tensor) -> tensor``, registering only its
    own parameters (the two chunks of a rank share one model; each stage must own a disjoint part)."""

    def __init__(self, model: nn.Module, blocks: tuple[int, ...], first: bool, last: bool):
        super().__init__()
        self._model = [model]                                   # not a submodule: its parameters are not ours
        self.blocks = nn.ModuleList(model.blocks[str(i)] for i in blocks)
        self.first, self.last = first, last
        if first:
            self.tok_emb = model.tok_emb
        if last:
            self.final_norm, self.lm_head = model.final_norm, model.lm_head

    def forward(self, x: Tensor) -> Tensor:
        model = self._model[0]
        ctx = make_context(torch.arange(x.shape[1], device=x.device))
        h = model.embed(x, ctx.positions) if self.first else x
        for block in self.blocks:
            h = block(h, ctx)
        return model.head(h) if self.last else h


def _ours(grid: Grid, spec: ModelSpec, plan: Plan, name: str):
    rt = our_runtime(grid, spec, plan, schedule=build_schedule(name, plan.pp, M))
    micro = rt.micro_batches(synthetic_batch(spec, plan, 0))

    def step() -> None:
        rt.train_step(micro)
        rt.timeline.spans.clear()
    return step


def _torch(grid: Grid, spec: ModelSpec, plan: Plan, name: str):
    from torch.distributed import pipelining

    p = plan.pp
    layout = stage_layout(spec, plan, grid.pp_rank, Placement.v_shape(p))
    model = keep_stage(build_model(spec, device=grid.device), layout)
    stages = [pipelining.PipelineStage(_Chunk(model, layout.chunks[c], layout.is_first(c), layout.is_last(c)),
                                       layout.virtual(c), 2 * p, grid.device, group=grid.groups["pp"])
              for c in range(2)]
    schedule = getattr(pipelining.schedules, TORCH_CLASS[name])(stages, M, loss_fn=loss_fn)
    opt = make_optimizer(model.parameters(), plan)
    batch = synthetic_batch(spec, plan, 0)

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        if layout.has_embedding:                                # rank 0: the first and the last stage
            schedule.step(batch.tokens, target=batch.targets, losses=[])
        else:
            schedule.step()
        opt.step()
    return step


def _bench_rank(grid: Grid, spec: ModelSpec, plan: Plan) -> dict[str, list[float]]:
    steps = {}
    for name in ("zb-v", "dualpipev"):
        steps[f"ours {name}"] = _ours(grid, spec, plan, name)
        steps[f"torch {TORCH_CLASS[name]}"] = _torch(grid, spec, plan, name)
    times, _ = side_by_side({k: (lambda i, f=f: f()) for k, f in steps.items()}, WARMUP, STEPS)
    return times


def measure(p: int) -> dict[str, float]:
    spec = SPEC.with_(layers=2 * p)
    plan = Plan(pp=p, grad_accum=M, micro_batch=4, seq=128, schedule="1f1b", optimizer="adam-fp32", dtype="fp32")
    return slowest_rank_median(launch(_bench_rank, plan, spec, plan, timeout_s=600))


def main() -> None:
    print(f"{SPEC.summary()} with 2p blocks; seq 128, micro-batch 4, m={M}, AdamW; median of {STEPS} steps")
    for p in (2, 4):
        t = measure(p)
        print(f"p={p} ranks (2p={2 * p} virtual stages): " + ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in t.items()))
        for name, cls in TORCH_CLASS.items():
            print(f"  ratio ours {name} / torch {cls} = {t[f'ours {name}'] / t[f'torch {cls}']:.2f}  (goal <= 1.0)")


if __name__ == "__main__":
    main()
