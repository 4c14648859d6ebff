"""Torch's own engines beside the lab's, on the same ranks, model, data and optimizer (lesson 10).

Four pairs run on 2 gloo ranks, each for ``STEPS`` optimizer steps from the same weights::

    DDP   BucketedDDP                      torch.nn.parallel.DistributedDataParallel(bucket_cap_mb)
    FSDP  Zero3 (a unit per block + root)  fully_shard per block, then on the root (FSDP2)
    TP    ColumnParallel/RowParallelLinear parallelize_module with ColwiseParallel / RowwiseParallel
    PP    PipelineExecutor + 1F1B actions  torch.distributed.pipelining PipelineStage + Schedule1F1B

Both sides of a pair are measured with one ruler, :class:`CollectiveLog`: a ``TorchDispatchMode`` that
sees every collective reaching torch's dispatcher (the ``c10d`` ops behind ``dist.*``, DDP's C++ reducer
and FSDP2; the ``_c10d_functional`` ops of DTensor) and records its kind and message bytes under the lab's
conventions (docs/conventions.md). ``CommDebugMode`` counts the same calls but records no bytes.
:func:`compare_rank` is what ``launch`` runs on each rank; :func:`call_table` sets the lab's prediction
(``comm.stage_collectives``) beside both measurements of the last step.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode

from parallel_lab.distributed.instruments.tracer import CommTracer
from parallel_lab.distributed.model.data import synthetic_batch
from parallel_lab.distributed.model.model import build_model, loss_fn, make_context, make_optimizer
from parallel_lab.distributed.pipeline_parallel.stages import keep_stage, stage_layout
from parallel_lab.distributed.runtime.grid import Grid
from parallel_lab.distributed.runtime.train import parallelize
from parallel_lab.specs import ModelSpec, Plan

SPEC = ModelSpec.preset("tiny-llama").with_(layers=2)
STEPS = 3
_COMMON = {"seq": 32, "optimizer": "adam-fp32", "dtype": "fp32"}
#: engine -> the lab's plan of it (2 ranks each)
PLANS = {
    "DDP": Plan(dp=2, micro_batch=2, bucket_mb=0.25, **_COMMON),
    "FSDP": Plan(dp=2, zero=3, micro_batch=2, **_COMMON),
    "TP": Plan(tp=2, micro_batch=4, **_COMMON),
    "PP": Plan(pp=2, micro_batch=1, grad_accum=4, schedule="1f1b", **_COMMON),
}

#: what torch.distributed's calls dispatch to: op -> (kind, the argument that is the message)
_C10D = {"c10d.allreduce_": ("all_reduce", 0), "c10d._allgather_base_": ("all_gather", 0),
         "c10d._reduce_scatter_base_": ("reduce_scatter", 1), "c10d.alltoall_base_": ("all_to_all", 1),
         "c10d.broadcast_": ("broadcast", 0), "c10d.send": ("send", 0), "c10d.recv_": ("recv", 0)}
#: what DTensor's functional collectives dispatch to: op -> kind. The message is argument 0, but an
#: all-gather's message is its output: the input times the group size (argument 1).
_FUNCTIONAL = {"_c10d_functional.all_reduce": "all_reduce", "_c10d_functional.all_reduce_": "all_reduce",
               "_c10d_functional.all_gather_into_tensor": "all_gather",
               "_c10d_functional.reduce_scatter_tensor": "reduce_scatter",
               "_c10d_functional.all_to_all_single": "all_to_all"}
_SILENT = {"c10d.barrier", "_c10d_functional.wait_tensor", "_c10d_functional._wrap_tensor_autograd"}


def _nbytes(x: Any) -> int:
    if isinstance(x, Tensor):
        return x.numel() * x.element_size()
    return sum(_nbytes(t) for t in x) if isinstance(x, (list, tuple)) else 0


class CollectiveLog(TorchDispatchMode):
    """Inside ``with CollectiveLog() as log:`` every collective this rank starts is appended to
    ``log.calls`` as ``(kind, message_bytes)`` (all-gather: the gathered output; reduce-scatter: the full
    input; the rest: the tensor). An op it does not know is kept as ``("other:<op>", bytes)``."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[str, int]] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        if not isinstance(func, torch._ops.HigherOrderOperator) and DTensor in types:
            return NotImplemented       # DTensor first: its dispatch starts collectives (CommDebugMode's way)
        if func.namespace in ("c10d", "_c10d_functional"):
            name = f"{func.namespace}.{func._opname}"
            if name in _C10D:
                kind, i = _C10D[name]
                self.calls.append((kind, _nbytes(args[i])))
            elif name in _FUNCTIONAL:
                kind = _FUNCTIONAL[name]
                self.calls.append((kind, _nbytes(args[0]) * (args[1] if kind == "all_gather" else 1)))
            elif name not in _SILENT:
                self.calls.append((f"other:{name}", _nbytes(args[:1])))
        return func(*args, **(kwargs or {}))


# ---- torch's engines, applied as a torch user writes them -------------------------------------------------

def apply_fully_shard(model: nn.Module) -> nn.Module:
    """FSDP2 as torchtitan applies it: one ``fully_shard`` per block (a unit: its parameters gathered before
    its forward and again before its backward, its gradient reduce-scattered after), then the root, which
    takes what is left (embedding, final norm, head) as one more unit. Parameters become DTensors sharded
    on dim 0; ``p.to_local()`` is this rank's shard."""
    from torch.distributed.fsdp import fully_shard

    for block in model.blocks.values():
        fully_shard(block)
    fully_shard(model)
    return model


def apply_torch_tp(model: nn.Module, tp: int, device: torch.device) -> nn.Module:
    """Megatron's plan in DTensor words: q, k, v, gate, up column-parallel, o and down row-parallel, the
    embedding cut over the vocabulary (its outputs all-reduced), the head column-parallel with logits left
    sharded over the vocabulary for ``loss_parallel()``."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = init_device_mesh(device.type, (tp,))
    layer = {"attn.wq": ColwiseParallel(), "attn.wk": ColwiseParallel(), "attn.wv": ColwiseParallel(),
             "attn.wo": RowwiseParallel(), "mlp.gate": ColwiseParallel(), "mlp.up": ColwiseParallel(),
             "mlp.down": RowwiseParallel()}
    for block in model.blocks.values():
        parallelize_module(block, mesh, layer)
    parallelize_module(model, mesh, {"tok_emb": RowwiseParallel(input_layouts=Replicate()),
                                     "lm_head": ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)})
    return model


class PipelineStageModule(nn.Module):
    """One stage of the lab's Transformer as torch's pipelining wants it: ``forward(tensor) -> tensor``."""

    def __init__(self, model: nn.Module, blocks: list[int], first: bool, last: bool):
        super().__init__()
        self.model, self.blocks, self.first, self.last = model, blocks, first, last

    def forward(self, x: Tensor) -> Tensor:
        ctx = make_context(torch.arange(x.shape[1], device=x.device))
        h = self.model.embed(x, ctx.positions) if self.first else x
        for i in self.blocks:
            h = self.model.blocks[str(i)](h, ctx)
        return self.model.head(h) if self.last else h


# ---- one engine, lab and torch, on this rank -------------------------------------------------------------

def _full(p: Tensor) -> Tensor:
    return (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()


def _lab(grid: Grid, plan: Plan) -> dict[str, Any]:
    g = Grid.create(plan, grid.rank, grid.device)
    rt = parallelize(build_model(SPEC, seed=0), g, plan, CommTracer(g.rank, g.groups_by_dim()), meter=False)
    losses, calls = [], []
    for step in range(STEPS):
        with CollectiveLog() as log:
            losses.append(float(rt.train_step(rt.micro_batches(synthetic_batch(SPEC, plan, step)))))
        calls = log.calls
    rt.tracer.enabled = False
    state = dict(rt.dp.measure_state()) if plan.zero else {}
    return {"losses": losses, "calls": calls, "params": dict(rt.full_parameters()), "state": state}


def _torch_pp(grid: Grid, plan: Plan) -> dict[str, Any]:
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    layout = stage_layout(SPEC, plan, grid.rank)
    model = keep_stage(build_model(SPEC, seed=0), layout)
    stage = PipelineStage(PipelineStageModule(model, layout.layers, layout.has_embedding, layout.has_head),
                          grid.rank, plan.pp, grid.device)
    schedule = Schedule1F1B(stage, plan.grad_accum, loss_fn=loss_fn)
    opt = make_optimizer(model.parameters(), plan)
    losses, calls = [], []
    for step in range(STEPS):
        batch = synthetic_batch(SPEC, plan, step)
        opt.zero_grad(set_to_none=True)
        with CollectiveLog() as log:
            if layout.has_embedding:
                schedule.step(batch.tokens)
            else:
                micro: list[Tensor] = []
                schedule.step(target=batch.targets, losses=micro)
                losses.append(float(sum(x.detach() for x in micro) / len(micro)))
            opt.step()
        calls = log.calls
    return {"losses": losses, "calls": calls, "params": {n: _full(p) for n, p in model.named_parameters()}}


def _torch(grid: Grid, engine: str, plan: Plan) -> dict[str, Any]:
    """Torch's engine for ``engine`` in a plain torch loop: zero_grad, forward, backward, step."""
    if engine == "PP":
        return _torch_pp(grid, plan)
    model = build_model(SPEC, seed=0)
    loss_ctx: Any = None
    if engine == "DDP":
        net: nn.Module = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=plan.bucket_mb)
    elif engine == "FSDP":
        net = apply_fully_shard(model)
    else:
        from torch.distributed.tensor.parallel import loss_parallel

        net, loss_ctx = apply_torch_tp(model, plan.tp, grid.device), loss_parallel
    opt = make_optimizer(net.parameters(), plan)
    rows = plan.micro_batch
    first = grid.rank * rows if plan.dp > 1 else 0
    losses, calls = [], []
    for step in range(STEPS):
        b = synthetic_batch(SPEC, plan, step).rows(first, first + rows)
        opt.zero_grad(set_to_none=True)
        with CollectiveLog() as log:
            if loss_ctx is None:
                loss = loss_fn(net(b.tokens, b.positions), b.targets)
                loss.backward()
            else:
                with loss_ctx():
                    loss = loss_fn(net(b.tokens, b.positions), b.targets)
                    loss.backward()
            opt.step()
        calls = log.calls
        losses.append(float(_full(loss)))
    out = {"losses": losses, "calls": calls, "params": {n: _full(p) for n, p in model.named_parameters()}}
    if engine == "FSDP":
        out["state"] = _local_state(model, opt)
    return out


def _local_state(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, int]:
    """Bytes this rank holds of FSDP2's sharded parameters, gradients and AdamW state (``to_local()``)."""
    local = lambda t: t.to_local() if hasattr(t, "to_local") else t          # noqa: E731
    params = list(model.parameters())
    moments = [v for p in params for k, v in opt.state[p].items() if k != "step"]
    return {"parameters": sum(_nbytes(local(p)) for p in params),
            "gradients": sum(_nbytes(local(p.grad)) for p in params if p.grad is not None),
            "optimizer_states": sum(_nbytes(local(v)) for v in moments)}


def compare_rank(grid: Grid, engines: tuple[str, ...] = tuple(PLANS)) -> dict[str, Any]:
    """Every engine of ``engines``, the lab's then torch's, on this rank: losses, the last step's
    collectives, final full parameters (and for FSDP the state bytes this rank holds); then the attempt
    at torch's ``context_parallel`` (:func:`try_context_parallel`)."""
    torch.manual_seed(0)
    out: dict[str, Any] = {e: {"lab": _lab(grid, PLANS[e]), "torch": _torch(grid, e, PLANS[e])} for e in engines}
    out["context_parallel"] = try_context_parallel(grid)
    return out


def try_context_parallel(grid: Grid) -> dict[str, str]:
    """Torch's ring attention (``context_parallel``) on these ranks, under the default SDPA backend and
    under the math backend: ``"ok"`` or the error it raised (type and first line)."""
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import context_parallel
    from torch.nn.attention import SDPBackend, sdpa_kernel

    mesh = init_device_mesh(grid.device.type, (dist.get_world_size(),))
    out = {}
    for backend in ("default", "math"):
        gen = torch.Generator().manual_seed(0)
        q, k, v = (torch.randn(1, 4, 64, 32, generator=gen) for _ in range(3))
        try:
            with context_parallel(mesh, buffers=[q, k, v], buffer_seq_dims=[2, 2, 2]):
                with sdpa_kernel(SDPBackend.MATH) if backend == "math" else _null():
                    F.scaled_dot_product_attention(q, k, v, is_causal=True)
            out[backend] = "ok"
        except Exception as e:          # noqa: BLE001 - the error is the result
            out[backend] = f"{type(e).__name__}: {str(e).strip().splitlines()[0][:160]}"
        dist.barrier()
    return out


def ring_attention_kernels() -> list[str]:
    """The SDPA kernels torch's ``context_parallel`` turns into ring attention (the ops its DTensor handler
    table holds, read from torch's private ``_context_parallel._attention.custom_ops``), forwards only."""
    from torch.distributed.tensor.experimental._context_parallel import _attention

    return sorted(op._schema.name.split("::")[1] for op in _attention.custom_ops if "backward" not in str(op))


def _null() -> Any:
    from contextlib import nullcontext

    return nullcontext()


# ---- on the host: predictions beside measurements --------------------------------------------------------

def predicted_calls(engine: str, rank: int) -> Counter:
    """The lab's prediction of one rank's calls per step: ``(kind, message_bytes) -> count``."""
    from parallel_lab.comm import stage_collectives

    plan = PLANS[engine]
    plan.validate(SPEC)
    stage = rank if plan.pp > 1 else 0
    c: Counter = Counter()
    for col in stage_collectives(SPEC, plan, stage):
        c[(col.kind, col.message_bytes)] += col.count
    return c


def call_table(engine: str, results: list[dict[str, Any]], rank: int = 0) -> list[tuple[str, int, int, int, int]]:
    """Rows ``(kind, message_bytes, predicted, lab measured, torch measured)`` of one rank's last step,
    each count the number of calls of that kind and size."""
    pred = predicted_calls(engine, rank)
    lab = Counter(results[rank][engine]["lab"]["calls"])
    ours = Counter(results[rank][engine]["torch"]["calls"])
    keys = sorted(set(pred) | set(lab) | set(ours), key=lambda k: (k[0], -k[1]))
    return [(k, b, pred[(k, b)], lab[(k, b)], ours[(k, b)]) for k, b in keys]


def max_param_diff(a: dict[str, Tensor], b: dict[str, Tensor]) -> float:
    """``max |a - b|`` over the parameters both hold (a pipeline stage holds its own)."""
    common = set(a) & set(b)
    return max(float((a[n].float() - b[n].float()).abs().max()) for n in common) if common else float("nan")
