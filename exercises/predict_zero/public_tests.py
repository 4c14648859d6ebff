"""Public tests of predict_zero: the seed's example, 7.5B parameters on 64 GPUs (ZeRO paper, Figure 1), and the
bytes one GPU sends per step at every stage for 2.5B parameters on 4 and 16 GPUs (against ``parallel_lab.comm``)."""

from __future__ import annotations

from parallel_lab.grading.feedback import check_revealed as check
from parallel_lab.grading.harness import Fail, checks, points, require


@points(2)
@checks("the memory per GPU of each stage: which of parameters, gradients and optimizer states are sharded "
        "g ways", "stage k shards the first k of optimizer states, gradients, parameters")
def test_zero_paper_figure1(sub):
    (fn,) = require(sub, "zero_state")
    psi, g = 7_500_000_000, 64
    # Figure 1 of Rajbhandari et al. 2020: 120 GB, 31.4 GB, 16.6 GB, 1.9 GB per GPU for stages 0..3
    for stage, gb in ((0, 120.0), (1, 31.4), (2, 16.6), (3, 1.88)):
        fb = check(sum(fn(psi, g, stage).values()) / 1e9, gb, rtol=0.01, name=f"stage {stage} total (GB)")
        if not fb:
            raise Fail(fb.message)


@points(2)
@checks("the bytes one GPU sends per step at each stage, with the ring's (g - 1) / g and the collectives of "
        "each stage", "which collectives does a stage call, each on how many bytes? How much of a message "
        "does one rank of a ring send for an all-reduce, and for a reduce-scatter or an all-gather?")
def test_bytes_per_stage(sub):
    from parallel_lab import comm
    from parallel_lab.specs import ModelSpec, Plan

    (fn,) = require(sub, "zero_dp_bytes")
    psi = 2_500_000_001
    for g in (4, 16):
        for stage in (0, 1, 2, 3):
            plan = Plan(dp=g, zero=stage, zero_unit="root")
            want = comm.per_step_bytes(comm.collectives(ModelSpec.from_params(psi), plan))["dp"]
            fb = check(fn(psi, g, stage, 2), want, rtol=1e-6, unit="B",
                       name=f"bytes sent per GPU per step, Psi={psi:,}, g={g}, stage {stage}")
            if not fb:
                raise Fail(fb.message)
