"""Exercise pipeline_1f1b (implement): the 1F1B pipeline schedule written as an action list.

A pipeline schedule is data (``parallel_lab.schedules``): for each of the ``p`` stages, the list of
compute actions it runs in order, ``F(i)`` (forward of micro-batch ``i``) and ``B(i)`` (its backward).
GPipe runs all ``m`` forwards and then all backwards, so stage 0 holds the activations of all ``m``
micro-batches at once. 1F1B (PipeDream-Flush, Narayanan et al. 2021) has the same bubble, ``(p - 1) / m``
of the ideal time with equal F and B costs, but stage ``r`` never holds more than ``min(p - r, m)``
micro-batches: it runs a few warm-up forwards (how many?), then alternates one forward and one backward,
then drains the remaining backwards.

Implement ``one_f_one_b(p, m)`` returning ``p`` lists of ``F``/``B`` actions (no sends or receives: the
grader inserts them with ``schedules.p2p.with_p2p``). Graded: the schedule passes the library's validator
(every backward after its forward, every receive matched, no deadlock); its simulated bubble is
``(p - 1) / m`` (tolerance 1e-9) and stage ``r``'s peak in-flight count is ``min(p - r, m)`` for several
``(p, m)``; the library's pipeline executor runs it on 2 CPU ranks (a 2-stage model, 4 micro-batches)
and the loss and parameters equal one process's within 1e-5, its point-to-point messages equal
``parallel_lab.comm``'s prediction call by call.
Check: ``parallel-lab grade pipeline_1f1b exercises/pipeline_1f1b/starter.py``.
"""

from __future__ import annotations

from parallel_lab.schedules.actions import Action, B, F


def one_f_one_b(p: int, m: int) -> list[list[Action]]:
    # TODO: for each stage r: warm-up forwards, then F/B pairs, then the remaining backwards
    raise NotImplementedError("one_f_one_b")


__all__ = ["Action", "B", "F", "one_f_one_b"]
