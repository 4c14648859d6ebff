"""The explorers' base class and the inputs they share.

How an explorer works. Every explorer holds its input widgets in ``.widgets`` (a dict by name),
computes its result from their values with the analytic core (``compute``), draws the result into one
persistent matplotlib figure (``.figure``) and shows it as a PNG in an ``ipywidgets.Image``. It
recomputes only on a widget's change event (sliders have ``continuous_update=False``: dragging sends one
event on release). The figure's axes are built once; the ``draw_*`` functions of
:mod:`parallel_lab.viz.plots` update their artists in place, and the renderer redraws only those over a
cached background (blitting).

Why an Image widget rather than ipympl: matplotlib renders the figure either way (ipympl sends Agg's
PNGs too), but an Image needs no front-end extension and cannot hit ipympl 0.10's blank canvas when
the notebook draws while Voila still executes it (seen with ipympl 0.10 under Voila 0.5).
Figures are ``matplotlib.figure.Figure``, never pyplot: no figure is left open.

Invalid input: the core raises :class:`ParallelLabError`; the explorer shows its message (the bad value
and a fix) in ``.status`` and hides the stale chart. Any other exception is a bug, shown as
"internal error" with its one-line message, without a traceback.
"""

from __future__ import annotations

import html
import time
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import ipywidgets as W
from matplotlib.axes import Axes
from matplotlib.figure import Figure

from ...errors import ParallelLabError
from ...hardware import CLUSTER_PRESETS, ClusterSpec
from ...specs import MODEL_PRESETS, ModelSpec, Plan
from ..frames import Frames
from ..palette import ERROR_EDGE, ERROR_FILL, ERROR_TEXT, INK
from ..plots.base import DPI, FIGSIZE, new_figure
from .help import tooltip
from .lessons import EXPLAINED_BY, lesson_link

DEGREES = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
SEQS = (512, 1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072)
CUSTOM = "custom"
LAYOUTS_KEPT = 3              # figures kept for recent layouts (e.g. the planner with and without pp)
DESC = {"description_width": "112px"}
COL = W.Layout(width="320px")
ROW_ITEM = W.Layout(width="310px")


# --------------------------------------------------------------------------------------------------
# widget helpers
# --------------------------------------------------------------------------------------------------

def slider(description: str, options: Sequence[Any], value: Any) -> W.SelectionSlider:
    return W.SelectionSlider(options=list(options), value=value, description=description,
                             continuous_update=False, style=DESC, layout=ROW_ITEM)


def int_slider(description: str, lo: int, hi: int, value: int) -> W.IntSlider:
    return W.IntSlider(value=value, min=lo, max=hi, description=description, continuous_update=False,
                       style=DESC, layout=ROW_ITEM)


def dropdown(description: str, options: Sequence[Any], value: Any) -> W.Dropdown:
    return W.Dropdown(options=list(options), value=value, description=description, style=DESC,
                      layout=ROW_ITEM)


def toggles(description: str, options: Sequence[Any], value: Any, width: str = "48px") -> W.ToggleButtons:
    """Toggle buttons; their label is put beside them by :func:`labelled` (``description`` is a tooltip)."""
    return W.ToggleButtons(options=list(options), value=value, tooltip=description,
                           style={"button_width": width}, layout=W.Layout(width="auto"))


def labelled(label: str, widget: W.Widget) -> W.HBox:
    """``label`` left of ``widget``, aligned like the other widgets' descriptions."""
    text = W.HTML(f"<div style='text-align:right;padding-right:8px'>{html.escape(label)}</div>",
                  layout=W.Layout(width="120px"))
    return W.HBox([text, widget], layout=W.Layout(align_items="center", margin="0 12px 0 0"))


def checkbox(description: str, value: bool) -> W.Checkbox:
    return W.Checkbox(value=value, description=description, indent=True, style=DESC, layout=ROW_ITEM)


def int_text(description: str, value: int) -> W.BoundedIntText:
    return W.BoundedIntText(value=value, min=1, max=10**7, description=description, style=DESC,
                            layout=ROW_ITEM)


def degree_controls(dp: int, tp: int, pp: int, cp: int, zero: int) -> dict[str, W.ValueWidget]:
    """The plan's degrees, ZeRO stage and sequence-parallel switch, as the Memory and Comm tabs show them."""
    return {"dp": slider("dp", DEGREES, dp), "tp": slider("tp", DEGREES[:7], tp), "pp": slider("pp", DEGREES[:8], pp),
            "cp": slider("cp", DEGREES[:7], cp), "zero": toggles("ZeRO stage", (0, 1, 2, 3), zero, "40px"),
            "sp": checkbox("sequence parallel", False)}


def job_controls(start: W.Button, cancel_tooltip: str, steps: int, progress_label: str,
                 width: str) -> tuple[W.Button, W.Button, W.IntProgress, W.HTML]:
    """A background job's row: its start button, a Cancel button, a progress bar of ``steps`` and its text."""
    cancel = W.Button(description="Cancel", icon="stop", disabled=True, tooltip=cancel_tooltip)
    progress = W.IntProgress(value=0, min=0, max=steps, description=progress_label, layout=W.Layout(width=width))
    return start, cancel, progress, W.HTML()


def fresh(ax: Axes, key: Any) -> bool:
    """True (and ``key`` remembered) when ``ax`` last drew something else than ``key``: for pictures drawn
    from scratch, so that an axes whose inputs did not change is left alone and the renderer reuses its
    cached tile (its artists, and so its key in :mod:`parallel_lab.viz.frames`, stay the same)."""
    if getattr(ax, "_pl_drawn", None) == key:
        return False
    ax._pl_drawn = key  # type: ignore[attr-defined]
    return True


def no_null_tooltips(root: W.Widget) -> None:
    """Give every widget under ``root`` without a tooltip an empty one: ipywidgets 8 writes a missing
    tooltip into the page as the title "null", which the browser then shows on hover."""
    stack = [root]
    while stack:
        w = stack.pop()
        if getattr(w, "tooltip", "") is None:
            w.tooltip = ""
        stack.extend(c for c in getattr(w, "children", ()) if isinstance(c, W.Widget))


def error_html(err: BaseException, head: str = "Invalid combination") -> str:
    """The library's message in a red box (no traceback), under ``head`` (e.g. "Plan file error")."""
    if isinstance(err, ParallelLabError):
        msg = str(err)
    else:
        head, msg = "Internal error (please report it)", f"{type(err).__name__}: {err}"
    return (f'<div class="pl-error" style="color:{ERROR_TEXT};background:{ERROR_FILL};'
            f'border-left:4px solid {ERROR_EDGE};'
            f'padding:6px 10px;margin:4px 0"><b>{head}:</b> {html.escape(msg)}</div>')


def status_line(text: str, color: str = INK) -> str:
    return f'<div style="color:{color};margin:2px 0">{text}</div>'


# --------------------------------------------------------------------------------------------------
# base class
# --------------------------------------------------------------------------------------------------

class Explorer(W.VBox):
    """Widgets in, one figure out. Subclasses define ``compute(values) -> result``, ``make_axes(figure,
    result)``, ``draw(result, axes)`` and ``describe(result) -> html``; ``layout_key(result)`` says when
    the axes must be rebuilt (otherwise ``draw`` updates the charts already on them).

    Attributes for tests and notebooks: ``widgets`` (name -> input widget), ``figure`` (the matplotlib
    figure last drawn), ``image`` (the Image widget showing it), ``status`` (HTML: verdict or error),
    ``result`` (last valid result), ``error`` (the exception of the last refresh, or None), ``verdict``
    (a short string, or None), ``last_redraw_s`` and ``timings`` (the last refresh's compute, artist and
    render seconds, and ``full``: 1.0 if the whole figure was drawn, 0.0 if only what changed),
    ``frames`` (the renderer, :class:`~parallel_lab.viz.frames.Frames`).
    """

    figsize: tuple[float, float] = FIGSIZE

    def __init__(self, controls: dict[str, W.ValueWidget], columns: Sequence[Sequence[W.Widget]],
                 extra: Sequence[W.Widget] = ()) -> None:
        self.widgets: dict[str, W.ValueWidget] = controls
        for name, w in controls.items():                 # meaning and unit on hover (help.TOOLTIPS)
            w.tooltip = tooltip(name)
            if isinstance(w, W.ToggleButtons):
                w.tooltips = [w.tooltip] * len(w.options)
        self.status = W.HTML(layout=W.Layout(min_height="44px"))
        self.figure = new_figure(self.figsize)
        self._stamps: OrderedDict[Any, Any] = OrderedDict()      # texts rendered once, for all layouts
        self.frames = Frames(self.figure, stamps=self._stamps)
        width = f"{int(self.figsize[0] * DPI)}px"
        self.image = W.Image(format="png", layout=W.Layout(width="100%", max_width=width))
        self.result: Any = None
        self.error: BaseException | None = None
        self.verdict: str | None = None
        self.last_redraw_s = 0.0
        self.timings: dict[str, float] = {}
        self._hold = False
        self._axes: list[Axes] = []
        self._axes_key: Any = object()
        self._layouts: OrderedDict[Any, tuple[Figure, Frames, list[Axes]]] = OrderedDict()
        panel = W.HBox([W.VBox(list(col), layout=COL) for col in columns],
                       layout=W.Layout(flex_flow="row wrap"))
        lesson = EXPLAINED_BY.get(type(self).__name__)
        self.lesson = W.HTML(f"<div style='font-size:12px;margin:2px 0'>Explained in {lesson_link(lesson)}</div>"
                             if lesson else "")
        self.lesson.add_class("pl-lesson-link")
        super().__init__([panel, self.status, self.image, *extra, self.lesson])
        self.add_class("pl-explorer")
        self.status.add_class("pl-status")
        self.image.add_class("pl-chart")
        for w in controls.values():
            w.observe(self._on_change, names="value")
        no_null_tooltips(self)
        self.refresh()

    # ---- driving --------------------------------------------------------------------------------
    def values(self) -> dict[str, Any]:
        return {k: w.value for k, w in self.widgets.items()}

    def set(self, **values: Any) -> Explorer:
        """Set several widgets at once and refresh once; unknown names raise ``KeyError``."""
        unknown = sorted(set(values) - set(self.widgets))
        if unknown:
            raise KeyError(f"unknown widget(s) {unknown}; known: {sorted(self.widgets)}")
        self._hold = True
        try:
            for k, v in values.items():
                self.widgets[k].value = v
        finally:
            self._hold = False
        self.refresh()
        return self

    def _on_change(self, change: dict[str, Any]) -> None:
        if not self._hold:
            self.refresh()

    def show_plan(self, model: ModelSpec, cluster: ClusterSpec, plan: Plan, gpus: int) -> list[str]:
        """Set this explorer's inputs to ``plan`` (one redraw). Inputs it lacks are ignored; a value its
        widget cannot take (not among a slider's options) is left as it was and named in the returned
        list, e.g. ``["grad_accum=12"]``."""
        values = plan_values(model, cluster, plan, gpus)
        ok, skipped = {}, []
        for name, value in values.items():
            w = self.widgets.get(name)
            if w is None:
                continue
            options = getattr(w, "options", None)
            allowed = ([o[1] if isinstance(o, tuple) else o for o in options] if options is not None
                       else None)
            in_range = (allowed is None or value in allowed) and not (
                hasattr(w, "max") and hasattr(w, "min") and not w.min <= value <= w.max)
            if in_range:
                ok[name] = value
            else:
                skipped.append(f"{name}={value}")
        self.set(**ok)
        return skipped

    def refresh(self) -> None:
        """Recompute from the widgets' values and redraw in place (or show the error)."""
        t0 = time.perf_counter()
        try:
            result = self.compute(self.values())
            t1 = time.perf_counter()
            self.draw(result, self.axes_for(result))
            t2 = time.perf_counter()
            image = self.frames.render()
            self.timings = {"compute_s": t1 - t0, "artists_s": t2 - t1, "render_s": time.perf_counter() - t2,
                            "full": float(self.frames.last_full)}
            status = self.describe(result)
        except Exception as err:  # noqa: BLE001 - shown in the widget, never as a traceback
            self.error, self.verdict = err, None
            self.status.value = error_html(err)
            self.image.layout.display = "none"
        else:
            self.error, self.result = None, result
            self.image.value = image
            self.image.layout.display = None
            self.status.value = status
        self.last_redraw_s = time.perf_counter() - t0

    def axes_for(self, result: Any) -> list[Axes]:
        """The axes for ``layout_key(result)``: the same axes while the key stays (the ``draw_*`` functions
        update their charts in place), else those of the figure kept for that key (the last
        ``LAYOUTS_KEPT`` layouts keep their figure, charts and cached frames), else a new figure."""
        key = self.layout_key(result)
        if key != self._axes_key:
            layout = self._layouts.pop(key, None)
            if layout is None:
                if not self._layouts and not self.figure.axes:
                    figure, frames = self.figure, self.frames          # the first layout: the figure made
                else:
                    figure = new_figure(self.figsize)
                    frames = Frames(figure, stamps=self._stamps)
                layout = (figure, frames, list(self.make_axes(figure, result)))
            self._layouts[key] = layout                                # most recent last
            while len(self._layouts) > LAYOUTS_KEPT:
                self._layouts.popitem(last=False)
            self.figure, self.frames, self._axes = layout
            self._axes_key = key
        return self._axes

    # ---- subclasses -----------------------------------------------------------------------------
    def compute(self, v: dict[str, Any]) -> Any:
        raise NotImplementedError

    def layout_key(self, result: Any) -> Any:
        return None

    def make_axes(self, fig: Figure, result: Any) -> Sequence[Axes]:
        raise NotImplementedError

    def draw(self, result: Any, axes: list[Axes]) -> None:
        raise NotImplementedError

    def describe(self, result: Any) -> str:
        return ""


# --------------------------------------------------------------------------------------------------
# shared inputs: model (preset or custom shape), cluster
# --------------------------------------------------------------------------------------------------

def model_controls(default: str) -> tuple[dict[str, W.ValueWidget], W.VBox]:
    c: dict[str, W.ValueWidget] = {"model": dropdown("model", [*MODEL_PRESETS, CUSTOM], default)}
    c["layers"] = int_text("layers", 32)
    c["hidden"] = int_text("hidden", 4096)
    c["heads"] = int_text("heads", 32)
    c["kv_heads"] = int_text("kv heads", 32)
    c["ffn"] = int_text("ffn", 16384)
    c["vocab"] = int_text("vocab", 32000)
    c["flavour"] = dropdown("flavour", ["gpt", "llama"], "gpt")
    custom = W.VBox([c[k] for k in ("layers", "hidden", "heads", "kv_heads", "ffn", "vocab", "flavour")])

    def show(_: Any = None) -> None:
        custom.layout.display = None if c["model"].value == CUSTOM else "none"

    c["model"].observe(show, names="value")
    show()
    return c, custom


def model_from(v: dict[str, Any]) -> ModelSpec:
    """The ModelSpec the widgets describe: a preset, or a custom shape (validated by ModelSpec)."""
    if v["model"] != CUSTOM:
        return ModelSpec.preset(v["model"])
    return ModelSpec(layers=v["layers"], hidden=v["hidden"], heads=v["heads"], kv_heads=v["kv_heads"],
                     ffn=v["ffn"], vocab=v["vocab"], flavour=v["flavour"], max_positions=max(SEQS),
                     name="custom")


def plan_values(model: ModelSpec, cluster: ClusterSpec, plan: Plan, gpus: int) -> dict[str, Any]:
    """The explorers' input values that describe ``plan`` of ``model`` on ``gpus`` x ``cluster`` (GPUs
    first: the Memory explorer then sets dp from it and each degree after it sets GPUs again)."""
    out: dict[str, Any] = {"gpus": gpus}
    if model.name in MODEL_PRESETS and ModelSpec.preset(model.name) == model:
        out["model"] = model.name
    else:
        out.update(model=CUSTOM, layers=model.layers, hidden=model.hidden, heads=model.heads,
                   kv_heads=model.kv_heads, ffn=model.ffn, vocab=model.vocab, flavour=model.flavour)
    if cluster.name in CLUSTER_PRESETS:
        out["cluster"] = cluster.name
    out.update(dp=plan.dp, tp=plan.tp, pp=plan.pp, cp=plan.cp, zero=plan.zero, sp=plan.sp, seq=plan.seq,
               micro_batch=plan.micro_batch, grad_accum=plan.grad_accum, recompute=plan.recompute,
               optimizer=plan.optimizer, schedule=plan.schedule, interleave=plan.interleave,
               cp_kind=plan.cp_kind, stages=plan.pp, microbatches=plan.microbatches)
    return out


def tier_label(cluster: ClusterSpec, name: str) -> str:
    """``nvlink4 450 GB/s``: a link tier's name with its bandwidth per GPU per direction."""
    for t in (cluster.intra, cluster.inter):
        if t.name == name:
            return f"{t.name} {t.bandwidth / 1e9:.3g} GB/s"
    return name

