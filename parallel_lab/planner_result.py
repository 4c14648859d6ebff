"""What a search returns: one :class:`Estimate` per plan (memory and step time, docs/planner.md) and the
:class:`PlannerResult`, the ranked plans that :meth:`PlannerResult.top` also checks against the ledger's
whole verdict (the larger of the total and the peak at one moment, ``ledger.MemoryLedger.fits``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from . import ledger
from .hardware import ClusterSpec
from .specs import ModelSpec, Plan

#: The Plan fields of a row of ``parallel-lab plan --json``.
ROW_FIELDS = ("dp", "tp", "pp", "cp", "zero", "zero2_accumulate", "sp", "micro_batch", "grad_accum", "recompute",
              "schedule", "interleave")


@dataclass
class Estimate:
    """One plan with its memory and step-time estimate (the model: docs/planner.md).

    ``fields`` are the Plan's fields; ``plan`` builds (and keeps) the :class:`Plan` on first use, so that
    the search need not build one per candidate.
    """

    fields: dict[str, Any]
    memory_bytes: float              # largest stage total (the ledger's)
    usable_bytes: float              # hbm * (1 - margin)
    compute_s: float                 # the busiest stage's compute for the step
    bubble_ratio: float
    comm_s: dict[str, float]         # alpha-beta time per dim (the stage that sets the step time)
    exposed_s: dict[str, float]      # what of it is on the critical path
    step_time_s: float
    mfu: float
    _plan: Plan | None = field(default=None, repr=False, compare=False)
    #: ``memory``'s verdict on the plan, the larger of the total and the peak at one moment
    #: (``ledger.MemoryLedger.need_bytes``); set by :meth:`PlannerResult.top`, None until checked
    need_bytes: float | None = field(default=None, compare=False)
    #: the optimizer step's memory-bound seconds of the stage that sets the step (0 without a roofline profile)
    optimizer_s: float = 0.0

    @property
    def plan(self) -> Plan:
        if self._plan is None:
            self._plan = Plan(**self.fields)
        return self._plan

    @property
    def headroom_bytes(self) -> float:
        """What is left of ``usable_bytes``: after the verdict's need once it is checked, else the total."""
        return self.usable_bytes - (self.memory_bytes if self.need_bytes is None else self.need_bytes)

    @property
    def bubble_s(self) -> float:
        critical = self.compute_s + self.exposed_s.get("tp", 0.0) + self.exposed_s.get("cp", 0.0)
        return critical * self.bubble_ratio

    def row(self) -> dict[str, Any]:
        """The JSON row of ``parallel-lab plan --json``."""
        f = self.fields
        out = {k: f[k] for k in ROW_FIELDS}
        if "ep" in f:
            out["ep"] = f["ep"]
        if self.need_bytes is not None:
            out["need_bytes"] = self.need_bytes
        out.update({"memory_bytes": self.memory_bytes, "headroom_bytes": self.headroom_bytes,
                    "step_time_s": self.step_time_s, "mfu": self.mfu, "bubble_ratio": self.bubble_ratio,
                    "compute_s": self.compute_s, "exposed_comm_s": dict(self.exposed_s),
                    "comm_s": dict(self.comm_s)})
        return out


#: :meth:`PlannerResult.top` checks at most ``PEAK_SCAN_PER_PLAN`` plans per plan asked for (and at least
#: ``PEAK_SCAN_MIN``) at their peak at one moment.
PEAK_SCAN_PER_PLAN, PEAK_SCAN_MIN = 16, 64


@dataclass
class PlannerResult:
    """Ranked plans (best first), rejected families by reason, and what was searched."""

    estimates: Sequence[Estimate]
    rejected: dict[str, int]
    families: int
    candidates: int
    elapsed_s: float
    model: ModelSpec
    cluster: ClusterSpec
    gpus: int
    seq: int
    global_batch: int
    margin: float = 0.1
    _at_peak: dict[int, bool] = field(default_factory=dict, repr=False, compare=False)

    def fits_at_peak(self, i: int) -> bool:
        """Whether ``estimates[i]`` also passes ``memory``'s whole verdict: the larger of its total and its
        peak at one moment within ``hbm * (1 - margin)`` (``ledger.MemoryLedger.fits``, the rule the
        ``memory`` command and the plan files use). The search ranks by totals (docs/planner.md); this is
        asked of the plans shown, once each, and sets their ``need_bytes``."""
        ok = self._at_peak.get(i)
        if ok is None:
            e = self.estimates[i]
            led = ledger.memory(self.model, e.plan, self.cluster, margin=self.margin)
            e.need_bytes = led.need_bytes
            ok = self._at_peak[i] = led.fits
        return ok

    def scan_limit(self, n: int | None) -> int:
        """How many estimates :meth:`top` checks at their peak for ``n`` plans: ``PEAK_SCAN_PER_PLAN * n``
        (at least ``PEAK_SCAN_MIN``), every one for ``n=None``; a peak costs up to ~20 ms (405B), so a search
        whose plans nearly all fail at their peak stops there instead of checking 10^4 of them."""
        total = len(self.estimates)
        return total if n is None else min(total, max(PEAK_SCAN_MIN, PEAK_SCAN_PER_PLAN * n))

    def _shown(self, n: int | None) -> list[int]:
        """Indices of the first ``n`` estimates (all if None) that fit at their peak too, among the first
        :meth:`scan_limit` by total."""
        out: list[int] = []
        for i in range(self.scan_limit(n)):
            if n is not None and len(out) >= n:
                break
            if self.fits_at_peak(i):
                out.append(i)
        return out

    def scan_stopped(self, n: int | None) -> bool:
        """Whether :meth:`top` found fewer than ``n`` plans because it stopped at :meth:`scan_limit`, with
        plans left that fit by their totals (they were not checked at their peak)."""
        return n is not None and len(self._shown(n)) < n and self.scan_limit(n) < len(self.estimates)

    def top(self, n: int | None = None) -> list[Estimate]:
        """The ``n`` best plans (all if None) that fit by ``memory``'s verdict, best first: the ranking with
        the plans whose peak at one moment exceeds the budget left out (:meth:`dropped_at_peak`)."""
        return [self.estimates[i] for i in self._shown(n)]

    def dropped_at_peak(self, n: int | None = None) -> list[Estimate]:
        """The plans ranked above the last of :meth:`top`'s ``n`` (fewer than ``n`` found: among the
        :meth:`scan_limit` checked) that fit by their totals but not at their peak at one moment (:meth:`top`
        leaves them out)."""
        shown = self._shown(n)
        end = shown[-1] + 1 if n is not None and len(shown) == n else self.scan_limit(n)
        return [self.estimates[i] for i in range(end) if not self.fits_at_peak(i)]

    def _first_match(self, fields: dict[str, Any]) -> int | None:
        """Index of the best plan whose fields match ``fields`` and that fits at its peak (only the matches are
        checked at their peak)."""
        for j, e in enumerate(self.estimates):
            if all(e.fields[k] == v for k, v in fields.items()) and self.fits_at_peak(j):
                return j
        return None

    def best_matching(self, **fields: Any) -> Estimate | None:
        """The best plan whose fields match ``fields`` that passes ``memory``'s whole verdict (None if none):
        cheap, unlike :meth:`rank_of`, which checks every plan above it."""
        j = self._first_match(fields)
        return None if j is None else self.estimates[j]

    def rank_of(self, **fields: Any) -> int | None:
        """1-based rank, in :meth:`top`, of the best plan whose fields match ``fields`` (None if none fits);
        the matches and every plan above the first that fits have their peak checked (up to ~20 ms each)."""
        j = self._first_match(fields)
        return None if j is None else sum(self.fits_at_peak(k) for k in range(j)) + 1

    def to_json(self, top: int | None = None) -> dict[str, Any]:
        """The JSON of ``parallel-lab plan``: with ``top``, the best ``top`` of :meth:`top` and the plans
        dropped at their peak among them; without, every plan that fits by its total, unchecked at its peak
        (checking 10^5 peaks would take minutes), ``dropped_at_peak`` then None."""
        rows = self.top(top) if top is not None else self.estimates
        return {"plans": [e.row() for e in rows], "rejected": dict(self.rejected),
                "dropped_at_peak": None if top is None else [e.row() for e in self.dropped_at_peak(top)],
                "families": self.families, "candidates": self.candidates, "fitting": len(self.estimates),
                "elapsed_s": self.elapsed_s, "model": self.model.name, "cluster": self.cluster.name,
                "gpus": self.gpus, "seq": self.seq, "global_batch": self.global_batch,
                "global_batch_tokens": self.global_batch * self.seq, "margin": self.margin}
