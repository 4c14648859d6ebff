"""torchtitan's own Llama 3 70B job measured in fake tensors beside the ledger: TP 8 with sequence parallelism,
FSDP over 8 (64 ranks), seq 8192, local batch 1, op-level selective checkpointing. ``BENCH_LAYERS`` (env, default
4): blocks built on both sides (per-block categories scale with it; 80 is the whole model). Prints the table of
``parallel-lab memory --measure --engine torchtitan`` and the seconds it took; asserts nothing.
``--table-8b``: instead, the Llama 3.1 8B table of docs/measure.md (2 of 32 blocks, the cases of
tests/test_titan_measure.py), in MiB, ledger / torchtitan.
"""

from __future__ import annotations

import os
import sys

from parallel_lab.distributed.instruments.titan_measure import TITAN_CATEGORIES
from parallel_lab.specs import ModelSpec, Plan

LAYERS = int(os.environ.get("BENCH_LAYERS", "4"))
TABLE_CATEGORIES = tuple(k for k in TITAN_CATEGORIES if k != "buffers")     # the job holds no module buffers


def table_8b() -> None:
    from parallel_lab.distributed.instruments.titan_measure import measure_titan

    model = ModelSpec.preset("llama3-8b")
    print("| case (2 of 32 blocks) | " + " | ".join(TABLE_CATEGORIES) + " |")
    print("|---" * (len(TABLE_CATEGORIES) + 1) + "|")
    for w in (8, 128):
        for b in (1, 2):
            for r in ("none", "full", "op-sac"):
                plan = Plan(seq=8192, micro_batch=b, dp=w, zero=3, optimizer="fsdp2-mixed", dtype="bf16",
                            recompute=r, attention="flash")
                m = measure_titan(model, plan, layers=2)
                cells = []
                for k in TABLE_CATEGORIES:
                    got, e = m.measured[k] / 2**20, m.error(k)
                    p = "-" if e is None else f"{m.predicted[k] / 2**20:,.1f}"
                    cells.append(f"{p} / {got:,.1f}" + ("" if e is None else f" ({e:+.1%})"))
                print(f"| fsdp{w} b{b} {r} | " + " | ".join(cells) + " |")


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
    table_8b() if "--table-8b" in sys.argv[1:] else main()
