"""Plan files: one training phase's plan as a small, versioned YAML document.

A plan file records what was decided (``schema_version``, ``phase``, ``engine``, ``model``, ``cluster``, ``gpus``,
``plan``), what it is expected to cost (``expected``: memory per GPU from the ledger, bytes per step by
dim from ``comm``, ``bubble_ratio`` from ``simulate.bubble_formula``, ``step_time_s`` and ``mfu`` from
``planner.evaluate``) and ``replan_when``, the conditions under which it no longer holds.
:func:`save_plan` writes one atomically (a temporary file renamed over the target); :func:`load_plan` reads
it into a :class:`PlanFile` and validates it against :data:`SCHEMA` (a known version, the types and ranges
of ``inputs.PLAN_FILE_LIMITS``, a plan valid for the model and cluster). The file is parsed safely and
bounded first: at most :data:`MAX_FILE_BYTES`, nesting at most :data:`MAX_DEPTH`, no anchors or aliases,
no key twice, integers within +-2^53, last line :data:`END_LINE`. Every problem raises
:class:`ParallelLabError` naming the file, the field and the fix. The format in full: docs/planfile.md.
"""

from __future__ import annotations

import math
import os
import re
import tempfile
from dataclasses import MISSING, asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

import yaml

from . import comm, ledger
from .engines import DEFAULT_ENGINE, ENGINES, torchtitan_differences
from .errors import ParallelLabError
from .hardware import CLUSTER_PRESETS, ClusterSpec, LinkTier, StepProfile
from .inputs import MAX_NAME, PLAN_FILE_LIMITS, read_bounded
from .planner import evaluate
from .specs import MODEL_PRESETS, RUN_DEFAULTS, ModelSpec, Plan
from .steptime import plan_bubble

SCHEMA_VERSION = 1
KNOWN_VERSIONS = (1,)
TOP_FIELDS = ("schema_version", "phase", "engine", "model", "cluster", "gpus", "plan", "expected", "replan_when")
_PHASE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,99}$")
MAX_FILE_BYTES = 256 * 1024      #: a plan file is a few kB; a larger one is refused unread
MAX_DEPTH = 8                    #: mappings/lists nested deeper than this are refused while parsing
MAX_INT = 2**53                  #: integers beyond +-2^53 are refused (no count in a plan is that large)
#: Fields with a default; every other field of the schema is required.
OPTIONAL = {"replan_when": [], "expected.step_time_s": None, "expected.mfu": None, "engine": DEFAULT_ENGINE}
#: The Plan fields of schema 1: all required (a field added to Plan later takes Plan's default).
PLAN_FIELDS_V1 = ("dp", "tp", "pp", "cp", "zero", "sp", "micro_batch", "grad_accum", "seq", "recompute",
                  "optimizer", "dtype", "schedule", "interleave", "cp_kind", "dp_kind", "bucket_mb",
                  "zero_unit")
#: The last line of every plan file: a file cut short (an interrupted copy) loses it, though what remains
#: may still be valid YAML (a shorter replan_when list, a shorter reason).
END_LINE = "# end of plan file"
#: ``replan_when`` fields and the type of their value.
REPLAN_FIELDS = {"seq": int, "gpus": int, "global_batch": int, "model": str, "cluster": str}


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
    #: the engine the plan was made for (engines.py): ``lab`` (a file without the field) or ``torchtitan``
    engine: str = DEFAULT_ENGINE

    def to_dict(self) -> dict[str, Any]:
        return {
            "schema_version": self.schema_version,
            "phase": self.phase,
            "engine": self.engine,
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


def _in_limits(where: str, name: str, cls: type, data: dict[str, Any]) -> None:
    """Every field of ``data`` (a mapping of ``cls`` fields) of its type, numbers within
    ``inputs.PLAN_FILE_LIMITS[name]`` (the command line's ranges), names printable and short."""
    _known(where, data, [f.name for f in fields(cls)])
    limits = PLAN_FILE_LIMITS[name]
    for f in fields(cls):
        if f.name not in data or f.name in ("intra", "inter", "profile"):
            continue
        v, kind, label = data[f.name], str(f.type), f"{name}.{f.name}"
        if v is None and kind.endswith("| None"):
            continue
        if kind.startswith(("int", "float")):
            lo, hi = limits.get(f.name, (0, MAX_INT))
            if kind.startswith("int"):
                _int(label, v, int(lo), int(hi))
            else:
                _number(label, v, lo, hi)
        elif kind.startswith("bool") and not isinstance(v, bool):
            raise _type_error(label, v, "true or false")
        elif f.name == "source" and not isinstance(v, str):       # a profile's provenance: free text
            raise _type_error(label, v, "a sentence (a string)")
        elif not kind.startswith(("int", "float", "bool")) and f.name != "source" and \
                not (isinstance(v, str) and v.isprintable() and 0 < len(v) <= MAX_NAME):
            raise _type_error(label, v, f"a name of 1 to {MAX_NAME} printable characters")


def _check_fields(where: str, what: str, cls: type, data: Any) -> None:
    """``data`` (not a preset name) must be a mapping of ``cls`` fields within the limits of ``what``."""
    if not isinstance(data, dict):
        raise ParallelLabError(f"{where}: {what} must be a preset name or a mapping of {cls.__name__} fields")
    _in_limits(f"{where} {what}", what, cls, data)


def _model_from_data(where: str, data: Any) -> ModelSpec:
    if isinstance(data, str):
        return ModelSpec.preset(data)
    _check_fields(where, "model", ModelSpec, data)
    return ModelSpec(**data)


def _cluster_from_data(where: str, data: Any) -> ClusterSpec:
    if isinstance(data, str):
        return ClusterSpec.preset(data)
    _check_fields(where, "cluster", ClusterSpec, data)
    d = dict(data)
    for tier in ("intra", "inter"):
        t = d.get(tier)
        if not isinstance(t, dict):
            raise ParallelLabError(f"{where}: cluster.{tier} must be a mapping of name, bandwidth, latency")
        _in_limits(f"{where} cluster.{tier}", "link", LinkTier, t)
        d[tier] = LinkTier(**t)
    if d.get("profile") is not None:
        _in_limits(f"{where} cluster.profile", "profile", StepProfile, _mapping("cluster.profile", d["profile"]))
        d["profile"] = StepProfile(**d["profile"])
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
                   replan_when: list[ReplanCondition] | None = None, engine: str = DEFAULT_ENGINE) -> PlanFile:
    """A validated :class:`PlanFile` (``expected`` computed when not given); a plan for ``engine="torchtitan"``
    must be one torchtitan runs as the ledger describes it (:func:`engines.torchtitan_differences` empty)."""
    gpus = plan.world if gpus is None else gpus
    _check_phase("plan file", phase)
    plan.validate(model, gpus=gpus, cluster=cluster)
    check_engine("plan file", engine, plan)
    return PlanFile(phase, model, cluster, gpus, plan, expected or expectations(model, cluster, plan),
                    replan_when if replan_when is not None else default_replan(model, cluster, gpus, plan),
                    engine=engine)


def check_engine(where: str, engine: Any, plan: Plan) -> None:
    """``engine`` is known, and a torchtitan plan is what torchtitan runs (the first difference named)."""
    if engine not in ENGINES:
        raise ParallelLabError(f"{where}: engine={_show(engine)} is not known; pick one of {', '.join(ENGINES)} "
                               f"(a file without the field is a plan for the lab's engine)")
    diffs = torchtitan_differences(plan) if engine == "torchtitan" else []
    if diffs:
        raise ParallelLabError(f"{where}: engine=torchtitan but {diffs[0][0]}")


def save_plan(path: str | Path, model: ModelSpec | PlanFile, cluster: ClusterSpec | None = None,
              plan: Plan | None = None, *, phase: str = "default", gpus: int | None = None,
              expected: Expectations | None = None,
              replan_when: list[ReplanCondition] | None = None, engine: str = DEFAULT_ENGINE) -> PlanFile:
    """Write a plan file (YAML) and return what was written. Pass a :class:`PlanFile`, or its parts."""
    if isinstance(model, PlanFile):
        pf = model
    else:
        if cluster is None or plan is None:
            raise ParallelLabError("save_plan needs a PlanFile, or model, cluster and plan")
        pf = make_plan_file(model, cluster, plan, phase=phase, gpus=gpus, expected=expected,
                            replan_when=replan_when, engine=engine)
    text = (f"# parallel_lab plan file, schema {pf.schema_version}: load with "
            f"parallel_lab.planfile.load_plan\n" + yaml.safe_dump(pf.to_dict(), sort_keys=False) + END_LINE + "\n")
    write_atomic(path, text)
    return pf


def write_atomic(path: str | Path, text: str, what: str = "plan file", example: str = "plan.yaml") -> None:
    """Write ``text`` to ``path`` through a temporary file in the same folder and a rename (all or nothing);
    an unwritable target raises ParallelLabError naming ``what``, the path and the reason."""
    p = Path(path)
    where = f"cannot write the {what} {str(p)[:200]}"
    if p.is_dir():
        raise ParallelLabError(f"{where}: it is a directory; give a file name, e.g. {str(p / example)[:200]}")
    folder = p.parent if str(p.parent) else Path(".")
    if not folder.is_dir():
        raise ParallelLabError(f"{where}: the folder {str(folder)[:200]} does not exist; create it first")
    tmp = None
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{p.name[:100]}.", suffix=".tmp", dir=folder)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, p)
        tmp = None
    except OSError as e:
        raise ParallelLabError(f"{where}: {e.strerror or e}; pick a writable path with free space") from None
    finally:
        if tmp is not None:
            try:
                os.unlink(tmp)
            except OSError:
                pass


def _check_phase(where: str, phase: Any) -> None:
    if not isinstance(phase, str) or not _PHASE.match(phase):
        raise ParallelLabError(f"{where}: phase={phase!r} must be a name of letters, digits, '.', '_' "
                               "or '-', e.g. pretrain-8k")


def _show(value: Any) -> str:
    """A value as a message shows it: its repr, at most 40 characters."""
    r = repr(value)
    return r if len(r) <= 40 else r[:37] + "..."


def _type_error(name: str, value: Any, want: str) -> ParallelLabError:
    return ParallelLabError(f"{name}={_show(value)} must be {want}")


def _int(name: str, value: Any, lo: int = 1, hi: int = MAX_INT) -> int:
    """An integer in ``[lo, hi]``; beyond +-2^53 the message says so (no count in a plan is that large)."""
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= MAX_INT:
        raise _type_error(name, value, f"an integer in [{lo}, 2^53]")
    if value > hi:
        raise _type_error(name, value, f"an integer in [{lo:,}, {hi:,}] (the command line's range)")
    return value


def _number(name: str, value: Any, lo: float = 0.0, hi: float = math.inf) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
            or not lo <= value <= hi:
        raise _type_error(name, value, f"a finite number in [{lo:g}, {hi:g}]")
    return value


def _mapping(name: str, value: Any) -> dict[str, Any]:
    if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
        raise ParallelLabError(f"{name} must be a mapping of names to values, got {_show(value)}")
    return value


def _require(name: str, data: dict[str, Any], required: tuple[str, ...] | list[str]) -> None:
    missing = [f for f in required if f not in data]
    if missing:
        raise ParallelLabError(f"{name}: missing field(s) {missing}; the schema requires them (see "
                               f"parallel_lab/planfile.py, or write the file with parallel-lab plan --save)")


def _plan_from_data(data: Any) -> Plan:
    """The ``plan`` mapping: every schema-1 field present, each of its Plan type."""
    d = _mapping("plan", data)
    defaults = {f.name: f.default for f in fields(Plan)}
    if set(d) - set(defaults):
        Plan.from_dict(d)                        # raises its own "unknown plan field(s)" message
    _require("plan", d, PLAN_FIELDS_V1)
    for k, v in d.items():
        want = defaults[k]
        if want is MISSING:
            continue
        if isinstance(want, bool):
            if not isinstance(v, bool):
                raise _type_error(f"plan.{k}", v, "true or false")
        elif isinstance(want, int):
            lo, hi = PLAN_FILE_LIMITS["plan"].get(k, (0 if k in ("zero", "loss_chunk") else 1, MAX_INT))
            _int(f"plan.{k}", v, int(lo), int(hi))
        elif isinstance(want, float):
            _number(f"plan.{k}", v, *PLAN_FILE_LIMITS["plan"].get(k, (0.0, math.inf)))
        elif isinstance(want, str) and not isinstance(v, str):
            raise _type_error(f"plan.{k}", v, "a name (a string)")
    return Plan.from_dict(d)


def _expected_from_data(data: Any, plan: Plan) -> Expectations:
    exp = _mapping("expected", data)
    _known("expected", exp, [f.name for f in fields(Expectations)])
    _require("expected", exp, [f.name for f in fields(Expectations) if f"expected.{f.name}" not in OPTIONAL])
    for key in ("memory_bytes_per_gpu", "bytes_per_step"):
        for k, v in _mapping(f"expected.{key}", exp[key]).items():
            _number(f"expected.{key}.{k}", v)
    _int("expected.memory_stage", exp["memory_stage"], lo=0)
    if exp["memory_stage"] >= plan.pp:
        raise ParallelLabError(f"expected.memory_stage={exp['memory_stage']} must be a pipeline stage, "
                               f"0..{plan.pp - 1}")
    if not isinstance(exp["fits"], bool):
        raise _type_error("expected.fits", exp["fits"], "true or false")
    _number("expected.bubble_ratio", exp["bubble_ratio"])
    if exp.get("step_time_s") is not None:
        _number("expected.step_time_s", exp["step_time_s"], lo=0.0)
    if exp.get("mfu") is not None:
        _number("expected.mfu", exp["mfu"], hi=1.0)
    return Expectations(**{**{k[len("expected."):]: v for k, v in OPTIONAL.items() if k.startswith("expected.")},
                           **exp})


def _replan_from_data(data: Any, current: dict[str, Any]) -> list[ReplanCondition]:
    if not isinstance(data, list):
        raise ParallelLabError("replan_when must be a list of {field, value, reason} mappings")
    out = []
    for i, c in enumerate(data):
        name = f"replan_when[{i}]"
        c = _mapping(name, c)
        _known(name, c, ("field", "value", "reason"))
        _require(name, c, ("field", "value", "reason"))
        f, v = c["field"], c["value"]
        if f not in REPLAN_FIELDS:
            raise ParallelLabError(f"{name}.field={_show(f)} is not known; pick one of {', '.join(REPLAN_FIELDS)}")
        if REPLAN_FIELDS[f] is int:
            _int(f"{name}.value", v)
        elif not isinstance(v, str):
            raise _type_error(f"{name}.value", v, "a name (a string)")
        if not isinstance(c["reason"], str):
            raise _type_error(f"{name}.reason", c["reason"], "a sentence (a string)")
        if current.get(f, v) != v:
            raise ParallelLabError(f"{name} says {f}={_show(v)} but the file's plan has {f}={_show(current[f])}; "
                                   f"the file contradicts itself (edited by hand?); write it again with "
                                   f"parallel-lab plan --save")
        out.append(ReplanCondition(f, v, c["reason"]))
    return out


def plan_file_from_data(data: Any, where: str = "plan file") -> PlanFile:
    """Validate the parsed YAML of a plan file against the schema and build the :class:`PlanFile`."""
    if not isinstance(data, dict):
        raise ParallelLabError(f"{where}: the document must be a mapping with fields {', '.join(TOP_FIELDS)}")
    if "schema_version" not in data:
        raise ParallelLabError(f"{where}: no schema_version; this parallel_lab reads "
                               f"schema_version {', '.join(map(str, KNOWN_VERSIONS))}")
    version = data["schema_version"]
    if isinstance(version, bool) or not isinstance(version, int) or version not in KNOWN_VERSIONS:
        raise ParallelLabError(f"{where}: schema_version {_show(version)} is not known; this parallel_lab reads "
                               f"{', '.join(map(str, KNOWN_VERSIONS))} (an integer; written by a newer version? "
                               f"upgrade)")
    try:
        _mapping("the document", data)
        _known(where, data, TOP_FIELDS)
        _require(where, data, [f for f in TOP_FIELDS if f not in OPTIONAL])
        _check_phase(where, data["phase"])
        model = _model_from_data(where, data["model"])
        cluster = _cluster_from_data(where, data["cluster"])
        gpus = _int("gpus", data["gpus"], *(int(x) for x in PLAN_FILE_LIMITS["gpus"]["gpus"]))
        plan = _plan_from_data(data["plan"]).validate(model, gpus=gpus, cluster=cluster)
        expected = _expected_from_data(data["expected"], plan)
        current = {"seq": plan.seq, "gpus": gpus, "global_batch": plan.global_batch, "model": model.name,
                   "cluster": cluster.name}
        replan = _replan_from_data(data.get("replan_when", OPTIONAL["replan_when"]), current)
        engine = data.get("engine", OPTIONAL["engine"])
        check_engine(where, engine, plan)
    except ParallelLabError as e:
        msg = str(e)
        raise ParallelLabError(msg if msg.startswith(where) else f"{where}: {msg}") from None
    except (TypeError, ValueError, OverflowError) as e:   # a missing or odd field of a nested mapping
        raise ParallelLabError(f"{where}: {str(e)[:300]}") from None
    return PlanFile(data["phase"], model, cluster, gpus, plan, expected, replan, version, engine)


class _BoundedLoader(yaml.SafeLoader):
    """PyYAML's safe loader that refuses anchors and aliases and nesting deeper than MAX_DEPTH, while
    composing (before anything is expanded or built)."""

    _depth = 0

    def compose_node(self, parent: Any, index: Any) -> Any:
        event = self.peek_event()
        if isinstance(event, yaml.AliasEvent) or getattr(event, "anchor", None) is not None:
            raise _Refused(f"anchors and aliases (&name, *name) are not allowed in a plan file, at line "
                           f"{event.start_mark.line + 1}; write the values out")
        self._depth += 1
        if self._depth > MAX_DEPTH:
            raise _Refused(f"nesting deeper than {MAX_DEPTH} levels at line {event.start_mark.line + 1}; a plan "
                           f"file is a flat mapping of a few mappings")
        try:
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1

    def construct_mapping(self, node: Any, deep: bool = False) -> Any:
        seen: set[Any] = set()
        for key_node, _ in node.value:
            key = key_node.value if isinstance(key_node, yaml.ScalarNode) else None
            if key is not None and key in seen:
                raise _Refused(f"the field {_show(key)} appears twice (line {key_node.start_mark.line + 1}); "
                               f"keep one")
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


class _Refused(Exception):
    pass


def parse_plan_text(raw: bytes, where: str = "plan file") -> Any:
    """The YAML document in ``raw``, bounded and safe (see the module docstring)."""
    if len(raw) > MAX_FILE_BYTES:
        raise ParallelLabError(f"{where} is {len(raw):,} bytes; a plan file is at most {MAX_FILE_BYTES:,} "
                               f"(is it the right file?)")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ParallelLabError(f"{where} is not UTF-8 text (byte {e.start}: {raw[e.start:e.start + 1]!r}); "
                               f"save it as UTF-8") from None
    if "\x00" in text:
        raise ParallelLabError(f"{where} contains a NUL byte; it is not a text file")
    try:
        return yaml.load(text, Loader=_BoundedLoader)   # noqa: S506  (a SafeLoader subclass)
    except _Refused as e:
        raise ParallelLabError(f"{where}: {e}") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = " ".join(str(getattr(e, "problem", None) or e).split())[:200]
        raise ParallelLabError(f"{where} is not valid YAML{at}: {problem}") from None
    except (ValueError, OverflowError, RecursionError) as e:    # e.g. an integer of 5,000 digits
        raise ParallelLabError(f"{where}: a value cannot be read ({' '.join(str(e).split())[:120]})") from None


def load_plan(path: str | Path) -> PlanFile:
    """Read and validate a plan file (see the module docstring)."""
    where = f"plan file {str(path)[:200]}"
    if not str(path).strip():
        raise ParallelLabError("plan file '': no path given; e.g. --plan examples/plans/tiny-dp2-zero3.yaml")
    raw = read_bounded(path, "plan file", MAX_FILE_BYTES)
    pf = plan_file_from_data(parse_plan_text(raw, where), where)
    if raw.rstrip().rsplit(b"\n", 1)[-1].strip() != END_LINE.encode():
        raise ParallelLabError(f"{where} does not end with the line '{END_LINE}': it was cut short (an "
                               f"interrupted copy?); write it again with parallel-lab plan --save (a file "
                               f"written by hand: add that line)")
    return pf


# --------------------------------------------------------------------------------------------------
# The example plan files (examples/plans/), generated by this code
# --------------------------------------------------------------------------------------------------

def tiny_examples() -> dict[str, PlanFile]:
    """Plan files for the tiny model on CPU ranks (what ``parallel-lab run --plan`` takes)."""
    model, cluster = ModelSpec.preset("tiny-llama"), ClusterSpec.preset("cpu-gloo")
    run = RUN_DEFAULTS
    plans = {
        "tiny-dp2-zero3": Plan(dp=2, zero=3, **run),
        "tiny-tp2-sp": Plan(tp=2, sp=True, **run),
        "tiny-pp2-1f1b": Plan(pp=2, grad_accum=4, schedule="1f1b", **run),
        "tiny-cp2-ring": Plan(cp=2, cp_kind="ring", **run),
    }
    return {name: make_plan_file(model, cluster, plan, phase=name) for name, plan in plans.items()}


def meta_examples() -> dict[str, PlanFile]:
    """Meta's Llama 3 405B runs on 16,384 H100s as published (Dubey et al. 2024, Table 4 and section 3.3.2): TP 8,
    PP 16 interleaved with one block fewer on the first and last stage, FSDP sharding gradients and optimizer
    states but not re-sharding parameters after forward (zero=2), fp32 gradient reduction, all-gather CP, 16
    sequences per data-parallel rank; 8K with DP 128 and no activation checkpointing, 131K with CP 16 and DP 8.
    Not published, chosen here: interleave 2 and, at 131K, no recompute either. Made for torchtitan."""
    model, cluster = ModelSpec.preset("llama3-405b"), ClusterSpec.preset("h100-sxm")
    meta = dict(tp=8, pp=16, zero=2, sp=True, micro_batch=1, grad_accum=16, recompute="none", dtype="bf16",
                optimizer="adam-mixed-fp32-grad", schedule="interleaved", interleave=2, pp_split="embed-head",
                cp_kind="allgather", attention="flash")
    phases = {"meta-8k": Plan(dp=128, cp=1, seq=8192, **meta), "meta-131k": Plan(dp=8, cp=16, seq=131072, **meta)}
    return {f"llama3-405b-{phase}": make_plan_file(model, cluster, plan, phase=phase, engine="torchtitan")
            for phase, plan in phases.items()}


def write_examples(directory: str | Path) -> list[Path]:
    """Write :func:`tiny_examples` and :func:`meta_examples` into ``directory`` as ``NAME.yaml``; returns the
    paths (the planner's own 405B suggestions there are written by ``parallel-lab plan --save``)."""
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    out = []
    for name, pf in {**tiny_examples(), **meta_examples()}.items():
        path = d / f"{name}.yaml"
        save_plan(path, pf)
        out.append(path)
    return out
