"""The Memory explorer.

The memory explorer: the ledger per GPU (``parallel_lab.ledger.memory``) as stacked bars against HBM,
per pipeline stage when pp > 1, and beside it one knob swept (ZeRO stage 0-3, the sequence length, the
data-parallel degree). The status line says whether the plan fits in HBM minus the ledger's margin and
names the largest category. The GPUs field is the product dp x tp x pp x cp.

Below the chart, "measure this plan" (:class:`~.memory_measure.MeasurePanel`) runs ``parallel-lab memory
... --measure --json`` for the plan shown in a child process: one training step of its fullest stage's
rank at full size in fake tensors, measured beside both activation models' ledgers. Changes that start no
measurement only show or hide its last answer (it belongs to one plan), so they stay as fast as before.
"""

from __future__ import annotations

import html
from collections.abc import Callable, Sequence
from typing import Any

import ipywidgets as W
from matplotlib.axes import Axes
from matplotlib.figure import Figure

from ... import ledger as ledger_mod
from ... import ledger_activations as ledger_activations_mod
from ...errors import ParallelLabError
from ...hardware import CLUSTER_PRESETS, ClusterSpec
from ...optimizers import OPTIMIZERS
from ...quantities import fmt_bytes
from ...specs import SCHEDULES, ModelSpec, Plan
from ..palette import BAD, MUTED, OK
from ..plots.base import CATEGORY_LABELS
from ..plots.memory import (
    category_legend,
    draw_activation_terms,
    draw_memory,
    draw_memory_sweep,
    memory_axes,
    need_text,
)
from .base import (
    DEGREES,
    SEQS,
    Explorer,
    degree_controls,
    dropdown,
    int_text,
    labelled,
    model_controls,
    model_from,
    slider,
    status_line,
    toggles,
)
from .memory_measure import MeasurePanel

SWEEPS = ("ZeRO stage", "sequence", "dp")
DEGREE_NAMES = ("dp", "tp", "pp", "cp")


class MemoryExplorer(Explorer):
    """The memory ledger per GPU against HBM, and how each category scales while one knob sweeps.

    Left: one stacked bar per GPU (per pipeline stage when pp > 1) of the ledger's six categories, the HBM
    line and the usable line after the safety margin. Right, by ``sweep``: ZeRO stage 0-3 at this dp; the
    activations over sequence length split into the part linear in s and the quadratic attention scores;
    or the ledger over the data-parallel degree.
    """

    figsize = (9.6, 3.9)

    def __init__(self, model: str = "llama2-7b", seq: int = 4096, dp: int = 8, tp: int = 1, pp: int = 1,
                 cp: int = 1, zero: int = 0, recompute: str = "none", cluster: str = "h100-sxm",
                 sweep: str = "ZeRO stage", gpus: int | None = None) -> None:
        self._syncing = False
        c, custom = model_controls(model)
        c["seq"] = slider("sequence", SEQS, seq)
        c["micro_batch"] = slider("micro-batch", (1, 2, 4, 8, 16, 32), 1)
        c["grad_accum"] = slider("micro-batches", (1, 2, 4, 8, 16, 32, 64, 128), 1 if pp == 1 else 2 * pp)
        c["schedule"] = dropdown("schedule", SCHEDULES, "1f1b")
        c["interleave"] = slider("interleave", (1, 2, 3, 4, 6, 8, 16, 32), 1)
        c["gpus"] = int_text("GPUs", gpus or dp * tp * pp * cp)
        c.update(degree_controls(dp, tp, pp, cp, zero))
        c["recompute"] = toggles("recompute", ("none", "selective", "full"), recompute, "72px")
        c["optimizer"] = dropdown("optimizer", OPTIMIZERS, "adam-mixed")
        c["cluster"] = dropdown("cluster", CLUSTER_PRESETS, cluster)
        c["activation_model"] = dropdown("activations", ("korthikanti", "per-op"), "korthikanti")
        c["sweep"] = toggles("second view", SWEEPS, sweep, "92px")
        columns = [
            [c["model"], custom, c["cluster"], c["optimizer"], c["activation_model"]],
            [c["seq"], c["micro_batch"], c["grad_accum"], c["schedule"], c["interleave"]],
            [c["gpus"], c["dp"], c["tp"], c["pp"], c["cp"]],
        ]
        knobs = W.HBox([labelled("ZeRO stage", c["zero"]), labelled("recompute", c["recompute"]),
                        labelled("second view", c["sweep"]), c["sp"]], layout=W.Layout(flex_flow="row wrap"))
        c["sp"].layout = W.Layout(width="auto")          # in the row above: the picture stays on the first screen
        self.measure = MeasurePanel(self.measure_target)
        super().__init__(c, columns, extra=(self.measure,))
        self.children = (self.children[0], knobs, *self.children[1:])

    # ---- GPUs and degrees stay consistent -------------------------------------------------------
    def _on_change(self, change: dict[str, Any]) -> None:
        """A degree changed: GPUs becomes dp x tp x pp x cp. GPUs typed: dp becomes GPUs / (tp x pp x cp)
        when that is one of the dp slider's values (otherwise :meth:`compute` says what to type). Either
        way one refresh, after both widgets hold their new values."""
        name = next((k for k, w in self.widgets.items() if w is change["owner"]), None)
        if not self._syncing and name in ("gpus", *DEGREE_NAMES):
            self._syncing, held = True, self._hold
            self._hold = True                            # the widget set here must not refresh on its own
            try:
                v = self.values()
                if name == "gpus":
                    rest = v["tp"] * v["pp"] * v["cp"]
                    if v["gpus"] % rest == 0 and v["gpus"] // rest in self.widgets["dp"].options:
                        self.widgets["dp"].value = v["gpus"] // rest
                else:
                    self.widgets["gpus"].value = v["dp"] * v["tp"] * v["pp"] * v["cp"]
            finally:
                self._syncing, self._hold = False, held
        super()._on_change(change)

    @staticmethod
    def check_gpus(v: dict[str, Any]) -> None:
        """GPUs must be dp x tp x pp x cp; the message says which GPU counts the other degrees allow."""
        world = v["dp"] * v["tp"] * v["pp"] * v["cp"]
        if v["gpus"] != world:
            rest = v["tp"] * v["pp"] * v["cp"]
            fits = ", ".join(str(rest * d) for d in DEGREES[:6])
            raise ParallelLabError(
                f"GPUs={v['gpus']} is not dp x tp x pp x cp = {v['dp']} x {v['tp']} x {v['pp']} x {v['cp']} = "
                f"{world}; with tp={v['tp']}, pp={v['pp']}, cp={v['cp']} type one of {fits}, ... (dp is set "
                f"from it), or change a degree (GPUs follows)")

    # ---- measure this plan ------------------------------------------------------------------------
    def measure_target(self) -> tuple[ModelSpec, Plan, ClusterSpec, int, str]:
        """What "measure this plan" measures: the plan shown, at its fullest stage (the one the status
        line names), with the activation model chosen; raises the explorer's error while the plan is invalid."""
        if self.error is not None:
            raise self.error
        r = self.result
        return r["model"], r["plan"], r["cluster"], r["ledger"].stage, r["activation_model"]

    def refresh(self) -> None:
        super().refresh()
        self.measure.on_refresh()                # shows the last measurement only for its own plan

    # ---- core -----------------------------------------------------------------------------------
    @staticmethod
    def plan_from(v: dict[str, Any]) -> Plan:
        return Plan(dp=v["dp"], tp=v["tp"], pp=v["pp"], cp=v["cp"], zero=v["zero"], sp=v["sp"],
                    micro_batch=v["micro_batch"], grad_accum=v["grad_accum"], seq=v["seq"],
                    recompute=v["recompute"], optimizer=v["optimizer"], schedule=v["schedule"],
                    interleave=v["interleave"])

    def compute(self, v: dict[str, Any]) -> dict[str, Any]:
        model = model_from(v)
        cluster = ClusterSpec.preset(v["cluster"])
        self.check_gpus(v)
        plan = self.plan_from(v).validate(model, v["gpus"], cluster)
        am = v["activation_model"]
        led = ledger_mod.memory(model, plan, cluster, activation_model=am)
        stages = _shown_stages(plan.pp)
        per_stage = [ledger_mod.memory(model, plan, cluster, activation_model=am, stage=s) for s in stages]
        out: dict[str, Any] = {"model": model, "plan": plan, "cluster": cluster, "ledger": led,
                               "stages": stages, "stage_ledgers": per_stage, "sweep": v["sweep"],
                               "activation_model": am}

        def attempt(f: Callable[[], Any]) -> Any:
            try:
                return f()
            except ParallelLabError:
                return None

        if v["sweep"] == "ZeRO stage":
            out["sweep_values"] = [0, 1, 2, 3]
            out["sweep_ledgers"] = [attempt(lambda z=z: ledger_mod.memory(
                model, plan.with_(zero=z), cluster, activation_model=am)) for z in range(4)]
        elif v["sweep"] == "dp":
            out["sweep_values"] = [d for d in DEGREES[:9]]
            out["sweep_ledgers"] = [attempt(lambda d=d: ledger_mod.memory(
                model, plan.with_(dp=d), cluster, activation_model=am)) for d in out["sweep_values"]]
        else:
            seqs = list(SEQS)
            full = [attempt(lambda s=s: ledger_activations_mod.activation_bytes(
                model, plan.with_(seq=s, recompute="none").validate(model), 0, formula=am)) for s in seqs]
            lin = [attempt(lambda s=s: ledger_activations_mod.activation_bytes(
                model, plan.with_(seq=s, recompute="selective").validate(model), 0, formula=am))
                for s in seqs]
            out["sweep_values"] = seqs
            out["linear_bytes"] = lin
            out["quadratic_bytes"] = [f - s if f is not None and s is not None else None
                                      for f, s in zip(full, lin, strict=True)]
        self.verdict = "fits" if led.fits else "does not fit"
        return out

    def make_axes(self, fig: Figure, result: Any) -> Sequence[Axes]:
        return memory_axes(fig)

    def draw(self, r: dict[str, Any], axes: list[Axes]) -> None:
        fig = self.figure
        a1, a2 = axes
        pp = r["plan"].pp > 1
        draw_memory(a1, r["stage_ledgers"], [str(s) for s in r["stages"]] if pp else ["per GPU"],
                    xlabel="pipeline stage" if pp else None,
                    title=f"{r['model'].name} on {r['cluster'].name}")
        plan = r["plan"]
        if r["sweep"] == "ZeRO stage":
            draw_memory_sweep(a2, r["sweep_values"], r["sweep_ledgers"], f"ZeRO stage (dp={plan.dp})",
                              value_fmt="ZeRO-{}", highlight=plan.zero,
                              title="model state shards over the data-parallel ranks")
        elif r["sweep"] == "dp":
            draw_memory_sweep(a2, r["sweep_values"], r["sweep_ledgers"],
                              f"data-parallel degree (ZeRO-{plan.zero})", highlight=plan.dp,
                              title="the ledger as dp grows (other degrees fixed)")
        else:
            draw_activation_terms(a2, r["sweep_values"], r["linear_bytes"], r["quadratic_bytes"],
                                  hbm_bytes=r["cluster"].hbm_bytes, highlight=plan.seq, legend_outside=True,
                                  title="activations, no recomputation (stage 0)")
        category_legend(fig)

    def describe(self, r: dict[str, Any]) -> str:
        led = r["ledger"]
        usable = led.hbm_bytes * (1 - led.margin)
        total = led.total_bytes
        where = f" (stage {led.stage}, the fullest)" if r["plan"].pp > 1 else ""
        fb = fmt_bytes
        room = (f"{fb(usable)} usable ({fb(led.hbm_bytes)} HBM, {led.margin:.0%} margin)")
        need = f"{need_text(led.need_bytes)} per GPU{where}"
        if led.peak_decides:                # a moment's transients exceed the categories' sum (ledger.MemoryLedger)
            need += (f" at its peak moment ({led.peak.peak}; the categories sum to {fb(total)}, the hatched segment is "
                     "the rest)")
        if led.fits:
            head = f'<b style="color:{OK}">Fits</b>: {need}, of {room}'
        else:
            head = f'<b style="color:{BAD}">Does not fit</b>: {need} &gt; {room}'
        big = max(led.per_gpu_bytes.items(), key=lambda kv: kv[1])
        parts = ", ".join(f"{CATEGORY_LABELS.get(k, k)} {fb(b)}" for k, b in led.per_gpu_bytes.items())
        largest = CATEGORY_LABELS.get(big[0], big[0])
        lines = [status_line(head), status_line(f"Per GPU: {parts}. Largest: {largest}.", MUTED)]
        lines += [status_line(html.escape(n), MUTED) for n in led.notes[:3]]
        return "".join(lines)


def _shown_stages(pp: int) -> list[int]:
    """All stages for pp <= 4, else the first two, the middle and the last."""
    if pp <= 4:
        return list(range(pp))
    return sorted({0, 1, pp // 2, pp - 1})

