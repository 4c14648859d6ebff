"""Lesson 01: the seed's figures, computed by the library inside the notebook, and the measured run."""

from __future__ import annotations


def check(text: str, nb) -> None:
    for figure in ("112.00 GB", "38.50", "26.25", "14.00", "104.15 GB", "18.25 GB", "1.07 GB"):
        assert figure in text, figure
    assert "linear x2, scores x4" in text
    if "ZeRO-0 on 2 ranks" in text:       # the real run happened (torch and parallel_lab.distributed present)
        assert "measured state bytes per parameter per rank: 16.00" in text
