"""Pipeline parallelism: cut the model into stages and run a schedule's action lists on them.

One executor, no schedule logic. :func:`apply_pp` gives each pipeline rank its pieces of the model and
its own list from ``parallel_lab.schedules.build_schedule(plan.schedule, p, m, v)``; the
:class:`PipelineExecutor` then runs that list action by action. GPipe, 1F1B, interleaved 1F1B and ZB-H1
differ only in the lists; adding a schedule means adding a generator in ``schedules.py``.

Stages (Narayanan et al. 2021's placement, ``specs.chunk_layers``)
------------------------------------------------------------------
The ``L`` blocks are cut into ``V = p * v`` contiguous chunks (the first ``L % V`` chunks get one block
more when ``V`` does not divide ``L``). Chunk ``c`` of pipeline rank ``r`` is *virtual stage*
``s = c * p + r``. Virtual stage 0 also holds the embedding, virtual stage ``V - 1`` the final norm, the
head and the loss. A rank keeps only its pieces (the other blocks are deleted, names stay
``blocks.{i}.*``), so its parameters, gradients and optimizer states are its stage's alone.

The actions (``schedules.py`` documents their point-to-point semantics; this file implements them)
----------------------------------------------------------------------------------------------------
* ``P2P(ops)``: post every op at once with ``batch_isend_irecv`` through the ``CommTracer`` (dim
  ``pp``): ``SEND_F`` the output activation ``(b, s, h)`` of a chunk, ``RECV_F`` into a new buffer,
  ``SEND_B`` the gradient of a chunk's input, ``RECV_B`` the gradient of its output. Nothing waits here.
* ``F(mb, c)``: wait for the input (``RECV_F``, or embed the tokens on virtual stage 0), run the chunk's
  blocks, and on the last virtual stage the head and ``loss / m``. The autograd graph stays alive: the
  micro-batch is now *in flight* on this rank.
* ``B(mb, c)`` not followed by a ``W`` (GPipe, 1F1B, interleaved): wait for the output gradient
  (``RECV_B``) and run the whole backward: input gradient (to send) and weight gradients (accumulated
  in ``.grad``). The graph is then dropped, which frees the micro-batch's saved activations.
* ``B(mb, c)`` split from ``W(mb, c)`` (ZB-H1, Qi et al. 2023), see :func:`weight_split_points`:

  - B computes only the input gradient: ``torch.autograd.backward(y, dy, inputs=[x],
    retain_graph=True)``. Autograd then runs only the nodes on a path to ``x`` and asks each of them
    only for the gradients that lead there: a linear's matmul computes ``dX = dY W`` and skips
    ``dW = dY^T X``. Just before it runs, a pre-hook on every node where the input path and a weight
    path part (each linear's matmul, each norm's multiplication by its weight) keeps the gradient
    arriving at that node (``dY``).
  - W then runs each of those nodes again for its weights only:
    ``torch.autograd.backward(GradientEdge(node, i), dY_i, inputs=[its weights])``, which computes
    ``dW = dY^T X`` from the activations the graph saved and accumulates it into ``.grad``. No other
    node runs twice, so B + W costs one ordinary backward. The graph (and the activations it saved)
    lives until W, as ``schedules.py`` counts it; the kept ``dY`` are W's own extra memory (ZB's
    "weight-gradient store").

  The embedding of virtual stage 0 is a graph of its own (its output is detached into the chunk's input
  ``x``): its weight gradient needs ``x.grad`` and is computed with the other weights (in W, or at
  the end of a full B).

Data parallelism: every rank of a pipeline replica accumulates its stage's gradients over the
micro-batches; ``rt.dp.set_sync(True)`` is called only before the step's last action that produces weight
gradients (the last ``W``, or the last unsplit ``B``), so DDP/ZeRO synchronise once per step, not per
micro-batch. ``rt.owns_loss`` is true on the last stage only (the loss is ``sum over micro-batches of
loss / m``, as without a pipeline).

Measurement. Every ``F``/``B``/``W`` is a ``Span`` of ``rt.timeline`` (name = kind, ``micro_batch``,
``stage`` = virtual stage), the whole list one span ``"pp_step"`` (kind ``"pipeline"``). The executor keeps
per step :class:`StepRecord`: the rows ``[rank, start, end, kind, microbatch, chunk]`` (the simulator's
timeline format), when the step started and ended, and the peak number of in-flight ``(mb, chunk)``
pairs, *counted from the objects alive* (a ``WeakSet`` of the per-micro-batch graphs, so a leaked
reference would show), beside the saved-tensor meter's live bytes; they reach the caller as
``RankResult.info["pp"]``. :func:`timeline_stats` turns rows into the simulator's figures
(``bubble_ratio``, ``idle_fraction``), so that measured and simulated timelines are compared with the same
definitions; :func:`pipeline_report` (what ``parallel-lab run`` prints) adds the simulator *replaying*
every measured duration (:func:`replay`: what the schedule explains) and the hand-off times between
stages (:func:`handoffs`: what the messages cost). ``viz.plots.pipeline_timelines_figure`` draws the
simulated and the measured timeline together.
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn
from torch.autograd.graph import GradientEdge, Node

from parallel_lab.distributed.instruments import TracedWork
from parallel_lab.distributed.model import AttnContext, Batch, make_context
from parallel_lab.schedules import Action, build_schedule, execute, split_backward, validate
from parallel_lab.specs import ModelSpec, ParallelLabError, Plan, chunk_layers

# --------------------------------------------------------------------------------------------------
# Stages
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class StageLayout:
    """Pipeline rank ``rank`` of ``p``: ``v`` chunks; chunk ``c`` is virtual stage ``c*p + rank``."""

    rank: int
    p: int
    v: int
    chunks: tuple[tuple[int, ...], ...]        # block ids of each local chunk, in model order

    def virtual(self, chunk: int) -> int:
        return chunk * self.p + self.rank

    @property
    def n_virtual(self) -> int:
        return self.p * self.v

    def is_first(self, chunk: int) -> bool:
        return self.virtual(chunk) == 0

    def is_last(self, chunk: int) -> bool:
        return self.virtual(chunk) == self.n_virtual - 1

    @property
    def has_embedding(self) -> bool:
        return self.rank == 0

    @property
    def has_head(self) -> bool:
        return self.rank == self.p - 1

    @property
    def layers(self) -> list[int]:
        return [i for ids in self.chunks for i in ids]

    def describe(self) -> str:
        parts = [f"chunk {c} (virtual stage {self.virtual(c)}): blocks {list(ids)}"
                 for c, ids in enumerate(self.chunks)]
        if self.has_embedding:
            parts.insert(0, "embedding")
        if self.has_head:
            parts.append("final norm + head + loss")
        return f"pipeline rank {self.rank}: " + "; ".join(parts)


def stage_layout(spec: ModelSpec, plan: Plan, rank: int) -> StageLayout:
    """The chunks of pipeline rank ``rank`` (``specs.chunk_layers``: contiguous, uneven allowed)."""
    if not 0 <= rank < plan.pp:
        raise ParallelLabError(f"pipeline rank {rank} is not in 0..{plan.pp - 1}")
    cut = chunk_layers(spec.layers, plan.pp, plan.interleave)
    chunks = tuple(tuple(cut[c * plan.pp + rank]) for c in range(plan.interleave))
    return StageLayout(rank, plan.pp, plan.interleave, chunks)


def layers_per_stage(spec: ModelSpec, plan: Plan) -> list[int]:
    """Blocks held by each pipeline rank (all its chunks); uneven when ``p * v`` does not divide ``L``."""
    return [len(stage_layout(spec, plan, r).layers) for r in range(plan.pp)]


def keep_stage(model: nn.Module, layout: StageLayout) -> nn.Module:
    """Delete the pieces of ``model`` (a ``distributed.model.Transformer``) that ``layout`` does not hold."""
    keep = {str(i) for i in layout.layers}
    for name in [n for n in model.blocks if n not in keep]:
        del model.blocks[name]
    if not layout.has_embedding:
        model.tok_emb = None
        model.pos_emb = None
    if not layout.has_head:
        model.final_norm = None
        model.lm_head = None
        model.has_head = False
    return model


# --------------------------------------------------------------------------------------------------
# Splitting a backward into B (input gradient) and W (weight gradients)
# --------------------------------------------------------------------------------------------------

def _nodes_leading_to(root: Node, target: Tensor) -> dict[Node, bool]:
    """For every node reachable from ``root``: does a path lead from it to the leaf ``target``?"""
    leads: dict[Node, bool] = {}
    stack: list[tuple[Node, bool]] = [(root, False)]
    while stack:                                  # iterative post-order (graphs are deep)
        node, children_done = stack.pop()
        if node in leads:
            continue
        nexts = [f for f, _ in node.next_functions if f is not None]
        if children_done:
            leads[node] = getattr(node, "variable", None) is target or any(leads[f] for f in nexts)
        else:
            stack.append((node, True))
            stack.extend((f, False) for f in nexts if f not in leads)
    return leads


def _weights_below(node: Node, wanted: dict[int, Tensor]) -> list[Tensor]:
    """Parameters (of ``wanted``, keyed by ``id``) whose gradient accumulators lie below ``node``."""
    out, seen, stack = [], set(), [node]
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        var = getattr(n, "variable", None)
        if var is not None and id(var) in wanted:
            out.append(wanted[id(var)])
        stack.extend(f for f, _ in n.next_functions if f is not None)
    return out


def weight_split_points(root: Node, x: Tensor, params: Iterable[Tensor]) -> list[tuple[Node, list[Tensor]]]:
    """Where the input-gradient path and the weight-gradient paths of a backward part.

    ``root``: the output's ``grad_fn``; ``x``: the chunk's input (a leaf). Returns ``(node, weights)`` for
    every node that lies on a path from ``root`` to ``x`` and has an edge leaving that path towards
    parameters (each linear's matmul, each norm's product with its weight). Running such a node for its
    weights alone, with the gradient it received during B, gives exactly their gradients (W).
    Raises ParallelLabError when a weight sits below two such nodes (a weight used twice), for which
    per-node W passes would count a gradient twice.
    """
    wanted = {id(p): p for p in params if p.requires_grad}
    leads = _nodes_leading_to(root, x)
    points, owner = [], {}
    for node, on_path in leads.items():
        if not on_path:
            continue
        ws: list[Tensor] = []
        for f, _ in node.next_functions:
            if f is not None and not leads[f]:
                ws += _weights_below(f, wanted)
        if ws:
            for w in ws:
                if id(w) in owner:
                    raise ParallelLabError(
                        "a parameter is used by two operations of one pipeline chunk, so its weight gradient "
                        "cannot be split from the input gradient per operation; use a schedule without W "
                        "(gpipe, 1f1b, interleaved)")
                owner[id(w)] = node
            points.append((node, ws))
    return points


@dataclass(eq=False)
class _InFlight:
    """One (micro-batch, chunk) between its F and its last backward part: the graph and what B kept."""

    x: Tensor                                  # the chunk's input (leaf, requires grad)
    y: Tensor                                  # its output (or the loss on the last virtual stage)
    h0: Tensor | None = None                   # embedding output (virtual stage 0), a separate graph
    held: list[tuple[Node, list[Tensor], tuple]] = field(default_factory=list)   # (node, weights, dY) for W

    def weight_pass(self) -> None:
        """W: every split node again for its weights only, then the embedding's weight (stage 0)."""
        for node, weights, grads in self.held:
            edges = [(GradientEdge(node, i), g) for i, g in enumerate(grads) if g is not None]
            if edges:
                torch.autograd.backward([e for e, _ in edges], [g for _, g in edges], inputs=weights)
        self.held = []
        if self.h0 is not None:
            torch.autograd.backward(self.h0, self.x.grad)


class _OpWait:
    """Completion of one posted op: waits the works its batch returned, then stamps its traced event."""

    def __init__(self, works: Sequence[TracedWork], own: TracedWork | None):
        self.works, self.own = works, own

    def wait(self) -> None:
        for w in self.works:
            w.wait()
        if self.own is not None:
            self.own.wait()


def op_waits(works: Sequence[TracedWork], n_ops: int) -> list[_OpWait]:
    """One completion per posted op from what ``CommTracer.batch_isend_irecv`` returned: gloo gives one work
    per op (each op waits its own); NCCL coalesces the batch into one work, returned before the ops' traced
    events (each op then waits the batch's work and stamps its own event)."""
    if len(works) == n_ops and all(w.work is not None for w in works):
        return [_OpWait([], w) for w in works]
    batch = [w for w in works if w.work is not None]
    events = [w for w in works if w.event is not None]
    return [_OpWait(batch, events[j] if j < len(events) else None) for j in range(n_ops)]


@dataclass(eq=False)
class _Step:
    """The state of one step on one rank: posted receives and sends, outputs waiting to be sent, the
    (mb, chunk) pairs in flight, and what is measured."""

    micro_batches: list[Batch]
    params: list[Tensor]
    recvs: dict[tuple[str, int, int], tuple[Tensor, _OpWait]] = field(default_factory=dict)
    sends: list[tuple[_OpWait, Tensor]] = field(default_factory=list)
    outbox: dict[tuple[str, int, int], Tensor] = field(default_factory=dict)   # (SEND_F|SEND_B, mb, chunk)
    live: dict[tuple[int, int], _InFlight] = field(default_factory=dict)
    alive: weakref.WeakSet = field(default_factory=weakref.WeakSet)            # counts objects really alive
    contexts: dict[int, AttnContext] = field(default_factory=dict)
    rows: list[list[Any]] = field(default_factory=list)
    trace: list[int] = field(default_factory=list)
    live_peak: int = 0
    loss: float = 0.0

    @property
    def dtype(self) -> torch.dtype:
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
        st = _Step(micro_batches, [q for q in rt.model.parameters() if q.requires_grad])
        run = {"P2P": self._p2p, "F": self._forward, "B": self._backward, "W": self._weight}
        t_start = time.perf_counter()
        with rt.timeline.span("pp_step", kind="pipeline", stage=self.layout.rank):
            for i, a in enumerate(self.actions):
                run[a.kind](rt, st, i, a)
                if a.kind != "P2P":
                    span = rt.timeline.spans[-1]
                    st.rows.append([span.stage % self.layout.p, span.t_start, span.t_end, a.kind,
                                    a.microbatch, a.chunk])
                    st.trace.append(len(st.alive))               # (mb, chunk) graphs alive after it
                    if rt.meter is not None:
                        st.live_peak = max(st.live_peak, int(rt.meter.live_total))
            with rt.tracer.phase_as("backward"):
                for done, _tensor in st.sends:                  # the step ends when all sends are done
                    done.wait()
        if st.live or st.recvs or st.outbox:
            raise ParallelLabError(f"pipeline rank {self.layout.rank}: the action list left work behind "
                                   f"(in flight {sorted(st.live)}, receives {sorted(st.recvs)}, unsent "
                                   f"{sorted(st.outbox)}); check it with schedules.validate")
        self.records.append(StepRecord(self.layout.rank, t_start, time.perf_counter(), st.rows,
                                       max(st.trace, default=0), st.live_peak, st.trace))
        return st.loss if self.layout.has_head else 0.0

    def _span(self, rt: Any, a: Action):
        return rt.timeline.span(a.kind, micro_batch=a.microbatch, stage=self.layout.virtual(a.chunk))

    def _forward(self, rt: Any, st: _Step, i: int, a: Action) -> None:
        """F: input (received, or the embedding's output), the chunk's blocks, the head and ``loss / m``."""
        first, last = self.layout.is_first(a.chunk), self.layout.is_last(a.chunk)
        micro, model = st.micro_batches[a.microbatch], rt.model
        x = None if first else st.take("RECV_F", a).requires_grad_()
        with rt.tracer.phase_as("forward"), self._span(rt, a):
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
                y = h
                st.outbox[("SEND_F", a.microbatch, a.chunk)] = h.detach()
        item = st.live[(a.microbatch, a.chunk)] = _InFlight(x, y, h0)
        st.alive.add(item)

    def _backward(self, rt: Any, st: _Step, i: int, a: Action) -> None:
        """B: the full backward, or only the input gradient when a W of this (mb, chunk) follows."""
        key = (a.microbatch, a.chunk)
        dy = None if self.layout.is_last(a.chunk) else st.take("RECV_B", a)
        rt.dp.set_sync(i == self.last_grad_action)
        item = st.live[key]
        with rt.tracer.phase_as("backward"), self._span(rt, a):
            if key in self.split:
                self._input_grad_only(item, dy, st.params)
            else:
                torch.autograd.backward(item.y, dy)
                if item.h0 is not None:
                    torch.autograd.backward(item.h0, item.x.grad)
            if not self.layout.is_first(a.chunk):
                st.outbox[("SEND_B", *key)] = item.x.grad
        if key not in self.split:
            del st.live[key]                                   # the graph goes: activations freed

    def _weight(self, rt: Any, st: _Step, i: int, a: Action) -> None:
        """W: the weight gradients a split B left, then the micro-batch's graph is freed."""
        rt.dp.set_sync(i == self.last_grad_action)
        item = st.live.pop((a.microbatch, a.chunk))
        with rt.tracer.phase_as("backward"), self._span(rt, a):
            item.weight_pass()

    def _input_grad_only(self, item: _InFlight, dy: Tensor | None, params: list[Tensor]) -> None:
        """B of a split backward: ``dL/dx`` only, keeping ``dY`` at every split node for W."""
        points = weight_split_points(item.y.grad_fn, item.x, params)
        caught: dict[Node, tuple] = {}
        handles = [node.register_prehook(lambda g, node=node: caught.__setitem__(node, tuple(g)))
                   for node, _ in points]
        try:
            torch.autograd.backward(item.y, dy, inputs=[item.x], retain_graph=True)
        finally:
            for h in handles:
                h.remove()
        item.held = [(node, ws, caught[node]) for node, ws in points if node in caught]

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
        waits = op_waits(rt.tracer.batch_isend_irecv(ops, "pp"), len(ops))
        for op, (_, tensor, _peer), done in zip(a.ops, ops, waits, strict=True):
            if done.own is not None and done.own.event is not None:
                done.own.event.phase = "forward" if op.kind in ("SEND_F", "RECV_F") else "backward"
            if op.is_send:
                st.sends.append((done, tensor))            # keep the tensor until the send is done
            else:
                st.recvs[(op.kind, op.microbatch, op.chunk)] = (tensor, done)


# --------------------------------------------------------------------------------------------------
# Plug-in
# --------------------------------------------------------------------------------------------------

def check_pp(spec: ModelSpec, plan: Plan) -> None:
    """Plans the executor cannot run (``train.check_runnable`` calls it before any process starts)."""
    if spec.tied_embeddings:
        raise ParallelLabError("tied embeddings put one weight on the first and the last pipeline stage; the "
                               "runnable pipeline needs untied embeddings (tied_embeddings=False) or pp=1")


def apply_pp(rt: Any) -> None:
    """Keep this rank's stage of ``rt.model`` and set ``rt.forward_backward`` to the schedule's executor."""
    plan: Plan = rt.plan
    spec: ModelSpec = rt.model.spec
    check_pp(spec, plan)
    layout = stage_layout(spec, plan, rt.grid.pp_rank)
    keep_stage(rt.model, layout)
    schedule = validate(build_schedule(plan.schedule, plan.pp, plan.microbatches, plan.interleave))
    ex = PipelineExecutor(rt, layout, schedule[layout.rank], plan.microbatches)
    rt.forward_backward = ex
    rt.owns_loss = rt.owns_loss and layout.has_head
    rt.extras["pipeline"] = ex
    rt.extras.setdefault("reports", {})["pp"] = ex.report


# --------------------------------------------------------------------------------------------------
# Measured timelines, in the simulator's terms
# --------------------------------------------------------------------------------------------------

def timeline_stats(rows: Iterable[Sequence[Any]], t_start: float | None = None,
                   t_end: float | None = None) -> dict[str, Any]:
    """``bubble_ratio``, ``idle_fraction`` and busy time per rank of a timeline ``[rank, start, end, ...]``.

    The definitions of ``simulate.simulate``: ``step = t_end - t_start`` (default: first start to last
    end), ``bubble_ratio = (step - C) / C`` with ``C`` the busiest rank's compute time, ``idle_fraction =
    1 - sum(busy) / (p * step)``.
    """
    rows = list(rows)
    if not rows:
        return {"step_time": 0.0, "busy": {}, "bubble_ratio": 0.0, "idle_fraction": 0.0}
    t0 = min(r[1] for r in rows) if t_start is None else t_start
    t1 = max(r[2] for r in rows) if t_end is None else t_end
    busy: dict[int, float] = {}
    for r in rows:
        busy[int(r[0])] = busy.get(int(r[0]), 0.0) + (r[2] - r[1])
    step = t1 - t0
    ideal = max(busy.values())
    return {"step_time": step, "busy": busy, "bubble_ratio": (step - ideal) / ideal if ideal else 0.0,
            "idle_fraction": 1.0 - sum(busy.values()) / (len(busy) * step) if step else 0.0}


def measured_step(records: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """One pipeline's step from its ranks' records (``StepRecord.as_dict``), in the simulator's frame: time 0
    is the first compute action (the first stage's first forward, which waits for nothing), the step ends
    when the last rank has finished its list and its last send; rows are shifted accordingly, with
    :func:`timeline_stats` of that window. ``start_skew_s``: how long before that some rank was already
    in its list, waiting (ranks leave the previous optimizer step at different times; the simulator
    starts them together, so this wait is reported apart from the bubble)."""
    t0 = min(row[1] for rec in records for row in rec["rows"])
    t1 = max(rec["t_end"] for rec in records)
    rows = sorted(([row[0], row[1] - t0, row[2] - t0, *row[3:]] for rec in records for row in rec["rows"]),
                  key=lambda x: (x[0], x[1]))
    out = timeline_stats(rows, 0.0, t1 - t0)
    out["rows"] = rows
    out["start_skew_s"] = t0 - min(rec["t_start"] for rec in records)
    out["inflight_peak"] = [rec["inflight_peak"] for rec in sorted(records, key=lambda x: x["rank"])]
    return out


def mean_costs(rows: Iterable[Sequence[Any]], split: bool) -> dict[str, float]:
    """Mean measured F, B, W durations (seconds), as ``simulate.Costs`` fields: a full backward is ``b``
    (``w = 0``) when the schedule does not split it."""
    acc: dict[str, list[float]] = {"F": [], "B": [], "W": []}
    for r in rows:
        acc[str(r[3])].append(r[2] - r[1])
    mean = {k: sum(v) / len(v) for k, v in acc.items() if v}
    return {"f": mean.get("F", 0.0), "b": mean.get("B", 0.0), "w": mean.get("W", 0.0) if split else 0.0}


def rank_costs(rows: Iterable[Sequence[Any]]) -> list[dict[str, float]]:
    """Per pipeline rank, the mean measured duration (seconds) of each action kind it ran."""
    acc: dict[int, dict[str, list[float]]] = {}
    for r in rows:
        acc.setdefault(int(r[0]), {}).setdefault(str(r[3]), []).append(r[2] - r[1])
    return [{k: sum(v) / len(v) for k, v in acc[rank].items()} for rank in sorted(acc)]


def replay(schedule: list[list[Action]], rows: Iterable[Sequence[Any]]) -> dict[str, Any]:
    """The simulator (``schedules.execute``, instantaneous point-to-point) run with every action's own
    measured duration: the step the schedule would take if the ranks never waited for anything but their
    inputs. What the measured step has beyond it is communication and the executor's overhead; what it
    has beyond the textbook prediction is the stages' imbalance and the durations' variation (on 2 cores:
    contention). Returns :func:`timeline_stats` of the replayed timeline, its rows and its step time."""
    dur = {(int(r[0]), str(r[3]), int(r[4]), int(r[5])): r[2] - r[1] for r in rows}
    ex = execute(schedule, lambda rank, a: dur[(rank, a.kind, a.microbatch, a.chunk)], 0.0)
    out_rows = sorted(([r, t0, t1, a.kind, a.microbatch, a.chunk] for r, t0, t1, a in ex.compute),
                      key=lambda x: (x[0], x[1]))
    out = timeline_stats(out_rows, 0.0, max(ex.finish))
    out["rows"] = out_rows
    return out


def handoffs(rows: Iterable[Sequence[Any]], p: int) -> list[float]:
    """Measured point-to-point hand-off times (seconds): from the end of the action that produced a
    tensor (an F's output, a B's input gradient) to the start of the action on the neighbouring stage that
    consumed it, counted only where the consumer sat idle waiting for it (so the gap is the message's
    latency plus the executor's posting and waiting, not queueing behind other work)."""
    rows = sorted(rows, key=lambda x: (x[0], x[1]))
    end = {(int(r[0]), str(r[3]), int(r[4]), int(r[5])): r[2] for r in rows}
    v = 1 + max(int(r[5]) for r in rows)
    out, last_end = [], {}
    for rank, start, stop, kind, mb, chunk in ((int(r[0]), r[1], r[2], str(r[3]), int(r[4]), int(r[5]))
                                              for r in rows):
        s = chunk * p + rank
        src = s - 1 if kind == "F" else s + 1
        if kind in ("F", "B") and 0 <= src < p * v:
            t = end.get((src % p, kind, mb, src // p))
            if t is not None and last_end.get(rank, float("-inf")) < t <= start:
                out.append(start - t)
        last_end[rank] = stop
    return out


def pipeline_report(spec: ModelSpec, plan: Plan, results: Sequence[Any],
                    step: int | None = None) -> dict[str, Any]:
    """Measured against simulated, for ``parallel-lab run``: one pipeline replica (the ranks with dp, cp and
    tp coordinates 0), step ``step`` (default: the fastest step after the first, whose allocations warm up;
    the fastest is the one least disturbed by other processes, as ``timeit`` takes the minimum).

    * ``bubble_ratio``, ``idle_fraction`` and ``step_time_s``: ``predicted`` by the simulator with the
      textbook costs (F = 1, B = 2, or F = B = W = 1 for ZB-H1; ``(p - 1) / m`` for GPipe and 1F1B; no
      step time), ``measured`` from the timeline (:func:`measured_step`), and ``replayed``: the simulator
      fed every action's measured duration (:func:`replay`).
    * ``handoff_s``: median and 90th percentile of the measured hand-offs between stages (:func:`handoffs`).
    * ``peak_inflight``: per pipeline rank, (micro-batch, chunk) pairs alive at once, measured against the
      simulator's count.
    """
    from parallel_lab.simulate import Costs, simulate

    schedule = build_schedule(plan.schedule, plan.pp, plan.microbatches, plan.interleave)
    mine = sorted((r for r in results if r.coords.get("dp", 0) == 0 and r.coords.get("cp", 0) == 0
                   and r.coords.get("tp", 0) == 0), key=lambda r: r.coords["pp"])
    n = len(mine[0].info["pp"]["steps"])
    if step is None:
        steps = [measured_step([r.info["pp"]["steps"][i] for r in mine]) for i in range(min(1, n - 1), n)]
        meas = min(steps, key=lambda x: x["step_time"])
    else:
        meas = measured_step([r.info["pp"]["steps"][step] for r in mine])
    split = any(a.kind == "W" for acts in schedule for a in acts)
    pred = simulate(schedule, Costs())
    rep = replay(schedule, meas["rows"])
    hand = sorted(handoffs(meas["rows"], plan.pp))
    layers = layers_per_stage(spec, plan)
    return {
        "schedule": plan.schedule, "p": plan.pp, "m": plan.microbatches, "v": plan.interleave,
        "layers_per_stage": layers, "uneven": len(set(layers)) > 1,
        "bubble_ratio": {"predicted": pred.bubble_ratio, "measured": meas["bubble_ratio"],
                         "replayed": rep["bubble_ratio"]},
        "idle_fraction": {"predicted": pred.idle_fraction, "measured": meas["idle_fraction"],
                          "replayed": rep["idle_fraction"]},
        "step_time_s": {"measured": meas["step_time"], "replayed": rep["step_time"]},
        "start_skew_s": meas["start_skew_s"],
        "handoff_s": {"median": hand[len(hand) // 2] if hand else None,
                      "p90": hand[int(0.9 * len(hand))] if hand else None, "count": len(hand)},
        "peak_inflight": {"predicted": list(pred.peak_inflight), "measured": meas["inflight_peak"]},
        "mean_costs_s": mean_costs(meas["rows"], split), "rank_costs_s": rank_costs(meas["rows"]),
        "timeline": meas["rows"],
    }


def format_pipeline_report(rep: dict[str, Any]) -> str:
    """The text block ``parallel-lab run`` prints for a pipeline."""
    v = f", v={rep['v']} chunks per stage" if rep["v"] > 1 else ""
    lines = [f"pipeline: {rep['schedule']}, p={rep['p']} stages, m={rep['m']} micro-batches{v}",
             f"blocks per stage {rep['layers_per_stage']}" + (" (uneven)" if rep["uneven"] else "")
             + f"; embedding on stage 0, final norm + head + loss on stage {rep['p'] - 1}",
             "               predicted  measured  replayed (simulator fed the measured durations)"]
    for key in ("bubble_ratio", "idle_fraction"):
        d = rep[key]
        lines.append(f"{key:<14} {d['predicted']:>9.1%} {d['measured']:>9.1%} {d['replayed']:>9.1%}")
    st = rep["step_time_s"]
    lines.append(f"{'step (ms)':<14} {'':>9} {st['measured'] * 1e3:>9.1f} {st['replayed'] * 1e3:>9.1f}")
    lines.append(f"peak in-flight micro-batches per stage: measured {rep['peak_inflight']['measured']}, "
                 f"simulated {rep['peak_inflight']['predicted']}")
    kinds = "F/B/W" if rep["mean_costs_s"]["w"] else "F/B"
    per = ", ".join("/".join(f"{d[k] * 1e3:.1f}" for k in ("F", "B", "W") if k in d)
                    for d in rep["rank_costs_s"])
    lines.append(f"mean {kinds} per stage (ms): {per}")
    h = rep["handoff_s"]
    if h["count"]:
        lines.append(f"hand-off between stages (ms): median {h['median'] * 1e3:.2f}, 90th percentile "
                     f"{h['p90'] * 1e3:.2f} ({h['count']} waits); a rank entered the step "
                     f"{rep['start_skew_s'] * 1e3:.1f} ms before the first forward")
    return "\n".join(lines)
