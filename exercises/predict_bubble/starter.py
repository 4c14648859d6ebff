"""Exercise predict_bubble (predict): the bubble of a pipeline schedule.

With ``p`` stages and ``m`` micro-batches, a forward ``F`` and a backward ``B`` cost one unit each (ZB-H1
splits the backward into ``B``, the input gradient, and ``W``, the weight gradient, one unit each; an
unsplit backward costs ``B + W``). The *bubble ratio* is the idle time of the busiest stage over its
compute time. Derive it from the timelines (Narayanan et al. 2021; Qi et al. 2023; lesson 04): draw a
small case by hand, find how long the busiest stage waits, then generalise.

* GPipe runs every forward, then every backward; 1F1B interleaves them after a warm-up. Is their bubble
  different?
* Interleaved 1F1B gives each stage ``v`` model chunks (each ``1 / v`` of its layers, so a chunk's forward
  takes ``1 / v`` of the time): what happens to the warm-up and the drain?
* ZB-H1 (``m >= p``) splits the backward; a ``W`` depends on nothing downstream and can fill idle time.
  Which part of the 1F1B bubble is left?

Peak in-flight micro-batches (activations held at once) on stage ``r``: how many forwards has stage ``r``
run before its first backward, in GPipe and in 1F1B?

Implement ``bubble_ratio(schedule, p, m, v=1)`` for ``schedule`` in ``gpipe``, ``1f1b``, ``interleaved``,
``zb-h1`` (``m >= p``), and ``peak_inflight(schedule, p, m, stage)`` for ``gpipe`` and ``1f1b``. Graded
(1e-9): against the library's closed forms and against the simulated timelines of the executable action
lists (``parallel_lab.simulate``), for many ``(p, m, v)``.
Written answer (ungraded, read by your teacher; the batch CSV carries it): ``BUBBLE_VS_MEMORY`` below.
Check: ``parallel-lab grade predict_bubble exercises/predict_bubble/starter.py``.
"""

from __future__ import annotations


def bubble_ratio(schedule: str, p: int, m: int, v: int = 1) -> float:
    # TODO
    raise NotImplementedError("bubble_ratio")


def peak_inflight(schedule: str, p: int, m: int, stage: int) -> int:
    # TODO
    raise NotImplementedError("peak_inflight")


#: 1F1B has the bubble of GPipe; interleaving divides it by v and ZB-H1 shrinks it further. What does each of them
#: cost in activation memory or in messages, and when would you accept the larger bubble? (a few sentences)
BUBBLE_VS_MEMORY = """
"""
