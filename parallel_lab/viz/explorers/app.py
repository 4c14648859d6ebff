"""The Voila app.

The Voila app (``notebooks/app.ipynb``, served by ``parallel_lab.viz.serve``): the explorers in tabs,
one sentence of introduction each.
"""

from __future__ import annotations

import gc
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import ipywidgets as W

from ...hardware import ClusterSpec
from ...specs import ModelSpec, Plan
from ..palette import MUTED
from .base import no_null_tooltips
from .comm import CommExplorer
from .grid import GridExplorer
from .help import glossary_html
from .lessons import lessons_html
from .memory import MemoryExplorer
from .pipeline import PipelineExplorer
from .planner import PlannerExplorer
from .ring import RingExplorer
from .routing import RoutingExplorer
from .run import RunExplorer
from .tp import TPExplorer
from .zero import ZeroExplorer

INTROS = {
    "Memory": "Does the plan fit on one GPU? Every byte the ledger counts, stacked against the GPU's "
              "memory, and how ZeRO, sequence length or data parallelism move it.",
    "Communication": "How many bytes each GPU sends per step, in which collectives, and how long they take "
                     "on the link each group lands on; flip the toggle to push tensor parallelism across "
                     "nodes.",
    "Pipeline": "When each pipeline stage works and when it waits: the simulated schedule, its bubble and "
                "the micro-batches each stage keeps in memory.",
    "Grid": "Where every rank sits: its (dp, pp, cp, tp) coordinates on the cluster's nodes, the groups of "
            "one dimension coloured, the groups that cross a node boundary (red border) and the bytes each "
            "link tier carries.",
    "Ring attention": "Context parallelism step by step: which key/value block each rank holds, which "
                      "tiles of the causal mask it computes, and why zigzag chunks balance the work.",
    "Run": "Train the tiny model under a plan on the local machine's CPU ranks (the code `parallel-lab run` "
           "runs) and see what was measured beside what was predicted: memory per category, bytes per "
           "collective, the pipeline's timeline and the losses against one process.",
    "ZeRO/FSDP": "Which rank owns which shard of which unit, and when ZeRO-3 gathers a unit's parameters "
                 "and frees them again: block units keep the peak low, one root unit gathers the whole model.",
    "Tensor parallel": "How a block's weights are cut over the tensor-parallel ranks, where the f and g "
                       "operators sit and what their collectives carry; the ring all-reduce step by step.",
    "Experts": "Mixture of experts: how unevenly a router sends tokens to the experts, what the capacity "
               "factor drops, and the bytes expert parallelism's all-to-alls send beside the gradient all-reduces.",
    "Planner": "Every way to split a model over a cluster, ranked by estimated step time, with the reason "
               "each rejected family failed; save the best as a plan file.",
}


class Explorers(Mapping[str, W.Widget]):
    """Tab name -> explorer, each built the first time it is asked for (its tab opened, a plan shown in
    every tab, a test reading it): the page is ready once the first tab is built, not all ten."""

    def __init__(self, makers: dict[str, Callable[[], W.Widget]], on_build: Callable[[str, W.Widget], None]):
        self._makers, self._on_build = makers, on_build
        self._built: dict[str, W.Widget] = {}

    def __getitem__(self, name: str) -> W.Widget:
        if name not in self._built:
            ex = self._makers[name]()
            self._built[name] = ex
            self._on_build(name, ex)
        return self._built[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._makers)

    def __len__(self) -> int:
        return len(self._makers)

    def built(self, name: str) -> bool:
        return name in self._built


class App(W.VBox):
    """The Voila app: the explorers in tabs, one sentence each. ``App().explorers`` maps tab names
    to the explorers (built when first needed: :class:`Explorers`). ``freeze_gc``: the app owns its kernel,
    so each tab's objects, once built, are moved out of the garbage collector's view (``gc.freeze``): a full
    collection then walks only what later changes make (``python -m bench browser``, one run each: the
    largest p95 of a change that starts no search went from 100 to 75 ms). Objects frozen while alive and
    dropped later are never collected (bounded: what a tab holds when built); pass False to embed the app in
    a kernel of your own."""

    def __init__(self, freeze_gc: bool = True) -> None:
        self.freeze_gc = freeze_gc
        makers: dict[str, Callable[..., W.Widget]] = {
            "Memory": MemoryExplorer, "Communication": CommExplorer, "Pipeline": PipelineExplorer,
            "Grid": GridExplorer, "Ring attention": RingExplorer, "ZeRO/FSDP": ZeroExplorer,
            "Tensor parallel": TPExplorer, "Experts": RoutingExplorer, "Planner": PlannerExplorer,
            "Run": RunExplorer,
        }
        intro = '<p class="pl-intro" style="font-size:14px;margin:4px 0 8px">{}</p>'
        self._pages = {n: W.VBox([W.HTML(intro.format(INTROS[n])),
                                  W.HTML(f"<i style='color:{MUTED}'>building this tab...</i>")]) for n in makers}
        self.explorers = Explorers(makers, self._built)
        self.tabs = W.Tab(children=list(self._pages.values()), titles=list(makers))
        header = W.HTML("<div style='margin:4px 0'><b style='font-size:18px'>parallel_lab</b> "
                        f"<span style='color:{MUTED}'>Predict the memory, the communication and "
                        "the pipeline bubble of a multi-GPU "
                        "training plan; change any input and watch the numbers move.</span></div>")
        self.glossary = W.HTML(glossary_html())
        self.lessons = W.HTML(lessons_html())
        super().__init__([header, self.lessons, self.tabs, self.glossary])
        self.tabs.observe(self._on_tab, names="selected_index")
        self._on_tab()
        no_null_tooltips(self)

    def _on_tab(self, _: Any = None) -> None:
        index = self.tabs.selected_index
        if index is not None:
            self.explorers[list(self._pages)[index]]

    def _built(self, name: str, ex: W.Widget) -> None:
        page = self._pages[name]
        page.children = (page.children[0], ex)
        if name == "Planner":
            ex.on_open = self.open_plan
        no_null_tooltips(page)
        if self.freeze_gc:             # a tab's widgets, figures and caches live as long as the app
            gc.collect()               # garbage first: a frozen object is never collected
            gc.freeze()

    def open_plan(self, model: ModelSpec, cluster: ClusterSpec, plan: Plan, gpus: int) -> str:
        """Show ``plan`` in every tab but the planner's (its search stays); returns what was opened where."""
        opened, notes = [], []
        for name, ex in self.explorers.items():
            if name == "Planner":
                continue
            skipped = ex.show_plan(model, cluster, plan, gpus)
            opened.append(name if ex.error is None else f"{name} (which says why it cannot show it)")
            if skipped:
                notes.append(f"{name} kept {', '.join(skipped)} (not on its sliders)")
        return "opened in " + ", ".join(opened) + (f"; {'; '.join(notes)}" if notes else "")
