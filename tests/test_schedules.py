"""Schedules as data: every generated list validates, broken lists are rejected, in-flight counts."""

from __future__ import annotations

import pytest

from parallel_lab.errors import ParallelLabError
from parallel_lab.schedules.actions import P2P, Action, B, F, W
from parallel_lab.schedules.checks import validate
from parallel_lab.schedules.execution import execute
from parallel_lab.schedules.generators import build_schedule
from parallel_lab.schedules.inflight import (
    head_inflight,
    inflight_trace,
    peak_activation_units,
    peak_inflight,
    peak_inflight_of,
)
from parallel_lab.schedules.orders import interleaved_order
from parallel_lab.schedules.p2p import with_p2p

PS = (2, 3, 4, 8)
MS = tuple(range(1, 17)) + (32, 64)


def grid():
    """(name, p, m, v) over the issue's grid, where the schedule is defined."""
    for name in ("gpipe", "1f1b", "zb-h1"):
        for p in PS:
            for m in MS:
                yield name, p, m, 1
    for p in PS:
        for m in MS:
            if m % p == 0:
                for v in (1, 2, 4):
                    yield "interleaved", p, m, v


GRID = list(grid())


@pytest.mark.parametrize("p", PS)
def test_every_generated_schedule_validates(p):
    for name, pp, m, v in GRID:
        if pp == p:
            validate(build_schedule(name, p, m, v))


def test_single_stage_schedules_have_no_p2p():
    for name in ("gpipe", "1f1b", "zb-h1"):
        s = validate(build_schedule(name, 1, 4))
        assert all(a.kind != "P2P" for a in s[0])


SOME = [g for g in GRID if g[2] in (1, 3, 8, 16, 64) or g[0] == "interleaved"]


@pytest.mark.parametrize("name,p,m,v", SOME, ids=str)
def test_peak_inflight_closed_form_matches_lists(name, p, m, v):
    got = peak_inflight_of(build_schedule(name, p, m, v))
    assert got == [peak_inflight(name, p, m, v, stage=r) for r in range(p)]


def test_1f1b_first_stage_holds_p_gpipe_holds_m():
    for p in PS:
        for m in MS:
            g = peak_inflight_of(build_schedule("gpipe", p, m))
            o = peak_inflight_of(build_schedule("1f1b", p, m))
            assert g == [m] * p
            assert o[0] == min(p, m)
            assert o == [min(p - r, m) for r in range(p)]


def test_zb_h1_memory_no_more_than_1f1b_first_stage():
    # Qi et al. 2023: ZB-H1's peak memory does not exceed 1F1B's (every rank holds at most p micro-batches).
    for p in PS:
        for m in MS:
            z = peak_inflight_of(build_schedule("zb-h1", p, m))
            assert max(z) == peak_inflight_of(build_schedule("1f1b", p, m))[0]


def test_interleaved_memory_factor_korthikanti():
    # Korthikanti et al. 2022: the first stage of interleaved 1F1B holds p (1 + (p-1)/(p v)) micro-batches'
    # worth of stage activations (m large enough that the warm-up is not capped).
    for p, v in ((4, 2), (8, 2), (8, 4), (3, 3)):
        m = 4 * p * v
        got = peak_activation_units("interleaved", p, m, v, stage=0)
        assert got == pytest.approx(p * (1 + (p - 1) / (p * v)))
        assert peak_inflight_of(build_schedule("interleaved", p, m, v))[0] / v == pytest.approx(got)


def test_action_ordering_in_lists():
    s = build_schedule("1f1b", 4, 8)
    # last stage alternates F, B immediately (no warm-up), first stage warms up with p-1 forwards
    computes = [a for a in s[3] if a.is_compute]
    assert [a.kind for a in computes[:4]] == ["F", "B", "F", "B"]
    computes0 = [a for a in s[0] if a.is_compute]
    assert [a.kind for a in computes0[:5]] == ["F", "F", "F", "F", "B"]
    z = build_schedule("zb-h1", 4, 8)
    kinds = [a.kind for a in z[3] if a.is_compute]
    assert kinds.count("W") == 8 and kinds.index("W") > kinds.index("B")


def test_interleaved_placement_chunk_to_rank():
    # chunk c on rank r is virtual stage c*p + r: rank 3's chunk 0 (stage 3) sends to rank 0's chunk 1
    # (stage 4)
    s = build_schedule("interleaved", 4, 4, 2)
    sends = [op for a in s[3] for op in a.ops if op.kind == "SEND_F" and op.chunk == 0]
    assert sends and all(op.peer == 0 for op in sends)
    recvs = [op for a in s[0] for op in a.ops if op.kind == "RECV_F"]
    assert recvs and all(op.chunk == 1 and op.peer == 3 for op in recvs)


def test_build_schedule_errors():
    with pytest.raises(ParallelLabError, match="not known"):
        build_schedule("pipedream", 2, 4)
    with pytest.raises(ParallelLabError, match="multiple"):
        build_schedule("interleaved", 4, 6, 2)
    with pytest.raises(ParallelLabError, match="interleaved"):
        build_schedule("1f1b", 4, 8, 2)
    with pytest.raises(ParallelLabError, match="positive"):
        build_schedule("gpipe", 0, 4)


# ---- broken lists are rejected, naming the action --------------------------------------------------

def two_stage_1f1b() -> list[list[Action]]:
    return [list(r) for r in build_schedule("1f1b", 2, 2)]


def test_send_before_compute_is_rejected():
    s = two_stage_1f1b()
    s[0][0], s[0][1] = s[0][1], s[0][0]   # P2P[SEND_F(mb=0)] before F(0)
    with pytest.raises(ParallelLabError, match=r"rank 0, action 0 .*sends a tensor before its F\(mb=0"):
        validate(s)


def test_swapped_send_order_is_rejected():
    # rank 0 sends mb 1 before mb 0 while rank 1 receives mb 0 first: the FIFO would swap the tensors
    s = [
        [F(0), F(1), P2P(Action("SEND_F", 1, 0, 1), Action("SEND_F", 0, 0, 1)),
         P2P(Action("RECV_B", 0, 0, 1)), B(0), P2P(Action("RECV_B", 1, 0, 1)), B(1)],
        [P2P(Action("RECV_F", 0, 0, 0)), F(0), B(0),
         P2P(Action("SEND_B", 0, 0, 0), Action("RECV_F", 1, 0, 0)), F(1), B(1),
         P2P(Action("SEND_B", 1, 0, 0))],
    ]
    with pytest.raises(ParallelLabError, match=r"rank 1, action 0 .*is RECV_F\(mb=0.*send #0 to rank 1 is "
                                               r"SEND_F\(mb=1.*swap them back"):
        validate(s)
    # the same lists with the sends in order are fine
    s[0][2] = P2P(Action("SEND_F", 0, 0, 1), Action("SEND_F", 1, 0, 1))
    validate(s)


def test_swapped_recv_order_is_rejected():
    # receives of mb 0 and mb 1 swapped on rank 1: the FIFO would hand mb 0's activations to mb 1
    s = [
        [F(0), P2P(Action("SEND_F", 0, 0, 1)), F(1), P2P(Action("SEND_F", 1, 0, 1)),
         P2P(Action("RECV_B", 0, 0, 1)), B(0), P2P(Action("RECV_B", 1, 0, 1)), B(1)],
        [P2P(Action("RECV_F", 1, 0, 0)), P2P(Action("RECV_F", 0, 0, 0)), F(0), B(0),
         P2P(Action("SEND_B", 0, 0, 0)), F(1), B(1), P2P(Action("SEND_B", 1, 0, 0))],
    ]
    with pytest.raises(ParallelLabError, match=r"rank 1, action 0 .*receive #0 from rank 0 is RECV_F\(mb=1"):
        validate(s)


def test_backward_before_forward_is_rejected():
    s = two_stage_1f1b()
    last = s[1]
    fi = next(i for i, a in enumerate(last) if a.kind == "F")
    bi = next(i for i, a in enumerate(last) if a.kind == "B")
    last[fi], last[bi] = last[bi], last[fi]
    with pytest.raises(ParallelLabError,
                       match=r"rank 1, action \d+ B\(mb=0, chunk=0\): backward before its forward"):
        validate(s)


def test_w_before_b_and_duplicates_rejected():
    s = [[F(0), W(0), B(0)]]
    with pytest.raises(ParallelLabError, match="W before its B"):
        validate(s)
    with pytest.raises(ParallelLabError, match="done twice"):
        validate([[F(0), F(0), B(0)]])
    with pytest.raises(ParallelLabError, match="never runs"):
        validate([[F(0), B(0), F(1)]])


def test_missing_receive_rejected():
    s = [
        [F(0), P2P(Action("SEND_F", 0, 0, 1)), P2P(Action("RECV_B", 0, 0, 1)), B(0)],
        [F(0), B(0), P2P(Action("SEND_B", 0, 0, 0))],
    ]
    with pytest.raises(ParallelLabError,
                       match=r"rank 1, action 0 F\(mb=0, chunk=0\): forward before its input"):
        validate(s)


def test_unmatched_send_rejected():
    s = [
        [F(0), P2P(Action("SEND_F", 0, 0, 1)), P2P(Action("RECV_B", 0, 0, 1)), B(0)],
        [P2P(Action("RECV_F", 0, 0, 0)), F(0), B(0), P2P(Action("SEND_B", 0, 0, 0)),
         P2P(Action("SEND_B", 0, 0, 0))],
    ]
    with pytest.raises(ParallelLabError, match="sent twice"):
        validate(s)


def test_deadlock_is_detected():
    # rank 0 waits for a gradient before it sends the activations rank 1 needs to produce that gradient
    s = [
        [F(0), P2P(Action("RECV_B", 0, 0, 1)), B(0), P2P(Action("SEND_F", 0, 0, 1))],
        [P2P(Action("RECV_F", 0, 0, 0)), F(0), B(0), P2P(Action("SEND_B", 0, 0, 0))],
    ]
    with pytest.raises(ParallelLabError, match=r"deadlock.*rank 0 waits at action 2 B\(mb=0"):
        validate(s)


def test_interleaved_needs_megatron_rounds_under_in_order_completion():
    # One P2P between every two compute actions is fine when batches complete independently (gloo), but
    # on one in-order stream (NCCL) two interleaved ranks wait for each other: the generator pairs each
    # steady-state forward with its backward (Megatron's rounds) to avoid it.
    naive = with_p2p(interleaved_order(2, 4, 2), 2)
    unit = {"F": 1.0, "B": 1.0, "W": 1.0}
    execute(naive, unit)
    with pytest.raises(ParallelLabError, match="deadlock"):
        execute(naive, unit, in_order=True)
    execute(build_schedule("interleaved", 2, 4, 2), unit, in_order=True)


def test_ledger_inflight_count_agrees_with_the_lists():
    # the memory ledger multiplies one micro-batch's stage activations by this count; it must be what the
    # schedule lists actually hold (counted off the lists, in units of a whole stage)
    from parallel_lab.rank_view import inflight_microbatches

    for name, p, m, v in SOME:
        lists = peak_inflight_of(build_schedule(name, p, m, v))
        for stage in range(p):
            assert inflight_microbatches(name, p, m, v, stage) == pytest.approx(lists[stage] / v), \
                (name, p, m, v, stage)


def test_input_recv_names_the_posted_receive():
    # the executor waits, before each compute action, for the receive input_recv() names; an earlier P2P of
    # the same rank posted it, and every posted receive is consumed exactly once
    from parallel_lab.schedules.p2p import input_recv

    cases = [("1f1b", 4, 8, 1), ("interleaved", 4, 8, 2), ("zb-h1", 3, 5, 1), ("gpipe", 2, 3, 1)]
    for name, p, m, v in cases:
        s = build_schedule(name, p, m, v)
        for r, acts in enumerate(s):
            posted, used = set(), set()
            for a in acts:
                if a.kind == "P2P":
                    posted |= {(o.kind, o.microbatch, o.chunk) for o in a.ops if not o.is_send}
                elif (key := input_recv(a, r, p, v)) is not None:
                    assert key in posted and key not in used
                    used.add(key)
            assert used == posted


@pytest.mark.parametrize("name", ["gpipe", "1f1b", "interleaved", "zb-h1"])
def test_head_inflight_equals_the_last_chunk_of_the_lists(name):
    """The ledger's logits factor (GPipe m, ZB-H1 min(p, m), 1F1B and interleaved 1) is what the last
    rank's list keeps alive in its last chunk (the one holding the head)."""
    for p in (2, 3, 4, 8):
        for m in (1, 2, 3, 4, 8, 16):
            for v in ((1, 2, 4) if name == "interleaved" else (1,)):
                if name == "interleaved" and m % p:
                    continue
                acts = build_schedule(name, p, m, v)[p - 1]
                last = [a for a in acts if a.is_compute and a.chunk == v - 1]
                assert head_inflight(name, p, m, v) == max(inflight_trace(last)), (name, p, m, v)
    assert head_inflight(name, 1, 8) == 1


@pytest.mark.parametrize("name,p,m,v", [("gpipe", 3, 5, 1), ("1f1b", 4, 7, 1), ("interleaved", 4, 8, 2),
                                        ("interleaved", 3, 6, 1), ("interleaved", 16, 16, 8), ("zb-h1", 4, 6, 1),
                                        ("zb-v", 3, 7, 1), ("dualpipev", 2, 8, 1)])
def test_compute_orders_are_the_compute_actions_of_build_schedule(name, p, m, v):
    from parallel_lab.schedules.generators import compute_orders
    full = build_schedule(name, p, m, v)
    assert [list(o) for o in compute_orders(name, p, m, v)] == [[a for a in r if a.is_compute] for r in full]
    with pytest.raises(ParallelLabError, match="needs schedule 'interleaved'"):
        compute_orders("1f1b", p, m, 2)


def test_messages_at_once_is_counted_on_the_full_list():
    """``messages_at_once``'s closed forms (and, for the V schedules, its count on the list of ``min(m, 2p)``
    micro-batches) against the count on the full list of every valid ``m`` up to ``4p``, and on Meta's
    16 x 16 x 8 and a 16 x 32 x 8 interleaving; the executor measures the same counts
    (tests/distributed/test_comm_buffers.py)."""
    from parallel_lab.schedules.inflight import messages_at_once

    def counted(name: str, p: int, m: int, v: int) -> tuple[int, ...]:
        return tuple(max((len(a.ops) for a in r if a.kind == "P2P"), default=0)
                     for r in build_schedule(name, p, m, v))

    checked = 0
    for name, v in (("gpipe", 1), ("1f1b", 1), ("zb-h1", 1), ("interleaved", 2), ("interleaved", 3), ("zb-v", 1),
                    ("dualpipev", 1)):
        for p in (2, 3, 4, 5, 6):
            for m in range(1, 4 * p + 1):
                try:
                    want = counted(name, p, m, v)
                except ParallelLabError:                  # m not valid for this schedule
                    continue
                assert messages_at_once(name, p, m, v) == want, (name, p, m, v)
                checked += 1
    assert checked > 300
    for p, m, v in ((16, 16, 8), (16, 32, 8), (8, 8, 4), (12, 12, 2)):
        assert messages_at_once("interleaved", p, m, v) == counted("interleaved", p, m, v), (p, m, v)
    assert messages_at_once("interleaved", 16, 16, 8) == (2,) * 8 + (4,) * 7 + (2,)
    assert messages_at_once("1f1b", 4, 64) == (2, 2, 2, 2) and messages_at_once("gpipe", 4, 64) == (2, 2, 2, 1)
    assert messages_at_once("zb-v", 4, 20) == (2, 3, 3, 2) and messages_at_once("dualpipev", 3, 12) == (4,) * 3
