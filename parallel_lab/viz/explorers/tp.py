"""The tensor-parallel explorer: how a block's weights split over ``tp`` ranks, where ``f`` and ``g`` sit,
what each of their collectives carries, and a ring all-reduce as a reduce-scatter plus an all-gather.

Left: attention (the fused ``wq, wk, wv`` column-parallel, ``wo`` row-parallel) and the MLP (``gate, up``
or ``fc`` column-parallel, ``down`` or ``proj`` row-parallel), each weight cut into the slices the ranks
hold; what one rank holds comes from ``parallel_lab.sharding`` (heads, key/value heads and their
replication when ``tp > kv_heads``, the MLP width). Right: the ring all-reduce of one ``g`` (the partial
outputs, ``s b h`` elements) step by step (:func:`~parallel_lab.viz.plots.tp.ring_allreduce_states`).
The status lists one block's TP calls for one micro-batch, ``comm.tp_layer_collectives``, with each
call's message and the bytes one rank sends, ``2 (n - 1) / n * M`` for an all-reduce.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from matplotlib.axes import Axes
from matplotlib.figure import Figure

from ... import comm as comm_mod
from ...quantities import fmt_bytes
from ...sharding import check_tp, kv_heads_local, kv_replicas
from ...specs import ModelSpec, Plan
from ..palette import MUTED
from ..plots.base import draw_message, two_panels
from ..plots.tp import Split, draw_ring_allreduce, draw_tp_block
from .base import Explorer, fresh, int_slider, labelled, model_controls, model_from, slider, status_line, toggles


def block_splits(model: ModelSpec, tp: int) -> tuple[list[Split], list[Split]]:
    """The linears of one block as (attention, MLP) :class:`Split` lists: full (in, out) and one rank's share."""
    check_tp(model, tp)
    h, d = model.hidden, model.head_dim
    kv_local = kv_heads_local(model, tp)
    rep = kv_replicas(model, tp)
    kv_note = f", {kv_local} kv head{'s' if kv_local > 1 else ''}" + (f" (each on {rep} ranks)" if rep > 1 else "")
    qkv = Split("wq, wk, wv", "column", (h, (model.heads + 2 * model.kv_heads) * d),
                f"rank: {model.heads // tp} of {model.heads} heads{kv_note}")
    wo = Split("wo", "row", (model.heads * d, h), f"rank: {model.heads // tp * d:,} input rows")
    first, second = ("gate, up", "down") if model.flavour == "llama" else ("fc", "proj")
    fan = 2 if model.flavour == "llama" else 1
    up = Split(first, "column", (h, fan * model.ffn), f"rank: {model.ffn // tp:,} of {model.ffn:,} columns"
               + (" each" if fan > 1 else ""))
    down = Split(second, "row", (model.ffn, h), f"rank: {model.ffn // tp:,} input rows")
    return [qkv, wo], [up, down]


class TPExplorer(Explorer):
    """Megatron tensor parallelism in one block, and the ring all-reduce its ``g`` operator runs."""

    figsize = (9.6, 4.3)

    def __init__(self, model: str = "llama2-7b", tp: int = 4, sp: bool = False, seq: int = 4096,
                 micro_batch: int = 1, ring_step: int = 0) -> None:
        c, custom = model_controls(model)
        c["tp"] = slider("tp", (1, 2, 4, 8), tp)
        c["seq"] = slider("sequence", (512, 1024, 2048, 4096, 8192), seq)
        c["micro_batch"] = slider("micro-batch", (1, 2, 4, 8), micro_batch)
        c["sp"] = toggles("sequence parallel", (False, True), sp, "64px")
        c["sp"].options = [("off", False), ("on", True)]
        c["sp"].value = sp
        c["ring_step"] = int_slider("all-reduce step", 0, comm_mod.ring_steps("all_reduce", tp), ring_step)
        super().__init__(c, [[c["model"], custom], [c["tp"], c["seq"]], [c["micro_batch"], c["ring_step"]]])
        self.children = (self.children[0], labelled("sequence parallel", c["sp"]), *self.children[1:])

    def _on_change(self, change: dict[str, Any]) -> None:
        if change["owner"] is self.widgets["tp"]:              # a ring of n ranks has 2 (n - 1) steps
            held, self._hold = self._hold, True
            try:
                self.widgets["ring_step"].max = comm_mod.ring_steps("all_reduce", self.widgets["tp"].value)
            finally:
                self._hold = held
        super()._on_change(change)

    def compute(self, v: dict[str, Any]) -> dict[str, Any]:
        model = model_from(v)
        plan = Plan(tp=v["tp"], sp=v["sp"], seq=v["seq"], micro_batch=v["micro_batch"]).validate(model)
        attention, mlp = block_splits(model, plan.tp)
        calls = comm_mod.tp_layer_collectives(model, plan)
        step = min(v["ring_step"], comm_mod.ring_steps("all_reduce", plan.tp))
        ar = next((c for c in calls if c.kind == "all_reduce"), None)
        message = ar.message_bytes if ar else (calls[0].message_bytes if calls else 0)
        self.verdict = f"tp={plan.tp}, ring step {step}"
        return {"model": model, "plan": plan, "attention": attention, "mlp": mlp, "calls": calls, "step": step,
                "message": message}

    def layout_key(self, r: dict[str, Any]) -> Any:
        # one figure per (model, tp, sp): going back to a recent setting reuses its picture
        return (r["model"], r["plan"].tp, r["plan"].sp)

    def make_axes(self, fig: Figure, r: dict[str, Any]) -> Sequence[Axes]:
        return two_panels(fig, (1.55, 1.0), wspace=0.12, left=0.01, right=0.97, bottom=0.19, top=0.91)

    def draw(self, r: dict[str, Any], axes: list[Axes]) -> None:
        plan = r["plan"]
        if fresh(axes[0], (r["model"], plan.tp, plan.sp)):   # an axes left alone keeps its cached picture
            draw_tp_block(axes[0], r["attention"], r["mlp"], plan.tp, plan.sp,
                          title=f"one block of {r['model'].name} over tp={plan.tp} "
                                f"(colour = rank; f, g: the operators)")
        if not fresh(axes[1], (plan.tp, r["step"], r["message"])):
            return
        if plan.tp == 1:
            draw_message(axes[1], "tp=1: one rank holds every weight; no all-reduce")
        else:
            draw_ring_allreduce(axes[1], plan.tp, r["step"], r["message"],
                                title="ring all-reduce of g's outputs, chunk by chunk")

    def describe(self, r: dict[str, Any]) -> str:
        plan, calls = r["plan"], r["calls"]
        if not calls:
            return status_line("<b>tp=1</b>: nothing to split and nothing to reduce.")
        rows = "; ".join(f"{c.count} x {c.kind.replace('_', '-')} of {fmt_bytes(c.message_bytes)} in {c.phase} "
                         f"({c.note}; each rank sends {fmt_bytes(c.wire_bytes_per_call)})" for c in calls)
        n, m = plan.tp, r["message"]
        sent = comm_mod.Collective("tp", "all_reduce", m, n).wire_bytes_per_call       # 2 (n - 1) / n x M
        ring = (f"A ring all-reduce of {fmt_bytes(m)} over {n} ranks: {n - 1} reduce-scatter steps then {n - 1} "
                f"all-gather steps, one chunk of {fmt_bytes(m / n)} per step, so each rank sends "
                f"2 (n - 1) / n x M = {fmt_bytes(sent)}.")
        return (status_line(f"<b>Per block and micro-batch</b> (s b h = {plan.seq} x {plan.micro_batch} x "
                            f"{r['model'].hidden} values): {rows}.")
                + status_line(ring, MUTED))
