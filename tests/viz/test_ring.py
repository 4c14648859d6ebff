"""Ring attention's picture against the runnable context parallelism: the work per rank drawn is
``distributed.context_parallel.cp_balance.work_per_rank`` (which counts the allowed query/key pairs of the real
index layout), and the tiles each step are the K/V block the ring hands each rank."""

from __future__ import annotations

import pytest

from parallel_lab.viz.explorers.ring import RingExplorer
from parallel_lab.viz.plots.ring import rank_chunks, ring_tiles, work_per_rank


@pytest.mark.parametrize("cp", [2, 4, 8])
@pytest.mark.parametrize("balance", ["contiguous", "zigzag"])
def test_work_per_rank_is_the_runnable_layouts(cp, balance):
    context_parallel = pytest.importorskip("parallel_lab.distributed.context_parallel.cp_balance")
    chunk = 4                                                          # tokens per zigzag chunk
    seq = 2 * cp * chunk
    tiles = ring_tiles(cp, balance, chunk * (2 if balance == "contiguous" else 1))
    assert work_per_rank(tiles, cp) == context_parallel.work_per_rank(seq, cp, balance)
    idx = context_parallel.rank_indices(seq, cp, balance)
    n = 2 * cp if balance == "zigzag" else cp
    for r, chunks in enumerate(rank_chunks(cp, balance)):             # the same chunks on the same ranks
        assert sorted({int(i) // (seq // n) for i in idx[r]}) == sorted(chunks)


def test_the_explorer_draws_the_steps_and_the_balance():
    ex = RingExplorer(cp=4, balance="contiguous", step=1)
    assert ex.error is None
    tiles_ax, work_ax = ex.figure.axes
    # step 1: every rank computes its own diagonal tile only
    edges = {p.get_gid(): p.get_linewidth() for p in tiles_ax.patches if (p.get_gid() or "").startswith("tile:")}
    assert [g for g, w in edges.items() if w == 1.6] == [f"tile:{i}:{i}" for i in range(4)]
    heights = {p.get_gid(): p.get_height() for p in work_ax.patches if (p.get_gid() or "").startswith("work:")}
    # contiguous, causal: rank r computes r full tiles and one diagonal, 2r + 1 quarters of the share
    assert [heights[f"work:contiguous:{r}"] for r in range(4)] == pytest.approx([0.25, 0.75, 1.25, 1.75],
                                                                                rel=1e-3)
    assert [heights[f"work:zigzag:{r}"] for r in range(4)] == pytest.approx([1.0] * 4)
    ex.widgets["step"].value = 3                                       # rank r holds the K/V of rank r - 2
    assert "rank 2 holds K/V chunk 0" in ex.status.value and "2 of 4 ranks compute" in ex.status.value
    ex.widgets["cp"].value = 2
    assert ex.widgets["step"].max == 2 and ex.error is None
