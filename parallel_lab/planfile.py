"""Plan files: one training phase's plan as a small, versioned YAML document.

A plan file records what was decided and what it is expected to cost, so that a run can be checked
against it and a change of circumstances noticed::

    schema_version: 1
    phase: pretrain-8k                  # a name: pretrain-8k, long-context-131k, ...
    model: llama3-405b                  # a preset name, or a mapping of ModelSpec fields
    cluster: h100-sxm                   # a preset name, or a mapping of ClusterSpec fields
    gpus: 16384
    plan: {dp: 128, tp: 8, pp: 16, ...} # every Plan field
    expected:                           # what the analytic core predicts for this plan
      memory_bytes_per_gpu: {parameters: ..., ..., total: ...}   # ledger, the fullest stage
      memory_stage: 0
      fits: true
      bytes_per_step: {dp: ..., tp: ..., pp: ...}   # wire bytes one GPU sends per step, by dim (comm)
      bubble_ratio: 0.117                           # planner.plan_bubble (simulate.bubble_formula)
      step_time_s: 6.99                             # planner.evaluate (its stated model)
      mfu: 0.389
    replan_when:                        # conditions under which this plan no longer holds, as data
      - {field: seq, value: 8192, reason: ...}

:func:`save_plan` writes one (computing ``expected`` from the ledger, the comm module and the planner's
time model when not given); :func:`load_plan` reads it back into a :class:`PlanFile` and validates it:
the schema version must be known, every field known, the plan valid for the model on ``gpus`` GPUs of
the cluster. Every problem raises :class:`ParallelLabError` naming the file and the fix. The
``parallel-lab run --plan FILE`` launcher of the runnable core takes such a file.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

import yaml

from . import comm, ledger
from .planner import evaluate, plan_bubble
from .specs import (
    CLUSTER_PRESETS,
    MODEL_PRESETS,
    ClusterSpec,
    LinkTier,
    ModelSpec,
    ParallelLabError,
    Plan,
)

SCHEMA_VERSION = 1
KNOWN_VERSIONS = (1,)
TOP_FIELDS = ("schema_version", "phase", "model", "cluster", "gpus", "plan", "expected", "replan_when")
_PHASE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")


@dataclass(frozen=True)
class ReplanCondition:
    """Re-plan when ``field`` no longer equals ``value`` (``reason`` says why the plan depends on it)."""

    field: str
    value: Any
    reason: str


@dataclass
class Expectations:
    """What the analytic core predicts for the plan (units: bytes, seconds)."""

    memory_bytes_per_gpu: dict[str, float]
    memory_stage: int
    fits: bool
    bytes_per_step: dict[str, float]
    bubble_ratio: float
    step_time_s: float | None = None
    mfu: float | None = None


@dataclass
class PlanFile:
    """A loaded plan file: the model, the cluster, the plan, what to expect and when to re-plan."""

    phase: str
    model: ModelSpec
    cluster: ClusterSpec
    gpus: int
    plan: Plan
    expected: Expectations
    replan_when: list[ReplanCondition] = field(default_factory=list)
    schema_version: int = SCHEMA_VERSION

    def to_dict(self) -> dict[str, Any]:
        return {
            "schema_version": self.schema_version,
            "phase": self.phase,
            "model": _model_to_data(self.model),
            "cluster": _cluster_to_data(self.cluster),
            "gpus": self.gpus,
            "plan": self.plan.to_dict(),
            "expected": asdict(self.expected),
            "replan_when": [asdict(c) for c in self.replan_when],
        }

    def needs_replan(self, **current: Any) -> list[ReplanCondition]:
        """The conditions that ``current`` values break, e.g. ``needs_replan(seq=131072, gpus=16384)``."""
        return [c for c in self.replan_when if c.field in current and current[c.field] != c.value]


# --------------------------------------------------------------------------------------------------
# Model and cluster: a preset name when they are a preset, else their fields
# --------------------------------------------------------------------------------------------------

def _model_to_data(model: ModelSpec) -> str | dict[str, Any]:
    if MODEL_PRESETS.get(model.name) == model:
        return model.name
    return asdict(model)


def _cluster_to_data(cluster: ClusterSpec) -> str | dict[str, Any]:
    if CLUSTER_PRESETS.get(cluster.name) == cluster:
        return cluster.name
    return asdict(cluster)


def _known(where: str, data: dict[str, Any], known: list[str] | tuple[str, ...]) -> None:
    unknown = sorted(set(data) - set(known))
    if unknown:
        raise ParallelLabError(f"{where}: unknown field(s) {unknown}; known fields: {sorted(known)}")


def _model_from_data(where: str, data: Any) -> ModelSpec:
    if isinstance(data, str):
        return ModelSpec.preset(data)
    if not isinstance(data, dict):
        raise ParallelLabError(f"{where}: model must be a preset name or a mapping of ModelSpec fields")
    _known(f"{where} model", data, [f.name for f in fields(ModelSpec)])
    return ModelSpec(**data)


def _cluster_from_data(where: str, data: Any) -> ClusterSpec:
    if isinstance(data, str):
        return ClusterSpec.preset(data)
    if not isinstance(data, dict):
        raise ParallelLabError(f"{where}: cluster must be a preset name or a mapping of ClusterSpec fields")
    _known(f"{where} cluster", data, [f.name for f in fields(ClusterSpec)])
    d = dict(data)
    for tier in ("intra", "inter"):
        t = d.get(tier)
        if not isinstance(t, dict):
            raise ParallelLabError(f"{where}: cluster.{tier} must be a mapping of name, bandwidth, latency")
        _known(f"{where} cluster.{tier}", t, [f.name for f in fields(LinkTier)])
        d[tier] = LinkTier(**t)
    return ClusterSpec(**d)


# --------------------------------------------------------------------------------------------------
# Expectations and re-planning conditions
# --------------------------------------------------------------------------------------------------

def expectations(model: ModelSpec, cluster: ClusterSpec, plan: Plan, *, margin: float = 0.1) -> Expectations:
    """Memory (ledger, fullest stage), bytes per step (comm), bubble and the planner's step-time estimate."""
    led = ledger.memory(model, plan, cluster, margin=margin)
    mem = {**led.per_gpu_bytes, "total": led.total_bytes}
    rep = comm.report(model, plan, cluster)
    bubble = plan_bubble(plan)
    step = mfu = None
    if model.shape_known:
        est = evaluate(model, cluster, plan, margin=margin)
        step, mfu = est.step_time_s, est.mfu
    return Expectations(mem, led.stage, led.fits, dict(rep.per_step_bytes), bubble, step, mfu)


def default_replan(model: ModelSpec, cluster: ClusterSpec, gpus: int, plan: Plan) -> list[ReplanCondition]:
    """The circumstances a plan was chosen for, as data."""
    return [
        ReplanCondition("seq", plan.seq, "activation memory, context parallelism and attention FLOPs "
                                         "scale with the sequence length"),
        ReplanCondition("gpus", gpus, "the degrees dp*tp*pp*cp must multiply to the number of GPUs"),
        ReplanCondition("global_batch", plan.global_batch, "micro_batch*grad_accum*dp must equal it, and "
                                                           "grad_accum (m) sets the pipeline bubble"),
        ReplanCondition("model", model.name, "memory, FLOPs and divisibility depend on the model's shape"),
        ReplanCondition("cluster", cluster.name, "HBM, link tiers and peak FLOPs decide fit and step time"),
    ]


# --------------------------------------------------------------------------------------------------
# Save and load
# --------------------------------------------------------------------------------------------------

def make_plan_file(model: ModelSpec, cluster: ClusterSpec, plan: Plan, *, phase: str, gpus: int | None = None,
                   expected: Expectations | None = None,
                   replan_when: list[ReplanCondition] | None = None) -> PlanFile:
    """A validated :class:`PlanFile` (``expected`` computed when not given)."""
    gpus = plan.world if gpus is None else gpus
    _check_phase("plan file", phase)
    plan.validate(model, gpus=gpus, cluster=cluster)
    return PlanFile(phase, model, cluster, gpus, plan, expected or expectations(model, cluster, plan),
                    replan_when if replan_when is not None else default_replan(model, cluster, gpus, plan))


def save_plan(path: str | Path, model: ModelSpec | PlanFile, cluster: ClusterSpec | None = None,
              plan: Plan | None = None, *, phase: str = "default", gpus: int | None = None,
              expected: Expectations | None = None,
              replan_when: list[ReplanCondition] | None = None) -> PlanFile:
    """Write a plan file (YAML) and return what was written. Pass a :class:`PlanFile`, or its parts."""
    if isinstance(model, PlanFile):
        pf = model
    else:
        if cluster is None or plan is None:
            raise ParallelLabError("save_plan needs a PlanFile, or model, cluster and plan")
        pf = make_plan_file(model, cluster, plan, phase=phase, gpus=gpus, expected=expected,
                            replan_when=replan_when)
    text = (f"# parallel_lab plan file, schema {pf.schema_version}: load with "
            f"parallel_lab.planfile.load_plan\n" + yaml.safe_dump(pf.to_dict(), sort_keys=False))
    Path(path).write_text(text)
    return pf


def _check_phase(where: str, phase: Any) -> None:
    if not isinstance(phase, str) or not _PHASE.match(phase):
        raise ParallelLabError(f"{where}: phase={phase!r} must be a name of letters, digits, '.', '_' "
                               "or '-', e.g. pretrain-8k")


def plan_file_from_data(data: Any, where: str = "plan file") -> PlanFile:
    """Validate the parsed YAML of a plan file and build the :class:`PlanFile`."""
    if not isinstance(data, dict):
        raise ParallelLabError(f"{where}: the document must be a mapping with fields {', '.join(TOP_FIELDS)}")
    if "schema_version" not in data:
        raise ParallelLabError(f"{where}: no schema_version; this parallel_lab reads "
                               f"schema_version {', '.join(map(str, KNOWN_VERSIONS))}")
    version = data["schema_version"]
    if version not in KNOWN_VERSIONS or isinstance(version, bool):
        raise ParallelLabError(f"{where}: schema_version {version!r} is not known; this parallel_lab reads "
                               f"{', '.join(map(str, KNOWN_VERSIONS))} (written by a newer version? upgrade)")
    _known(where, data, TOP_FIELDS)
    missing = [f for f in TOP_FIELDS if f not in data and f != "replan_when"]
    if missing:
        raise ParallelLabError(f"{where}: missing field(s) {missing}")
    _check_phase(where, data["phase"])
    try:
        model = _model_from_data(where, data["model"])
        cluster = _cluster_from_data(where, data["cluster"])
        gpus = data["gpus"]
        if isinstance(gpus, bool) or not isinstance(gpus, int) or gpus < 1:
            raise ParallelLabError(f"gpus={gpus!r} must be a positive integer")
        if not isinstance(data["plan"], dict):
            raise ParallelLabError("plan must be a mapping of Plan fields")
        plan = Plan.from_dict(data["plan"]).validate(model, gpus=gpus, cluster=cluster)
        exp = data["expected"]
        if not isinstance(exp, dict):
            raise ParallelLabError("expected must be a mapping")
        _known("expected", exp, [f.name for f in fields(Expectations)])
        expected = Expectations(**exp)
        conds = data.get("replan_when") or []
        if not isinstance(conds, list) or not all(isinstance(c, dict) for c in conds):
            raise ParallelLabError("replan_when must be a list of {field, value, reason} mappings")
        replan = []
        for c in conds:
            _known("replan_when entry", c, ("field", "value", "reason"))
            replan.append(ReplanCondition(**c))
    except ParallelLabError as e:
        msg = str(e)
        raise ParallelLabError(msg if msg.startswith(where) else f"{where}: {msg}") from None
    except TypeError as e:   # a missing field of a nested mapping
        raise ParallelLabError(f"{where}: {e}") from None
    return PlanFile(data["phase"], model, cluster, gpus, plan, expected, replan, version)


def load_plan(path: str | Path) -> PlanFile:
    """Read and validate a plan file (see the module docstring)."""
    p = Path(path)
    where = f"plan file {p}"
    try:
        text = p.read_text()
    except OSError as e:
        raise ParallelLabError(f"{where}: cannot be read ({e.strerror or e}); check the path") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        raise ParallelLabError(f"{where} is not valid YAML{at}: {getattr(e, 'problem', e)}") from None
    return plan_file_from_data(data, where)


# --------------------------------------------------------------------------------------------------
# The example plan files (examples/plans/), generated by this code
# --------------------------------------------------------------------------------------------------

def tiny_examples() -> dict[str, PlanFile]:
    """Plan files for the tiny model on CPU ranks (what ``parallel-lab run --plan`` takes)."""
    model, cluster = ModelSpec.preset("tiny-llama"), ClusterSpec.preset("cpu-gloo")
    run = {"seq": 128, "micro_batch": 4, "dtype": "fp32", "optimizer": "adam-fp32"}
    plans = {
        "tiny-dp2-zero3": Plan(dp=2, zero=3, **run),
        "tiny-tp2-sp": Plan(tp=2, sp=True, **run),
        "tiny-pp2-1f1b": Plan(pp=2, grad_accum=4, schedule="1f1b", **run),
        "tiny-cp2-ring": Plan(cp=2, cp_kind="ring", **run),
    }
    return {name: make_plan_file(model, cluster, plan, phase=name) for name, plan in plans.items()}


def write_examples(directory: str | Path) -> list[Path]:
    """Write :func:`tiny_examples` into ``directory`` as ``NAME.yaml``; returns the paths."""
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    out = []
    for name, pf in tiny_examples().items():
        path = d / f"{name}.yaml"
        save_plan(path, pf)
        out.append(path)
    return out
