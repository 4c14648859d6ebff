"""Bounded, validated input (issue 35, part 6): every file argument is a regular file of bounded size, read with
a timeout; a plan file's model, cluster and plan lie within the command line's ranges; malformed runs files
are one-line refusals."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from parallel_lab import cli
from parallel_lab.calibrate import load_profile, load_runs
from parallel_lab.errors import ParallelLabError
from parallel_lab.hardware import ClusterSpec, LinkTier
from parallel_lab.inputs import LIMITS, PLAN_FILE_LIMITS, read_bounded
from parallel_lab.planfile import END_LINE, load_plan, make_plan_file, save_plan
from parallel_lab.specs import ModelSpec, Plan

ROOT = Path(__file__).resolve().parents[1]
PLAN = ROOT / "examples" / "plans" / "tiny-pp2-1f1b.yaml"


@pytest.fixture
def fifo(tmp_path):
    path = tmp_path / "pipe.yaml"
    os.mkfifo(path)
    return path


def test_the_plan_file_limits_are_the_command_lines():
    """Every field a flag also sets has the flag's range (``experts``: 0 in a file is a dense model)."""
    shared = [(g, k) for g in ("model", "plan", "gpus") for k in PLAN_FILE_LIMITS[g] if k in LIMITS]
    assert len(shared) >= 18
    for group, key in shared:
        want = (0, LIMITS[key][1]) if key == "experts" else LIMITS[key]
        assert PLAN_FILE_LIMITS[group][key] == want, key


@pytest.mark.parametrize("path,kind", [("fifo", "a FIFO"), ("dir", "a directory"), ("/dev/zero", "character device"),
                                       ("/dev/null", "character device")])
def test_only_regular_files_are_read(path, kind, fifo, tmp_path):
    target = {"fifo": fifo, "dir": tmp_path}.get(path, path)
    t = time.monotonic()
    with pytest.raises(ParallelLabError, match=f"{kind}.*give a regular file"):
        read_bounded(target, "plan file", 1000)
    assert time.monotonic() - t < 1.0


def test_size_bound_and_missing_file(tmp_path):
    big = tmp_path / "big.yaml"
    big.write_bytes(b"#" * 2000)
    with pytest.raises(ParallelLabError, match="2,000 bytes; a plan file is at most 1,000"):
        read_bounded(big, "plan file", 1000)
    assert read_bounded(big, "plan file", 2000) == b"#" * 2000
    with pytest.raises(ParallelLabError, match="cannot be read .No such file"):
        read_bounded(tmp_path / "nope", "plan file", 1000)
    with pytest.raises(ParallelLabError, match="no path given"):
        read_bounded(" ", "plan file", 1000)


@pytest.mark.parametrize("argv", [
    ["launch", "{f}"], ["reshard", "{f}", str(PLAN)], ["run", "--plan", "{f}"], ["bubble", "--schedule-file", "{f}"],
    ["calibrate", "--runs", "{f}.csv"], ["memory", "--model", "llama3-8b", "--cluster", "{f}.json"],
])
def test_a_fifo_or_a_directory_never_hangs_the_cli(argv, tmp_path):
    """Each file argument given a FIFO (which blocks its reader until a writer comes) and a directory: one line,
    exit 2, at once."""
    for name, make in (("pipe", os.mkfifo), ("dir", os.mkdir)):
        base = tmp_path / name
        for suffix in ("", ".csv", ".json"):
            make(f"{base}{suffix}")
        args = [a.replace("{f}", str(base)) for a in argv]
        p = subprocess.run([sys.executable, "-m", "parallel_lab", *args], capture_output=True, text=True,
                           timeout=60, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
        assert p.returncode == 2, (args, p.stderr)
        assert len(p.stderr.strip().splitlines()) == 1 and "give a regular file" in p.stderr, p.stderr


def _edited(tmp_path, edit) -> Path:
    data = yaml.safe_load(PLAN.read_text())
    edit(data)
    path = tmp_path / "edited.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False) + END_LINE + "\n")
    return path


TINY = {"layers": 2, "hidden": 64, "heads": 4, "vocab": 256, "flavour": "llama", "name": "tiny"}


@pytest.mark.parametrize("edit,why", [
    (lambda d: d.update(model={**TINY, "layers": 1000}), r"model.layers=1000 must be an integer in \[1, 512\]"),
    (lambda d: d.update(model={**TINY, "experts": 1_000_000, "top_k": 2}), r"model.experts=1000000 .*65,536"),
    (lambda d: d.update(model={**TINY, "layers": "2"}), r"model.layers='2' must be an integer"),
    (lambda d: d.update(model={**TINY, "tied_embeddings": "yes"}), "must be true or false"),
    (lambda d: d.update(model={**TINY, "name": "x\ntouch /tmp/x"}), "printable characters"),
    (lambda d: d.update(model={**TINY, "capacity_factor": 1e300}), "capacity_factor"),
    (lambda d: d.update(cluster={**_cpu(), "gpus_per_node": 10**9}), r"gpus_per_node=1000000000 .*131,072"),
    (lambda d: d.update(cluster={**_cpu(), "hbm_bytes": 1e300}), "hbm_bytes"),
    (lambda d: d.update(cluster={**_cpu(), "intra": {"name": "x", "bandwidth": 1.0, "latency": 1e9}}), "latency"),
    (lambda d: d.update(cluster={**_cpu(), "profile": {"half_width": -1.0}}), "half_width"),
    (lambda d: d.update(cluster={**_cpu(), "profile": "fast"}), "cluster.profile must be a mapping"),
    (lambda d: d["plan"].update(grad_accum=10**7), r"plan.grad_accum=10000000 .*1,048,576"),
    (lambda d: d["plan"].update(seq=2**30), "plan.seq"),
    (lambda d: d["plan"].update(bucket_mb=1e300), "plan.bucket_mb"),
    (lambda d: d.update(gpus=2**20), r"gpus=1048576 .*131,072"),
])
def test_absurd_models_clusters_and_plans_are_refused_as_their_flags_are(tmp_path, edit, why):
    with pytest.raises(ParallelLabError, match=why):
        load_plan(_edited(tmp_path, edit))


def _cpu() -> dict:
    from dataclasses import asdict

    return asdict(ClusterSpec.preset("cpu-gloo"))


def test_a_custom_model_and_cluster_with_a_profile_within_the_limits_load(tmp_path):
    model = ModelSpec(layers=512, hidden=256, heads=8, vocab=1000, flavour="llama", name="deep model (512)")
    from parallel_lab.hardware import StepProfile

    cluster = ClusterSpec("lab", 4, 24e9, 100e12, LinkTier("pcie", 25e9, 5e-6), LinkTier("eth", 5e9, 20e-6),
                          profile=StepProfile(matmul_efficiency=0.7, source="fitted to 9 run(s): " + "run, " * 80))
    pf = make_plan_file(model, cluster, Plan(dp=2, pp=2, grad_accum=4, seq=512), phase="deep")
    save_plan(tmp_path / "d.yaml", pf)
    assert load_plan(tmp_path / "d.yaml") == pf


RUNS_HEADER = "name,model,gpus,dp,tp,seq,micro_batch,grad_accum,tflops_per_gpu\n"


@pytest.mark.parametrize("text,why", [
    (RUNS_HEADER + "a,llama3-8b,8,8,1,8192,1,1,abc\n", r"run 0: tflops_per_gpu='abc' must be a number"),
    (RUNS_HEADER + "a,llama3-8b,8,8,1,8192,1,1,nan\n", r"tflops_per_gpu='nan'"),
    (RUNS_HEADER + "a,llama3-8b,8,8.5,1,8192,1,1,100\n", r"dp='8.5' must be a whole number"),
    (RUNS_HEADER + "a,llama3-8b,8,8,1,99999999999,1,1,100\n", r"seq='99999999999' must be a whole number in "),
    (RUNS_HEADER + "a,llama3-8b,8,8,1,8192,1,1,100,7\n", "more cells than the header"),
    ("name,model,step_time_s\na,llama3-8b,0\n", r"step_time_s='0' must be a number in \(0"),
    ("name,model,tflops_per_gpu\n", "holds no runs"),
])
def test_malformed_run_rows_are_one_line_refusals(tmp_path, text, why):
    path = tmp_path / "runs.csv"
    path.write_text(text)
    with pytest.raises(ParallelLabError, match=why):
        load_runs(path)


@pytest.mark.parametrize("text,why", [
    ("runs: [1, 2]\n", "not a row of named columns"),
    ("- {1: 2}\n", "not a row of named columns"),
    ("- {model: llama3-8b, tflops_per_gpu: [1]}\n", r"tflops_per_gpu=\[1\]"),
    ("- {model: 8, tflops_per_gpu: 100}\n", "model=8 must be a name"),
    ("a: &a [1]\nb: *a\n", "anchors and aliases"),
    ("runs: {a: 1}\n", "give a list of at most 100 runs"),
])
def test_malformed_yaml_runs_are_one_line_refusals(tmp_path, text, why):
    path = tmp_path / "runs.yaml"
    path.write_text(text)
    with pytest.raises(ParallelLabError, match=why):
        load_runs(path)


def test_calibrate_given_a_directory_or_bad_rows_exits_2(tmp_path, capsys):
    (tmp_path / "runs.csv").mkdir()
    assert cli.main(["calibrate", "--runs", str(tmp_path / "runs.csv")]) == 2
    assert "is a directory; give a regular file" in capsys.readouterr().err
    (tmp_path / "bad.csv").write_text(RUNS_HEADER + "a,llama3-8b,8,x,1,8192,1,1,100\n")
    assert cli.main(["calibrate", "--runs", str(tmp_path / "bad.csv")]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "dp='x' must be a whole number" in err


@pytest.mark.parametrize("text,why", [
    ('{"cluster": "h100-sxm", "profile": {"half_width": 1e999}}', "half_width=inf"),
    ('{"cluster": "h100-sxm", "profile": {}, "peak_flops": 1e300}', "peak_flops"),
    ('{"cluster": "h100-sxm", "profile": []}', "not a profile file"),
    ("[" * 100_000, "not a profile file"),
])
def test_damaged_profiles_are_refused(tmp_path, text, why):
    path = tmp_path / "p.json"
    path.write_text(text)
    with pytest.raises(ParallelLabError, match=why):
        load_profile(path)


def test_a_read_past_its_deadline_is_refused(tmp_path, monkeypatch):
    """A file on a stalled network file system: the read stops at the deadline with one line."""
    from parallel_lab import inputs

    slow = tmp_path / "slow.yaml"
    slow.write_bytes(b"x" * (3 * 64 * 1024))
    clock = iter(range(0, 1000, 4))
    monkeypatch.setattr(inputs, "monotonic", lambda: float(next(clock)))
    with pytest.raises(ParallelLabError, match=r"reading it took over 5 s; copy it to a local disk"):
        read_bounded(slow, "plan file", 10**6)
