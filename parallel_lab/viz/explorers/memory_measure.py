"""The Memory tab's "measure this plan": the ledger beside one real-scale training step in fake tensors.

``parallel-lab memory ... --measure --json`` (``distributed.instruments.measure``) builds the plan's model at full size
under fake tensors (nothing is allocated), applies the plan to one rank of the stage the explorer reports
(the fullest) with the lab's own parallelisms, runs one forward, backward and optimizer step under torch's
memory tracker and prints, per ledger category and for the peak, the measured bytes beside both activation
models' predictions, with ``error = predicted / measured - 1``. That takes seconds to a minute of CPU, so
:class:`MeasurePanel` runs the command itself in a child process (:class:`~.jobs.CliJob`, the machinery of
the Run tab): the panel shows each progress line the command prints, Cancel stops it, and the answer is
drawn with the library's own plots (``plots.draw_memory`` stacked bars of both ledgers and the measurement,
``plots.draw_predicted_measured`` per category) above a table of the exact bytes. Before anything starts,
``measurable.measurable_layout`` (torch-free: the kernel never loads torch) refuses what fake
tensors cannot run (``tp > kv_heads``, an optimizer without a runnable layout) with its message
and its fix, and the command line is parsed back (``jobs.check_spelled``) so that it computes the very plan
shown; the runnable code's own checks run in the child, whose error line the panel shows.
"""

from __future__ import annotations

import html
import math
from collections.abc import Callable
from typing import Any

import ipywidgets as W

from ...errors import ParallelLabError
from ...hardware import ClusterSpec
from ...ledger import CATEGORIES
from ...measurable import measurable_layout
from ...quantities import fmt_bytes, fmt_seconds
from ...specs import ModelSpec, Plan
from ..palette import MUTED
from ..plots.base import CATEGORY_LABELS, DPI, new_figure, to_png
from ..plots.measured import draw_predicted_measured
from ..plots.memory import category_legend, draw_memory
from .base import error_html, job_controls, status_line
from .jobs import CliJob, check_spelled, cli_argv, loop_caller

#: what the command writes before each of its progress lines on stderr (``say`` in parallel_lab/cli/memory.py)
PROGRESS_PREFIX = "parallel-lab memory --measure: "
#: progress lines of one stage: building, applying the plan, forward/backward, optimizer step, done
STAGE_LINES = 5
LEDGER_FORMULAS = ("per-op", "korthikanti")
#: the rows of a measurement: the ledger's categories, then the peak (against the ledger's total)
ROWS = (*CATEGORIES, "peak")

#: what one measurement is of: the model, the plan and the pipeline stage measured
Target = tuple[ModelSpec, Plan, int]


def measure_argv(model: ModelSpec, plan: Plan, cluster: ClusterSpec, stage: int, activation_model: str) -> list[str]:
    """The command line the panel runs (and shows): ``parallel-lab memory <plan> --measure --json``."""
    return cli_argv("memory", model, plan, "--cluster", cluster.name, "--activation-model", activation_model,
                    "--stage", str(stage), "--measure", "--json")


def shown_argv(argv: list[str]) -> str:
    """``parallel-lab memory ...``: the command as a user would type it (without the interpreter)."""
    return " ".join(["parallel-lab", *argv[3:]])


class MeasurePanel(W.VBox):
    """The button, its progress and the measured-beside-predicted answer for the plan ``target()`` names.

    ``target()`` returns ``(model, plan, cluster, stage, activation_model)`` of the plan shown, or raises
    (the explorer's own error). ``start()`` checks and starts; ``cancel()`` stops; ``wait(timeout_s)``
    blocks until a started measurement has ended (tests). After it: ``report`` (the command's JSON),
    ``measured_for`` (its :data:`Target`), ``entry`` (the stage's ``measured`` entry of ``report``),
    ``figure``; ``refused`` holds the message of a plan that was not started, ``failed`` that of a
    measurement that did not finish.
    """

    figsize = (9.6, 3.9)

    def __init__(self, target: Callable[[], tuple[ModelSpec, Plan, ClusterSpec, int, str]]) -> None:
        self._target = target
        self.job: CliJob | None = None
        self.report: dict[str, Any] | None = None
        self.entry: dict[str, Any] | None = None
        self.measured_for: Target | None = None
        self.figure: Any = None
        self.refused: str | None = None
        self.failed: str | None = None
        self._pending: Target | None = None
        self._lines = 0
        self._summary = ""
        self.button, self.cancel_button, self.progress, self.progress_text = job_controls(
            W.Button(description="measure this plan", icon="tachometer", button_style="info",
                     tooltip="one training step of the fullest stage's rank at full size in fake "
                             "tensors (parallel-lab memory --measure); seconds to a minute"),
            "stop the measurement (its process)", STAGE_LINES, "measure", "260px")
        self.status = W.HTML()
        self.image = W.Image(format="png", layout=W.Layout(width="100%", max_width=f"{int(9.6 * DPI)}px",
                                                           display="none"))
        self.table = W.HTML()
        self.button.on_click(lambda _: self.start())
        self.cancel_button.on_click(lambda _: self.cancel())
        self.progress_text.add_class("pl-measure-progress")
        self.status.add_class("pl-measure-status")
        self.image.add_class("pl-measure-chart")
        self.table.add_class("pl-measure-tables")
        bar = W.HBox([self.button, self.cancel_button, self.progress, self.progress_text],
                     layout=W.Layout(align_items="center", flex_flow="row wrap"))
        super().__init__([bar, self.status, self.image, self.table], layout=W.Layout(margin="8px 0 0 0"))
        self.add_class("pl-measure")

    # ---- starting and stopping ------------------------------------------------------------------
    def busy(self) -> bool:
        return self.job is not None and self.job.running()

    def start(self) -> bool:
        """Check the plan shown and start measuring it: False (the reason in the panel, ``refused``) when it
        cannot start, True once the child process runs."""
        if self.busy() or self._pending is not None:
            return False
        self.refused = self.failed = None
        try:
            model, plan, cluster, stage, am = self._target()
            argv = measure_argv(model, plan, cluster, stage, am)
            check_spelled(argv, model, plan)
            measurable_layout(model, plan)             # the plan rules, torch-free: the kernel stays light
        except Exception as err:  # noqa: BLE001 - the library's message, shown
            return self._refuse(err)
        self._pending = (model, plan, stage)
        self.button.disabled = True
        self.progress.value, self.progress.max, self._lines = 0, STAGE_LINES, 0
        self._launch(argv, loop_caller())              # the runnable code's own checks run in the child
        return True

    def _refuse(self, err: BaseException) -> bool:
        self._pending = None
        self.refused = str(err)
        self.button.disabled = False
        self.progress_text.value = ""
        self.status.value = error_html(err, "Not measured")
        return False

    def _launch(self, argv: list[str], call: Callable[..., None]) -> None:
        self.cancel_button.disabled = False
        self.progress_text.value = "starting: " + html.escape(shown_argv(argv))
        try:
            self.job = CliJob(argv, self._on_line, self._on_done, call,
                              is_progress=lambda line: line.startswith(PROGRESS_PREFIX))
        except OSError as err:                         # no process could start (descriptors, memory)
            self.cancel_button.disabled = True
            self._refuse(ParallelLabError(f"the measurement's process could not start: {err}"))

    def cancel(self) -> None:
        if self.job is not None and self.job.running():
            self.job.cancel()

    def wait(self, timeout_s: float | None = None) -> None:
        """Until the check and the measurement it started have ended (tests and notebooks)."""
        if self.job is not None:
            self.job.wait(timeout_s)

    # ---- the child's progress and answer ----------------------------------------------------------
    def _on_line(self, line: str) -> None:
        self._lines += 1
        self.progress.value = min(self._lines, self.progress.max)
        self.progress_text.value = html.escape(line[len(PROGRESS_PREFIX):])

    def _on_done(self, job: CliJob) -> None:
        target, self._pending = self._pending, None
        self.button.disabled, self.cancel_button.disabled = False, True
        if job.cancelled:
            self.progress_text.value = "cancelled (the measurement's process stopped)"
            self.failed = "cancelled"
            self.status.value = status_line("Measurement cancelled: nothing was measured.", MUTED)
        elif job.report is None:
            self.progress_text.value = "failed"
            self.failed = job.error or "the command did not answer"
            self.status.value = error_html(ParallelLabError(self.failed), "Measurement did not finish")
        else:
            self.progress.value = self.progress.max
            try:
                entry = job.report["measured"][0]
                self._draw(job.report, entry, shown_argv(job.argv), target[1].world)
            except Exception as err:  # noqa: BLE001 - an answer the panel cannot read: said, never raised
                self.failed = f"the command's answer could not be shown: {type(err).__name__}: {err}"
                self.progress_text.value = "failed"
                self.status.value = error_html(ParallelLabError(self.failed), "Measurement not shown")
            else:
                self.report, self.measured_for, self.entry = job.report, target, entry
                self.progress_text.value = (f"done: one training step in {fmt_seconds(entry['seconds'])} "
                                            f"({fmt_seconds(entry['cpu_seconds'])} of CPU)")
        self.show_for(self._current())

    def _current(self) -> Target | None:
        try:
            model, plan, _, stage, _ = self._target()
        except Exception:  # noqa: BLE001 - an invalid plan shown: no measurement is of it
            return None
        return model, plan, stage

    def show_for(self, target: Target | None) -> None:
        """Show the last measurement when it is of ``target`` (the plan now shown), else say what it was of.
        Called after every refresh of the explorer: only layout and one line change (no drawing)."""
        same = self.report is not None and target == self.measured_for
        self.image.layout.display = None if same else "none"
        self.table.layout.display = None if same else "none"
        if self.busy() or self._pending is not None or self.refused or (self.failed and not same):
            return
        if same:
            self.status.value = self._summary
        elif self.measured_for is not None:
            m, p, s = self.measured_for
            self.status.value = status_line(
                f"The last measurement was of another plan ({html.escape(m.name)}, dp={p.dp} tp={p.tp} "
                f"pp={p.pp} cp={p.cp} zero={p.zero}, seq {p.seq}, stage {s}); press <i>measure this plan</i> "
                f"for this one.", MUTED)
        else:
            self.status.value = status_line(
                "<i>measure this plan</i> runs one training step of the fullest stage's rank at full size in "
                "fake tensors, in a process of its own (<code>parallel-lab memory ... --measure</code>): "
                "seconds to a minute, nothing allocated; the measured bytes appear here beside the ledger's.",
                MUTED)

    def on_refresh(self) -> None:
        """The explorer redrew: drop a refusal that was about another plan, then :meth:`show_for`."""
        if self.refused is not None and not self.busy():
            self.refused = None
        self.show_for(self._current())

    # ---- the picture --------------------------------------------------------------------------------
    def _draw(self, report: dict[str, Any], entry: dict[str, Any], command: str, world: int) -> None:
        measured = {k: v for k, v in entry["measured"].items() if k != "peak" and v is not None}
        room = {"hbm_bytes": report["hbm_bytes"], "margin": report["margin"]}
        bars = [{"per_gpu_bytes": {k: v for k, v in entry["predicted"][f].items() if k != "total"}, **room}
                for f in LEDGER_FORMULAS] + [{"per_gpu_bytes": measured, **room}]
        fig = new_figure(self.figsize)
        gs = fig.add_gridspec(1, 2, width_ratios=(1.3, 1.0), wspace=0.55, left=0.07, right=0.72, bottom=0.16,
                              top=0.88)
        a1, a2 = fig.add_subplot(gs[0]), fig.add_subplot(gs[1])
        draw_memory(a1, bars, ["ledger\nper-op", "ledger\nKorth.", "meas-\nured"],
                    title=f"ledgers and measured, stage {entry['stage']}")
        rows = [k for k in ROWS if entry["measured"].get(k) is not None]
        draw_predicted_measured(a2, [_label(k) for k in rows],
                                [_predicted(entry, "per-op", k) for k in rows],
                                [entry["measured"][k] for k in rows], title="ledger (per-op) vs measured")
        category_legend(fig)
        self.figure = fig
        self.image.value = to_png(fig)
        self.table.value = measure_table(report, entry) + status_line(
            "error = predicted / measured - 1; the peak row is torch's tracker's peak against the ledger's total",
            MUTED) + "".join(
            status_line(html.escape(n), MUTED) for n in entry["notes"]) + status_line(
            f"command: <code>{html.escape(command)}</code>", MUTED)
        peak = entry["measured"]["peak"]
        worst = max((abs(e) for k, e in entry["error"]["per-op"].items() if k != "peak" and e is not None),
                    default=0.0)
        self._summary = status_line(
            f"<b>Measured</b> in fake tensors: stage {entry['stage']}'s rank {entry['rank']} of {world}, peak "
            f"{fmt_bytes(peak, 4)} against the ledger's total {fmt_bytes(_predicted(entry, 'per-op', 'peak'), 4)} "
            f"(per-op, error {_pct(entry['error']['per-op']['peak'])}); largest per-category error (per-op) "
            f"{_pct(worst)}.")


def _label(category: str) -> str:
    return "peak" if category == "peak" else CATEGORY_LABELS.get(category, category)


def _predicted(entry: dict[str, Any], formula: str, category: str) -> float:
    return float(entry["predicted"][formula]["total" if category == "peak" else category])


def _pct(e: float | None) -> str:
    return "-" if e is None else ("inf" if math.isinf(e) else f"{e:+.1%}")


def measure_table(report: dict[str, Any], entry: dict[str, Any]) -> str:
    """Measured beside both ledgers as an HTML table (class ``pl-measure-table``; exact byte counts;
    error = predicted / measured - 1, the command's own; the peak row: the tracker's peak against the
    ledger's total)."""
    def cell(cls: str, v: float | None) -> str:
        text = "-" if v is None else f"{int(v):,}"
        return f"<td class='{cls}' style='text-align:right'>{text}</td>"

    body = ""
    for k in ROWS:
        m = entry["measured"].get(k)
        body += (f"<tr data-row='{k}'><td>{html.escape(_label(k))}</td>{cell('measured', m)}"
                 + "".join(cell(f, _predicted(entry, f, k)) + f"<td class='error-{f}' style='text-align:right'>"
                           f"{_pct(entry['error'][f].get(k))}</td>" for f in LEDGER_FORMULAS) + "</tr>")
    head = "".join(f"<th>ledger {f}</th><th>error</th>" for f in LEDGER_FORMULAS)
    return (f"<table class='pl-measure-table' style='font-size:12px;margin:4px 0'><caption style='text-align:left'>"
            f"<b>stage {entry['stage']}, one training step in fake tensors</b> (bytes)</caption><tr>"
            f"<th>category</th>"
            f"<th>measured</th>{head}</tr>{body}</table>")
