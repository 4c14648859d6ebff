"""Exercise interleaved_1f1b (implement): interleaved 1F1B (Narayanan et al. 2021) written as an action list.

Interleaving cuts the model into ``p v`` chunks and gives each of the ``p`` ranks ``v`` of them: chunk ``c``
of rank ``r`` is virtual stage ``c p + r`` (``schedules.Placement.interleaved``), so a micro-batch passes
through every rank ``v`` times, each time through a chunk ``1/v`` as long. ``F(mb, c)`` / ``B(mb, c)`` run
micro-batch ``mb``'s forward / backward through local chunk ``c``. The warm-up and drain are then made of
short chunks: with equal F and B costs the bubble is ``(p - 1) / (v m)`` instead of 1F1B's ``(p - 1) / m``.
Megatron-LM runs micro-batches in groups of ``p``: a group through chunk 0, then through chunk 1, and so on.
Settle first: after chunk ``c`` of the last rank, where does a micro-batch go next? In which chunk order
must a rank run its backwards? How many forwards must rank ``r`` run (warm-up) before the first backward
can reach it, so that no rank waits in the steady state?

Implement ``interleaved_1f1b(p, m, v)``: ``p`` lists of ``F``/``B`` actions only, each ``(mb, c)`` once per
rank. Requirements: with ``v > 1``, ``m`` must be a multiple of ``p`` (raise ``ValueError`` otherwise);
``v = 1`` is plain 1F1B (any ``m``). The grader inserts the sends and receives (``schedules.p2p.with_p2p``,
a forward directly followed by a backward posted as one round, Megatron's ``send_forward_recv_backward``).
Graded: the library's validator accepts it (dependencies, matched messages, no deadlock); its simulated
bubble is ``(p - 1) / (v m)`` (1e-9); no rank holds more ``(mb, c)`` pairs than interleaved 1F1B does
(``schedules.inflight.peak_inflight``); the pipeline executor runs it on 2 CPU ranks equal to one process.
Check: ``parallel-lab grade interleaved_1f1b exercises/interleaved_1f1b/starter.py``.
"""

from __future__ import annotations

from parallel_lab.schedules.actions import Action, B, F


def interleaved_1f1b(p: int, m: int, v: int) -> list[list[Action]]:
    # TODO: refuse m not a multiple of p (v > 1); the rank's k-th forward and k-th backward as (mb, chunk);
    # TODO: for each rank r: warm-up forwards, then one forward and one backward in turn, then the drain
    raise NotImplementedError("interleaved_1f1b")


__all__ = ["Action", "B", "F", "interleaved_1f1b"]
