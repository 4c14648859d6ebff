"""Public tests of tp_mlp: the output of the parallel MLP on 2 ranks equals one process's (relative error
<= 1e-5); on another shape (h=16, ffn=48, 3 sequences of 5 tokens) the gradient at the input equals one process's
and forward and backward each make one all-reduce of the activation."""

from __future__ import annotations

from parallel_lab.grading.harness import Fail, checks, points, record_collectives, require, run_ranks
from parallel_lab.grading.micro import mlp_case, mlp_reference, rel_err


def forward_rank(grid, sub):
    A, Bw, x = mlp_case()
    return sub.ParallelMLP(A, Bw, grid.rank, grid.world)(x).detach()


def other_case() -> tuple:
    """Seeded ``(A (48, 16), B (16, 48), x (3, 5, 16))``: a shape of its own."""
    import torch

    g = torch.Generator().manual_seed(7)
    return torch.randn(48, 16, generator=g) * 0.3, torch.randn(16, 48, generator=g) * 0.3, torch.randn(3, 5, 16,
                                                                                                        generator=g)


def backward_rank(grid, sub):
    A, Bw, x = other_case()
    x = x.clone().requires_grad_(True)
    mlp = sub.ParallelMLP(A, Bw, grid.rank, grid.world)
    with record_collectives() as fwd:
        y = mlp(x)
    with record_collectives() as bwd:
        (y * y).sum().backward()
    return x.grad, [k for k, _, _ in fwd], [k for k, _, _ in bwd]


@points(2)
@checks("the column- then row-parallel MLP's output, summed over the ranks by g", "each rank's proj gives a "
        "partial y from its slice of the hidden units: what turns the partials into y?")
def test_forward_equals_one_process(sub):
    require(sub, "ParallelMLP", "CopyToParallel", "ReduceFromParallel")
    y_ref = mlp_reference()[0]
    for r, y in enumerate(run_ranks(forward_rank, 2, sub)):
        if tuple(y.shape) != tuple(y_ref.shape):
            raise Fail(f"rank {r}: output shape {tuple(y.shape)}, expected {tuple(y_ref.shape)}")
        err = rel_err(y, y_ref)
        if err > 1e-5:
            raise Fail(f"rank {r}: output differs from one process's MLP by {err:.2e} (relative); does g sum "
                       "the partial outputs of the ranks?")


@points(2)
@checks("f and g in backward: the gradient at x sums the ranks' contributions, with one all-reduce in forward "
        "(g) and one in backward (f)", "every rank used the whole x: whose gradient at x is the true one? And "
        "what is the gradient of a sum with respect to each of its terms?")
def test_backward_reduces_once(sub):
    import torch.nn.functional as F

    require(sub, "ParallelMLP", "CopyToParallel", "ReduceFromParallel")
    A, Bw, x = (t.clone().requires_grad_(True) for t in other_case())
    y = F.gelu(x @ A.T) @ Bw.T
    (y * y).sum().backward()
    for r, (gx, fwd, bwd) in enumerate(run_ranks(backward_rank, 2, sub)):
        if fwd != ["all_reduce"] or bwd != ["all_reduce"]:
            raise Fail(f"rank {r}: collectives in forward {fwd}, in backward {bwd}; expected one all_reduce in each")
        err = rel_err(gx, x.grad)
        if err > 1e-5:
            raise Fail(f"rank {r}: the gradient at x differs from one process's by {err:.2e} (relative); "
                       f"|yours| / |expected| = {float(gx.norm() / x.grad.norm()):.2f}")
