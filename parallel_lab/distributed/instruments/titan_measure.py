"""torchtitan 0.3's own Llama 3 job, one training step measured in fake tensors, beside the ledger.

The plan becomes torchtitan's flags (``cluster_job.torchtitan_flags``: one home for the mapping), its
ConfigManager parses them, a fake process group of the plan's world joins as rank 0, its ParallelDims builds the
mesh and its ``parallelize_fn`` applies TP, activation checkpointing (none, full, its op-level selective save
list) and FSDP2 (per block and root, its reshard choices) to its ``llama3`` model. Under ``FakeTensorMode`` the
trainer's step then runs (forward with ``_skip_lm_head``, its ChunkedLossWrapper with the fp32 cast, backward,
its AdamW) inside torch's ``FSDPMemTracker``. Differences from the GPU job, all of them on the CPU build of
torch: flex attention runs its eager higher-order op (same saved tensors as the compiled kernel, which CPU
backward refuses), ``init_weights`` is skipped (values are never read) and fused AdamW's fake kernel is read at
the step's end (its fake temporaries are not a GPU's). Categories: ``parameters``/``gradients`` the sharded
ones, ``optimizer_states`` after the step, ``activations`` what the blocks keep (live forward bytes after each
block less its output), ``logits_and_loss`` what the loss keeps between chunks, ``comm_buffers`` FSDP's
unsharded parameters and gradients and its all-gather / reduce-scatter buffers (each at its peak),
``temporaries`` the tracker's backward temporaries (no ledger category). Details: docs/measure.md.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from parallel_lab.errors import ParallelLabError
from parallel_lab.specs import ModelSpec, Plan

INSTALL = "pip install -e '.[titan]' (torchtitan 0.3, Python >= 3.11)"
#: torchtitan's ChunkedLossWrapper's default: the sequence cut into this many chunks (llama3 configs)
TITAN_LOSS_CHUNKS = 8
#: measured categories: the ledger's six, then what the ledger has no category for
TITAN_CATEGORIES = ("parameters", "gradients", "optimizer_states", "activations", "logits_and_loss",
                    "comm_buffers", "temporaries", "buffers")
#: FSDPMemTracker's categories that make ``comm_buffers``
COMM_KINDS = ("Unsharded Param", "All Gather", "Unsharded Grad", "Reduce Scatter")
Progress = Callable[[str], None]


def require_torchtitan() -> None:
    """Raise a ParallelLabError naming the install command when torchtitan cannot be imported."""
    try:
        import torchtitan  # noqa: F401
    except ImportError as e:
        raise ParallelLabError(f"--engine torchtitan needs torchtitan ({type(e).__name__}: {e}); install it: "
                               f"{INSTALL}") from None


def titan_plan(model: ModelSpec, plan: Plan) -> Plan:
    """The plan as torchtitan's job runs it, for the ledger: its loss in ``TITAN_LOSS_CHUNKS`` chunks per
    sequence (``loss_chunk``, tokens of one sequence per chunk)."""
    return dataclasses.replace(plan, loss_chunk=plan.seq // TITAN_LOSS_CHUNKS)


def titan_args(model: ModelSpec, plan: Plan) -> list[str]:
    """torchtitan's command line for ``plan`` (``--module M --config C`` and the plan's flags), or a
    ParallelLabError naming what torchtitan cannot run and the fix."""
    from parallel_lab.cluster_job import torchtitan_config, torchtitan_flags
    from parallel_lab.hardware import ClusterSpec
    from parallel_lab.planfile import make_plan_file

    if plan.pp > 1 or plan.cp > 1:
        raise ParallelLabError(f"--engine torchtitan --measure runs one rank without a pipeline or context "
                               f"parallelism (pp={plan.pp}, cp={plan.cp}); measure with --pp 1 --cp 1")
    pf = make_plan_file(model, ClusterSpec.preset("h100-sxm"), plan, phase="measure", engine="torchtitan")
    return [*torchtitan_config(pf), *torchtitan_flags(pf)]


@dataclass
class TitanMeasurement:
    """Measured (torchtitan's job, rank 0) beside predicted (the ledger of :func:`titan_plan`) bytes."""

    model: ModelSpec
    plan: Plan
    measured: dict[str, float]
    predicted: dict[str, float]
    tracker_peak: dict[str, float]
    seconds: float
    notes: list[str] = field(default_factory=list)

    def error(self, category: str) -> float | None:
        """``predicted / measured - 1``; None where the ledger has no such category."""
        m, p = self.measured.get(category), self.predicted.get(category)
        if m is None or p is None:
            return None
        return 0.0 if m == p else (math.inf if m == 0 else p / m - 1)

    TABLE_HEADER = ("category", "torchtitan (measured)", "ledger", "error")

    def table_rows(self, fmt: Callable[[float], str]) -> list[tuple[str, str, str, str]]:
        out = []
        for k in TITAN_CATEGORIES:
            e, p = self.error(k), self.predicted.get(k)
            out.append((k, fmt(self.measured[k]), "-" if p is None else fmt(p), "-" if e is None else f"{e:+.1%}"))
        return out

    def title(self) -> str:
        return (f"torchtitan's job measured in fake tensors: rank 0 of {self.plan.world}, one training step, "
                f"{self.seconds:.0f} s; error = ledger / torchtitan - 1")

    def to_json(self) -> dict[str, Any]:
        return {"engine": "torchtitan", "measured": dict(self.measured), "predicted": dict(self.predicted),
                "error": {k: self.error(k) for k in TITAN_CATEGORIES}, "tracker_peak": dict(self.tracker_peak),
                "seconds": self.seconds, "notes": list(self.notes)}


@contextlib.contextmanager
def _on_cpu() -> Iterator[None]:
    """torchtitan on a CPU build of torch (tests/titan_dryrun.py): its device "cpu"; flex attention's eager
    higher-order op (no CPU-backward refusal, no torch.compile wrapper, uncompiled block masks). Restored after."""
    import torch
    import torch.nn.attention.flex_attention as tfa
    import torchtitan.distributed.parallel_dims as pdm
    import torchtitan.distributed.utils as du
    import torchtitan.models.common.attention as ta
    import torchtitan.tools.utils as tu

    saved = [(tu, "device_type"), (tu, "device_module"), (pdm, "device_type"), (du, "device_type"),
             (ta, "_compiled_create_block_mask"), (tfa, "_validate_device"),
             (tfa, "_FLEX_ATTENTION_DISABLE_COMPILE_DEBUG")]
    old = [getattr(o, a) for o, a in saved]
    old_flex = ta.FlexAttention.__dict__["_compiled_flex_attn"]
    tu.device_type, tu.device_module, pdm.device_type, du.device_type = "cpu", torch.cpu, "cpu", "cpu"
    ta._compiled_create_block_mask = tfa.create_block_mask
    tfa._validate_device = lambda *a: None
    tfa._FLEX_ATTENTION_DISABLE_COMPILE_DEBUG = True
    ta.FlexAttention._compiled_flex_attn = staticmethod(tfa.flex_attention)
    try:
        yield
    finally:
        for (o, a), v in zip(saved, old, strict=True):
            setattr(o, a, v)
        ta.FlexAttention._compiled_flex_attn = old_flex


def _tracker_class() -> Any:
    """FSDPMemTracker that passes flex attention's higher-order op through and keeps, cheaply, each category's
    own peak (the stock one walks every module's peak on every op)."""
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker

    class Tracker(FSDPMemTracker):
        supports_higher_order_operators = True
        skip_opt = False

        def _update_peak_stats(self, peak_state: Any) -> None:
            if self.skip_opt and self._in_opt:
                return
            peaks = self.__dict__.setdefault("raw_peaks", {})     # torch's category keys, named at the end
            for k, v in _summed(self._curr_mem_snap).items():
                if v > peaks.get(k, -1):
                    peaks[k] = v

        def current(self) -> dict[str, int]:
            return _named(_summed(self._curr_mem_snap))

        @property
        def peaks(self) -> dict[str, int]:
            return _named(self.__dict__.get("raw_peaks", {}))

    return Tracker


def _summed(per_device: dict[Any, dict[Any, int]]) -> dict[Any, int]:
    """The tracker's snapshot summed over devices, by torch's category keys."""
    out: dict[Any, int] = {}
    for dev_snap in per_device.values():
        for k, v in dev_snap.items():
            out[k] = out.get(k, 0) + v
    return out


def _named(snap: dict[Any, int]) -> dict[str, int]:
    """Category keys as their names ("Sharded Param", "Activation", "Total", ...)."""
    out: dict[str, int] = {}
    for k, v in snap.items():
        name = str(getattr(k, "value", k))
        out[name] = out.get(name, 0) + int(v)
    return out


def measure_titan(model: ModelSpec, plan: Plan, *, layers: int | None = None,
                  progress: Progress | None = None) -> TitanMeasurement:
    """One training step of torchtitan's job for ``plan`` on rank 0 (module docstring), beside the ledger.
    ``layers``: keep only the first ``layers`` blocks on both sides (the per-block categories scale with it)."""
    require_torchtitan()
    say = progress or (lambda msg: None)
    if layers is not None:
        model = dataclasses.replace(model, layers=layers)
    args = titan_args(model, plan)
    import torch
    import torch.distributed as dist
    import torchtitan.distributed.utils as du
    from torchtitan.components.loss import ChunkedLossWrapper
    from torchtitan.config import ConfigManager
    from torchtitan.distributed.parallel_dims import ParallelDims

    if dist.is_initialized():
        raise ParallelLabError("measure needs a process without a process group (it creates a fake one); "
                               "call it outside launch()/init_process_group")
    t0 = time.perf_counter()
    ac = args.pop()                             # the activation-checkpoint subcommand comes last
    cfg = ConfigManager().parse_args([*args, "--parallelism.spmd_backend", "partial_dtensor", ac])
    excepthook = sys.excepthook
    with _on_cpu():
        du.init_fake_mode(plan.world, "fake_backend", rank=0)
        try:
            pd = ParallelDims.from_config(cfg.parallelism, plan.world)
            pd.build_mesh()
            du.set_spmd_backend(cfg.parallelism.spmd_backend)
            spec, mc = cfg.model_spec, cfg.model_spec.model
            if layers is not None:
                mc.layers = mc.layers[:layers]
            mc.update_from_config(config=cfg)
            say(f"building torchtitan's {spec.name} {spec.flavor} and its parallelize_fn ({ac})")
            with torch.device("meta"):
                net = mc.build()
            net = spec.parallelize_fn(net, parallel_dims=pd, training=cfg.training, parallelism=cfg.parallelism,
                                      compile_config=cfg.compile, ac_config=cfg.activation_checkpoint,
                                      dump_folder=cfg.dump_folder)
            b, s = cfg.training.local_batch_size, cfg.training.seq_len
            positions = torch.arange(s).repeat(b, 1)            # one document per sequence, as real values
            masks = net.get_attention_masks(positions=positions)
            measured, peaks, notes = _step(net, cfg, b, s, positions, masks, ChunkedLossWrapper, say)
        finally:
            dist.destroy_process_group()
            sys.excepthook = excepthook
    return TitanMeasurement(model, plan, measured, titan_ledger(model, plan), peaks, time.perf_counter() - t0,
                            notes)


def titan_ledger(model: ModelSpec, plan: Plan) -> dict[str, float]:
    """The ledger of torchtitan's job: :func:`titan_plan`'s per-op ledger for the model states, and
    ``ledger_titan``'s torchtitan terms for ``activations`` (its norm as this CPU build of torch runs it:
    composite), ``logits_and_loss`` (its chunked loss) and ``comm_buffers`` (FSDP2's buffers, each at its peak)."""
    from parallel_lab.ledger import memory
    from parallel_lab.ledger_titan import titan_activation_bytes, titan_fsdp2_buffers, titan_loss_terms

    tp = titan_plan(model, plan)
    led = memory(model, tp, activation_model="per-op")
    out = {**led.per_gpu_bytes, "activations": titan_activation_bytes(model, tp, led.stage, norm="composite"),
           "logits_and_loss": sum(titan_loss_terms(model, tp, chunks=TITAN_LOSS_CHUNKS).values())}
    fsdp2 = titan_fsdp2_buffers(model, tp)
    if fsdp2:
        out["comm_buffers"] = float(sum(fsdp2.values()))
    return out


def _step(net: Any, cfg: Any, b: int, s: int, positions: Any, masks: Any, chunked: type, say: Progress
          ) -> tuple[dict[str, float], dict[str, float], list[str]]:
    """The trainer's step under fake tensors and the tracker: measured categories, the tracker's peaks, notes."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    def nbytes(t: Any) -> int:
        t = t.to_local() if hasattr(t, "to_local") else t
        return t.untyped_storage().nbytes() if isinstance(t, torch.Tensor) else 0

    with FakeTensorMode(allow_non_fake_inputs=True):
        net.to_empty(device="cpu")
        net.train()
        opts = cfg.optimizer.build(model_parts=[net])
        loss_fn = cfg.loss.build(compile_config=cfg.compile)
        if isinstance(loss_fn, chunked):
            loss_fn.set_lm_head(net.lm_head)
            net._skip_lm_head = True
        x, y = torch.zeros(b, s, dtype=torch.long), torch.zeros(b, s, dtype=torch.long)
        tracker = _tracker_class()(net, opts.optimizers[0])
        tracker.track_inputs((x, y))
        acts = {"blocks": 0, "loss": 0}

        def after_block(mod: Any, a: Any, out: Any) -> None:
            if not tracker._mod_tracker.is_bw:
                acts["blocks"] = max(acts["blocks"], tracker.current().get("Activation", 0) - nbytes(out))

        def before_head(mod: Any, a: Any) -> None:
            # between two loss chunks: what the loss keeps, less the blocks' activations; a module the tracker
            # sees a second time at top level is a second iteration to it: a parent makes it nested
            tracker._mod_tracker.parents.add("chunked-loss")
            cur = tracker.current()
            acts["loss"] = max(acts["loss"], cur.get("Activation", 0) + cur.get("Temp", 0) - acts["end"])

        hooks = [blk.register_forward_hook(after_block) for blk in net.layers.values()]
        with tracker:
            hooks.append(net.lm_head.register_forward_pre_hook(before_head, prepend=True))
            say(f"forward and backward, {b} x {s} tokens")
            pred = net(x, positions=positions, attention_masks=masks)
            acts["end"] = tracker.current().get("Activation", 0)
            loss, _ = loss_fn(pred, y, torch.tensor(float(x.numel())))
            del pred
            loss.backward()
            say("optimizer step")
            tracker.skip_opt = True
            opts.step()
            opts.zero_grad()
        for h in hooks:
            h.remove()
        state = [v for st in opts.optimizers[0].state.values() for v in st.values() if isinstance(v, torch.Tensor)]
        opt_bytes = sum(nbytes(v) for v in state)
    pk = tracker.peaks
    measured = {"parameters": float(pk.get("Sharded Param", 0)), "gradients": float(pk.get("Sharded Grad", 0)),
                "optimizer_states": float(opt_bytes), "activations": float(acts["blocks"]),
                "logits_and_loss": float(acts["loss"]),
                "comm_buffers": float(sum(pk.get(k, 0) for k in COMM_KINDS)),
                "temporaries": float(pk.get("Temp", 0)), "buffers": float(pk.get("Buffer", 0))}
    notes = [f"tracker peak {pk.get('Total', 0) / 2**30:.3f} GiB before the optimizer step (its fused AdamW's fake "
             f"temporaries left out); {', '.join(f'{k} {pk.get(k, 0) / 2**30:.3f}' for k in COMM_KINDS)} GiB"]
    return measured, {k: float(v) for k, v in pk.items()}, notes
