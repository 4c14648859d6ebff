"""Re-sharding on ranks: save a checkpoint under one plan, load it under another, count the bytes.

Each rank of plan A writes one file, ``rank{i}.pt``: for every piece it is the first holder of
(``parallel_lab.reshard.holdings``: TP box, pipeline stage, ZeRO shard), the global flat indices of the
elements and their values, taken from the runtime itself (the model's parameters, the optimizer's
``exp_avg``/``exp_avg_sq`` per parameter or in ZeRO-1/2's per-unit optimizers, ZeRO-3's fp32 shards; adam-fp32).
Each rank of plan B lists the global indices it needs in its own order, opens every file of A, copies the
overlap (``hit = position[source_indices]``), counts the bytes it took from each file, and checks that every
element it needs arrived exactly once. ``load_into`` then writes the state into B's runtime (parameters,
shards, optimizer states with their step count), so training continues under B.

Why our own format and not ``torch.distributed.checkpoint``: DCP describes a rank's share of a tensor as
one n-dimensional box (a ``ShardedTensor``'s shards or a ``DTensor``'s placements) and re-shards by box
overlap; ZeRO's flat shards cut a padded concatenation of a unit's tensors at arbitrary element offsets, so
a shard is not a box of any tensor (up to three boxes per tensor, several tensors per shard). We keep the
same idea (save local pieces with global coordinates, read the overlap) with flat global indices.
Measured bytes equal ``parallel_lab.reshard.transfers`` pair by pair (tests/distributed/test_reshard.py).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from parallel_lab import reshard
from parallel_lab.distributed.instruments.tracer import CommTracer
from parallel_lab.distributed.model.data import synthetic_batch
from parallel_lab.distributed.model.model import build_model
from parallel_lab.distributed.runtime.grid import Grid
from parallel_lab.distributed.runtime.runtime import Runtime
from parallel_lab.errors import ParallelLabError
from parallel_lab.specs import ModelSpec, Plan

Key = tuple[str, str]                     # (state, parameter name)


def check_reshardable(spec: ModelSpec, plan: Plan) -> None:
    """Plans whose runtime state this module can read and write: fp32 parameters with adam-fp32."""
    from parallel_lab.distributed.runtime.train import check_runnable

    check_runnable(spec, plan)
    if plan.optimizer != "adam-fp32" or plan.dtype != "fp32":
        raise ParallelLabError(f"optimizer={plan.optimizer!r}, dtype={plan.dtype!r}: the runnable re-sharding reads "
                               f"fp32 parameters and their optimizer states; use --optimizer adam-fp32 --dtype fp32 "
                               f"(the prediction, parallel-lab reshard, covers the mixed-precision layouts)")


def global_index(t: reshard.LocalTensor) -> Tensor:
    """Global flat indices of the local tensor ``t`` in its own row-major order (its TP box of the full tensor)."""
    full = torch.arange(torch.Size(t.shape).numel()).view(t.shape)
    return full[tuple(slice(a, b) for a, b in t.box)].reshape(-1)


def _optimizer_and_shards(rt: Runtime) -> tuple[list[Any], list[Tensor]] | None:
    """ZeRO's per-unit (optimizer, shard) pairs (ZeRO-1/2: one optimizer per unit; ZeRO-3: one for all)."""
    if not rt.plan.zero:
        return None
    shards = list(rt.dp.shards)
    opts = list(rt.dp.optimizers) if hasattr(rt.dp, "optimizers") else [rt.dp.optimizer] * len(shards)
    return opts, shards


def _unit_index(rt: Runtime) -> dict[str, int]:
    """Position of each ZeRO unit in the runtime; its tensors must be those ``sharding`` lists, in order."""
    if not rt.plan.zero:
        return {}
    c = rt.grid.coords
    want: dict[str, list[str]] = {}
    for t in reshard.local_tensors(rt.model.spec, rt.plan.tp, rt.plan.pp, rt.plan.interleave, rt.plan.zero_unit,
                                   rt.plan.pp_split, c["pp"], c["tp"]):
        want.setdefault(t.unit, []).append(t.name)
    have = {u.name: u.names for u in rt.dp.units}
    if have != want:
        raise ParallelLabError(f"rank {rt.grid.rank}: the runtime's ZeRO units {have} are not sharding's {want}")
    return {u.name: i for i, u in enumerate(rt.dp.units)}


def _tensor_of(rt: Runtime, h: reshard.Holding, units: dict[str, int]) -> Tensor:
    """The flat runtime tensor whose elements ``h`` describes (a view: writing into it loads the state)."""
    zs = _optimizer_and_shards(rt)
    if h.at is not None:                                     # a ZeRO shard of unit h.tensor.unit
        opts, shards = zs
        i = units[h.tensor.unit]
        if h.state == "param":
            return shards[i].data.view(-1)[h.at:h.at + h.b - h.a]
        return opts[i].state[shards[i]][h.state].view(-1)[h.at:h.at + h.b - h.a]
    p = dict(rt.model.named_parameters())[h.tensor.name]
    if h.state == "param":
        return p.data.view(-1)[h.a:h.b]
    return rt.dp.optimizer.state[p][h.state].view(-1)[h.a:h.b]


def local_state(rt: Runtime) -> dict[Key, tuple[Tensor, Tensor]]:
    """``{(state, name): (global indices, values)}`` of everything this rank holds, copied from its runtime."""
    holds = reshard.holdings(rt.model.spec, rt.plan, rt.grid.rank)
    units = _unit_index(rt)
    out: dict[Key, list[tuple[Tensor, Tensor]]] = {}
    for h in holds:
        out.setdefault((h.state, h.tensor.name), []).append(
            (global_index(h.tensor)[h.a:h.b], _tensor_of(rt, h, units).detach().clone()))
    return {k: (torch.cat([i for i, _ in v]), torch.cat([x for _, x in v])) for k, v in out.items()}


def _step_count(rt: Runtime) -> int:
    zs = _optimizer_and_shards(rt)
    opt = zs[0][0] if zs else rt.dp.optimizer
    steps = [int(s["step"]) for s in opt.state.values() if "step" in s]
    return steps[0] if steps else 0


def save(rt: Runtime, directory: str | os.PathLike) -> int:
    """Write this rank's pieces (those it is the first holder of) to ``directory/rank{r}.pt``; return bytes."""
    holds = reshard.holdings(rt.model.spec, rt.plan, rt.grid.rank)
    units = _unit_index(rt)
    pieces: dict[Key, list[tuple[Tensor, Tensor]]] = {}
    for h in holds:
        if h.writes:
            pieces.setdefault((h.state, h.tensor.name), []).append(
                (global_index(h.tensor)[h.a:h.b], _tensor_of(rt, h, units).detach().clone()))
    flat = {k: (torch.cat([i for i, _ in v]), torch.cat([x for _, x in v])) for k, v in pieces.items()}
    path = Path(directory) / f"rank{rt.grid.rank}.pt"
    tmp = path.with_suffix(".tmp")
    torch.save({"world": rt.plan.world, "step": _step_count(rt), "pieces": flat}, tmp)
    tmp.replace(path)
    return sum(x.numel() * x.element_size() for _, x in flat.values())


@dataclass
class Loaded:
    """What one rank of plan B read: its state (global indices and values per key), the bytes it took from
    each file of A, and A's optimizer step count."""

    state: dict[Key, tuple[Tensor, Tensor]]
    bytes_from: dict[int, int] = field(default_factory=dict)
    step: int = 0
    seconds: float = 0.0


def read(spec: ModelSpec, plan: Plan, rank: int, directory: str | os.PathLike) -> Loaded:
    """Assemble ``rank``'s state under ``plan`` from the files of ``directory`` (module docstring)."""
    t0 = time.perf_counter()
    need: dict[Key, Tensor] = {}
    for h in reshard.holdings(spec, plan, rank):
        idx = global_index(h.tensor)[h.a:h.b]
        key = (h.state, h.tensor.name)
        need[key] = torch.cat([need[key], idx]) if key in need else idx
    shapes = dict(spec.parameter_shapes())
    values = {k: torch.empty(len(v)) for k, v in need.items()}
    filled = {k: torch.zeros(len(v), dtype=torch.int32) for k, v in need.items()}
    files = sorted(Path(directory).glob("rank*.pt"), key=lambda p: int(p.stem[4:]))
    if not files:
        raise ParallelLabError(f"no checkpoint files rank*.pt in {directory}; save one first")
    out = Loaded({}, {})
    for f in files:
        ckpt = torch.load(f, weights_only=True)
        out.step = int(ckpt["step"])
        src = int(f.stem[4:])
        for key, (sidx, svals) in ckpt["pieces"].items():
            if key not in need:
                continue
            pos = torch.full((torch.Size(shapes[key[1]]).numel(),), -1, dtype=torch.long)
            pos[need[key]] = torch.arange(len(need[key]))
            hit = pos[sidx]
            mask = hit >= 0
            if mask.any():
                values[key][hit[mask]] = svals[mask]
                filled[key][hit[mask]] += 1
                out.bytes_from[src] = out.bytes_from.get(src, 0) + int(mask.sum()) * svals.element_size()
    for key, n in filled.items():
        if not bool((n == 1).all()):
            bad = int((n != 1).nonzero()[0])
            raise ParallelLabError(f"rank {rank}: element {int(need[key][bad])} of {key[1]} ({key[0]}) arrived "
                                   f"{int(n[bad])} times, not once; the files in {directory} are not one checkpoint")
    out.state = {k: (need[k], values[k]) for k in need}
    out.seconds = time.perf_counter() - t0
    return out


def load_into(rt: Runtime, loaded: Loaded) -> None:
    """Write ``loaded`` (read for this rank and plan) into the runtime: parameters or ZeRO-3 shards, and the
    optimizer's states with their step count, created as torch would after ``loaded.step`` steps."""
    holds = reshard.holdings(rt.model.spec, rt.plan, rt.grid.rank)
    zs = _optimizer_and_shards(rt)
    units = _unit_index(rt)
    step = torch.tensor(float(loaded.step))
    states = [s for s in reshard.checkpoint_states(rt.plan) if s != "param"]
    if zs:                                                   # every shard gets zeroed states (padding stays 0)
        opts, shards = zs
        for o, s, u in zip(opts, shards, rt.dp.units, strict=True):
            o.state[s] = {"step": step.clone(), **{k: torch.zeros(u.shard) for k in states}}
    if not rt.plan.zero:
        for p in rt.dp.params:
            rt.dp.optimizer.state[p] = {"step": step.clone(), **{k: torch.zeros_like(p) for k in states}}
    offset: dict[Key, int] = {}
    for h in holds:
        key = (h.state, h.tensor.name)
        _, vals = loaded.state[key]
        o = offset.get(key, 0)
        with torch.no_grad():
            _tensor_of(rt, h, units).copy_(vals[o:o + h.b - h.a])
        offset[key] = o + h.b - h.a


# ---- what launch() runs on each rank -------------------------------------------------------------------

def _runtime(grid: Grid, spec: ModelSpec, plan: Plan, seed: int) -> Runtime:
    from parallel_lab.distributed.runtime.train import parallelize

    check_reshardable(spec, plan)
    model = build_model(spec, seed, recompute=plan.recompute, device=grid.device, attention=plan.attention,
                        mlp=plan.mlp, loss_chunk=plan.loss_chunk)
    return parallelize(model, grid, plan, CommTracer(grid.rank, grid.groups_by_dim()), meter=False)


def _train(rt: Runtime, spec: ModelSpec, plan: Plan, steps: range, seed: int) -> list[float]:
    return [rt.train_step(rt.micro_batches(synthetic_batch(spec, plan, s, seed))) for s in steps]


def _full_parameters(rt: Runtime) -> dict[str, Tensor] | None:
    """The full parameters (every rank takes part in the TP / ZeRO-3 gathers; the owner keeps them)."""
    full = rt.full_parameters()
    return {n: t.detach().clone() for n, t in full.items()} if rt.param_owner else None


def train_and_save(grid: Grid, spec: ModelSpec, plan: Plan, steps: int, directory: str, seed: int = 0) -> dict:
    """Rank function: train ``steps`` steps of ``plan``, save, and return the bytes written, the state as the
    runtime holds it (for the comparison) and the full parameters (the runtime's own TP gathers)."""
    rt = _runtime(grid, spec, plan, seed)
    _train(rt, spec, plan, range(steps), seed)
    written = save(rt, directory)
    full = _full_parameters(rt)
    return {"rank": grid.rank, "written": written, "state": local_state(rt), "params": full}


def load_and_train(grid: Grid, spec: ModelSpec, plan: Plan, directory: str, more_steps: int = 0,
                   seed: int = 0) -> dict:
    """Rank function: read this rank's state under ``plan``, load it into a fresh runtime, return the bytes
    read per file, the loaded state, the runtime's full parameters, then train ``more_steps`` steps further
    and return the losses and the parameters after them."""
    rt = _runtime(grid, spec, plan, seed)
    loaded = read(spec, plan, grid.rank, directory)
    load_into(rt, loaded)
    full = _full_parameters(rt)
    reloaded = local_state(rt)                               # what the runtime now holds, read back
    losses = _train(rt, spec, plan, range(loaded.step, loaded.step + more_steps), seed)
    after = _full_parameters(rt)
    return {"rank": grid.rank, "bytes_from": loaded.bytes_from, "state": reloaded, "params": full,
            "losses": losses, "owns_loss": rt.owns_loss, "params_after": after, "seconds": loaded.seconds,
            "step": loaded.step}


def full_state(states: list[dict[Key, tuple[Tensor, Tensor]]], spec: ModelSpec) -> dict[Key, Tensor]:
    """Full tensors from every rank's ``(indices, values)`` (replicas must agree; a gap is an error)."""
    shapes = dict(spec.parameter_shapes())
    parts: dict[Key, list[tuple[Tensor, Tensor]]] = {}
    for st in states:
        for key, iv in st.items():
            parts.setdefault(key, []).append(iv)
    out: dict[Key, Tensor] = {}
    for key, ivs in parts.items():
        idx, vals = torch.cat([i for i, _ in ivs]), torch.cat([v for _, v in ivs])
        full = torch.zeros(torch.Size(shapes[key[1]]).numel())
        full[idx] = vals
        if not torch.equal(full[idx], vals):
            raise ParallelLabError(f"two ranks hold different values of {key[1]} ({key[0]})")
        missing = int((torch.bincount(idx, minlength=full.numel()) == 0).sum())
        if missing:
            raise ParallelLabError(f"{key[1]} ({key[0]}): {missing} elements are on no rank")
        out[key] = full.view(shapes[key[1]])
    return out


@dataclass
class ReshardResult:
    """A measured re-shard A -> B on CPU ranks beside its prediction (``parallel_lab.reshard.transfers``)."""

    measured: dict[tuple[int, int], int]          # (rank of A that wrote, rank of B that read): bytes
    predicted: dict[tuple[int, int], int]
    written: list[int]                            # bytes per rank of A, measured
    bitwise: dict[str, bool]                      # state -> loaded under B == saved under A, every element
    params_equal: bool                            # B's runtime gathers exactly A's runtime's parameters
    resume_losses: list[float] = field(default_factory=list)
    resume_diff: float | None = None              # after more steps under B, vs the one-process reference
    seconds: dict[str, float] = field(default_factory=dict)


    def to_json(self) -> dict[str, Any]:
        return {"pairs": [[i, j, n, self.predicted.get((i, j), 0)] for (i, j), n in sorted(self.measured.items())],
                "bytes_equal": self.measured == self.predicted, "written": self.written, "bitwise": self.bitwise,
                "params_equal": self.params_equal, "resume_losses": self.resume_losses,
                "resume_diff": self.resume_diff, "seconds": self.seconds}

    def summary(self) -> str:
        """Measured beside predicted, pair by pair, and the bitwise checks."""
        lines = ["measured on CPU ranks (bytes B's rank read from A's file)",
                 f"{'A rank':>6}  {'B rank':>6}  {'measured':>14}  {'predicted':>14}"]
        for (i, j), n in sorted(self.measured.items()):
            p = self.predicted.get((i, j), 0)
            lines.append(f"{i:>6}  {j:>6}  {n:>14,}  {p:>14,}  {'ok' if n == p else 'DIFFERENT'}")
        extra = sorted(set(self.predicted) - set(self.measured))
        lines += [f"{i:>6}  {j:>6}  {0:>14,}  {self.predicted[(i, j)]:>14,}  DIFFERENT" for i, j in extra]
        lines.append("loaded state equals the saved state bit for bit: " + ", ".join(
            f"{k} {'yes' if v else 'NO'}" for k, v in self.bitwise.items()) +
            f"; B's gathered parameters equal A's: {'yes' if self.params_equal else 'NO'}")
        if self.resume_diff is not None:
            lines.append(f"one more step under B: loss {self.resume_losses[0]:.6f}, largest parameter difference "
                         f"from the one-process reference {self.resume_diff:.2e}")
        return "\n".join(lines)


def reshard_run(spec: ModelSpec, plan_a: Plan, plan_b: Plan, steps: int = 1, more_steps: int = 0, seed: int = 0,
                timeout_s: float = 120.0) -> ReshardResult:
    """Train ``steps`` steps under ``plan_a`` on its ranks and save; load under ``plan_b`` on its ranks and
    train ``more_steps`` further; compare states bitwise and bytes pair by pair (caller-side: no process
    group here)."""
    import tempfile

    from parallel_lab.distributed.model.reference import reference_train
    from parallel_lab.distributed.runtime.launch import launch

    reshard.check_pair(spec, plan_a, plan_b)
    for p in (plan_a, plan_b):
        check_reshardable(spec, p)
    if plan_a.global_batch != plan_b.global_batch and more_steps:
        raise ParallelLabError(f"global batch {plan_a.global_batch} (plan A) != {plan_b.global_batch} (plan B): "
                               f"training on after the re-shard compares with one run; set micro_batch, "
                               f"grad_accum and dp so that both are equal")
    seconds = {}
    with tempfile.TemporaryDirectory(prefix="reshard-") as d:
        t0 = time.perf_counter()
        ra = launch(train_and_save, plan_a, spec, plan_a, steps, d, seed, timeout_s=timeout_s)
        t1 = time.perf_counter()
        rb = launch(load_and_train, plan_b, spec, plan_b, d, more_steps, seed, timeout_s=timeout_s)
        seconds = {"save_run": t1 - t0, "load_run": time.perf_counter() - t1,
                   "read_max": max(r["seconds"] for r in rb)}
    fa = full_state([r["state"] for r in ra], spec)
    fb = full_state([r["state"] for r in rb], spec)
    bitwise: dict[str, bool] = {}
    for (state, name), t in fa.items():
        bitwise[state] = bitwise.get(state, True) and (state, name) in fb and torch.equal(t, fb[(state, name)])
    pa = {n: t for r in ra for n, t in (r["params"] or {}).items()}
    pb = {n: t for r in rb for n, t in (r["params"] or {}).items()}
    params_equal = set(pa) == set(pb) and all(torch.equal(pa[n], pb[n]) and torch.equal(pa[n], fa[("param", n)])
                                              for n in pa)
    out = ReshardResult({(i, r["rank"]): n for r in rb for i, n in r["bytes_from"].items()},
                        reshard.transfers(spec, plan_a, plan_b), [r["written"] for r in ra], bitwise,
                        params_equal, seconds=seconds)
    if more_steps:
        owners = [r["losses"] for r in rb if r["owns_loss"]]
        out.resume_losses = [sum(x[i] for x in owners) / len(owners) for i in range(more_steps)]
        after = {n: t for r in rb for n, t in (r["params_after"] or {}).items()}
        ref = reference_train(spec, plan_a, steps + more_steps, seed)
        out.resume_diff = max(float((after[n] - ref.params[n]).abs().max()) for n in ref.params)
    return out

