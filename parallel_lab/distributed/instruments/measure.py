"""Memory of one rank of a real-scale plan, measured without allocating it: fake tensors and torch's tracker.

Under ``FakeTensorMode`` every tensor has its shape, dtype and storage size but no memory, and a fake
process group (``init_process_group("fake")``) answers every collective at once. :func:`measure_stage`
builds the full-size model, applies the plan for one rank with the library's own parallelisms
(``runtime.train.parallelize``, as ``parallel-lab run`` does), runs one training step and reads
``parameters``, ``gradients``, ``optimizer_states`` (the implementation's ``measure_state()``),
``activations`` and ``logits_and_loss`` (torch's ``MemTracker``: bytes created in forward and still alive,
the maximum over the step), ``comm_buffers`` (the parts sampled at the calls, each at its peak, beside
``ledger_buffers.comm_buffer_parts``) and ``peak`` (the tracker's, against the ledger's total and
``ledger_peak.peak_moments``). Scalars a fake tensor cannot give read as 1; the rank's batch is real.
Details: docs/measure.md; the comparison with the ledger: README, "Measured at real scale".
"""

from __future__ import annotations

import contextlib
import math
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch._subclasses.fake_tensor import FakeTensorMode, unset_fake_temporarily
from torch.distributed._tools.mem_tracker import _TOTAL_KEY, MemTracker, _MemRefType
from torch.testing._internal.distributed.fake_pg import FakeStore
from torch.utils._python_dispatch import TorchDispatchMode

from parallel_lab.distributed.instruments.alloc_trace import AllocTrace, reserve_of_trace, steady_state
from parallel_lab.distributed.instruments.tracer import CommTracer
from parallel_lab.distributed.model.data import Batch
from parallel_lab.distributed.model.model import Transformer, build_model, loss_fn
from parallel_lab.distributed.runtime.grid import Grid, mesh
from parallel_lab.distributed.runtime.runtime import Runtime, sequential_forward_backward
from parallel_lab.distributed.runtime.train import check_parallelisms, parallelize
from parallel_lab.errors import ParallelLabError
from parallel_lab.ledger import CATEGORIES, memory
from parallel_lab.ledger_buffers import comm_buffer_parts
from parallel_lab.ledger_peak import peak_moments
from parallel_lab.ledger_reserve import ledger_events
from parallel_lab.measurable import measurable_layout
from parallel_lab.specs import ModelSpec, Plan

#: The ledger's activation models, each shown beside the measurement.
FORMULAS = ("per-op", "korthikanti")
#: The row comparing the measured peak with ``ledger_peak.peak_moments`` (the bytes alive at one moment).
PEAK_ONE_MOMENT = "peak (one moment)"
#: The compute dtypes a fake-tensor run can use, with the optimizers whose layout the runnable code has.
_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}     # measurable.MEASURABLE_DTYPES

Progress = Callable[[str], None]


class _ValuesOfTheBatch(TorchDispatchMode):
    """The places where a value reaches a shape or Python: a floating-point scalar read (``loss.item()``,
    Adam's ``step``) answers 1.0 (no code path depends on it beyond a non-zero step count); a boolean one
    answers True (the one such read, ``attention.tile_mask``'s "is any pair of this partial tile visible?",
    is true for every tile of an unpacked batch); ``nonzero`` and boolean indexing (the vocabulary-parallel
    embedding's backward) answer every element: the batch is all token 0, which TP rank 0 (the rank
    measured) holds, so every mask is all true. An integer scalar read of a fake tensor would size a tensor
    from a value nobody computed, so it raises instead (the batch's own values are real: read them before
    faking)."""

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        if func is torch.ops.aten._local_scalar_dense.default:
            if args[0].is_floating_point():
                return 1.0
            if args[0].dtype == torch.bool:
                return True
            raise ParallelLabError(
                f"measure: a {args[0].dtype} scalar of a fake tensor was read (shape {tuple(args[0].shape)}); its "
                "value was never computed, so a shape or a branch would be decided by a guess. Compute it from "
                "the real batch (under unset_fake_temporarily) before the fake tensors")
        if func is torch.ops.aten.nonzero.default:
            x = args[0]
            return torch.empty((x.numel(), x.dim()), dtype=torch.long, device=x.device)    # (n, ndim)
        if func is torch.ops.aten.index.Tensor and any(i is not None and i.dtype == torch.bool for i in args[1]):
            x, idx = args
            if len(idx) != 1:
                raise ParallelLabError("boolean indexing with several indices has no fake-tensor rule here")
            k = idx[0].dim()
            return x.reshape(-1, *x.shape[k:]).clone()       # x[mask], mask all true: (prod(shape[:k]), ...)
        return func(*args, **(kwargs or {}))


@dataclass
class Measurement:
    """Measured beside predicted bytes for one rank of one pipeline stage.

    ``measured``: the ledger's categories plus ``peak`` (None where not measured); ``predicted[formula]``:
    ``ledger.memory(..., activation_model=formula, stage=stage).per_gpu_bytes`` plus ``total``;
    ``tracker_peak``: torch's own categories at the tracker's peak (Parameter, Gradient, Activation, Temp,
    Optstate, ...); ``tracker_activations``: torch's view of ``activations`` (:class:`_Probe`), beside the
    saved-tensor meter's; ``comm_parts``: ``{"measured": {part: bytes}, "predicted": {part: bytes}}``, the
    comm buffers part by part (``tracer.buffers`` and ``ledger_buffers.comm_buffer_parts``).
    """

    model: ModelSpec
    plan: Plan
    stage: int
    rank: int
    measured: dict[str, float | None]
    predicted: dict[str, dict[str, float]]
    tracker_peak: dict[str, int]
    tracker_activations: float
    seconds: float
    cpu_seconds: float
    notes: list[str] = field(default_factory=list)
    comm_parts: dict[str, dict[str, float]] = field(default_factory=dict)
    #: ``ledger_peak.peak_moments(...).to_json()``: the bytes alive at one moment, its peak beside the measured one
    moments: dict[str, Any] = field(default_factory=dict)
    #: the step's allocation trace replayed through ``parallel_lab.allocator`` beside the ledger's moments
    #: replayed (docs/reserve.md): ``{"measured": reserve_of_trace(...), "predicted": {...}}``
    reserve: dict[str, Any] = field(default_factory=dict)

    def error(self, category: str, formula: str = "per-op") -> float | None:
        """``predicted / measured - 1`` for ``category`` (``peak`` compares with the ledger's total,
        ``peak (one moment)`` with :func:`ledger_peak.peak_moments`'s peak, the same for both formulas)."""
        if category == PEAK_ONE_MOMENT:
            m, p = self.measured.get("peak"), self.moments.get("peak_bytes")
            return None if m is None or p is None or m == 0 else p / m - 1
        m = self.measured.get(category)
        p = self.predicted[formula].get("total" if category == "peak" else category)
        if m is None or p is None or (m == 0 and p == 0):
            return None if m is None or p is None else 0.0
        return math.inf if m == 0 else p / m - 1

    def rows(self) -> list[tuple[str, float | None, float, float | None, float, float | None]]:
        """``(category, measured, per-op, error, korthikanti, error)`` for every category and the peak."""
        out = []
        for k in (*CATEGORIES, "peak"):
            key = "total" if k == "peak" else k
            out.append((k, self.measured.get(k), self.predicted["per-op"].get(key, 0.0), self.error(k, "per-op"),
                        self.predicted["korthikanti"].get(key, 0.0), self.error(k, "korthikanti")))
        if self.moments:
            p = self.moments["peak_bytes"]
            out.append((PEAK_ONE_MOMENT, self.measured.get("peak"), p, self.error(PEAK_ONE_MOMENT), p,
                        self.error(PEAK_ONE_MOMENT)))
        return out

    TABLE_HEADER = ("category", "measured", "ledger per-op", "error", "ledger korthikanti", "error")

    def title(self) -> str:
        return (f"measured in fake tensors: rank {self.rank} of {self.plan.world} (pipeline stage {self.stage} "
                f"of {self.plan.pp}), one training step, {self.seconds:.0f} s "
                f"({self.cpu_seconds:.0f} s of CPU); error = predicted / measured - 1")

    def table_rows(self, fmt: Callable[[float], str]) -> list[tuple[str, ...]]:
        """:meth:`rows` as text: bytes through ``fmt``, errors in percent ("-" where not measured)."""
        def pct(e: float | None) -> str:
            return "-" if e is None else ("inf" if math.isinf(e) else f"{e:+.1%}")

        out = [(k, "-" if m is None else fmt(m), fmt(p1), pct(e1), fmt(p2), pct(e2))
               for k, m, p1, e1, p2, e2 in self.rows()]
        if self.moments:           # one figure (per-op activations) at the moment it names
            out[-1] = (PEAK_ONE_MOMENT, out[-1][1], f"{out[-1][2]} ({self.moments['peak']})", out[-1][3], "", "")
        out.insert(len(CATEGORIES) - 2, ("  (torch tracker)", fmt(self.tracker_activations), "", "", "", ""))
        at = [r[0] for r in out].index("comm_buffers") + 1
        got, want = self.comm_parts.get("measured", {}), self.comm_parts.get("predicted", {})
        for part in sorted(set(got) | set(want)):
            m, p = got.get(part), want.get(part, 0.0)
            e = None if m is None else (0.0 if m == p else (math.inf if m == 0 else p / m - 1))
            out.insert(at, (f"  {part}", "-" if m is None else fmt(m), fmt(p), pct(e), fmt(p), pct(e)))
            at += 1
        return out

    def to_json(self) -> dict[str, Any]:
        return {"stage": self.stage, "rank": self.rank, "measured": dict(self.measured),
                "predicted": {f: dict(v) for f, v in self.predicted.items()},
                "error": {f: {k: self.error(k, f) for k in (*CATEGORIES, "peak")} for f in FORMULAS},
                "moments": {**self.moments, "error": self.error(PEAK_ONE_MOMENT)} if self.moments else {},
                "tracker_peak": dict(self.tracker_peak),
                "tracker_activations": self.tracker_activations, "seconds": self.seconds,
                "cpu_seconds": self.cpu_seconds, "notes": list(self.notes),
                "comm_parts": {k: dict(v) for k, v in self.comm_parts.items()},
                "reserve": {k: dict(v) for k, v in self.reserve.items()}}


# --------------------------------------------------------------------------------------------------
# What can be measured
# --------------------------------------------------------------------------------------------------

def check_measurable(model: ModelSpec, plan: Plan) -> torch.dtype:
    """The dtype of the fake model's parameters, or a ParallelLabError naming the fix: the plan rules of
    ``measurable.measurable_layout`` (torch-free), then the runnable code's own checks."""
    dtype = _DTYPES[measurable_layout(model, plan)]
    check_parallelisms(model, plan)
    return dtype


def rank_of_stage(plan: Plan, stage: int) -> int:
    """The global rank measured for ``stage``: data-, context- and tensor-parallel coordinate 0."""
    if not 0 <= stage < plan.pp:
        raise ParallelLabError(f"stage={stage} is not a pipeline stage of pp={plan.pp}; pick 0..{plan.pp - 1}")
    return int(mesh(plan)[0, stage, 0, 0])


# --------------------------------------------------------------------------------------------------
# Reading the tracker at the right moments
# --------------------------------------------------------------------------------------------------

def _nbytes(t: Any) -> int:
    return t.untyped_storage().nbytes() if isinstance(t, Tensor) else 0


class _Probe:
    """torch's view of the activations: the tracker's live forward bytes after each block's forward (less
    the block's output, the next block's input), the maximum over the step."""

    def __init__(self, tracker: MemTracker, rt: Runtime):
        self.tracker, self.rt = tracker, rt
        self.activations = 0
        self._handles = [mod.register_forward_hook(self._after_block) for name, mod in rt.model.named_modules()
                         if name.startswith("blocks.") and name.count(".") == 1]

    def _live(self) -> int:
        """Bytes created in forward and alive now, less ZeRO-3's gathered parameters (not activations)."""
        act = sum(snap.get(_MemRefType.ACT, 0) for snap in self.tracker._curr_mem_snap.values())
        gathered = getattr(self.rt.dp, "leaf", None) or []
        return act - sum(_nbytes(t) for t in gathered)

    def _after_block(self, module: nn.Module, args: Any, out: Tensor) -> None:
        if not self.tracker._mod_tracker.is_bw:          # not a recomputation inside backward
            self.activations = max(self.activations, self._live() - _nbytes(out))

    def remove(self) -> None:
        for h in self._handles:
            h.remove()


class _Tracker(MemTracker):
    """torch's MemTracker, allowing a module to run again at top level within the step: a pipeline stage
    runs each block once per micro-batch, gradient accumulation the whole model (the stock tracker stops,
    taking it for a second iteration). Its per-module statistics then restart; the totals are unaffected."""

    def _pre_fw_hook(self, module: nn.Module, inputs: Any) -> None:
        if module in self.memory_tracking and not self._mod_tracker.is_bw:
            parents = set(self._mod_tracker.parents) - {self._mod_tracker.get_known_fqn(module)}
            if parents == {"Global"}:
                del self.memory_tracking[module]
        super()._pre_fw_hook(module, inputs)

    phase = "forward_backward"
    #: per phase (``forward_backward``, ``step``): the peak snapshot, torch's categories -> bytes
    phase_peaks: dict[str, dict[Any, int]]

    def _update_peak_stats(self, peak_state: Any) -> None:
        # the peak of each phase only: the stock method also walks every module's own peak on every
        # operation, which dominated the run time at 80 blocks (module-wise peaks are not used here)
        if not hasattr(self, "phase_peaks"):
            self.phase_peaks = {}
        total = sum(snap[_TOTAL_KEY] for snap in self._curr_mem_snap.values())
        if self.phase_peaks.get(self.phase, {}).get(_TOTAL_KEY, -1) < total:
            snap: dict[Any, int] = {}
            for dev_snap in self._curr_mem_snap.values():
                for k, v in dev_snap.items():
                    snap[k] = snap.get(k, 0) + v
            self.phase_peaks[self.phase] = snap

    def current(self, kind: Any) -> int:
        return sum(snap.get(kind, 0) for snap in self._curr_mem_snap.values())


def _register_state(tracker: MemTracker, rt: Runtime, trace: AllocTrace | None = None) -> None:
    """Tell the tracker (and ``trace``) about the state built before it started: parameters (module
    parameters and ZeRO-3's shards) and the optimizers' own tensors (master copies that are not parameters)."""
    seen: set[int] = set()

    def add(t: Tensor | None, kind: _MemRefType) -> None:
        if isinstance(t, Tensor) and t.untyped_storage()._cdata not in seen:
            seen.add(t.untyped_storage()._cdata)
            tracker._update_and_maybe_create_winfos(t, kind)     # torch's own registration (private API)
            if trace is not None:
                trace.track(t)

    tracker.track_external(rt.model)
    for p in [*rt.model.parameters(), *rt.dp.params]:
        add(p, _MemRefType.PARAM)
    optimizers = getattr(rt.dp, "optimizers", None) or [getattr(rt.dp, "optimizer", None)]
    for opt in optimizers:
        inner = getattr(opt, "inner", opt)                   # MasterAdamW wraps AdamW over the fp32 masters
        for group in getattr(inner, "param_groups", []):
            for p in group["params"]:
                add(p, _MemRefType.OPT)


def _optimizer_tensors(rt: Runtime) -> list[Tensor]:
    """The tensors the optimizers keep per parameter (AdamW's moments and step counts), made at the first step."""
    optimizers = getattr(rt.dp, "optimizers", None) or [getattr(rt.dp, "optimizer", None)]
    inner = [getattr(opt, "inner", opt) for opt in optimizers if opt is not None]
    return [v for opt in inner for st in getattr(opt, "state", {}).values() for v in st.values()
            if isinstance(v, Tensor)]


# --------------------------------------------------------------------------------------------------
# One stage
# --------------------------------------------------------------------------------------------------

def measure_stage(model: ModelSpec, plan: Plan, stage: int = 0, *, progress: Progress | None = None
                  ) -> Measurement:
    """Run one training step of ``plan``'s rank (dp 0, stage ``stage``, cp 0, tp 0) in fake mode and return
    measured beside predicted bytes (module docstring). Takes seconds (about 14 s for 32 blocks of Llama 3
    8B at 8K tokens on 2 cores); allocates about nothing (tests/distributed/test_measure.py)."""
    say = progress or (lambda msg: None)
    dtype = check_measurable(model, plan)
    rank = rank_of_stage(plan, stage)
    if dist.is_initialized():
        raise ParallelLabError("measure needs a process without a process group (it creates a fake one); "
                               "call it outside launch()/init_process_group")
    t0, c0 = time.perf_counter(), time.process_time()
    notes: list[str] = []
    excepthook = sys.excepthook                 # init_process_group wraps it (a rank prefix), every time
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=plan.world)
    old_dtype = torch.get_default_dtype()
    try:
        grid = Grid.create(plan, rank, own_groups_only=True)        # the fake world: this rank's groups
        # Real tensors: the positions (s,) and this rank's micro-batches and CP chunks cut from the batch (the
        # flash and context-parallel kernels cut their tiles from the positions' values: attention.Tokens.of);
        # the global batch is one row of token ids seen B times (no B x s copy). Every op that reads them
        # makes fake outputs.
        tokens = torch.zeros(1, plan.seq, dtype=torch.long).expand(plan.global_batch, plan.seq)    # (B, s)
        batch = Batch(tokens, tokens, torch.arange(plan.seq))
        with FakeTensorMode(allow_non_fake_inputs=True):
            say(f"stage {stage}: building {model.name or 'the model'} at full size (fake tensors)")
            torch.set_default_dtype(dtype)
            try:
                net = Transformer(model, recompute=plan.recompute, attention=plan.attention, mlp=plan.mlp,
                                  loss_chunk=plan.loss_chunk).train()
            finally:
                torch.set_default_dtype(old_dtype)
            say(f"stage {stage}: applying the plan to rank {rank} of {plan.world}")
            tracer = CommTracer(grid.rank, grid.groups_by_dim())
            rt = parallelize(net, grid, plan, tracer)
            with unset_fake_temporarily():
                micro = rt.micro_batches(batch)
            tracker = _Tracker()
            alloc = AllocTrace()                     # every storage of the step, for the allocator's replay
            _register_state(tracker, rt, alloc)
            opt_before = tracker.current(_MemRefType.OPT)
            probe = _Probe(tracker, rt)
            with tracker, _ValuesOfTheBatch(), tracer.observe(), alloc:
                say(f"stage {stage}: forward and backward of {len(micro)} micro-batch(es) "
                    f"[{time.perf_counter() - t0:.0f} s]")
                rt.dp.zero_grad()
                with rt.meter:
                    (rt.forward_backward or sequential_forward_backward)(rt, micro)
                rt.dp.finish()
                for fn in rt.finalize_grads:
                    fn()
                say(f"stage {stage}: optimizer step [{time.perf_counter() - t0:.0f} s]")
                tracker.phase = "step"
                rt.dp.step()
                state = dict(rt.dp.measure_state())
            lazy_keys = [alloc.key_of(t) for t in _optimizer_tensors(rt)]
            alloc.stop()
            probe.remove()
            lazy = tracker.current(_MemRefType.OPT) - opt_before
    finally:
        dist.destroy_process_group()
        sys.excepthook = excepthook
    # Steady state: the optimizer's moments appear at the first step only (lazily), so in every later step
    # they are alive during forward and backward too: the peak is the larger of (forward/backward peak +
    # the moments) and the step's own peak.
    fb, st = tracker.phase_peaks.get("forward_backward", {}), tracker.phase_peaks.get("step", {})
    fb = {**fb, _MemRefType.OPT: fb.get(_MemRefType.OPT, 0) + lazy, _TOTAL_KEY: fb.get(_TOTAL_KEY, 0) + lazy}
    at_peak = "step" if st.get(_TOTAL_KEY, 0) > fb[_TOTAL_KEY] else "forward/backward"
    peak = {str(getattr(k, "value", k)): int(v) for k, v in (st if at_peak == "step" else fb).items()}
    notes.append(f"peak: steady state, reached in the {at_peak} phase (the optimizer's moments, "
                 f"{lazy / 1e9:.3g} GB, counted from the start of the step as after the first step)")
    measured: dict[str, float | None] = {k: float(state[k]) for k in ("parameters", "gradients",
                                                                         "optimizer_states")}
    measured["activations"] = float(rt.meter.peak["activations"])
    measured["logits_and_loss"] = float(rt.meter.peak["logits_and_loss"])
    parts = {k: float(v) for k, v in tracer.buffers.peaks.items() if v}
    measured["comm_buffers"] = float(sum(parts.values()))
    measured["peak"] = float(peak.get("Total", 0))
    predicted_parts = {k: float(v) for k, v in (comm_buffer_parts(model, plan, stage) or {}).items()}
    predicted = {}
    for f in FORMULAS:
        led = memory(model, plan, activation_model=f, stage=stage)
        predicted[f] = {**led.per_gpu_bytes, "total": led.total_bytes}
    moments = peak_moments(model, plan, stage).to_json()
    traced = reserve_of_trace(steady_state(alloc.events, [k for k in lazy_keys if k is not None]))
    ledger_list = reserve_of_trace(ledger_events(model, plan, stage, activation_model="per-op"))
    gb = {k: {f: v / 1e9 for f, v in d.items()} for k, d in (("t", traced), ("l", ledger_list))}
    notes.append(f"allocator (docs/reserve.md): this step's {traced['events']:.0f} allocations and frees replayed "
                 f"reserve {gb['t']['reserved']:.3g} GB for {gb['t']['peak_requested']:.3g} GB of tensors "
                 f"({gb['t']['reserved_expandable']:.3g} GB with expandable segments); the ledger's moments "
                 f"replayed: {gb['l']['reserved']:.3g} GB ({gb['l']['reserved_expandable']:.3g} GB)")
    seconds = time.perf_counter() - t0
    say(f"stage {stage}: done [{seconds:.0f} s]")
    return Measurement(model, plan, stage, rank, measured, predicted, peak, float(probe.activations), seconds,
                       time.process_time() - c0, notes, {"measured": parts, "predicted": predicted_parts},
                       moments, {"measured": traced, "predicted": ledger_list})


def measure(model: ModelSpec, plan: Plan, stage: int | None = None, *, progress: Progress | None = None
            ) -> list[Measurement]:
    """:func:`measure_stage` for ``stage``, or for every pipeline stage (``stage=None``)."""
    stages = range(plan.pp) if stage is None else [stage]
    return [measure_stage(model, plan, s, progress=progress) for s in stages]


def measure_json(model: ModelSpec, plan: Plan, stage: int | None = None, *, progress: Progress | None = None
                 ) -> dict[str, Any]:
    """Plain data for the CLI's ``--json`` and the Memory explorer's "measure this plan": ``{"stages":
    [Measurement.to_json(), ...], "categories": [...], "formulas": [...]}``."""
    return {"stages": [m.to_json() for m in measure(model, plan, stage, progress=progress)],
            "categories": [*CATEGORIES, "peak"], "formulas": list(FORMULAS)}


def training_step_trace(spec: ModelSpec, seq: int, micro_batch: int = 1, *, seed: int = 0,
                        fake: bool = False) -> list[tuple]:
    """The allocation events of the second training step (forward, backward, AdamW step, ``zero_grad``) of
    the lab's model in fp32 on one process: the first step creates AdamW's moments, which the second holds
    from its start, as every later step does. ``fake``: under ``FakeTensorMode`` (full-size shapes, no
    memory; scalar reads answer as in ``measure.py``), else real tensors on CPU."""
    torch.manual_seed(seed)
    tokens = torch.randint(0, spec.vocab, (micro_batch, seq + 1))
    x, y = tokens[:, :-1], tokens[:, 1:]
    trace = AllocTrace()
    with FakeTensorMode(allow_non_fake_inputs=True) if fake else contextlib.nullcontext(), \
            _ValuesOfTheBatch() if fake else contextlib.nullcontext():
        net = Transformer(spec).train() if fake else build_model(spec, seed=seed)
        opt = torch.optim.AdamW(net.parameters(), lr=1e-3, foreach=False)

        def step() -> None:
            loss = loss_fn(net(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        step()
        trace.existing([*net.parameters(),
                        *(v for st in opt.state.values() for v in st.values() if isinstance(v, Tensor))])
        with trace:
            step()
        trace.stop()
    return trace.events
