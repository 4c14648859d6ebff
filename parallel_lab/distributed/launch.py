"""Start one process per rank, run a function on each, and bring the results (or the first error) back.

``launch(fn, plan, *args, **kwargs)`` calls ``fn(grid, *args, **kwargs)`` on every rank of
``plan.world`` ranks, where ``grid`` is the rank's :class:`~parallel_lab.distributed.grid.Grid` (coordinates,
process groups, device), and returns the ranks' return values in rank order. ``fn`` must live in an
importable module (a function defined in a notebook cannot be pickled under spawn).

How (measured on this machine, ``shared/reference/torch_cpu_notes.md``):

* ``torch.multiprocessing.start_processes`` with ``fork`` (0.3 s for 4 ranks; spawn takes ~4 s and is
  supported with ``start_method="spawn"``). The caller itself never joins a process group: a process
  that did cannot fork ranks any more, so ``launch`` refuses to run from one.
* Rendezvous ``tcp://127.0.0.1:{free port}`` (asked from the OS, never a fixed port); a process-group
  timeout, so a collective that waits for a dead or stuck peer fails instead of hanging.
* CPU: backend gloo and ``torch.set_num_threads(1)`` per rank (torchrun sets OMP_NUM_THREADS=1,
  multiprocessing does not). GPUs: backend nccl and ``cuda:{local_rank}``; chosen automatically.
* A rank's exception comes back to the caller as :class:`RankError` naming the rank, with the rank's
  traceback text; the other ranks are killed at once. If the ranks do not all finish within
  ``timeout_s`` (a hang), all are killed and :class:`LaunchTimeout` is raised.
* Teardown ``gc.collect(); dist.barrier(); dist.destroy_process_group()``: without the collect and the
  barrier, DTensor-based code aborts at exit in ~15% of runs. A rank that crashes *after* its result was
  received does not fail the launch.

Results travel back pickled by value (tensors are moved to CPU), so return small things: losses,
events, tensors of a tiny model.

Under torchrun (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` set in the environment) the same call runs
``fn`` in this process only, for this rank, with ``env://`` rendezvous, and returns a list of
``world`` entries in which only this rank's is filled (the others are None). The process group then
stays up for further launches of the same script and is torn down at exit. Single node::

    torchrun --standalone --nproc-per-node=8 my_script.py

Several nodes under SLURM (one torchrun per node, which starts 8 ranks)::

    srun --nodes=4 --ntasks-per-node=1 bash -c 'torchrun --nnodes=$SLURM_NNODES --nproc-per-node=8 \\
        --rdzv-id=$SLURM_JOB_ID --rdzv-backend=c10d \\
        --rdzv-endpoint=$(scontrol show hostnames $SLURM_JOB_NODELIST | head -n1):29500 my_script.py'

where ``my_script.py`` calls ``launch(train_rank, plan, ...)`` under ``if __name__ == "__main__":``.
"""

from __future__ import annotations

import atexit
import gc
import os
import pickle
import socket
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from parallel_lab.distributed.grid import Grid
from parallel_lab.specs import ParallelLabError, Plan

DEFAULT_TIMEOUT_S = 300.0


class RankError(RuntimeError):
    """A rank raised; the message names the rank and carries its traceback."""

    def __init__(self, rank: int, tb: str):
        last = tb.strip().splitlines()[-1] if tb.strip() else "unknown error"
        super().__init__(f"rank {rank} failed: {last}\n--- traceback of rank {rank} ---\n{tb}")
        self.rank, self.traceback = rank, tb


class LaunchTimeout(RuntimeError):
    """The ranks did not all finish within the launch timeout (a hang); all were killed."""


def free_port() -> int:
    """A TCP port on 127.0.0.1 that the OS says is free now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def under_torchrun() -> bool:
    """True when torchrun (or another launcher) set this process's rank in the environment."""
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR"))


def pick_device(local_rank: int, device: str | None = None) -> tuple[torch.device, str]:
    """``(device, backend)``: ``cuda:{local_rank}`` with nccl where CUDA is present, else cpu with gloo."""
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda":
        n = torch.cuda.device_count()
        if local_rank >= n:
            raise ParallelLabError(f"local rank {local_rank} needs a GPU but only {n} are visible; use fewer "
                                   f"ranks per node or device='cpu'")
        return torch.device("cuda", local_rank), "nccl"
    return torch.device("cpu"), "gloo"


def _as_plan(plan: Plan | int) -> Plan:
    if isinstance(plan, Plan):
        return plan
    if isinstance(plan, int) and not isinstance(plan, bool) and plan >= 1:
        return Plan(dp=plan)
    raise ParallelLabError(f"launch needs a Plan or a world size, got {plan!r}")


def _to_cpu(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return x.detach().cpu()
    if isinstance(x, dict):
        return {k: _to_cpu(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)) and type(x) in (list, tuple):
        return type(x)(_to_cpu(v) for v in x)
    return x


def _init(rank: int, world: int, local_rank: int, init_method: str, timeout_s: float,
          device: str | None) -> torch.device:
    dev, backend = pick_device(local_rank, device)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    else:
        torch.set_num_threads(1)
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world,
                            timeout=timedelta(seconds=timeout_s))
    return dev


def teardown() -> None:
    """``gc.collect(); barrier; destroy_process_group()``: the clean exit DTensor code needs."""
    if dist.is_initialized():
        gc.collect()
        dist.barrier()
        dist.destroy_process_group()


def _worker(rank: int, fn: Callable, plan: Plan, port: int, queue: Any, pg_timeout_s: float,
            device: str | None, args: tuple, kwargs: dict) -> None:
    try:
        dev = _init(rank, plan.world, rank, f"tcp://127.0.0.1:{port}", pg_timeout_s, device)
        grid = Grid.create(plan, rank, dev)
        grid.notify = lambda msg: queue.put(("progress", rank, msg))
        result = fn(grid, *args, **kwargs)
        payload = pickle.dumps(_to_cpu(result))
        del grid, result
        queue.put(("ok", rank, payload))
    except BaseException:
        try:
            queue.put(("err", rank, traceback.format_exc()))
        finally:
            os._exit(1)   # skip teardown: peers may be dead; the caller kills the rest
    try:
        teardown()
    except BaseException:
        os._exit(1)


def _kill(procs: list) -> None:
    for p in procs:
        if p.is_alive():
            p.kill()
    for p in procs:
        p.join(timeout=5)


def launch(fn: Callable[..., Any], plan: Plan | int, *args: Any, start_method: str = "fork",
           timeout_s: float = DEFAULT_TIMEOUT_S, pg_timeout_s: float | None = None, device: str | None = None,
           on_progress: Callable[[int, Any], None] | None = None, **kwargs: Any) -> list[Any]:
    """Run ``fn(grid, *args, **kwargs)`` on ``plan.world`` ranks; return the results in rank order.

    ``plan``: a Plan (its grid shape is used) or a world size (a pure data-parallel grid).
    ``timeout_s``: the whole launch (start to last result); ``pg_timeout_s``: collectives (default:
    ``timeout_s``). ``device``: force "cpu" or "cuda" (default: cuda when available).
    ``on_progress(rank, msg)``: called in the caller for every ``grid.notify(msg)`` of a rank.
    Raises :class:`RankError` (first rank that failed) or :class:`LaunchTimeout`.
    """
    plan = _as_plan(plan)
    pg_timeout_s = timeout_s if pg_timeout_s is None else pg_timeout_s
    if under_torchrun():
        return _launch_torchrun(fn, plan, args, kwargs, pg_timeout_s, device)
    if dist.is_initialized():
        raise ParallelLabError("launch() was called from a process that joined a process group itself; the "
                               "caller (e.g. a notebook kernel) must never call init_process_group")
    if start_method == "fork" and torch.cuda.is_initialized():
        start_method = "spawn"          # CUDA cannot be used in a child forked after CUDA initialised
    if start_method not in ("fork", "spawn", "forkserver"):
        raise ParallelLabError(f"start_method={start_method!r}; pick fork, spawn or forkserver")
    world = plan.world
    queue = mp.get_context(start_method).SimpleQueue()
    ctx = mp.start_processes(_worker, args=(fn, plan, free_port(), queue, pg_timeout_s, device, args, kwargs),
                             nprocs=world, join=False, start_method=start_method)
    procs = ctx.processes
    results: dict[int, Any] = {}
    deadline = time.monotonic() + timeout_s
    exited_at: dict[int, float] = {}
    try:
        while len(results) < world:
            while not queue.empty():
                status, rank, data = queue.get()
                if status == "err":
                    raise RankError(rank, data)
                if status == "progress":
                    if on_progress is not None:
                        on_progress(rank, data)
                    continue
                results[rank] = pickle.loads(data)
            now = time.monotonic()
            for r, p in enumerate(procs):
                if r not in results and p.exitcode is not None:
                    exited_at.setdefault(r, now)
                    if now - exited_at[r] > 1.0:    # dead and nothing arrived from it
                        raise RankError(r, f"process exited with code {p.exitcode} before returning a result "
                                           f"(killed by a signal if negative)\n")
            if now > deadline:
                missing = [r for r in range(world) if r not in results]
                raise LaunchTimeout(f"ranks {missing} did not finish within timeout_s={timeout_s:g} s (a "
                                    f"hang, e.g. a collective that not every rank calls); all ranks killed")
            time.sleep(0.005)
    except BaseException:
        _kill(procs)
        raise
    for p in procs:   # teardown is a barrier; a rank stuck there after its result is killed
        p.join(timeout=min(30.0, max(5.0, deadline - time.monotonic())))
    _kill(procs)
    return [results[r] for r in range(world)]


def hello(grid: Grid) -> dict[str, Any]:
    """A smoke test for a setup: this rank's place, device and backend, and an all-reduce of the ranks.

    ``launch(hello, 4)`` returns one dict per rank; ``rank_sum`` is ``0 + 1 + ... + (world - 1)`` on all.
    """
    t = torch.tensor([float(grid.rank)], device=grid.device)
    dist.all_reduce(t)
    return {"rank": grid.rank, "world": grid.world, "coords": grid.coords, "device": str(grid.device),
            "backend": dist.get_backend(), "rank_sum": int(t.item()), "pid": os.getpid()}


def _launch_torchrun(fn: Callable, plan: Plan, args: tuple, kwargs: dict, pg_timeout_s: float,
                     device: str | None) -> list[Any]:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    if world != plan.world:
        raise ParallelLabError(f"torchrun started {world} ranks but the plan needs {plan.world} "
                               f"(dp*pp*cp*tp); pass --nproc-per-node/--nnodes to match")
    if dist.is_initialized():
        dev = pick_device(local_rank, device)[0]
    else:
        dev = _init(rank, world, local_rank, "env://", pg_timeout_s, device)
        atexit.register(teardown)     # one process group for all launches of this script (a second
        #                               init on torchrun's store would read the first one's stale keys)
    grid = Grid.create(plan, rank, dev)
    result = fn(grid, *args, **kwargs)
    del grid
    gc.collect()
    dist.barrier()
    out: list[Any] = [None] * world
    out[rank] = result
    return out
