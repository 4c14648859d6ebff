"""The single-process reference every parallel run is compared with (same model, data and optimizer).

:func:`reference_train` trains the whole global batch in one process: the loss of a step is the mean
cross-entropy over all its ``global_batch * seq`` tokens, and the parameters after ``steps`` optimizer
steps are what a correct parallel run must reproduce (up to float reordering; bitwise where the run's
arithmetic is the same). ``parallel-lab run`` reports ``max |parallel - reference|`` over parameters.

``mixed=True`` is the reference of ``optimizer="adam-mixed"`` (distributed/model/mixed_precision.py): bf16
model, fp32 master weights and AdamW, and the batch as ``dp * grad_accum`` micro-batches whose bf16
gradients are added in the order a data-parallel run adds them.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import Tensor

from parallel_lab.distributed.model.data import synthetic_batch
from parallel_lab.distributed.model.model import build_model, freeze, loss_fn, make_optimizer
from parallel_lab.errors import ParallelLabError
from parallel_lab.specs import ModelSpec, Plan


@dataclass
class ReferenceResult:
    losses: list[float]
    params: dict[str, Tensor]


def reference_train(spec: ModelSpec, plan: Plan, steps: int, seed: int = 0, frozen: Iterable[str] = (),
                    packed: bool = False, mixed: bool = False) -> ReferenceResult:
    """Single process, whole global batch at once: loss = mean over all its tokens; ``steps`` optimizer steps.

    Returns the loss of each step (before its update) and the final parameters by name. fp32 AdamW for
    every Adam layout (adam-fp32, adam-mixed, fsdp2-mixed: the fp32 arithmetic the mixed runs approximate).

    ``mixed=True`` (an ``adam-mixed`` plan): the arithmetic of a mixed-precision data-parallel run in one
    process (distributed/model/mixed_precision.py): bf16 model, fp32 master weights and AdamW, and the global batch as
    ``dp * grad_accum`` micro-batches of ``micro_batch`` sequences, each backward of ``loss / n`` adding
    its bf16 gradient into ``p.grad``, so that the gradient is rounded as a data-parallel run rounds it
    (bitwise equal for two micro-batches). The parameters returned are the fp32 masters.

    It runs on one torch thread, as each rank does: on a loaded machine torch's default thread count made
    the reference 16x slower (110 s against 6.8 s in a lesson), and one thread sums as the ranks sum.
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _reference_train(spec, plan, steps, seed, frozen, packed, mixed)
    finally:
        torch.set_num_threads(threads)


def _reference_train(spec: ModelSpec, plan: Plan, steps: int, seed: int, frozen: Iterable[str], packed: bool,
                     mixed: bool) -> ReferenceResult:
    model = build_model(spec, seed, recompute="none")
    if mixed:
        model.to(torch.bfloat16)
    freeze(model, frozen)
    if mixed and plan.optimizer != "adam-mixed":
        raise ParallelLabError(f"mixed=True is the reference of optimizer='adam-mixed', not {plan.optimizer!r}")
    fp32 = plan.with_(optimizer="adam-fp32") if plan.optimizer == "adam-mixed" and not mixed else plan
    opt = make_optimizer(model.parameters(), fp32)
    n = plan.global_batch // plan.micro_batch if mixed else 1
    losses = []
    for step in range(steps):
        batch = synthetic_batch(spec, plan, step, seed, packed=packed)
        total = 0.0
        for i in range(n):
            mb = batch if n == 1 else batch.rows(i * plan.micro_batch, (i + 1) * plan.micro_batch)
            loss = loss_fn(model(mb.tokens, mb.positions, mb.doc_ids), mb.targets) / n
            loss.backward()
            total += loss.item()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(total)
    masters = opt.master_of() if mixed else {}
    return ReferenceResult(losses, {name: masters.get(id(p), p).detach().clone()
                                    for name, p in model.named_parameters()})
