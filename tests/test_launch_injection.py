"""``launch`` writes no user value into a script unchecked or unquoted (issue 35, part 4).

The generated sbatch script and the per-node torchrun line run here under bash with stub ``srun``, ``torchrun``
and ``scontrol`` (shell scripts that log their argv) as the only commands on PATH: only the stubs run, with the
expected arguments, and a plan path full of shell syntax (command substitutions, quotes, ``;``) arrives as one
argument while creating nothing. Values that cannot be quoted into a script (a ``--time`` with a newline, a host
with ``;``) are refused with exit 2 and one line.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from parallel_lab import cluster_job
from parallel_lab.cli import main
from parallel_lab.errors import ParallelLabError
from parallel_lab.hardware import ClusterSpec
from parallel_lab.planfile import load_plan, make_plan_file
from parallel_lab.specs import ModelSpec, Plan

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "examples" / "plans" / "tiny-tp2-sp.yaml"
#: a plan path a shell would run parts of, if it were not quoted: each part would create a file in the cwd
HOSTILE = "plans/a b $(echo sub > canary1) `echo tick > canary2` ;echo semi > canary3; \"'$HOME'\" *.yaml"
STUB = """#!/bin/bash
{ printf '%s' "${0##*/}"; for a in "$@"; do printf '\\t%s' "$a"; done; printf '\\n'; } >> "$STUB_LOG"
"""
SRUN = STUB + 'while [[ "$1" == --* ]]; do shift; done\nexec "$@"\n'           # run the per-node command
SCONTROL = STUB + 'printf "node001\\nnode002\\n"\n'


def meta_8k():
    plan = Plan(dp=128, tp=8, pp=16, zero=2, sp=True, micro_batch=1, grad_accum=16, seq=8192, schedule="1f1b")
    return make_plan_file(ModelSpec.preset("llama3-405b"), ClusterSpec.preset("h100-sxm"), plan, phase="meta-8k")


@pytest.fixture
def stubs(tmp_path):
    """A PATH holding only the stubs."""
    bindir = tmp_path / "bin"
    bindir.mkdir()
    for name, text in (("srun", SRUN), ("torchrun", STUB), ("scontrol", SCONTROL)):
        (bindir / name).write_text(text)
        (bindir / name).chmod(0o755)
    work = tmp_path / "work"
    work.mkdir()
    return bindir, work


def _run(stubs, argv: list[str], **env: str) -> list[list[str]]:
    bindir, work = stubs
    log = bindir.parent / "argv.log"
    full = {"PATH": str(bindir), "STUB_LOG": str(log), "HOME": "/nonexistent", **env}
    p = subprocess.run(argv, cwd=work, env=full, capture_output=True, text=True, timeout=60)
    assert p.returncode == 0 and p.stderr == "", p.stderr
    assert set(os.listdir(work)) <= {"job.sbatch"}, os.listdir(work)          # nothing created by the values
    return [line.split("\t") for line in log.read_text().splitlines()]


@pytest.mark.parametrize("entry", ["parallel-lab", "torchtitan"])
@pytest.mark.parametrize("head", [None, "node007", "[fe80::1]"])
def test_the_sbatch_script_runs_only_srun_torchrun_and_scontrol(stubs, entry, head):
    pf = load_plan(TINY) if entry == "parallel-lab" else meta_8k()
    script = cluster_job.sbatch_script(pf, HOSTILE, entry=entry, port=29411, head=head, partition="gpu",
                                       time="1-00:00", config="llama3:llama3_debugmodel")
    (stubs[1] / "job.sbatch").write_text(script)
    if shutil.which("shellcheck"):                       # CI has it: warnings and errors, not SC2016 (info)
        p = subprocess.run(["shellcheck", "-S", "warning", "job.sbatch"], cwd=stubs[1], capture_output=True,
                           text=True, timeout=60)
        assert p.returncode == 0, p.stdout
    got = _run(stubs, ["/bin/bash", "job.sbatch"], SLURM_JOB_ID="4242", SLURM_JOB_NODELIST="node[001-002]")
    job = cluster_job.job_of(pf)
    torchrun = ["torchrun", f"--nnodes={job.nodes}", f"--nproc-per-node={job.gpus_per_node}", "--rdzv-backend=c10d",
                f"--rdzv-endpoint={head or 'node001'}:29411", "--rdzv-id=4242",
                *cluster_job.program(pf, HOSTILE, entry, "llama3:llama3_debugmodel")]
    srun = ["srun", f"--nodes={job.nodes}", "--ntasks-per-node=1", *torchrun]
    want = ([] if head else [["scontrol", "show", "hostnames", "node[001-002]"]]) + [srun, torchrun]
    assert got == want
    assert (HOSTILE in torchrun) == (entry == "parallel-lab")      # torchtitan's trainer is not given the path


@pytest.mark.parametrize("entry", ["parallel-lab", "torchtitan"])
def test_the_per_node_command_runs_only_torchrun(stubs, entry):
    pf = load_plan(TINY) if entry == "parallel-lab" else meta_8k()
    cmd = cluster_job.torchrun_command(pf, HOSTILE, entry=entry, config="llama3:llama3_debugmodel")
    got = _run(stubs, ["/bin/bash", "-c", cmd], HEAD_NODE="node003")
    assert got == [["torchrun", *cmd_words(pf, entry)]]
    fixed = cluster_job.torchrun_command(pf, HOSTILE, entry=entry, head="node009", port=29400,
                                         config="llama3:llama3_debugmodel")
    assert _run(stubs, ["/bin/bash", "-c", fixed])[-1][4] == "--rdzv-endpoint=node009:29400"


def cmd_words(pf, entry: str) -> list[str]:
    job = cluster_job.job_of(pf)
    return [f"--nnodes={job.nodes}", f"--nproc-per-node={job.gpus_per_node}", "--rdzv-backend=c10d",
            "--rdzv-endpoint=node003:29500", f"--rdzv-id={pf.phase}",
            *cluster_job.program(pf, HOSTILE, entry, "llama3:llama3_debugmodel")]


@pytest.mark.parametrize("argv,why", [
    (["--slurm", "--time", "04:00:00\ntouch /tmp/x"], "--time '04:00:00\\\\ntouch /tmp/x' is not a SLURM time"),
    (["--slurm", "--rdzv-endpoint", "node0;touch /tmp/x;echo"], "the host 'node0;touch /tmp/x;echo' is not a host"),
    (["--rdzv-endpoint", "a=$(touch /tmp/x)"], "is not a host name"),
    (["--rdzv-endpoint", "[fe80::zz]:29400"], "nor an IPv6 address in brackets"),
    (["--slurm", "--partition", "gpu;id"], "--partition 'gpu;id' is not a SLURM name"),
    (["--slurm", "--partition", "gpu\n#SBATCH --x"], "is not a SLURM name"),
    (["--rdzv-port", "0"], "--rdzv-port '0' is not a port number; give one in 1-65535"),
    (["--rdzv-port", "65536"], "not a port number"),
    (["--entry", "torchtitan", "--torchtitan-config", "llama3:x $(id)"], "is not MODULE:CONFIG, two Python names"),
    (["--slurm", "--time", "60:60"], "not a SLURM time"),
    (["--slurm", "--time", "1-24"], "not a SLURM time"),
    (["--torchtitan-config", "0.25"], "--torchtitan-config '0.25' is not MODULE:CONFIG"),
])
def test_values_that_would_break_the_script_exit_2_with_one_line(argv, why, capsys):
    assert main(["launch", str(TINY), *argv]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and why.replace("\\\\", "\\") in err, err


@pytest.mark.parametrize("time", ["90", "90:30", "48:00:00", "2-12", "2-12:30", "2-12:30:15", "0"])
def test_every_slurm_time_format_is_accepted(time):
    assert cluster_job.check_time(time) == time
    assert f"#SBATCH --time={time}\n" in cluster_job.sbatch_script(load_plan(TINY), "p.yaml", time=time)


def test_a_plan_path_with_a_newline_is_refused():
    with pytest.raises(ParallelLabError, match="control character"):
        cluster_job.sbatch_script(load_plan(TINY), "a\nb.yaml")


def test_an_unwritable_out_is_one_line(tmp_path, capsys):
    for out, why in ((tmp_path, "it is a directory; give a file name, e.g. "), (tmp_path / "no" / "x.sh", "create it")):
        assert main(["launch", str(TINY), "--slurm", "--out", str(out)]) == 2
        err = capsys.readouterr().err
        assert len(err.strip().splitlines()) == 1 and "cannot write the sbatch script" in err and why in err, err
    assert main(["launch", str(TINY), "--slurm", "--out", str(tmp_path / "job.sbatch")]) == 0
    assert (tmp_path / "job.sbatch").read_text() == cluster_job.sbatch_script(load_plan(TINY), str(TINY))
