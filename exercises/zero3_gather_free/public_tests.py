"""Public tests of zero3_gather_free: on 2 ranks (3 blocks of h=4, one unit per block) the shard gradients equal
one process's; the bytes of full parameters alive at once are one block's, and all three blocks' with one root
unit; the all-gathers and reduce-scatters per unit."""

from __future__ import annotations

import contextlib
import functools

from parallel_lab.grading.harness import Fail, checks, doing, points, record_collectives, require, run_ranks


def case(h: int, n_blocks: int, rows: int, seed: int) -> tuple:
    """Seeded blocks ``[[W (h, h), b (h), g (h)], ...]`` and inputs ``x (rows, h)``."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    blocks = [[torch.randn(h, h, generator=gen) * 0.4, torch.randn(h, generator=gen) * 0.1,
               1 + 0.1 * torch.randn(h, generator=gen)] for _ in range(n_blocks)]
    return blocks, torch.randn(rows, h, generator=gen)


def padded_numel(blocks: list, unit: list[int], world: int) -> int:
    n = sum(t.numel() for i in unit for t in blocks[i])
    return -(-n // world) * world


def reference(h: int, n_blocks: int, rows: int, seed: int, units: list, world: int) -> tuple:
    """One process: the loss (mean over all rows of y^2) and each unit's padded flat gradient."""
    import torch

    blocks, x = case(h, n_blocks, rows, seed)
    params = [[t.clone().requires_grad_(True) for t in blk] for blk in blocks]
    y = x
    for w, b, g in params:
        y = y + g * torch.tanh(y @ w.T + b)
    loss = (y * y).mean()
    loss.backward()
    grads = []
    for unit in units:
        flat = torch.cat([t.grad.reshape(-1) for i in unit for t in params[i]])
        grads.append(torch.cat([flat, flat.new_zeros(padded_numel(blocks, unit, world) - flat.numel())]))
    return float(loss), grads


class GatherWatch:
    """The bytes of all-gather outputs still alive (their storage not freed), sampled after every all-gather
    and at every block's forward; ``peak`` is the largest sample. gloo's worker thread may hold a finished
    call's tensors a moment longer: an older storage counts once it has stayed alive for ``GRACE_S``."""

    GRACE_S = 0.25

    def __init__(self) -> None:
        self.live: dict = {}           # storage address -> (weak reference, bytes)
        self.held: set = set()         # addresses alive past a grace period: kept by the submission
        self.newest = None
        self.peak = 0

    def sample(self) -> None:
        import time

        deadline = time.monotonic() + self.GRACE_S
        while True:
            self.live = {k: (ref, n) for k, (ref, n) in self.live.items() if not ref.expired()}
            self.held &= set(self.live)
            pending = [k for k in self.live if k != self.newest and k not in self.held]
            if not pending:
                break
            if time.monotonic() > deadline:
                self.held.update(pending)
                break
            time.sleep(0.002)
        self.peak = max(self.peak, sum(n for _, n in self.live.values()))

    @contextlib.contextmanager
    def watching(self, sub):
        import torch.distributed as dist
        from torch.multiprocessing.reductions import StorageWeakRef

        def wrap(fn, gathers):
            @functools.wraps(fn)
            def run(*a, **kw):
                out = fn(*a, **kw)
                if gathers:
                    t = kw["output_tensor"] if "output_tensor" in kw else a[0]
                    st = t.untyped_storage()
                    self.newest = st.data_ptr()
                    self.live[self.newest] = (StorageWeakRef(st), t.numel() * t.element_size())
                self.sample()
                return out
            return run

        names = [n for n in ("all_gather_into_tensor", "all_gather_single") if hasattr(dist, n)]
        saved = {n: getattr(dist, n) for n in names}
        block = getattr(sub, "block_forward", None)
        for n in names:
            setattr(dist, n, wrap(saved[n], True))
        if block is not None:
            sub.block_forward = wrap(block, False)
        try:
            yield self
        finally:
            for n in names:
                setattr(dist, n, saved[n])
            if block is not None:
                sub.block_forward = block


def train(grid, sub, h, n_blocks, rows, seed, unit_sets):
    """Per set of units: this rank's loss, shard gradients, peak gathered bytes, forward and backward calls."""
    blocks, x = case(h, n_blocks, rows, seed)
    per = rows // grid.world
    mine = x[grid.rank * per:(grid.rank + 1) * per]
    out = []
    for units in unit_sets:
        doing(grid, f"Zero3(units={units})")
        z = sub.Zero3(blocks, units, grid.rank, grid.world)
        with GatherWatch().watching(sub) as watch:
            with record_collectives() as fwd:
                doing(grid, f"forward, units {units}")
                y = z.forward(mine)
                loss = (y * y).mean()
            with record_collectives() as bwd:
                doing(grid, f"backward, units {units}")
                loss.backward()
        grads = [None if s.grad is None else s.grad.detach().clone() for s in z.shards]
        out.append((float(loss), grads, watch.peak, list(fwd), list(bwd)))
    return out


H, BLOCKS, ROWS, SEED = 4, 3, 4, 0
PER_BLOCK, ROOT = [[0], [1], [2]], [[0, 1, 2]]


@functools.cache
def results(sub):
    """The 2 ranks' runs with one unit per block and with one root unit, launched once."""
    return run_ranks(train, 2, sub, H, BLOCKS, ROWS, SEED, (PER_BLOCK, ROOT))


def check_grads(res: list, h: int, n_blocks: int, rows: int, seed: int, units: list, which: int) -> None:
    """Each rank's shard gradients against one process's (relative 1e-5)."""
    from parallel_lab.grading.micro import rel_err

    _, ref = reference(h, n_blocks, rows, seed, units, len(res))
    for r, runs in enumerate(res):
        _, grads, _, _, _ = runs[which]
        if len(grads) != len(units):
            raise Fail(f"rank {r}: {len(grads)} shards for {len(units)} units (one nn.Parameter per unit)")
        for u, (g, full) in enumerate(zip(grads, ref, strict=True)):
            s = full.numel() // len(res)
            want = full[r * s:(r + 1) * s]
            if g is None or tuple(g.shape) != tuple(want.shape):
                raise Fail(f"rank {r}, unit {u}: the shard's gradient is {None if g is None else tuple(g.shape)}, "
                           f"expected {s} elements (the rank's part of the padded unit)")
            err = rel_err(g, want)
            if err > 1e-5:
                ratio = float(g.norm() / want.norm().clamp_min(1e-30))
                raise Fail(f"rank {r}, unit {u} (blocks {units[u]}): the shard gradient differs from one process's "
                           f"by {err:.2e} relative (|yours| / |expected| = {ratio:.2f})")


@points(3)
@checks("each rank's shard gradient is its part of the gradient of the global mean loss, as one process computes "
        "it", "each rank's backward sees only its own rows: which collective leaves each rank the sum of its part "
        "only, and what turns that sum of per-rank means into the global mean?")
def test_shard_gradients_equal_one_process(sub):
    require(sub, "Zero3", "GatherFree")
    check_grads(results(sub), H, BLOCKS, ROWS, SEED, PER_BLOCK, 0)


@points(2)
@checks("ZeRO-3's memory: with one unit per block, one block's full parameters are alive at a time; one root unit "
        "holds all of them at once", "drop every reference to a unit's gathered parameters as soon as it has "
        "computed, in forward and in backward; what does backward use if forward freed them?")
def test_peak_is_one_block_and_root_holds_all(sub):
    require(sub, "Zero3", "GatherFree")
    blocks, _ = case(H, BLOCKS, ROWS, SEED)
    one = max(padded_numel(blocks, u, 2) for u in PER_BLOCK) * 4
    everything = padded_numel(blocks, ROOT[0], 2) * 4
    for r, runs in enumerate(results(sub)):
        per_block, root = runs[0][2], runs[1][2]
        if per_block == 0:
            raise Fail(f"rank {r}: no all-gather output was seen alive; gather each unit's shards into one flat tensor "
                       "with dist.all_gather_into_tensor (or all_gather_flat_fn()), as the statement asks")
        if per_block != one:
            raise Fail(f"rank {r}: with one unit per block, up to {per_block:,} B of gathered parameters were alive "
                       f"at once; one block's are {one:,} B (all three: {everything:,} B)")
        if root != everything:
            raise Fail(f"rank {r}: with one root unit the peak is {root:,} B; gathering the root unit holds all "
                       f"{everything:,} B at once")


@points(1)
@checks("the calls: per unit one all-gather in forward, one all-gather and one reduce-scatter in backward, each "
        "of the padded unit", "forward gathers a unit just before it runs; backward gathers it again and "
        "reduce-scatters its gradient; no all-reduce")
def test_collectives_per_unit(sub):
    require(sub, "Zero3", "GatherFree")
    blocks, _ = case(H, BLOCKS, ROWS, SEED)
    sizes = [padded_numel(blocks, u, 2) * 4 for u in PER_BLOCK]
    want_f = sorted(("all_gather", b, 2) for b in sizes)
    want_b = sorted([("all_gather", b, 2) for b in sizes] + [("reduce_scatter", b, 2) for b in sizes])
    for r, runs in enumerate(results(sub)):
        fwd, bwd = runs[0][3], runs[0][4]
        for phase, got, want in (("forward", fwd, want_f), ("backward", bwd, want_b)):
            if sorted(got) != want:
                raise Fail(f"rank {r}, {phase} with one unit per block: calls {sorted(got)}, expected {want}")
