"""Lesson 09: Mixtral's counts, the ep memory and all-to-all figures, and the measured run."""

from __future__ import annotations


def check(text: str, nb) -> None:
    for figure in ("active per token: 12.88B", "routed experts 45.10B of 46.70B", "ep=8: parameters  14.49 GB",
                   "capacity C = ceil(1.25 * 2 * 4096 / 8) = 1280", "= 83.89 MB = 2.5 activations",
                   "no answer yet"):
        assert figure in text, figure
    assert "ep:   9.40 GB sent per GPU per step" in text and "on nvlink4" in text
    if "4 ranks" in text:                          # the real run happened
        assert "largest parameter difference against one process: " in text
        lines = [ln.split() for ln in text.splitlines()]
        for row in lines:
            if row and row[0] in ("ep", "dp", "pp") and len(row) == 3 and row[1][0].isdigit():
                assert row[1] == row[2], row          # measured == predicted bytes
            if row and row[0] in ("parameters", "gradients", "optimizer_states", "activations") and len(row) == 3:
                assert row[1] == row[2], row
        assert "tokens each expert rank computed" in text
