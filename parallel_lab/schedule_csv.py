"""Schedules in torch's pipelining CSV format, both ways, with messages that point at the wrong cell.

``torch.distributed.pipelining`` stores a schedule as CSV: row ``r`` is pipeline rank ``r``'s list, one
action per cell, ``{stage}{kind}{micro-batch}`` with the global (virtual) stage: ``F``, ``I`` (input
gradient), ``W`` (weight gradient), ``B`` (full backward), ``SEND_F``/``RECV_F``/``SEND_B``/``RECV_B``, and
``(2F3;5B1)OVERLAP_F_B``. A compute-only file is lowered with ``with_p2p`` (receives posted when the sender
sends, as torch's ``_add_send_recv`` does); FSDP's ``UNSHARD``/``RESHARD``/``REDUCE_GRAD`` cells are
skipped. :func:`load` validates what it read and names the rank, the column and the cell of a mistake.
The format's details are in docs/schedule_csv.md.
"""

from __future__ import annotations

import csv
import io
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Literal

from .errors import ParallelLabError
from .inputs import read_text
from .schedules.actions import COMPUTE_KINDS, P2P, Action, Placement, Schedule
from .schedules.checks import validate
from .schedules.inflight import split_backward
from .schedules.p2p import with_p2p

Format = Literal["compute_only", "compute_comms"]

_CELL = re.compile(r"^(\d+)(F|I|B|W|UNSHARD|RESHARD|REDUCE_GRAD|SEND_F|RECV_F|SEND_B|RECV_B)(\d*)$")
_OVERLAP = re.compile(r"^\((.*)\)OVERLAP_F_B$")
_SKIPPED = ("UNSHARD", "RESHARD", "REDUCE_GRAD")
#: a schedule file is at most this many bytes (~0.5 s to read, check and simulate: 32 stages x 128 micro-batches)
MAX_FILE_BYTES = 256 * 1024
_HINT = "write [stage][F|I|B|W|SEND_F|RECV_F|SEND_B|RECV_B][micro-batch], e.g. 2F0, or (0F3;3B1)OVERLAP_F_B"


# --------------------------------------------------------------------------------------------------
# Writing
# --------------------------------------------------------------------------------------------------

def to_rows(schedule: list[list[Action]], fmt: Format = "compute_comms") -> list[list[str]]:
    """One row of cells per rank: our lists in torch's action strings (see the module docstring)."""
    if fmt not in ("compute_only", "compute_comms"):
        raise ParallelLabError(f"format {fmt!r}: pick compute_only or compute_comms")
    from .schedules.actions import placement_of

    place = placement_of(schedule)
    overlapped = getattr(schedule, "overlapped", None) or [set() for _ in schedule]
    rows = []
    for r, acts in enumerate(schedule):
        split = split_backward(acts)

        def cell(a: Action, r: int = r, split: set = split) -> str:
            kind = "I" if a.kind == "B" and (a.microbatch, a.chunk) in split else a.kind
            return f"{place.stage(r, a.chunk)}{kind}{a.microbatch}"

        row: list[str] = []
        i = 0
        while i < len(acts):
            a = acts[i]
            if a.kind == "P2P":
                if fmt == "compute_comms":
                    row += [cell(op) for op in a.ops]
                i += 1
                continue
            nxt = acts[i + 1] if i + 1 < len(acts) else None
            if nxt is not None and (a, nxt) in overlapped[r]:
                row.append(f"({cell(a)};{cell(nxt)})OVERLAP_F_B")
                i += 2
                continue
            row.append(cell(a))
            i += 1
        rows.append(row)
    return rows


def dumps(schedule: list[list[Action]], fmt: Format = "compute_comms") -> str:
    """The CSV text of a schedule (as torch's ``_dump_csv`` writes it: one row per rank)."""
    buf = io.StringIO()
    csv.writer(buf).writerows(to_rows(schedule, fmt))
    return buf.getvalue()


def dump(schedule: list[list[Action]], path: str | Path, fmt: Format = "compute_comms") -> None:
    Path(path).write_text(dumps(schedule, fmt), newline="")


def table(schedule: list[list[Action]], fmt: Format = "compute_only") -> str:
    """The lists as a grid, one row per position in the lists and one column per rank, the layout torch's
    ``_format_pipeline_order`` prints (a quick look at a schedule, e.g. a learner's, before simulating it)."""
    rows = to_rows(schedule, fmt)
    n = max((len(r) for r in rows), default=0)
    labels = ["Step " + str(i).zfill(len(str(n - 1))) for i in range(n)]
    cols = [r + [""] * (n - len(r)) for r in rows]
    heads = [f"Rank {r}" for r in range(len(rows))]
    # torch sizes rank r's column by its longest cell and by the r-th step label (not by "Rank r")
    width = [max([len(labels[r]) if r < n else 0] + [len(c) for c in col]) for r, col in enumerate(cols)]
    lines = [" " * (len(labels[0]) + 2) + " ".join(f"{h:<{w}}" for h, w in zip(heads, width, strict=True)) if n
             else ""]
    for i, label in enumerate(labels):
        lines.append(f"{label}: " + " ".join(f"{col[i]:<{w}}" for col, w in zip(cols, width, strict=True)))
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------------------------------
# Reading
# --------------------------------------------------------------------------------------------------

def _parse_cell(text: str, rank: int, col: int) -> list[tuple[int, str, int]]:
    """``(stage, kind, micro-batch)`` of one cell (two for an overlapped pair, none for skipped kinds)."""
    text = text.strip()
    where = f"rank {rank}, action {col} ({text!r})"
    if not text:
        return []
    m = _OVERLAP.match(text)
    if m:
        parts = [p.strip() for p in m.group(1).split(";") if p.strip()]
        got = [x for p in parts for x in _parse_cell(p, rank, col)]
        if len(got) != 2 or got[0][1] != "F" or got[1][1] not in ("B", "I"):
            raise ParallelLabError(f"{where}: an OVERLAP_F_B holds one forward then one backward, e.g. "
                                   "(0F3;3B1)OVERLAP_F_B")
        return got
    m = _CELL.match(text)
    if not m:
        raise ParallelLabError(f"{where}: not an action; {_HINT}")
    stage, kind, mb = int(m.group(1)), m.group(2), m.group(3)
    if kind in _SKIPPED:
        return []
    if mb == "":
        raise ParallelLabError(f"{where}: {kind} needs a micro-batch index, e.g. {stage}{kind}0")
    return [(stage, kind, int(mb))]


def from_rows(rows: Iterable[Iterable[str]], fmt: Format | None = None, check: bool = True) -> Schedule:
    """Our schedule from torch's cells, one row per rank; ``fmt`` None: compute + comms if any comm cell.

    With ``check`` the result is validated and a mistake is reported at its cell (see :func:`load`)."""
    parsed = [[(col, x) for col, text in enumerate(row) for x in _parse_cell(text, r, col)]
              for r, row in enumerate(list(row) for row in rows)]
    has_comms = any(k not in ("F", "I", "B", "W") for row in parsed for _, (_, k, _) in row)
    fmt = fmt or ("compute_comms" if has_comms else "compute_only")
    # which rank runs which stage: from the compute cells (the stage of a comm cell is that rank's too)
    rank_of: dict[int, int] = {}
    first_seen: dict[int, int] = {}
    for r, row in enumerate(parsed):
        for col, (stage, kind, _mb) in row:
            if kind in ("F", "I", "B", "W"):
                if rank_of.setdefault(stage, r) != r:
                    raise ParallelLabError(f"rank {r}, action {col} ('{stage}{kind}{_mb}'): virtual stage {stage} is "
                                           f"already run by rank {rank_of[stage]} (action {first_seen[stage]}); "
                                           "a stage lives on one rank")
                first_seen.setdefault(stage, col)
    n = len(parsed)
    missing = sorted(set(range(max(rank_of, default=-1) + 1)) - set(rank_of))
    if missing:
        raise ParallelLabError(f"no rank runs virtual stage {missing[0]}; the stages must be 0..{max(rank_of)} "
                               "with every one on some rank")
    place = Placement.from_stage_ranks(rank_of)
    if place.p != n:
        raise ParallelLabError(f"the file has {n} rows (ranks) but stages on only {place.p}; give every rank "
                               "its row")
    schedule = Schedule([], place)
    columns: list[list[int]] = []           # per rank: the CSV column of each of our actions
    overlapped: list[set[tuple[Action, Action]]] = []
    orders: list[list[Action]] = []
    for r, row in enumerate(parsed):
        acts: list[Action] = []
        cols: list[int] = []
        mine: set[tuple[Action, Action]] = set()
        batch: list[Action] = []
        batch_col = -1
        for k, (col, (stage, kind, mb)) in enumerate(row):
            if kind in ("F", "I", "B", "W"):
                if batch:
                    acts.append(P2P(*batch))
                    cols.append(batch_col)
                    batch = []
                rr, chunk = place.holder(stage)
                a = Action({"I": "B"}.get(kind, kind), mb, chunk)
                acts.append(a)
                cols.append(col)
                prev = row[k - 1] if k > 0 else None
                if prev is not None and prev[0] == col:              # second half of an OVERLAP_F_B cell
                    mine.add((acts[-2], a))
                continue
            if fmt == "compute_only":
                raise ParallelLabError(f"rank {r}, action {col} ({stage}{kind}{mb}): a communication action in a "
                                       "compute-only schedule; remove it or read the file as compute_comms")
            rr, chunk = _comm_holder(place, r, col, stage, kind, mb)
            nb = place.neighbour(r, chunk, +1 if kind in ("SEND_F", "RECV_B") else -1)
            if nb is None or nb[0] == r:
                raise ParallelLabError(f"rank {r}, action {col} ({stage}{kind}{mb}): virtual stage {stage} has no "
                                       f"neighbour on another rank in that direction; remove the op")
            if not batch:
                batch_col = col
            batch.append(Action(kind, mb, chunk, nb[0]))
        if batch:
            acts.append(P2P(*batch))
            cols.append(batch_col)
        orders.append([a for a in acts if a.kind in COMPUTE_KINDS])
        schedule.append(acts)
        columns.append(cols)
        overlapped.append(mine)
    cells = _cells(parsed)
    if fmt == "compute_only":
        if check:   # the learner's own mistakes first, on the simplest lowering (receives at their consumers)
            plain = _lower(orders, place, overlapped, "consumer")
            _at_cells(lambda: _free_checks(plain), _compute_columns(plain, parsed), cells)
        schedule = _at_cells(lambda: _lower(orders, place, overlapped, "sender"), None, cells)
        columns = _compute_columns(schedule, parsed)
    schedule.overlapped = overlapped
    if check:
        _at_cells(lambda: validate(schedule), columns, cells)
    return schedule


def _compute_columns(schedule: Schedule, parsed: list) -> list[list[int]]:
    """Per rank, the CSV column of each action of a lowered compute-only file (-1 for the added P2P)."""
    columns = []
    for r, row in enumerate(parsed):
        comp_cols = iter(col for col, (_s, kind, _m) in row if kind in ("F", "I", "B", "W"))
        columns.append([next(comp_cols) if a.kind != "P2P" else -1 for a in schedule[r]])
    return columns


def _free_checks(schedule: Schedule) -> None:
    from .schedules.checks import match_checks, static_checks
    from .schedules.execution import execute

    static_checks(schedule)
    match_checks(schedule)
    execute(schedule, {"F": 1.0, "B": 1.0, "W": 1.0})


def _comm_holder(place: Placement, r: int, col: int, stage: int, kind: str, mb: int) -> tuple[int, int]:
    if not 0 <= stage < place.n_stages:
        raise ParallelLabError(f"rank {r}, action {col} ({stage}{kind}{mb}): virtual stage {stage} is not in "
                               f"0..{place.n_stages - 1}")
    rr, chunk = place.holder(stage)
    if rr != r:
        raise ParallelLabError(f"rank {r}, action {col} ({stage}{kind}{mb}): virtual stage {stage} runs on rank "
                               f"{rr}; a rank sends and receives only for its own stages")
    return rr, chunk


def _lower(orders: list[list[Action]], place: Placement, overlapped: list[set[tuple[Action, Action]]],
           recv_at: Literal["consumer", "sender"]) -> Schedule:
    """A compute-only schedule with its messages: overlapped pairs as groups, receives when sent."""
    groups = []
    for order, mine in zip(orders, overlapped, strict=True):
        sizes, i = [], 0
        while i < len(order):
            n = 2 if i + 1 < len(order) and (order[i], order[i + 1]) in mine else 1
            sizes.append(n)
            i += n
        groups.append(sizes)
    return with_p2p(orders, place.v, groups, place, overlapped, recv_at=recv_at)


def _cells(parsed: list[list[tuple[int, tuple[int, str, int]]]]) -> list[dict[int, str]]:
    """Per rank, column -> the cell's action text (the first action of an overlapped cell)."""
    out: list[dict[int, str]] = []
    for row in parsed:
        d: dict[int, str] = {}
        for col, (s, k, m) in row:
            d.setdefault(col, f"{s}{k}{m}")
        out.append(d)
    return out


_WHERE = re.compile(r"^rank (\d+), action (\d+) (.*?): (.*)$", re.S)
_WAITS = re.compile(r"rank (\d+) waits at action (\d+) ")


def _at_cells(run, columns: list[list[int]] | None, cells: list[dict[int, str]]):
    """``run()``; a ParallelLabError naming ``rank r, action i`` of our lists is re-worded to name the CSV
    cell (``rank r, action C ('cell', i.e. ours)``), and so is each ``rank r waits at action i`` of a
    deadlock. Without ``columns`` (lowering) only the message's own CSV-free wording is kept."""
    try:
        return run()
    except ParallelLabError as e:
        msg = str(e)

        def col_of(r: int, i: int) -> int:
            if columns is None or r >= len(columns) or i >= len(columns[r]):
                return -1
            return columns[r][i]

        m = _WHERE.match(msg)
        if m is not None:
            r, i, ours, why = int(m.group(1)), int(m.group(2)), m.group(3), m.group(4)
            col = col_of(r, i)
            if col >= 0:
                msg = f"rank {r}, action {col} ({cells[r].get(col, '')!r}, i.e. {ours}): {why}"
            else:           # a batch of messages the lowering of a compute-only file added
                msg = f"rank {r}: the messages lowered before its action {i}, {ours}: {why}"

        def waits(mw: re.Match) -> str:
            r, col = int(mw.group(1)), col_of(int(mw.group(1)), int(mw.group(2)))
            return f"rank {r} waits at action {col} ({cells[r].get(col, '')!r}) " if col >= 0 else mw.group(0)

        msg = _WAITS.sub(waits, msg)
        raise ParallelLabError(msg) from None


def loads(text: str, fmt: Format | None = None, check: bool = True) -> Schedule:
    """A schedule from CSV text (torch's format)."""
    return from_rows(csv.reader(io.StringIO(text)), fmt, check)


def load(path: str | Path, fmt: Format | None = None, check: bool = True) -> Schedule:
    """A schedule from a CSV file in torch's format (``fmt`` None: detected), validated with ``check``.

    Errors name the first wrong action as ``rank R, action C ('cell')``: ``R`` the row, ``C`` the column
    of the cell in that row, then the reason, e.g. ``rank 1, action 4 ('2F1'): forward before its input
    activations were received``."""
    return loads(read_text(path, "schedule file", MAX_FILE_BYTES), fmt, check)
