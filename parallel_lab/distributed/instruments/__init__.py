"""Instruments: measure on the ranks what the analytic core predicts (docs/conventions.md is the contract).

Four tools, one module each:

* ``tracer``: :class:`CommTracer` observes the plain ``torch.distributed`` calls from outside
  (``observe.py`` wraps them, the one tracing mechanism, the grader's too); a traced call is a
  ``comm.Collective`` plus timing (:class:`TracedCall`); :func:`compare_calls` and
  :func:`payload_by_dim` put traced and predicted calls side by side.
* ``saved``: :class:`SavedTensorMeter`, activations as the storage bytes saved for backward (peak and
  per scope), the ledger's ``activations`` and ``logits_and_loss``.
* ``memory``: :class:`BufferMeter`, the communication buffers' peaks by part, sampled through
  ``distributed/probe.py`` (every ``CommTracer`` carries one, ``tracer.buffers``);
  :func:`memtracker_snapshot`, torch's opinion (the state itself: ``model/state.py``).
* ``timeline``: :class:`Timeline`, per-rank intervals (``simulate.Interval``, the simulator's type) on
  a clock shared by the processes of one machine.

Each name is imported from its module (``from parallel_lab.distributed.instruments.tracer import
CommTracer``).
"""
