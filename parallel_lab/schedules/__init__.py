"""Pipeline schedules as data: GPipe, 1F1B, interleaved 1F1B, ZB-H1, ZB-V and DualPipeV as per-rank action lists.

A *schedule* is ``list[list[Action]]``: one list per pipeline rank, executed in list order by that rank.
These lists are the only definition of a schedule in parallel_lab: the simulator (:mod:`parallel_lab.simulate`)
times them, the memory ledger counts their in-flight micro-batches, and the pipeline executor
(``parallel_lab.distributed.pipeline_parallel.pipeline_parallel``) runs them. The modules, in reading order:

* ``actions``: the action data (``F``, ``B``, ``W``, ``P2P``), the :class:`Placement` of chunks, ``Schedule``;
* ``orders``: each schedule's compute order per rank (the algorithms, a few lines each);
* ``p2p``: the point-to-point batches inserted between compute actions (``with_p2p``);
* ``generators``: the named schedules, ``build_schedule`` and ``compute_orders``;
* ``inflight``: in-flight micro-batches, peaks and messages at once (closed forms checked on the lists);
* ``execution``: running the lists under the point-to-point rules (``execute``); ``checks``: ``validate``.

The point-to-point semantics, grouping and activation lifetime: ``docs/schedules.md``.
"""
