"""ZB-V and DualPipeV: the V placement, torch's own orders, memory and bubble closed forms, broken V lists.

The published facts checked here: ZB-V (Qi et al. 2024, section 6) holds at most 1F1B's first-stage
activations (p micro-batches of a whole stage); DualPipe (DeepSeek-V3 report, table 2) holds "PP + 1" stage
activations with PP stages (here 2p chunk-stages: 2p + 1); the orders are torch's ``ScheduleZBVZeroBubble``
and ``ScheduleDualPipeV``, action for action. The bubble closed forms are checked against the simulator.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from parallel_lab.errors import ParallelLabError
from parallel_lab.schedules.actions import P2P, Action, Placement, Schedule
from parallel_lab.schedules.checks import validate
from parallel_lab.schedules.execution import execute
from parallel_lab.schedules.generators import build_schedule
from parallel_lab.schedules.inflight import (
    head_inflight,
    inflight_trace,
    peak_activation_units,
    peak_inflight,
    peak_inflight_of,
    split_backward,
)
from parallel_lab.schedules.orders import dualpipev_order, zb_v_order
from parallel_lab.schedules.p2p import input_recv, local_input, with_p2p
from parallel_lab.simulate import Costs, bubble_formula, simulate

PS = (1, 2, 3, 4, 8)
UNIT = {"F": 1.0, "B": 1.0, "W": 1.0}


def v_grid():
    for p in PS:
        for m in list(range(1, 19)) + [32]:
            yield "zb-v", p, m
            if m >= 2 * p:
                yield "dualpipev", p, m


GRID = list(v_grid())


@pytest.mark.parametrize("p", PS)
def test_every_v_schedule_validates_under_both_completion_rules(p):
    for name, pp, m in GRID:
        if pp == p:
            s = validate(build_schedule(name, p, m))       # includes the in-order (one NCCL stream) run
            assert s.placement == Placement.v_shape(p) and s.placement.name == "v"


def test_v_placement_table():
    pl = Placement.v_shape(4)
    assert pl.stages == ((0, 7), (1, 6), (2, 5), (3, 4)) and pl.v == 2 and pl.n_stages == 8
    assert pl.holder(0) == (0, 0) and pl.holder(7) == (0, 1) and pl.holder(4) == (3, 1)
    assert pl.neighbour(3, 0, +1) == (3, 1)                     # the turn of the V stays on rank 3
    assert pl.neighbour(0, 1, +1) is None and pl.neighbour(0, 0, -1) is None
    assert Placement.interleaved(4, 2).stages == ((0, 4), (1, 5), (2, 6), (3, 7))
    assert Placement.from_stage_ranks({s: r for r, row in enumerate(pl.stages) for s in row}) == pl
    with pytest.raises(ParallelLabError, match="each exactly once"):
        Placement(((0, 1), (1, 2)))
    with pytest.raises(ParallelLabError, match="same number"):
        Placement(((0, 1), (2,)))


def test_the_turn_of_the_v_is_local_and_the_peers_follow_the_table():
    p, m = 4, 8
    s = build_schedule("zb-v", p, m)
    pl = s.placement
    for r, acts in enumerate(s):
        for a in acts:
            for op in a.ops:
                step = +1 if op.kind in ("SEND_F", "RECV_B") else -1
                assert op.peer == pl.neighbour(r, op.chunk, step)[0] != r
    # rank 3 never sends its chunk 0 forward nor its chunk 1 backward: stage 3 -> stage 4 is on the same rank
    ops3 = [op for a in s[3] for op in a.ops]
    assert not [op for op in ops3 if (op.kind, op.chunk) in (("SEND_F", 0), ("SEND_B", 1), ("RECV_F", 1))]
    f1 = Action("F", 0, 1)
    assert local_input(f1, 3, pl) == ("F", 0, 0) and input_recv(f1, 3, p, 2, pl) is None
    assert input_recv(f1, 2, p, 2, pl) == ("RECV_F", 0, 1) and local_input(f1, 2, pl) is None
    # rank 0 holds the embedding (stage 0) and the head (stage 7): its chunk 1 receives activations from rank 1
    assert input_recv(f1, 0, p, 2, pl) == ("RECV_F", 0, 1)
    assert input_recv(Action("B", 0, 1), 0, p, 2, pl) is None


# ---- the same orders as torch.distributed.pipelining -------------------------------------------------

def torch_orders(cls_name: str, p: int, m: int) -> dict[int, list[str]]:
    """torch's compute-only lists (its generator, called without building stages), sub-actions unrolled."""
    from torch.distributed.pipelining import schedules as T

    ns = SimpleNamespace(pp_group_size=p, _n_microbatches=m, num_stages=2 * p, _num_stages=2 * p)
    out = {}
    for r in range(p):
        row = []
        for a in getattr(T, cls_name)._calculate_single_rank_operations(ns, r):
            if a is not None:
                row += [str(x) for x in a.sub_actions] if a.sub_actions else [str(a)]
        out[r] = row
    return out


def as_torch(order: list[Action], rank: int, pl: Placement) -> list[str]:
    split = split_backward(order)
    kinds = {"F": "F", "W": "W"}
    return [f"{pl.stage(rank, a.chunk)}{kinds.get(a.kind) or ('I' if (a.microbatch, a.chunk) in split else 'B')}"
            f"{a.microbatch}" for a in order]


@pytest.mark.parametrize("p", [1, 2, 3, 4, 8])
def test_orders_equal_torchs_schedule_classes(p):
    pl = Placement.v_shape(p)
    for m in range(1, 25):
        zb = zb_v_order(p, m)
        assert {r: as_torch(zb[r], r, pl) for r in range(p)} == torch_orders("ScheduleZBVZeroBubble", p, m), m
        if m >= 2 * p:
            dp, _ = dualpipev_order(p, m)
            assert {r: as_torch(dp[r], r, pl) for r in range(p)} == torch_orders("ScheduleDualPipeV", p, m), m


def test_dualpipev_overlapped_pairs_are_posted_together():
    s = build_schedule("dualpipev", 4, 12)
    for r, acts in enumerate(s):
        assert s.overlapped[r]
        for f, b in s.overlapped[r]:
            i = acts.index(f)
            assert acts[i + 1] == b and f.kind == "F" and b.kind == "B"         # no P2P between the two
            assert (b.microbatch, b.chunk) not in split_backward(acts)           # the overlapped B is full
    with pytest.raises(ParallelLabError, match="at least 2p = 8"):
        build_schedule("dualpipev", 4, 7)


# ---- memory ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name,p,m", [g for g in GRID if g[2] in (1, 2, 3, 5, 8, 9, 16, 32)], ids=str)
def test_peak_and_head_closed_forms_match_the_lists(name, p, m):
    s = build_schedule(name, p, m)
    assert peak_inflight_of(s) == [peak_inflight(name, p, m, 1, stage=r) for r in range(p)]
    if p > 1:
        head = [a for a in s[0] if a.is_compute and a.chunk == 1]                # rank 0's chunk 1 holds the head
        assert head_inflight(name, p, m) == max(inflight_trace(head))


def test_zb_v_memory_is_1f1b_first_stage_and_dualpipev_one_chunk_more():
    for p in (2, 3, 4, 8):
        for m in (2 * p, 4 * p):
            one_f_one_b = peak_activation_units("1f1b", p, m, stage=0)
            assert one_f_one_b == p
            assert [peak_activation_units("zb-v", p, m, stage=r) for r in range(p)] == [p] * p
            assert max(peak_inflight_of(build_schedule("dualpipev", p, m))) == 2 * p + 1   # "PP + 1", PP = 2p


# ---- bubble ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name,p,m", [g for g in GRID if g[1] > 1], ids=str)
def test_bubble_closed_form_matches_the_simulator(name, p, m):
    for c in (Costs(1, 1, 1), Costs(2, 2, 2)):
        assert simulate(build_schedule(name, p, m), c).bubble_ratio == pytest.approx(bubble_formula(name, p, m,
                                                                                                     1, c))


def test_zero_bubble_v_beats_the_older_schedules_with_equal_costs():
    c = Costs(1, 1, 1)
    for p in (2, 4, 8):
        m = 4 * p
        zbv, dpv = (simulate(build_schedule(n, p, m), c).bubble_ratio for n in ("zb-v", "dualpipev"))
        zbh1 = simulate(build_schedule("zb-h1", p, m), c).bubble_ratio
        ofob = simulate(build_schedule("1f1b", p, m), c).bubble_ratio
        assert zbv < zbh1 < ofob and dpv == pytest.approx(zbh1)
        assert ofob == pytest.approx((p - 1) / m) and zbv == pytest.approx((p - 1) / (6 * m))


def test_unequal_costs_are_simulated():
    c = Costs(1, 2, 0.5)
    assert bubble_formula("zb-v", 4, 8, 1, c) == simulate(build_schedule("zb-v", 4, 8), c).bubble_ratio


# ---- broken V lists: the message points at the first wrong action ------------------------------------

def test_a_message_for_the_local_hand_off_is_rejected():
    s = build_schedule("zb-v", 2, 2)
    acts = s[1]
    i = next(i for i, a in enumerate(acts) if a == Action("F", 0, 1))
    bad = Schedule(s, s.placement)
    bad[1] = acts[:i] + [P2P(Action("RECV_F", 0, 1, 1))] + acts[i:]
    with pytest.raises(ParallelLabError, match=rf"rank 1, action {i} .*virtual stage 1 is on this rank too, the "
                                               r"tensor is handed over locally; remove the op"):
        validate(bad)


def test_the_second_leg_before_the_first_is_rejected():
    s = build_schedule("zb-v", 2, 2)
    acts = list(s[1])
    i, j = acts.index(Action("F", 0, 0)), acts.index(Action("F", 0, 1))
    acts[i], acts[j] = acts[j], acts[i]
    bad = Schedule(s, s.placement)
    bad[1] = acts
    with pytest.raises(ParallelLabError, match=rf"rank 1, action {i} F\(mb=0, chunk=1\): forward before its "
                                               r"input: F\(mb=0, chunk=0\) of this rank \(virtual stage 1\)"):
        validate(bad)


def test_the_interleaved_peers_are_wrong_on_a_v():
    # the same compute order with the default (interleaved) placement talks to the wrong ranks; validate()
    # with the V placement names the first op that does
    orders = zb_v_order(2, 2)
    wrong = with_p2p(orders, 2)                                     # peers for the interleaved placement
    bad = Schedule(wrong, Placement.v_shape(2))
    with pytest.raises(ParallelLabError, match=r"rank 0, action 5 P2P.*SEND_F\(mb=0, chunk=1, peer=1\): virtual "
                                               r"stage 3 is the last one, there is no stage 4"):
        validate(bad)


def test_receives_posted_at_consumers_can_deadlock_one_in_order_stream_on_a_v():
    # why the V lists post each receive when the sender sends (torch's lowering): two streams flow between
    # the same ranks on a V, and with receives at their consumers one in-order stream waits in a cycle
    orders = zb_v_order(2, 4)
    late = with_p2p(orders, 2, placement=Placement.v_shape(2))
    execute(late, UNIT)                                             # per-op completion (gloo): fine
    with pytest.raises(ParallelLabError, match="deadlock"):
        execute(late, UNIT, in_order=True)
    execute(build_schedule("zb-v", 2, 4), UNIT, in_order=True)
