"""Fuzzing the command line (issue 18): random argument lists, each in a fork under a time and memory cap.

Hypothesis draws the seed of a random argument list (:func:`fuzzing.random_argv`: a subcommand, often a
valid base, then hostile flags and values); every call must exit 0 with valid output (valid JSON under
``--json``) or exit 2 with one line ``parallel-lab CMD: error: ...``, never a traceback, within
``fuzzing.MAX_S`` CPU seconds and ``fuzzing.MAX_MB`` MB. ``run`` stops where it would start ranks. With
``fuzzing.hostile_files`` the file arguments too (issue 35). Kept to a few seconds here; the full-scale run
(10,000 lists) is ``python tests/fuzzing.py``.
"""

from __future__ import annotations

import random
import re
from pathlib import Path

import fuzzing
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import parallel_lab.distributed.runtime.run  # noqa: F401  (imported once, before the forks)
import parallel_lab.planner  # noqa: F401

FLAGS = fuzzing.cli_flags()


@settings(max_examples=40, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(st.integers(min_value=0, max_value=2**32))
def test_random_argument_lists_keep_the_contract(seed):
    r = fuzzing.run_cli_case(fuzzing.random_argv(random.Random(seed), FLAGS))
    assert fuzzing.check_cli_result(r) == [], (r.argv, r.code, r.err[-400:])


@pytest.mark.parametrize("argv", [
    ["memory", "--model", "llama3-8b", "--gpus", "8", "--tp", "0"],
    ["bubble", "--schedule", "1f1b", "--stages", "4096", "--microbatches", "8", "--json"],
    ["bubble", "--schedule", "gpipe", "--stages", "64", "--microbatches", "8192", "--json"],
    ["bubble", "--schedule", "1f1b", "--stages", "4", "--microbatches", "8", "--p2p", "nan", "--json"],
    ["flops", "--model", "llama3-8b", "--step-time", "1e-320", "--json"],
    ["plan", "--model", "llama2-7b", "--gpus", "999999999999", "--seq", "4096", "--global-batch", "8"],
    ["plan", "--model", "llama3-405b", "--gpus", "131072", "--seq", "8192", "--global-batch-tokens", "16M",
     "--json"],
    ["memory", "--layers", "2", "--hidden", "128", "--heads", "8", "--ffn", "999999999999", "--tp", "8"],
    ["comm", "--model", "llama3-8b", "--dp", "131072", "--json"],
    ["memory", "--layers", "512", "--hidden", "128", "--heads", "4", "--pp", "64", "--grad-accum", "1048576",
     "--json"],
])
def test_the_cases_that_hung_or_blew_up(argv):
    """Issue 18's hangs and blow-ups, at the edge of the ranges: each well under the bounds now."""
    r = fuzzing.run_cli_case(argv)
    assert fuzzing.check_cli_result(r) == [], (r.argv, r.code, r.err[-400:])
    assert r.wall_s < fuzzing.MAX_S and r.grew_mb < fuzzing.MAX_MB


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    return fuzzing.hostile_files(tmp_path_factory.mktemp("hostile"))


@settings(max_examples=30, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(st.integers(min_value=0, max_value=2**32))
def test_random_argument_lists_with_hostile_files_keep_the_contract(files, seed):
    """File arguments too (issue 35): FIFOs, folders, devices, oversized files, absurd plans, malformed runs rows,
    damaged profiles and schedules, to launch, reshard, run, bubble, calibrate and --cluster."""
    r = fuzzing.run_cli_case(fuzzing.random_argv(random.Random(seed), FLAGS, files))
    assert fuzzing.check_cli_result(r) == [], (r.argv, r.code, r.err[-400:])


@pytest.mark.parametrize("argv", [
    ["launch", "{plan-fifo.yaml}"], ["reshard", "{plan-fifo.yaml}", "examples/plans/tiny-tp2-sp.yaml"],
    ["run", "--plan", "{plan-fifo.yaml}"], ["bubble", "--schedule-file", "{schedule-fifo.csv}"],
    ["calibrate", "--runs", "{runs-dir.csv}"], ["calibrate", "--runs", "{runs-fifo.csv}"],
    ["calibrate", "--runs", "{runs-1.csv}"], ["calibrate", "--runs", "{runs-3.csv}"],
    ["calibrate", "--runs", "{runs-y0.yaml}"], ["memory", "--model", "llama3-8b", "--cluster", "{profile-fifo.json}"],
    ["launch", "{plan-big.yaml}"], ["run", "--plan", "{plan-1.yaml}"], ["launch", "/dev/zero"],
    ["launch", "examples/plans/tiny-tp2-sp.yaml", "--slurm", "--time", "04:00:00\ntouch /tmp/x"],
    ["launch", "examples/plans/tiny-tp2-sp.yaml", "--slurm", "--rdzv-endpoint", "node0;touch /tmp/x;echo"],
])
def test_the_file_and_launch_cases_of_issue_35_are_one_line_refusals(argv, files):
    """Each exits 2 with one line, at once: never a hang on a FIFO, never an internal error."""
    folder = Path(files["plan"][0]).parent
    r = fuzzing.run_cli_case([re.sub(r"^\{(.+)\}$", lambda m: str(folder / m.group(1)), a) for a in argv])
    assert fuzzing.check_cli_result(r) == [] and r.code == 2, (r.argv, r.code, r.err[-400:])
