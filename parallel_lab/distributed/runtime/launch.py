"""Start one process per rank, run a function on each, and bring the results (or the first error) back.

``launch(fn, plan, *args, **kwargs)`` calls ``fn(grid, *args, **kwargs)`` on every rank of ``plan.world``
ranks (``grid``: the rank's :class:`~parallel_lab.distributed.runtime.grid.Grid`) and returns their
return values in rank order; ``fn`` must live in an importable module. Ranks are forked
(``torch.multiprocessing.start_processes``; ``start_method="spawn"`` also works), meet at
``tcp://127.0.0.1:{free port}`` with a process-group timeout, and run gloo with one torch thread each on
CPU, nccl on ``cuda:{local_rank}`` on GPUs. A rank's exception comes back as :class:`RankError` naming the
rank (a rank killed by a signal is named as the cause, not the peers whose collectives then fail);
``timeout_s`` is a progress timeout (heartbeats and completed steps in shared memory) after which
:class:`LaunchTimeout` names the stuck rank and its last action (``diagnosis.ActionLog``).

Under torchrun (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` set) the same call runs ``fn`` for this rank only
with ``env://`` rendezvous and returns a list in which only this rank's entry is filled::

    torchrun --standalone --nproc-per-node=8 my_script.py

How each part works, and the SLURM form: docs/launch.md.
"""

from __future__ import annotations

import atexit
import functools
import gc
import os
import pickle
import signal
import socket
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from parallel_lab.cluster_job import under_torchrun
from parallel_lab.distributed.runtime.grid import Grid
from parallel_lab.errors import ParallelLabError
from parallel_lab.specs import Plan

#: Seconds without a completed step (or a result) before a launch counts as stuck; generous, because a
#: function that never calls ``grid.notify`` makes progress only when it returns (``parallel-lab run``
#: notifies every step and uses 60 s, ``cli.run.RUN_TIMEOUT_S``).
DEFAULT_TIMEOUT_S = 300.0
HEARTBEAT_S = 1.0            #: a rank's heartbeat period; ~5 missed beats mean it is stopped or frozen
ACTION_BYTES = 160           #: shared-memory slot of a rank's current action: 1 byte "blocked?" + its text
ERROR_GRACE_S = 1.5          #: how long an error waits for news that a peer died first


class RankError(RuntimeError):
    """A rank raised or died; the message names the rank and carries its traceback.

    ``rank``; ``traceback`` (text); ``exc_type`` (the exception's class name, or None when the rank died
    without one); ``signal`` (the signal that ended it, or None); ``step`` (steps it completed, or None
    when it never reported one); ``log`` (a file with the full traceback, or None); ``last_action`` (what
    the rank was doing when it ended, as it recorded it with ``grid.record``; None if it recorded nothing).
    """

    def __init__(self, rank: int, tb: str, *, signal: int | None = None, step: int | None = None,
                 log: str | None = None, exc_type: str | None = None, last_action: str | None = None):
        last = tb.strip().splitlines()[-1] if tb.strip() else "unknown error"
        doing = f" (last action: {last_action})" if last_action else ""
        super().__init__(f"rank {rank} failed: {last}{doing}\n--- traceback of rank {rank} ---\n{tb}")
        self.rank, self.traceback, self.signal, self.step, self.log = rank, tb, signal, step, log
        self.exc_type = exc_type
        self.last_line = last
        self.last_action = last_action


class LaunchTimeout(RuntimeError):
    """No step completed within the progress timeout (or the wall-clock limit passed); all ranks were killed.

    ``ranks``: the ranks named as stuck; ``steps``: steps completed per rank; ``stopped``: ranks whose
    heartbeat had stopped (a stopped or frozen process) when the launch gave up; ``actions``: each rank's last
    recorded action (None where it recorded none).
    """

    def __init__(self, message: str, ranks: list[int] | None = None, steps: list[int] | None = None,
                 stopped: list[int] | None = None, actions: list[str | None] | None = None):
        super().__init__(message)
        self.ranks, self.steps, self.stopped = ranks or [], steps or [], stopped or []
        self.actions = actions or []


def free_port() -> int:
    """A TCP port on 127.0.0.1 that the OS says is free now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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


def _heartbeat(beats: Any, rank: int) -> None:
    """Write this rank's clock into shared memory once a second (no lock: one writer per slot)."""
    while True:
        beats[rank] = time.monotonic()
        time.sleep(HEARTBEAT_S)


def _write_action(actions: Any, rank: int, text: str, waiting: bool) -> None:
    """Put ``text`` into this rank's slot (one writer per slot; a reader may rarely see a torn line)."""
    data = (b"1" if waiting else b"0") + text.encode("utf-8", "replace")[:ACTION_BYTES - 1]
    actions[rank * ACTION_BYTES:(rank + 1) * ACTION_BYTES] = data.ljust(ACTION_BYTES, b"\0")


def read_action(actions: Any, rank: int) -> tuple[str | None, bool]:
    """``(text, waiting)`` of a rank's slot; ``(None, False)`` when it recorded nothing."""
    raw = bytes(actions[rank * ACTION_BYTES:(rank + 1) * ACTION_BYTES]).rstrip(b"\0")
    if not raw:
        return None, False
    return raw[1:].decode("utf-8", "replace"), raw[:1] == b"1"


def _worker(rank: int, fn: Callable, plan: Plan, port: int, queue: Any, pg_timeout_s: float,
            device: str | None, args: tuple, kwargs: dict, beats: Any = None, actions: Any = None) -> None:
    try:
        if beats is not None:
            beats[rank] = time.monotonic()
            threading.Thread(target=_heartbeat, args=(beats, rank), daemon=True).start()
        dev = _init(rank, plan.world, rank, f"tcp://127.0.0.1:{port}", pg_timeout_s, device)
        grid = Grid.create(plan, rank, dev)
        grid.notify = lambda msg: queue.put(("progress", rank, msg))
        if actions is not None:
            grid.record = lambda text, waiting: _write_action(actions, rank, text, waiting)
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


def _signal_name(sig: int) -> str:
    try:
        return signal.Signals(sig).name
    except ValueError:
        return f"signal {sig}"


def _write_log(rank: int, text: str) -> str | None:
    """The full traceback of a failed rank in a file (its path goes into the report)."""
    try:
        fd, path = tempfile.mkstemp(prefix=f"parallel_lab-rank{rank}-", suffix=".log")
        with os.fdopen(fd, "w") as f:
            f.write(text)
        return path
    except OSError:
        return None


def _exc_type(tb: str) -> str | None:
    last = tb.strip().splitlines()[-1] if tb.strip() else ""
    name = last.split(":", 1)[0].strip()
    return name.rsplit(".", 1)[-1] if name and " " not in name else None


@functools.cache
def prime_lazy_imports() -> None:
    """Import in this process what torch imports on first use, so that the ranks forked from it inherit it.

    The first optimizer a process builds imports ``torch._dynamo`` (torch.optim's compile guards), about
    1.8 CPU-s and some 800 modules. Every forked rank paid that again while its parent had not: with 16
    ranks on 2 cores, 20 s of a 24 s one-step run of the tiny 4-D plan; primed, about 7 s."""
    import torch._dynamo  # noqa: F401


def launch(fn: Callable[..., Any], plan: Plan | int, *args: Any, start_method: str = "fork",
           timeout_s: float = DEFAULT_TIMEOUT_S, time_limit_s: float | None = None,
           pg_timeout_s: float | None = None, device: str | None = None,
           on_progress: Callable[[int, Any], None] | None = None, **kwargs: Any) -> list[Any]:
    """Run ``fn(grid, *args, **kwargs)`` on ``plan.world`` ranks; return the results in rank order.

    ``plan``: a Plan (its grid shape is used) or a world size (a pure data-parallel grid).
    ``timeout_s``: the progress timeout (no step completed, i.e. no ``grid.notify`` and no result, for
    that long: stuck); ``time_limit_s``: an optional wall-clock limit on the whole launch;
    ``pg_timeout_s``: collectives (default ``timeout_s + 30``). ``device``: force "cpu" or "cuda"
    (default: cuda when available). ``on_progress(rank, msg)``: called in the caller for every
    ``grid.notify(msg)`` of a rank. Raises :class:`RankError` (the rank that failed first, a dead rank
    before the peers it took down) or :class:`LaunchTimeout`.
    """
    plan = _as_plan(plan)
    if not (timeout_s > 0 and (time_limit_s is None or time_limit_s > 0)):
        raise ParallelLabError(f"timeout_s={timeout_s!r} and time_limit_s={time_limit_s!r} must be > 0 seconds")
    pg_timeout_s = timeout_s + 30.0 if pg_timeout_s is None else pg_timeout_s
    if under_torchrun():
        return _launch_torchrun(fn, plan, args, kwargs, pg_timeout_s, device)
    if dist.is_initialized():
        raise ParallelLabError("launch() was called from a process that joined a process group itself; the "
                               "caller (e.g. a notebook kernel) must never call init_process_group")
    if start_method == "fork" and torch.cuda.is_initialized():
        start_method = "spawn"          # CUDA cannot be used in a child forked after CUDA initialised
    if start_method not in ("fork", "spawn", "forkserver"):
        raise ParallelLabError(f"start_method={start_method!r}; pick fork, spawn or forkserver")
    if start_method == "fork":
        prime_lazy_imports()                       # once per caller: the forked ranks inherit the imports
    world = plan.world
    context = mp.get_context(start_method)
    queue = context.SimpleQueue()
    beats = context.RawArray("d", world)           # each rank's last heartbeat (time.monotonic)
    actions = context.RawArray("c", world * ACTION_BYTES)     # each rank's current action (grid.record)
    start = time.monotonic()
    ctx = mp.start_processes(_worker, args=(fn, plan, free_port(), queue, pg_timeout_s, device, args, kwargs,
                                            beats, actions),
                             nprocs=world, join=False, start_method=start_method)
    procs = ctx.processes
    watch = _Watch(procs, beats, start, actions)
    results: dict[int, Any] = {}
    try:
        while len(results) < world:
            while not queue.empty():
                status, rank, data = queue.get()
                if status == "err":
                    raise watch.blame(RankError(rank, data, step=watch.steps[rank], log=_write_log(rank, data),
                                                exc_type=_exc_type(data), last_action=watch.action(rank)[0]),
                                      queue, results)
                watch.progress(rank)
                if status == "progress":
                    if isinstance(data, int) and not isinstance(data, bool):
                        watch.steps[rank] = data
                    if on_progress is not None:
                        on_progress(rank, data)
                    continue
                results[rank] = pickle.loads(data)
            now = time.monotonic()
            dead = watch.dead(results, now)
            if dead is not None:
                raise watch.blame(dead, queue, results)
            if now - watch.last_progress > timeout_s:
                raise watch.stuck(results, now, f"no rank completed a step for {timeout_s:g} s (--timeout)")
            if time_limit_s is not None and now - start > time_limit_s:
                raise watch.stuck(results, now, f"the run passed its wall-clock limit of {time_limit_s:g} s "
                                                f"(--time-limit)")
            time.sleep(0.005)
    except BaseException:
        _kill(procs)
        raise
    for p in procs:   # teardown is a barrier; a rank stuck there after its result is killed
        p.join(timeout=min(30.0, max(5.0, timeout_s)))
    _kill(procs)
    return [results[r] for r in range(world)]


class _Watch:
    """What the launcher knows of its ranks: steps, heartbeats, exits; and whom to blame."""

    def __init__(self, procs: list, beats: Any, start: float, actions: Any = None):
        self.procs, self.beats, self.actions = procs, beats, actions
        self.steps: list[int | None] = [None] * len(procs)
        self.start = self.last_progress = start
        self.exited_at: dict[int, float] = {}

    def action(self, r: int) -> tuple[str | None, bool]:
        """Rank ``r``'s last recorded action and whether it was blocked in it."""
        return read_action(self.actions, r) if self.actions is not None else (None, False)

    def progress(self, rank: int) -> None:
        self.last_progress = time.monotonic()

    def _died(self, r: int) -> RankError:
        code = self.procs[r].exitcode
        sig = -code if code is not None and code < 0 else None
        how = (f"killed by {_signal_name(sig)}" + (" (kill -9 or the out-of-memory killer)" if sig == 9 else "")
               if sig else f"exited with code {code}")
        text = f"process {how} before returning a result (killed by a signal if negative: code {code})\n"
        return RankError(r, text, signal=sig, step=self.steps[r], last_action=self.action(r)[0])

    def dead(self, results: dict[int, Any], now: float) -> RankError | None:
        """A rank whose process ended without a result or an error (after a second to let its message in);
        of several, the one that ended first (its peers often die of its absence: the first is the cause)."""
        for r, p in enumerate(self.procs):
            if r not in results and p.exitcode is not None:
                self.exited_at.setdefault(r, now)
        gone = [r for r in self.exited_at if r not in results and now - self.exited_at[r] > 1.0]
        return self._died(min(gone, key=lambda r: (self.exited_at[r], r))) if gone else None

    def blame(self, err: RankError, queue: Any, results: dict[int, Any] | None = None) -> RankError:
        """``err``, unless another rank died by a signal meanwhile: peers of a dead rank fail in their
        collectives, and it is the dead one the user must hear about. A rank that returned its result and
        then failed its teardown (a peer was gone) is not to blame."""
        if err.signal is not None:
            return err
        spoke = {err.rank} | set(results or ())
        deadline = time.monotonic() + ERROR_GRACE_S
        while time.monotonic() < deadline:
            for _ in range(2):                       # drain, look, and drain again before blaming
                while not queue.empty():
                    status, rank, _data = queue.get()
                    if status == "err":
                        spoke.add(rank)
                silent = [r for r, p in enumerate(self.procs)
                          if r not in spoke and p.exitcode is not None and p.exitcode != 0]
            if silent:
                return self._died(silent[0])
            time.sleep(0.02)
        return err

    def stuck(self, results: dict[int, Any], now: float, why: str) -> LaunchTimeout:
        waiting = [r for r in range(len(self.procs)) if r not in results]
        stopped = [r for r in waiting if now - max(self.beats[r], self.start) > 5 * HEARTBEAT_S]
        done = [s or 0 for s in self.steps]
        if stopped:
            ranks = stopped
            what = (f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))} stopped responding (no "
                    f"heartbeat for {now - max(self.beats[r] for r in ranks):.0f} s: a stopped or frozen "
                    f"process) after step {', '.join(str(done[r]) for r in ranks)}")
        else:
            low = min(done[r] for r in waiting)
            behind = [r for r in waiting if done[r] == low]
            # of the ranks furthest behind, the ones not blocked in a collective are those the others wait for
            busy = [r for r in behind if not self.action(r)[1]]
            ranks = busy if busy and len(busy) < len(behind) else behind
            one = len(ranks) == 1
            if ranks is busy:
                what = (f"rank{'' if one else 's'} {', '.join(map(str, ranks))} made no progress after step {low} "
                        f"while alive and outside any collective (a hang in its own work: the other ranks are "
                        f"blocked waiting for {'it' if one else 'them'})")
            else:
                what = (f"rank{'' if one else 's'} {', '.join(map(str, ranks))} made no progress after step {low} "
                        f"while alive (a hang: e.g. a collective that not every rank calls)")
            doing = "; ".join(f"rank {r}: {self.action(r)[0]}" for r in ranks if self.action(r)[0])
            if doing:
                what += f"; last action {doing}"
        steps = ", ".join(f"rank {r}: {done[r]}" for r in range(len(done)))
        return LaunchTimeout(f"{why}: {what}; steps completed: {steps}; all ranks killed", ranks, done, stopped,
                             [self.action(r)[0] for r in range(len(self.procs))])


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
    grid = Grid.create(plan, rank, dev, ranks_per_node=int(os.environ.get("LOCAL_WORLD_SIZE", world)))
    result = fn(grid, *args, **kwargs)
    del grid
    gc.collect()
    dist.barrier()
    out: list[Any] = [None] * world
    out[rank] = result
    return out
