"""From a plan file to a cluster job: torchrun per node, an sbatch script, torchtitan's flags."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from parallel_lab import cluster_job
from parallel_lab.errors import ParallelLabError
from parallel_lab.hardware import ClusterSpec
from parallel_lab.planfile import load_plan, make_plan_file
from parallel_lab.specs import ModelSpec, Plan

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
    cmd = cluster_job.torchrun_command(meta_8k(), "plan.yaml", port=29411, entry="torchtitan")
    for part in ("--nnodes=2048", "--nproc-per-node=8", "--rdzv-backend=c10d", "--rdzv-endpoint=$HEAD_NODE:29411"):
        assert part in cmd
    assert "--node-rank" not in cmd          # inert under c10d (torchrun reads it only with --rdzv-backend=static)
    tiny = cluster_job.torchrun_command(load_plan(ROOT / "examples/plans/tiny-tp2-sp.yaml"), "plan.yaml")
    assert "--nnodes=1 --nproc-per-node=2" in tiny and "-m parallel_lab run --plan plan.yaml" in tiny
    tt = cluster_job.torchrun_command(meta_8k(), "plan.yaml", entry="torchtitan")
    assert "-m torchtitan.train --module llama3 --config llama3_405b" in tt
    assert "--parallelism.tensor_parallel_degree 8" in tt
    tiny = load_plan(ROOT / "examples/plans/tiny-tp2-sp.yaml")              # the tiny plans: torchtitan's debug model
    tt = cluster_job.torchrun_command(tiny, "p.yaml", entry="torchtitan")
    assert "--module llama3 --config llama3_debugmodel" in tt
    gpt = make_plan_file(ModelSpec.preset("tiny-gpt"), tiny.cluster, tiny.plan, phase="gpt")
    with pytest.raises(ParallelLabError, match="MODULE:CONFIG"):
        cluster_job.torchrun_command(gpt, "plan.yaml", entry="torchtitan")


def test_the_rendezvous_endpoint_is_spelled_as_torchrun_spells_it(capsys):
    assert cluster_job.rendezvous(None) == (None, 29500)
    assert cluster_job.rendezvous("node001:29400") == ("node001", 29400)
    assert cluster_job.rendezvous("node001", 29411) == ("node001", 29411)
    assert cluster_job.rendezvous("[fe80::1]:29400") == ("[fe80::1]", 29400)
    assert cluster_job.rendezvous("[fe80::1]") == ("[fe80::1]", 29500)
    for bad, why in (("node001:x", "not a port number"), (":29400", "no host"), ("node001:70000", "not a port"),
                     ("node001:", "not a port number"), ("a:b:1", "more than one"), ("fe80::1", "brackets"),
                     ("[fe80::1", "IPv6"), ("[]:29400", "no host")):
        with pytest.raises(ParallelLabError, match=why):
            cluster_job.rendezvous(bad)
    with pytest.raises(ParallelLabError, match="two ports"):
        cluster_job.rendezvous("node001:29400", 29500)
    from parallel_lab.cli import main
    plan = str(ROOT / "examples/plans/tiny-tp2-sp.yaml")
    assert main(["launch", plan, "--rdzv-endpoint", "node001:29400"]) == 0
    out = capsys.readouterr().out
    assert "--rdzv-endpoint=node001:29400" in out and "HEAD_NODE" not in out and "rendezvous on node001" in out
    assert main(["launch", plan, "--slurm", "--rdzv-endpoint", "node001"]) == 0
    out = capsys.readouterr().out
    assert "HEAD_NODE=node001" in out and "scontrol" not in out and "--rdzv-endpoint=$HEAD_NODE:29500" in out


def test_the_labs_own_entry_is_refused_where_its_reference_cannot_run():
    """``parallel-lab run`` checks every step against a one-process reference of the whole model: a 405B plan
    would need terabytes on one device, so launch points to torchtitan instead of printing a job that fails."""
    with pytest.raises(ParallelLabError, match=r"one-process reference of the whole llama3-405b.*--entry torchtitan"):
        cluster_job.torchrun_command(meta_8k(), "plan.yaml")
    with pytest.raises(ParallelLabError, match="--entry torchtitan"):
        cluster_job.sbatch_script(meta_8k(), "plan.yaml")


def test_under_torchrun_this_machine_holds_its_own_ranks(monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    assert cluster_job.ranks_on_this_machine(16) == (16, True)
    for k, v in {"RANK": "9", "WORLD_SIZE": "16", "MASTER_ADDR": "node001", "LOCAL_WORLD_SIZE": "8"}.items():
        monkeypatch.setenv(k, v)
    assert cluster_job.ranks_on_this_machine(16) == (8, False)        # node 1: no reference here
    monkeypatch.setenv("RANK", "3")
    assert cluster_job.ranks_on_this_machine(16) == (8, True)         # the node of rank 0 runs the reference


def test_sbatch_script_is_valid_bash_and_shellcheck_clean(tmp_path):
    script = cluster_job.sbatch_script(meta_8k(), "plan.yaml", partition="gpu", entry="torchtitan")
    assert "#SBATCH --nodes=2048" in script and "#SBATCH --gpus-per-node=8" in script
    assert "--rdzv-endpoint=$HEAD_NODE:29500" in script and "--node-rank" not in script
    f = tmp_path / "job.sbatch"
    f.write_text(script)
    subprocess.run(["bash", "-n", str(f)], check=True, timeout=30)
    if shutil.which("shellcheck"):
        p = subprocess.run(["shellcheck", "-S", "warning", str(f)], capture_output=True, text=True, timeout=60)
        assert p.returncode == 0, p.stdout


def test_torchtitan_flags_follow_the_plan_and_refuse_what_it_cannot_express():
    flags = cluster_job.torchtitan_flags(meta_8k())
    assert "--parallelism.enable_sequence_parallel" in flags and flags[-1] == "activation-checkpoint:none"
    got, _ = _flags(meta_8k())
    assert got["--parallelism.tensor_parallel_degree"] == "8"
    assert got["--parallelism.pipeline_parallel_degree"] == "16"
    assert got["--parallelism.data_parallel_shard_degree"] == "128"
    assert got["--parallelism.fsdp_reshard_after_forward"] == "never"       # ZeRO-2: Meta's FSDP setting
    assert got["--parallelism.pipeline_parallel_schedule"] == "1F1B"
    assert got["--training.local_batch_size"] == "16" and got["--training.global_batch_size"] == "2048"
    zb = meta_8k()
    zb = zb.__class__(**{**zb.__dict__, "plan": zb.plan.with_(schedule="zb-h1")})
    with pytest.raises(ParallelLabError, match="no torchtitan equivalent: schedule=zb-h1"):
        cluster_job.torchtitan_flags(zb)
    both = zb.__class__(**{**zb.__dict__, "plan": zb.plan.with_(zero=1)})
    with pytest.raises(ParallelLabError, match=r"schedule=zb-h1: .*; zero=1: "):      # every refusal, one line
        cluster_job.torchtitan_flags(both)


def _flags(pf):
    flags = cluster_job.torchtitan_flags(pf)
    valued = [f for f in flags[:-1] if f.split(".")[-1] not in (
        "enable_sequence_parallel", "no_enable_sequence_parallel", "disable_cuda_graphs")]
    return dict(zip(valued[::2], valued[1::2], strict=True)), flags[-1]


def test_torchtitan_accumulates_as_the_plan_and_splits_its_stages_the_same_way():
    """torchtitan accumulates ``global / (local * dp)`` steps and splits a pipeline's local batch into
    micro-batches: without a pipeline the local batch is one micro-batch. Its stage split (slots spread
    over ``ceil(slots / layers_per_stage)`` virtual stages, the first ones one more, the embedding and head
    taking ``*_less_layers`` slots) is the plan's ``sharding.chunk_layers``."""
    from parallel_lab import sharding
    ddp = make_plan_file(L405, H100, Plan(dp=64, tp=8, zero=3, micro_batch=1, grad_accum=4, seq=8192), phase="a")
    got, _ = _flags(ddp)
    assert got["--training.local_batch_size"] == "1" and got["--training.global_batch_size"] == "256"
    assert int(got["--training.global_batch_size"]) // (1 * 64) == 4                  # torchtitan's accumulation
    meta = make_plan_file(L405, H100, Plan(dp=128, tp=8, pp=16, zero=2, sp=True, micro_batch=1, grad_accum=16,
                                           seq=8192, schedule="interleaved", interleave=8, pp_split="embed-head",
                                           recompute="op-sac"), phase="b")
    got, ac = _flags(meta)
    assert got["--training.local_batch_size"] == "16" and ac == "activation-checkpoint:selective"
    less, per = int(got["--parallelism.pipeline_parallel_first_stage_less_layers"]), \
        int(got["--parallelism.pipeline_parallel_layers_per_stage"])
    assert less == int(got["--parallelism.pipeline_parallel_last_stage_less_layers"]) == 1
    slots = L405.layers + 2 * less
    stages = -(-slots // per)
    assert stages == 16 * 8
    q, r = divmod(slots, stages)                          # torchtitan's _generate_llm_fqn_per_model_part
    titan = [q + (i < r) - less * (i in (0, stages - 1)) for i in range(stages)]
    assert titan == [len(c) for c in sharding.chunk_layers(L405.layers, 16, 8, "embed-head")]
    odd = make_plan_file(L405, H100, meta.plan.with_(interleave=3, pp_split="layers", grad_accum=48), phase="c")
    with pytest.raises(ParallelLabError, match=r"pick interleave in \["):
        cluster_job.torchtitan_flags(odd)


def test_torchtitan_notes_say_where_the_job_is_not_the_plan():
    got, _ = _flags(load_plan(ROOT / "examples/plans/tiny-dp2-zero3.yaml"))
    assert got["--training.mixed_precision_param"] == "float32"                  # an fp32 plan stays fp32
    notes = cluster_job.torchtitan_notes(meta_8k().__class__(**{**meta_8k().__dict__,
                                                               "plan": meta_8k().plan.with_(recompute="selective")}))
    text = " ".join(notes)
    assert "Korthikanti" in text and "float32" in text and "Float8" in text and "ChunkedLossWrapper" in text
    fp32_grads = meta_8k().plan.with_(optimizer="adam-mixed-fp32-grad", loss_chunk=4096)
    assert not any("float32" in n or "Chunked" in n
                   for n in cluster_job.torchtitan_notes(make_plan_file(L405, H100, fp32_grads, phase="d"),
                                                         "llama3:llama3_70b"))


def test_torchtitan_config_loader_accepts_the_flags():
    # torchtitan's own loader (ConfigManager: tyro over its config registry) parses our flags. Its llama3_405b
    # entry turns on float8 linears, which it refuses to build without an SM89+ GPU, so the flags are applied
    # to its llama3_70b entry: the parallelism and training sections are the same dataclasses.
    from torchtitan.config import manager  # the titan extra (make test installs it): never skipped
    cfg = manager.ConfigManager().parse_args(["--module", "llama3", "--config", "llama3_70b",
                                              *cluster_job.torchtitan_flags(meta_8k())])
    assert cfg.parallelism.tensor_parallel_degree == 8 and cfg.parallelism.pipeline_parallel_degree == 16
    assert cfg.training.seq_len == 8192 and cfg.parallelism.enable_sequence_parallel is True
    assert cfg.parallelism.data_parallel_shard_degree == 128 and cfg.parallelism.fsdp_reshard_after_forward == "never"
    assert type(cfg.activation_checkpoint).__name__.lower().startswith("no")
    assert cfg.parallelism.pipeline_parallel_first_stage_less_layers == 0 == \
        cfg.parallelism.pipeline_parallel_last_stage_less_layers
    # the interleaved embed-head split, op-sac and an fp32 plan without a pipeline
    meta = make_plan_file(L405, H100, Plan(dp=128, tp=8, pp=16, zero=2, sp=True, micro_batch=1, grad_accum=16,
                                           seq=8192, schedule="interleaved", interleave=8, pp_split="embed-head",
                                           recompute="op-sac"), phase="b")
    cfg = manager.ConfigManager().parse_args(["--module", "llama3", "--config", "llama3_70b",
                                              *cluster_job.torchtitan_flags(meta)])
    assert cfg.parallelism.pipeline_parallel_schedule == "Interleaved1F1B"
    assert cfg.parallelism.pipeline_parallel_layers_per_stage == 1
    assert cfg.parallelism.pipeline_parallel_first_stage_less_layers == 1
    assert type(cfg.activation_checkpoint).__qualname__.lower().startswith("selective")
    fp32 = make_plan_file(L405, H100, Plan(dp=64, tp=8, zero=3, micro_batch=1, grad_accum=4, seq=8192,
                                           optimizer="adam-fp32", dtype="fp32"), phase="c")
    cfg = manager.ConfigManager().parse_args(["--module", "llama3", "--config", "llama3_70b",
                                              *cluster_job.torchtitan_flags(fp32)])
    assert cfg.training.mixed_precision_param == "float32" and cfg.training.local_batch_size == 1
    assert cfg.training.global_batch_size == 256
