"""Lesson 00: the six collectives on 4 ranks (before/after drawn, bytes per rank measured = predicted), the ring
all-reduce by sends (2 (n-1)/n M per rank, equal to dist.all_reduce), the alpha-beta crossovers, a shared link
and the micro-benchmark's fit."""

from __future__ import annotations

import re

from notebook_checks import assert_no_answer_everywhere, markdown_of, number


def _pngs(cell) -> int:
    return sum("image/png" in o.get("data", {}) for o in cell.get("outputs", []))


def check(text: str, nb) -> None:
    assert re.search(r"Core path: about \d+ minutes", nb.cells[0].source)   # its value: tests/test_lesson_time.py
    assert "4 ranks ran 7 collectives" in text
    checks = [c for c in nb.cells if c.cell_type == "code" and "check(" in c.source]
    assert len(checks) >= 7, len(checks)
    assert_no_answer_everywhere(text, nb)
    assert "rank 3 after the all-reduce, chunk by chunk: [1111.0, 2222.0, 3333.0, 4444.0]" in text
    # bytes per rank: measured by the tracer = predicted by comm.Collective, for each of the six calls
    rows = dict((name.strip(), (int(msg.replace(",", "")), m, p, eq)) for name, msg, m, p, eq in re.findall(
        r"^(all_reduce|all_gather|reduce_scatter|all_to_all|broadcast|send / recv) +([\d,]+) B +([\d,]+) B / +"
        r"([\d,]+) B +equal: (\w+)$", text, re.M))
    assert len(rows) == 6, rows
    for name, (msg, measured, predicted, equal) in rows.items():
        assert msg == 16_000 and measured == predicted and equal == "True", (name, rows[name])
    assert rows["all_reduce"][1] == "24,000" and rows["broadcast"][1] == rows["send / recv"][1] == "16,000"
    assert all(rows[k][1] == "12,000" for k in ("all_gather", "reduce_scatter", "all_to_all"))
    # the ring by sends: every rank sent 2 (n-1)/n x 1 MB and got dist.all_reduce's result
    ring = re.findall(r"^rank (\d): 6 sends, 1,500,000 B sent; predicted 2 \(n-1\)/n x M = 1,500,000 B; "
                      r"equal: True; largest difference from dist.all_reduce: ([\d.e+-]+)$", text, re.M)
    assert [r for r, _ in ring] == ["0", "1", "2", "3"], ring
    assert all(float(d) < 1e-5 for _, d in ring), ring
    # the alpha-beta table and crossovers (H100 preset, Thakur et al.'s forms)
    for line in ("ring                               14        1.75",
                 "binomial tree                       6           6",
                 "recursive doubling                  3           3",
                 "Rabenseifner                        6        1.75"):
        assert line in text, line
    assert "p = 64: ring and binomial tree cross at 5,682,243 B" in text
    md = markdown_of(nb)
    assert "latency-bound below 4.0 MB" in md and "beats it below 941 kB" in md, md
    # the shared card: the TP all-reduce takes about twice as long
    alone = number(r"tp: all_reduce of [\d.]+ MB over 16 GPUs, [\d.]+ MB on the wire: alone ([\d.]+) ms", text)
    shared = number(r"tp: all_reduce .* sharing the card ([\d.]+) ms", text)
    assert 1.8 < shared / alone < 2.0, (alone, shared)
    # the micro-benchmark ran on 4 ranks and its fit has a positive bandwidth
    assert text.count("on 4 ranks:") == 3
    assert number(r"fitted: alpha [\d.]+ ms, bandwidth ([\d.]+) GB/s", text) > 0
    assert "8 nodes (64 GPUs), 16 MB: ring 1.89 ms, binomial tree 3.96 ms -> ring is faster" in text
    # pictures: six before/after figures in one cell, the ring's steps, the chart, the shared link
    figures = [_pngs(c) for c in nb.cells if c.cell_type == "code"]
    assert 6 in figures and sum(figures) >= 9, figures
    # the library's own ring is on the page, and the helper cells are hidden
    assert "def ring_reduce_scatter_" in md and "dist.isend" in md
    hidden = [c for c in nb.cells if c.metadata.get("jupyter", {}).get("source_hidden")]
    assert len(hidden) >= 4 and all("hide-input" in c.metadata.get("tags", []) for c in hidden)


# The answer key (tests/test_lesson_answers.py): a right answer to every question, worked out from the lesson's
# text; a plausible wrong one (the mistake in its comment); and the diagnosis the feedback must give for it.
ANSWERS = {
    "my_rd_crossover_bytes": 14883720,            # (126 - 6) alpha B / (6 - 2 x 63/64)
    "my_hier_network_bytes": 218750000,           # 2 (8-1)/8 x 1 GB / 8
    "my_rank3_chunk2": 3333,                      # 3 + 30 + 300 + 3000: chunk 2 of every rank, summed
    "my_ring_bytes": 1500000,                     # 2 (n-1)/n x M = 2 x 3 x 250,000
    "my_latency_bound_bytes": 4e6,                # 14 steps x 10 us = 1.75 x m / 50 GB/s
    "my_crossover_bytes": 941176,                 # 14 a + 1.75 m/B = 6 a + 6 m/B: m = 8 a B / 4.25
    "my_tp_shared_ms": 5.33,                      # 125.8 MB at 25 GB/s while both run, + 30 steps x 10 us
    "my_busbw": 350,                              # 200 GB/s x 2 (n-1)/n = 1.75
    "my_tree_nodes": 32,                          # 256 GPUs: tree 16 x 330 us < ring 510 x 10 us + 640 us
}
WRONG = {
    "my_rd_crossover_bytes": 10000000,            # (126 - 6) alpha B / 6: the ring's own bytes forgotten
    "my_hier_network_bytes": 1968750000,          # the flat ring over 64 GPUs
    "my_rank3_chunk2": 3330,                      # rank 0's share (digit 0) left out
    "my_ring_bytes": 750000,                      # one phase only
    "my_latency_bound_bytes": 7e6,                # the ring's wire factor 1.75 forgotten
    "my_crossover_bytes": 1e6,                    # the ring's wire taken as 2 m, not 2 (p-1)/p m
    "my_tp_shared_ms": 2.82,                      # the TP call's time alone, the card not shared
    "my_busbw": 400,                              # the factor 2 without its (n-1)/n
    "my_tree_nodes": 16,                          # one doubling short: at 16 nodes the ring still wins
}
HINTS = {
    "my_rd_crossover_bytes": "bytes count too",
    "my_hier_network_bytes": "flat ring",
    "my_rank3_chunk2": "too low",
    "my_ring_bytes": "leaves out one of",
    "my_latency_bound_bytes": "too high",
    "my_tp_shared_ms": "too low",
    "my_tree_nodes": "a factor 2 smaller",
}
