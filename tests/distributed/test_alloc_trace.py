"""The caching-allocator model on a measured trace: the storages one training step of the lab's model makes
and frees on CPU (parallel_lab/distributed/instruments/alloc_trace.py), replayed through
parallel_lab/allocator.py, beside the ledger's own allocation list (parallel_lab/ledger_reserve.py)."""

from __future__ import annotations

import pytest

from parallel_lab.allocator import AllocatorConfig, replay, round_size, segment_size
from parallel_lab.ledger_peak import peak_moments
from parallel_lab.ledger_reserve import ledger_events
from parallel_lab.specs import ModelSpec, Plan

pytest.importorskip("torch")

from parallel_lab.distributed.instruments.measure import training_step_trace  # noqa: E402

#: small enough for a CPU, large enough that the logits, the embedding and its gradient (8 MiB each) and
#: the MLP's weights (0.7 MiB) exercise both pools
SPEC = ModelSpec(layers=2, hidden=256, heads=4, kv_heads=2, ffn=688, vocab=8192, flavour="llama", name="trace")
SEQ, MICRO = 128, 2
#: Llama 3.2 1B's width (h 2048, GQA 32/8, SwiGLU 8192, 128256 vocabulary) with 4 blocks, 2K tokens, at full
#: size in fake tensors (15.2 GiB at the peak)
WIDE = ModelSpec(layers=4, hidden=2048, heads=32, kv_heads=8, ffn=8192, vocab=128256, flavour="llama",
                 name="llama3.2-1b-width")


@pytest.fixture(scope="module")
def events() -> list[tuple]:
    return training_step_trace(SPEC, SEQ, MICRO)


@pytest.fixture(scope="module")
def fake_events() -> list[tuple]:
    return training_step_trace(WIDE, 2048, 1, fake=True)


def live_peaks(events: list[tuple]) -> tuple[int, int]:
    """(requested, rounded) bytes alive at their peak, counted from the events alone."""
    live: dict = {}
    req = rnd = peak_req = peak_rnd = 0
    for ev in events:
        if ev[0] == "alloc":
            live[ev[1]] = ev[2]
            req, rnd = req + ev[2], rnd + round_size(ev[2])
        else:
            n = live.pop(ev[1])
            req, rnd = req - n, rnd - round_size(n)
        peak_req, peak_rnd = max(peak_req, req), max(peak_rnd, rnd)
    return peak_req, peak_rnd


@pytest.mark.timeout(120)
def test_the_trace_records_a_step_and_its_frees(events):
    allocs = [e for e in events if e[0] == "alloc"]
    frees = {e[1] for e in events if e[0] == "free"}
    assert len(allocs) > 100 and frees and frees <= {e[1] for e in allocs}
    assert any(e[2] > 1 << 20 for e in allocs) and any(e[2] <= 1 << 20 for e in allocs)   # both pools


@pytest.mark.timeout(120)
@pytest.mark.parametrize("conf", ["", "expandable_segments:True"])
def test_the_replayed_reserve_holds_the_traced_tensors_within_the_segment_bound(events, conf):
    peak_req, peak_rnd = live_peaks(events)
    r = replay(events, AllocatorConfig.parse(conf))
    assert r.peak_requested == peak_req                  # the replay's bookkeeping is the trace's
    assert r.peak_reserved >= r.peak_allocated >= peak_rnd >= peak_req
    # derived bound: a request makes at most one segment (of segment_size, or a 2/20 MiB page when
    # expandable), and without a capacity no segment is ever released
    bound = sum(max(segment_size(round_size(e[2])), round_size(e[2]) + (20 << 20)) if conf else
                segment_size(round_size(e[2])) for e in events if e[0] == "alloc")
    assert r.peak_reserved <= bound


@pytest.mark.timeout(120)
def test_the_ledgers_peak_and_reserve_beside_the_trace(events):
    plan = Plan(seq=SEQ, micro_batch=MICRO, dtype="fp32", optimizer="adam-fp32")
    peak_req, _ = live_peaks(events)
    pm = peak_moments(SPEC, plan, 0, activation_model="per-op")
    assert abs(pm.peak_bytes / peak_req - 1) < 0.01      # the per-op ledger's one-moment peak is the trace's
    traced = replay(events).peak_reserved
    predicted = replay(ledger_events(SPEC, plan, 0, activation_model="per-op")).peak_reserved
    assert predicted >= peak_req and traced >= peak_req


@pytest.mark.timeout(180)
@pytest.mark.parametrize("conf", ["", "expandable_segments:True"])
def test_a_full_size_fake_step_replays_within_the_same_bounds(fake_events, conf):
    peak_req, peak_rnd = live_peaks(fake_events)
    r = replay(fake_events, AllocatorConfig.parse(conf))
    assert r.peak_requested == peak_req and r.peak_reserved >= r.peak_allocated >= peak_rnd
    plan = Plan(seq=2048, micro_batch=1, dtype="fp32", optimizer="adam-fp32")
    assert abs(peak_moments(WIDE, plan, 0, activation_model="per-op").peak_bytes / peak_req - 1) < 0.01
    predicted = replay(ledger_events(WIDE, plan, 0, activation_model="per-op"), AllocatorConfig.parse(conf))
    assert predicted.peak_reserved >= peak_req
