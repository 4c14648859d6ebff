"""The launcher: results in rank order, errors named by rank (a dead rank, not the peer it took down),
a stopped rank named within the progress timeout, a long healthy run never cut off by it."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import time

import pytest
import torch
import torch.distributed as dist

from parallel_lab.distributed.runtime.launch import LaunchTimeout, RankError, free_port, hello, launch
from parallel_lab.specs import Plan

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(90)]


def _gather(grid, scale):
    t = torch.tensor([float(grid.rank)])
    dist.all_reduce(t)
    return {"rank": grid.rank, "sum": t.item() * scale, "threads": torch.get_num_threads(),
            "backend": dist.get_backend()}


def _modules_build_model_imports(grid):
    import sys

    from parallel_lab.distributed.model.model import build_model, make_optimizer
    from parallel_lab.specs import ModelSpec

    before = set(sys.modules)
    model = build_model(ModelSpec.preset("tiny-llama"))
    make_optimizer(model.parameters(), Plan(optimizer="adam-fp32"))
    return sorted(set(sys.modules) - before)


def _raise_in_rank_1(grid):
    if grid.rank == 1:
        raise KeyError("broken on purpose")
    time.sleep(60)


def _hang_in_collective(grid):
    if grid.rank == 0:
        dist.all_reduce(torch.ones(1))          # rank 1 never joins
    time.sleep(60)


def _die(grid):
    if grid.rank == 1:
        os._exit(3)
    time.sleep(60)


def test_results_come_back_in_rank_order_twice_in_a_row():
    for _ in range(2):
        out = launch(_gather, 3, 2.0, timeout_s=60)
        assert [r["rank"] for r in out] == [0, 1, 2]
        assert all(r["sum"] == 2.0 * (0 + 1 + 2) for r in out)
        assert all(r["threads"] == 1 and r["backend"] == "gloo" for r in out)
    assert not dist.is_initialized()             # the caller never joins a process group


def test_an_exception_in_rank_1_is_reraised_with_the_rank_named_quickly():
    t0 = time.monotonic()
    with pytest.raises(RankError, match="rank 1") as info:
        launch(_raise_in_rank_1, 2, timeout_s=60)
    assert time.monotonic() - t0 < 15
    assert info.value.rank == 1
    assert "KeyError" in str(info.value) and "_raise_in_rank_1" in info.value.traceback


def test_a_hang_in_a_collective_fails_within_the_launch_timeout():
    t0 = time.monotonic()
    with pytest.raises((LaunchTimeout, RankError)):
        launch(_hang_in_collective, 2, timeout_s=4)
    assert time.monotonic() - t0 < 12


def test_a_rank_that_dies_without_a_word_is_reported():
    with pytest.raises(RankError, match="rank 1.*code 3"):
        launch(_die, 2, timeout_s=30)


def test_hello_under_spawn_and_a_plan_grid():
    out = launch(hello, Plan(dp=2), start_method="spawn", timeout_s=60)
    assert [r["rank_sum"] for r in out] == [1, 1]
    assert len({r["pid"] for r in out}) == 2


def test_free_port_is_a_port():
    assert 0 < free_port() < 65536


def test_the_same_launch_runs_under_torchrun(tmp_path):
    """Under torchrun each process runs its own rank in-process; two launches in one script work."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    script = tmp_path / "two_launches.py"
    script.write_text(                                   # one file per process: their stdout would interleave
        "import json, os, sys\n"
        "from parallel_lab.distributed.runtime.launch import hello, launch\n"
        "if __name__ == '__main__':\n"
        "    a = launch(hello, 2)\n"
        "    b = launch(hello, 2)\n"
        "    with open(os.path.join(sys.argv[1], 'rank' + os.environ['RANK'] + '.json'), 'w') as f:\n"
        "        json.dump([a, b], f)\n")
    torchrun = Path(sys.executable).with_name("torchrun")
    cmd = [str(torchrun), "--standalone", "--nproc-per-node=2", str(script), str(tmp_path)]
    repo = Path(__file__).resolve().parents[2]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=100, cwd=repo)
    assert p.returncode == 0, p.stderr[-2000:]
    outs = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for rank, (a, b) in enumerate(outs):                 # each process filled only its own entry
        mine = [i for i, r in enumerate(a) if r is not None]
        assert mine == [rank] and a[rank]["rank_sum"] == b[rank]["rank_sum"] == 1


def _steps(grid, n=40, victim=-1, at=3, how="stop", pause=0.05):
    """``n`` steps of an all-reduce; rank ``victim`` stops (SIGSTOP) or is killed (SIGKILL) before step ``at``."""
    for i in range(n):
        if grid.rank == victim and i == at:
            os.kill(os.getpid(), signal.SIGSTOP if how == "stop" else signal.SIGKILL)
        t = torch.ones(256)
        dist.all_reduce(t)
        time.sleep(pause)
        grid.notify(i + 1)
    return grid.rank


@pytest.mark.parametrize("victim", [0, 1])
def test_a_killed_rank_is_named_not_the_survivor(victim):
    """kill -9 of one rank: its peer then fails in the all-reduce, but the report names the dead rank."""
    with pytest.raises(RankError) as info:
        launch(_steps, 2, timeout_s=30, victim=victim, how="kill")
    e = info.value
    assert e.rank == victim and e.signal == 9 and e.step == 3
    assert f"rank {victim} failed" in str(e) and "SIGKILL" in str(e)


def test_a_stopped_rank_is_named_within_the_progress_timeout():
    t0 = time.monotonic()
    with pytest.raises(LaunchTimeout) as info:
        launch(_steps, 2, timeout_s=6, victim=1, how="stop")
    took = time.monotonic() - t0
    e = info.value
    assert e.ranks == [1] and e.stopped == [1] and e.steps == [3, 3]
    assert "rank 1 stopped responding" in str(e) and "6 s" in str(e)
    assert 6 <= took < 6 + 15                       # the progress timeout plus start-up, not 300 s


def test_a_long_healthy_run_is_not_cut_by_the_progress_timeout():
    """80 steps of ~0.06 s (about 5 s in all) under a 2 s progress timeout: the run completes."""
    t0 = time.monotonic()
    assert launch(_steps, 2, timeout_s=2, n=80) == [0, 1]
    assert time.monotonic() - t0 > 2 * 2               # it really ran past the timeout in total


def test_the_wall_clock_limit_is_separate():
    with pytest.raises(LaunchTimeout, match="wall-clock limit of 2 s"):
        launch(_steps, 2, timeout_s=30, time_limit_s=2, n=1000)


# ---- the same through `parallel-lab run`: a short report and a distinct exit code, no traceback ----------

def _run_cli_and(action, timeout_s: float = 8):
    """Start `parallel-lab run --dp 2` with many steps, apply ``action`` to rank 1's process, return the end."""
    import subprocess
    import sys

    psutil = pytest.importorskip("psutil")
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    p = subprocess.Popen([sys.executable, "-m", "parallel_lab", "run", "--dp", "2", "--steps", "100000",
                          "--timeout", str(timeout_s)], cwd=repo, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True)
    try:
        deadline = time.monotonic() + 120
        ranks: list = []
        while len(ranks) < 2 and time.monotonic() < deadline and p.poll() is None:
            ranks = sorted(psutil.Process(p.pid).children(), key=lambda c: c.pid)   # forked in rank order
            time.sleep(0.2)
        assert len(ranks) == 2, "the ranks did not start"
        # until the progress bar shows a completed step (a loaded machine may take many seconds to get there)
        fd = p.stderr.fileno()
        os.set_blocking(fd, False)
        seen = ""
        while not re.search(r" [1-9]\d*/100000 steps", seen) and time.monotonic() < deadline and p.poll() is None:
            with contextlib.suppress(BlockingIOError):
                seen += os.read(fd, 1 << 16).decode(errors="replace")
            time.sleep(0.2)
        os.set_blocking(fd, True)
        assert re.search(r" [1-9]\d*/100000 steps", seen), seen[-500:]
        t0 = time.monotonic()
        action(ranks[1].pid)
        out, err = p.communicate(timeout=120)
        return p.returncode, seen + err, time.monotonic() - t0
    finally:
        if p.poll() is None:
            p.kill()


@pytest.mark.timeout(300)
def test_cli_run_names_a_killed_rank_with_exit_3():
    code, err, _ = _run_cli_and(lambda pid: os.kill(pid, signal.SIGKILL))
    assert code == 3, err[-1000:]
    assert "failed: rank 1 was killed by signal 9" in err and "Traceback" not in err


@pytest.mark.timeout(300)
def test_cli_run_names_a_stopped_rank_with_exit_4_within_the_progress_timeout():
    code, err, took = _run_cli_and(lambda pid: os.kill(pid, signal.SIGSTOP), timeout_s=8)
    assert code == 4, err[-1000:]
    assert "rank 1 stopped responding" in err and "Traceback" not in err
    assert took < 8 + 30


@pytest.mark.distributed
@pytest.mark.timeout(60)
def test_forked_ranks_inherit_the_lazy_imports_of_building_a_model():
    """Building the model and its optimizer on a forked rank imports (almost) nothing: the caller imported
    torch._dynamo before it forked (launch.prime_lazy_imports). Unprimed, each rank imported ~800 modules."""
    for new in launch(_modules_build_model_imports, 2):
        assert len(new) < 10, new[:20]
