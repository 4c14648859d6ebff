"""The ring-attention explorer: step by step, which key/value block each context-parallel rank holds,
which tiles of the causal mask it computes, and the work per rank under contiguous and zigzag chunks.

A step slider walks the ring (cp steps: at step t rank r holds the K/V of rank (r - t) mod cp); the
tiles of the causal mask fill in rank by rank, and the status says who holds what. The right-hand
chart compares the total work per rank of both chunkings: contiguous leaves the last rank with
2 cp - 1 times the first's, zigzag gives every rank the same share. The arithmetic is
:mod:`parallel_lab.viz.plots.ring`, checked against ``distributed.context_parallel.cp_balance.work_per_rank``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from matplotlib.axes import Axes
from matplotlib.figure import Figure

from ..palette import MUTED
from ..plots.base import two_panels
from ..plots.ring import BALANCES, draw_ring_tiles, draw_work, rank_chunks, ring_tiles, work_per_rank
from .base import Explorer, int_slider, labelled, slider, status_line, toggles

CHUNK_TOKENS = 1024                      # tokens per chunk: the pairs scale with its square


class RingExplorer(Explorer):
    """Ring attention with a causal mask, one ring step at a time."""

    figsize = (9.6, 4.0)

    def __init__(self, cp: int = 4, balance: str = "zigzag", step: int = 1) -> None:
        c = {"cp": slider("cp", (2, 4, 8), cp),
             "balance": toggles("chunks", BALANCES, balance, "96px"),
             "step": int_slider("ring step", 1, cp, step)}
        super().__init__(c, [[c["cp"], c["step"]]])
        self.children = (self.children[0], labelled("chunks", c["balance"]), *self.children[1:])

    def _on_change(self, change: dict[str, Any]) -> None:
        if change["owner"] is self.widgets["cp"]:                 # the ring has cp steps
            held, self._hold = self._hold, True
            try:
                self.widgets["step"].max = self.widgets["cp"].value
            finally:
                self._hold = held
        super()._on_change(change)

    def compute(self, v: dict[str, Any]) -> dict[str, Any]:
        cp, balance = v["cp"], v["balance"]
        step = min(v["step"], cp) - 1
        tiles = ring_tiles(cp, balance, CHUNK_TOKENS)
        work = {b: work_per_rank(ring_tiles(cp, b, CHUNK_TOKENS * (2 if b == "contiguous" else 1)), cp)
                for b in BALANCES}                                   # the same sequence for both chunkings
        chunks = rank_chunks(cp, balance)
        holds = {r: chunks[(r - step) % cp] for r in range(cp)}
        self.verdict = f"step {step + 1} of {cp}"
        return {"cp": cp, "balance": balance, "step": step, "tiles": tiles, "work": work, "chunks": chunks,
                "holds": holds, "n_chunks": sum(len(x) for x in chunks)}

    def layout_key(self, r: dict[str, Any]) -> Any:
        return r["n_chunks"]

    def make_axes(self, fig: Figure, r: dict[str, Any]) -> Sequence[Axes]:
        return two_panels(fig, (1.0, 1.0), wspace=0.55, left=0.06, right=0.97, bottom=0.13, top=0.9)

    def draw(self, r: dict[str, Any], axes: list[Axes]) -> None:
        draw_ring_tiles(axes[0], r["tiles"], r["n_chunks"], r["step"], r["cp"],
                        title=f"{r['balance']}: ring step {r['step'] + 1} of {r['cp']}")
        draw_work(axes[1], r["work"], title=f"work per rank over the whole ring (cp={r['cp']})")

    def describe(self, r: dict[str, Any]) -> str:
        holds = "; ".join(f"rank {k} holds K/V chunk{'s' if len(v) > 1 else ''} {', '.join(map(str, v))}"
                          for k, v in r["holds"].items())
        now = [t for t in r["tiles"] if t.step == r["step"]]
        per = {k: sum(t.pairs for t in now if t.rank == k) for k in range(r["cp"])}
        busy = sum(1 for v in per.values() if v)
        w = r["work"]
        spread = {b: max(x) / min(x) for b, x in w.items()}
        return (status_line(f"<b>Step {r['step'] + 1}</b>: {holds}. {busy} of {r['cp']} ranks compute tiles "
                            f"this step (the others wait for the next K/V block).")
                + status_line(f"Busiest over least busy rank over the ring: contiguous "
                              f"{spread['contiguous']:.2f}x, zigzag {spread['zigzag']:.2f}x.", MUTED))
