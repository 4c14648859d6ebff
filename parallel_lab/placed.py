"""Predictions for a pipeline run by any schedule's action lists: what each rank holds, sends and saves.

``ledger``, ``comm`` and ``sharding`` predict the schedules a :class:`~parallel_lab.specs.Plan` names, whose
model chunks sit in Megatron's interleaved placement. A schedule given as action lists brings its own
placement (``schedules.Placement``): ZB-V and DualPipeV put virtual stages ``r`` and ``2p - 1 - r`` on rank ``r``
(Qi et al. 2024), so rank 0 holds the embedding *and* the head, and the turn of the V needs no message.
Everything here is read off the lists and that table, with the library's own rules for the rest:

* state: the parameters of the rank's blocks (``chunk_layers`` cut into ``p v`` chunks, chunk ``c`` of rank ``r``
  being virtual stage ``placement.stage(r, c)``), plus the embedding and/or the head where it holds stage 0 or
  the last one, times the optimizer's bytes (no ZeRO);
* point-to-point: one activation ``s b h d`` per send and receive op of the rank's list;
* activations: the per-op bytes of one block (``activations.per_op_bytes``) times the peak of the rank's
  live blocks over its list (a forward adds its chunk's blocks, the end of its backward, or its W, removes
  them), plus the embedding's and the rotary tables' saves per live forward of the chunks that use them;
  the head's bytes once (its F is followed by its B on V schedules).
"""

from __future__ import annotations

from .activations import per_op_bytes
from .comm import Collective
from .errors import ParallelLabError
from .schedules.actions import Schedule, placement_of
from .schedules.inflight import split_backward
from .sharding import _local, chunk_layers
from .specs import ModelSpec, Plan


def rank_chunks(model: ModelSpec, plan: Plan, schedule: Schedule, rank: int) -> list[list[int]]:
    """Block ids of each local chunk of pipeline rank ``rank``, in model order."""
    place = placement_of(schedule)
    cut = chunk_layers(model.layers, plan.pp, place.v, plan.pp_split)
    return [list(cut[place.stage(rank, c)]) for c in range(place.v)]


def holds(schedule: Schedule, rank: int) -> tuple[bool, bool]:
    """``(embedding, head)``: whether ``rank`` holds virtual stage 0 and the last virtual stage."""
    place = placement_of(schedule)
    return place.holder(0)[0] == rank, place.holder(place.n_stages - 1)[0] == rank


def state_bytes(model: ModelSpec, plan: Plan, schedule: Schedule, rank: int) -> dict[str, float]:
    """Parameters, gradients and optimizer states of pipeline rank ``rank`` (bytes; no ZeRO)."""
    if plan.zero:
        raise ParallelLabError(f"zero={plan.zero} with a schedule given as action lists is not predicted here; "
                               "use zero=0")
    layers = {i for ids in rank_chunks(model, plan, schedule, rank) for i in ids}
    emb, head = holds(schedule, rank)
    on = {"tok_emb": emb, "pos_emb": emb, "final_norm": head, "lm_head": head}
    n = 0
    for name, shape in model.parameter_shapes():
        parts = name.split(".")
        if (int(parts[1]) in layers) if parts[0] == "blocks" else on[parts[0]]:
            n += _local(model, name, shape, plan.tp)[0]
    o = plan.optim
    return {"parameters": float(n * o.param_bytes), "gradients": float(n * o.grad_bytes),
            "optimizer_states": float(n * o.optim_bytes)}


def p2p_collectives(model: ModelSpec, plan: Plan, schedule: Schedule, rank: int) -> list[Collective]:
    """The point-to-point calls of ``rank``'s list for one step: one activation-sized message per op."""
    msg = (plan.seq // plan.cp) * plan.micro_batch * model.hidden * plan.dtype_bytes // (plan.tp if plan.sp else 1)
    out = []
    for a in schedule[rank]:
        for op in a.ops or ((a,) if a.kind in ("SEND_F", "SEND_B", "RECV_F", "RECV_B") else ()):
            phase = "forward" if op.kind.endswith("_F") else "backward"
            out.append(Collective("pp", "send" if op.is_send else "recv", msg, 2, 1, phase, op.kind))
    return out


def activation_bytes(model: ModelSpec, plan: Plan, schedule: Schedule, rank: int) -> float:
    """Peak bytes saved for backward on ``rank`` over its list (module docstring)."""
    chunks = rank_chunks(model, plan, schedule, rank)
    d = per_op_bytes(model, plan)
    per_block = d["per_block_bytes"]
    shared = sum(e["bytes"] for e in d["shared"])
    emb_bytes = sum(e["bytes"] for e in d["embedding"])
    place = placement_of(schedule)
    first = [place.stage(rank, c) == 0 for c in range(place.v)]
    acts = schedule[rank]
    split = split_backward(acts)
    live = peak = 0.0
    for a in acts:
        cost = per_block * len(chunks[a.chunk]) + (shared if chunks[a.chunk] else 0.0) + (
            emb_bytes if a.is_compute and first[a.chunk] else 0.0)
        if a.kind == "F":
            live += cost
        elif (a.kind == "B" and (a.microbatch, a.chunk) not in split) or a.kind == "W":
            live -= cost
        peak = max(peak, live)
    return float(peak)


def logits_bytes(model: ModelSpec, plan: Plan, schedule: Schedule, rank: int) -> float:
    """The head's per-op bytes on the rank holding it (each head forward runs straight into its backward)."""
    return float(sum(e["bytes"] for e in per_op_bytes(model, plan)["head"])) if holds(schedule, rank)[1] else 0.0
