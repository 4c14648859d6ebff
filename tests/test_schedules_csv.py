"""torch's pipelining CSV format, both ways: round trips through torch's own parser and writer, torch's
schedule classes read into ours, and a learner's broken file reported at its first wrong cell."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from parallel_lab import schedule_csv
from parallel_lab.errors import ParallelLabError
from parallel_lab.schedules.actions import Placement
from parallel_lab.schedules.checks import validate
from parallel_lab.schedules.generators import build_schedule
from parallel_lab.simulate import simulate

T = pytest.importorskip("torch.distributed.pipelining.schedules")

CASES = [("gpipe", 2, 3, 1), ("1f1b", 4, 8, 1), ("interleaved", 4, 8, 2), ("zb-h1", 3, 5, 1), ("zb-v", 2, 3, 1),
         ("zb-v", 4, 8, 1), ("dualpipev", 2, 4, 1), ("dualpipev", 4, 10, 1)]


def compute(s):
    return [[a for a in acts if a.is_compute] for acts in s]


def torch_dump(actions: dict[int, list], path, fmt: str) -> None:
    """torch's own writer (``_PipelineScheduleRuntime._dump_csv``) on a bare object holding the lists."""
    ns = SimpleNamespace(pipeline_order=actions, pipeline_order_with_comms=actions)
    T._PipelineScheduleRuntime._dump_csv(ns, str(path), fmt)


def torch_load_compute_only(path, p: int, n_stages: int, m: int) -> dict[int, list]:
    """torch's own reader for compute-only files (``PipelineScheduleMulti._load_csv``), which also runs
    torch's validator (``_validate_schedule``: every stage's F before I/B before W, each exactly once)."""
    ns = SimpleNamespace(pipeline_order={})
    ns._validate_and_set_stage_mapping = lambda actions: T._validate_schedule(actions, p, n_stages, m)
    T.PipelineScheduleMulti._load_csv(ns, str(path))
    return ns.pipeline_order


@pytest.mark.parametrize("name,p,m,v", CASES, ids=str)
def test_round_trip_through_torchs_parser_and_writer(name, p, m, v, tmp_path):
    s = validate(build_schedule(name, p, m, v))
    # compute + comms: ours -> CSV -> torch's _Action.from_str -> torch's writer -> ours: the same lists
    ours = tmp_path / "ours.csv"
    schedule_csv.dump(s, ours)
    rows = ours.read_text().splitlines()
    parsed = {r: [T._Action.from_str(c) for c in row.split(",")] for r, row in enumerate(rows)}
    assert all(a is not None for acts in parsed.values() for a in acts)
    theirs = tmp_path / "theirs.csv"
    torch_dump(parsed, theirs, "compute_comms")
    back = schedule_csv.load(theirs)
    assert [list(r) for r in back] == [list(r) for r in s]
    assert back.placement.stages == s.placement.stages and back.overlapped == s.overlapped
    # compute-only: torch reads and validates it; what it read, written by torch, reads back to our compute
    # lists (the messages are lowered again, and the result validates)
    only = tmp_path / "only.csv"
    schedule_csv.dump(s, only, "compute_only")
    order = torch_load_compute_only(only, p, p * s.placement.v, m)
    torch_dump(order, theirs, "compute_only")
    again = schedule_csv.load(theirs)
    assert compute(again) == compute(s) and again.placement == s.placement
    assert simulate(again).step_time == pytest.approx(simulate(s).step_time)


@pytest.mark.parametrize("cls,p,m", [("ScheduleZBVZeroBubble", 2, 4), ("ScheduleZBVZeroBubble", 4, 8),
                                     ("ScheduleZBVZeroBubble", 4, 3), ("ScheduleDualPipeV", 2, 6),
                                     ("ScheduleDualPipeV", 4, 8)])
def test_torchs_schedules_read_into_ours(cls, p, m, tmp_path):
    """torch's ZB-V / DualPipeV lists (its generator) and torch's lowering of them (``_add_send_recv``),
    written by torch's writer, read back: the compute order is our generator's, the lowered lists validate
    under our rules and time like ours."""
    ns = SimpleNamespace(pp_group_size=p, _n_microbatches=m, num_stages=2 * p, _num_stages=2 * p)
    order = {r: getattr(T, cls)._calculate_single_rank_operations(ns, r) for r in range(p)}
    f = tmp_path / "torch.csv"
    torch_dump(order, f, "compute_only")
    ours = build_schedule("zb-v" if "ZBV" in cls else "dualpipev", p, m)
    got = schedule_csv.load(f)
    assert compute(got) == compute(ours) and got.placement == Placement.v_shape(p)
    assert got.overlapped == ours.overlapped
    lowered = T._add_send_recv({r: [a for a in acts if a is not None] for r, acts in order.items()},
                               stage_to_rank=lambda s: s if s < p else 2 * p - 1 - s, num_stages=2 * p)
    torch_dump(lowered, f, "compute_comms")
    theirs = schedule_csv.load(f)                  # validated: FIFO matching, no deadlock (both rules)
    assert compute(theirs) == compute(ours)
    assert simulate(theirs).step_time == pytest.approx(simulate(ours).step_time)


# ---- a learner's file with a mistake ------------------------------------------------------------------

GOOD = build_schedule("1f1b", 2, 2)


def rows_of(s):
    return [r.split(",") for r in schedule_csv.dumps(s).splitlines()]


def test_a_learners_file_is_reported_at_its_first_wrong_cell(tmp_path):
    rows = rows_of(GOOD)
    assert rows[1][:3] == ["1RECV_F0", "1F0", "1B0"]
    rows[1][1], rows[1][2] = rows[1][2], rows[1][1]                          # backward before forward
    with pytest.raises(ParallelLabError, match=r"^rank 1, action 1 \('1B0', i.e. B\(mb=0, chunk=0\)\): backward "
                                               r"before its forward$"):
        schedule_csv.from_rows(rows)
    rows = rows_of(GOOD)
    del rows[1][-1]                                                           # the last gradient never sent
    with pytest.raises(ParallelLabError, match=r"^rank 1, action 6 \('1B1'.*its output is never sent \(no "
                                               r"SEND_B\(mb=1, chunk=0, peer=0\)"):
        schedule_csv.from_rows(rows)
    rows = rows_of(GOOD)
    rows[0][3], rows[0][1] = rows[0][1], rows[0][3]                          # a send before its forward
    with pytest.raises(ParallelLabError, match=r"^rank 0, action 1 \('0SEND_F1', i.e. P2P.*sends a tensor before "
                                               r"its F\(mb=1, chunk=0\) has computed it"):
        schedule_csv.from_rows(rows)
    rows = rows_of(GOOD)
    rows[0][:4] = ["0F0", "0F1", "0SEND_F1", "0SEND_F0"]                     # sends swapped: FIFO mismatch
    with pytest.raises(ParallelLabError, match=r"^rank 1, action 0 \('1RECV_F0'.*receive #0 from rank 0 is "
                                               r"RECV_F\(mb=0.*send #0 to rank 1 is SEND_F\(mb=1"):
        schedule_csv.from_rows(rows)
    bad = tmp_path / "bad.csv"
    bad.write_text("0F0,0X1\n1F0\n")
    with pytest.raises(ParallelLabError, match=r"rank 0, action 1 \('0X1'\): not an action; write \[stage\]"):
        schedule_csv.load(bad)
    with pytest.raises(ParallelLabError, match=r"rank 1, action 0 \('0F1'\): virtual stage 0 is already run by "
                                               r"rank 0"):
        schedule_csv.loads("0F0,0B0\n0F1,0B1\n")
    with pytest.raises(ParallelLabError, match=r"rank 0, action 1 \('0F'\): F needs a micro-batch index"):
        schedule_csv.loads("0F0,0F\n")
    with pytest.raises(ParallelLabError, match="communication action in a compute-only"):
        schedule_csv.loads("0F0,0SEND_F0\n1F0\n", fmt="compute_only")


def test_a_learners_compute_only_file_is_lowered_validated_and_simulated():
    # a 2-rank 1F1B written by hand, compute actions only (torch's "simple" format)
    s = schedule_csv.loads("0F0,0F1,0B0,0B1\n1F0,1B0,1F1,1B1\n")
    assert s.placement == Placement.interleaved(2, 1)
    assert compute(s) == compute(GOOD)
    assert simulate(s).bubble_ratio == pytest.approx(1 / 2)             # (p - 1) / m
    with pytest.raises(ParallelLabError, match=r"^rank 0, action 2 \('0W0', i.e. W\(mb=0, chunk=0\)\): "
                                               r"weight-gradient pass W before its B"):
        schedule_csv.loads("0F0,0F1,0W0,0I0,0I1,0W1\n1F0,1I0,1W0,1F1,1I1,1W1\n")


# ---- parallel-lab bubble --schedule-file, and the two bubble figures named where they print -----------

def test_bubble_cli_reads_a_schedule_file_and_names_both_bubble_figures(tmp_path, cli_json):
    from conftest import run_cli

    f = tmp_path / "mine.csv"
    f.write_text("0F0,0F1,3F0,3B0,3F1,3B1,0B0,0B1\n1F0,2F0,1F1,2F1,2B0,1B0,2B1,1B1\n")
    j = cli_json("bubble", "--schedule-file", str(f))
    want = simulate(schedule_csv.load(f))
    assert (j["p"], j["m"], j["v"]) == (2, 2, 2) and j["bubble_ratio"] == pytest.approx(want.bubble_ratio)
    assert set(j["bubble_definitions"]) == {"bubble_ratio", "idle_fraction"}
    text = run_cli("bubble", "--schedule", "1f1b", "--stages", "4", "--microbatches", "8").stdout
    assert "bubble_ratio  0.3750 (37.5%): bubble time / ideal compute time" in text and "(p-1)/m" in text
    assert "idle fraction 0.2727 (27.3%) of 4 x 33 time units: idle time of all ranks" in text
    assert "zb-v: p=4 stages, m=8 micro-batches, v=2 chunks" in run_cli("bubble", "--schedule", "zb-v", "--stages",
                                                                       "4", "--microbatches", "8").stdout
    f.write_text("0F0,0F1,3F0,3W0,3F1,3B1,0B1,0B0\n1F0,2F0,1F1,2F1,2B0,1B0,2B1,1B1\n")
    bad = run_cli("bubble", "--schedule-file", str(f))
    assert bad.returncode == 2
    assert "rank 0, action 3 ('3W0', i.e. W(mb=0, chunk=1)): weight-gradient pass W before its B" in bad.stderr
    f.write_text("3F0,0F0,0F1,3B0,3F1,3B1,0B1,0B0\n1F0,2F0,1F1,2F1,2B0,1B0,2B1,1B1\n")
    assert "deadlock" in (e := run_cli("bubble", "--schedule-file", str(f)).stderr) and \
        "rank 0 waits at action 0 ('3F0')" in e


@pytest.mark.parametrize("name,p,m", [("1f1b", 3, 4), ("zb-v", 2, 4), ("dualpipev", 2, 4)])
def test_table_is_torchs_format_pipeline_order(name, p, m):
    s = build_schedule(name, p, m)
    for fmt in ("compute_only", "compute_comms"):
        rows = schedule_csv.to_rows(s, fmt)
        theirs = T._format_pipeline_order({r: [T._Action.from_str(c) for c in row] for r, row in enumerate(rows)})
        assert schedule_csv.table(s, fmt) == theirs
