"""Hidden tests of tp_mlp: gradients against one process, all-reduces against parallel_lab.comm."""

from __future__ import annotations

import functools

from parallel_lab import comm
from parallel_lab.grading.harness import Fail, diff_calls, doing, points, record_collectives, run_ranks
from parallel_lab.grading.micro import MLP_B, MLP_FFN, MLP_H, MLP_S, mlp_case, mlp_reference, rel_err
from parallel_lab.specs import ModelSpec, Plan


def rank(grid, sub):
    A, Bw, x = mlp_case()
    x = x.clone().requires_grad_(True)
    mlp = sub.ParallelMLP(A, Bw, grid.rank, grid.world)
    with record_collectives() as fwd:
        doing(grid, "forward")
        y = mlp(x)
    with record_collectives() as bwd:
        doing(grid, "backward")
        (y * y).sum().backward()
    return y.detach(), x.grad, mlp.fc.grad, mlp.proj.grad, list(fwd), list(bwd)


@functools.cache
def results(sub):
    return run_ranks(rank, 2, sub)


def predicted(phase):
    spec = ModelSpec(layers=1, hidden=MLP_H, heads=4, ffn=MLP_FFN, vocab=64, flavour="gpt", name="mlp")
    plan = Plan(tp=2, seq=MLP_S, micro_batch=MLP_B, dtype="fp32", optimizer="adam-fp32")
    out = []
    for c in comm.collectives(spec, plan):
        if c.dim == "tp" and c.phase == phase:
            out += [(c.kind, c.message_bytes, c.group_size)] * (c.count // 2)   # attention's half is not here
    return sorted(out)


@points(2)
def test_input_gradient(sub):
    ref = mlp_reference()
    for r, res in enumerate(results(sub)):
        err = rel_err(res[1], ref[1])
        if err > 1e-5:
            ratio = float(res[1].norm() / ref[1].norm())
            raise Fail(f"rank {r}: the gradient at x differs from one process's by {err:.2e} relative "
                       f"(|yours|/|expected| = {ratio:.2f}); f's backward must sum the gradient over the ranks, "
                       "g's backward is the identity")


@points(2)
def test_shard_gradients(sub):
    _, _, gA, gB = mlp_reference()
    n = gA.shape[0] // 2
    for r, res in enumerate(results(sub)):
        wantA, wantB = gA[r * n:(r + 1) * n], gB[:, r * n:(r + 1) * n]
        if res[2] is None or tuple(res[2].shape) != tuple(wantA.shape) or rel_err(res[2], wantA) > 1e-5:
            raise Fail(f"rank {r}: the gradient of your fc shard is not rows {r * n}..{(r + 1) * n - 1} of the full "
                       "fc gradient (column-parallel: keep output rows of fc)")
        if res[3] is None or tuple(res[3].shape) != tuple(wantB.shape) or rel_err(res[3], wantB) > 1e-5:
            raise Fail(f"rank {r}: the gradient of your proj shard is not columns {r * n}..{(r + 1) * n - 1} of the "
                       "full proj gradient (row-parallel: keep input columns of proj)")


@points(2)
def test_all_reduces_as_predicted(sub):
    for r, res in enumerate(results(sub)):
        for phase, calls in (("forward", res[4]), ("backward", res[5])):
            msg = diff_calls(calls, predicted(phase))
            if msg:
                raise Fail(f"rank {r}, {phase}: {msg} (Megatron: g all-reduces in forward, f in backward)")
