"""torchtitan's own Llama 3 70B job measured in fake tensors beside the ledger: TP 8 with sequence parallelism,
FSDP over 8 (64 ranks), seq 8192, local batch 1, op-level selective checkpointing. ``BENCH_LAYERS`` (env, default
4): blocks built on both sides (per-block categories scale with it; 80 is the whole model). Prints the table of
``parallel-lab memory --measure --engine torchtitan`` and the seconds it took; asserts nothing.
"""

from __future__ import annotations

import os

from parallel_lab.specs import ModelSpec, Plan

LAYERS = int(os.environ.get("BENCH_LAYERS", "4"))


def main() -> None:
    from parallel_lab.distributed.instruments.titan_measure import measure_titan

    model = ModelSpec.preset("llama3-70b")
    plan = Plan(seq=8192, micro_batch=1, dp=8, tp=8, sp=True, zero=3, optimizer="fsdp2-mixed", dtype="bf16",
                recompute="op-sac", attention="flash")
    m = measure_titan(model, plan, layers=LAYERS)
    print(f"llama3-70b ({LAYERS} of 80 blocks), tp 8 + sp, fsdp 8, seq 8192, op-sac: {m.seconds:.0f} s")
    for row in m.table_rows(lambda v: f"{v / 2**30:.3f} GiB"):
        print("  " + " | ".join(row))
    for n in m.notes:
        print("  note:", n)


if __name__ == "__main__":
    main()
