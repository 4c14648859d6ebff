"""Lesson 05: the ledger's s vs s^2 figures, the online-softmax merge, the causal balance, and the measured runs."""

from __future__ import annotations

import re


def check(text: str, nb) -> None:
    # every prediction cell ran with its placeholder and got "no answer yet", never a silent pass
    assert text.count("no answer yet") >= 7, text.count("no answer yet")
    for figure in ("linear terms 10.27 GB (x16), attention scores 549.76 GB (x256)",
                   "cp = 16: linear terms 0.642 GB per layer per GPU (the 8K figure: 0.642 GB)",
                   "after block B: m = 3, l = 1.5032",
                   "busiest / least busy 7.00", "zigzag     pairs per rank ['8,389,632', '8,389,632', '8,389,632', "
                   "'8,389,632'], busiest / least busy 1.00",
                   "zigzag     busiest rank / mean: 1.27", "work       busiest rank / mean: 1.03",
                   "allgather: forward all_gather x1 of 262,144 B",
                   "TP 8 + SP + CP 16  activations   0.64 GB per layer"):
        assert figure in text, figure
    merged, full = map(float, re.search(r"merged output ([\d.]+), softmax over all three keys at once ([\d.]+)",
                                        text).groups())
    assert abs(merged - full) < 1e-5 * full, (merged, full)
    if "every byte as predicted" in text:        # the real runs happened
        assert "every byte as predicted: True; every run equal to one process (parameters within 1e-4): True" in text
        measured, predicted = re.search(r"pairs computed per rank .*: measured (\[[\d, ]+\]), predicted from the "
                                        r"ring's tiles (\[[\d, ]+\])", text).groups()
        assert measured == predicted, (measured, predicted)
        assert "work speed-up on cp = 2: 2.00x of a 2.00x ceiling (100%)" in text
        for kind in ("ring", "allgather", "ulysses"):
            row = re.search(rf"^{kind} +([\d,]+) +([\d,]+) +([\d,]+) +([\d,]+) ", text, re.M)
            assert row and row.group(1) == row.group(2) and row.group(3) == row.group(4), kind
