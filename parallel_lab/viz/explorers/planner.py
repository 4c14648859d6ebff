"""The Planner explorer.

The planner explorer: every way to split a model over a cluster (``parallel_lab.planner.plan_search``),
ranked by estimated step time; the rejected families with their reasons; the chosen plan's memory,
bytes and schedule; and a button that saves the chosen plan as a plan file (``parallel_lab.planfile``).
The search is kept while only the plan to show changes.
"""

from __future__ import annotations

import html
from collections.abc import Callable, Sequence
from typing import Any

import ipywidgets as W
from matplotlib.axes import Axes
from matplotlib.figure import Figure

from ... import comm as comm_mod
from ... import ledger as ledger_mod
from ... import simulate as simulate_mod
from ... import steptime as steptime_mod
from ...engines import DEFAULT_ENGINE, ENGINES
from ...errors import ParallelLabError
from ...hardware import CLUSTER_PRESETS, ClusterSpec
from ...planner_constraints import Constraints
from ...quantities import fmt_bytes, fmt_seconds
from ...schedules.generators import build_schedule
from ...specs import Plan
from ..palette import CHOSEN_ROW, DIM_COLORS, GHOST, IDLE_EDGE, MUTED, OK, STEP_COLORS, WARN
from ..plots.base import CATEGORIES, draw_message, dynamic_title
from ..plots.comm import draw_comm_bytes
from ..plots.memory import category_legend, draw_memory
from ..plots.planner import plan_label
from ..plots.timeline import draw_timeline, draw_timeline_ends, needs_ends
from .base import (
    DESC,
    ROW_ITEM,
    SEQS,
    Explorer,
    dropdown,
    error_html,
    int_slider,
    model_controls,
    model_from,
    slider,
    status_line,
)

GPU_COUNTS = tuple(2**k for k in range(0, 15))                    # 1 .. 16384
BATCH_TOKENS = ("64K", "256K", "512K", "1M", "2M", "4M", "8M", "16M")
REASON_TEXT = {
    "divisibility": "the degrees do not divide the heads, the ffn width, the layers or the sequence",
    "batch": "the global batch is not a whole number of sequences per data-parallel replica",
    "tp_across_nodes": "tensor parallelism would span more than one node",
    "oom": "no micro-batch, recomputation, ZeRO stage or schedule fits in memory",
}
MAX_DRAWN_ACTIONS = 3000


class PlannerExplorer(Explorer):
    """Every way to split a model over a cluster (``parallel_lab.planner.plan_search``), ranked by estimated
    step time; the rejected families with their reasons; the chosen plan's ledger, bytes and bubble; and a
    button that saves the chosen plan as a plan file."""

    figsize = (9.6, 6.0)

    def __init__(self, model: str = "llama2-7b", cluster: str = "h100-sxm", gpus: int = 16, seq: int = 4096,
                 batch_tokens: str = "1M", path: str = "plan.yaml") -> None:
        c, custom = model_controls(model)
        c["cluster"] = dropdown("cluster", CLUSTER_PRESETS, cluster)
        c["gpus"] = slider("GPUs", GPU_COUNTS, gpus)
        c["seq"] = slider("sequence", SEQS, seq)
        c["batch_tokens"] = dropdown("global batch", BATCH_TOKENS, batch_tokens)
        c["engine"] = dropdown("engine", ENGINES, DEFAULT_ENGINE)
        c["top"] = int_slider("plans shown", 3, 20, 8)
        c["chosen"] = int_slider("show plan #", 1, 20, 1)
        self._search_key: Any = None
        self._search: Any = None
        self._shown: dict[int, dict[str, Any]] = {}      # plan index -> its pictures' inputs
        self._schedules: dict[tuple, Any] = {}            # (schedule, p, m, v, b) -> simulated timeline
        self._timeline_memo: dict[Any, Any] = {}          # their boxes, built once (plots.draw_timeline)
        self._drawn_timeline: Any = None                  # (simulation, title, axes) on the figure now
        self._empty_search: Any = None
        self.path = W.Text(value=path, description="plan file", style=DESC, layout=W.Layout(width="520px"))
        self.phase = W.Text(value="", placeholder="pretrain-4k", description="phase", style=DESC,
                            layout=ROW_ITEM)
        self.save_button = W.Button(description="save plan file", icon="", button_style="primary",
                                    layout=W.Layout(width="160px"))
        self.path.tooltip = "Where to write the plan file (a path on the machine running the app; YAML)"
        self.phase.tooltip = "Name of the training phase this plan is for, stored in the plan file"
        self.save_button.tooltip = "Save the plan shown as a plan file (parallel-lab run --plan FILE runs it)"
        self.save_message = W.HTML()
        self.table = W.HTML()
        self.rejected = W.HTML()
        self.saved_path: Any = None
        self.save_button.on_click(lambda _: self.save())
        self.open_button = W.Button(description="open in every tab", button_style="info",
                                    tooltip="Show this plan's memory, bytes, schedule and process grid in the "
                                            "other tabs", layout=W.Layout(width="160px"))
        self.load_button = W.Button(description="load plan file", tooltip="Read the plan file at the path "
                                    "on the left and open its plan in every tab", layout=W.Layout(width="140px"))
        #: ``on_open(model, cluster, plan, gpus) -> message``: set by the App to show a plan in its tabs
        self.on_open: Callable[[Any, Any, Any, int], str] | None = None
        self.open_button.on_click(lambda _: self.open_in_tabs())
        self.load_button.on_click(lambda _: self.load())
        columns = [[c["model"], custom, c["cluster"]], [c["gpus"], c["seq"], c["batch_tokens"]],
                   [c["top"], c["chosen"], c["engine"]]]
        save_row = W.HBox([self.path, self.phase, self.save_button, self.load_button, self.open_button],
                          layout=W.Layout(flex_flow="row wrap"))
        super().__init__(c, columns)
        panel, status, image, *rest = self.children            # rest: the link to the lesson
        # the chosen plan's picture under its status (on the first screen), then the ranked table, the rejected
        # families and the plan file
        self.children = (panel, status, image, self.table, self.rejected, save_row, self.save_message, *rest)

    def refresh(self) -> None:
        super().refresh()
        if self.error is not None:                      # no stale table under an error message
            self.table.value = ""
            empty = self._empty_search
            self.rejected.value = rejected_table(empty) if empty is not None else ""

    # ---- core -----------------------------------------------------------------------------------
    def search(self, v: dict[str, Any]) -> Any:
        """The planner's result for the widgets' model, cluster, GPUs, sequence and batch (cached: choosing
        another plan to show does not search again)."""
        from ... import planner

        model, cluster = model_from(v), ClusterSpec.preset(v["cluster"])
        key = (model, cluster, v["gpus"], v["seq"], v["batch_tokens"], v["engine"])
        if key != self._search_key:
            # the kernel sends this at once: the learner sees the search running, not a frozen page
            self.status.value = status_line(f"<b>Searching</b> every plan for {html.escape(model.name)} on "
                                            f"{v['gpus']:,} x {html.escape(cluster.name)}...", MUTED)
            self._search = None                         # free the old result before the new search
            self._shown.clear()
            self._schedules.clear()
            self._timeline_memo.clear()
            self._search = planner.plan_search(model, cluster, v["gpus"], v["seq"],
                                               global_batch_tokens=v["batch_tokens"],
                                               constraints=Constraints(engine=v["engine"]))
            self._search_key = key
        return self._search

    def plan_details(self, res: Any, idx: int) -> dict[str, Any]:
        """The ledger, the communication report and the simulated schedule of plan ``idx`` of ``res``
        (kept for the plans of the current search that were shown)."""
        if idx not in self._shown:
            model, cluster, plan = res.model, res.cluster, res.top(idx + 1)[idx].plan
            sim = None
            if plan.pp > 1 and plan.pp * plan.microbatches * plan.interleave <= MAX_DRAWN_ACTIONS:
                # plans that differ only in tp, cp, dp or ZeRO share their schedule: simulate it once
                costs = steptime_mod.costs(plan.recompute)          # the planner's own F : B : W
                key = (plan.schedule, plan.pp, plan.microbatches, plan.interleave, costs)
                if key not in self._schedules:
                    actions = build_schedule(plan.schedule, plan.pp, plan.microbatches,
                                                           plan.interleave)
                    self._schedules[key] = simulate_mod.simulate(actions, costs)
                sim = self._schedules[key]
            rep = comm_mod.report(model, plan, cluster)
            self._shown[idx] = {"ledger": ledger_mod.memory(model, plan, cluster), "report": rep, "sim": sim,
                                "comm": {"per_step_bytes": rep.per_step_bytes,
                                         "collectives": [c.to_json() for c in rep.collectives]}}
        return self._shown[idx]

    def compute(self, v: dict[str, Any]) -> dict[str, Any]:
        self._empty_search = None
        res = self.search(v)
        model, cluster = res.model, res.cluster
        listed = res.top(v["top"])                      # memory's verdict: the plans whose peak fits too
        if not listed:
            self._empty_search = res                    # its rejected families explain the error
            reasons = ", ".join(f"{REASON_TEXT.get(r, r)} ({n} families)" for r, n in res.rejected.items())
            if res.estimates:                            # plans that fit by their totals, none at their peak
                reasons = (f"{len(res.dropped_at_peak(v['top'])):,} plans fit by their totals but not at their "
                           f"peak at one moment" + (f"; {reasons}" if reasons else ""))
            raise ParallelLabError(f"no plan for {model.name} on {res.gpus} x {cluster.name} at "
                                   f"seq={res.seq} with {v['batch_tokens']} tokens per batch: "
                                   f"{reasons or 'nothing to try'}; "
                                   f"try more GPUs, a larger global batch or a shorter sequence")
        shown = len(listed)
        self._bound_chosen(shown)
        idx = min(self.widgets["chosen"].value, shown) - 1
        est = listed[idx]
        plan = est.plan
        self.verdict = plan_label(plan)
        return {"result": res, "shown": shown, "index": idx, "estimate": est, "plan": plan, "model": model,
                "cluster": cluster, "engine": v["engine"], **self.plan_details(res, idx)}

    def _bound_chosen(self, shown: int) -> None:
        """The "show plan #" slider ends at the last plan listed (no redraw of its own when that clamps it)."""
        chosen = self.widgets["chosen"]
        if chosen.max != shown:
            held, self._hold = self._hold, True
            try:
                chosen.max = max(shown, chosen.min)
            finally:
                self._hold = held

    def layout_key(self, r: dict[str, Any]) -> Any:
        return r["plan"].pp > 1, _zoomed(r["plan"])

    def make_axes(self, fig: Figure, r: dict[str, Any]) -> Sequence[Axes]:
        pipeline = r["plan"].pp > 1
        top_in, h_in = 3.0, (4.9 if pipeline else 3.0)          # inches: it fits a 900 px screen under the inputs
        fig.set_size_inches(self.figsize[0], h_in)
        gs = fig.add_gridspec(1, 2, width_ratios=(1.0, 1.6), wspace=0.3, left=0.08, right=0.84,
                              bottom=1 - (top_in - 0.5) / h_in, top=1 - 0.3 / h_in)
        axes = [fig.add_subplot(gs[0]), fig.add_subplot(gs[1])]
        if pipeline:
            rect = (0.08, 0.45 / h_in, 0.76, (h_in - top_in - 0.75) / h_in)
            if _zoomed(r["plan"]):                # the step's start and its end, side by side
                gs2 = fig.add_gridspec(1, 2, wspace=0.12, left=rect[0], right=rect[0] + rect[2], bottom=rect[1],
                                       top=rect[1] + rect[3])
                axes += [fig.add_subplot(gs2[0]), fig.add_subplot(gs2[1])]
            else:
                axes.append(fig.add_axes(rect))
        return axes

    def draw(self, r: dict[str, Any], axes: list[Axes]) -> None:
        est, plan = r["estimate"], r["plan"]
        draw_memory(axes[0], r["ledger"], ["per GPU"], title=f"plan #{r['index'] + 1}: memory")
        dynamic_title(axes[0])                          # the plan number changes with every choice
        category_legend(self.figure, [c for c in CATEGORIES if c in r["ledger"].per_gpu_bytes])
        if r["report"].per_step_bytes:
            draw_comm_bytes(axes[1], r["comm"], title="bytes sent per GPU per step")
        else:
            draw_message(axes[1], "no communication")
        if plan.pp > 1:
            if r["sim"] is not None:
                title = (f"{plan.schedule}: p={plan.pp}, m={plan.microbatches}"
                         + (f", v={plan.interleave}" if plan.interleave > 1 else "")
                         + f"; bubble {est.bubble_ratio:.1%}")
                if self._drawn_timeline != (r["sim"], title, axes[2]):     # plans often share a schedule
                    if len(axes) > 3:
                        draw_timeline_ends(axes[2], axes[3], r["sim"], plan.pp, title=title,
                                           time_unit="time (F = 1)", memo=self._timeline_memo)
                    else:
                        draw_timeline(axes[2], r["sim"], time_unit="time (F = 1)", step_time=r["sim"].step_time,
                                      title=title, memo=self._timeline_memo)
                    self._drawn_timeline = (r["sim"], title, axes[2])
            else:
                draw_message(axes[2], f"{plan.schedule}: p={plan.pp}, m={plan.microbatches}: too many "
                                      f"actions to draw; bubble {est.bubble_ratio:.1%}")
                self._drawn_timeline = None

    def describe(self, r: dict[str, Any]) -> str:
        res, est, plan = r["result"], r["estimate"], r["plan"]
        self.table.value = plans_table(res.top(r["shown"]), r["index"])
        self.rejected.value = rejected_table(res)
        if not self.phase.value:
            self.phase.placeholder = f"pretrain-{plan.seq // 1024}k" if plan.seq >= 1024 else "pretrain"
        dropped = len(res.dropped_at_peak(r["shown"]))
        left_out = f"; {dropped} ranked among these left out: their peak at one moment does not fit" if dropped \
            else ""
        head = (f"<b>Plan #{r['index'] + 1}</b> of the {r['shown']} best that fit "
                f"({len(res.estimates):,} of {res.candidates:,} candidates in {res.families:,} families fit by "
                f"their totals, searched in {res.elapsed_s * 1e3:.0f} ms{left_out}): <b>{plan_label(plan)}</b>, "
                f"micro-batch {plan.micro_batch} x "
                f"{plan.microbatches} micro-batches; {fmt_bytes(est.need_bytes)} per GPU "
                f"({fmt_bytes(est.headroom_bytes)} headroom), step {fmt_seconds(est.step_time_s)}, "
                f"MFU {est.mfu:.1%}, bubble {est.bubble_ratio:.1%}.")
        lines = [status_line(head), step_breakdown_html(est)]
        best = res.top(1)[0]
        poor = poor_plan_reasons(best)
        if poor:
            lines.append(status_line(f"<b>Warning</b>: even the best plan is poor ({'; '.join(poor)}): try fewer "
                                     "GPUs, a larger global batch or a longer sequence per GPU", WARN))
        return "".join(lines)

    # ---- one plan across the tabs -----------------------------------------------------------------
    def open_in_tabs(self) -> str | None:
        """Hand the plan shown to ``on_open`` (the App's other tabs); the message says where it went."""
        if self.result is None or self.error is not None or self.on_open is None:
            why = "the inputs above are invalid; fix them first" if self.on_open else "not inside the app"
            self.save_message.value = error_html(ParallelLabError(f"no plan to open: {why}"))
            return None
        r = self.result
        msg = self.on_open(r["model"], r["cluster"], r["plan"], r["result"].gpus)
        self.save_message.value = status_line(f"Plan #{r['index'] + 1} ({html.escape(plan_label(r['plan']))}) "
                                              f"{msg}", OK)
        return msg

    def load(self) -> str | None:
        """Read the plan file at ``self.path.value`` and hand its plan to ``on_open``."""
        from pathlib import Path

        from ... import planfile

        path = Path(self.path.value.strip() or "plan.yaml").expanduser()
        try:
            pf = planfile.load_plan(path)
        except OSError as err:
            self.save_message.value = error_html(ParallelLabError(
                f"cannot read the plan file {str(path)!r}: {err.strerror or err}; check the path"), FILE_ERROR)
            return None
        except ParallelLabError as err:                  # planfile's own message names the file and the fix
            self.save_message.value = error_html(err, FILE_ERROR)
            return None
        if self.on_open is None:
            self.save_message.value = error_html(ParallelLabError("loaded, but not inside the app: no tabs"))
            return None
        msg = self.on_open(pf.model, pf.cluster, pf.plan, pf.gpus)
        self.save_message.value = status_line(f"Plan file <code>{html.escape(str(path.resolve()))}</code> "
                                              f"({html.escape(plan_label(pf.plan))}) {msg}", OK)
        return msg

    # ---- plan file ------------------------------------------------------------------------------
    def save(self) -> Any:
        """Save the plan shown as a plan file (``parallel_lab.planfile.save_plan``) at ``self.path.value``;
        the message under the button names the absolute path. Returns that path, or None on an error."""
        from pathlib import Path

        try:
            if self.result is None or self.error is not None:
                raise ParallelLabError("no plan to save: the inputs above are invalid; fix them first")
            from ... import planfile

            r = self.result
            phase = self.phase.value.strip() or self.phase.placeholder or "pretrain"
            target = Path(self.path.value.strip() or "plan.yaml").expanduser()
            planfile.save_plan(target, r["model"], r["cluster"], r["plan"], phase=phase,
                               gpus=r["result"].gpus, engine=r["engine"])
        except ParallelLabError as err:
            self.save_message.value = error_html(err)
            return None
        except OSError as err:
            self.save_message.value = error_html(ParallelLabError(
                f"cannot write {self.path.value!r}: {err.strerror or err}; pick another path"), FILE_ERROR)
            return None
        self.saved_path = target.resolve()
        where = html.escape(str(self.saved_path))
        label = html.escape(plan_label(r["plan"]))
        self.save_message.value = status_line(f"Saved plan #{r['index'] + 1} ({label}, phase "
                                        f"{html.escape(phase)}) to <code>{where}</code>", OK)
        return self.saved_path


def _zoomed(plan: Plan) -> bool:
    return needs_ends(plan.pp, plan.microbatches, plan.interleave)


FILE_ERROR = "Plan file error"
#: A best plan under this MFU, or with a bubble over this ratio, gets a warning.
POOR_MFU = 0.10
POOR_BUBBLE = 1.0
BREAKDOWN_COLORS = {"compute": STEP_COLORS["compute"], "tp": DIM_COLORS["tp"], "cp": DIM_COLORS["cp"],
                    "pp": DIM_COLORS["pp"], "dp": DIM_COLORS["dp"], "bubble": STEP_COLORS["bubble"],
                    "optimizer": STEP_COLORS["step"]}


def step_breakdown(est: Any) -> dict[str, float]:
    """The planner's step time of ``est`` in its parts (seconds): compute of the busiest stage, the exposed
    communication per dimension, the pipeline bubble and the optimizer step's memory-bound time (with a roofline
    profile); they add up to ``est.step_time_s`` (``parallel_lab.steptime``: step = (compute + tp + cp)
    (1 + bubble ratio) + pp + dp + optimizer)."""
    parts = {"compute": est.compute_s}
    parts.update({d: t for d, t in est.exposed_s.items() if t > 0})
    if est.bubble_s > 0:
        parts["bubble"] = est.bubble_s
    if est.optimizer_s > 0:
        parts["optimizer"] = est.optimizer_s
    return parts


def step_breakdown_html(est: Any) -> str:
    """:func:`step_breakdown` as one horizontal bar of coloured segments, each labelled with its time."""
    parts = step_breakdown(est)
    total = sum(parts.values()) or 1.0
    segs = "".join(
        f"<div class='pl-step-part' data-part='{k}' data-seconds='{t!r}' title='{k} {fmt_seconds(t)}' "
        f"style='width:{100 * t / total:.2f}%;background:{BREAKDOWN_COLORS.get(k, GHOST)};height:14px'></div>"
        for k, t in parts.items())
    legend = ", ".join(f"<span style='color:{BREAKDOWN_COLORS.get(k, GHOST)}'>&#9632;</span> "
                       f"{'exposed ' + k if k in ('tp', 'cp', 'pp', 'dp') else k} {fmt_seconds(t)}"
                       for k, t in parts.items())
    return (f"<div class='pl-step' style='margin:4px 0;font-size:12px'>Step {fmt_seconds(est.step_time_s)} = "
            f"{legend}<div style='display:flex;width:560px;border:1px solid {IDLE_EDGE}'>{segs}</div></div>")


def poor_plan_reasons(est: Any) -> list[str]:
    """Why a plan is poor, if it is: MFU under :data:`POOR_MFU`, bubble over :data:`POOR_BUBBLE`."""
    out = []
    if est.mfu < POOR_MFU:
        out.append(f"MFU {est.mfu:.1%}")
    if est.bubble_ratio > POOR_BUBBLE:
        out.append(f"bubble {est.bubble_ratio:.0%} of the compute time")
    return out


def plans_table(estimates: Sequence[Any], chosen: int) -> str:
    """The ranked plans as an HTML table; the chosen row highlighted."""
    heads = ("#", "tp", "cp", "pp", "dp", "ZeRO", "SP", "micro-batch", "m", "recompute", "schedule",
             "memory/GPU", "step", "MFU", "bubble")
    th = "".join(f"<th style='padding:2px 8px;text-align:right'>{h}</th>" for h in heads)
    rows = []
    for i, e in enumerate(estimates):
        p = e.plan
        sched = (p.schedule + (f" v={p.interleave}" if p.interleave > 1 else "")) if p.pp > 1 else "-"
        cells = (i + 1, p.tp, p.cp, p.pp, p.dp, p.zero, "yes" if p.sp else "", p.micro_batch, p.microbatches,
                 p.recompute, sched, fmt_bytes(e.memory_bytes if e.need_bytes is None else e.need_bytes),
                 fmt_seconds(e.step_time_s),
                 f"{e.mfu:.1%}", f"{e.bubble_ratio:.1%}")
        style = f" style='background:{CHOSEN_ROW};font-weight:bold'" if i == chosen else ""
        td = "<td style='padding:2px 8px;text-align:right'>{}</td>"
        rows.append(f"<tr{style}>" + "".join(td.format(html.escape(str(x))) for x in cells) + "</tr>")
    return ("<div style='font-size:12px;margin-top:6px'><b>Ranked plans</b> (estimated step time, best first)"
            f"<table style='border-collapse:collapse'><tr>{th}</tr>{''.join(rows)}</table></div>")


def rejected_table(res: Any) -> str:
    """Rejected families (tp, cp, pp, dp degrees) by reason, with what the reason means."""
    if not res.rejected:
        return "<div style='font-size:12px;margin-top:6px'>No family of degrees was rejected.</div>"
    td = "<td style='padding:2px 8px'>{}</td>"
    rows = "".join("<tr>" + td.format(html.escape(r)) + td.format(f"{n:,}")
                   + td.format(html.escape(REASON_TEXT.get(r, ""))) + "</tr>"
                   for r, n in res.rejected.items())
    return ("<div style='font-size:12px;margin-top:6px'><b>Rejected families</b> (of "
            f"{res.families:,} ways to factor {res.gpus:,} GPUs into tp x cp x pp x dp)"
            "<table style='border-collapse:collapse'><tr><th style='padding:2px 8px'>reason</th>"
            "<th style='padding:2px 8px'>families</th><th style='padding:2px 8px'>meaning</th></tr>"
            f"{rows}</table></div>")


