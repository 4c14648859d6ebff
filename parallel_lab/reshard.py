"""Re-sharding a checkpoint between two plans: what each rank writes, reads and moves, and how long it takes.

A checkpoint holds, per trainable parameter, the fp32 master weight and the optimizer's states (Adam's two
moments, SGD's momentum): ``STATE_BYTES = 4`` bytes each, 12 B per parameter for Adam, the ZeRO paper's
"optimizer states" K = 12. Every rank of plan A writes the pieces it holds (``sharding`` says which: TP rows or
columns, the blocks of its pipeline stage, ZeRO's flat shard ``[r S, (r+1) S)`` of each unit), each element
exactly once: a replicated element (DP and CP replicas, TP-replicated norms, copies of a shared kv head,
the tied embedding's copy on the last stage) is written by its first holder only (lowest dp, cp, tp).
Every rank of plan B then reads, from each file of A, the overlap of that file's pieces with its own:

    bytes(i -> j) = STATE_BYTES * sum over states and tensors of |box_i  intersect  box_j|

where a piece is a box of global indices (``[lo, hi)`` per dimension). A ZeRO shard of a flat unit buffer
is cut per tensor into at most three boxes (a partial first row, whole rows, a partial last row), so the
overlap is a product of interval overlaps: no element is enumerated. Time on a cluster profile: each rank
receives what it does not hold itself, over the tier between the two ranks (``mesh.same_node``), and all
ranks receive at once (``time = max_j sum_i latency + bytes(i -> j) / bandwidth``). The same rule, run
element by element on CPU ranks, is ``parallel_lab.distributed.runtime.reshard_run`` (its measured bytes equal these).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from . import mesh, sharding
from .errors import ParallelLabError

if TYPE_CHECKING:
    from .hardware import ClusterSpec
    from .sharding import Box
    from .specs import ModelSpec, Plan

#: Bytes of one checkpointed element (fp32 master weights and fp32 optimizer states).
STATE_BYTES = 4


def box_numel(box: Box) -> int:
    """Elements in a box of ``(start, stop)`` index ranges, one per dimension."""
    return math.prod(b - a for a, b in box)


def checkpoint_states(plan: Plan) -> tuple[str, ...]:
    """The state tensors a checkpoint keeps per parameter: the fp32 master weight and the optimizer's states
    (torch's names: ``exp_avg``/``exp_avg_sq`` for Adam, ``momentum_buffer`` for SGD with momentum)."""
    if plan.optimizer == "sgd-momentum":
        return ("param", "momentum_buffer")
    if plan.optimizer in ("adam-8bit", "adafactor"):
        raise ParallelLabError(f"optimizer={plan.optimizer!r}: its states are not fp32 per element, so the "
                               f"re-sharding prediction does not describe them; use an adam-* optimizer or "
                               f"sgd-momentum")
    return ("param", "exp_avg", "exp_avg_sq")


def state_sharded(plan: Plan, state: str) -> bool:
    """Whether ``state`` lives in ZeRO's flat shards under ``plan``: the optimizer states from ZeRO-1 on; the
    fp32 master weight with ZeRO-3, or from ZeRO-1 on when the working parameters are low precision (the
    master is then an optimizer state; Llama 3's FSDP keeps bf16 parameters whole and fp32 masters sharded)."""
    if state != "param":
        return plan.zero >= 1
    return plan.zero == 3 or (plan.zero >= 1 and plan.optimizer not in ("adam-fp32", "sgd-momentum"))


class _Boxed:
    """Something that holds a ``box`` of a tensor: ``numel`` is the box's element count."""

    box: Box

    @property
    def numel(self) -> int:
        return box_numel(self.box)


@dataclass(frozen=True)
class Piece(_Boxed):
    """One box of one state tensor of one parameter, in the full tensor's (global) coordinates."""

    state: str
    name: str
    box: Box


def _row_boxes(box: Box, a: int, b: int) -> list[Box]:
    """The local flat range ``[a, b)`` of a tensor holding ``box`` (row-major) as at most three boxes."""
    if len(box) == 1:
        (lo, _), = box
        return [((lo + a, lo + b),)]
    (r0, _), (c0, c1) = box[0], box[1]
    w = c1 - c0
    out: list[Box] = []
    ra, ca = divmod(a, w)
    rb, cb = divmod(b, w)
    if ra == rb:
        return [((r0 + ra, r0 + ra + 1), (c0 + ca, c0 + cb))] if ca < cb else []
    if ca:
        out.append(((r0 + ra, r0 + ra + 1), (c0 + ca, c1)))
        ra += 1
    if ra < rb:
        out.append(((r0 + ra, r0 + rb), (c0, c1)))
    if cb:
        out.append(((r0 + rb, r0 + rb + 1), (c0, c0 + cb)))
    return out


@dataclass(frozen=True)
class LocalTensor(_Boxed):
    """One parameter as one rank holds it: its full ``shape``, the ``box`` this TP rank holds, the ZeRO
    ``unit``, and whether this rank is the first holder of that box (TP replicas, the tied copy)."""

    name: str
    shape: tuple[int, ...]
    box: Box
    unit: str
    first: bool


@functools.lru_cache(maxsize=1024)
def local_tensors(model: ModelSpec, tp: int, pp: int, interleave: int, zero_unit: str, split: str,
                  stage: int, tp_rank: int) -> tuple[LocalTensor, ...]:
    """The tensors of ``stage`` on TP rank ``tp_rank``, in registration order (``sharding._local_parameters``),
    each with its box of the full tensor."""
    shapes = dict(model.parameter_shapes())
    out = []
    for p in sharding._local_parameters(model, tp, pp, interleave, zero_unit, stage, split):
        box, _, first = sharding.tp_slice(model, p.name, shapes[p.name], tp, tp_rank)
        tied_copy = p.name == "tok_emb.weight" and stage != 0             # the head's copy on the last stage
        out.append(LocalTensor(p.name, shapes[p.name], box, p.unit, first and not tied_copy))
    return tuple(out)


def _tensors_of(model: ModelSpec, plan: Plan, c: dict[str, int]) -> tuple[LocalTensor, ...]:
    return local_tensors(model, plan.tp, plan.pp, plan.interleave, plan.zero_unit, plan.pp_split, c["pp"], c["tp"])


@dataclass(frozen=True)
class Holding:
    """Elements ``[a, b)`` (local row-major order) of one state of one tensor that a rank holds; ``at``: where
    they start in the rank's flat ZeRO shard of ``tensor.unit`` (``None``: a whole local tensor);
    ``writes``: whether this rank writes them to the checkpoint (the first holder)."""

    state: str
    tensor: LocalTensor
    a: int
    b: int
    at: int | None
    writes: bool

    def boxes(self) -> list[Box]:
        return _row_boxes(self.tensor.box, self.a, self.b)


def holdings(model: ModelSpec, plan: Plan, rank: int) -> list[Holding]:
    """Everything ``rank`` holds under ``plan``, state by state, in the rank's own order. Sharded states are
    cut by ``sharding.shard_range`` over the gradient group ``dp x cp`` (index ``dp * cp + cp_rank``), the rest
    are whole local tensors, written by the replica with dp = cp = 0."""
    model.require_shape("the re-sharding prediction")
    c = mesh.coords(plan, rank)
    tensors = _tensors_of(model, plan, c)
    g, index = sharding.shard_group(plan), c["dp"] * plan.cp + c["cp"]
    replica_first = c["dp"] == 0 and c["cp"] == 0
    units: dict[str, list[LocalTensor]] = {}
    for t in tensors:
        units.setdefault(t.unit, []).append(t)
    out: list[Holding] = []
    for state in checkpoint_states(plan):
        if not state_sharded(plan, state):
            out += [Holding(state, t, 0, t.numel, None, t.first and replica_first) for t in tensors]
            continue
        for members in units.values():
            n = sum(t.numel for t in members)
            lo, hi = sharding.shard_range(n, g, index)
            off = 0
            for t in members:
                a, b = max(lo, off), min(hi, off + t.numel)
                if a < b:
                    out.append(Holding(state, t, a - off, b - off, a - lo, t.first))
                off += t.numel
    return out


def rank_pieces(model: ModelSpec, plan: Plan, rank: int, written: bool = False) -> list[Piece]:
    """The boxes ``rank`` holds (``written=True``: only those it writes, so that every element of the
    checkpoint is on exactly one rank)."""
    return [Piece(h.state, h.tensor.name, box) for h in holdings(model, plan, rank)
            if h.writes or not written for box in h.boxes()]


def _overlap(a: Box, b: Box) -> int:
    n = 1
    for (a0, a1), (b0, b1) in zip(a, b, strict=True):
        n *= max(0, min(a1, b1) - max(a0, b0))
        if not n:
            return 0
    return n


MAX_PAIRS = 1 << 16


def transfers(model: ModelSpec, plan_a: Plan, plan_b: Plan) -> dict[tuple[int, int], int]:
    """``{(rank of A that wrote it, rank of B that reads it): bytes}``, every nonzero pair."""
    if plan_a.world * plan_b.world > MAX_PAIRS:
        raise ParallelLabError(f"{plan_a.world} x {plan_b.world} rank pairs is more than {MAX_PAIRS} to list one by "
                               f"one; use summary(), which gives the per-rank figures without the pairs")
    by_tensor: dict[tuple[str, str], list[tuple[int, Box]]] = {}
    for i in range(plan_a.world):
        for p in rank_pieces(model, plan_a, i, written=True):
            by_tensor.setdefault((p.state, p.name), []).append((i, p.box))
    out: dict[tuple[int, int], int] = {}
    for j in range(plan_b.world):
        for p in rank_pieces(model, plan_b, j):
            for i, box in by_tensor.get((p.state, p.name), ()):
                n = _overlap(box, p.box)
                if n:
                    out[(i, j)] = out.get((i, j), 0) + n * STATE_BYTES
    return out


def checkpoint_bytes(model: ModelSpec, plan: Plan) -> int:
    """Bytes of the whole checkpoint: every state of every trainable parameter once."""
    return STATE_BYTES * len(checkpoint_states(plan)) * model.n_params


def max_read_bytes(model: ModelSpec, plan: Plan) -> int:
    """Bytes the fullest rank of ``plan`` holds, hence reads, of the checkpoint (no pair listing, any scale):
    per stage, whole local tensors for an unsharded state and ``sum over units of ceil(n_u / g)`` for a
    sharded one (the first shard of a unit is never padding)."""
    g = sharding.shard_group(plan)
    best = 0
    for stage in range(plan.pp):
        for r in range(plan.tp):
            tensors = _tensors_of(model, plan, {"pp": stage, "tp": r})
            units: dict[str, int] = {}
            for t in tensors:
                units[t.unit] = units.get(t.unit, 0) + t.numel
            total = 0
            for state in checkpoint_states(plan):
                sharded = sum(sharding.shard_size(n, g) if n > g else n for n in units.values())
                total += sharded if state_sharded(plan, state) else sum(t.numel for t in tensors)
            best = max(best, total)
    return best * STATE_BYTES


@dataclass(frozen=True)
class ReshardPrediction:
    """What re-sharding from plan A to plan B costs (bytes are integers, times seconds)."""

    checkpoint_bytes: int                 # the whole checkpoint, written once by A's ranks
    written: list[int] | None             # per rank of A (None when there are too many pairs to list)
    read: list[int] | None                # per rank of B
    moved: list[int] | None               # per rank of B: read from a file another rank wrote
    pairs: dict[tuple[int, int], int] | None
    max_read_bytes: int                   # the fullest rank of B
    time_s: float                         # every rank of B receives at once; the slowest one
    assumption: str

    def to_json(self) -> dict[str, Any]:
        return {"checkpoint_bytes": self.checkpoint_bytes, "written": self.written, "read": self.read,
                "moved": self.moved, "max_read_bytes": self.max_read_bytes, "time_s": self.time_s,
                "pairs": None if self.pairs is None else [[i, j, n] for (i, j), n in sorted(self.pairs.items())],
                "assumption": self.assumption}


def check_pair(model: ModelSpec, plan_a: Plan, plan_b: Plan) -> None:
    """Both plans must cut the same model with the same states (one line naming the difference)."""
    plan_a.validate(model)
    plan_b.validate(model)
    if checkpoint_states(plan_a) != checkpoint_states(plan_b):
        raise ParallelLabError(f"plan A's optimizer {plan_a.optimizer!r} keeps states {checkpoint_states(plan_a)}, "
                               f"plan B's {plan_b.optimizer!r} keeps {checkpoint_states(plan_b)}; a checkpoint moves "
                               f"between plans with the same optimizer")


def predict(model: ModelSpec, plan_a: Plan, plan_b: Plan, cluster: ClusterSpec) -> ReshardPrediction:
    """Bytes written, read and moved per rank, and the time on ``cluster`` (module docstring).

    With more than ``MAX_PAIRS`` rank pairs the per-rank lists are left out and the time is the fullest
    rank's read over the inter-node link (the checkpoint of A is spread over every node: the bound a
    re-shard on a real cluster meets, since a rank's new shard comes from ranks of other nodes)."""
    check_pair(model, plan_a, plan_b)
    total, fullest = checkpoint_bytes(model, plan_a), max_read_bytes(model, plan_b)
    if plan_a.world * plan_b.world > MAX_PAIRS:
        t = cluster.inter.latency + fullest / cluster.inter.bandwidth
        return ReshardPrediction(total, None, None, None, None, fullest, t,
                                 f"{plan_a.world} x {plan_b.world} ranks: the fullest rank of B reads "
                                 f"{fullest:,} B over {cluster.inter.name}")
    pairs = transfers(model, plan_a, plan_b)
    read, moved = [0] * plan_b.world, [0] * plan_b.world
    per_dst: list[float] = [0.0] * plan_b.world
    for (i, j), n in pairs.items():
        read[j] += n
        if i != j:
            moved[j] += n
            tier = mesh.tier_of(cluster, [i, j])
            per_dst[j] += tier.latency + n / tier.bandwidth
    written = [sum(p.numel for p in rank_pieces(model, plan_a, i, written=True)) * STATE_BYTES
               for i in range(plan_a.world)]
    return ReshardPrediction(total, written, read, moved, pairs, fullest, max(per_dst, default=0.0),
                             "rank i of A and rank i of B are the same GPU; each rank of B receives, one after "
                             "the other, the pieces other GPUs wrote, on the link tier between the two")


def kept_bytes(model: ModelSpec, plan_a: Plan, plan_b: Plan, rank: int) -> tuple[int, int]:
    """``(read, kept)`` for one rank of B at any scale: the bytes it needs, and how many of them rank ``rank``
    of A wrote itself (no network needed when the same GPU keeps the same rank number)."""
    mine: dict[tuple[str, str], list[Box]] = {}
    if rank < plan_a.world:
        for p in rank_pieces(model, plan_a, rank, written=True):
            mine.setdefault((p.state, p.name), []).append(p.box)
    read = kept = 0
    for p in rank_pieces(model, plan_b, rank):
        read += p.numel
        kept += sum(_overlap(b, p.box) for b in mine.get((p.state, p.name), ()))
    return read * STATE_BYTES, kept * STATE_BYTES


def _gb(n: float) -> str:
    return f"{n:,} B" if n < 10**6 else f"{n / 1e9:,.3f} GB"


def summary(pred: ReshardPrediction, label_a: str = "A", label_b: str = "B", rows: int = 16) -> str:
    """The prediction as a short table (what ``parallel-lab reshard`` prints)."""
    lines = [f"checkpoint: {_gb(pred.checkpoint_bytes)} (fp32 master weights and optimizer states, each element "
             f"written once by {label_a}'s ranks)"]
    if pred.read is not None:
        lines.append(f"A = {label_a}, B = {label_b}; bytes per rank")
        lines.append(f"{'rank':>4}  {'written by A':>14}  {'read by B':>14}  {'moved to B':>14}")
        for r in range(min(rows, max(len(pred.written), len(pred.read)))):
            w = f"{pred.written[r]:,}" if r < len(pred.written) else "-"
            rd = f"{pred.read[r]:,}" if r < len(pred.read) else "-"
            mv = f"{pred.moved[r]:,}" if r < len(pred.moved) else "-"
            lines.append(f"{r:>4}  {w:>14}  {rd:>14}  {mv:>14}")
        if max(len(pred.written), len(pred.read)) > rows:
            lines.append(f"... ({max(len(pred.written), len(pred.read)) - rows} more ranks; --json lists all)")
    lines.append(f"fullest rank of {label_b} reads {_gb(pred.max_read_bytes)}; estimated time "
                 f"{pred.time_s * 1e3:.3f} ms ({pred.assumption})")
    return "\n".join(lines)


def switch_seconds(checkpoint_bytes: float, storage_bytes_per_s: float, restart_s: float,
                   network_s: float = 0.0) -> float:
    """Wall time a change of plan costs the job: write the checkpoint to storage under the old plan, read it
    back under the new one (``2 x checkpoint / storage bandwidth``), restart (reload, warm up) and the
    network's re-shard (``ReshardPrediction.time_s``, milliseconds at scale)."""
    if storage_bytes_per_s <= 0:
        raise ParallelLabError(f"storage bandwidth {storage_bytes_per_s} B/s must be positive")
    return 2 * checkpoint_bytes / storage_bytes_per_s + restart_s + network_s


def payback_steps(switch_s: float, step_old_s: float, step_new_s: float) -> float:
    """Steps of the new phase after which a re-shard has paid for itself: the switch's cost over what each
    step saves (``switch / (old step - new step)``); ``inf`` when the new plan is not faster."""
    saved = step_old_s - step_new_s
    return math.inf if saved <= 0 else switch_s / saved
