"""The caching-allocator model (parallel_lab/allocator.py) on event sequences worked out by hand from torch's
rules (docs/reserve.md), the reserve beside the ledger (parallel_lab/ledger_reserve.py) and its CLI lines."""

from __future__ import annotations

import json

import pytest

from parallel_lab.allocator import AllocatorConfig, CachingAllocator, MiB, replay, round_size, segment_size
from parallel_lab.cli import main
from parallel_lab.errors import ParallelLabError
from parallel_lab.hardware import ClusterSpec
from parallel_lab.ledger import memory
from parallel_lab.ledger_reserve import ledger_events, nccl_buffer_bytes, reserve
from parallel_lab.specs import ModelSpec, Plan

KiB = 1024


def allocs(*sizes: int) -> list[tuple]:
    return [("alloc", i, n) for i, n in enumerate(sizes)]


def test_sizes_round_to_512_bytes_and_segments_follow_the_pools():
    assert [round_size(n) for n in (1, 512, 513, 1000, 4096)] == [512, 512, 1024, 1024, 4096]
    assert segment_size(1024) == segment_size(MiB) == 2 * MiB              # small pool: 2 MiB
    assert segment_size(MiB + 512) == segment_size(9 * MiB) == 20 * MiB   # (1, 10) MiB: 20 MiB
    assert segment_size(10 * MiB) == 10 * MiB and segment_size(100 * MiB + 512) == 102 * MiB
    # roundup_power2_divisions:4 rounds 1200 KiB to the next quarter between 1 and 2 MiB: 1.25 MiB
    assert round_size(1200 * KiB, AllocatorConfig(roundup_power2_divisions=4)) == 1280 * KiB


def test_small_requests_pack_into_2_mib_segments():
    r = replay(allocs(1000, 1000, 1000, 1000))
    assert (r.peak_reserved, r.peak_allocated, r.segments) == (2 * MiB, 4 * 1024, 1)
    r = replay(allocs(*[512 * KiB] * 5))                   # four fill the first 2 MiB, the fifth opens another
    assert (r.peak_reserved, r.segments) == (4 * MiB, 2)
    r = replay(allocs(MiB, MiB))                            # 1 MiB is still small: both in one segment
    assert r.peak_reserved == 2 * MiB
    assert replay(allocs(MiB + 1)).peak_reserved == 20 * MiB


def test_a_5_mib_request_takes_a_20_mib_segment_that_four_share():
    assert replay(allocs(5 * MiB)).peak_reserved == 20 * MiB
    assert replay(allocs(*[5 * MiB] * 4)).peak_reserved == 20 * MiB
    assert replay(allocs(*[5 * MiB] * 5)).peak_reserved == 40 * MiB


def test_a_large_request_gets_its_own_segment_rounded_to_2_mib():
    r = replay(allocs(100 * MiB + 1))
    assert (r.peak_reserved, r.peak_allocated) == (102 * MiB, 100 * MiB + 512)


def test_freed_blocks_are_reused_split_and_merged():
    # reuse: the freed 100 MiB serves the next 100 MiB
    assert replay([("alloc", 0, 100 * MiB), ("free", 0), ("alloc", 1, 100 * MiB)]).peak_reserved == 100 * MiB
    # split: 98 MiB leaves 2 MiB (> 1 MiB) free, which serves a 2 MiB request
    ev = [("alloc", 0, 100 * MiB), ("free", 0), ("alloc", 1, 98 * MiB), ("alloc", 2, 2 * MiB)]
    assert replay(ev).peak_reserved == 100 * MiB
    # no split when <= 1 MiB would remain in the large pool: the whole 100 MiB block is handed out
    a = CachingAllocator()
    a.alloc(0, 100 * MiB)
    a.free(0)
    assert a.alloc(1, 99 * MiB + 512 * KiB) == 100 * MiB and a.reserved == 100 * MiB
    assert a.alloc(2, 1000) == 512 * 2 and a.reserved == 102 * MiB      # the small pool's own segment
    # merge: two 30 MiB halves freed become one 100 MiB block again, which holds 90 MiB
    ev = [("alloc", 0, 100 * MiB), ("free", 0), ("alloc", 1, 30 * MiB), ("alloc", 2, 30 * MiB),
          ("free", 1), ("free", 2), ("alloc", 3, 90 * MiB)]
    assert replay(ev).peak_reserved == 100 * MiB
    # small requests never use the large pool's free blocks
    assert replay([("alloc", 0, 100 * MiB), ("free", 0), ("alloc", 1, 1000)]).peak_reserved == 102 * MiB


def test_best_fit_takes_the_smallest_free_block_that_fits():
    ev = [("alloc", 0, 60 * MiB), ("alloc", 1, 40 * MiB), ("free", 0), ("free", 1),
          ("alloc", 2, 30 * MiB), ("alloc", 3, 55 * MiB)]       # 30 into the 40, 55 into the 60
    r = replay(ev)
    assert (r.peak_reserved, r.segments) == (100 * MiB, 2)


def test_expandable_segments_grow_by_pages():
    ev = allocs(5 * MiB, 5 * MiB, 25 * MiB)
    # default: a 20 MiB segment for the two 5 MiB, a 26 MiB one for 25 MiB; expandable: 20 MiB pages, 40 MiB
    assert replay(ev).peak_reserved == 46 * MiB
    assert replay(ev, AllocatorConfig(expandable_segments=True)).peak_reserved == 40 * MiB
    assert replay(allocs(1000, 3 * MiB), AllocatorConfig(expandable_segments=True)).peak_reserved == 22 * MiB


def test_max_split_size_keeps_oversize_blocks_for_large_requests():
    ev = [("alloc", 0, 100 * MiB), ("free", 0), ("alloc", 1, 10 * MiB)]
    assert replay(ev).peak_reserved == 100 * MiB
    assert replay(ev, AllocatorConfig.parse("max_split_size_mb:64")).peak_reserved == 110 * MiB


def test_a_failed_device_allocation_releases_the_cached_segments_first():
    ev = [("alloc", 0, 100 * MiB), ("free", 0), ("alloc", 1, 150 * MiB)]
    assert replay(ev, capacity=200 * MiB).peak_reserved == 150 * MiB
    assert replay(ev).peak_reserved == 250 * MiB
    with pytest.raises(ParallelLabError, match="out of memory"):
        replay(allocs(150 * MiB, 100 * MiB), capacity=200 * MiB)


def test_bookkeeping_returns_to_zero_and_options_are_checked():
    a = CachingAllocator()
    for i, n in enumerate((1000, 5 * MiB, 100 * MiB, 3 * MiB, 700 * KiB)):
        a.alloc(i, n)
    for i in (3, 0, 4, 2, 1):
        a.free(i)
    assert a.allocated == a.requested == 0 and a.reserved == 2 * MiB + 20 * MiB + 100 * MiB
    assert all(b.prev is None and b.next is None for b in a.blocks.values())   # every segment whole again
    with pytest.raises(ParallelLabError, match="not modelled"):
        AllocatorConfig.parse("garbage_collection_threshold:0.6")


# ---- the reserve beside the ledger ---------------------------------------------------------------

def test_fixed_costs_follow_their_sources():
    h100, a100 = ClusterSpec.preset("h100-sxm"), ClusterSpec.preset("a100-80gb")
    model, plan = ModelSpec.preset("tiny-llama"), Plan(dp=8, tp=2, seq=128)
    # dp=8: 16 channels x 2 neighbours x 4 MiB; tp=2: one neighbour
    assert nccl_buffer_bytes(plan) == 16 * 2 * 4 * MiB + 16 * 1 * 4 * MiB
    assert reserve(model, plan, h100).cublas_workspace == 2 * (32 * MiB + 32 * MiB)
    assert reserve(model, plan, a100).cublas_workspace == 2 * (8 * MiB + 128 * KiB + 4 * MiB)


@pytest.mark.parametrize("kw", [dict(dp=8, zero=1), dict(dp=2, zero=3, recompute="full"),
                                dict(tp=2, pp=2, grad_accum=4, sp=True)])
def test_the_ledgers_allocations_replay_to_a_reserve_above_the_tensors(kw):
    model, plan, cluster = ModelSpec.preset("llama3-8b"), Plan(**kw), ClusterSpec.preset("h100-sxm")
    res = reserve(model, plan, cluster)
    assert res.allocator_reserved >= res.tensors_peak + res.cublas_workspace
    assert res.nvidia_smi_estimate == res.allocator_reserved + res.cuda_context + res.nccl_buffers
    # the replayed allocations hold the peak moment's bytes (to rounding) at their peak
    peak = replay(ledger_events(model, plan, res.stage)).peak_requested
    assert abs(peak - res.tensors_peak) <= 1e-6 * res.tensors_peak + 64 * 512
    expandable = reserve(model, plan, cluster, config=AllocatorConfig(expandable_segments=True))
    assert expandable.allocator_reserved <= res.allocator_reserved


def run_cli(argv: list[str], capsys) -> str:
    assert main(argv) == 0
    return capsys.readouterr().out


def test_memory_prints_the_reserve_beside_an_unchanged_verdict(capsys):
    argv = ["memory", "--model", "llama3-8b", "--dp", "8", "--zero", "1"]
    data = json.loads(run_cli([*argv, "--json"], capsys))
    r = data["reserve"]
    assert set(r) >= {"tensors_peak", "allocator_reserved", "cublas_workspace", "cuda_context", "nccl_buffers",
                      "nvidia_smi_estimate", "decides_fit"} and r["decides_fit"] is False
    led = memory(ModelSpec.preset("llama3-8b"), Plan(dp=8, zero=1))
    assert data["fits"] == led.fits and data["need_bytes"] == led.need_bytes
    assert r["tensors_peak"] == led.peak.peak_bytes
    text = run_cli(argv, capsys)
    assert "= max reserved" in text and "nvidia-smi would show ~" in text
    lines = text.splitlines()
    verdict = next(i for i, line in enumerate(lines) if line.startswith("fits:"))
    assert lines[verdict + 1].startswith("reserve (beside the verdict")
    exp = json.loads(run_cli([*argv, "--alloc-conf", "expandable_segments:True", "--json"], capsys))
    assert exp["reserve"]["allocator_config"]["expandable_segments"] is True and exp["fits"] == data["fits"]
    bare = json.loads(run_cli(["memory", "--params", "7e9", "--dp", "8", "--json"], capsys))
    assert bare["reserve"] is None


def check_segments(a: CachingAllocator) -> None:
    """Every segment is tiled by its blocks, in address order, neighbours linked both ways; the free sets
    hold exactly the free blocks; reserved is the sum of the segments."""
    heads = [b for b in a.blocks.values() if b.prev is None]
    for head in heads:
        b, end = head, head.addr
        while b is not None:
            assert b.addr == end and b.seg == head.seg and (b.next is None or b.next.prev is b)
            end, b = b.addr + b.size, b.next
        assert end - head.seg == a.segs[head.seg]
    free = sorted((b.size, b.addr) for b in a.blocks.values() if not b.allocated)
    assert free == sorted(a.free_sets[True] + a.free_sets[False])
    assert a.reserved == sum(a.segs.values())
    assert a.allocated == sum(b.size for b, _ in a.live.values())


@pytest.mark.parametrize("conf", ["", "expandable_segments:True", "max_split_size_mb:40", "roundup_power2_divisions:4"])
def test_random_sequences_keep_the_segments_whole(conf):
    import random

    rng = random.Random(0)
    a = CachingAllocator(AllocatorConfig.parse(conf), capacity=3 << 30)
    live: list[int] = []
    for i in range(3000):
        if live and rng.random() < 0.45:
            a.free(live.pop(rng.randrange(len(live))))
        else:
            a.alloc(i, rng.choice([rng.randint(1, 4096), rng.randint(1, 2 * MiB), rng.randint(1, 60 * MiB)]))
            live.append(i)
        if i % 97 == 0:
            check_segments(a)
    for k in live:
        a.free(k)
    check_segments(a)
    assert a.allocated == 0 and a.peak_reserved >= a.peak_allocated
