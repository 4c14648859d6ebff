"""Pipeline parallelism: run one rank's action list (F, B, P2P; GPipe, 1F1B, interleaved, ZB, V).

One executor, no schedule logic: :func:`apply_pp` keeps each rank's stage (``stages.py``) and its list from
``schedules.generators.build_schedule(plan.schedule, p, m, v)``; :class:`PipelineExecutor` runs it. ``P2P``
posts its sends/receives together (``pp_communications.post``), ``F`` waits for its input, runs the chunk
(and ``loss / m`` on the last stage) and keeps the graph alive; ``B`` waits for ``dy`` and runs the backward,
freeing the micro-batch's activations. 1F1B (Narayanan et al. 2021, PipeDream-Flush) keeps at most ``p - r``
micro-batches in flight on rank ``r``; bubble ``(p - 1) / (m + p - 1)`` of the step (Huang et al. 2019).
A ``B`` split from its ``W`` (ZB-H1) and the V's local hand-offs go through ``zero_bubble.py``.
``rt.dp.set_sync(True)`` only before the step's last weight-gradient action (DDP/ZeRO sync once per step).
Measured: every action a ``rt.timeline`` span, per step a :class:`StepRecord`. Derivation: ``docs/pipeline.md``.
"""

from __future__ import annotations

import time
import weakref
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from parallel_lab.distributed import probe
from parallel_lab.distributed.model.data import Batch
from parallel_lab.distributed.model.model import AttnContext, make_context
from parallel_lab.distributed.pipeline_parallel.pp_communications import post
from parallel_lab.distributed.pipeline_parallel.stages import StageLayout, keep_stage, stage_layout
from parallel_lab.distributed.pipeline_parallel.zero_bubble import (
    Held,
    LocalHandoffs,
    backward_input_only,
    backward_weights,
)
from parallel_lab.distributed.runtime.runtime import Runtime
from parallel_lab.errors import ParallelLabError
from parallel_lab.schedules.actions import Action, Schedule, num_microbatches, placement_of
from parallel_lab.schedules.checks import validate
from parallel_lab.schedules.generators import build_schedule
from parallel_lab.schedules.inflight import split_backward
from parallel_lab.specs import ModelSpec, Plan


@dataclass(eq=False)
class _InFlight:
    """One (micro-batch, chunk) between its F and its last backward part: the graph and what B kept."""

    x: Tensor                                  # the chunk's input (leaf, requires grad)
    y: Tensor                                  # its output (or the loss on the last virtual stage)
    h0: Tensor | None = None                   # embedding output (virtual stage 0), a separate graph
    held: Held = field(default_factory=list)   # (node, weights, dY) a split B keeps for W

    def embedding_backward(self) -> None:
        """The embedding's weight gradient (virtual stage 0), which needs ``x.grad``."""
        if self.h0 is not None:
            torch.autograd.backward(self.h0, self.x.grad)


@dataclass(eq=False)
class _Step:
    """The state of one step on one rank: posted receives and sends, outputs waiting to be sent, the
    (mb, chunk) pairs in flight, and what is measured."""

    micro_batches: list[Batch]
    params: list[Tensor]
    local: LocalHandoffs                                                       # the V's turn, no message
    recvs: dict[tuple[str, int, int], tuple[Tensor, Any]] = field(default_factory=dict)    # (buffer, completion)
    sends: list[tuple[Any, Tensor]] = field(default_factory=list)
    outbox: dict[tuple[str, int, int], Tensor] = field(default_factory=dict)   # (SEND_F|SEND_B, mb, chunk)
    live: dict[tuple[int, int], _InFlight] = field(default_factory=dict)
    alive: weakref.WeakSet = field(default_factory=weakref.WeakSet)            # counts objects really alive
    contexts: dict[int, AttnContext] = field(default_factory=dict)
    rows: list[list[Any]] = field(default_factory=list)
    trace: list[int] = field(default_factory=list)
    live_peak: int = 0
    loss: float = 0.0
    compute_dtype: torch.dtype | None = None          # ZeRO-3 (no parameters left in the model): its gathers'

    @property
    def dtype(self) -> torch.dtype:
        if self.compute_dtype is not None:
            return self.compute_dtype
        return self.params[0].dtype if self.params else torch.float32

    @property
    def device(self) -> torch.device:
        return self.micro_batches[0].tokens.device

    def take(self, kind: str, a: Action) -> Tensor:
        """The buffer of a posted receive, once it has arrived."""
        buf, done = self.recvs.pop((kind, a.microbatch, a.chunk))
        done.wait()
        return buf


@dataclass
class StepRecord:
    """What one executed step looked like on this rank (times in ``perf_counter`` seconds)."""

    rank: int                                  # pipeline rank
    t_start: float
    t_end: float
    rows: list[list[Any]]                      # [rank, start, end, kind, microbatch, chunk]
    inflight_peak: int                         # (mb, chunk) pairs alive at once (counted objects)
    live_bytes_peak: int                       # saved-tensor bytes alive at the end of an action, peak
    inflight_trace: list[int] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return {"rank": self.rank, "t_start": self.t_start, "t_end": self.t_end, "rows": self.rows,
                "inflight_peak": self.inflight_peak, "live_bytes_peak": self.live_bytes_peak,
                "inflight_trace": self.inflight_trace}


# --------------------------------------------------------------------------------------------------
# The executor
# --------------------------------------------------------------------------------------------------

class PipelineExecutor:
    """Runs one rank's action list (``rt.forward_backward``); see the module docstring."""

    def __init__(self, rt: Any, layout: StageLayout, actions: list[Action], m: int):
        self.layout, self.actions, self.m = layout, actions, m
        self.split = split_backward(actions)
        self.pp_ranks = rt.grid.ranks["pp"]            # pipeline rank -> global rank
        self.group = rt.grid.groups["pp"]
        grads = [i for i, a in enumerate(actions)
                 if a.kind == "W" or (a.kind == "B" and (a.microbatch, a.chunk) not in self.split)]
        self.last_grad_action = grads[-1] if grads else -1
        self.records: list[StepRecord] = []

    def report(self) -> dict[str, Any]:
        """Plain data for ``RankResult.info["pp"]``: the layout and every step's :class:`StepRecord`."""
        return {"rank": self.layout.rank, "layers": self.layout.layers,
                "chunks": [list(c) for c in self.layout.chunks], "layout": self.layout.describe(),
                "steps": [rec.as_dict() for rec in self.records]}

    # ---- shapes ----------------------------------------------------------------------------------
    def activation_shape(self, rt: Any, micro: Batch) -> tuple[int, int, int]:
        """Shape of the tensor that crosses a stage boundary: ``(b, s_local, h)``; with sequence
        parallelism the activations between blocks are sequence-sharded (``s / tp``)."""
        b, s = micro.tokens.shape
        if rt.plan.sp:
            s //= rt.plan.tp
        return (b, s, rt.model.spec.hidden)

    # ---- one step --------------------------------------------------------------------------------
    def __call__(self, rt: Any, micro_batches: list[Batch]) -> float:
        """Run this rank's list once (one optimizer step's micro-batches); returns the local loss."""
        if len(micro_batches) != self.m:
            raise ParallelLabError(f"the schedule was built for m={self.m} micro-batches, got "
                                   f"{len(micro_batches)}; build the Runtime with grad_accum={self.m}")
        st = _Step(micro_batches, [q for q in rt.model.parameters() if q.requires_grad], LocalHandoffs(self.layout),
                   compute_dtype=getattr(rt.dp, "param_dtype", None))
        run = {"P2P": self._p2p, "F": self._forward, "B": self._backward, "W": self._weight}
        t_start = time.perf_counter()
        with rt.timeline.span("pp_step", kind="pipeline", stage=self.layout.rank):
            for i, a in enumerate(self.actions):
                run[a.kind](rt, st, i, a)
                if a.kind != "P2P":
                    span = rt.timeline.spans[-1]
                    st.rows.append([self.layout.rank, span.t_start, span.t_end, a.kind, a.microbatch, a.chunk])
                    st.trace.append(len(st.alive))               # (mb, chunk) graphs alive after it
                    if rt.meter is not None:
                        st.live_peak = max(st.live_peak, int(rt.meter.live_total))
            with rt.phase_as("backward"):
                for done, _tensor in st.sends:                  # the step ends when all sends are done
                    done.wait()
        if st.live or st.recvs or st.outbox or st.local.held:
            raise ParallelLabError(f"pipeline rank {self.layout.rank}: the action list left work behind "
                                   f"(in flight {sorted(st.live)}, receives {sorted(st.recvs)}, unsent "
                                   f"{sorted(st.outbox)}, local hand-offs {st.local.pending()}); check it with "
                                   "schedules.validate")
        self.records.append(StepRecord(self.layout.rank, t_start, time.perf_counter(), st.rows,
                                       max(st.trace, default=0), st.live_peak, st.trace))
        return st.loss if self.layout.has_head else 0.0

    def _span(self, rt: Any, a: Action):
        return rt.timeline.span(a.kind, micro_batch=a.microbatch, stage=self.layout.virtual(a.chunk))

    def _forward(self, rt: Any, st: _Step, i: int, a: Action) -> None:
        """F: input (received, or the embedding's output), the chunk's blocks, the head and ``loss / m``."""
        first, last = self.layout.is_first(a.chunk), self.layout.is_last(a.chunk)
        micro, model = st.micro_batches[a.microbatch], rt.model
        x = None
        if not first:                                          # from this rank's previous chunk, or received
            x = st.local.take("F", a)
            x = (st.take("RECV_F", a) if x is None else x).requires_grad_()
        with rt.phase_as("forward"), self._span(rt, a):
            ctx = st.contexts.get(a.microbatch)
            if ctx is None:              # one per micro-batch: its chunks share the rotary tables and mask
                ctx = st.contexts[a.microbatch] = make_context(micro.positions, micro.doc_ids)
            h0 = None
            if first:
                h0 = model.embed(micro.tokens, ctx.positions)
                x = h0.detach().requires_grad_()
            h = x
            for block_id in self.layout.chunks[a.chunk]:
                h = model.blocks[str(block_id)](h, ctx)
            if last:
                y = rt.loss(model.head(h), micro) / self.m
                st.loss += float(y.detach())
            else:
                y, out = h, h.detach()
                if not st.local.give("F", a, out):
                    st.outbox[("SEND_F", a.microbatch, a.chunk)] = out
        item = st.live[(a.microbatch, a.chunk)] = _InFlight(x, y, h0)
        st.alive.add(item)

    def _backward(self, rt: Any, st: _Step, i: int, a: Action) -> None:
        """B: the full backward, or only the input gradient when a W of this (mb, chunk) follows."""
        key = (a.microbatch, a.chunk)
        dy = None                                              # on the last stage: the loss itself
        if not self.layout.is_last(a.chunk):                   # from this rank's next chunk, or received
            dy = st.local.take("B", a)
            dy = st.take("RECV_B", a) if dy is None else dy
        rt.dp.set_sync(i == self.last_grad_action)
        item = st.live[key]
        with rt.phase_as("backward"), self._span(rt, a):
            if key in self.split:
                item.held = backward_input_only(item.y, item.x, dy, st.params)
            else:
                torch.autograd.backward(item.y, dy)
                item.embedding_backward()
            if not st.local.give("B", a, item.x.grad) and not self.layout.is_first(a.chunk):
                st.outbox[("SEND_B", *key)] = item.x.grad
        if key not in self.split:
            del st.live[key]                                   # the graph goes: activations freed

    def _weight(self, rt: Any, st: _Step, i: int, a: Action) -> None:
        """W: the weight gradients a split B left, then the micro-batch's graph is freed."""
        rt.dp.set_sync(i == self.last_grad_action)
        item = st.live.pop((a.microbatch, a.chunk))
        with rt.phase_as("backward"), self._span(rt, a):
            backward_weights(item.held)
            item.held = []
            item.embedding_backward()

    def _p2p(self, rt: Any, st: _Step, i: int, a: Action) -> None:
        """``P2P(ops)``: post all ops together (``batch_isend_irecv``), wait for none."""
        ops: list[tuple[str, Tensor, int]] = []
        for op in a.ops:
            peer = self.pp_ranks[op.peer]
            if op.is_send:
                ops.append(("send", st.outbox.pop((op.kind, op.microbatch, op.chunk)).contiguous(), peer))
            else:
                shape = self.activation_shape(rt, st.micro_batches[op.microbatch])
                ops.append(("recv", torch.empty(shape, dtype=st.dtype, device=st.device), peer))
        probe.sample("pp", [t for _, t, _ in ops])               # the messages one P2P action posts together
        phases = tuple("forward" if op.kind in ("SEND_F", "RECV_F") else "backward" for op in a.ops)
        with probe.tagged(phases=phases):                        # one batch may carry both phases' messages
            waits = post(ops, self.group)
        for op, (_, tensor, _peer), done in zip(a.ops, ops, waits, strict=True):
            if op.is_send:
                st.sends.append((done, tensor))            # keep the tensor until the send is done
            else:
                st.recvs[(op.kind, op.microbatch, op.chunk)] = (tensor, done)


# --------------------------------------------------------------------------------------------------
# Plug-in
# --------------------------------------------------------------------------------------------------

def check_pp(spec: ModelSpec, plan: Plan) -> None:
    """Plans the runnable pipeline cannot execute (``train.check_runnable`` calls it before any process)."""
    if spec.tied_embeddings:
        raise ParallelLabError("tied embeddings put one weight on the first and the last pipeline stage; the "
                               "runnable pipeline needs untied embeddings (drop --tied-embeddings) or pp=1")
    validate(build_schedule(plan.schedule, plan.pp, plan.microbatches, plan.interleave))


def apply_pp(rt: Runtime, schedule: Schedule | None = None) -> None:
    """Keep this rank's stage of ``rt.model`` and set ``rt.forward_backward`` to the schedule's executor.

    ``schedule``: any action lists (a V schedule, a learner's, one read from torch's CSV format), run instead
    of ``plan.schedule``'s; their placement says which layers each rank keeps. Validated first."""
    plan: Plan = rt.plan
    spec: ModelSpec = rt.model.spec
    if schedule is None:
        check_pp(spec, plan)
        schedule = build_schedule(plan.schedule, plan.pp, plan.microbatches, plan.interleave)
    elif spec.tied_embeddings:
        check_pp(spec, plan)
    schedule = validate(schedule)
    if num_microbatches(schedule) != plan.microbatches or len(schedule) != plan.pp:
        raise ParallelLabError(f"the schedule has {len(schedule)} rank lists and {num_microbatches(schedule)} "
                               f"micro-batches but the plan pp={plan.pp}, grad_accum={plan.microbatches}; "
                               "make them agree")
    layout = stage_layout(spec, plan, rt.grid.pp_rank, placement_of(schedule))
    keep_stage(rt.model, layout)
    ex = PipelineExecutor(rt, layout, schedule[layout.rank], plan.microbatches)
    rt.forward_backward = ex
    rt.owns_loss = rt.owns_loss and layout.has_head
    rt.extras["pipeline"] = ex
    rt.extras.setdefault("reports", {})["pp"] = ex.report
