"""From a plan file to the job a cluster runs: per-node torchrun commands, an sbatch script, torchtitan flags.

A plan of ``world = dp * tp * pp * cp`` GPUs on nodes of ``gpus_per_node`` runs as ``world / gpus_per_node``
torchrun agents, one per node, that meet through the c10d rendezvous on the head node (torchrun's
``--nnodes N --nproc-per-node G --rdzv-backend c10d --rdzv-endpoint HEAD:PORT``). Ranks are numbered node
by node, so the grid ``arange(world).view(dp, pp, cp, tp)`` puts each TP group inside one node whenever
``tp <= gpus_per_node`` (``layout.group_tier``), which :meth:`Plan.validate` with the cluster checks.

Two programs can run under those agents: the lab's own ``parallel-lab run --plan PLAN.yaml`` (the tiny
model, for plans small enough to measure), or torchtitan's trainer with the plan's degrees as its
``--parallelism.*`` flags (:func:`torchtitan_flags`, torchtitan 0.3's config names). Where torchtitan has no
equivalent the mapping says so instead of guessing: ZB-H1 (use 1F1B or a CSV schedule), ZeRO-1 (FSDP shards
gradients too: ZeRO-2 is the nearest, ``reshard_after_forward=never``), and our ``selective`` (Korthikanti's
attention-core recompute) differs from torchtitan's op-level selective checkpointing.
Environment variables that matter on a cluster: ``OMP_NUM_THREADS`` (torchrun sets 1), ``NCCL_DEBUG``,
``TORCH_NCCL_ASYNC_ERROR_HANDLING`` (fail fast on a broken collective), ``NCCL_SOCKET_IFNAME`` (site-specific).
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass

from . import layout
from .errors import ParallelLabError
from .planfile import PlanFile

DEFAULT_PORT = 29500
#: our schedule name -> torchtitan's ``parallelism.pipeline_parallel_schedule`` (torch.distributed.pipelining)
#: our model presets -> torchtitan's ``--module`` and ``--config`` (its config registry)
TORCHTITAN_CONFIGS = {"llama3-8b": "llama3:llama3_8b", "llama3-70b": "llama3:llama3_70b",
                      "llama3-405b": "llama3:llama3_405b"}
TORCHTITAN_SCHEDULES = {"1f1b": "1F1B", "gpipe": "GPipe", "interleaved": "Interleaved1F1B"}


@dataclass(frozen=True)
class Job:
    """The shape of the job: how many nodes, GPUs per node, and the rendezvous."""

    nodes: int
    gpus_per_node: int
    port: int = DEFAULT_PORT

    @property
    def world(self) -> int:
        return self.nodes * self.gpus_per_node


def rendezvous(endpoint: str | None, port: int | None = None) -> tuple[str | None, int]:
    """``(host, port)`` of torchrun's ``--rdzv-endpoint HOST[:PORT]`` (host None: the allocation's first node);
    ``port`` is ``--rdzv-port``, which must agree with the endpoint's when both are given."""
    host, _, text = (endpoint or "").rpartition(":") if endpoint and ":" in endpoint else (endpoint, "", "")
    if text:
        if not text.isdigit() or not 0 < int(text) < 65536:
            raise ParallelLabError(f"--rdzv-endpoint {endpoint!r}: the port {text!r} is not a port number; "
                                   f"write HOST:PORT, e.g. node001:29500")
        if port is not None and port != int(text):
            raise ParallelLabError(f"--rdzv-endpoint {endpoint!r} and --rdzv-port {port} name two ports; give one")
        port = int(text)
    if endpoint is not None and not host:
        raise ParallelLabError(f"--rdzv-endpoint {endpoint!r} has no host; write HOST[:PORT], e.g. node001:29500")
    return host or None, DEFAULT_PORT if port is None else port


def job_of(pf: PlanFile, port: int = DEFAULT_PORT) -> Job:
    """The nodes a plan file needs: ``world / gpus_per_node`` (a partial node is refused, with the fix)."""
    pf.plan.validate(pf.model, pf.gpus, pf.cluster)
    g = pf.cluster.gpus_per_node
    world = pf.plan.world
    if world < g:
        return Job(1, world, port)
    if world % g:
        raise ParallelLabError(f"world={world} GPUs is not a whole number of nodes of {g} GPUs ({pf.cluster.name}); "
                               f"pick degrees whose product is a multiple of {g}")
    return Job(layout.node_count(world, g), g, port)


def torchtitan_config(pf: PlanFile, config: str | None = None) -> list[str]:
    """``--module M --config C`` of torchtitan's trainer for the plan's model (``config`` = ``"M:C"``)."""
    config = config or TORCHTITAN_CONFIGS.get(pf.model.name)
    if not config or ":" not in config:
        raise ParallelLabError(f"model {pf.model.name!r} has no torchtitan config we know of; pass one as "
                               f"MODULE:CONFIG (e.g. --torchtitan-config llama3:llama3_8b)")
    module, name = config.split(":", 1)
    return ["--module", module, "--config", name]


def program(pf: PlanFile, plan_path: str, entry: str = "parallel-lab", config: str | None = None) -> list[str]:
    """The command each rank runs: the lab's ``parallel_lab run`` or torchtitan's trainer."""
    if entry == "parallel-lab":
        return ["-m", "parallel_lab", "run", "--plan", plan_path]
    if entry == "torchtitan":
        return ["-m", "torchtitan.train", *torchtitan_config(pf, config), *torchtitan_flags(pf)]
    raise ParallelLabError(f"entry={entry!r} is not known; pick parallel-lab or torchtitan")


def torchrun_command(pf: PlanFile, plan_path: str, *, entry: str = "parallel-lab", head: str = "$HEAD_NODE",
                     node_rank: str = "$NODE_RANK", port: int = DEFAULT_PORT, config: str | None = None) -> str:
    """The command to start on every node (the same line; ``node_rank`` differs per node)."""
    job = job_of(pf, port)
    args = ["torchrun", f"--nnodes={job.nodes}", f"--nproc-per-node={job.gpus_per_node}",
            f"--node-rank={node_rank}", "--rdzv-backend=c10d", f"--rdzv-endpoint={head}:{job.port}",
            f"--rdzv-id={pf.phase}", *program(pf, plan_path, entry, config)]
    return " ".join(a if a.startswith("$") or "=$" in a else shlex.quote(a) for a in args)


def sbatch_script(pf: PlanFile, plan_path: str, *, entry: str = "parallel-lab", port: int = DEFAULT_PORT,
                  time: str = "04:00:00", partition: str | None = None, config: str | None = None,
                  head: str | None = None) -> str:
    """An sbatch script: one torchrun agent per node (``srun --ntasks-per-node=1``), rendezvous on the first
    node of the allocation (or on ``head``), the node count from the plan."""
    job = job_of(pf, port)
    prog = " ".join(shlex.quote(a) for a in program(pf, plan_path, entry, config))
    lines = [
        "#!/bin/bash",
        f"# parallel_lab plan {pf.phase!r}: {pf.model.name} on {pf.plan.world} GPUs of {pf.cluster.name}",
        f"# dp={pf.plan.dp} tp={pf.plan.tp} pp={pf.plan.pp} cp={pf.plan.cp} zero={pf.plan.zero} "
        f"schedule={pf.plan.schedule} micro_batch={pf.plan.micro_batch} grad_accum={pf.plan.grad_accum}",
        f"#SBATCH --job-name={shlex.quote(pf.phase)}",
        f"#SBATCH --nodes={job.nodes}",
        "#SBATCH --ntasks-per-node=1",
        f"#SBATCH --gpus-per-node={job.gpus_per_node}",
        f"#SBATCH --time={time}",
    ]
    if partition:
        lines.append(f"#SBATCH --partition={shlex.quote(partition)}")
    lines += [
        "set -euo pipefail",
        'HEAD_NODE=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)' if head is None
        else f"HEAD_NODE={shlex.quote(head)}",
        "export HEAD_NODE",
        "export OMP_NUM_THREADS=1",
        "export TORCH_NCCL_ASYNC_ERROR_HANDLING=1   # a broken collective fails the job instead of hanging it",
        "export NCCL_DEBUG=${NCCL_DEBUG:-WARN}",
        "# export NCCL_SOCKET_IFNAME=...   # site-specific: the interface of the fast network",
        f'srun --nodes={job.nodes} --ntasks-per-node=1 bash -c "torchrun --nnodes={job.nodes} '
        f"--nproc-per-node={job.gpus_per_node} --node-rank=\\$SLURM_NODEID --rdzv-backend=c10d "
        f'--rdzv-endpoint=$HEAD_NODE:{job.port} --rdzv-id=$SLURM_JOB_ID {prog}"',
    ]
    return "\n".join(lines) + "\n"


def torchtitan_flags(pf: PlanFile) -> list[str]:
    """The plan as torchtitan 0.3 command-line overrides (``--section.key value``); refuses what torchtitan
    cannot express, naming the nearest setting."""
    p = pf.plan
    if p.pp > 1 and p.schedule not in TORCHTITAN_SCHEDULES:
        raise ParallelLabError(f"schedule={p.schedule!r} has no torchtitan equivalent; use 1f1b, "
                               "interleaved or gpipe (or export the schedule as a CSV file)")
    if p.zero == 1:
        raise ParallelLabError("zero=1 has no torchtitan equivalent (its FSDP shards gradients too); use zero=2 "
                               "(FSDP, reshard_after_forward=never) or zero=3")
    flags = {
        "--training.seq_len": p.seq,
        "--training.local_batch_size": p.micro_batch * p.grad_accum,
        "--training.global_batch_size": p.global_batch,
        "--parallelism.tensor_parallel_degree": p.tp,
        "--parallelism.enable_sequence_parallel": p.sp,
        "--parallelism.context_parallel_degree": p.cp,
        "--parallelism.pipeline_parallel_degree": p.pp,
    }
    if p.zero == 0:
        flags["--parallelism.data_parallel_replicate_degree"] = p.dp
        flags["--parallelism.data_parallel_shard_degree"] = 1
    else:
        flags["--parallelism.data_parallel_shard_degree"] = p.dp
        flags["--parallelism.fsdp_reshard_after_forward"] = "never" if p.zero == 2 else "always"
    if p.pp > 1:
        flags["--parallelism.pipeline_parallel_schedule"] = TORCHTITAN_SCHEDULES[p.schedule]
        flags["--parallelism.pipeline_parallel_microbatch_size"] = p.micro_batch
        flags["--training.disable_cuda_graphs"] = True     # torchtitan: CUDA graphs do not support PP yet
    if p.dtype == "bf16":
        flags["--training.mixed_precision_param"] = "bfloat16"
    out: list[str] = []
    for k, v in flags.items():
        if isinstance(v, bool):                     # tyro's boolean flags: --section.key / --section.no_key
            section, _, key = k.rpartition(".")
            out.append(k if v else f"{section}.no_{key}")
        else:
            out += [k, str(v)]
    # activation checkpointing is a tyro subcommand of torchtitan's config (its `selective` is op-level SAC)
    out.append({"none": "activation-checkpoint:none", "selective": "activation-checkpoint:selective",
                "full": "activation-checkpoint:full"}[p.recompute])
    return out
