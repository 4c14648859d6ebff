"""Pipeline parallelism: cut the model into stages and run a schedule's action lists on them.

One executor, no schedule logic. :func:`apply_pp` gives each pipeline rank its pieces of the model and
its own list from ``schedules.generators.build_schedule(plan.schedule, p, m, v)``; the
:class:`PipelineExecutor` then runs that list action by action. GPipe, 1F1B, interleaved 1F1B and ZB-H1
differ only in the lists; adding a schedule means adding a generator in ``schedules.py``.

Stages (Narayanan et al. 2021's placement, ``sharding.chunk_layers``)
------------------------------------------------------------------
The ``L`` blocks are cut into ``V = p * v`` contiguous chunks (the first ``L % V`` chunks get one block
more when ``V`` does not divide ``L``). Chunk ``c`` of pipeline rank ``r`` is *virtual stage*
``s = c * p + r`` (the schedule's ``schedules.Placement``: ZB-V and DualPipeV put stages ``r`` and
``2p - 1 - r`` on rank ``r``, so rank 0 holds the embedding and the head, and on rank ``p - 1`` the
output of stage ``p - 1`` goes to stage ``p`` without a message: a *local hand-off*, kept in ``_Step.local``
until the consumer takes it, both ways). Virtual stage 0 also holds the embedding, virtual stage ``V - 1``
the final norm, the head and the loss. A rank keeps only its pieces (the other blocks are deleted, names stay
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

Measurement. Every ``F``/``B``/``W`` is a ``simulate.Interval`` of ``rt.timeline`` (name = kind,
``micro_batch``, ``stage`` = virtual stage), the whole list one interval ``"pp_step"`` (kind ``"pipeline"``).
The executor keeps per step a :class:`StepRecord`: the rows ``Interval.as_row()`` of its actions, when the
step started and ended, and the peak number of in-flight ``(mb, chunk)`` pairs, *counted from the objects
alive* (a ``WeakSet`` of the per-micro-batch graphs, so a leaked reference would show), beside the
saved-tensor meter's live bytes; they reach the caller as ``RankResult.info["pp"]``, and
``pipeline_report.py`` reads them with the simulator's definitions. The messages each ``P2P``
action posts together (``pp_communications.py``) are sampled through the probe as comm-buffer part ``pp``
(``ledger_buffers.comm_buffer_parts``), each op tagged with the phase it belongs to.
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn
from torch.autograd.graph import GradientEdge, Node

from parallel_lab.distributed import probe
from parallel_lab.distributed.model.data import Batch
from parallel_lab.distributed.model.model import AttnContext, make_context
from parallel_lab.distributed.pipeline_parallel.pp_communications import post
from parallel_lab.distributed.runtime.runtime import Runtime
from parallel_lab.errors import ParallelLabError
from parallel_lab.schedules.actions import Action, Placement, Schedule, num_microbatches, placement_of
from parallel_lab.schedules.checks import validate
from parallel_lab.schedules.generators import build_schedule
from parallel_lab.schedules.inflight import split_backward
from parallel_lab.sharding import chunk_layers
from parallel_lab.specs import ModelSpec, Plan

# --------------------------------------------------------------------------------------------------
# Stages
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class StageLayout:
    """Pipeline rank ``rank`` of ``p``: ``v`` chunks; chunk ``c`` is virtual stage
    ``placement.stage(rank, c)`` (``c*p + rank`` interleaved; ``rank`` and ``2p-1-rank`` on a V)."""

    rank: int
    p: int
    v: int
    chunks: tuple[tuple[int, ...], ...]        # block ids of each local chunk, in model order
    placement: Placement | None = None         # None: Megatron's interleaved placement

    @property
    def place(self) -> Placement:
        return self.placement or Placement.interleaved(self.p, self.v)

    def virtual(self, chunk: int) -> int:
        return self.place.stage(self.rank, chunk)

    @property
    def n_virtual(self) -> int:
        return self.p * self.v

    def is_first(self, chunk: int) -> bool:
        return self.virtual(chunk) == 0

    def is_last(self, chunk: int) -> bool:
        return self.virtual(chunk) == self.n_virtual - 1

    def local_neighbour(self, chunk: int, step: int) -> int | None:
        """The local chunk holding virtual stage ``virtual(chunk) + step`` when it is on this rank too."""
        nb = self.place.neighbour(self.rank, chunk, step)
        return nb[1] if nb is not None and nb[0] == self.rank else None

    @property
    def has_embedding(self) -> bool:
        return self.place.holder(0)[0] == self.rank

    @property
    def has_head(self) -> bool:
        return self.place.holder(self.n_virtual - 1)[0] == self.rank

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


def stage_layout(spec: ModelSpec, plan: Plan, rank: int, placement: Placement | None = None) -> StageLayout:
    """The chunks of pipeline rank ``rank`` (``sharding.chunk_layers``: contiguous, uneven allowed), placed by
    ``placement`` (default: interleaved with ``plan.interleave`` chunks)."""
    if not 0 <= rank < plan.pp:
        raise ParallelLabError(f"pipeline rank {rank} is not in 0..{plan.pp - 1}")
    place = placement or Placement.interleaved(plan.pp, plan.interleave)
    if place.p != plan.pp:
        raise ParallelLabError(f"the schedule's placement has {place.p} ranks but pp={plan.pp}; build the "
                               f"schedule for p={plan.pp}")
    cut = chunk_layers(spec.layers, plan.pp, place.v, plan.pp_split)
    chunks = tuple(tuple(cut[place.stage(rank, c)]) for c in range(place.v))
    return StageLayout(rank, plan.pp, place.v, chunks, placement)


def layers_per_stage(spec: ModelSpec, plan: Plan) -> list[int]:
    """Blocks held by each pipeline rank (all its chunks); uneven when ``p * v`` does not divide ``L``."""
    return [len(stage_layout(spec, plan, r).layers) for r in range(plan.pp)]


def keep_stage(model: nn.Module, layout: StageLayout) -> nn.Module:
    """Delete the pieces of ``model`` (a ``distributed.model.model.Transformer``) that ``layout`` does not hold."""
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


@dataclass(eq=False)
class _Step:
    """The state of one step on one rank: posted receives and sends, outputs waiting to be sent, the
    (mb, chunk) pairs in flight, and what is measured."""

    micro_batches: list[Batch]
    params: list[Tensor]
    recvs: dict[tuple[str, int, int], tuple[Tensor, Any]] = field(default_factory=dict)    # (buffer, completion)
    sends: list[tuple[Any, Tensor]] = field(default_factory=list)
    outbox: dict[tuple[str, int, int], Tensor] = field(default_factory=dict)   # (SEND_F|SEND_B, mb, chunk)
    local: dict[tuple[str, int, int], Tensor] = field(default_factory=dict)    # (F|B, mb, consumer chunk)
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
        st = _Step(micro_batches, [q for q in rt.model.parameters() if q.requires_grad],
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
        if st.live or st.recvs or st.outbox or st.local:
            raise ParallelLabError(f"pipeline rank {self.layout.rank}: the action list left work behind "
                                   f"(in flight {sorted(st.live)}, receives {sorted(st.recvs)}, unsent "
                                   f"{sorted(st.outbox)}, local hand-offs {sorted(st.local)}); check it with "
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
        here = self.layout.local_neighbour(a.chunk, -1)        # the V's turn: input from this rank's chunk
        x = None if first else (st.local.pop(("F", a.microbatch, a.chunk)) if here is not None
                                else st.take("RECV_F", a)).requires_grad_()
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
                y = h
                nxt = self.layout.local_neighbour(a.chunk, +1)
                if nxt is None:
                    st.outbox[("SEND_F", a.microbatch, a.chunk)] = h.detach()
                else:
                    st.local[("F", a.microbatch, nxt)] = h.detach()
        item = st.live[(a.microbatch, a.chunk)] = _InFlight(x, y, h0)
        st.alive.add(item)

    def _backward(self, rt: Any, st: _Step, i: int, a: Action) -> None:
        """B: the full backward, or only the input gradient when a W of this (mb, chunk) follows."""
        key = (a.microbatch, a.chunk)
        if self.layout.is_last(a.chunk):
            dy = None
        elif self.layout.local_neighbour(a.chunk, +1) is not None:      # from this rank's next chunk
            dy = st.local.pop(("B", a.microbatch, a.chunk))
        else:
            dy = st.take("RECV_B", a)
        rt.dp.set_sync(i == self.last_grad_action)
        item = st.live[key]
        with rt.phase_as("backward"), self._span(rt, a):
            if key in self.split:
                self._input_grad_only(item, dy, st.params)
            else:
                torch.autograd.backward(item.y, dy)
                if item.h0 is not None:
                    torch.autograd.backward(item.h0, item.x.grad)
            prev = self.layout.local_neighbour(a.chunk, -1)
            if prev is not None:
                st.local[("B", a.microbatch, prev)] = item.x.grad
            elif not self.layout.is_first(a.chunk):
                st.outbox[("SEND_B", *key)] = item.x.grad
        if key not in self.split:
            del st.live[key]                                   # the graph goes: activations freed

    def _weight(self, rt: Any, st: _Step, i: int, a: Action) -> None:
        """W: the weight gradients a split B left, then the micro-batch's graph is freed."""
        rt.dp.set_sync(i == self.last_grad_action)
        item = st.live.pop((a.microbatch, a.chunk))
        with rt.phase_as("backward"), self._span(rt, a):
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
