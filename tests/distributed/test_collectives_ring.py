"""The ring all-reduce written with sends (distributed/collectives_ring.py) against torch's all_reduce, on ranks."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from parallel_lab.comm import Collective
from parallel_lab.distributed.collectives_ring import ring_all_reduce_, ring_reduce_scatter_
from parallel_lab.distributed.instruments.tracer import CommTracer
from parallel_lab.distributed.runtime.launch import launch
from parallel_lab.viz.plots.collectives import contributors, tag
from parallel_lab.viz.plots.tp import ring_allreduce_states


def _ring_rank(grid, numel):
    r = grid.rank
    pair = dist.new_group([1, 3])                                   # every rank creates it; ranks 1 and 3 use it
    x = torch.randn(numel, generator=torch.Generator().manual_seed(r))
    want = x.clone()
    dist.all_reduce(want)
    tracer = CommTracer(r, {"dp": dist.group.WORLD})
    steps = []
    with tracer.observe():
        got = ring_all_reduce_(x.clone(), on_step=lambda phase, s: steps.append((phase, s)))
    sent = sum(e.message_bytes for e in tracer.events if e.kind == "send")
    y = torch.arange(12, dtype=torch.float32) * (r + 1)
    done = ring_reduce_scatter_(y)
    tags = torch.tensor([tag(r, c) for c in range(grid.world)])
    seen = [tags.tolist()]
    ring_all_reduce_(tags, on_step=lambda phase, s: seen.append(tags.tolist()))
    sub = None
    if r in (1, 3):
        sub = torch.full((4,), float(r))
        ring_all_reduce_(sub, group=pair)
    return got, want, sent, steps, done, y, sub, seen


@pytest.mark.distributed
@pytest.mark.timeout(60)
def test_ring_all_reduce_equals_torch_and_sends_2_n_minus_1_over_n():
    numel = 1000
    out = launch(_ring_rank, 4, numel, timeout_s=60)
    n, message = 4, numel * 4
    for r, (got, want, sent, steps, done, y, sub, _) in enumerate(out):
        assert torch.allclose(got, want, atol=1e-5), r
        # measured bytes sent per rank: 2 (n-1) chunks of M/n = 2 (n-1)/n M = 6,000 B
        assert sent == 6_000 == Collective("dp", "all_reduce", message, n).wire_bytes_per_call
        assert steps == [("reduce-scatter", 1), ("reduce-scatter", 2), ("reduce-scatter", 3),
                         ("all-gather", 1), ("all-gather", 2), ("all-gather", 3)]
        # after the reduce-scatter, rank r holds chunk (r + 1) % 4 summed: arange * (1 + 2 + 3 + 4)
        assert done == (r + 1) % 4
        assert torch.equal(y.view(4, 3)[done], torch.arange(12, dtype=torch.float32).view(4, 3)[done] * 10)
        assert (sub is None) == (r in (0, 2))
        if sub is not None:
            assert torch.equal(sub, torch.full((4,), 4.0))       # ranks 1 + 3 over their own group
    # step by step, the sends follow the schedule the TP explorer draws (viz/plots/tp.py, computed on paper)
    drawn = ring_allreduce_states(n)
    for s in range(2 * (n - 1) + 1):
        for r in range(n):
            for c in range(n):
                ranks, chunk = contributors(out[r][7][s][c], n)
                assert (ranks, chunk) == (sorted(drawn[s][r][c]), c), (s, r, c)


@pytest.mark.distributed
@pytest.mark.timeout(60)
def test_ring_refuses_a_tensor_it_cannot_cut():
    out = launch(_refuse, 2, timeout_s=60)
    assert all("multiple of 2" in msg for msg in out)


def _refuse(grid):
    try:
        ring_all_reduce_(torch.ones(3))
    except ValueError as e:
        return str(e)
    return "no error"
