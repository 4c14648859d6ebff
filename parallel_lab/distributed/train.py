"""One rank's training loop, and the composition of the parallelisms of a Plan.

:func:`train_rank` is what :func:`~parallel_lab.distributed.launch.launch` runs on every rank::

    results = launch(train_rank, plan, spec, plan, steps=3, seed=0)

It builds the model from the full weights (``model.build_model``: the same on every rank), hands it to
:func:`parallelize`, runs ``steps`` optimizer steps on the rank's share of each global batch, and returns
a :class:`RankResult`: local losses, the traced collectives, measured memory, a timeline, and (untraced)
the full parameters this rank can contribute so that the caller can compare them with the
single-process reference (``model.reference_train``).

Composition. :func:`parallelize` wraps the model in a :class:`Runtime` and applies the parallelisms in a
fixed order, innermost first, each by one small function that edits the runtime::

    apply_tp(rt)     dist/tensor_parallel.py   swap linears for column/row-parallel ones (names unchanged),
                                               maybe rt.loss (vocab-parallel cross-entropy), rt.gather_full
    apply_cp(rt)     dist/context_parallel.py  swap each block.attn.core, set rt.shard_micro (sequence chunks
                                               and their positions / document ids)
    apply_pp(rt)     dist/pipeline.py          keep this stage's pieces, set rt.forward_backward (the
                                               executor) and rt.owns_loss
    apply_zero(rt)   dist/zero.py              set rt.dp to a ZeRO-1/2/3 object (the LocalGrads interface)
    apply_dp(...)    dist/data_parallel.py     otherwise: DDP naive / bucketed over the gradient group

A module that is not there yet makes a plan that needs it fail with a ParallelLabError naming the file.
To plug in, write ``apply_x(rt: Runtime) -> None`` in your file (and optionally ``check_x(spec, plan)``,
raising ParallelLabError for plans it cannot run, which :func:`check_runnable` calls before any process
starts); nothing here needs to change, except
where your parallelism changes what the report predicts (``predicted_activations`` in dist/run.py).

Fields a plug-in may set (defaults in brackets):

* ``rt.model``: the module this rank runs (a pipeline stage keeps only its pieces).
* ``rt.shard_micro(batch) -> Batch`` [identity]: cut a micro-batch for this rank (CP: sequence chunks,
  with their true positions and document ids).
* ``rt.loss(logits, batch) -> Tensor`` [``model.loss_fn``]: mean loss over the rank's tokens.
* ``rt.forward_backward(rt, micro_batches) -> float`` [:func:`sequential_forward_backward`]: forward and
  backward of all micro-batches of a step; returns the step's local loss (sum of ``loss / m``); must call
  ``rt.dp.set_sync(last)`` before each backward and label phases through ``rt.tracer.phase_as``.
* ``rt.owns_loss`` [tp_rank == 0]: this rank's loss counts in the reported loss (PP: last stage only).
* ``rt.gather_full``: functions ``dict[name, local tensor] -> dict[name, full tensor]`` applied in order to
  rebuild full parameters (untraced collectives; every rank calls them).
* ``rt.finalize_grads`` [none]: functions called after ``rt.dp.finish()`` and before the optimizer step, in
  the backward phase, e.g. TP's all-reduce of gradients that are partial over the TP group (Megatron's
  ``finalize_model_grads``).
* ``rt.param_owner`` [dp_rank == 0 and cp_rank == 0 and tp_rank == 0]: this rank returns parameters.
* ``rt.dp``: the data-parallel object (``LocalGrads`` interface: set_sync, finish, step, zero_grad,
  measure_state, local_parameters).
* ``rt.meter``: the saved-tensor meter, created after every ``apply_*`` (it hooks the final modules by
  name: ``tok_emb``, ``blocks.{i}``, ``final_norm``, ``lm_head``), so use it at run time, e.g.
  ``rt.meter.exclude(t)`` for a gathered buffer that is not an activation. Parameters are excluded
  automatically (looked up on ``rt.model`` at every save).
* ``rt.extras``: a free dict for a plug-in's own state. ``rt.extras["reports"]``, if set, maps a name to a
  function returning plain data; :func:`train_rank` puts ``name: fn()`` into ``RankResult.info`` at the end
  (the pipeline reports its measured timeline this way).

What the caller predicts for a plan lives in dist/run.py (``comm.collectives`` per rank's stage,
``ledger.state_bytes``, ``predicted_activations``); adjust those there if your parallelism changes them.

Loss normalisation: each micro-batch contributes ``mean over its tokens / m`` (``m = grad_accum``), and
gradients are averaged over the ``dp x cp`` ranks, so the gradients equal those of the mean loss over the
whole global batch (all micro-batches have the same number of tokens).
"""

from __future__ import annotations

import importlib
import importlib.util
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from torch import Tensor, nn

from parallel_lab.distributed.data_parallel import LocalGrads, apply_dp
from parallel_lab.distributed.grid import Grid
from parallel_lab.distributed.instruments import CommEvent, CommTracer, SavedTensorMeter, Span, Timeline
from parallel_lab.distributed.mixed_precision import check_mixed, is_mixed, to_compute_dtype
from parallel_lab.distributed.model import Batch, build_model, freeze, loss_fn, synthetic_batch
from parallel_lab.specs import ModelSpec, ParallelLabError, Plan


def _default_loss(logits: Tensor, batch: Batch) -> Tensor:
    return loss_fn(logits, batch.targets)


@dataclass
class Runtime:
    """One rank's parallelised training; the ``apply_*`` functions edit its fields (module docstring)."""

    model: nn.Module
    grid: Grid
    plan: Plan
    tracer: CommTracer
    timeline: Timeline
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


def sequential_forward_backward(rt: Runtime, micro_batches: list[Batch]) -> float:
    """Forward then backward of each micro-batch in turn (no pipeline); returns the step's local loss."""
    m = len(micro_batches)
    total = 0.0
    for i, mb in enumerate(micro_batches):
        rt.dp.set_sync(i == m - 1)
        with rt.tracer.phase_as("forward"), rt.timeline.span("F", micro_batch=i):
            loss = rt.loss(rt.model(mb.tokens, mb.positions, mb.doc_ids), mb) / m
        with rt.tracer.phase_as("backward"), rt.timeline.span("B", micro_batch=i):
            loss.backward()
        total += loss.item()
    return total


# --------------------------------------------------------------------------------------------------
# Composition
# --------------------------------------------------------------------------------------------------

PLUGINS = {  # plan field -> (module in parallel_lab.distributed, function, issue that adds it)
    "tp": ("tensor_parallel", "apply_tp", "tensor parallelism"),
    "cp": ("context_parallel", "apply_cp", "context parallelism"),
    "pp": ("pipeline", "apply_pp", "pipeline parallelism"),
    "zero": ("zero", "apply_zero", "ZeRO-1/2/3"),
}


def plugin(what: str) -> Callable[[Runtime], None]:
    """The ``apply_*`` function for ``what`` (tp, cp, pp, zero), or a clear error if its file is missing."""
    module, fn, title = PLUGINS[what]
    name = f"parallel_lab.distributed.{module}"
    if importlib.util.find_spec(name) is None:
        raise ParallelLabError(f"{what} > {1 if what != 'zero' else 0} needs dist/{module}.py ({title}), "
                               f"which is not in this version of parallel_lab; run with {what}="
                               f"{1 if what != 'zero' else 0}")
    mod = importlib.import_module(name)
    if not hasattr(mod, fn):
        raise ParallelLabError(f"dist/{module}.py has no {fn}(rt) yet; run with {what}="
                               f"{1 if what != 'zero' else 0}")
    return getattr(mod, fn)


def parallelize(model: nn.Module, grid: Grid, plan: Plan, tracer: CommTracer, schedule: Any = None) -> Runtime:
    """Apply the plan's parallelisms to ``model`` in the fixed order TP, CP, PP, then ZeRO or DDP.
    ``schedule``: pipeline action lists to run instead of ``plan.schedule``'s (``pipeline.apply_pp``)."""
    rt = Runtime(model, grid, plan, tracer, Timeline(grid.rank))
    rt.owns_loss = grid.tp_rank == 0
    rt.param_owner = grid.dp_rank == 0 and grid.cp_rank == 0 and grid.tp_rank == 0
    for what in ("tp", "cp", "pp"):
        if getattr(plan, what) > 1:
            plugin(what)(rt, *((schedule,) if what == "pp" and schedule is not None else ()))
    if plan.zero:
        plugin("zero")(rt)
    else:
        rt.dp = apply_dp(rt.model, plan, tracer, rt.grad_group_size)
    if rt.forward_backward is None:
        rt.forward_backward = sequential_forward_backward
    rt.meter = SavedTensorMeter(rt.model)
    return rt


# --------------------------------------------------------------------------------------------------
# The per-rank loop
# --------------------------------------------------------------------------------------------------

@dataclass
class RankResult:
    """What one rank sends back to the caller."""

    rank: int
    coords: dict[str, int]
    losses: list[float]
    owns_loss: bool
    events: list[CommEvent]
    memory: dict[str, int]
    params: dict[str, Tensor] | None
    spans: list[Span]
    step_times: list[float]
    info: dict[str, Any] = field(default_factory=dict)


def check_runnable(spec: ModelSpec, plan: Plan) -> None:
    """Errors for plans the runnable code cannot execute (clear message, before any process starts)."""
    plan.validate(spec)
    # FSDP2-style mixed precision (fp32 shards and AdamW, bf16 gathers and compute) is ZeRO-3's (dist/zero.py);
    # the ZeRO paper's (bf16 parameters and gradients, fp32 master and AdamW) is DDP's and ZeRO-1/2's
    # (dist/mixed_precision.py)
    check_mixed(spec, plan)
    mixed = plan.zero == 3 and plan.optimizer == "fsdp2-mixed" and plan.dtype in ("fp32", "bf16")
    mixed = mixed or is_mixed(plan)
    if plan.dtype != "fp32" and not mixed:
        raise ParallelLabError(f"dtype={plan.dtype!r}: the runnable implementations compute in fp32 (CPU "
                               f"default); use --dtype fp32 (or bf16 with --optimizer adam-mixed, or with "
                               f"--zero 3 --optimizer fsdp2-mixed)")
    if plan.optimizer not in ("adam-fp32", "sgd-momentum") and not mixed:
        raise ParallelLabError(f"optimizer={plan.optimizer!r} is not runnable; use adam-fp32 or sgd-momentum "
                               f"(or adam-mixed with --dtype bf16, or fsdp2-mixed with --zero 3)")
    for what in PLUGINS:
        if getattr(plan, what) > (0 if what == "zero" else 1):
            check = getattr(importlib.import_module(plugin(what).__module__), f"check_{what}", None)
            if check is not None:                # the plug-in's own limits, e.g. check_tp(spec, plan)
                check(spec, plan)


def train_rank(grid: Grid, spec: ModelSpec, plan: Plan, steps: int = 3, seed: int = 0, *,
               frozen: Iterable[str] = (), packed: bool = False, return_params: bool = True) -> RankResult:
    """Train ``steps`` optimizer steps of ``plan`` on this rank; see the module docstring."""
    check_runnable(spec, plan)
    model = build_model(spec, seed, recompute=plan.recompute, device=grid.device)
    to_compute_dtype(model, plan)               # adam-mixed: bf16 parameters (dist/mixed_precision.py)
    freeze(model, frozen)
    tracer = CommTracer(grid.rank, grid.groups_by_dim())
    rt = parallelize(model, grid, plan, tracer)
    losses, step_times = [], []
    memory: dict[str, int] = {}
    for step in range(steps):
        batch = synthetic_batch(spec, plan, step, seed, packed=packed)
        micro = rt.micro_batches(batch)
        t0 = time.perf_counter()
        rt.dp.zero_grad()
        with rt.meter:
            loss = rt.forward_backward(rt, micro)
        with tracer.phase_as("backward"):
            rt.dp.finish()
            for fn in rt.finalize_grads:
                fn()
        with tracer.phase_as("step"), rt.timeline.span("step"):
            rt.dp.step()
        step_times.append(time.perf_counter() - t0)
        losses.append(loss)
        if step == steps - 1:
            memory = dict(rt.dp.measure_state())
        if grid.notify is not None:
            grid.notify(step + 1)
    memory["activations"] = int(rt.meter.peak["activations"])
    memory["logits_and_loss"] = int(rt.meter.peak["logits_and_loss"])
    rt.meter.remove()
    tracer.enabled = False                      # reporting below is not part of the training step
    params = None
    if return_params:
        full = rt.dp.local_parameters()
        for fn in rt.gather_full:
            full = fn(full)
        params = {n: t.detach().cpu().clone() for n, t in full.items()} if rt.param_owner else None
    return RankResult(grid.rank, grid.coords, losses, rt.owns_loss, list(tracer.events), memory, params,
                      rt.timeline.spans, step_times,
                      info={"buckets": [b.nbytes for b in getattr(rt.dp, "buckets", [])],
                            **{k: fn() for k, fn in rt.extras.get("reports", {}).items()}})


def merge_params(results: list[RankResult]) -> dict[str, Tensor]:
    """Full parameters from the ranks that own some (pipeline stages own different names)."""
    out: dict[str, Tensor] = {}
    for r in results:
        for n, t in (r.params or {}).items():
            out.setdefault(n, t)
    return out


def global_losses(results: list[RankResult]) -> list[float]:
    """Per step: the mean of the local losses of the ranks that own one (equal token counts each)."""
    owners = [r.losses for r in results if r.owns_loss]
    if not owners:
        raise ParallelLabError("no rank reported a loss")
    return [sum(x[i] for x in owners) / len(owners) for i in range(len(owners[0]))]


def max_abs_diff(a: dict[str, Tensor], b: dict[str, Tensor]) -> float:
    """``max |a - b|`` over the parameters of ``b`` (all must be in ``a``)."""
    missing = sorted(set(b) - set(a))
    if missing:
        raise ParallelLabError(f"parameters missing from the parallel run: {missing[:4]}")
    return max(float((a[n].float() - b[n].float()).abs().max()) for n in b) if b else 0.0

