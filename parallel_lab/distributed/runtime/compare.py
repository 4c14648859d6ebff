"""``parallel-lab compare A B``: train two plans on the same data and say whether their loss curves agree.

A change of plan should not change what is learned: the same global batch, split another way, gives the
same mean loss and the same gradients (docs/conventions.md, "Loss"), so two plans with the same model,
seed, sequence length and global batch ``micro_batch * grad_accum * dp`` must give loss curves equal to
rounding. The tutorial's fifth failure mode (docs/sources.md) is a loss normalisation that depends on the
plan (the division by
the number of micro-batches ``m`` done in the wrong place, or not at all): each plan still trains, but
the effective learning rate moves with ``m``, and only an overlay of the two curves shows it.

:func:`compare` runs both plans with ``distributed.runtime.run.run`` (each also against its own single-process
reference) and calls them in agreement when every step's losses differ by at most ``tolerance`` relative
to the loss (:data:`DEFAULT_TOLERANCE`; fp32 rounding between plans is ~1e-7 here, a plan-dependent
normalisation of ``m = 2`` moves SGD's loss by ~1e-3 after one step). Plans are given as plan files or as
``FIELD=VALUE,...`` over the run defaults (:func:`plan_from_text`); faults (``distributed/runtime/faults.py``)
may be injected into either run, e.g. ``unscaled-accum`` into B to see the fifth failure mode caught.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from parallel_lab.distributed.runtime.faults import Fault
from parallel_lab.distributed.runtime.run import RunReport, run
from parallel_lab.errors import ParallelLabError
from parallel_lab.specs import ModelSpec, Plan

#: Largest ``|loss_a - loss_b| / |loss_b|`` at any step for two plans to agree.
DEFAULT_TOLERANCE = 1e-4


@dataclass
class Comparison:
    """Two runs of the same data under two plans; ``agree`` when every step is within ``tolerance``."""

    plan_a: Plan
    plan_b: Plan
    a: RunReport
    b: RunReport
    tolerance: float
    faults_b: tuple[Fault, ...] = ()

    @property
    def rel_diffs(self) -> list[float]:
        return [abs(x - y) / max(abs(y), 1e-12) for x, y in zip(self.a.losses, self.b.losses, strict=True)]

    @property
    def agree(self) -> bool:
        return all(d <= self.tolerance for d in self.rel_diffs)

    @property
    def first_disagreement(self) -> int | None:
        """The first step (0-based) whose losses differ by more than the tolerance, or None."""
        return next((i for i, d in enumerate(self.rel_diffs) if d > self.tolerance), None)

    def verdict(self) -> str:
        worst = max(self.rel_diffs) if self.rel_diffs else 0.0
        if self.agree:
            return (f"the loss curves agree: largest relative difference {worst:.1e} <= tolerance "
                    f"{self.tolerance:g}")
        return (f"the loss curves DISAGREE from step {self.first_disagreement}: largest relative difference "
                f"{worst:.1e} > tolerance {self.tolerance:g}; the same data under two plans should give the same "
                f"losses: look for a normalisation that depends on the plan (the loss divided by grad_accum, "
                f"dp or the token count in the wrong place; the tutorial's fifth failure mode)")

    def to_json(self) -> dict[str, Any]:
        return {"plan_a": dataclasses.asdict(self.plan_a), "plan_b": dataclasses.asdict(self.plan_b),
                "losses_a": self.a.losses, "losses_b": self.b.losses,
                "reference_losses": self.a.reference_losses, "relative_differences": self.rel_diffs,
                "tolerance": self.tolerance, "agree": self.agree, "first_disagreement": self.first_disagreement,
                "faults_b": [f.spelling() for f in self.faults_b],
                "wall_s": {"a": self.a.wall_s, "b": self.b.wall_s}}

    def summary(self) -> str:
        def short(p: Plan) -> str:
            return (f"dp={p.dp} tp={p.tp} pp={p.pp} cp={p.cp} zero={p.zero} micro_batch={p.micro_batch} "
                    f"grad_accum={p.grad_accum}")

        lines = [self.a.model.summary(), f"A: {short(self.plan_a)}",
                 f"B: {short(self.plan_b)}" + (f"  (faults injected: {', '.join(f.spelling() for f in self.faults_b)})"
                                               if self.faults_b else ""),
                 f"same data: {self.plan_a.global_batch} sequences x {self.plan_a.seq} tokens per step, "
                 f"{self.plan_a.optimizer}", "",
                 "step        loss A        loss B   relative diff"]
        for i, (x, y, d) in enumerate(zip(self.a.losses, self.b.losses, self.rel_diffs, strict=True)):
            lines.append(f"{i:>4}  {x:>12.6f}  {y:>12.6f}  {d:>14.2e}{'  > tolerance' if d > self.tolerance else ''}")
        lines += ["", self.verdict()]
        return "\n".join(lines)


def check_same_data(spec: ModelSpec, a: Plan, b: Plan) -> None:
    """Both plans must see the same tokens per step: same sequence length and global batch."""
    if a.seq != b.seq or a.global_batch != b.global_batch:
        raise ParallelLabError(
            f"plan A trains {a.global_batch} x {a.seq} tokens per step and plan B {b.global_batch} x {b.seq}: "
            f"compare needs the same data; make micro_batch * grad_accum * dp and seq equal (e.g. dp=2 against "
            f"dp=1,grad_accum={2 * a.grad_accum})")


def plan_from_text(text: str, base: Plan) -> tuple[ModelSpec | None, Plan]:
    """A plan file (a path that exists, or ending in .yaml/.yml), or ``FIELD=VALUE,...`` over ``base``:
    ``dp=2``, ``dp=1,grad_accum=2``, ``tp=2,sp=true``. Values take the type of the Plan field."""
    if Path(text).suffix in (".yaml", ".yml") or Path(text).is_file():
        from parallel_lab.planfile import load_plan

        pf = load_plan(text)
        return pf.model, pf.plan
    fields = {f.name: f for f in dataclasses.fields(Plan)}
    given: dict[str, Any] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        if "=" not in part:
            raise ParallelLabError(f"plan {text!r}: {part!r} is not FIELD=VALUE; e.g. dp=2,grad_accum=2 (or a plan "
                                   f"file)")
        k, v = (s.strip() for s in part.split("=", 1))
        k = k.replace("-", "_")
        if k not in fields:
            raise ParallelLabError(f"plan {text!r}: {k!r} is not a Plan field; e.g. dp, tp, pp, cp, zero, "
                                   f"grad_accum, micro_batch")
        default = getattr(base, k)
        try:
            if isinstance(default, bool):
                if v.lower() not in ("true", "false", "1", "0", "yes", "no", "on", "off"):
                    raise ValueError
                given[k] = v.lower() in ("true", "1", "yes", "on")
            elif isinstance(default, int):
                given[k] = int(v)
            elif isinstance(default, float):
                given[k] = float(v)
            else:
                given[k] = v
        except ValueError:
            want = "true or false" if isinstance(default, bool) else "an integer" if isinstance(default, int) else (
                "a number")
            raise ParallelLabError(f"plan {text!r}: {k}={v!r} must be {want}") from None
    return None, base.with_(**given)


def compare(spec: ModelSpec, plan_a: Plan, plan_b: Plan, steps: int = 3, seed: int = 0, *,
            tolerance: float = DEFAULT_TOLERANCE, faults_a: Iterable[Fault] = (), faults_b: Iterable[Fault] = (),
            timeout_s: float = 300.0) -> Comparison:
    """Train ``plan_a`` and ``plan_b`` on the same data (same model, seed, batches); compare their losses."""
    plan_a, plan_b = plan_a.validate(spec), plan_b.validate(spec)
    check_same_data(spec, plan_a, plan_b)
    if not tolerance > 0:
        raise ParallelLabError(f"tolerance={tolerance!r} must be > 0, e.g. {DEFAULT_TOLERANCE:g}")
    a = run(spec, plan_a, steps, seed, timeout_s=timeout_s, faults=faults_a)
    b = run(spec, plan_b, steps, seed, timeout_s=timeout_s, faults=faults_b)
    return Comparison(plan_a, plan_b, a, b, tolerance, tuple(faults_b))
