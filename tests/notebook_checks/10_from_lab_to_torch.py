"""Companion 10: torch's DDP, FSDP2, TP and pipelining beside the lab's on the same 2 ranks: equal losses and
parameters, the lab's predicted collectives against torch's measured ones, FSDP2's shards against the
ledger, and context_parallel refused on CPU."""

from __future__ import annotations

import re

from notebook_checks import assert_no_answer_everywhere


def _table(text: str, name: str) -> list[tuple[str, int, int, int, int]]:
    """Rows (kind, bytes, predicted, lab, torch) of one engine's call table."""
    block = text.split(f"{name} (rank 0)", 1)[1].split("payload per step", 1)[0]
    return [(k, int(b.replace(",", "")), int(p), int(lab), int(t))
            for k, b, p, lab, t in re.findall(r"^  (\w+) +([\d,]+) +(\d+) +(\d+) +(\d+)$", block, re.M)]


def check(text: str, nb) -> None:
    assert_no_answer_everywhere(text, nb)
    assert len([c for c in nb.cells if c.cell_type == "code" and "check(" in c.source]) == 2
    # the library's torch code is on the page before the launch
    for key in ("fully_shard(block)", '"mlp.down": RowwiseParallel()}', "def __torch_dispatch__"):
        assert key in text, key
    assert text.index("fully_shard(block)") < text.index("trained on 2 ranks in")
    # (1) equal: DDP and FSDP bitwise on both ranks, TP and PP to rounding
    for name in ("DDP", "FSDP"):
        for rank in (0, 1):
            assert re.search(rf"^{name} +rank {rank}: .*max \|loss lab - torch\| = 0\.0e\+00; "
                             rf"max \|param lab - torch\| = 0\.0e\+00 over 21 tensors$", text, re.M), (name, rank)
    for name, rank, tensors in (("TP", 0, 21), ("TP", 1, 21), ("PP", 1, 11)):
        m = re.search(rf"^{name} +rank {rank}: .*max \|loss lab - torch\| = ([\d.e+-]+); "
                      rf"max \|param lab - torch\| = ([\d.e+-]+) over {tensors} tensors$", text, re.M)
        assert m and float(m[1]) < 1e-5 and float(m[2]) < 1e-4, (name, rank, m and m.groups())
    # (2) bytes: FSDP and PP predicted = lab = torch call for call; DDP same total, other buckets; TP: 16 vs 10
    for name in ("FSDP", "PP"):
        rows = _table(text, name)
        assert rows and all(p == lab == t for _, _, p, lab, t in rows), (name, rows)
    assert ("all_gather", 726016, 4, 4, 4) in _table(text, "FSDP")
    assert ("reduce_scatter", 524800, 1, 1, 1) in _table(text, "FSDP")
    ddp = _table(text, "DDP")
    assert all(p == lab for _, _, p, lab, _ in ddp) and sum(r[3] for r in ddp) == 10 and sum(r[4] for r in ddp) == 6
    assert "payload per step: predicted 1,976,832 B, lab 1,976,832 B, torch 1,976,832 B" in text
    tp = _table(text, "TP")
    assert ("all_reduce", 65536, 10, 10, 16) in tp and ("all_reduce", 512, 3, 3, 3) in tp
    assert "payload per step: predicted 5,405,696 B, lab 5,405,696 B, torch 5,405,696 B" in text
    # memory: ledger = lab = FSDP2's to_local shards
    for cat, value in (("parameters", "988,416"), ("gradients", "988,416"), ("optimizer_states", "1,976,832")):
        assert re.search(rf"^  {cat} +{value} +{value} +{value}$", text, re.M), cat
    assert "FSDP2 all-gathers per step, rank 0: 5" in text
    # (3) CP: refused on CPU with torch's own messages; the ring kernels are CUDA's
    assert ("default SDPA backend: NotImplementedError: Operator "
            "aten._scaled_dot_product_flash_attention_for_cpu") in text
    assert "math SDPA backend: RuntimeError:" in text
    assert "_scaled_dot_product_flash_attention" in text.split("into ring attention:", 1)[1]
    assert "image/png" in str(nb)
