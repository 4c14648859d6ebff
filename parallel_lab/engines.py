"""The engines a plan can be made for: the lab's own (``lab``, every choice the ledger models) and torchtitan 0.3.

``parallel-lab plan --engine torchtitan`` searches only what torchtitan's trainer runs (:data:`TORCHTITAN`:
its pipeline schedules, FSDP in place of ZeRO-1, op-level selective checkpointing, all-gather context
parallelism, FSDP2's fp32 master weights and fp32 gradient reduction, fused attention) and a plan file records
its engine. :func:`torchtitan_differences` says, one line each, where a plan made for the lab's engine is not
what torchtitan would run: ``refuse`` lines have no torchtitan setting at all (``launch --entry torchtitan``
refuses them), the others are close settings the launch output names as notes.
"""

from __future__ import annotations

from dataclasses import dataclass

from .optimizers import OPTIMIZERS
from .specs import Plan

ENGINES: tuple[str, ...] = ("lab", "torchtitan")
DEFAULT_ENGINE = "lab"


@dataclass(frozen=True)
class EngineChoices:
    """What an engine can run, as the planner's options: the values tried, and the defaults it plans with
    where the lab's defaults are not what the engine does."""

    schedules: tuple[str, ...]
    zero_stages: tuple[int, ...]
    recompute: tuple[str, ...]
    cp_kinds: tuple[str, ...]
    optimizer: str
    attention: str


#: torchtitan 0.3: ``parallelism.pipeline_parallel_schedule`` names torch.distributed.pipelining's schedules
#: (1F1B, Interleaved1F1B, GPipe here; its zero-bubble ones are V-shaped or interleaved, not ZB-H1); FSDP2 for
#: data parallelism (replicate = ZeRO-0, reshard_after_forward never = ZeRO-2, always = ZeRO-3: no ZeRO-1);
#: SelectiveAC is op-level (op-sac); CP with flex attention all-gathers K and V; FSDP2's mixed precision keeps
#: fp32 sharded parameters and reduces in fp32 (fsdp2-mixed); flex attention never holds the S x S scores.
TORCHTITAN = EngineChoices(schedules=("1f1b", "interleaved", "gpipe"), zero_stages=(0, 2, 3),
                           recompute=("none", "op-sac", "full"), cp_kinds=("allgather",),
                           optimizer="fsdp2-mixed", attention="flash")


def torchtitan_differences(plan: Plan) -> list[tuple[str, bool]]:
    """``(line, refuse)`` for every way ``plan`` is not what torchtitan 0.3 runs; ``refuse``: no setting exists."""
    t, out = TORCHTITAN, []
    if plan.pp > 1 and plan.schedule not in t.schedules:
        out.append((f"schedule={plan.schedule}: torchtitan has no such schedule (it runs 1F1B, Interleaved1F1B, "
                    f"GPipe, and zero-bubble schedules only interleaved or V-shaped); re-plan with --engine "
                    f"torchtitan or --fix schedule=1f1b", True))
    if plan.zero == 1:
        out.append(("zero=1: torchtitan's FSDP shards gradients too; re-plan with --engine torchtitan, or "
                    "--fix zero=2 (FSDP, reshard_after_forward=never)", True))
    if plan.recompute == "selective":
        out.append(("recompute=selective (Korthikanti's attention-core recompute): torchtitan's selective "
                    "checkpointing is op-level, the lab's op-sac, which keeps and recomputes other tensors", False))
    if plan.cp > 1 and plan.cp_kind not in t.cp_kinds:
        out.append((f"cp_kind={plan.cp_kind}: torchtitan's context parallelism all-gathers K and V (cp_kind="
                    f"allgather, Meta's), with other bytes per step", False))
    if plan.dp > 1 and plan.dtype != "fp32" and OPTIMIZERS[plan.optimizer].grad_bytes < 4:
        out.append((f"optimizer={plan.optimizer}: torchtitan's FSDP keeps fp32 master weights and reduces "
                    f"gradients in float32 (mixed_precision_reduce has no other value), twice the data-parallel "
                    f"bytes predicted here; optimizer=fsdp2-mixed is its ledger", False))
    if plan.attention == "eager":
        out.append(("attention=eager: torchtitan's llama3 runs flex attention, which never holds the S x S "
                    "scores the ledger counts here (attention=flash)", False))
    return out
