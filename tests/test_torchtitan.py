"""Every plan ``launch --entry torchtitan`` exports, set up by torchtitan itself (the titan extra: ``make test``
installs it, so nothing here is skipped): its ConfigManager parses the flags, and its own mesh, pipeline split,
TP / CP / FSDP parallelize functions run on meta parameters under a fake process group (tests/titan_dryrun.py:
the part of ``torchtitan.train --comm.mode fake_backend`` that runs on a CPU build of torch)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from parallel_lab import cluster_job, sharding
from parallel_lab.cli import main
from parallel_lab.errors import ParallelLabError
from parallel_lab.hardware import ClusterSpec
from parallel_lab.planfile import load_plan, make_plan_file
from parallel_lab.planner import plan_search
from parallel_lab.planner_constraints import Constraints
from parallel_lab.specs import ModelSpec

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples/plans"
#: the example plans meant for a cluster under torchtitan: Meta's runs and the tiny plans (its debug model)
FOR_TORCHTITAN = {"llama3-405b-meta-8k", "llama3-405b-meta-131k", "tiny-cp2-ring", "tiny-dp2-zero3",
                  "tiny-pp2-1f1b", "tiny-tp2-sp"}
#: the planner's own 405B suggestions, made for the lab's engine (ZB-H1, ZeRO-1): refused, naming why
LAB_ONLY = {"llama3-405b-planner-8k", "llama3-405b-planner-131k"}
TITAN_LAYERS = {"llama3_405b": 126, "llama3_8b": 32, "llama3_debugmodel": 6}   # layers of torchtitan's models


def _planner_plan_for_torchtitan():
    """The planner's best plan for llama3-8b on 64 H100s with --engine torchtitan, as a plan file."""
    model, cluster = ModelSpec.preset("llama3-8b"), ClusterSpec.preset("h100-sxm")
    res = plan_search(model, cluster, 64, 8192, global_batch=512,
                      constraints=Constraints(engine="torchtitan", fixed={"pp": 4}))
    return make_plan_file(model, cluster, res.top(1)[0].plan, phase="planner-8b", engine="torchtitan")


def test_every_example_meant_for_a_cluster_is_set_up_by_torchtitan(tmp_path):
    import torchtitan  # noqa: F401  (the titan extra; a missing one fails here, it is not skipped)

    plans = {p.stem: load_plan(p) for p in sorted(EXAMPLES.glob("*.yaml"))}
    assert set(plans) == FOR_TORCHTITAN | LAB_ONLY, "a new example plan: say whether it is meant for torchtitan"
    for name in LAB_ONLY:
        assert plans[name].engine == "lab"
        with pytest.raises(ParallelLabError, match=r"engine lab\) has no torchtitan equivalent: schedule=zb-h1"):
            cluster_job.torchtitan_flags(plans[name])
    plans = {n: pf for n, pf in plans.items() if n in FOR_TORCHTITAN}
    plans["planner-8b"] = _planner_plan_for_torchtitan()
    jobs = []
    for name, pf in plans.items():
        config = cluster_job.torchtitan_config(pf)
        args = [*config, *cluster_job.torchtitan_flags(pf)]
        w = pf.plan.world
        ranks = [0, w - 1] if pf.plan.pp > 1 and name.startswith("llama3") else [0]
        jobs += [{"name": name, "world": w, "rank": r, "args": args, "config": config[3]} for r in ranks]
    (tmp_path / "jobs.json").write_text(json.dumps(jobs))
    p = subprocess.run([sys.executable, str(ROOT / "tests/titan_dryrun.py"), str(tmp_path / "jobs.json")],
                       capture_output=True, text=True, timeout=170, cwd=tmp_path)
    got = [json.loads(line) for line in p.stdout.splitlines() if line.startswith("{")]
    assert len(got) == len(jobs), p.stderr[-2000:]
    for job, out in zip(jobs, got, strict=True):
        pf, where = plans[job["name"]], f"{job['name']} rank {job['rank']}"
        assert "error" not in out, f"{where}: {out.get('error')}"
        assert out["world"] == pf.plan.world and out["dtensor"], where
        q = pf.plan
        if q.pp == 1:                                       # torchtitan accumulates global / (local * dp)
            assert out["accumulation"] == q.grad_accum and out["layers"] == [TITAN_LAYERS[job["config"]]], where
            continue
        assert out["accumulation"] == 1 and out["microbatches"] == q.grad_accum, where
        stage = 0 if job["rank"] == 0 else q.pp - 1           # rank 0 and the last rank, in any mesh order
        chunks = sharding.chunk_layers(TITAN_LAYERS[job["config"]], q.pp, q.interleave, q.pp_split)
        assert out["layers"] == [len(c) for c in chunks[stage::q.pp]], where
        assert (out["first"], out["last"]) == (stage == 0, stage == q.pp - 1), where


@pytest.mark.parametrize("phase,seq,dp,cp", [("8k", 8192, 128, 1), ("131k", 131072, 8, 16)])
def test_metas_runs_export_to_sbatch_for_torchtitan(capsys, tmp_path, phase, seq, dp, cp):
    """The Llama 3 paper's Table 4 plans (published_runs): TP 8, PP 16, 16 sequences per DP rank, 16M tokens."""
    path = EXAMPLES / f"llama3-405b-meta-{phase}.yaml"
    pf = load_plan(path)
    q = pf.plan
    assert (pf.engine, pf.gpus, q.tp, q.pp, q.cp, q.dp, q.seq) == ("torchtitan", 16384, 8, 16, cp, dp, seq)
    assert q.micro_batch * q.grad_accum == 16 and q.global_batch_tokens == 16 * 2**20
    assert (q.zero, q.schedule, q.pp_split, q.recompute) == (2, "interleaved", "embed-head", "none")
    out = tmp_path / "job.sbatch"
    assert main(["launch", str(path), "--slurm", "--entry", "torchtitan", "--out", str(out)]) == 0
    text = out.read_text()
    assert "#SBATCH --nodes=2048" in text and "-m torchtitan.train --module llama3 --config llama3_405b" in text
    assert f"--parallelism.context_parallel_degree {cp}" in text and "Interleaved1F1B" in text
    subprocess.run(["bash", "-n", str(out)], check=True, timeout=30)
    printed = capsys.readouterr().out
    assert "made for the lab's engine" not in printed          # a torchtitan plan: no differences to name
