"""Public tests of sp_collectives: on 2 ranks a TP region between the two operators (b=2, s=6, h=8, ffn 16: an MLP
whose hidden units are averaged over the earlier tokens, as attention mixes tokens) gives one process's output tokens
and gradients; forward and backward each make one all-gather and one reduce-scatter of the whole activation."""

from __future__ import annotations

import functools

from parallel_lab.grading.harness import Fail, checks, doing, points, record_collectives, require, run_ranks
from parallel_lab.grading.micro import rel_err


def mlp_case(b: int, s: int, h: int, ffn: int, seed: int) -> tuple:
    """Seeded ``(A (ffn, h), B (h, ffn), x (b, s, h))`` of a GPT MLP ``y = gelu(x A^T) B^T``."""
    import torch

    g = torch.Generator().manual_seed(seed)
    return (torch.randn(ffn, h, generator=g) * 0.3, torch.randn(h, ffn, generator=g) * 0.3,
            torch.randn(b, s, h, generator=g))


def mix(z):
    """Each token's hidden units averaged over the tokens up to it (dim 1): the region mixes tokens, as attention."""
    import torch

    return z.cumsum(1) / torch.arange(1, z.shape[1] + 1, dtype=z.dtype)[:, None]


def mlp_reference(shape: tuple) -> tuple:
    """One process: ``(y, dL/dx, dL/dA)`` for ``y = mix(gelu(x A^T)) B^T``, ``L = sum(y^2)``."""
    import torch.nn.functional as F

    A, Bw, x = (t.clone().requires_grad_(True) for t in mlp_case(*shape))
    y = mix(F.gelu(x @ A.T)) @ Bw.T
    (y * y).sum().backward()
    return y.detach(), x.grad, A.grad


def sp_mlp(grid, sub, shape):
    """This rank: its tokens of the output and of the input gradient, its fc shard's gradient, and the calls of
    forward and of backward."""
    import torch.nn.functional as F

    A, Bw, x = mlp_case(*shape)
    t, r = grid.world, grid.rank
    n, f = x.shape[1] // t, A.shape[0] // t
    xr = x[:, r * n:(r + 1) * n].clone().requires_grad_(True)
    a = A[r * f:(r + 1) * f].clone().requires_grad_(True)
    b = Bw[:, r * f:(r + 1) * f].clone()
    with record_collectives() as fwd:
        doing(grid, "forward: GatherSequence, the MLP shards, ReduceScatterSequence")
        y = sub.ReduceScatterSequence.apply(mix(F.gelu(sub.GatherSequence.apply(xr) @ a.T)) @ b.T)
    with record_collectives() as bwd:
        doing(grid, "backward")
        (y * y).sum().backward()
    return y.detach(), xr.grad, a.grad, list(fwd), list(bwd)


def check_mlp(res: list, shape: tuple) -> None:
    y_ref, gx_ref, gA_ref = mlp_reference(shape)
    t = len(res)
    n, f = y_ref.shape[1] // t, gA_ref.shape[0] // t
    for r, (y, gx, ga, _, _) in enumerate(res):
        want = y_ref[:, r * n:(r + 1) * n]
        if tuple(y.shape) != tuple(want.shape):
            raise Fail(f"rank {r} of {t}: the MLP's output is {tuple(y.shape)}, expected this rank's tokens "
                       f"{tuple(want.shape)}")
        if rel_err(y, want) > 1e-5:
            raise Fail(f"rank {r} of {t}: the output tokens {r * n}..{(r + 1) * n - 1} differ from one process's by "
                       f"{rel_err(y, want):.2e} (relative): are the gathered tokens in order, batch by batch?")
        for what, got, exp in (("the input's tokens", gx, gx_ref[:, r * n:(r + 1) * n]),
                               ("this rank's fc rows", ga, gA_ref[r * f:(r + 1) * f])):
            if got is None or tuple(got.shape) != tuple(exp.shape) or rel_err(got, exp) > 1e-5:
                ratio = "" if got is None or got.shape != exp.shape else \
                    f" (|yours| / |expected| = {float(got.norm() / exp.norm()):.2f})"
                raise Fail(f"rank {r} of {t}: the gradient of {what} differs from one process's{ratio}")


SHAPE = (2, 6, 8, 16, 0)      # b, s, h, ffn, seed


@functools.cache
def results(sub):
    return run_ranks(sp_mlp, 2, sub, SHAPE)


@points(3)
@checks("a TP region between GatherSequence and ReduceScatterSequence (an MLP that mixes tokens) equals one "
        "process's on this rank's tokens, forward and backward", "forward: in which order do the gathered shards "
        "arrive when b > 1? Backward: every rank used every token; whose gradients must be summed, and who keeps "
        "which tokens?")
def test_sp_mlp_equals_one_process(sub):
    require(sub, "GatherSequence", "ReduceScatterSequence")
    check_mlp(results(sub), SHAPE)


@points(2)
@checks("the conjugate pair: forward one all-gather and one reduce-scatter of the whole activation (b s h "
        "elements), and backward the same two", "a backward sends gradients back the way its forward sent "
        "activations: where did each rank's tokens go in forward, and where did each partial sum come from?")
def test_one_gather_and_one_reduce_scatter_each_way(sub):
    require(sub, "GatherSequence", "ReduceScatterSequence")
    b, s, h = SHAPE[:3]
    want = sorted([("all_gather", b * s * h * 4, 2), ("reduce_scatter", b * s * h * 4, 2)])
    for r, (*_, fwd, bwd) in enumerate(results(sub)):
        for phase, got in (("forward", fwd), ("backward", bwd)):
            if sorted(got) != want:
                raise Fail(f"rank {r}, {phase}: calls {sorted(got)}, expected {want} (message: the whole (b, s, h) "
                           "activation of 4-byte elements)")
