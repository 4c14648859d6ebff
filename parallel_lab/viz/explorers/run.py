"""The Run tab: train the tiny model under the plan shown, on CPU ranks, and put measured beside predicted.

A run is ``parallel-lab run ... --json`` in a child process (:class:`RunJob`, a :class:`~.jobs.CliJob`):
the same code and the same numbers as the command line, and the kernel's event loop never waits for it (a
reader thread follows the child's progress bar on stderr and hands every update back to the loop). Cancel
stops the child's whole process group (the launcher and its ranks). Before anything starts, the plan is
validated and checked against the local machine's memory by the command line's own guard
(``plan_flags.check_fits_this_machine``: the ledger's bytes of the fullest rank for every rank plus the
one-process reference); a refusal is its message, and no process starts.

When the run is done the chart shows, side by side, what the run measured and what the library predicted
(both columns come from the run's report, ``distributed.runtime.run.RunReport.to_json``): memory per category of
the fullest rank, payload bytes per dimension over all ranks and steps, and the losses of the parallel run
over those of the one-process reference. With pipeline parallelism, the embedded
:class:`~.pipeline.PipelineExplorer` simulates the plan's schedule with the measured mean F/B costs and
draws the measured timeline of the last step below it (``set_measured``).
"""

from __future__ import annotations

import html
import re
import sys
from collections.abc import Callable, Sequence
from typing import Any

import ipywidgets as W
from matplotlib.axes import Axes
from matplotlib.figure import Figure

from ...errors import ParallelLabError
from ...plan_flags import check_fits_this_machine
from ...quantities import fmt_seconds, unit_for
from ...specs import MODEL_PRESETS, RUN_DEFAULTS, SCHEDULES, ModelSpec, Plan
from ..palette import CURVE_COLORS, MEASURED, MUTED, PREDICTED_EDGE
from ..plots.base import draw_message, reset_axes
from .base import Explorer, error_html, int_slider, job_controls, labelled, slider, status_line, toggles
from .jobs import CliJob, loop_caller
from .pipeline import PipelineExplorer

RUN_DEGREES = (1, 2, 4, 8)
STEPS_RE = re.compile(r"(\d+)/(\d+) steps")
RUN_CATEGORIES = ("parameters", "gradients", "optimizer_states", "activations")


def run_plan(v: dict[str, Any]) -> tuple[ModelSpec, Plan]:
    """The model and plan the Run tab's inputs describe (the run's CPU defaults, ``specs.RUN_DEFAULTS``,
    for every field it has no input for), validated."""
    model = ModelSpec.preset(v["model"])
    plan = Plan(dp=v["dp"], tp=v["tp"], pp=v["pp"], cp=v["cp"], zero=v["zero"], seq=v["seq"],
                micro_batch=v["micro_batch"], grad_accum=v["grad_accum"], schedule=v["schedule"],
                dtype=RUN_DEFAULTS["dtype"], optimizer=RUN_DEFAULTS["optimizer"])
    return model, plan.validate(model)


def run_argv(model: ModelSpec, plan: Plan, steps: int, python: str = sys.executable) -> list[str]:
    """The ``parallel-lab run`` command line of ``plan`` (every field the tab sets, spelled as the CLI's)."""
    return [python, "-m", "parallel_lab", "run", "--model", model.name, "--dp", str(plan.dp),
            "--tp", str(plan.tp), "--pp", str(plan.pp), "--cp", str(plan.cp), "--zero", str(plan.zero),
            "--seq", str(plan.seq), "--micro-batch", str(plan.micro_batch), "--grad-accum", str(plan.grad_accum),
            "--schedule", plan.schedule, "--dtype", plan.dtype, "--optimizer", plan.optimizer,
            "--steps", str(steps), "--json"]


def check_fits(model: ModelSpec, plan: Plan) -> None:
    """The command line's guard: raises ``ParallelLabError`` (its message) when the ranks would not fit."""
    check_fits_this_machine(model, plan)


class RunJob(CliJob):
    """``parallel-lab run`` as a :class:`~.jobs.CliJob`: ``on_progress(done, total)`` for every step its
    progress bar reports on stderr, ``on_done(job)`` at the end, each called through ``call``."""

    def __init__(self, argv: Sequence[str], on_progress: Callable[[int, int], None],
                 on_done: Callable[[CliJob], None], call: Callable[..., None] | None = None) -> None:
        def on_line(line: str) -> None:
            m = STEPS_RE.search(line)
            on_progress(int(m.group(1)), int(m.group(2)))

        super().__init__(argv, on_line, on_done, call, is_progress=STEPS_RE.search)


class RunExplorer(Explorer):
    """Train the tiny model under a plan on CPU ranks; measured beside predicted.

    ``start()`` (the Run button) checks the plan and the machine's memory and starts a :class:`RunJob`;
    ``cancel()`` stops it; ``job`` is the last job, ``report`` the last finished run's JSON (with
    ``report_plan``, the plan it ran). Tests call ``start()`` then ``job.wait()``.
    """

    figsize = (9.6, 3.3)

    def __init__(self, model: str = "tiny-llama", dp: int = 2, tp: int = 1, pp: int = 2, cp: int = 1,
                 zero: int = 0, steps: int = 2) -> None:
        c: dict[str, W.ValueWidget] = {
            "model": W.Dropdown(options=list(MODEL_PRESETS), value=model, description="model",
                                style={"description_width": "112px"}, layout=W.Layout(width="310px")),
            "dp": slider("dp", RUN_DEGREES, dp), "tp": slider("tp", RUN_DEGREES, tp),
            "pp": slider("pp", RUN_DEGREES, pp), "cp": slider("cp", RUN_DEGREES, cp),
            "zero": toggles("ZeRO stage", (0, 1, 2, 3), zero),
            "seq": slider("sequence", (32, 64, 128, 256, 512), RUN_DEFAULTS["seq"]),
            "micro_batch": slider("micro-batch", (1, 2, 4, 8), RUN_DEFAULTS["micro_batch"]),
            "grad_accum": slider("micro-batches", (1, 2, 4, 8), 4),
            "schedule": W.Dropdown(options=list(SCHEDULES), value="1f1b", description="schedule",
                                   style={"description_width": "112px"}, layout=W.Layout(width="310px")),
            "steps": int_slider("steps", 1, 5, steps),
        }
        self.job: RunJob | None = None
        self.report: dict[str, Any] | None = None
        self.report_plan: tuple[ModelSpec, Plan] | None = None
        self.run_error: str | None = None
        self.run_error_head = "Run did not finish"
        self.run_button, self.cancel_button, self.progress, self.progress_text = job_controls(
            W.Button(description="Run on CPU ranks", button_style="primary", icon="play",
                     tooltip="train the tiny model under this plan (parallel-lab run)"),
            "stop the run and all its ranks", steps, "steps", "310px")
        self.tables = W.HTML()
        self.tables.add_class("pl-run-tables")
        self.pipeline = PipelineExplorer()
        self.pipeline.layout.display = "none"
        for child in self.pipeline.children[:2]:      # its schedule controls: the run's plan sets them
            child.layout.display = "none"
        self.run_button.on_click(lambda _: self.start())
        self.cancel_button.on_click(lambda _: self.cancel())
        buttons = W.HBox([self.run_button, self.cancel_button, self.progress, self.progress_text],
                         layout=W.Layout(align_items="center"))
        columns = [[c["model"], c["dp"], c["tp"], c["pp"]], [c["cp"], c["seq"], c["micro_batch"], c["grad_accum"]],
                   [c["schedule"], c["steps"]]]
        super().__init__(c, columns, [self.tables, self.pipeline])
        self.children = (self.children[0], labelled("ZeRO stage", c["zero"]), buttons, *self.children[1:])
        self.add_class("pl-run")

    # ---- running --------------------------------------------------------------------------------
    def start(self) -> bool:
        """Start a run of the plan shown; False (and the reason in the status) when it cannot start."""
        if self.job is not None and self.job.running():
            return False
        self.run_error, self.run_error_head = None, "Run did not finish"
        try:
            model, plan = run_plan(self.values())
            check_fits(model, plan)
        except Exception as err:  # noqa: BLE001 - the library's message, shown
            self.run_error, self.run_error_head = str(err), "Not started"
            self.status.value = error_html(err, "Not started")
            return False
        steps = self.widgets["steps"].value
        self.progress.max, self.progress.value = steps, 0
        self.progress_text.value = f"starting {plan.world} ranks..."
        self.run_button.disabled, self.cancel_button.disabled = True, False
        self._running = (model, plan)
        self.job = RunJob(run_argv(model, plan, steps), self._on_progress, self._on_done, loop_caller())
        if self.result is not None:
            self.status.value = self.describe(self.result)          # "Running ...", not "Not run yet"
        return True

    def cancel(self) -> None:
        if self.job is not None and self.job.running():
            self.job.cancel()

    def _on_progress(self, done: int, total: int) -> None:
        self.progress.max, self.progress.value = total, done
        self.progress_text.value = (f"step {done} of {total}" if done < total else
                                    "ranks done; the one-process reference runs...")
        if self.result is not None and self.report_plan != self._running:
            self.status.value = self.describe(self.result)

    def _on_done(self, job: RunJob) -> None:
        self.run_button.disabled, self.cancel_button.disabled = False, True
        if job.cancelled:
            self.progress_text.value = "cancelled (every rank stopped)"
            self.run_error = "cancelled"
        elif job.report is None:
            self.progress_text.value = "failed"
            self.run_error = job.error
        else:
            self.report, self.report_plan = job.report, self._running
            self.progress_text.value = f"done in {fmt_seconds(job.report['wall_s'])} (ranks' wall time)"
        self.refresh()

    # ---- the picture ----------------------------------------------------------------------------
    def compute(self, v: dict[str, Any]) -> dict[str, Any]:
        model, plan = run_plan(v)
        shown = self.report if self.report_plan == (model, plan) else None
        self.verdict = "measured" if shown else "not run"
        return {"model": model, "plan": plan, "report": shown}

    def layout_key(self, r: dict[str, Any]) -> Any:
        return r["report"] is not None

    def make_axes(self, fig: Figure, r: dict[str, Any]) -> Sequence[Axes]:
        if r["report"] is None:
            return [fig.add_axes((0.02, 0.02, 0.96, 0.96))]
        gs = fig.add_gridspec(1, 3, wspace=0.45, left=0.07, right=0.98, bottom=0.2, top=0.88)
        return [fig.add_subplot(gs[i]) for i in range(3)]

    def draw(self, r: dict[str, Any], axes: list[Axes]) -> None:
        self.frames.invalidate()              # drawn from scratch: a run's picture changes once per run
        rep = r["report"]
        if rep is None:
            draw_message(axes[0], "press Run: the measured figures appear here beside the predicted ones")
            self.pipeline.layout.display = "none"
            self.tables.value = ""
            return
        mem = {k: rep["memory"][k] for k in RUN_CATEGORIES if k in rep["memory"]}
        _pair_bars(axes[0], mem, "memory of the fullest rank")
        _pair_bars(axes[1], rep["comm"], "payload over all ranks and steps")
        ax = axes[2]
        reset_axes(ax)
        steps = list(range(1, len(rep["losses"]) + 1))
        ax.plot(steps, rep["reference_losses"], "o-", color=CURVE_COLORS[0], lw=3, label="1 process")
        ax.plot(steps, rep["losses"], "x--", color=CURVE_COLORS[1], label="parallel")
        ax.set_title("loss per step", fontsize=9)
        ax.set_xlabel("step", fontsize=8)
        ax.set_xticks(steps)
        ax.legend(fontsize=8)
        ax.tick_params(labelsize=8)
        self.tables.value = report_tables(rep)
        self._show_pipeline(r["plan"], rep)

    def _show_pipeline(self, plan: Plan, rep: dict[str, Any]) -> None:
        pipe = rep.get("pipeline")
        if not pipe:
            self.pipeline.layout.display = "none"
            return
        costs = pipe["mean_costs_s"]
        b = min(3.0, max(0.25, round(4 * costs["b"] / costs["f"]) / 4)) if costs["f"] > 0 else 1.0
        self.pipeline._measured = pipe["timeline"]
        self.pipeline._measured_title = f"measured (last step of the run, {plan.pp} CPU ranks per replica)"
        self.pipeline.unit_s = costs["f"] if costs["f"] > 0 else None
        self.pipeline.set(schedule=pipe["schedule"], stages=pipe["p"], microbatches=pipe["m"], f=1.0, b=b,
                          w=0.0, p2p=0.0)
        self.pipeline.layout.display = None

    def describe(self, r: dict[str, Any]) -> str:
        plan, rep = r["plan"], r["report"]
        head = (f"tiny run: {r['model'].name}, dp={plan.dp} tp={plan.tp} pp={plan.pp} cp={plan.cp} "
                f"zero={plan.zero}: {plan.world} CPU ranks, global batch {plan.global_batch} x {plan.seq} tokens")
        if self.run_error and rep is None:
            return error_html(ParallelLabError(self.run_error), self.run_error_head) + status_line(head, MUTED)
        if self.job is not None and self.job.running() and getattr(self, "_running", None) == (r["model"], plan):
            return status_line(f"<b>Running</b> {self.progress_text.value or 'starting...'}: {head}. Cancel "
                               f"stops every rank.")
        if rep is None:
            return status_line(f"<b>Not run yet.</b> {head}. Press Run; the kernel stays responsive and "
                               f"Cancel stops every rank.")
        same = all(c["measured_bytes"] == c["predicted_bytes"] for c in rep["comm"].values())
        gap = max(abs(a - b) for a, b in zip(rep["losses"], rep["reference_losses"], strict=True))
        return (status_line(f"<b>Measured</b> in {fmt_seconds(rep['wall_s'])}: {head}.")
                + status_line(f"Bytes per collective dimension {'equal the prediction' if same else 'DIFFER'}; "
                              f"largest loss difference from the one-process reference {gap:.1e}; "
                              f"largest parameter difference {rep['max_abs_param_diff']:.1e}.", MUTED))


def _pair_bars(ax: Axes, rows: dict[str, dict[str, int]], title: str) -> None:
    """Measured and predicted bytes side by side, one pair per row name, on a unit that suits them."""
    reset_axes(ax)
    names = list(rows)
    if not names:
        draw_message(ax, "none: a single rank per group")
        ax.set_title(title, fontsize=9)
        return
    top = max(max(c["measured_bytes"], c["predicted_bytes"]) for c in rows.values()) or 1
    unit, scale = unit_for(top)
    xs = range(len(names))
    ax.bar([x - 0.2 for x in xs], [rows[n]["predicted_bytes"] / scale for n in names], 0.4, facecolor="white",
           edgecolor=PREDICTED_EDGE, label="predicted", gid="predicted")
    ax.bar([x + 0.2 for x in xs], [rows[n]["measured_bytes"] / scale for n in names], 0.4, color=MEASURED,
           label="measured", gid="measured")
    ax.set_xticks(list(xs), [n.replace("_", "\n") for n in names], fontsize=8)
    ax.set_ylabel(unit, fontsize=8)
    ax.tick_params(labelsize=8)
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8)


def report_tables(rep: dict[str, Any]) -> str:
    """The run's figures as HTML tables (class ``pl-run-table``; cells hold exact byte counts)."""
    def table(title: str, rows: dict[str, dict[str, int]]) -> str:
        body = ""
        for name, c in rows.items():
            m, p = c["measured_bytes"], c["predicted_bytes"]
            gap = f"{(m - p) / p:+.2%}" if p else ""
            body += (f"<tr data-row='{html.escape(name)}'><td>{html.escape(name)}</td>"
                     f"<td class='measured' style='text-align:right'>{m:,}</td>"
                     f"<td class='predicted' style='text-align:right'>{p:,}</td><td>{gap}</td></tr>")
        return (f"<table class='pl-run-table' data-table='{title}' style='font-size:12px;margin:4px 16px 4px 0'>"
                f"<caption style='text-align:left'><b>{title}</b> (bytes)</caption><tr><th>category</th>"
                f"<th>measured</th><th>predicted</th><th>gap</th></tr>{body}</table>")

    losses = "".join(f"<tr><td>{i}</td><td>{a:.6f}</td><td>{b:.6f}</td></tr>"      # steps from 1, as the chart
                     for i, (a, b) in enumerate(zip(rep["losses"], rep["reference_losses"], strict=True), 1))
    loss_table = (f"<table class='pl-run-losses' style='font-size:12px;margin:4px 0'><caption "
                  f"style='text-align:left'><b>losses</b></caption><tr><th>step</th><th>parallel</th>"
                  f"<th>1 process</th></tr>{losses}</table>")
    return ("<div style='display:flex;flex-wrap:wrap'>" + table("memory", rep["memory"])
            + table("comm", rep["comm"]) + loss_table + "</div>")
