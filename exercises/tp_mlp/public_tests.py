"""Public tests of tp_mlp: the output of the parallel MLP on 2 ranks equals one process's (relative error
<= 1e-5)."""

from __future__ import annotations

from parallel_lab.grading.harness import Fail, points, require, run_ranks
from parallel_lab.grading.micro import mlp_case, mlp_reference, rel_err


def forward_rank(grid, sub):
    A, Bw, x = mlp_case()
    return sub.ParallelMLP(A, Bw, grid.rank, grid.world)(x).detach()


@points(2)
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
