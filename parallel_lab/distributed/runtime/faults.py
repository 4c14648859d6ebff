"""Fault injection: make one rank die, hang, straggle or produce a NaN, on purpose, at a chosen step.

``parallel-lab run --inject-fault KIND:RANK[:STEP]`` (and ``train_rank(..., faults=[Fault(...)])``) installs
one fault on one rank from optimizer step ``STEP`` (1-based), inside the MLP of the first block it holds:

=========  ==========================================================================================
``die``    the process kills itself with SIGKILL (as the out-of-memory killer would): no traceback
``hang``   the rank sleeps forever in that forward; its heartbeat goes on (alive, not progressing)
``slow``   every forward of that module sleeps :data:`SLOW_S` seconds from then on (a straggler)
``nan``    that module's output becomes NaN, once
=========  ==========================================================================================

``unscaled-accum`` (every rank): each micro-batch's loss is not divided by the number of micro-batches
``m``, so the effective learning rate moves with ``m``. What catches each: ``launch`` names the dead and
the hung rank, ``run``'s per-rank times the straggler, ``diagnosis.FiniteWatch`` the NaN's rank, step and
module, and ``parallel-lab compare`` the loss curves that stop overlapping (docs/faults.md).
"""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from parallel_lab.errors import ParallelLabError

#: The faults, with what each does (the module docstring says more).
FAULT_KINDS: dict[str, str] = {
    "die": "the rank kills itself (SIGKILL) in a forward",
    "hang": "the rank stops in a forward and never returns (alive)",
    "slow": "every forward of one module of the rank sleeps SLOW_S seconds (a straggler)",
    "nan": "one module's output on the rank becomes NaN, once",
    "unscaled-accum": "every rank: micro-batch gradients not divided by the number of micro-batches",
}
RANKLESS = ("unscaled-accum",)
SLOW_S = 1.0        #: seconds a ``slow`` rank sleeps in each forward of the faulty module


@dataclass(frozen=True)
class Fault:
    """One injected fault: ``kind`` (:data:`FAULT_KINDS`), the ``rank`` it strikes (None: every rank, for
    :data:`RANKLESS` kinds), from optimizer ``step`` (1-based); ``module``: where (default: the first
    ``blocks.{i}.mlp`` the rank holds); ``seconds``: a ``slow`` fault's sleep per forward."""

    kind: str
    rank: int | None = None
    step: int = 1
    module: str | None = None
    seconds: float = SLOW_S

    def __post_init__(self) -> None:
        if self.kind not in FAULT_KINDS:
            raise ParallelLabError(f"fault kind {self.kind!r} is unknown; pick one of {', '.join(FAULT_KINDS)}")
        if self.kind in RANKLESS and self.rank is not None:
            raise ParallelLabError(f"fault {self.kind!r} strikes every rank; write it without a rank")
        if self.kind not in RANKLESS and (self.rank is None or self.rank < 0):
            raise ParallelLabError(f"fault {self.kind!r} needs the rank it strikes, e.g. {self.kind}:1 or "
                                   f"{self.kind}:1:2 (rank 1 from step 2)")
        if self.step < 1:
            raise ParallelLabError(f"fault step {self.step} must be >= 1 (steps count from 1)")

    @classmethod
    def parse(cls, text: str) -> Fault:
        """``"die:1"``, ``"hang:0:2"`` (rank 0 from step 2), ``"unscaled-accum"``."""
        parts = text.strip().split(":")
        kind = parts[0]
        if kind in RANKLESS:
            if len(parts) > 1:
                raise ParallelLabError(f"fault {text!r}: {kind} strikes every rank; write just {kind!r}")
            return cls(kind)
        if len(parts) not in (2, 3):
            raise ParallelLabError(f"fault {text!r} is not KIND:RANK[:STEP]; e.g. die:1 or slow:0:2 (KIND one of "
                                   f"{', '.join(FAULT_KINDS)})")
        try:
            nums = [int(p) for p in parts[1:]]
        except ValueError:
            raise ParallelLabError(f"fault {text!r}: RANK and STEP must be integers, e.g. {kind}:1:2") from None
        return cls(kind, nums[0], *(nums[1:]))

    def spelling(self) -> str:
        return self.kind if self.rank is None else f"{self.kind}:{self.rank}:{self.step}"


def check_faults(faults: tuple[Fault, ...], world: int, steps: int) -> None:
    """Refuse, before any process starts, a fault on a rank or step the run does not have."""
    for f in faults:
        if f.rank is not None and f.rank >= world:
            raise ParallelLabError(f"fault {f.spelling()}: rank {f.rank} is not in a run of {world} ranks; "
                                   f"pick 0..{world - 1}")
        if f.step > steps:
            raise ParallelLabError(f"fault {f.spelling()}: step {f.step} is after the last step ({steps}); "
                                   f"pick 1..{steps}")


class _ScaleGrad(torch.autograd.Function):
    """Identity forward; backward multiplies the gradient by ``k`` (the unscaled accumulation)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, k: float) -> Tensor:
        ctx.k = k
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> tuple[Tensor, None]:
        return g * ctx.k, None


def target_module(model: nn.Module, name: str | None = None) -> tuple[str, nn.Module]:
    """The module a fault strikes: ``name``, or the first ``blocks.{i}.mlp`` of ``model``."""
    mods = dict(model.named_modules())
    if name is not None:
        if name not in mods:
            raise ParallelLabError(f"fault module {name!r} is not on this rank; e.g. {next(iter(mods), '')!r}")
        return name, mods[name]
    for n, m in mods.items():
        if n.startswith("blocks.") and n.endswith(".mlp") and n.count(".") == 2:
            return n, m
    return "the model", model


class FaultInjector:
    """The faults of one rank; :meth:`begin_step` arms them when their step comes (``train_rank`` calls it)."""

    def __init__(self, faults: tuple[Fault, ...], rank: int, rt: Any):
        self.rank, self.rt = rank, rt
        self.mine = [f for f in faults if f.rank is None or f.rank == rank]
        self._armed: set[Fault] = set()
        for f in self.mine:
            if f.kind == "unscaled-accum":
                loss, m = rt.loss, rt.plan.grad_accum
                rt.loss = lambda logits, batch, _loss=loss, _m=m: _ScaleGrad.apply(_loss(logits, batch), float(_m))

    def begin_step(self, step: int) -> None:
        for f in self.mine:
            if f.kind == "unscaled-accum" or f in self._armed or step < f.step:
                continue
            self._armed.add(f)
            _, mod = target_module(self.rt.model, f.module)
            if f.kind == "die":
                mod.register_forward_pre_hook(lambda *_: os.kill(os.getpid(), signal.SIGKILL))
            elif f.kind == "hang":
                mod.register_forward_pre_hook(_hang)
            elif f.kind == "slow":
                mod.register_forward_pre_hook(lambda *_, s=f.seconds: time.sleep(s))
            elif f.kind == "nan":
                # prepend: runs before FiniteWatch's check on the same module, which then names it
                _Poison(mod)


class _Poison:
    """A forward hook that turns a module's output into NaN once, then removes itself."""

    def __init__(self, mod: nn.Module):
        self.handle = mod.register_forward_hook(self, prepend=True)

    def __call__(self, module: nn.Module, args: Any, out: Tensor) -> Tensor:
        self.handle.remove()
        return out * float("nan")


def _hang(*_: Any) -> None:
    while True:
        time.sleep(1.0)
