"""The Voila app.

The Voila app (``notebooks/app.ipynb``, served by ``parallel_lab.viz.serve``): the explorers in tabs,
one sentence of introduction each.
"""

from __future__ import annotations

from collections.abc import Callable

import ipywidgets as W

from ...specs import ClusterSpec, ModelSpec, Plan
from .base import no_null_tooltips
from .comm import CommExplorer
from .grid import GridExplorer
from .help import glossary_html
from .lessons import lessons_html
from .memory import MemoryExplorer
from .pipeline import PipelineExplorer
from .planner import PlannerExplorer
from .ring import RingExplorer
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
    "Run": "Train the tiny model under a plan on this machine's CPU ranks (the code `parallel-lab run` "
           "runs) and see what was measured beside what was predicted: memory per category, bytes per "
           "collective, the pipeline's timeline and the losses against one process.",
    "ZeRO/FSDP": "Which rank owns which shard of which unit, and when ZeRO-3 gathers a unit's parameters "
                 "and frees them again: block units keep the peak low, one root unit gathers the whole model.",
    "Tensor parallel": "How a block's weights are cut over the tensor-parallel ranks, where the f and g "
                       "operators sit and what their collectives carry; the ring all-reduce step by step.",
    "Planner": "Every way to split a model over a cluster, ranked by estimated step time, with the reason "
               "each rejected family failed; save the best as a plan file.",
}


class App(W.VBox):
    """The Voila app: the explorers in tabs, one sentence each. ``App().explorers`` maps tab names
    to the explorers (for tests). ``renderer`` is passed to each explorer (``bench/bench_browser.py``)."""

    def __init__(self, renderer: str = "frames") -> None:
        makers: dict[str, Callable[[], W.Widget]] = {
            "Memory": MemoryExplorer, "Communication": CommExplorer, "Pipeline": PipelineExplorer,
            "Grid": GridExplorer, "Ring attention": RingExplorer, "ZeRO/FSDP": ZeroExplorer,
            "Tensor parallel": TPExplorer, "Planner": PlannerExplorer,
            "Run": RunExplorer,
        }
        self.explorers: dict[str, W.Widget] = {name: make(renderer=renderer) for name, make in makers.items()}
        intro = '<p class="pl-intro" style="font-size:14px;margin:4px 0 8px">{}</p>'
        pages = [W.VBox([W.HTML(intro.format(INTROS[n])), ex]) for n, ex in self.explorers.items()]
        self.tabs = W.Tab(children=pages, titles=list(self.explorers))
        header = W.HTML("<h2 style='margin:8px 0 2px'>parallel_lab</h2>"
                        "<p style='margin:0 0 8px;color:#57606a'>Predict the memory, the communication and "
                        "the pipeline bubble of a multi-GPU "
                        "training plan; change any input and watch the numbers move.</p>")
        self.explorers["Planner"].on_open = self.open_plan
        self.glossary = W.HTML(glossary_html())
        self.lessons = W.HTML(lessons_html())
        super().__init__([header, self.lessons, self.tabs, self.glossary])
        no_null_tooltips(self)

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
