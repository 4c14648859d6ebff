"""Public tests of predict_tp: the README's example, 32 layers of h=4096 at s=4096 over 8 GPUs (bf16), then
llama2-13b over 4 GPUs with 3 micro-batches on the two links of an A100 cluster (against ``parallel_lab.comm``)."""

from __future__ import annotations

from parallel_lab.grading.feedback import check_revealed as check
from parallel_lab.grading.harness import Fail, checks, points, require


@points(2)
@checks("the bytes one GPU sends for TP's all-reduces in one step", "how many all-reduces per layer, in "
        "forward and in backward, and how much of each message does one rank of a ring send?")
def test_readme_example(sub):
    (fn,) = require(sub, "tp_bytes_per_step")
    # `parallel-lab comm --layers 32 --hidden 4096 --heads 32 --seq 4096 --tp 8`: tp 7.52 GB per step
    fb = check(fn(32, 4096, 1, 4096, 8, 2, 1), 7.516e9, rtol=0.001, unit="B", name="TP bytes per step")
    if not fb:
        raise Fail(fb.message)


@points(2)
@checks("the time of TP's all-reduces on a link: latency and bandwidth terms, bandwidth in bytes per second",
        "one all-reduce over a ring of t ranks takes how many steps, each paying the link's latency? The "
        "bandwidth is given in bytes/s per GPU per direction")
def test_time_on_a100_links(sub):
    from parallel_lab import comm
    from parallel_lab.hardware import CLUSTER_PRESETS
    from parallel_lab.specs import ModelSpec, Plan

    nbytes, time = require(sub, "tp_bytes_per_step", "tp_time_per_step")
    spec, s, b, t, m = ModelSpec.preset("llama2-13b"), 2048, 2, 4, 3
    colls = [c for c in comm.collectives(spec, Plan(tp=t, seq=s, micro_batch=b, grad_accum=m)) if c.dim == "tp"]
    fb = check(nbytes(spec.layers, s, b, spec.hidden, t, 2, m), sum(c.wire_bytes for c in colls), rtol=1e-6,
               unit="B", name=f"llama2-13b, s={s}, b={b}, tp={t}, m={m}: bytes")
    if not fb:
        raise Fail(fb.message)
    a100 = CLUSTER_PRESETS["a100-80gb"]
    for tier in (a100.intra, a100.inter):
        want = sum(c.count * comm.collective_time(c.kind, c.message_bytes, c.group_size, tier) for c in colls)
        got = time(spec.layers, s, b, spec.hidden, t, 2, m, tier.bandwidth, tier.latency)
        fb = check(got, want, rtol=1e-6, unit="s", name=f"llama2-13b, tp={t} on {tier.name}: time")
        if not fb:
            raise Fail(fb.message)
