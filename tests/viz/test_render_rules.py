"""Every explorer's picture over a grid of learner settings, checked against the layout rules a learner
sees broken: no two texts overlap, no text is crossed by a reference line (``axhline`` / ``axvline``), no
text under 8 pt, no text cut at the figure's edge, no text hard to read on the fill under it (contrast
under 3:1), and no colour with two meanings in one figure (two legend labels for one colour, unless both
name the colour's palette meaning), no colour drawn without a legend entry (itself or lightened, as later
pipeline chunks) or a text naming it (its palette meaning, or a caption "colour: <palette>" such as
"colour = rank"; neutral greys are exempt, so the legends of grey marks are checked by eye), and no status
HTML colour outside the palette.
Text extents come from the Agg renderer after a full draw. One explorer per tab is reused for all its
settings (as in the app).

Also: the Memory verdict's number is drawn for every Memory setting (inside the axis), the "TP group
across nodes" toggle and the Experts' skew keep their axis and write their ratio, plot modules take their
colours from ``viz.palette``, which has no hex value in two palettes.
"""

from __future__ import annotations

import itertools
from typing import Any

import pytest
from matplotlib.colors import to_hex
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.patches import Patch, Rectangle
from matplotlib.text import Text

from parallel_lab.viz import palette
from parallel_lab.viz.explorers.comm import CommExplorer
from parallel_lab.viz.explorers.grid import GridExplorer
from parallel_lab.viz.explorers.memory import MemoryExplorer
from parallel_lab.viz.explorers.pipeline import PipelineExplorer
from parallel_lab.viz.explorers.planner import PlannerExplorer
from parallel_lab.viz.explorers.ring import RingExplorer
from parallel_lab.viz.explorers.routing import RoutingExplorer
from parallel_lab.viz.explorers.run import RunExplorer
from parallel_lab.viz.explorers.tp import TPExplorer
from parallel_lab.viz.explorers.zero import ZeroExplorer
from parallel_lab.viz.plots.memory import need_text

MIN_PT = 8.0
SLACK = 1.0                       # pixels: boxes that only touch do not overlap

#: (explorer, settings) for every tab drawn from widgets alone: presets, sweeps, stages, extreme degrees.
SETTINGS: dict[type, list[dict[str, Any]]] = {
    MemoryExplorer: [
        {}, {"sweep": "sequence"}, {"sweep": "dp"},
        {"model": "tiny-llama", "tp": 2, "recompute": "selective", "sweep": "ZeRO stage"},
        {"model": "tiny-llama", "tp": 2, "recompute": "selective", "sweep": "dp"},
        {"model": "llama2-7b", "zero": 3, "dp": 64, "gpus": 64},
        {"model": "llama2-70b", "tp": 8, "pp": 4, "dp": 2, "grad_accum": 8, "sweep": "ZeRO stage"},
        {"model": "llama3-405b", "tp": 8, "pp": 16, "dp": 8, "grad_accum": 32, "zero": 1, "recompute": "full"},
        {"model": "gpt3-175b", "tp": 8, "pp": 8, "dp": 16, "zero": 1, "grad_accum": 16, "seq": 2048,
         "sweep": "dp"},
        {"model": "llama2-7b", "dp": 1024, "zero": 3, "gpus": 1024, "sweep": "dp"},
        {"model": "llama2-7b", "cp": 4, "seq": 65536, "dp": 2, "sweep": "sequence"},
        {"model": "tiny-gpt", "seq": 512, "dp": 2, "zero": 2},
        {"model": "megatron-1t", "tp": 8, "pp": 64, "dp": 2, "grad_accum": 128, "seq": 2048, "sweep": "dp"},
    ],
    CommExplorer: [
        {}, {"tp_across_nodes": True}, {"dp": 8, "tp": 8, "pp": 2, "grad_accum": 4},
        {"dp": 64, "tp": 1, "zero": 3}, {"dp": 2, "tp": 4, "cp": 4, "seq": 32768, "tp_across_nodes": True},
        {"model": "tiny-llama", "dp": 2, "tp": 2, "tp_across_nodes": False}, {"dp": 1, "tp": 1},
    ],
    ZeroExplorer: [
        {"zero": 3}, {"zero": 2}, {"zero": 1}, {"zero": 0}, {"dp": 16, "zero": 3},
        {"zero_unit": "root", "dp": 2}, {"model": "tiny-llama", "dp": 8, "zero": 2},
    ],
    TPExplorer: [{}, {"tp": 8, "sp": True, "ring_step": 7}, {"tp": 2, "ring_step": 1}, {"tp": 1},
                 {"model": "tiny-llama", "tp": 4, "ring_step": 3}],
    PipelineExplorer: [{}, {"schedule": "gpipe", "stages": 8, "microbatches": 64},
                       {"stages": 16, "microbatches": 64, "interleave": 4}, {"stages": 1},
                       # many micro-batches: the step's start and end side by side, not a moire of stripes
                       {"schedule": "1f1b", "stages": 8, "microbatches": 128},
                       {"schedule": "interleaved", "stages": 4, "microbatches": 128, "interleave": 2},
                       {"schedule": "interleaved", "stages": 8, "microbatches": 64, "interleave": 4},
                       {"schedule": "zb-h1", "stages": 4, "microbatches": 25}],
    RingExplorer: [{}, {"cp": 8, "step": 8, "balance": "contiguous"}, {"cp": 2, "step": 2}],
    GridExplorer: [{}, {"dp": 4, "tp": 8, "pp": 2, "cp": 2}, {"dp": 1, "tp": 1, "pp": 1, "cp": 1}],
    RoutingExplorer: [{}, {"skew": 2.0}, {"model": "deepseekmoe-16b", "ep": 8, "skew": 1.5},
                      {"model": "tiny-moe", "ep": 1, "skew": 0.0, "capacity_factor": 4.0}],
    RunExplorer: [{}, {"pp": 1, "dp": 4, "zero": 3}],
    # the default's best plan has pp=2, m=128: the timeline's start and end side by side; small searches
    # (under 1 s each) cover a plan without a pipeline, another plan chosen, and a pipeline drawn whole
    PlannerExplorer: [{}, {"gpus": 8}, {"gpus": 8, "chosen": 3, "top": 3},
                      {"model": "tiny-llama", "gpus": 64}],
}
CASES = [(cls, s) for cls, ss in SETTINGS.items() for s in ss]


def test_the_grid_has_forty_settings_or_more_across_the_tabs():
    assert len(CASES) >= 40 and len(SETTINGS) >= 8


# --------------------------------------------------------------------------------------------------
# the rules, read from a drawn figure
# --------------------------------------------------------------------------------------------------

def _candidate_texts(fig: Figure) -> list[Text]:
    """The texts a draw puts on the canvas: axes texts, titles, axis labels, the tick labels drawn (within
    the view), legends' texts and titles, figure texts and legends."""
    out: list[Text] = list(fig.texts)
    legends = list(fig.legends)
    for ax in fig.axes:
        if not ax.get_visible():
            continue
        out += [*ax.texts, ax.title, ax._left_title, ax._right_title]
        for axis in (ax.xaxis, ax.yaxis):
            if ax.axison:
                out.append(axis.label)
                out += [tick.label1 for tick in axis._update_ticks() if tick.get_visible()]
        if ax.get_legend() is not None:
            legends.append(ax.get_legend())
    for leg in legends:
        if leg.get_visible():
            out += [*leg.get_texts(), leg.get_title()]
    return out


def _texts(fig: Figure, renderer: Any) -> list[tuple[Text, Any]]:
    """Visible, non-empty texts with their window extents (clipped texts outside their axes left out)."""
    out = []
    legends = [ax.get_legend() for ax in fig.axes if ax.get_legend() is not None] + list(fig.legends)
    in_legends = {id(t) for leg in legends for t in [*leg.get_texts(), leg.get_title()]}
    for t in _candidate_texts(fig):
        if not t.get_visible() or not t.get_text().strip() or t.get_gid() == "current-label":
            continue
        box = t.get_window_extent(renderer)
        ax = t.axes
        if ax is not None and t.get_clip_on() and not ax.bbox.overlaps(box) and id(t) not in in_legends:
            continue
        out.append((t, box))
    return out


def _reference_lines(fig: Figure, renderer: Any) -> list[tuple[str, float, float, float]]:
    """(orientation, position, start, end) in pixels of every visible axhline/axvline-like line: a line
    thinner than 1.5 px across at least half its axes."""
    out = []
    for ax in fig.axes:
        for ln in ax.lines:
            if not ln.get_visible() or len(ln.get_xdata()) != 2:
                continue
            b = ln.get_window_extent(renderer)
            if b.height < 1.5 and b.width > 0.5 * ax.bbox.width:
                out.append(("h", b.y0, b.x0, b.x1))
            elif b.width < 1.5 and b.height > 0.5 * ax.bbox.height:
                out.append(("v", b.x0, b.y0, b.y1))
    return out


def _legend_colours(fig: Figure) -> dict[str, set[str]]:
    """hex colour -> the legend labels it stands for, over every legend of ``fig``."""
    out: dict[str, set[str]] = {}
    legends = [ax.get_legend() for ax in fig.axes if ax.get_legend() is not None] + list(fig.legends)
    for leg in legends:
        for handle, text in zip(leg.legend_handles, leg.get_texts(), strict=False):
            if isinstance(handle, Patch):
                fc = handle.get_facecolor()
                color = handle.get_edgecolor() if fc[3] == 0 or to_hex(fc) == "#ffffff" else fc
            elif isinstance(handle, Line2D):
                color = handle.get_color()
            else:
                continue
            out.setdefault(to_hex(color), set()).add(text.get_text())
    return out


def _legend_marks(fig: Figure) -> set[str]:
    """Every face and edge colour of every legend handle of ``fig`` (hex)."""
    out: set[str] = set()
    legends = [ax.get_legend() for ax in fig.axes if ax.get_legend() is not None] + list(fig.legends)
    for leg in legends:
        for handle in leg.legend_handles:
            if isinstance(handle, Patch):
                out |= {to_hex(handle.get_facecolor()), to_hex(handle.get_edgecolor())}
            elif isinstance(handle, Line2D):
                out |= {to_hex(handle.get_color()), to_hex(handle.get_markerfacecolor())}
    return out


def _lighter_of(color: str, base: str) -> bool:
    """``color`` is ``base`` lightened towards white (``plots.base.lighten``), e.g. a later pipeline chunk."""
    from matplotlib.colors import to_rgb

    c, b = to_rgb(color), to_rgb(base)
    i = min(range(3), key=lambda k: b[k])                 # the channel farthest from white fixes the amount
    t = (c[i] - b[i]) / (1 - b[i]) if b[i] < 0.99 else 0.0
    return 0 <= t <= 1 and all(abs(b[k] + (1 - b[k]) * t - c[k]) < 2.5 / 255 for k in range(3))


def _marks(fig: Figure) -> set[str]:
    """The non-neutral colours of the visible patches and collections of ``fig``: fills and outlines (an
    outline counts where it is drawn, linewidth > 0)."""
    from matplotlib.collections import Collection

    out: set[str] = set()
    for ax in fig.axes:
        if not ax.get_visible():
            continue
        for art in [*ax.patches, *ax.collections]:
            if not art.get_visible():
                continue
            if isinstance(art, Collection):
                faces = list(art.get_facecolors())
                edges = list(art.get_edgecolors()) if max(art.get_linewidths(), default=0) > 0 else []
            else:
                faces = [art.get_facecolor()] if art.get_fill() else []
                edges = [art.get_edgecolor()] if art.get_linewidth() > 0 else []
            out |= {to_hex(c) for c in [*faces, *edges] if c[3] > 0}
    return {c for c in out if c not in palette.NEUTRALS}


def unexplained_marks(fig: Figure) -> list[str]:
    """Colours drawn in ``fig`` that neither a legend handle shows (itself, or lightened) nor a text of the
    figure names (the colour's palette meaning, e.g. "partial" for the ring's partial sums)."""
    shown = _legend_marks(fig)
    words = "\n".join(t.get_text() for ax in fig.axes for t in [*ax.texts, ax.title, ax.xaxis.label,
                                                                  ax.yaxis.label]) + "\n".join(
        t.get_text() for t in fig.texts)
    captions = [t for t in words.split("\n") if "colour" in t]
    out = []
    for c in sorted(_marks(fig)):
        family, name = (palette.meaning(c) or ":").split(":", 1)
        name = name.replace("_", " ").split(" ")[0]        # "operator fill": named by "operator"
        if c in shown or any(_lighter_of(c, s) for s in shown) or (name and name in words):
            continue
        if family and any(family in t for t in captions):      # "colour = rank", "colour: tp groups"
            continue
        out.append(f"colour {c} ({palette.meaning(c) or 'no meaning'}) has no legend entry or caption")
    return out


MIN_CONTRAST = 3.0                  # WCAG's large-text ratio: 8-10 pt bold-ish labels on a fill


def _luminance(rgb: Any) -> float:
    def lin(c: float) -> float:
        return c / 12.92 if c <= 0.03928 else ((c + 0.055) / 1.055) ** 2.4
    r, g, b = (lin(c) for c in rgb[:3])
    return 0.2126 * r + 0.7152 * g + 0.0722 * b


def _on_fill(fig: Figure, renderer: Any, texts: list[tuple[Text, Any]]) -> list[str]:
    """Texts without a box of their own, centred on a filled patch, whose colour contrasts less than
    :data:`MIN_CONTRAST` with the fill (alpha blended on white)."""
    from matplotlib.colors import to_rgba
    from matplotlib.patches import Rectangle

    patches = [p for ax in fig.axes for p in ax.patches
               if isinstance(p, Rectangle) and p.get_visible() and p.get_fill() and p.get_facecolor()[3] > 0]
    out = []
    for t, box in texts:
        if t.get_bbox_patch() is not None:
            continue
        cx, cy = (box.x0 + box.x1) / 2, (box.y0 + box.y1) / 2
        under = [p for p in patches if p.axes is t.axes and p.get_window_extent(renderer).contains(cx, cy)]
        if not under:
            continue
        r, g, b, a = under[-1].get_facecolor()
        fill = (r * a + 1 - a, g * a + 1 - a, b * a + 1 - a)
        lo, hi = sorted((_luminance(fill), _luminance(to_rgba(t.get_color()))))
        if (hi + 0.05) / (lo + 0.05) < MIN_CONTRAST:
            out.append(f"{t.get_text()!r} is hard to read on its fill ({(hi + 0.05) / (lo + 0.05):.1f}:1)")
    return out


def layout_problems(fig: Figure) -> list[str]:
    """What breaks the rules in ``fig`` (empty when it keeps them)."""
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    texts = _texts(fig, renderer)
    problems = [f"{t.get_text()!r} is {t.get_fontsize():.1f} pt" for t, _ in texts if t.get_fontsize() < MIN_PT - 1e-6]
    for (a, ba), (b, bb) in itertools.combinations(texts, 2):
        w = min(ba.x1, bb.x1) - max(ba.x0, bb.x0)
        h = min(ba.y1, bb.y1) - max(ba.y0, bb.y0)
        if w > SLACK and h > SLACK:
            problems.append(f"{a.get_text()!r} overlaps {b.get_text()!r}")
    for kind, pos, lo, hi in _reference_lines(fig, renderer):
        for t, box in texts:
            if kind == "h" and box.y0 + SLACK < pos < box.y1 - SLACK and box.x1 > lo and box.x0 < hi:
                problems.append(f"{t.get_text()!r} is crossed by a horizontal reference line")
            if kind == "v" and box.x0 + SLACK < pos < box.x1 - SLACK and box.y1 > lo and box.y0 < hi:
                problems.append(f"{t.get_text()!r} is crossed by a vertical reference line")
    problems += _on_fill(fig, renderer, texts)
    width, height = fig.bbox.width, fig.bbox.height
    problems += [f"{t.get_text()!r} is cut at the figure's edge" for t, box in texts
                 if box.x0 < 0 or box.y0 < 0 or box.x1 > width or box.y1 > height]
    for color, labels in _legend_colours(fig).items():
        name = (palette.meaning(color) or ":").split(":", 1)[1].replace("_", " ")
        if len(labels) > 1 and not (name and all(name in x for x in labels)):     # "activations (grow like s)"
            problems.append(f"colour {color} means {sorted(labels)} in one figure")
    return problems


@pytest.fixture(scope="module")
def explorers() -> dict[type, Any]:
    return {}


def shown(explorers: dict[type, Any], cls: type, settings: dict[str, Any]) -> Any:
    """The tab's one explorer (built once) set to its defaults overridden by ``settings``."""
    if cls not in explorers:
        ex = cls()
        explorers[cls] = (ex, ex.values())
    ex, defaults = explorers[cls]
    return ex.set(**{**defaults, **settings})


@pytest.mark.parametrize("cls,settings", CASES, ids=[f"{c.__name__}-{i}" for i, (c, _) in enumerate(CASES)])
def test_every_picture_keeps_the_layout_rules(cls, settings, explorers):
    ex = shown(explorers, cls, settings)
    assert ex.error is None, f"{cls.__name__}({settings}): {ex.error}"
    if cls is MemoryExplorer:
        check_memory_verdict(ex)
    problems = layout_problems(ex.figure) + unexplained_marks(ex.figure) + unpalette_html(ex.status.value)
    assert not problems, f"{cls.__name__}({settings}): " + "; ".join(problems)


def unpalette_html(markup: str) -> list[str]:
    """Hex colours in an explorer's status HTML that are not the palette's (its HTML status colours, its
    neutrals, or a meaning's colour, e.g. the Planner's step breakdown)."""
    import re

    allowed = palette.HTML_COLORS | palette.NEUTRALS | set(palette.MEANINGS)
    return [f"status HTML colour {h} is not the palette's" for h in re.findall(r"#[0-9a-fA-F]{6}\b", markup)
            if h.lower() not in allowed]


def test_explorers_write_no_colour_of_their_own():
    """The explorers' HTML (status lines, tables, error boxes) names no hex colour: each comes from
    ``viz.palette`` (``OK``, ``BAD``, ``WARN``, ``MUTED``...), so a status colour means one thing."""
    import re
    from pathlib import Path

    import parallel_lab.viz.explorers as explorers

    found = {f"{p.name}: {h}" for p in Path(explorers.__file__).parent.glob("*.py")
             for h in re.findall(r"(?<!&)#[0-9a-fA-F]{3}(?:[0-9a-fA-F]{3})?\b", p.read_text())}
    assert not found, sorted(found)
    assert unpalette_html('<div style="color:#123456">x</div>')
    assert not unpalette_html(f"<b style='color:{palette.OK}'>")


def test_the_rules_catch_what_they_are_for():
    """The checker fails a figure with overlapping texts, a text on a reference line, a small text and one
    colour under two labels: a test that cannot fail checks nothing."""
    from parallel_lab.viz.plots.base import new_figure

    fig = new_figure((4, 3))
    ax = fig.add_subplot()
    ax.set_ylim(0, 1)
    ax.text(0.5, 0.5, "one", fontsize=9)
    ax.text(0.5, 0.5, "two", fontsize=9)
    ax.axhline(0.21)
    ax.text(0.1, 0.2, "on the line", fontsize=9)
    ax.text(0.1, 0.8, "tiny", fontsize=6)
    ax.legend(handles=[Patch(color="#1b9e77", label="dp"), Patch(color="#1b9e77", label="compute")])
    ax.add_patch(Rectangle((0.6, 0.05), 0.3, 0.12, facecolor="#ffff99"))
    ax.text(0.75, 0.11, "pale", ha="center", va="center", color="white", fontsize=9)
    ax.add_patch(Rectangle((0.1, 0.3), 0.1, 0.1, facecolor=palette.DIM_COLORS["tp"]))
    assert "colour #e7298a (dim:tp) has no legend entry or caption" in unexplained_marks(fig)
    found = " | ".join(layout_problems(fig))
    assert "'one' overlaps 'two'" in found and "crossed by a horizontal" in found
    assert "'tiny' is 6.0 pt" in found and "colour #1b9e77 means" in found
    assert "'pale' is hard to read on its fill" in found
    ax.text(0.9, 0.5, "a caption that runs off the right edge of the figure", fontsize=9)
    assert "is cut at the figure's edge" in " | ".join(layout_problems(fig))


# --------------------------------------------------------------------------------------------------
# what the pictures must show
# --------------------------------------------------------------------------------------------------

def test_palette_has_one_meaning_per_colour():
    meanings = palette.check_disjoint()
    assert meanings["#4c72b0"] == "category:parameters" and palette.meaning("#1B9E77") == "dim:dp"
    assert len({palette.DIM_COLORS["dp"], palette.STEP_COLORS["compute"], palette.RANK_COLORS[0],
                palette.KIND_COLORS["F"], palette.CATEGORY_COLORS["parameters"]}) == 5
    from parallel_lab.viz.explorers.planner import BREAKDOWN_COLORS

    assert len(set(BREAKDOWN_COLORS.values())) == len(BREAKDOWN_COLORS)      # compute is not exposed dp's blue
    palette.PALETTES["probe"] = {"dp again": palette.DIM_COLORS["dp"]}
    try:
        with pytest.raises(ValueError, match="means both dim:dp and probe:dp again"):
            palette.check_disjoint()
    finally:
        del palette.PALETTES["probe"]


def test_plots_take_their_colours_from_the_palette():
    """No hex colour is written in a plot module unless it is one of the palette's neutral greys: a meaning
    needs the palette's colour (a new hard-coded blue would mean two things again)."""
    import re
    from pathlib import Path

    import parallel_lab.viz.plots as plots

    found = {f"{p.name}: {h}" for p in Path(plots.__file__).parent.glob("*.py")
             for h in re.findall(r"[\"'](#[0-9a-fA-F]{6})[\"']", p.read_text()) if h.lower() not in palette.NEUTRALS}
    assert not found, sorted(found)


def check_memory_verdict(ex: MemoryExplorer) -> None:
    """The verdict's bytes, rounded as the status line rounds them, are written on the per-GPU bar and lie
    inside the axis; where the peak at one moment decides, the hatched segment reaches it."""
    led, ax = ex.result["ledger"], ex.figure.axes[0]
    want = need_text(led.need_bytes)
    assert want in ex.status.value
    assert want in [t.get_text() for t in ax.texts if t.get_visible()]
    needs = [s.need_bytes for s in ex.result["stage_ledgers"]]
    assert ax.get_ylim()[1] >= max(needs)                        # bytes on the axis
    if led.peak_decides:
        seg = [p for p in ax.patches if p.get_gid() == "peak" and p.get_visible()]
        assert seg and max(p.get_y() + p.get_height() for p in seg) == pytest.approx(max(needs), rel=1e-9)


def test_tp_across_nodes_keeps_the_axis_and_writes_the_ratio():
    ex = CommExplorer()
    ax = ex.figure.axes[1]
    before = ax.get_xlim()
    near = sum(ex.result["near_time_s"][d] for d in ("tp",))
    ex.set(tp_across_nodes=True)
    far = sum(ex.result["far_time_s"][d] for d in ("tp",))
    assert ax.get_xlim() == before                               # the bars move, the axis stays
    shown = [t.get_text() for t in ax.texts if t.get_visible()]
    assert any(f"x{far / near:.3g}" in s for s in shown), shown
    ghosts = [p for p in ax.patches if p.get_gid() == "ghost:tp" and p.get_visible()]
    assert ghosts and ghosts[0].get_width() == pytest.approx(near)


def test_a_skew_change_keeps_the_experts_axis_and_shows_the_load_before():
    ex = RoutingExplorer(skew=0.0)
    ax = ex.figure.axes[0]
    top = ax.get_ylim()
    balanced = list(ex.result["load"].routed)
    ex.set(skew=1.5)
    assert ax.get_ylim() == top                                   # the bars grow against the same axis
    ghost = [p for p in ax.patches if p.get_gid() == "ghost"]
    assert [p.get_height() for p in ghost] == balanced
    routed = ex.result["load"].routed
    busiest = max(range(len(routed)), key=lambda e: routed[e])
    ratio = [t.get_text() for t in ax.texts if t.get_gid() == "ratio"]
    assert ratio == [f"x{routed[busiest] / balanced[busiest]:.3g}"]
