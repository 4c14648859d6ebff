"""Exercise predict_bubble (predict): the bubble of a pipeline schedule.

With ``p`` stages and ``m`` micro-batches, a forward ``F`` and a backward ``B`` cost one unit each (ZB-H1
splits the backward into ``B``, the input gradient, and ``W``, the weight gradient, one unit each; an
unsplit backward costs ``B + W``). The *bubble ratio* is the idle time of the busiest stage over its
compute time. Known results (Narayanan et al. 2021; Qi et al. 2023):

* GPipe and 1F1B: ``(p - 1) / m``;
* interleaved 1F1B with ``v`` model chunks per stage: ``(p - 1) / (v m)``;
* ZB-H1 (``m >= p``): a bubble time of ``(p - 1)(F + B - W)``, over a compute time of ``m (F + B + W)``.

Peak in-flight micro-batches (activations held at once) on stage ``r``: GPipe ``m``; 1F1B
``min(p - r, m)``.

Implement ``bubble_ratio(schedule, p, m, v=1)`` for ``schedule`` in ``gpipe``, ``1f1b``, ``interleaved``,
``zb-h1`` (``m >= p``), and ``peak_inflight(schedule, p, m, stage)`` for ``gpipe`` and ``1f1b``. Graded
(1e-9): against the library's closed forms and against the simulated timelines of the executable action
lists (``parallel_lab.simulate``), for many ``(p, m, v)``.
Check: ``parallel-lab grade predict_bubble exercises/predict_bubble/starter.py``.
"""

from __future__ import annotations


def bubble_ratio(schedule: str, p: int, m: int, v: int = 1) -> float:
    # TODO
    raise NotImplementedError("bubble_ratio")


def peak_inflight(schedule: str, p: int, m: int, stage: int) -> int:
    # TODO
    raise NotImplementedError("peak_inflight")
