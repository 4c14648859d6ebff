"""The routing explorer: its bars are the routing model's counts and comm's bytes."""

from __future__ import annotations

import pytest

from parallel_lab import comm
from parallel_lab.routing import load_report
from parallel_lab.specs import ModelSpec, Plan
from parallel_lab.viz.explorers.routing import DP, SEQ, SEQUENCES, RoutingExplorer


def _bars(fig, prefix):
    return {p.get_gid(): p.get_height() for ax in fig.axes for p in ax.patches
            if (p.get_gid() or "").startswith(prefix)}


def test_bars_are_the_load_report_and_the_comm_report():
    ex = RoutingExplorer(model="mixtral-8x7b", skew=1.0, capacity_factor=1.25, ep=4)
    assert ex.error is None
    m = ModelSpec.preset("mixtral-8x7b")
    want = load_report(m, SEQ, ep=4, skew=1.0, sequences=SEQUENCES)
    kept = _bars(ex.figure, "expert:")
    assert [kept[f"expert:{e}"] for e in range(m.experts)] == want.kept
    per_step = comm.report(m, Plan(dp=DP, ep=4, seq=SEQ, micro_batch=SEQUENCES)).per_step_bytes
    got = _bars(ex.figure, "bytes:")
    assert got["bytes:ep"] * 1e9 == pytest.approx(per_step["ep"])
    assert "dropped" in ex.verdict


def test_more_capacity_drops_fewer_tokens():
    ex = RoutingExplorer(skew=1.0, capacity_factor=1.0)
    before = ex.result["load"].dropped
    ex.set(capacity_factor=4.0)
    assert ex.result["load"].dropped == 0 < before
    assert not _bars(ex.figure, "dropped:")
