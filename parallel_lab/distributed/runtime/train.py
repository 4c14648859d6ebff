"""One rank's training loop, and the composition of the parallelisms of a Plan.

:func:`train_rank` (what ``launch`` runs on every rank) builds the model from the full weights, hands it to
:func:`parallelize`, runs ``steps`` optimizer steps and returns a :class:`RankResult` (losses, traced
calls, memory, timeline, full parameters for the comparison with ``reference.reference_train``).
Composition, innermost first, as torchtitan's ``parallelize`` writes it::

    if plan.tp > 1: apply_tp(rt)      # column/row-parallel linears, vocab-parallel embedding and loss
    if plan.cp > 1: apply_cp(rt)      # context-parallel attention core, sequence chunks per rank
    if moe:         apply_ep(rt)      # experts of this ep rank, tokens dispatched by all-to-all
    if plan.pp > 1: apply_pp(rt)      # this rank's stage; the schedule's executor runs forward/backward
    rt.dp = apply_zero(...) if plan.zero else apply_dp(...)   # gradient sync over dp (x cp)

:func:`check_runnable` refuses, before any process starts, every plan one of them cannot run.
Details: docs/runtime.md.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from torch import Tensor, nn

from parallel_lab.distributed.context_parallel.context_parallel import apply_cp, check_cp
from parallel_lab.distributed.data_parallel.data_parallel import apply_dp
from parallel_lab.distributed.expert_parallel.expert_parallel import apply_ep, check_ep
from parallel_lab.distributed.instruments.saved import SavedTensorMeter
from parallel_lab.distributed.instruments.timeline import Timeline
from parallel_lab.distributed.instruments.tracer import CommTracer, TracedCall
from parallel_lab.distributed.model.data import synthetic_batch
from parallel_lab.distributed.model.mixed_precision import check_mixed, is_mixed, to_compute_dtype
from parallel_lab.distributed.model.model import build_model, freeze
from parallel_lab.distributed.pipeline_parallel.pipeline_parallel import apply_pp, check_pp
from parallel_lab.distributed.runtime.diagnosis import ActionLog, FiniteWatch
from parallel_lab.distributed.runtime.faults import Fault, FaultInjector
from parallel_lab.distributed.runtime.grid import Grid
from parallel_lab.distributed.runtime.runtime import Runtime
from parallel_lab.distributed.tensor_parallel.tp_model import apply_tp, check_tp
from parallel_lab.distributed.zero.zero import apply_zero, check_zero
from parallel_lab.errors import ParallelLabError
from parallel_lab.simulate import Interval
from parallel_lab.specs import ModelSpec, Plan


def parallelize(model: nn.Module, grid: Grid, plan: Plan, tracer: CommTracer | None, meter: bool = True,
                schedule: Any = None) -> Runtime:
    """Apply the plan's parallelisms to ``model`` in the fixed order TP, CP, PP, then ZeRO or DDP.
    ``schedule``: pipeline action lists to run instead of ``plan.schedule``'s (``pipeline.apply_pp``).

    ``tracer``: the comm tracer that observes every step, or None (nothing measures: the benchmarks).
    ``meter``: attach the saved-tensor meter (created last: it hooks the final modules by name); the
    benchmarks time the step without it.
    """
    rt = Runtime(model, grid, plan, Timeline(grid.rank), tracer)
    rt.owns_loss = grid.tp_rank == 0
    rt.param_owner = grid.dp_rank == 0 and grid.cp_rank == 0 and grid.tp_rank == 0
    if plan.tp > 1:
        apply_tp(rt)
    if plan.cp > 1:
        apply_cp(rt)
    if model.spec.is_moe:
        apply_ep(rt)                              # experts of this ep rank, all-to-all dispatch (ep > 1)
    if plan.pp > 1:
        apply_pp(rt, schedule)
    if plan.zero:
        apply_zero(rt)
    else:
        rt.dp = apply_dp(rt.model, plan, grid.groups[grid.grad_group], rt.grad_group_size)
    if meter:
        rt.meter = SavedTensorMeter(rt.model)
    return rt


@dataclass
class RankResult:
    """What one rank sends back to the caller."""

    rank: int
    coords: dict[str, int]
    losses: list[float]
    owns_loss: bool
    events: list[TracedCall]
    memory: dict[str, int]
    params: dict[str, Tensor] | None
    spans: list[Interval]
    step_times: list[float]
    info: dict[str, Any] = field(default_factory=dict)


def check_runnable(spec: ModelSpec, plan: Plan) -> None:
    """Errors for plans the runnable code cannot execute (clear message, before any process starts)."""
    plan.validate(spec)
    # FSDP2-style mixed precision (fp32 shards and AdamW, bf16 gathers and compute) is ZeRO-3's
    # (distributed/zero/zero.py); the ZeRO paper's (bf16 parameters and gradients, fp32 master and AdamW)
    # is DDP's and ZeRO-1/2's (distributed/model/mixed_precision.py); both compose with TP, PP and CP
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
    if plan.recompute == "op-sac" and (plan.tp > 1 or plan.cp > 1):
        raise ParallelLabError(f"recompute='op-sac' runs here with tp=1 and cp=1 only (got tp={plan.tp}, "
                               f"cp={plan.cp}): its recomputed forward would repeat TP/CP collectives that the "
                               "communication model does not count; use recompute='full' or 'selective'")
    if plan.loss_chunk and plan.tp > 1:
        raise ParallelLabError(f"loss_chunk={plan.loss_chunk} (chunked cross-entropy) runs with tp=1 only; the "
                               "vocabulary-parallel cross-entropy of tp > 1 is not chunked here; set loss_chunk=0")
    check_parallelisms(spec, plan)


def check_parallelisms(spec: ModelSpec, plan: Plan) -> None:
    """Each parallelism's own refusals (``check_tp``, ``check_cp``, ``check_pp``, ``check_zero``), in the order
    :func:`parallelize` applies them."""
    if plan.tp > 1:
        check_tp(spec, plan)
    if plan.cp > 1:
        check_cp(spec, plan)
    if spec.is_moe:
        check_ep(spec, plan)
    if plan.pp > 1:
        check_pp(spec, plan)
    if plan.zero:
        check_zero(spec, plan)


def train_rank(grid: Grid, spec: ModelSpec, plan: Plan, steps: int = 3, seed: int = 0, *,
               frozen: Iterable[str] = (), packed: bool = False, return_params: bool = True,
               schedule: Any = None, faults: Iterable[Fault] = ()) -> RankResult:
    """Train ``steps`` optimizer steps of ``plan`` on this rank; see the module docstring. ``schedule``:
    pipeline action lists to run instead of ``plan.schedule``'s (``parallelize``).

    Diagnosis (``distributed/runtime/diagnosis.py``) is always on: the rank's current action goes to the launcher,
    its blocked seconds per step to ``info["wait_s"]``, and a NaN or inf raises, naming the module.
    ``faults``: injected on purpose (``distributed/runtime/faults.py``)."""
    check_runnable(spec, plan)
    model = build_model(spec, seed, recompute=plan.recompute, device=grid.device, attention=plan.attention,
                        mlp=plan.mlp, loss_chunk=plan.loss_chunk)
    to_compute_dtype(model, plan)               # adam-mixed: bf16 parameters (distributed/model/mixed_precision.py)
    freeze(model, frozen)
    tracer = CommTracer(grid.rank, grid.groups_by_dim())
    tracer.on_action = actions = ActionLog(grid.record)
    rt = parallelize(model, grid, plan, tracer, schedule=schedule)
    finite = FiniteWatch(rt.model, grid.rank)
    injector = FaultInjector(tuple(faults), grid.rank, rt)
    losses, step_times = [], []
    memory: dict[str, int] = {}
    for step in range(steps):
        micro = rt.micro_batches(synthetic_batch(spec, plan, step, seed, packed=packed))
        actions.begin_step(step + 1)
        finite.step = step + 1
        injector.begin_step(step + 1)
        t0 = time.perf_counter()
        losses.append(rt.train_step(micro))
        step_times.append(time.perf_counter() - t0)
        finite.check_loss(losses[-1])
        if step == steps - 1:
            memory = dict(rt.dp.measure_state())
        if grid.notify is not None:
            grid.notify(step + 1)
    comm_buffers = dict(tracer.buffers.peaks)   # each part's peak over the steps (ledger_buffers.comm_buffer_parts)
    memory["activations"] = int(rt.meter.peak["activations"])
    memory["logits_and_loss"] = int(rt.meter.peak["logits_and_loss"])
    rt.meter.remove()
    finite.remove()
    actions("reporting results (untraced)", False)
    tracer.enabled = False                      # reporting below is not part of the training step
    params = None
    if return_params:
        full = rt.full_parameters()
        params = {n: t.detach().cpu().clone() for n, t in full.items()} if rt.param_owner else None
    reports = {k: fn() for k, fn in rt.extras.get("reports", {}).items()}
    if plan.zero == 3:                          # ZeRO-3's memory peaks, sampled through the probe
        reports["zero"].update(tracer.zero3_peaks())
    return RankResult(grid.rank, grid.coords, losses, rt.owns_loss, list(tracer.events), memory, params,
                      rt.timeline.spans, step_times,
                      info={"buckets": [b.nbytes for b in getattr(rt.dp, "buckets", [])],
                            "comm_buffers": comm_buffers,
                            "wait_s": list(actions.wait_s),
                            "node": {"node": grid.node, "ranks_per_node": grid.ranks_per_node,
                                     "crossing": grid.crossing()},
                            **reports})


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

