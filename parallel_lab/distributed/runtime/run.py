"""``parallel-lab run``: train the tiny model under a plan on real ranks; measurement beside prediction.

:func:`run` launches :func:`~parallel_lab.distributed.runtime.train.train_rank` on ``plan.world`` ranks
(gloo on CPU, nccl on GPUs), trains the same steps in one process (``reference.reference_train``) and
reports ``losses`` against ``reference_losses``, ``max_abs_param_diff``, ``comm[dim]`` (measured against
predicted bytes, summed over ranks and steps), ``memory[category]`` (state equal to ``ledger.state_bytes``
exactly, activations within 2% of :func:`predicted_activations`, comm buffers equal to
``ledger_buffers.comm_buffer_parts``), ``moe``, the V schedules' predictions (``parallel_lab.placed``),
``wall_s``, ``step_times`` (compute and wait per rank, the straggler), ``nodes`` (groups crossing a node)
and ``pipeline`` (bubble and idle fraction predicted and measured, ``pipeline_report``). Each field in
full: docs/runtime.md.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from parallel_lab import comm, ledger, ledger_activations, ledger_buffers, mesh, placed
from parallel_lab.cluster_job import under_torchrun
from parallel_lab.distributed.expert_parallel.expert_parallel import format_moe_report, moe_report
from parallel_lab.distributed.instruments.tracer import payload_by_dim
from parallel_lab.distributed.model.mixed_precision import is_mixed
from parallel_lab.distributed.model.reference import reference_train
from parallel_lab.distributed.pipeline_parallel.pipeline_report import format_pipeline_report, pipeline_report
from parallel_lab.distributed.runtime.diagnosis import format_step_times, step_time_report
from parallel_lab.distributed.runtime.faults import Fault, check_faults
from parallel_lab.distributed.runtime.grid import coords
from parallel_lab.distributed.runtime.launch import launch
from parallel_lab.distributed.runtime.train import (
    RankResult,
    check_runnable,
    global_losses,
    max_abs_diff,
    merge_params,
    train_rank,
)
from parallel_lab.errors import ParallelLabError
from parallel_lab.schedules.checks import validate
from parallel_lab.schedules.generators import V_SCHEDULES, build_schedule
from parallel_lab.specs import SCHEDULES, ModelSpec, Plan

STATE = ("parameters", "gradients", "optimizer_states")



def predicted_activations(spec: ModelSpec, plan: Plan, stage: int = 0) -> int:
    """Peak bytes saved for backward on one rank of pipeline stage ``stage``: the ledger's per-op model
    (``ledger_activations.activation_bytes(..., formula="per-op")``: the stage's blocks, the rotary tables, on stage 0
    the embedding's ids, times the schedule's in-flight micro-batches)."""
    return int(round(ledger_activations.activation_bytes(spec, plan, stage, formula="per-op")))


def predicted_logits_and_loss(spec: ModelSpec, plan: Plan, stage: int = 0) -> int:
    """The ledger's per-op bytes of the final norm, head and loss (``ledger_activations.logits_bytes``, the
    micro-batches whose head the last stage holds at once); 0 on every other stage."""
    return int(round(ledger_activations.logits_bytes(spec, plan, formula="per-op"))) if stage == plan.pp - 1 else 0


def predicted_comm_buffer_parts(spec: ModelSpec, plan: Plan, stage: int = 0) -> dict[str, int]:
    """``ledger_buffers.comm_buffer_parts`` of ``stage`` in whole bytes (the parts a rank samples, zero parts
    left out)."""
    return {k: int(round(v)) for k, v in (ledger_buffers.comm_buffer_parts(spec, plan, stage) or {}).items()}


def activation_model_name(plan: Plan) -> str:
    """Which activation model the predicted column uses: the per-op model with this plan's kernels."""
    return (f"per-op model (attention={plan.attention}, mlp={plan.mlp}, recompute={plan.recompute}, "
            f"loss_chunk={plan.loss_chunk}; parallel_lab.activations)")


@dataclass
class RunReport:
    """Measured against predicted for one ``run``; :meth:`to_json` is the ``--json`` contract."""

    model: ModelSpec
    plan: Plan
    steps: int
    losses: list[float]
    reference_losses: list[float]
    max_abs_param_diff: float
    comm: dict[str, dict[str, int]]
    memory: dict[str, dict[str, int]]
    wall_s: float
    extra: dict[str, Any] = field(default_factory=dict)
    ranks: list[RankResult] = field(default_factory=list, repr=False)

    def to_json(self) -> dict[str, Any]:
        return {"losses": self.losses, "reference_losses": self.reference_losses,
                "max_abs_param_diff": self.max_abs_param_diff, "comm": self.comm, "memory": self.memory,
                "wall_s": self.wall_s,
                **({"step_times": self.extra["step_times"]} if "step_times" in self.extra else {}),
                **({"pipeline": self.extra["pipeline"]} if "pipeline" in self.extra else {}),
                **({"moe": self.extra["moe"]} if "moe" in self.extra else {}),
                **({"comm_buffers": self.extra["comm_buffers"]} if "comm_buffers" in self.extra else {}),
                **({"nodes": self.extra["nodes"]} if "nodes" in self.extra else {})}

    def summary(self) -> str:
        lines = [self.model.summary(),
                 f"plan: dp={self.plan.dp} tp={self.plan.tp} pp={self.plan.pp} cp={self.plan.cp} ep={self.plan.ep} "
                 f"zero={self.plan.zero} ({self.plan.world} ranks), {self.steps} steps of "
                 f"{self.plan.global_batch} x {self.plan.seq} tokens, {self.plan.optimizer}, "
                 f"{self.plan.dtype}",
                 "", "step  loss (parallel)  loss (1 process)  difference"]
        for i, (a, b) in enumerate(zip(self.losses, self.reference_losses, strict=True)):
            lines.append(f"{i:>4}  {a:>15.6f}  {b:>16.6f}  {a - b:>10.2e}")
        lines.append(f"largest parameter difference after {self.steps} steps: {self.max_abs_param_diff:.2e}")
        lines += ["", "communication payload, all ranks and steps (bytes)", "dim           measured     predicted"]
        for dim, c in self.comm.items():
            ok = "ok" if c["measured_bytes"] == c["predicted_bytes"] else "DIFFERENT"
            lines.append(f"{dim:<8} {c['measured_bytes']:>13,} {c['predicted_bytes']:>13,}  {ok}")
        if not self.comm:
            lines.append("(none: a single rank per gradient group)")
        lines += ["", "memory per rank (bytes); predicted activations: " + activation_model_name(self.plan),
                  "category           measured      predicted"]
        rows = dict(self.memory)
        for cat in ("logits_and_loss", "comm_buffers"):
            if cat in self.extra:
                rows[cat] = self.extra[cat]
        for cat, c in rows.items():
            m, p = c["measured_bytes"], c["predicted_bytes"]
            gap = f"{(m - p) / p:+.2%}" if p else ""
            lines.append(f"{cat:<17} {m:>12,}  {p:>12,}  {gap}")
        if "pipeline" in self.extra:
            lines += ["", format_pipeline_report(self.extra["pipeline"])]
        if "moe" in self.extra:
            lines += ["", format_moe_report(self.extra["moe"])]
        if "step_times" in self.extra:
            lines += ["", format_step_times(self.extra["step_times"])]
        if "nodes" in self.extra:
            lines += ["", format_node_report(self.extra["nodes"])]
        lines.append(f"\nwall time of the parallel run: {self.wall_s:.2f} s")
        return "\n".join(lines)


class ProgressBar:
    """A one-line progress bar on stderr: ``run [#####-----] 2/3 steps``."""

    def __init__(self, total: int, label: str = "run", stream: Any = None, width: int = 30):
        self.total, self.label, self.width = total, label, width
        self.stream = stream if stream is not None else sys.stderr
        self.show(0)

    def show(self, done: int, note: str = "") -> None:
        n = int(self.width * done / max(self.total, 1))
        bar = "#" * n + "-" * (self.width - n)
        self.stream.write(f"\r{self.label} [{bar}] {done}/{self.total} steps {note}")
        self.stream.flush()

    def close(self, note: str = "") -> None:
        self.stream.write(f"\r{self.label} [{'#' * self.width}] {self.total}/{self.total} steps {note}\n")
        self.stream.flush()


def check_schedule(spec: ModelSpec, plan: Plan, schedule: str) -> Any:
    """The action lists of ``run(..., schedule=name)`` (a V schedule: ``zb-v`` or ``dualpipev``), built and
    validated; the plans whose predictions ``parallel_lab.placed`` makes (a pipeline alone, no ZeRO)."""
    if schedule not in V_SCHEDULES:
        raise ParallelLabError(f"schedule={schedule!r}: run takes {', '.join(V_SCHEDULES)} here (the others are "
                               f"Plan.schedule: --schedule {'/'.join(SCHEDULES)})")
    if plan.pp < 2 or plan.world != plan.pp or plan.zero or spec.is_moe:
        raise ParallelLabError(f"schedule={schedule!r} runs here as a pipeline alone (pp >= 2, dp = tp = cp = 1, "
                               f"zero 0, a dense model); got pp={plan.pp}, {plan.world} ranks, zero={plan.zero}")
    if spec.layers < 2 * plan.pp:
        raise ParallelLabError(f"{schedule} puts 2 chunks on each of pp={plan.pp} ranks: it needs layers >= "
                               f"{2 * plan.pp}, the model has {spec.layers}; lower --pp")
    return validate(build_schedule(schedule, plan.pp, plan.microbatches))


def gather_on_first(results: list[Any]) -> list[Any] | None:
    """Under torchrun ``launch`` returns only this process's entry: gather every rank's on rank 0 (untraced,
    after training); the list there, None on the other ranks."""
    import torch.distributed as dist

    rank = dist.get_rank()
    out: list[Any] | None = [None] * dist.get_world_size() if rank == 0 else None
    dist.gather_object(results[rank], out, dst=0)
    return out


def node_report(plan: Plan, results: list[RankResult]) -> dict[str, Any]:
    """Which groups crossed a node: each rank's own view (its ``Grid``, nodes from ``LOCAL_WORLD_SIZE``) and
    the prediction of ``mesh.crossing_groups`` for the same node size; ``run`` reports it when there
    are several nodes."""
    rpn = results[0].info["node"]["ranks_per_node"]
    dims = ["dp", "tp", "pp", "cp"] + (["dp_cp"] if plan.cp > 1 else [])
    seen: dict[str, set[tuple[int, ...]]] = {d: set() for d in dims}
    for r in results:
        for d, ranks in r.info["node"]["crossing"].items():
            if d in seen:
                seen[d].add(tuple(ranks))
    return {"ranks_per_node": rpn, "nodes": mesh.node_count(plan.world, rpn),
            "node_of_rank": [r.info["node"]["node"] for r in results],
            "crossing": {d: sorted(list(g) for g in seen[d]) for d in dims},
            "predicted_crossing": {d: mesh.crossing_groups(plan, d, rpn) for d in dims}}


def format_node_report(nodes: dict[str, Any]) -> str:
    lines = [f"nodes: {nodes['nodes']} of {nodes['ranks_per_node']} ranks (LOCAL_WORLD_SIZE); rank -> node "
             f"{nodes['node_of_rank']}", "group  crossing a node (measured by the ranks)   predicted"]
    for d, groups in nodes["crossing"].items():
        ok = "ok" if groups == nodes["predicted_crossing"][d] else "DIFFERENT"
        lines.append(f"{d:<6} {str(groups) if groups else 'none: inside one node':<38} "
                     f"{str(nodes['predicted_crossing'][d]) if nodes['predicted_crossing'][d] else 'none'}  {ok}")
    return "\n".join(lines)


def run(spec: ModelSpec, plan: Plan, steps: int = 3, seed: int = 0, *, frozen: Iterable[str] = (),
        packed: bool = False, timeout_s: float = 300.0, time_limit_s: float | None = None, progress: bool = False,
        on_progress: Callable[[int, Any], None] | None = None, schedule: str | None = None,
        faults: Iterable[Fault] = ()) -> RunReport | None:
    """Run ``plan`` on ranks and the reference in this process; compare (module docstring). ``schedule``:
    ``"zb-v"`` or ``"dualpipev"`` instead of ``plan.schedule`` (:func:`check_schedule`; its predictions are
    ``parallel_lab.placed``'s, read off the action lists and their V placement). ``faults``: injected into
    the ranks (``distributed/runtime/faults.py``; the reference runs without them). Under torchrun every process
    calls it: rank 0 gathers the results and returns the report, the others None."""
    check_runnable(spec, plan)
    sched = check_schedule(spec, plan, schedule) if schedule is not None else None
    frozen, faults = tuple(frozen), tuple(faults)
    check_faults(faults, plan.world, steps)
    bar = ProgressBar(steps, f"run {plan.world} ranks") if progress else None

    def report(rank: int, step: Any) -> None:
        if rank == 0 and bar is not None:
            bar.show(int(step))
        if on_progress is not None:
            on_progress(rank, step)

    t0 = time.perf_counter()
    results: list[RankResult] = launch(train_rank, plan, spec, plan, steps, seed, frozen=frozen,
                                       packed=packed, faults=faults, timeout_s=timeout_s,
                                       time_limit_s=time_limit_s, on_progress=report, schedule=sched)
    if under_torchrun():            # each process holds its own result: rank 0 gathers them and reports
        gathered = gather_on_first(results)
        if gathered is None:
            return None
        results = gathered
    wall = time.perf_counter() - t0
    if bar is not None:
        bar.close("(reference in one process...)")
    # adam-mixed: the reference does the same bf16 arithmetic in one process (distributed/model/mixed_precision.py)
    ref = reference_train(spec, plan, steps, seed, frozen=frozen, packed=packed, mixed=is_mixed(plan))

    if sched is not None:
        return _placed_report(spec, plan, steps, results, ref, wall, sched, schedule, frozen)
    measured = payload_by_dim(e for r in results for e in r.events)
    predicted: dict[str, int] = {}
    stages = [coords(plan, r.rank)["pp"] for r in results]
    for stage in stages:
        for dim, b in comm.payload_bytes(comm.collectives(spec, plan, stage=stage, frozen=frozen)).items():
            predicted[dim] = predicted.get(dim, 0) + b * steps
    dims = [d for d in comm.DIMS if d in measured or d in predicted]
    comm_out = {d: {"measured_bytes": int(measured.get(d, 0)), "predicted_bytes": int(predicted.get(d, 0))}
                for d in dims}

    memory: dict[str, dict[str, int]] = {}
    pred_state = [ledger.state_bytes(spec, plan, stage=s) for s in stages]
    for cat in STATE:
        memory[cat] = {"measured_bytes": max(r.memory[cat] for r in results),
                       "predicted_bytes": int(max(p[cat] for p in pred_state))}
    memory["activations"] = {"measured_bytes": max(r.memory["activations"] for r in results),
                             "predicted_bytes": max(predicted_activations(spec, plan, s) for s in stages)}
    extra = {"logits_and_loss": {"measured_bytes": max(r.memory["logits_and_loss"] for r in results),
                                 "predicted_bytes": max(predicted_logits_and_loss(spec, plan, s)
                                                        for s in stages)}}
    extra["comm_buffers"] = {
        "measured_bytes": max(sum(r.info["comm_buffers"].values()) for r in results),
        "predicted_bytes": max(sum(predicted_comm_buffer_parts(spec, plan, s).values()) for s in stages)}
    if plan.pp > 1:
        extra["pipeline"] = pipeline_report(spec, plan, results)
    if spec.is_moe:
        extra["moe"] = moe_report(spec, plan, results)
    extra["step_times"] = step_time_report([r.step_times for r in results], [r.info["wait_s"] for r in results])
    nodes = node_report(plan, results)
    if nodes["nodes"] > 1:
        extra["nodes"] = nodes
    return RunReport(spec, plan, steps, global_losses(results), ref.losses,
                     max_abs_diff(merge_params(results), ref.params), comm_out, memory, wall, extra, results)


def _placed_report(spec: ModelSpec, plan: Plan, steps: int, results: list[RankResult], ref: Any, wall: float,
                   sched: Any, name: str, frozen: tuple[str, ...]) -> RunReport:
    """The report of a run by action lists: predictions from ``parallel_lab.placed``."""
    if frozen:
        raise ParallelLabError("frozen parameters with a schedule given as action lists are not predicted here")
    ranks = [coords(plan, r.rank)["pp"] for r in results]
    measured = payload_by_dim(e for r in results for e in r.events)
    pred = sum(c.payload_bytes for k in ranks for c in placed.p2p_collectives(spec, plan, sched, k)) * steps
    comm_out = {"pp": {"measured_bytes": int(measured.get("pp", 0)), "predicted_bytes": int(pred)}}
    state = [placed.state_bytes(spec, plan, sched, k) for k in ranks]
    memory = {cat: {"measured_bytes": max(r.memory[cat] for r in results),
                    "predicted_bytes": int(max(s[cat] for s in state))} for cat in STATE}
    memory["activations"] = {"measured_bytes": max(r.memory["activations"] for r in results),
                             "predicted_bytes": int(max(placed.activation_bytes(spec, plan, sched, k)
                                                        for k in ranks))}
    extra = {"logits_and_loss": {"measured_bytes": max(r.memory["logits_and_loss"] for r in results),
                                 "predicted_bytes": int(max(placed.logits_bytes(spec, plan, sched, k)
                                                            for k in ranks))},
             "pipeline": pipeline_report(spec, plan, results, schedule=sched, name=name)}
    extra["step_times"] = step_time_report([r.step_times for r in results], [r.info["wait_s"] for r in results])
    return RunReport(spec, plan, steps, global_losses(results), ref.losses,
                     max_abs_diff(merge_params(results), ref.params), comm_out, memory, wall, extra, results)
