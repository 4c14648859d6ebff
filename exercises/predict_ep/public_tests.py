"""Public tests of predict_ep: Mixtral 8x7B at 4096 tokens, bf16 (lesson 09's figures); then Mixtral at 1024 tokens
with 3 micro-batches over 2 and 4 expert-parallel GPUs (against ``parallel_lab.comm`` and ``parallel_lab.ledger``)."""

from __future__ import annotations

from parallel_lab.grading.feedback import check_revealed as check
from parallel_lab.grading.harness import Fail, checks, points, require


@points(1)
@checks("GShard's expert capacity: slots per expert for one sequence", "how many (token, expert) pairs does "
        "a sequence make, shared by how many experts, with what slack?")
def test_mixtral_capacity(sub):
    (fn,) = require(sub, "expert_capacity")
    if fn(4096, 8, 2, 1.25) != 1280:
        raise Fail(f"Mixtral's capacity at s=4096 (8 experts, top-2, factor 1.25) is 1280 slots; you have "
                   f"{fn(4096, 8, 2, 1.25)}")


@points(2)
@checks("the buffer one all-to-all exchanges: every expert's capacity for the micro-batch, padded", "the "
        "buffer is fixed in size whatever the router chose: how many slots, of how many bytes?")
def test_mixtral_dispatch(sub):
    (fn,) = require(sub, "dispatch_bytes")
    # `parallel-lab comm --model mixtral-8x7b --dp 8 --ep 8 --seq 4096`: one all-to-all of 83,886,080 B
    fb = check(fn(4096, 1, 4096, 2, 8, 2, 1.25), 83_886_080, rtol=1e-9, unit="B", name="one dispatch")
    if not fb:
        raise Fail(fb.message)


@points(2)
@checks("the all-to-alls of a whole step (forward and backward, every MoE block and micro-batch) and what "
        "expert parallelism splits: the routed experts only", "count the all-to-alls of one MoE block in "
        "forward, then in backward; which parameters does a GPU of the expert-parallel group not hold?")
def test_step_and_parameters(sub):
    import math

    from parallel_lab import comm, ledger
    from parallel_lab.specs import ModelSpec, Plan

    step, per_gpu = require(sub, "ep_bytes_per_step", "params_per_gpu")
    spec = ModelSpec.preset("mixtral-8x7b").with_(capacity_factor=1.5)
    routed = sum(math.prod(shape) for n, shape in spec.parameter_shapes() if ".experts." in n)
    for ep in (2, 4):
        plan = Plan(dp=4, ep=ep, seq=1024, micro_batch=1, grad_accum=3).validate(spec)
        want = comm.per_step_bytes(c for c in comm.collectives(spec, plan) if c.dim == "ep")["ep"]
        got = step(spec.moe_layers, 1024, 1, spec.hidden, 2, spec.experts, spec.top_k, 1.5, ep, 3)
        fb = check(got, want, rtol=1e-9, unit="B",
                   name=f"mixtral-8x7b, s=1024, ep={ep}, m=3: all-to-all bytes per step")
        if not fb:
            raise Fail(fb.message)
        fp32 = Plan(dp=4, ep=ep, optimizer="adam-fp32", dtype="fp32").validate(spec)
        fb = check(per_gpu(spec.n_params - routed, routed, ep), ledger.state_bytes(spec, fp32)["parameters"] / 4,
                   rtol=1e-9, name=f"mixtral-8x7b, ep={ep}: parameters per GPU")
        if not fb:
            raise Fail(fb.message)
