"""One rank's runtime: the model it runs, its place in the grid, its instruments, and the training step.

The ``apply_*`` functions of the parallelisms (``train.parallelize`` calls them in a fixed order) each
edit a :class:`Runtime`; :meth:`Runtime.train_step` then runs one optimizer step, the same code for
``parallel-lab run``, the tests and the benchmarks::

    dp.zero_grad()
    for i, micro in enumerate(micro_batches):        # or the pipeline executor's action list
        dp.set_sync(i == m - 1)                      # DDP's no_sync on every micro-batch but the last
        loss_i = loss(model(micro)) / m;  loss_i.backward()
    dp.finish();  [fn() for fn in finalize_grads]    # finish the gradient sync; TP's replicated grads
    dp.step()                                        # optimizer step (ZeRO: on the shard, then gather)

Each micro-batch contributes ``mean over its tokens / m`` (``m = grad_accum``) and ``dp.finish`` averages
over the ``dp x cp`` gradient group, so the gradients equal those of the mean loss over the global batch
(every micro-batch has the same number of tokens). Data slicing is in :meth:`Runtime.micro_batches`
(docs/conventions.md, "Determinism"). What each field means, and who sets it, is in docs/conventions.md
("Composition").
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from typing import Any

from torch import Tensor, nn

from parallel_lab.distributed.data_parallel.data_parallel import LocalGrads
from parallel_lab.distributed.instruments.saved import SavedTensorMeter
from parallel_lab.distributed.instruments.timeline import Timeline
from parallel_lab.distributed.instruments.tracer import CommTracer
from parallel_lab.distributed.model.data import Batch
from parallel_lab.distributed.model.model import loss_fn
from parallel_lab.distributed.runtime.grid import Grid
from parallel_lab.specs import Plan


def _default_loss(logits: Tensor, batch: Batch) -> Tensor:
    return loss_fn(logits, batch.targets)


@dataclass
class Runtime:
    """One rank's parallelised training; ``apply_tp``, ``apply_cp``, ``apply_pp``, ``apply_zero`` edit it.

    Defaults are those of a single process: the loss of every rank counts, every rank returns its
    parameters, micro-batches are not cut further, forward and backward run one micro-batch after the
    other (:func:`sequential_forward_backward`).
    """

    model: nn.Module
    grid: Grid
    plan: Plan
    timeline: Timeline
    tracer: CommTracer | None = None             # None: no measurement attached (the benchmarks)
    meter: SavedTensorMeter | None = None
    dp: LocalGrads | None = None
    shard_micro: Callable[[Batch], Batch] = lambda b: b
    loss: Callable[[Tensor, Batch], Tensor] = _default_loss
    forward_backward: Callable[[Runtime, list[Batch]], float] | None = None
    owns_loss: bool = True
    param_owner: bool = True
    gather_full: list[Callable[[dict[str, Tensor]], dict[str, Tensor]]] = field(default_factory=list)
    finalize_grads: list[Callable[[], None]] = field(default_factory=list)
    extras: dict[str, Any] = field(default_factory=dict)

    @property
    def grad_group_size(self) -> int:
        return self.grid.size(self.grid.grad_group)

    def micro_batches(self, batch: Batch) -> list[Batch]:
        """This rank's micro-batches of a global batch: its data-parallel rows, cut into ``grad_accum``
        micro-batches of ``micro_batch`` sequences, each passed through ``shard_micro``."""
        mb, m = self.plan.micro_batch, self.plan.grad_accum
        first = self.grid.dp_rank * mb * m
        out = []
        for i in range(m):
            micro = batch.rows(first + i * mb, first + (i + 1) * mb)
            micro.positions = micro.positions.clone()
            out.append(self.shard_micro(micro.to(self.grid.device)))
        return out

    def train_step(self, micro_batches: list[Batch], before_step: Callable[[], None] | None = None) -> float:
        """One optimizer step on this rank's micro-batches (module docstring); returns the local loss.

        ``before_step``: called once the gradients are final, before the optimizer step (a test reads
        the synchronised gradients there). The saved-tensor meter, if any, watches forward and backward;
        the comm tracer, if attached, observes the whole step (``CommTracer.observe``).
        """
        with self.tracer.observe() if self.tracer is not None else nullcontext():
            self.dp.zero_grad()
            with self.meter if self.meter is not None else nullcontext():
                loss = (self.forward_backward or sequential_forward_backward)(self, micro_batches)
            with self.phase_as("backward"):
                self.dp.finish()
                for fn in self.finalize_grads:
                    fn()
            if before_step is not None:
                before_step()
            with self.phase_as("step"), self.timeline.span("step"):
                self.dp.step()
        return loss

    def phase_as(self, phase: str) -> AbstractContextManager[None]:
        """The step phase the calls inside belong to ("forward", "backward", "step"): the loop's, and a
        pipeline executor's (it is the loop there)."""
        return self.tracer.phase_as(phase) if self.tracer is not None else nullcontext()

    def full_parameters(self) -> dict[str, Tensor]:
        """This rank's parameters rebuilt to full tensors (``gather_full``: TP's untraced gathers; every rank
        of the group must call it)."""
        full = self.dp.local_parameters()
        for fn in self.gather_full:
            full = fn(full)
        return full


def sequential_forward_backward(rt: Runtime, micro_batches: list[Batch]) -> float:
    """Forward then backward of each micro-batch in turn (no pipeline); returns the step's local loss."""
    m = len(micro_batches)
    total = 0.0
    for i, mb in enumerate(micro_batches):
        rt.dp.set_sync(i == m - 1)
        with rt.phase_as("forward"), rt.timeline.span("F", micro_batch=i):
            loss = rt.loss(rt.model(mb.tokens, mb.positions, mb.doc_ids), mb) / m
        with rt.phase_as("backward"), rt.timeline.span("B", micro_batch=i):
            loss.backward()
        total += loss.item()
    return total
