"""Explorers: ipywidgets front-ends to the ledger, the communication report, the pipeline simulator and
the planner. Each is one line in a notebook (``MemoryExplorer()``) and is itself a widget (a ``VBox``),
so the Voila app puts the four of them in tabs.

How they work. Every explorer holds its input widgets in ``.widgets`` (a dict by name), computes its
result from their values with the analytic core (``compute``), draws the result into one persistent
matplotlib figure (``.figure``) and shows it as a PNG in an ``ipywidgets.Image``. It recomputes only on a
widget's change event (sliders have ``continuous_update=False``, so dragging sends one event on release).

Why a redraw is cheap (goal: under 50 ms from a value change to the new PNG). The figure's axes are built
once; the pure ``draw_*`` functions of :mod:`parallel_lab.viz.plots` update the artists they made last
time (bar heights, label texts) on axis ranges taken from a ladder of round numbers, so ticks and labels
rarely move; and :class:`parallel_lab.viz.frames.Frames` redraws only those changing artists over a cached
picture of the rest (Agg blitting), then encodes a PNG. Text is what matplotlib draws slowest, and most
of it (ticks, titles, legends) is in the cached picture. The planner also keeps its search while only the
plan to show changes, and the pictures' inputs for the plans it has shown.

Why an Image widget rather than ipympl: the figure is rendered by matplotlib either way (ipympl sends
Agg's PNGs too), but an Image needs no extra front-end extension, and it cannot hit ipympl 0.10's
blank-canvas problem when the notebook draws while Voila is still executing it (see
``shared/reference/voila_browser_notes.md``). Figures are built with ``matplotlib.figure.Figure``, never
pyplot, so no figure is left open and nothing depends on a backend.

Invalid input. An impossible combination raises :class:`ParallelLabError` in the core; the explorer shows
its message (which names the bad value and a fix) in ``.status`` and hides the stale chart. ``.error``
holds the exception, ``.result`` the last valid result. Any other exception is a bug: it is shown as
"internal error" with its one-line message, still without a traceback.

Tests and benchmarks drive explorers programmatically: ``ex.widgets["zero"].value = 3`` (one redraw) or
``ex.set(zero=3, dp=16)`` (one redraw for several values), then read ``ex.result``, ``ex.verdict``,
``ex.error`` and the bars of ``ex.figure``. ``ex.last_redraw_s`` is the time of the last refresh,
``ex.timings`` its parts, ``ex.frames`` counts full draws and blitted frames.
"""

from __future__ import annotations

import html
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

import ipywidgets as W
from matplotlib.axes import Axes
from matplotlib.figure import Figure

from .. import comm as comm_mod
from .. import ledger as ledger_mod
from .. import schedules as schedules_mod
from .. import simulate as simulate_mod
from ..specs import (
    CLUSTER_PRESETS,
    CP_KINDS,
    MODEL_PRESETS,
    OPTIMIZERS,
    SCHEDULES,
    ClusterSpec,
    ModelSpec,
    ParallelLabError,
    Plan,
)
from . import plots as P
from .frames import Frames

GB = P.GB
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

def _slider(description: str, options: Sequence[Any], value: Any) -> W.SelectionSlider:
    return W.SelectionSlider(options=list(options), value=value, description=description,
                             continuous_update=False, style=DESC, layout=ROW_ITEM)


def _int_slider(description: str, lo: int, hi: int, value: int) -> W.IntSlider:
    return W.IntSlider(value=value, min=lo, max=hi, description=description, continuous_update=False,
                       style=DESC, layout=ROW_ITEM)


def _dropdown(description: str, options: Sequence[Any], value: Any) -> W.Dropdown:
    return W.Dropdown(options=list(options), value=value, description=description, style=DESC,
                      layout=ROW_ITEM)


def _toggles(description: str, options: Sequence[Any], value: Any, width: str = "48px") -> W.ToggleButtons:
    """Toggle buttons; their label is put beside them by :func:`_labelled` (``description`` is a tooltip)."""
    return W.ToggleButtons(options=list(options), value=value, tooltip=description,
                           style={"button_width": width}, layout=W.Layout(width="auto"))


def _labelled(label: str, widget: W.Widget) -> W.HBox:
    """``label`` left of ``widget``, aligned like the other widgets' descriptions."""
    text = W.HTML(f"<div style='text-align:right;padding-right:8px'>{html.escape(label)}</div>",
                  layout=W.Layout(width="120px"))
    return W.HBox([text, widget], layout=W.Layout(align_items="center", margin="0 12px 0 0"))


def _checkbox(description: str, value: bool) -> W.Checkbox:
    return W.Checkbox(value=value, description=description, indent=True, style=DESC, layout=ROW_ITEM)


def _int_text(description: str, value: int) -> W.BoundedIntText:
    return W.BoundedIntText(value=value, min=1, max=10**7, description=description, style=DESC,
                            layout=ROW_ITEM)


def error_html(err: BaseException) -> str:
    """The library's message in a red box (no traceback)."""
    if isinstance(err, ParallelLabError):
        head, msg = "Invalid combination", str(err)
    else:
        head, msg = "Internal error (please report it)", f"{type(err).__name__}: {err}"
    return (f'<div class="pl-error" style="color:#9b1c1c;background:#fdecea;border-left:4px solid #d93025;'
            f'padding:6px 10px;margin:4px 0"><b>{head}:</b> {html.escape(msg)}</div>')


def _line(text: str, color: str = "#1f2328") -> str:
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
    ``frames`` (the :class:`~parallel_lab.viz.frames.Frames` renderer).
    """

    figsize: tuple[float, float] = P.FIGSIZE

    def __init__(self, controls: dict[str, W.ValueWidget], columns: Sequence[Sequence[W.Widget]],
                 extra: Sequence[W.Widget] = ()) -> None:
        self.widgets: dict[str, W.ValueWidget] = controls
        self.status = W.HTML(layout=W.Layout(min_height="44px"))
        self.figure = P.new_figure(self.figsize)
        self._stamps: OrderedDict[Any, Any] = OrderedDict()      # texts rendered once, for all layouts
        self.frames = Frames(self.figure, stamps=self._stamps)
        width = f"{int(self.figsize[0] * P.DPI)}px"
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
        super().__init__([panel, self.status, self.image, *extra])
        self.add_class("pl-explorer")
        self.status.add_class("pl-status")
        self.image.add_class("pl-chart")
        for w in controls.values():
            w.observe(self._on_change, names="value")
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
                    figure = P.new_figure(self.figsize)
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

def _model_controls(default: str) -> tuple[dict[str, W.ValueWidget], W.VBox]:
    c: dict[str, W.ValueWidget] = {"model": _dropdown("model", [*MODEL_PRESETS, CUSTOM], default)}
    c["layers"] = _int_text("layers", 32)
    c["hidden"] = _int_text("hidden", 4096)
    c["heads"] = _int_text("heads", 32)
    c["kv_heads"] = _int_text("kv heads", 32)
    c["ffn"] = _int_text("ffn", 16384)
    c["vocab"] = _int_text("vocab", 32000)
    c["flavour"] = _dropdown("flavour", ["gpt", "llama"], "gpt")
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


def tier_label(cluster: ClusterSpec, name: str) -> str:
    """``nvlink4 450 GB/s``: a link tier's name with its bandwidth per GPU per direction."""
    for t in (cluster.intra, cluster.inter):
        if t.name == name:
            return f"{t.name} {t.bandwidth / 1e9:.3g} GB/s"
    return name


# --------------------------------------------------------------------------------------------------
# Memory
# --------------------------------------------------------------------------------------------------

SWEEPS = ("ZeRO stage", "sequence", "dp")


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
        c, custom = _model_controls(model)
        c["seq"] = _slider("sequence", SEQS, seq)
        c["micro_batch"] = _slider("micro-batch", (1, 2, 4, 8, 16, 32), 1)
        c["grad_accum"] = _slider("micro-batches", (1, 2, 4, 8, 16, 32, 64, 128), 1 if pp == 1 else 2 * pp)
        c["schedule"] = _dropdown("schedule", SCHEDULES, "1f1b")
        c["interleave"] = _slider("interleave", (1, 2, 3, 4), 1)
        c["gpus"] = _int_text("GPUs", gpus or dp * tp * pp * cp)
        c["dp"] = _slider("dp", DEGREES, dp)
        c["tp"] = _slider("tp", DEGREES[:7], tp)
        c["pp"] = _slider("pp", DEGREES[:8], pp)
        c["cp"] = _slider("cp", DEGREES[:7], cp)
        c["zero"] = _toggles("ZeRO stage", (0, 1, 2, 3), zero, "40px")
        c["sp"] = _checkbox("sequence parallel", False)
        c["recompute"] = _toggles("recompute", ("none", "selective", "full"), recompute, "72px")
        c["optimizer"] = _dropdown("optimizer", OPTIMIZERS, "adam-mixed")
        c["cluster"] = _dropdown("cluster", CLUSTER_PRESETS, cluster)
        c["activation_model"] = _dropdown("activations", ("korthikanti", "per-op"), "korthikanti")
        c["sweep"] = _toggles("second view", SWEEPS, sweep, "92px")
        columns = [
            [c["model"], custom, c["cluster"], c["optimizer"], c["activation_model"]],
            [c["seq"], c["micro_batch"], c["grad_accum"], c["schedule"], c["interleave"]],
            [c["gpus"], c["dp"], c["tp"], c["pp"], c["cp"], c["sp"]],
        ]
        knobs = W.HBox([_labelled("ZeRO stage", c["zero"]), _labelled("recompute", c["recompute"]),
                        _labelled("second view", c["sweep"])], layout=W.Layout(flex_flow="row wrap"))
        super().__init__(c, columns, extra=())
        self.children = (self.children[0], knobs, *self.children[1:])

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
        plan = self.plan_from(v).validate(model, v["gpus"], cluster)
        am = v["activation_model"]
        led = ledger_mod.memory(model, plan, cluster, activation_model=am)
        stages = _shown_stages(plan.pp)
        per_stage = [ledger_mod.memory(model, plan, cluster, activation_model=am, stage=s) for s in stages]
        out: dict[str, Any] = {"model": model, "plan": plan, "cluster": cluster, "ledger": led,
                               "stages": stages, "stage_ledgers": per_stage, "sweep": v["sweep"]}

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
            full = [attempt(lambda s=s: ledger_mod.activation_bytes(
                model, plan.with_(seq=s, recompute="none").validate(model), 0, formula=am)) for s in seqs]
            lin = [attempt(lambda s=s: ledger_mod.activation_bytes(
                model, plan.with_(seq=s, recompute="selective").validate(model), 0, formula=am))
                for s in seqs]
            out["sweep_values"] = seqs
            out["linear_bytes"] = lin
            out["quadratic_bytes"] = [f - s if f is not None and s is not None else None
                                      for f, s in zip(full, lin, strict=True)]
        self.verdict = "fits" if led.fits else "does not fit"
        return out

    def make_axes(self, fig: Figure, result: Any) -> Sequence[Axes]:
        return P.memory_axes(fig)

    def draw(self, r: dict[str, Any], axes: list[Axes]) -> None:
        fig = self.figure
        a1, a2 = axes
        pp = r["plan"].pp > 1
        P.draw_memory(a1, r["stage_ledgers"], [str(s) for s in r["stages"]] if pp else ["per GPU"],
                      xlabel="pipeline stage" if pp else None,
                      title=f"{r['model'].name} on {r['cluster'].name}")
        plan = r["plan"]
        if r["sweep"] == "ZeRO stage":
            P.draw_memory_sweep(a2, r["sweep_values"], r["sweep_ledgers"], f"ZeRO stage (dp={plan.dp})",
                                value_fmt="ZeRO-{}", highlight=plan.zero,
                                title="model state shards over the data-parallel ranks")
        elif r["sweep"] == "dp":
            P.draw_memory_sweep(a2, r["sweep_values"], r["sweep_ledgers"],
                                f"data-parallel degree (ZeRO-{plan.zero})", highlight=plan.dp,
                                title="the ledger as dp grows (other degrees fixed)")
        else:
            P.draw_activation_terms(a2, r["sweep_values"], r["linear_bytes"], r["quadratic_bytes"],
                                    hbm_bytes=r["cluster"].hbm_bytes, highlight=plan.seq, legend_outside=True,
                                    title="activations, no recomputation (stage 0)")
        P.category_legend(fig)

    def describe(self, r: dict[str, Any]) -> str:
        led = r["ledger"]
        usable = led.hbm_bytes * (1 - led.margin)
        total = led.total_bytes
        where = f" (stage {led.stage}, the fullest)" if r["plan"].pp > 1 else ""
        if led.fits:
            head = (f'<b style="color:#1a7f37">Fits</b>: {total / GB:.2f} GB per GPU{where} of '
                    f"{usable / GB:.1f} GB usable ({led.hbm_bytes / GB:.0f} GB HBM, {led.margin:.0%} margin)")
        else:
            head = (f'<b style="color:#b00020">Does not fit</b>: {total / GB:.2f} GB per GPU{where} &gt; '
                    f"{usable / GB:.1f} GB usable ({led.hbm_bytes / GB:.0f} GB HBM, {led.margin:.0%} margin)")
        big = max(led.per_gpu_bytes.items(), key=lambda kv: kv[1])
        parts = ", ".join(f"{P.CATEGORY_LABELS.get(k, k)} {b / GB:.2f}" for k, b in led.per_gpu_bytes.items())
        lines = [_line(head), _line(f"GB per GPU: {parts}. Largest: {P.CATEGORY_LABELS.get(big[0], big[0])}.",
                                    "#57606a")]
        lines += [_line(html.escape(n), "#57606a") for n in led.notes[:3]]
        return "".join(lines)


def _shown_stages(pp: int) -> list[int]:
    """All stages for pp <= 4, else the first two, the middle and the last."""
    if pp <= 4:
        return list(range(pp))
    return sorted({0, 1, pp // 2, pp - 1})


# --------------------------------------------------------------------------------------------------
# Communication
# --------------------------------------------------------------------------------------------------

TP_DIMS = ("tp", "tp_vocab")


def tp_on_tier(report: comm_mod.CommReport, tier: Any) -> tuple[dict[str, float], dict[str, str]]:
    """Times and tier names of ``report`` with the TP collectives (``tp``, ``tp_vocab``) moved to ``tier``.

    Each call is timed again with :func:`parallel_lab.comm.collective_time` (same alpha-beta model); only
    the link changes. Used by the explorer's "TP group across nodes" toggle.
    """
    times, tiers = dict(report.time_s), dict(report.tiers)
    for dim in TP_DIMS:
        if dim in times:
            times[dim] = sum(c.count * comm_mod.collective_time(c.kind, c.message_bytes, c.group_size, tier)
                             for c in report.collectives if c.dim == dim)
            tiers[dim] = tier.name
    return times, tiers


class CommExplorer(Explorer):
    """Bytes per GPU per step by dimension and collective, and their time on each link tier.

    The toggle "TP across nodes" times the tensor-parallel collectives on the inter-node link instead of
    NVLink, as if the TP group straddled the node boundary: the seed's 7.5 GB per step goes from
    milliseconds to about 150 ms.
    """

    figsize = (9.6, 3.7)

    def __init__(self, model: str = "llama2-7b", seq: int = 4096, dp: int = 1, tp: int = 8, pp: int = 1,
                 cp: int = 1, zero: int = 0, cluster: str = "h100-sxm") -> None:
        c, custom = _model_controls(model)
        c["seq"] = _slider("sequence", SEQS, seq)
        c["micro_batch"] = _slider("micro-batch", (1, 2, 4, 8, 16, 32), 1)
        c["grad_accum"] = _slider("micro-batches", (1, 2, 4, 8, 16, 32, 64, 128), 1 if pp == 1 else 2 * pp)
        c["cluster"] = _dropdown("cluster", CLUSTER_PRESETS, cluster)
        c["dp"] = _slider("dp", DEGREES, dp)
        c["tp"] = _slider("tp", DEGREES[:7], tp)
        c["pp"] = _slider("pp", DEGREES[:8], pp)
        c["cp"] = _slider("cp", DEGREES[:7], cp)
        c["zero"] = _toggles("ZeRO stage", (0, 1, 2, 3), zero, "40px")
        c["sp"] = _checkbox("sequence parallel", False)
        c["cp_kind"] = _dropdown("CP kind", CP_KINDS, "ring")
        c["tp_across_nodes"] = W.ToggleButton(value=False, description="TP group across nodes",
                                              icon="", tooltip="time TP's collectives on the inter-node link",
                                              layout=W.Layout(width="200px"))
        self.table = W.HTML()
        columns = [
            [c["model"], custom, c["cluster"], c["seq"], c["micro_batch"], c["grad_accum"]],
            [c["dp"], c["tp"], c["pp"], c["cp"], c["cp_kind"]],
            [c["sp"], _labelled("ZeRO stage", c["zero"]), c["tp_across_nodes"]],
        ]
        super().__init__(c, columns, extra=(self.table,))

    def compute(self, v: dict[str, Any]) -> dict[str, Any]:
        model = model_from(v)
        cluster = ClusterSpec.preset(v["cluster"])
        plan = Plan(dp=v["dp"], tp=v["tp"], pp=v["pp"], cp=v["cp"], zero=v["zero"], sp=v["sp"],
                    micro_batch=v["micro_batch"], grad_accum=v["grad_accum"], seq=v["seq"],
                    cp_kind=v["cp_kind"]).validate(model, None, cluster)
        rep = comm_mod.report(model, plan, cluster)
        near_t, near_tiers = dict(rep.time_s), dict(rep.tiers)
        far_t, far_tiers = tp_on_tier(rep, cluster.inter)
        across = bool(v["tp_across_nodes"])
        times, tiers = (far_t, far_tiers) if across else (near_t, near_tiers)
        self.verdict = f"{sum(times.values()) * 1e3:.3g} ms"
        return {"model": model, "plan": plan, "cluster": cluster, "report": rep, "across": across,
                "time_s": times, "tiers": tiers, "near_time_s": near_t, "far_time_s": far_t,
                "near_tiers": near_tiers, "far_tiers": far_tiers}

    def make_axes(self, fig: Figure, result: Any) -> Sequence[Axes]:
        return P.comm_axes(fig)

    def draw(self, r: dict[str, Any], axes: list[Axes]) -> None:
        a1, a2 = axes
        rep = r["report"]
        data = {"per_step_bytes": rep.per_step_bytes, "time_s": r["time_s"],
                "collectives": [c.to_json() for c in rep.collectives]}
        labels = {d: tier_label(r["cluster"], t) for d, t in r["tiers"].items()}
        if not rep.per_step_bytes:
            P.draw_message(a1, "no communication: every degree is 1")
            P.draw_message(a2, "")
            return
        P.draw_comm_bytes(a1, data, title="bytes sent per GPU per step")
        P.draw_comm_time(a2, data, labels, title="time per step, alpha-beta" + (" (TP across nodes)"
                                                                                if r["across"] else ""))

    def describe(self, r: dict[str, Any]) -> str:
        rep, cl = r["report"], r["cluster"]
        lines = []
        tp_bytes = sum(rep.per_step_bytes.get(d, 0.0) for d in TP_DIMS)
        if tp_bytes:
            near = sum(r["near_time_s"].get(d, 0.0) for d in TP_DIMS)
            far = sum(r["far_time_s"].get(d, 0.0) for d in TP_DIMS)
            lines.append(_line(
                f"<b>TP</b> sends {P.fmt_bytes(tp_bytes)} per GPU per step: <b>{P.fmt_seconds(near)}</b> on "
                f"{tier_label(cl, cl.intra.name)} inside a node, <b>{P.fmt_seconds(far)}</b> on "
                f"{tier_label(cl, cl.inter.name)} across nodes ({far / near:.1f}x slower)."))
        total = sum(r["time_s"].values())
        per_dim = ", ".join(f"{d} {P.fmt_seconds(t)}" for d, t in r["time_s"].items())
        none = "No communication: every degree is 1."
        lines.append(_line(f"All communication, if none overlapped compute: <b>{P.fmt_seconds(total)}</b> "
                           f"per step ({per_dim})." if r["time_s"] else none))
        self.table.value = collectives_table(rep, r["tiers"], r["time_s"], cl)
        return "".join(lines)


def collectives_table(rep: comm_mod.CommReport, tiers: dict[str, str], times: dict[str, float],
                      cluster: ClusterSpec) -> str:
    """The report's collectives as an HTML table: one row per (dim, kind, message size, group)."""
    if not rep.collectives:
        return ""
    th = "".join(f"<th style='text-align:{a};padding:2px 8px'>{h}</th>" for h, a in (
        ("dim", "left"), ("collective", "left"), ("phase", "left"), ("calls", "right"),
        ("message", "right"), ("group", "right"), ("sent per step", "right"), ("link", "left")))
    rows = []
    for c in rep.collectives:
        cells = (c.dim, c.kind.replace("_", "-"), c.phase, f"{c.count:,}", P.fmt_bytes(c.message_bytes),
                 str(c.group_size), P.fmt_bytes(c.wire_bytes), tier_label(cluster, tiers.get(c.dim, "")))
        rows.append("<tr>" + "".join(
            f"<td style='text-align:{'right' if i in (3, 4, 5, 6) else 'left'};padding:2px 8px'>"
            f"{html.escape(x)}</td>" for i, x in enumerate(cells)) + "</tr>")
    return ("<details><summary>every collective of one GPU in one step "
            f"({len(rep.collectives)} kinds)</summary><table style='border-collapse:collapse;font-size:12px'>"
            f"<tr>{th}</tr>{''.join(rows)}</table></details>")



# --------------------------------------------------------------------------------------------------
# Pipeline
# --------------------------------------------------------------------------------------------------

class PipelineExplorer(Explorer):
    """A pipeline schedule simulated: one row per rank, forward / backward / weight-gradient boxes and the
    idle gaps between them, with the bubble ratio and the peak number of in-flight micro-batches.

    ``measured`` (or :meth:`set_measured`) adds a measured timeline below the simulated one: rows
    ``[rank, start_s, end_s, kind, microbatch, chunk]`` (seconds), the shape of ``parallel-lab bubble
    --json``'s ``timeline``, as the runnable pipeline records them.
    """

    figsize = (9.6, 3.2)

    def __init__(self, schedule: str = "1f1b", stages: int = 4, microbatches: int = 8, interleave: int = 2,
                 measured: Any = None, measured_title: str = "measured") -> None:
        self._measured = measured
        self._measured_title = measured_title
        c: dict[str, W.ValueWidget] = {
            "schedule": _toggles("schedule", SCHEDULES, schedule, "86px"),
            "stages": _int_slider("stages p", 1, 16, stages),
            "microbatches": _int_slider("micro-batches m", 1, 64, microbatches),
            "interleave": _int_slider("interleave v", 1, 4, interleave),
            "f": W.FloatSlider(value=1.0, min=0.25, max=3.0, step=0.25, description="forward f",
                               continuous_update=False, style=DESC, layout=ROW_ITEM),
            "b": W.FloatSlider(value=1.0, min=0.25, max=3.0, step=0.25, description="backward b",
                               continuous_update=False, style=DESC, layout=ROW_ITEM),
            "w": W.FloatSlider(value=1.0, min=0.0, max=3.0, step=0.25, description="weight grad w",
                               continuous_update=False, style=DESC, layout=ROW_ITEM),
            "p2p": W.FloatSlider(value=0.0, min=0.0, max=1.0, step=0.05, description="p2p latency",
                                 continuous_update=False, style=DESC, layout=ROW_ITEM),
        }
        note = W.HTML("<small>costs per micro-batch per model chunk; a backward that is not split costs "
                      "b + w</small>", layout=ROW_ITEM)
        columns = [[c["stages"], c["microbatches"], c["interleave"]], [c["f"], c["b"]],
                   [c["w"], c["p2p"], note]]
        super().__init__(c, columns)
        self.children = (_labelled("schedule", c["schedule"]), *self.children)
        c["schedule"].observe(self._sync_interleave, names="value")
        self._sync_interleave()

    def _sync_interleave(self, _: Any = None) -> None:
        self.widgets["interleave"].disabled = self.widgets["schedule"].value != "interleaved"

    # ---- measured data --------------------------------------------------------------------------
    def set_measured(self, timeline: Any, title: str = "measured") -> None:
        """Show a measured timeline (rows ``[rank, start_s, end_s, kind, microbatch, chunk]``) below the
        simulated one; ``None`` removes it."""
        self._measured, self._measured_title = timeline, title
        self.refresh()

    def compute(self, v: dict[str, Any]) -> dict[str, Any]:
        name = v["schedule"]
        vv = v["interleave"] if name == "interleaved" else 1
        costs = simulate_mod.Costs(f=v["f"], b=v["b"], w=v["w"], p2p=v["p2p"])
        sched = schedules_mod.build_schedule(name, v["stages"], v["microbatches"], vv)
        sim = simulate_mod.simulate(sched, costs)
        formula = (simulate_mod.bubble_formula(name, v["stages"], v["microbatches"], vv, costs)
                   if v["p2p"] == 0 else None)
        measured = P.timeline_rows(self._measured) if self._measured is not None else None
        self.verdict = f"bubble {sim.bubble_ratio:.1%}"
        return {"name": name, "p": v["stages"], "m": v["microbatches"], "v": vv, "costs": costs, "sim": sim,
                "formula": formula, "measured": measured}

    def layout_key(self, r: dict[str, Any]) -> Any:
        mp = len({row[0] for row in r["measured"]}) if r["measured"] else 0
        return (r["p"], mp)

    def make_axes(self, fig: Figure, r: dict[str, Any]) -> Sequence[Axes]:
        p, mp = self.layout_key(r)
        rows = [p] + ([mp] if mp else [])
        title_in, label_in = 0.32, 0.5                       # inches above (title) and below (x label)
        h_in = [0.45 + 0.3 * n for n in rows]
        total = sum(title_in + h + label_in for h in h_in) + 0.05
        fig.set_size_inches(self.figsize[0], total)
        axes, top = [], 1.0
        for h in h_in:
            bottom = top - (title_in + h) / total
            axes.append(fig.add_axes((0.085, bottom, 0.77, h / total)))
            top = bottom - label_in / total
        return axes

    def draw(self, r: dict[str, Any], axes: list[Axes]) -> None:
        sim = r["sim"]
        title = (f"simulated {r['name']}: p={r['p']}, m={r['m']}" + (f", v={r['v']}" if r["v"] > 1 else "")
                 + f"; bubble {sim.bubble_ratio:.1%}")
        # a time axis on round numbers: it stays put (and shows the step growing) while m or p change
        P.draw_timeline(axes[0], sim, title=title, time_unit="time (cost units)", step_time=sim.step_time,
                        sticky=True)
        if r["measured"]:
            P.draw_timeline(axes[1], r["measured"], title=self._measured_title, time_unit="time (ms)",
                            time_scale=1e3)

    def describe(self, r: dict[str, Any]) -> str:
        sim = r["sim"]
        formula = "" if r["formula"] is None else f" (closed form: {r['formula']:.1%})"
        peaks = ", ".join(str(n) for n in sim.peak_inflight)
        lines = [
            _line(f"<b>Bubble ratio {sim.bubble_ratio:.1%}</b>{formula}: idle time over ideal compute time. "
                  f"Idle fraction of the whole step {sim.idle_fraction:.1%}; step time {sim.step_time:g}."),
            _line(f"Peak in-flight (micro-batch, chunk) pairs per rank: [{peaks}]"
                  + (f"; in micro-batches of a whole stage: "
                     f"[{', '.join(f'{x:g}' for x in sim.peak_activation_units)}]" if r["v"] > 1 else "")
                  + ".", "#57606a"),
        ]
        if r["measured"]:
            rows = r["measured"]
            t0 = min(x[1] for x in rows)
            span = max(x[2] for x in rows) - t0
            ranks = {x[0] for x in rows}
            busy = sum(x[2] - x[1] for x in rows)
            idle = 1 - busy / (len(ranks) * span) if span > 0 else 0.0
            lines.append(_line(f"Measured: {len(ranks)} ranks, step {span * 1e3:.3g} ms, idle fraction "
                               f"{idle:.1%} (simulated {sim.idle_fraction:.1%})."))
        return "".join(lines)


# --------------------------------------------------------------------------------------------------
# Planner
# --------------------------------------------------------------------------------------------------

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
        c, custom = _model_controls(model)
        c["cluster"] = _dropdown("cluster", CLUSTER_PRESETS, cluster)
        c["gpus"] = _slider("GPUs", GPU_COUNTS, gpus)
        c["seq"] = _slider("sequence", SEQS, seq)
        c["batch_tokens"] = _dropdown("global batch", BATCH_TOKENS, batch_tokens)
        c["top"] = _int_slider("plans shown", 3, 20, 8)
        c["chosen"] = _int_slider("show plan #", 1, 20, 1)
        self._search_key: Any = None
        self._search: Any = None
        self._shown: dict[int, dict[str, Any]] = {}      # plan index -> its pictures' inputs
        self._schedules: dict[tuple, Any] = {}            # (schedule, p, m, v, b) -> simulated timeline
        self._drawn_timeline: Any = None                  # (simulation, title, axes) on the figure now
        self._empty_search: Any = None
        self.path = W.Text(value=path, description="plan file", style=DESC, layout=W.Layout(width="520px"))
        self.phase = W.Text(value="", placeholder="pretrain-4k", description="phase", style=DESC,
                            layout=ROW_ITEM)
        self.save_button = W.Button(description="save plan file", icon="", button_style="primary",
                                    layout=W.Layout(width="160px"))
        self.save_message = W.HTML()
        self.table = W.HTML()
        self.rejected = W.HTML()
        self.saved_path: Any = None
        self.save_button.on_click(lambda _: self.save())
        columns = [[c["model"], custom, c["cluster"]], [c["gpus"], c["seq"], c["batch_tokens"]],
                   [c["top"], c["chosen"]]]
        save_row = W.HBox([self.path, self.phase, self.save_button], layout=W.Layout(flex_flow="row wrap"))
        super().__init__(c, columns)
        panel, status, image = self.children
        # the ranked table and the rejected families first, then the plan file, then the chosen plan's picture
        self.children = (panel, status, self.table, self.rejected, save_row, self.save_message, image)

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
        from .. import planner

        model, cluster = model_from(v), ClusterSpec.preset(v["cluster"])
        key = (model, cluster, v["gpus"], v["seq"], v["batch_tokens"])
        if key != self._search_key:
            self._search = None                         # free the old result before the new search
            self._shown.clear()
            self._schedules.clear()
            self._search = planner.plan_search(model, cluster, v["gpus"], v["seq"],
                                               global_batch_tokens=v["batch_tokens"])
            self._search_key = key
        return self._search

    def plan_details(self, res: Any, idx: int) -> dict[str, Any]:
        """The ledger, the communication report and the simulated schedule of plan ``idx`` of ``res``
        (kept for the plans of the current search that were shown)."""
        if idx not in self._shown:
            model, cluster, plan = res.model, res.cluster, res.estimates[idx].plan
            sim = None
            if plan.pp > 1 and plan.pp * plan.microbatches * plan.interleave <= MAX_DRAWN_ACTIONS:
                # plans that differ only in tp, cp, dp or ZeRO share their schedule: simulate it once
                b = 2.0 if plan.recompute == "full" else 1.0
                key = (plan.schedule, plan.pp, plan.microbatches, plan.interleave, b)
                if key not in self._schedules:
                    actions = schedules_mod.build_schedule(plan.schedule, plan.pp, plan.microbatches,
                                                           plan.interleave)
                    costs = simulate_mod.Costs(f=1.0, b=b, w=1.0)
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
        if not res.estimates:
            self._empty_search = res                    # its rejected families explain the error
            reasons = ", ".join(f"{REASON_TEXT.get(r, r)} ({n} families)" for r, n in res.rejected.items())
            raise ParallelLabError(f"no plan for {model.name} on {res.gpus} x {cluster.name} at "
                                   f"seq={res.seq} with {v['batch_tokens']} tokens per batch: "
                                   f"{reasons or 'nothing to try'}; "
                                   f"try more GPUs, a larger global batch or a shorter sequence")
        shown = min(v["top"], len(res.estimates))
        idx = min(v["chosen"], shown) - 1
        est = res.estimates[idx]
        plan = est.plan
        self.verdict = P.plan_label(plan)
        return {"result": res, "shown": shown, "index": idx, "estimate": est, "plan": plan, "model": model,
                "cluster": cluster, **self.plan_details(res, idx)}

    def layout_key(self, r: dict[str, Any]) -> Any:
        return r["plan"].pp > 1

    def make_axes(self, fig: Figure, r: dict[str, Any]) -> Sequence[Axes]:
        pipeline = r["plan"].pp > 1
        fig.set_size_inches(self.figsize[0], 6.4 if pipeline else 3.7)
        top_h = 3.7 / (6.4 if pipeline else 3.7)
        gs = fig.add_gridspec(1, 2, width_ratios=(1.0, 1.6), wspace=0.3, left=0.08, right=0.84,
                              bottom=1 - top_h + 0.55 / (6.4 if pipeline else 3.7), top=0.92 if not pipeline
                              else 1 - 0.3 / 6.4)
        axes = [fig.add_subplot(gs[0]), fig.add_subplot(gs[1])]
        if pipeline:
            axes.append(fig.add_axes((0.08, 0.5 / 6.4, 0.76, 1 - top_h - 0.95 / 6.4)))
        return axes

    def draw(self, r: dict[str, Any], axes: list[Axes]) -> None:
        est, plan = r["estimate"], r["plan"]
        P.draw_memory(axes[0], r["ledger"], ["per GPU"], title=f"plan #{r['index'] + 1}: memory")
        P.dynamic_title(axes[0])                        # the plan number changes with every choice
        P.category_legend(self.figure, [c for c in P.CATEGORIES if c in r["ledger"].per_gpu_bytes])
        if r["report"].per_step_bytes:
            P.draw_comm_bytes(axes[1], r["comm"], title="bytes sent per GPU per step")
        else:
            P.draw_message(axes[1], "no communication")
        if plan.pp > 1:
            if r["sim"] is not None:
                title = (f"{plan.schedule}: p={plan.pp}, m={plan.microbatches}"
                         + (f", v={plan.interleave}" if plan.interleave > 1 else "")
                         + f"; bubble {est.bubble_ratio:.1%}")
                if self._drawn_timeline != (r["sim"], title, axes[2]):     # plans often share a schedule
                    P.draw_timeline(axes[2], r["sim"], time_unit="time (F = 1)", step_time=r["sim"].step_time,
                                    title=title)
                    self._drawn_timeline = (r["sim"], title, axes[2])
            else:
                P.draw_message(axes[2], f"{plan.schedule}: p={plan.pp}, m={plan.microbatches}: too many "
                                        f"actions to draw; bubble {est.bubble_ratio:.1%}")
                self._drawn_timeline = None

    def describe(self, r: dict[str, Any]) -> str:
        res, est, plan = r["result"], r["estimate"], r["plan"]
        self.table.value = plans_table(res.estimates[: r["shown"]], r["index"])
        self.rejected.value = rejected_table(res)
        if not self.phase.value:
            self.phase.placeholder = f"pretrain-{plan.seq // 1024}k" if plan.seq >= 1024 else "pretrain"
        head = (f"<b>Plan #{r['index'] + 1} of {len(res.estimates):,}</b> that fit "
                f"({res.candidates:,} candidates in {res.families:,} families, searched in "
                f"{res.elapsed_s * 1e3:.0f} ms): <b>{P.plan_label(plan)}</b>, "
                f"micro-batch {plan.micro_batch} x "
                f"{plan.microbatches} micro-batches; {est.memory_bytes / GB:.1f} GB per GPU "
                f"({est.headroom_bytes / GB:.1f} GB headroom), step {P.fmt_seconds(est.step_time_s)}, "
                f"MFU {est.mfu:.1%}, bubble {est.bubble_ratio:.1%}.")
        return _line(head)

    # ---- plan file ------------------------------------------------------------------------------
    def save(self) -> Any:
        """Save the plan shown as a plan file (``parallel_lab.planfile.save_plan``) at ``self.path.value``;
        the message under the button names the absolute path. Returns that path, or None on an error."""
        from pathlib import Path

        try:
            if self.result is None or self.error is not None:
                raise ParallelLabError("no plan to save: the inputs above are invalid; fix them first")
            from .. import planfile

            r = self.result
            phase = self.phase.value.strip() or self.phase.placeholder or "pretrain"
            target = Path(self.path.value.strip() or "plan.yaml").expanduser()
            planfile.save_plan(target, r["model"], r["cluster"], r["plan"], phase=phase,
                               gpus=r["result"].gpus)
        except ImportError as err:
            err = ParallelLabError(f"plan files are not available in this version of parallel_lab ({err})")
            self.save_message.value = error_html(err)
            return None
        except (ParallelLabError, OSError) as err:
            if not isinstance(err, ParallelLabError):
                err = ParallelLabError(f"cannot write {self.path.value!r}: {err}; pick another path")
            self.save_message.value = error_html(err)
            return None
        self.saved_path = target.resolve()
        where = html.escape(str(self.saved_path))
        label = html.escape(P.plan_label(r["plan"]))
        self.save_message.value = _line(f"Saved plan #{r['index'] + 1} ({label}, phase "
                                        f"{html.escape(phase)}) to <code>{where}</code>", "#1a7f37")
        return self.saved_path


def plans_table(estimates: Sequence[Any], chosen: int) -> str:
    """The ranked plans as an HTML table; the chosen row highlighted."""
    heads = ("#", "tp", "cp", "pp", "dp", "ZeRO", "SP", "micro-batch", "m", "recompute", "schedule",
             "GB/GPU", "step", "MFU", "bubble")
    th = "".join(f"<th style='padding:2px 8px;text-align:right'>{h}</th>" for h in heads)
    rows = []
    for i, e in enumerate(estimates):
        p = e.plan
        sched = (p.schedule + (f" v={p.interleave}" if p.interleave > 1 else "")) if p.pp > 1 else "-"
        cells = (i + 1, p.tp, p.cp, p.pp, p.dp, p.zero, "yes" if p.sp else "", p.micro_batch, p.microbatches,
                 p.recompute, sched, f"{e.memory_bytes / GB:.1f}", P.fmt_seconds(e.step_time_s),
                 f"{e.mfu:.1%}", f"{e.bubble_ratio:.1%}")
        style = " style='background:#fff3c4;font-weight:bold'" if i == chosen else ""
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


# --------------------------------------------------------------------------------------------------
# The app: the four explorers in tabs
# --------------------------------------------------------------------------------------------------

INTROS = {
    "Memory": "Does the plan fit on one GPU? Every byte the ledger counts, stacked against the GPU's "
              "memory, and how ZeRO, sequence length or data parallelism move it.",
    "Communication": "How many bytes each GPU sends per step, in which collectives, and how long they take "
                     "on the link each group lands on; flip the toggle to push tensor parallelism across "
                     "nodes.",
    "Pipeline": "When each pipeline stage works and when it waits: the simulated schedule, its bubble and "
                "the micro-batches each stage keeps in memory.",
    "Planner": "Every way to split a model over a cluster, ranked by estimated step time, with the reason "
               "each rejected family failed; save the best as a plan file.",
}


def _planner_tab() -> W.Widget:
    try:
        from .. import planner  # noqa: F401
    except ImportError as err:                       # the planner module has not landed in this version
        return W.HTML(error_html(ParallelLabError(f"the planner is not available in this version ({err})")))
    return PlannerExplorer()


class App(W.VBox):
    """The Voila app: the four explorers in tabs, one sentence each. ``App().explorers`` maps tab names
    to the explorers (for tests)."""

    def __init__(self) -> None:
        makers: dict[str, Callable[[], W.Widget]] = {
            "Memory": MemoryExplorer, "Communication": CommExplorer, "Pipeline": PipelineExplorer,
            "Planner": _planner_tab,
        }
        self.explorers: dict[str, W.Widget] = {name: make() for name, make in makers.items()}
        intro = '<p class="pl-intro" style="font-size:14px;margin:4px 0 8px">{}</p>'
        pages = [W.VBox([W.HTML(intro.format(INTROS[n])), ex]) for n, ex in self.explorers.items()]
        self.tabs = W.Tab(children=pages, titles=list(self.explorers))
        header = W.HTML("<h2 style='margin:8px 0 2px'>parallel_lab</h2>"
                        "<p style='margin:0 0 8px;color:#57606a'>Predict the memory, the communication and "
                        "the pipeline bubble of a multi-GPU "
                        "training plan; change any input and watch the numbers move.</p>")
        super().__init__([header, self.tabs])
