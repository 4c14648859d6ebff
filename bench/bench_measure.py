"""``parallel-lab memory --measure``: the time of one fake-tensor measurement per kernel option, in one run.

Llama 3 8B at 8K tokens, dp 8, ZeRO-3 (``fsdp2-mixed``, bf16), rank 0: one measurement with the eager
kernels, then one for each kernel option (``--attention flash``, ``--mlp fused``, ``--recompute op-sac``,
``--loss-chunk``) and one with all of them, back to back in this process after a small warm-up
measurement. Printed per option: wall and CPU seconds (the CPU time is less sensitive to other work on the
machine), their ratio to the eager run, and the measured peak and activations (bytes). Goal: every option
at most 3x the eager measurement. Under fake tensors the blockwise attention kernel replays a few
representative tile pairs instead of its loop over every tile (``blockwise_replay.py``; docs/kernels.md,
"Measured in fake tensors"). ``BENCH_SEQ`` (env) sets another sequence length.
"""

from __future__ import annotations

import os
import time
from typing import Any

from parallel_lab.specs import ModelSpec, Plan

SEQ = int(os.environ.get("BENCH_SEQ", "8192"))
LOSS_CHUNK = 1024
OPTIONS: dict[str, dict[str, Any]] = {
    "eager": {},
    "attention=flash": {"attention": "flash"},
    "mlp=fused": {"mlp": "fused"},
    "recompute=op-sac": {"recompute": "op-sac"},
    f"loss_chunk={LOSS_CHUNK}": {"loss_chunk": LOSS_CHUNK},
    "all four": {"attention": "flash", "mlp": "fused", "recompute": "op-sac", "loss_chunk": LOSS_CHUNK},
}


def main() -> None:
    from parallel_lab.distributed.instruments.measure import measure_stage

    model = ModelSpec.preset("llama3-8b")
    base = {"dp": 8, "zero": 3, "seq": SEQ, "optimizer": "fsdp2-mixed", "dtype": "bf16"}
    print(f"llama3-8b, seq {SEQ}, dp 8, ZeRO-3 (fsdp2-mixed, bf16): one measurement per kernel option")
    print(f"{'option':<20} {'wall s':>8} {'cpu s':>8} {'wall/eager':>10} {'cpu/eager':>10} "
          f"{'peak bytes':>16} {'activations':>16}")
    measure_stage(model.with_(layers=1), Plan(**{**base, "seq": 512}))    # warm-up: imports, first-call costs
    ref: tuple[float, float] | None = None
    for name, extra in OPTIONS.items():
        t0, c0 = time.perf_counter(), time.process_time()
        m = measure_stage(model, Plan(**base, **extra))
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
        ref = ref or (wall, cpu)
        print(f"{name:<20} {wall:>8.1f} {cpu:>8.1f} {wall / ref[0]:>10.2f} {cpu / ref[1]:>10.2f} "
              f"{m.measured['peak']:>16,.0f} {m.measured['activations']:>16,.0f}", flush=True)


if __name__ == "__main__":
    main()
