"""Hidden tests of predict_ep: against parallel_lab.comm (dim ep) and parallel_lab.ledger."""

from __future__ import annotations

import math

from parallel_lab import comm, ledger
from parallel_lab.grading.feedback import check_revealed as check
from parallel_lab.grading.harness import Fail, points
from parallel_lab.specs import ModelSpec, Plan

CASES = [("mixtral-8x7b", 4096, 1, 8, 8, 1.25, 1), ("mixtral-8x7b", 2048, 2, 16, 4, 1.0, 2),
         ("deepseekmoe-16b", 4096, 1, 8, 8, 1.25, 4), ("deepseekmoe-16b", 512, 4, 4, 2, 2.0, 1),
         ("tiny-moe", 32, 2, 2, 2, 1.25, 2), ("tiny-moe", 8, 3, 4, 4, 100.0, 1)]


def _case(name, s, b, dp, ep, cf, m):
    spec = ModelSpec.preset(name).with_(capacity_factor=cf)
    plan = Plan(dp=dp, ep=ep, seq=s, micro_batch=b, grad_accum=m).validate(spec)
    return spec, plan


@points(2)
def test_capacity_and_dispatch_equal_comm(sub):
    for name, s, b, dp, ep, cf, m in CASES:
        spec, plan = _case(name, s, b, dp, ep, cf, m)
        cap = sub.expert_capacity(s, spec.experts, spec.top_k, cf)
        if cap != spec.expert_capacity(s):
            raise Fail(f"{name}, s={s}, capacity factor {cf}: capacity is {spec.expert_capacity(s)} slots, you "
                       f"have {cap}")
        got = sub.dispatch_bytes(s, b, spec.hidden, plan.dtype_bytes, spec.experts, spec.top_k, cf)
        fb = check(got, comm.ep_dispatch_bytes(spec, plan), rtol=1e-9, unit="B", name=f"{name}, b={b}: dispatch")
        if not fb:
            raise Fail(fb.message)


@points(3)
def test_bytes_per_step_equal_comm(sub):
    for name, s, b, dp, ep, cf, m in CASES:
        spec, plan = _case(name, s, b, dp, ep, cf, m)
        want = comm.per_step_bytes(c for c in comm.collectives(spec, plan) if c.dim == "ep")["ep"]
        got = sub.ep_bytes_per_step(spec.moe_layers, s, b, spec.hidden, plan.dtype_bytes, spec.experts,
                                    spec.top_k, cf, ep, m)
        fb = check(got, want, rtol=1e-9, unit="B", name=f"{name}, ep={ep}, m={m}: all-to-all bytes per step")
        if not fb:
            raise Fail(fb.message)


@points(2)
def test_params_per_gpu_equal_the_ledger(sub):
    for name, _, _, dp, ep, _, _ in CASES:
        spec = ModelSpec.preset(name)
        routed = sum(math.prod(shape) for n, shape in spec.parameter_shapes() if ".experts." in n)
        plan = Plan(dp=dp, ep=ep, optimizer="adam-fp32", dtype="fp32").validate(spec)
        want = ledger.state_bytes(spec, plan)["parameters"] / 4
        got = sub.params_per_gpu(spec.n_params - routed, routed, ep)
        fb = check(got, want, rtol=1e-9, name=f"{name}, ep={ep}: parameters per GPU")
        if not fb:
            raise Fail(fb.message)
