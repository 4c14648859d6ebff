"""The ZeRO/FSDP and tensor-parallel explorers against the library's own rules: the shards against
``sharding``, ZeRO-3's gathered peak and its gathers against ``ledger`` and ``comm``, the TP split against
``sharding``, the ring all-reduce's bytes against ``comm``'s wire bytes; and the lesson links."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from parallel_lab import comm, ledger, ledger_buffers
from parallel_lab.errors import ParallelLabError
from parallel_lab.sharding import kv_replicas, padded, q_width_local, shard_group, unit_sizes
from parallel_lab.specs import ModelSpec, Plan
from parallel_lab.viz.explorers.tp import TPExplorer, block_splits
from parallel_lab.viz.explorers.zero import ZeroExplorer
from parallel_lab.viz.plots.tp import ring_allreduce_states, ring_sent_chunks
from parallel_lab.viz.plots.zero import gather_timeline

NOTEBOOKS = Path(__file__).resolve().parents[2] / "notebooks"


# --------------------------------------------------------------------------------------------------
# ZeRO / FSDP
# --------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name,dp", [("llama2-7b", 4), ("tiny-llama", 2), ("tiny-gpt", 8)])
@pytest.mark.parametrize("unit", ["block", "root"])
def test_zero3_timeline_peak_and_gathers_match_ledger_and_comm(name, dp, unit):
    model = ModelSpec.preset(name)
    plan = Plan(dp=dp, zero=3, zero_unit=unit, seq=512).validate(model)
    g, pb = shard_group(plan), 2                                     # adam-mixed gathers bf16 parameters
    events = gather_timeline({u: padded(n, g) * pb for u, n in unit_sizes(model, plan).items()})
    assert max(e.held for e in events) == ledger_buffers.zero3_gathered_bytes(model, plan)
    assert events[-1].held == 0
    gathers = {}
    for e in events:
        if e.kind == "all_gather":
            gathers[e.unit] = gathers.get(e.unit, 0) + 1
    predicted = {c.unit: c.count for c in comm.collectives(model, plan)
                 if c.dim == "dp" and c.kind == "all_gather"}
    by_unit: dict[str, int] = {}
    for c in comm.collectives(model, plan):
        if c.dim == "dp" and c.kind == "all_gather":
            by_unit[c.unit] = by_unit.get(c.unit, 0) + c.count
    assert gathers == by_unit and set(predicted) == set(gathers)    # one micro-batch: comm's counts
    scatters = [e.unit for e in events if e.kind == "reduce_scatter"]
    assert sorted(scatters) == sorted(unit_sizes(model, plan))


def test_zero_explorer_draws_every_rank_s_shard_and_the_ledger_numbers():
    ex = ZeroExplorer(model="llama2-7b", dp=4, zero=3)
    assert ex.error is None and ex.image.layout.display is None
    model, plan = ModelSpec.preset("llama2-7b"), Plan(dp=4, zero=3)
    units = unit_sizes(model, plan)
    ax = ex.figure.axes[1]
    root = [p for p in ax.patches if p.get_y() < 0.5 and p.get_y() > -0.5]       # the first row: root
    assert len(root) == 4
    widths = [p.get_width() for p in root]
    assert widths == pytest.approx([math.ceil(units["root"] / 4) / 1e6] * 4)      # M elements each
    assert [t.get_text() for t in ax.get_legend().get_texts()] == [f"rank {r}" for r in range(4)]
    st = ledger.state_bytes(model, plan)
    from parallel_lab.quantities import fmt_bytes

    assert f"1/4 of the parameters ({fmt_bytes(st['parameters'])} of" in ex.status.value
    assert "rank 1 owns" in ex.status.value.split("<details")[1]           # element ranges only on demand
    peaks = {u: ledger_buffers.zero3_gathered_bytes(model, plan.with_(zero_unit=u)) for u in ("block", "root")}
    assert f"at most {fmt_bytes(peaks['block'])} per rank with block units" in ex.status.value
    assert peaks["root"] > 5 * peaks["block"]                          # the peak rises with one root unit
    curves = {ln.get_gid(): ln for ln in ex.figure.axes[2].lines if ln.get_gid()}
    assert max(curves["gathered:block"].get_ydata()) * 1e9 == pytest.approx(peaks["block"], rel=1e-9)
    lo, hi = ex.figure.axes[2].get_ylim()                               # the block curve on its own scale
    assert hi <= 2 * peaks["block"] / 1e9 and "gathered:root" not in curves
    ex.widgets["zero_unit"].value = "root"
    assert len(ex.result["units"]) == 1 and "one unit" in ex.figure.axes[1].get_title()
    ex.widgets["dp"].value = 1                                         # nothing to shard over: the library says so
    assert isinstance(ex.error, ParallelLabError) and "set dp &gt;= 2 or zero=0" in ex.status.value
    ex.widgets["zero"].value = 0
    assert ex.error is None and "over 1 ranks</b>: each rank holds all parameters" in ex.status.value


def _held(ex, rank, cat):
    return [p.get_width() for p in ex.figure.axes[0].patches if p.get_gid() == f"held:{rank}:{cat}"]


def test_zero_tab_changes_with_the_stage():
    """Each stage shards one more category: rank 1's held slice of it shrinks to 1/g and moves to 1/g."""
    ex = ZeroExplorer(model="tiny-llama", dp=4, zero=3)
    images = {3: ex.image.value}
    full = {c: _held(ex, 0, c) for c in ("parameters", "gradients", "optimizer_states")}
    for stage in (2, 1, 0):
        ex.widgets["zero"].value = stage
        images[stage] = ex.image.value
        sharded = {"parameters": stage >= 3, "gradients": stage >= 2, "optimizer_states": stage >= 1}
        for cat, is_sharded in sharded.items():
            (w,) = _held(ex, 1, cat)
            others = [p for p in ex.figure.axes[0].patches if p.get_gid() == f"others:1:{cat}"]
            assert bool(others) == is_sharded
            if not is_sharded:
                full[cat] = [w]
        assert f"ZeRO-{stage}" in ex.figure.axes[0].get_title()
    for cat, (w,) in full.items():
        ex.widgets["zero"].value = 3
        (held,) = _held(ex, 1, cat)
        assert held == pytest.approx(w / 4, rel=0.02)
    assert len(set(images.values())) == 4                               # four stages, four pictures


# --------------------------------------------------------------------------------------------------
# Tensor parallelism
# --------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("n", [2, 3, 4, 8])
def test_ring_allreduce_is_reduce_scatter_then_all_gather(n):
    states = ring_allreduce_states(n)
    assert len(states) == 2 * (n - 1) + 1
    full = frozenset(range(n))
    after_rs = states[n - 1]
    for r in range(n):                                  # each rank owns exactly one reduced chunk
        assert [c for c in range(n) if after_rs[r][c] == full] == [(r + 1) % n]
    assert all(cell == full for row in states[-1] for cell in row)
    sent = sum(len(ring_sent_chunks(n, s)) for s in range(1, 2 * n - 1)) / n      # chunks per rank
    message = 1000 * n
    ar = comm.Collective("tp", "all_reduce", message, n)
    assert sent * message / n == pytest.approx(ar.wire_bytes_per_call)


def test_tp_split_follows_layout_and_the_status_lists_comm_calls():
    model = ModelSpec.preset("tiny-llama")                        # 4 heads, 2 kv heads: tp=4 replicates them
    attention, mlp = block_splits(model, 4)
    assert "1 of 4 heads" in attention[0].local and f"each on {kv_replicas(model, 4)} ranks" in attention[0].local
    assert f"{q_width_local(model, 4):,} input rows" in attention[1].local
    assert mlp[0].shape == (model.hidden, 2 * model.ffn) and mlp[1].shape == (model.ffn, model.hidden)
    ex = TPExplorer(model="tiny-llama", tp=4, seq=1024)
    calls = comm.tp_layer_collectives(model, Plan(tp=4, seq=1024))
    from parallel_lab.quantities import fmt_bytes

    for c in calls:
        assert f"{c.count} x {c.kind.replace('_', '-')} of {fmt_bytes(c.message_bytes)}" in ex.status.value
    slices = [p for p in ex.figure.axes[0].patches if (p.get_gid() or "").startswith("w:wq, wk, wv:")]
    assert len(slices) == 4
    ex.widgets["ring_step"].value = 6
    cells = [p.get_gid() for p in ex.figure.axes[1].patches]
    assert all(g.endswith(":4") for g in cells) and len(cells) == 16          # every chunk reduced
    ex.widgets["tp"].value = 2
    assert ex.widgets["ring_step"].max == 2 and ex.result["step"] == 2
    ex.widgets["sp"].value = True
    kinds = {c.kind for c in comm.tp_layer_collectives(model, Plan(tp=2, sp=True, seq=1024))}
    assert kinds == {"all_gather", "reduce_scatter"} and "all-gather" in ex.status.value


def test_tp_explorer_shows_the_library_s_refusal():
    ex = TPExplorer(model="tiny-gpt", tp=8)
    assert isinstance(ex.error, ParallelLabError)
    assert "tp=8 does not divide heads=4" in ex.status.value and ex.image.layout.display == "none"


# --------------------------------------------------------------------------------------------------
# links to the lessons
# --------------------------------------------------------------------------------------------------

def test_every_tab_links_to_its_lesson_on_127_0_0_1():
    from parallel_lab.viz.explorers.app import App
    from parallel_lab.viz.explorers.lessons import EXPLAINED_BY, lesson_url

    app = App(freeze_gc=False)          # a test process is not the app's kernel
    for tab, ex in app.explorers.items():
        stem = EXPLAINED_BY[type(ex).__name__]
        assert f'href="{lesson_url(stem)}"' in ex.lesson.value, tab
        assert lesson_url(stem).startswith("http://127.0.0.1:")
    assert app.lessons.value.count('class="pl-lesson"') == len(list(NOTEBOOKS.glob("0*.ipynb"))) == 10


#: For a tab no lesson embeds, a word its lesson must use (the tab's subject).
TAB_SUBJECT = {"ZeroExplorer": "ZeRO", "TPExplorer": "all-reduce", "PlannerExplorer": "planner",
               "RunExplorer": "parallel-lab run"}


def test_each_tab_links_to_the_lesson_about_its_picture():
    """A tab links to a lesson that embeds its explorer (``CommExplorer(`` in lesson 03); for a tab that no
    lesson embeds, to one that names its subject. The Communication tab linked to lesson 02 while its
    default (TP 8) and its embedding are lesson 03's."""
    from parallel_lab.viz.explorers.lessons import EXPLAINED_BY

    texts = {p.stem: p.read_text() for p in sorted(NOTEBOOKS.glob("0*.ipynb"))}
    for cls, stem in EXPLAINED_BY.items():
        embedding = [s for s, t in texts.items() if f"{cls}(" in t]
        if embedding:
            assert stem in embedding, f"{cls} links to {stem}; the lessons that embed it: {embedding}"
        else:
            assert TAB_SUBJECT[cls].lower() in texts[stem].lower(), f"{cls} links to {stem}, which never says " \
                                                                     f"{TAB_SUBJECT[cls]!r}"


def test_every_linked_lesson_exists():
    """Fails until every lesson the app links to is in notebooks/ (lessons 02-09 are written in parallel)."""
    from parallel_lab.viz.explorers.lessons import EXPLAINED_BY, LESSONS

    missing = [f"{s}.ipynb" for s in {*LESSONS, *EXPLAINED_BY.values()} if not (NOTEBOOKS / f"{s}.ipynb").exists()]
    assert not missing, f"the app links to lessons that are not in notebooks/: {sorted(missing)}"


def test_the_app_builds_a_tab_when_it_is_first_opened():
    from parallel_lab.viz.explorers.app import App
    from parallel_lab.viz.explorers.zero import ZeroExplorer

    app = App(freeze_gc=False)          # a test process is not the app's kernel
    assert [n for n in app.explorers if app.explorers.built(n)] == ["Memory"]
    index = list(app.explorers).index("ZeRO/FSDP")
    assert "building this tab" in app.tabs.children[index].children[1].value
    app.tabs.selected_index = index
    assert app.explorers.built("ZeRO/FSDP") and isinstance(app.tabs.children[index].children[1], ZeroExplorer)
    assert app.tabs.children[index].children[1] is app.explorers["ZeRO/FSDP"]
