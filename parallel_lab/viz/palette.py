"""The lab's one visual vocabulary: every colour a picture uses, and what it means.

Each palette below gives one kind of thing its colours: the memory ledger's categories, the parallel
dimensions, ranks (and groups of ranks), pipeline actions (forward, backward, weight gradient),
collectives, link tiers, the parts of a step (compute, bubble, waiting), ZeRO's units, the ring all-reduce's
chunks, curves, and the marks of a verdict (the peak at one moment, a "before" ghost). No hex value appears
in two palettes (:func:`check_disjoint`, run by the tests), so within one figure a colour has one meaning;
:func:`meaning` names it. Predicted values are drawn as outlines (:data:`PREDICTED_EDGE`, white fill),
measured ones filled (:data:`MEASURED`). Neutral colours (:data:`NEUTRALS`: ink, greys, white) carry no
meaning: axes, text, idle time, reference lines.

Why one module: before it, one blue meant parameters, dp, rank 0, forward, compute and expert rank 0,
and the Planner's step bar drew "compute" and "exposed dp" alike.
"""

from __future__ import annotations

from collections.abc import Mapping

#: The ledger's categories (docs/conventions.md), in stacking order.
CATEGORY_COLORS: dict[str, str] = {
    "parameters": "#4c72b0", "gradients": "#55a868", "optimizer_states": "#8172b2",
    "activations": "#dd8452", "logits_and_loss": "#c44e52", "comm_buffers": "#937860",
}
#: Parallel dimensions.
DIM_COLORS: dict[str, str] = {
    "dp": "#1b9e77", "tp": "#e7298a", "tp_vocab": "#f4a6c9", "pp": "#a6761d", "cp": "#e6ab02", "ep": "#5e3c99",
}
#: Ranks (cycled): rank r is RANK_COLORS[r % 16].
RANK_COLORS: tuple[str, ...] = (
    "#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f",
    "#bcbd22", "#17becf", "#aec7e8", "#ffbb78", "#98df8a", "#ff9896", "#c5b0d5", "#c49c94",
)
#: Groups of ranks along one dimension (the Grid tab), cycled.
GROUP_COLORS: tuple[str, ...] = ("#a6cee3", "#b2df8a", "#fdbf6f", "#cab2d6", "#fb9a99", "#ffff99", "#1f78b4",
                                 "#33a02c", "#ff7f00", "#6a3d9a", "#e31a1c", "#b15928")
#: Pipeline actions: forward, backward (or backward-for-input), backward-for-weights, other.
KIND_COLORS: dict[str, str] = {"F": "#80b1d3", "B": "#fb8072", "W": "#bebada", "other": "#d9d9d9"}
KIND_LABELS: dict[str, str] = {"F": "forward", "B": "backward", "W": "weight grad", "other": "other"}
#: Collective kinds.
COLLECTIVE_COLORS: dict[str, str] = {
    "all_reduce": "#2a9d8f", "all_gather": "#e9c46a", "reduce_scatter": "#577590",
    "all_to_all": "#264653", "send": "#f28482", "recv": "#f5cac3", "broadcast": "#b5838d",
}
#: Link tiers, in the order a chart meets them (intra-node first).
TIER_COLORS: tuple[str, ...] = ("#023e8a", "#9d0208", "#588157", "#6d597a")
#: The parts of a step's time: compute, the pipeline bubble, the optimizer step, waiting on peers.
STEP_COLORS: dict[str, str] = {"compute": "#495057", "bubble": "#ced4da", "step": "#ffd43b",
                               "wait": "#ff922b"}
#: ZeRO unit choices (the gathered-parameters curves).
UNIT_COLORS: dict[str, str] = {"block": "#0077b6", "root": "#c1121f"}
#: The ring all-reduce's cells: a partial sum, a complete one, and the chunk sent at this step (outline).
RING_COLORS: dict[str, str] = {"partial": "#48cae4", "complete": "#2b9348", "sent": "#d00000"}
#: Curves of one chart (loss of one run, of another...), cycled.
CURVE_COLORS: tuple[str, ...] = ("#003f5c", "#bc5090", "#ffa600", "#58508d", "#ff6361")
#: Marks of a verdict: the peak at one moment above the categories' sum; a group crossing nodes.
MARK_COLORS: dict[str, str] = {"peak": "#3a0ca3", "crossing": "#ff006e", "operator": "#9a6700",
                               "operator_fill": "#fff8c5"}
#: Predicted (outline, white fill) vs measured (filled).
PREDICTED_EDGE = "#1f2328"
MEASURED = "#e76f51"
MEASURE_COLORS: dict[str, str] = {"measured": MEASURED}

#: Colours without a meaning: ink, greys, white, the highlight band.
INK, MUTED, GHOST, IDLE, IDLE_EDGE, HIGHLIGHT = "#1f2328", "#57606a", "#8c959f", "#f2f2f2", "#c8c8c8", "#ffe9a8"
NEUTRALS: frozenset[str] = frozenset({INK, MUTED, GHOST, IDLE, IDLE_EDGE, HIGHLIGHT, "#ffffff", "#000000",
                                      "#888888", "#999999", "#bbbbbb", "#dddddd", "#eeeeee", "#cccccc"})
#: HTML status colours (text, not figures): good news, bad news, a warning; an error box's text, fill and
#: edge; a link; the chosen row of a table. Explorers write no other colour in their HTML (tests/viz).
OK, BAD, WARN = "#1a7f37", "#b00020", "#9a6700"
ERROR_TEXT, ERROR_FILL, ERROR_EDGE, LINK, CHOSEN_ROW = "#9b1c1c", "#fdecea", "#d93025", "#0969da", "#fff3c4"
HTML_COLORS: frozenset[str] = frozenset({OK, BAD, WARN, ERROR_TEXT, ERROR_FILL, ERROR_EDGE, LINK, CHOSEN_ROW})

PALETTES: dict[str, Mapping[str, str]] = {
    "category": CATEGORY_COLORS, "dim": DIM_COLORS,
    "rank": {f"rank {i}": c for i, c in enumerate(RANK_COLORS)},
    "group": {f"group {i}": c for i, c in enumerate(GROUP_COLORS)},
    "kind": KIND_COLORS, "collective": COLLECTIVE_COLORS,
    "tier": {f"tier {i}": c for i, c in enumerate(TIER_COLORS)},
    "step": STEP_COLORS, "unit": UNIT_COLORS, "ring": RING_COLORS,
    "curve": {f"curve {i}": c for i, c in enumerate(CURVE_COLORS)},
    "mark": MARK_COLORS, "measure": MEASURE_COLORS,
}


def check_disjoint() -> dict[str, str]:
    """``{hex: "palette:name"}`` over every palette; raises ``ValueError`` naming a colour in two palettes
    or a palette colour that is also neutral."""
    out: dict[str, str] = {}
    for pal, colors in PALETTES.items():
        for name, c in colors.items():
            c = c.lower()
            if c in NEUTRALS or (c in out and not out[c].startswith(pal + ":")):
                raise ValueError(f"colour {c} means both {out.get(c, 'neutral')} and {pal}:{name}")
            out[c] = f"{pal}:{name}"
    return out


#: hex (lower case) -> ``"palette:name"``
MEANINGS: dict[str, str] = check_disjoint()


def meaning(color: str) -> str | None:
    """What ``color`` (a hex string) means in the lab's pictures, e.g. ``"dim:dp"``; None if neutral/unknown."""
    return MEANINGS.get(color.lower())


def rank_color(r: int) -> str:
    return RANK_COLORS[r % len(RANK_COLORS)]


def _luminance(color: str, alpha: float = 1.0) -> float:
    from matplotlib.colors import to_rgb

    def lin(c: float) -> float:
        c = c * alpha + 1 - alpha                            # over white
        return c / 12.92 if c <= 0.03928 else ((c + 0.055) / 1.055) ** 2.4
    r, g, b = (lin(c) for c in to_rgb(color))
    return 0.2126 * r + 0.7152 * g + 0.0722 * b


def text_on(fill: str, alpha: float = 1.0) -> str:
    """The text colour readable on ``fill`` (drawn with ``alpha`` over white): ink or white, whichever
    contrasts more (WCAG's luminance ratio)."""
    lum = _luminance(fill, alpha)
    return INK if (lum + 0.05) / (_luminance(INK) + 0.05) >= 1.05 / (lum + 0.05) else "#ffffff"
