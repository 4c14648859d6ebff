"""From a plan file to a cluster job: torchrun per node, an sbatch script, torchtitan's flags."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from parallel_lab import cluster_job
from parallel_lab.errors import ParallelLabError
from parallel_lab.planfile import load_plan, make_plan_file
from parallel_lab.specs import ClusterSpec, ModelSpec, Plan

ROOT = Path(__file__).resolve().parents[1]
L405 = ModelSpec.preset("llama3-405b")
H100 = ClusterSpec.preset("h100-sxm")


def meta_8k():
    plan = Plan(dp=128, tp=8, pp=16, zero=2, sp=True, micro_batch=1, grad_accum=16, seq=8192, schedule="1f1b")
    return make_plan_file(L405, H100, plan, phase="pretrain-8k")


def test_the_node_count_comes_from_the_plan():
    job = cluster_job.job_of(meta_8k())
    assert (job.nodes, job.gpus_per_node, job.world) == (2048, 8, 16384)
    tiny = load_plan(ROOT / "examples/plans/tiny-tp2-sp.yaml")
    assert cluster_job.job_of(tiny).nodes == 1


def test_a_partial_node_is_refused_with_the_fix():
    pf = make_plan_file(L405, H100, Plan(dp=3, tp=4, seq=4096), phase="odd")
    with pytest.raises(ParallelLabError, match="multiple of 8"):
        cluster_job.job_of(pf)


def test_torchrun_command_has_the_rendezvous_and_the_program():
    cmd = cluster_job.torchrun_command(meta_8k(), "plan.yaml", port=29411)
    for part in ("--nnodes=2048", "--nproc-per-node=8", "--node-rank=$NODE_RANK", "--rdzv-backend=c10d",
                 "--rdzv-endpoint=$HEAD_NODE:29411", "-m parallel_lab run --plan plan.yaml"):
        assert part in cmd
    tt = cluster_job.torchrun_command(meta_8k(), "plan.yaml", entry="torchtitan")
    assert "-m torchtitan.train --module llama3 --config llama3_405b" in tt
    assert "--parallelism.tensor_parallel_degree 8" in tt
    tiny = load_plan(ROOT / "examples/plans/tiny-tp2-sp.yaml")
    with pytest.raises(ParallelLabError, match="MODULE:CONFIG"):
        cluster_job.torchrun_command(tiny, "plan.yaml", entry="torchtitan")


def test_the_rendezvous_endpoint_is_spelled_as_torchrun_spells_it(capsys):
    assert cluster_job.rendezvous(None) == (None, 29500)
    assert cluster_job.rendezvous("node001:29400") == ("node001", 29400)
    assert cluster_job.rendezvous("node001", 29411) == ("node001", 29411)
    assert cluster_job.rendezvous("[fe80::1]:29400") == ("[fe80::1]", 29400)
    for bad, why in (("node001:x", "not a port number"), (":29400", "no host"), ("node001:70000", "not a port")):
        with pytest.raises(ParallelLabError, match=why):
            cluster_job.rendezvous(bad)
    with pytest.raises(ParallelLabError, match="two ports"):
        cluster_job.rendezvous("node001:29400", 29500)
    from parallel_lab.cli import main
    plan = str(ROOT / "examples/plans/llama3-405b-pretrain-8k.yaml")
    assert main(["launch", plan, "--rdzv-endpoint", "node001:29400"]) == 0
    out = capsys.readouterr().out
    assert "--rdzv-endpoint=node001:29400" in out and "HEAD_NODE" not in out
    assert main(["launch", plan, "--slurm", "--rdzv-endpoint", "node001"]) == 0
    out = capsys.readouterr().out
    assert "HEAD_NODE=node001" in out and "scontrol" not in out and "--rdzv-endpoint=$HEAD_NODE:29500" in out


def test_sbatch_script_is_valid_bash_and_shellcheck_clean(tmp_path):
    script = cluster_job.sbatch_script(meta_8k(), "plan.yaml", partition="gpu")
    assert "#SBATCH --nodes=2048" in script and "#SBATCH --gpus-per-node=8" in script
    assert "--rdzv-endpoint=$HEAD_NODE:29500" in script and "--node-rank=\\$SLURM_NODEID" in script
    f = tmp_path / "job.sbatch"
    f.write_text(script)
    subprocess.run(["bash", "-n", str(f)], check=True, timeout=30)
    if shutil.which("shellcheck"):
        p = subprocess.run(["shellcheck", "-S", "warning", str(f)], capture_output=True, text=True, timeout=60)
        assert p.returncode == 0, p.stdout


def test_torchtitan_flags_follow_the_plan_and_refuse_what_it_cannot_express():
    flags = cluster_job.torchtitan_flags(meta_8k())
    assert "--parallelism.enable_sequence_parallel" in flags and flags[-1] == "activation-checkpoint:none"
    valued = [f for f in flags[:-1] if f not in ("--parallelism.enable_sequence_parallel",
                                                 "--training.disable_cuda_graphs")]
    got = dict(zip(valued[::2], valued[1::2], strict=True))
    assert got["--parallelism.tensor_parallel_degree"] == "8"
    assert got["--parallelism.pipeline_parallel_degree"] == "16"
    assert got["--parallelism.data_parallel_shard_degree"] == "128"
    assert got["--parallelism.fsdp_reshard_after_forward"] == "never"       # ZeRO-2: Meta's FSDP setting
    assert got["--parallelism.pipeline_parallel_schedule"] == "1F1B"
    assert got["--training.local_batch_size"] == "16" and got["--training.global_batch_size"] == "2048"
    zb = meta_8k()
    zb = zb.__class__(**{**zb.__dict__, "plan": zb.plan.with_(schedule="zb-h1")})
    with pytest.raises(ParallelLabError, match="no torchtitan equivalent"):
        cluster_job.torchtitan_flags(zb)


def test_torchtitan_config_loader_accepts_the_flags():
    # torchtitan's own loader (ConfigManager: tyro over its config registry) parses our flags. Its llama3_405b
    # entry turns on float8 linears, which it refuses to build without an SM89+ GPU, so the flags are applied
    # to its llama3_70b entry: the parallelism and training sections are the same dataclasses.
    manager = pytest.importorskip("torchtitan.config.manager", reason="torchtitan is not installed")
    cfg = manager.ConfigManager().parse_args(["--module", "llama3", "--config", "llama3_70b",
                                              *cluster_job.torchtitan_flags(meta_8k())])
    assert cfg.parallelism.tensor_parallel_degree == 8 and cfg.parallelism.pipeline_parallel_degree == 16
    assert cfg.training.seq_len == 8192 and cfg.parallelism.enable_sequence_parallel is True
    assert cfg.parallelism.data_parallel_shard_degree == 128 and cfg.parallelism.fsdp_reshard_after_forward == "never"
    assert type(cfg.activation_checkpoint).__name__.lower().startswith("no")
