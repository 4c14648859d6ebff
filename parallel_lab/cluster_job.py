"""From a plan file to the job a cluster runs: per-node torchrun commands, an sbatch script, torchtitan flags.

A plan of ``world = dp * tp * pp * cp`` GPUs on nodes of ``gpus_per_node`` runs as ``world / gpus_per_node``
torchrun agents, one per node, that meet through the c10d rendezvous on the head node (torchrun's
``--nnodes N --nproc-per-node G --rdzv-backend c10d --rdzv-endpoint HEAD:PORT``). Ranks are numbered node
by node, so the grid ``arange(world).view(dp, pp, cp, tp)`` puts each TP group inside one node whenever
``tp <= gpus_per_node`` (``mesh.group_tier``), which :meth:`Plan.validate` with the cluster checks.

Two programs can run under those agents: the lab's own ``parallel-lab run --plan PLAN.yaml`` (the tiny
model, for plans small enough to measure), or torchtitan's trainer with the plan's degrees as its
``--parallelism.*`` flags (:func:`torchtitan_flags`, torchtitan 0.3's config names). Where torchtitan has no
equivalent the mapping says so instead of guessing: ZB-H1 (use 1F1B or a CSV schedule), ZeRO-1 (FSDP shards
gradients too: ZeRO-2 is the nearest, ``reshard_after_forward=never``), and our ``selective`` (Korthikanti's
attention-core recompute) differs from torchtitan's op-level selective checkpointing.
Environment variables that matter on a cluster: ``OMP_NUM_THREADS`` (torchrun sets 1), ``NCCL_DEBUG``,
``TORCH_NCCL_ASYNC_ERROR_HANDLING`` (fail fast on a broken collective), ``NCCL_SOCKET_IFNAME`` (site-specific).
Every value written into a script is checked (:func:`check_time`, :func:`check_partition`, :func:`check_host`,
:func:`check_port`) and quoted with ``shlex.quote``; a value that fails a check is a ParallelLabError (exit 2).
"""

from __future__ import annotations

import ipaddress
import os
import re
import shlex
from dataclasses import dataclass

from . import mesh
from .engines import torchtitan_differences
from .errors import ParallelLabError
from .planfile import PlanFile, write_atomic
from .specs import Plan

DEFAULT_PORT = 29500
_LABEL = r"[A-Za-z0-9_]([A-Za-z0-9_-]{0,61}[A-Za-z0-9_])?"         # one label of a host name (RFC 1123, and '_')
_HOST = re.compile(rf"^{_LABEL}(\.{_LABEL})*$")
_TIME = re.compile(r"^(?:(\d{1,7})(?::(\d{1,2}))?(?::(\d{1,2}))?|\d{1,5}-(\d{1,2})(?::(\d{1,2}))?(?::(\d{1,2}))?)$")
_PARTITION = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,63}(,[A-Za-z0-9_][A-Za-z0-9_.-]{0,63})*$")
_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_.]{0,99}$")
#: our schedule name -> torchtitan's ``parallelism.pipeline_parallel_schedule`` (torch.distributed.pipelining)
#: our model presets -> torchtitan's ``--module`` and ``--config`` (its config registry)
TORCHTITAN_CONFIGS = {"llama3-8b": "llama3:llama3_8b", "llama3-70b": "llama3:llama3_70b",
                      "llama3-405b": "llama3:llama3_405b", "tiny-llama": "llama3:llama3_debugmodel"}
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


def under_torchrun() -> bool:
    """True when torchrun (or another launcher) set this process's rank in the environment."""
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR"))


def ranks_on_this_machine(world: int) -> tuple[int, bool]:
    """``(ranks this node runs, whether it also runs the one-process reference)``: all ``world`` and the
    reference when this process forks them; under torchrun its ``LOCAL_WORLD_SIZE`` ranks, and the reference
    only on the node of global rank 0 (``run`` computes it there)."""
    if not under_torchrun():
        return world, True
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    return local, int(os.environ["RANK"]) < local


def check_port(port: int, flag: str = "--rdzv-port") -> int:
    """``port`` if it is a TCP port number (1-65535)."""
    if isinstance(port, bool) or not isinstance(port, int) or not 0 < port < 65536:
        raise ParallelLabError(f"{flag} {str(port)[:40]!r} is not a port number; give one in 1-65535, e.g. "
                               f"{DEFAULT_PORT}")
    return port


def check_host(host: str, flag: str = "--rdzv-endpoint") -> str:
    """``host`` if it is a host name (letters, digits, ``-``, ``_``, dots), an IPv4 address, or an IPv6 address
    in brackets: nothing a shell would read as more than a word."""
    if host.startswith("[") and host.endswith("]"):
        try:
            ipaddress.IPv6Address(host[1:-1])
            return host
        except ValueError:
            pass
    elif len(host) <= 253 and _HOST.match(host):
        return host
    raise ParallelLabError(f"{flag}: the host {host[:60]!r} is not a host name (letters, digits, '-', '_' and "
                           f"dots) nor an IPv6 address in brackets; e.g. node001, 10.0.0.1 or [fe80::1]")


def check_time(time: str) -> str:
    """``time`` if it is in one of SLURM's ``--time`` formats: minutes, MM:SS, HH:MM:SS, D-HH, D-HH:MM,
    D-HH:MM:SS (minutes and seconds after a ``:`` 0-59, hours after a ``-`` 0-23)."""
    m = _TIME.match(time)
    later = [int(x) for x in (m.group(2), m.group(3), m.group(5), m.group(6)) if x] if m else []
    if not m or any(x > 59 for x in later) or (m.group(4) is not None and int(m.group(4)) > 23):
        raise ParallelLabError(f"--time {time[:60]!r} is not a SLURM time; write minutes, MM:SS, HH:MM:SS, D-HH, "
                               f"D-HH:MM or D-HH:MM:SS, e.g. 04:00:00 or 2-00:00:00")
    return time


def check_partition(partition: str, flag: str = "--partition") -> str:
    """``partition`` if it is a SLURM partition (or account) name, or several separated by commas."""
    if len(partition) > 256 or not _PARTITION.match(partition):
        raise ParallelLabError(f"{flag} {partition[:60]!r} is not a SLURM name; use letters, digits, '_', '-' and "
                               f"'.' (several separated by commas), e.g. gpu or gpu,gpu-long")
    return partition


def _check_plan_path(plan_path: str) -> str:
    if not plan_path.isprintable() or len(plan_path) > 4096:
        raise ParallelLabError(f"plan file {plan_path[:60]!r}: the path has a control character (a newline?) "
                               f"or is over 4096 characters; rename the file")
    return plan_path


def rendezvous(endpoint: str | None, port: int | None = None) -> tuple[str | None, int]:
    """``(host, port)`` of torchrun's ``--rdzv-endpoint HOST[:PORT]`` (host None: the allocation's first node;
    an IPv6 address in brackets, ``[fe80::1]:29500``); ``port`` is ``--rdzv-port``, which must agree with
    the endpoint's when both are given. The host must be a host name or an address (:func:`check_host`)."""
    if port is not None:
        check_port(port)
    if endpoint is None:
        return None, DEFAULT_PORT if port is None else port
    if endpoint.startswith("["):
        host, sep, rest = endpoint.partition("]")
        host, text = host + sep, rest[1:] if rest.startswith(":") else None
        if not sep or (rest and not rest.startswith(":")):
            raise ParallelLabError(f"--rdzv-endpoint {endpoint!r}: write an IPv6 host as [ADDRESS] or [ADDRESS]:PORT")
    elif endpoint.count(":") > 1:
        raise ParallelLabError(f"--rdzv-endpoint {endpoint!r} has more than one ':'; write HOST:PORT, an IPv6 "
                               f"address in brackets: [fe80::1]:29500")
    else:
        host, sep, text = endpoint.partition(":")
        text = text if sep else None
    if not host or host == "[]":
        raise ParallelLabError(f"--rdzv-endpoint {endpoint!r} has no host; write HOST[:PORT], e.g. node001:29500")
    if text is not None:
        if not text.isdigit() or not 0 < int(text) < 65536:
            raise ParallelLabError(f"--rdzv-endpoint {endpoint!r}: the port {text!r} is not a port number; "
                                   f"write HOST:PORT, e.g. node001:29500")
        if port is not None and port != int(text):
            raise ParallelLabError(f"--rdzv-endpoint {endpoint!r} and --rdzv-port {port} name two ports; give one")
        port = int(text)
    return check_host(host), DEFAULT_PORT if port is None else port


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
    return Job(mesh.node_count(world, g), g, port)


def torchtitan_config(pf: PlanFile, config: str | None = None) -> list[str]:
    """``--module M --config C`` of torchtitan's trainer for the plan's model (``config`` = ``"M:C"``)."""
    config = config or TORCHTITAN_CONFIGS.get(pf.model.name)
    if not config:
        raise ParallelLabError(f"model {pf.model.name!r} has no torchtitan config we know of; pass one as "
                               f"MODULE:CONFIG (e.g. --torchtitan-config llama3:llama3_8b)")
    module, _, name = config.partition(":")
    if not (_NAME.match(module) and _NAME.match(name)):
        raise ParallelLabError(f"--torchtitan-config {config[:60]!r} is not MODULE:CONFIG, two Python names (letters, "
                               f"digits, '_', '.'); e.g. --torchtitan-config llama3:llama3_8b")
    return ["--module", module, "--config", name]


def check_lab_entry(pf: PlanFile) -> None:
    """Refuse ``--entry parallel-lab`` for a plan ``parallel-lab run`` cannot execute: it checks every step
    against a one-process reference of the whole model, on global rank 0, which must fit on one device
    (``memory``'s need, the larger of total and peak, against the whole HBM: what cannot run, not what is safe)."""
    from .ledger import memory

    p = pf.plan
    one = Plan(seq=p.seq, micro_batch=p.micro_batch, optimizer=p.optimizer, dtype=p.dtype, attention=p.attention,
               mlp=p.mlp, recompute=p.recompute)
    need = memory(pf.model, one, pf.cluster).need_bytes
    if need > pf.cluster.hbm_bytes:
        raise ParallelLabError(f"--entry parallel-lab runs `parallel-lab run --plan`, which checks every step against "
                               f"a one-process reference of the whole {pf.model.name}: {need / 1e9:,.1f} GB on one "
                               f"device, over the {pf.cluster.hbm_bytes / 1e9:,.0f} GB of one {pf.cluster.name} GPU; "
                               f"launch this plan with --entry torchtitan, or plan a smaller model")


def program(pf: PlanFile, plan_path: str, entry: str = "parallel-lab", config: str | None = None) -> list[str]:
    """The command each rank runs: the lab's ``parallel_lab run`` or torchtitan's trainer."""
    _check_plan_path(plan_path)
    if entry == "parallel-lab":
        check_lab_entry(pf)
        return ["-m", "parallel_lab", "run", "--plan", plan_path]
    if entry == "torchtitan":
        return ["-m", "torchtitan.train", *torchtitan_config(pf, config), *torchtitan_flags(pf)]
    raise ParallelLabError(f"entry={entry!r} is not known; pick parallel-lab or torchtitan")


def torchrun_command(pf: PlanFile, plan_path: str, *, entry: str = "parallel-lab", head: str = "$HEAD_NODE",
                     port: int = DEFAULT_PORT, config: str | None = None) -> str:
    """The command to start on every node: the same line everywhere. No ``--node-rank``: torchrun reads it only
    under ``--rdzv-backend=static``; under c10d the rendezvous gives each agent its node's group rank (which
    machine becomes node 0 is its choice), and a node's ranks stay consecutive, all the grid relies on.
    Every word is quoted (``shlex.quote``) but the endpoint on ``$HEAD_NODE``, the variable this line expands."""
    job = job_of(pf, check_port(port))
    endpoint = f"--rdzv-endpoint={head}:{job.port}"
    if head != "$HEAD_NODE":
        check_host(head)
    args = ["torchrun", f"--nnodes={job.nodes}", f"--nproc-per-node={job.gpus_per_node}",
            "--rdzv-backend=c10d", endpoint, f"--rdzv-id={pf.phase}", *program(pf, plan_path, entry, config)]
    return " ".join(a if a == endpoint and head == "$HEAD_NODE" else shlex.quote(a) for a in args)


def sbatch_script(pf: PlanFile, plan_path: str, *, entry: str = "parallel-lab", port: int = DEFAULT_PORT,
                  time: str = "04:00:00", partition: str | None = None, config: str | None = None,
                  head: str | None = None) -> str:
    """An sbatch script: one torchrun agent per node (``srun --ntasks-per-node=1``), rendezvous on the first
    node of the allocation (or on ``head``), the node count from the plan. Every value written into it is
    checked (:func:`check_time`, :func:`check_partition`, :func:`check_host`, :func:`check_port`) and every word
    quoted; ``srun`` starts ``torchrun`` itself (no ``bash -c "..."`` string for a value to break out of)."""
    job = job_of(pf, check_port(port))
    check_time(time)
    if partition:
        check_partition(partition)
    if head is not None:
        check_host(head)
    for what, name in (("model", pf.model.name), ("cluster", pf.cluster.name)):
        if not name.isprintable():
            raise ParallelLabError(f"the {what} name {name[:60]!r} has a control character; rename it")
    prog = " ".join(shlex.quote(a) for a in program(pf, plan_path, entry, config))
    lines = [
        "#!/bin/bash",
        f"# parallel_lab plan {pf.phase!r}: {pf.model.name} on {pf.plan.world} GPUs of {pf.cluster.name}",
        f"# dp={pf.plan.dp} tp={pf.plan.tp} pp={pf.plan.pp} cp={pf.plan.cp} zero={pf.plan.zero} "
        f"schedule={pf.plan.schedule} micro_batch={pf.plan.micro_batch} grad_accum={pf.plan.grad_accum}",
        f"#SBATCH --job-name={shlex.quote(pf.phase)}",
        f"#SBATCH --nodes={job.nodes}",
        "#SBATCH --ntasks-per-node=1",
        "#SBATCH --exclusive",
        f"#SBATCH --gpus-per-node={job.gpus_per_node}",
        f"#SBATCH --time={time}",
    ]
    if partition:
        lines.append(f"#SBATCH --partition={shlex.quote(partition)}")
    lines += [
        "# --exclusive: the one task per node gets every core, for its ranks and their data loaders",
        "set -euo pipefail",
        # no `| head -n 1`: under pipefail, head closing the pipe early can fail the job with scontrol's SIGPIPE
        'NODES=$(scontrol show hostnames "$SLURM_JOB_NODELIST")\nHEAD_NODE=${NODES%%$\'\\n\'*}' if head is None
        else f"HEAD_NODE={shlex.quote(head)}",
        "export HEAD_NODE",
        "export OMP_NUM_THREADS=1",
        "export TORCH_NCCL_ASYNC_ERROR_HANDLING=1   # a broken collective fails the job instead of hanging it",
        "export NCCL_DEBUG=${NCCL_DEBUG:-WARN}",
        "# export NCCL_SOCKET_IFNAME=...   # site-specific: the interface of the fast network",
        f"srun --nodes={job.nodes} --ntasks-per-node=1 torchrun --nnodes={job.nodes} "
        f"--nproc-per-node={job.gpus_per_node} --rdzv-backend=c10d "
        f'"--rdzv-endpoint=$HEAD_NODE:{job.port}" "--rdzv-id=$SLURM_JOB_ID" {prog}',
    ]
    return "\n".join(lines) + "\n"


def write_script(path: str, script: str) -> None:
    """``launch --slurm --out PATH``: the script written all or nothing (``planfile.write_atomic``); a directory,
    a missing folder or a read-only target is a ParallelLabError naming the path and the fix."""
    write_atomic(path, script, "sbatch script", "job.sbatch")


def torchtitan_flags(pf: PlanFile) -> list[str]:
    """The plan as torchtitan 0.3 command-line overrides (``--section.key value``); refuses what torchtitan
    cannot express, naming the nearest setting."""
    p = pf.plan
    refused = [line for line, refuse in torchtitan_differences(p) if refuse]
    if refused:
        raise ParallelLabError(f"plan {pf.phase!r} (engine {pf.engine}) has no torchtitan equivalent: "
                               + "; ".join(refused))
    # torchtitan accumulates global / (local * dp) steps; a pipeline splits each local batch into micro-batches
    flags = {
        "--training.seq_len": p.seq,
        "--training.local_batch_size": p.micro_batch * p.grad_accum if p.pp > 1 else p.micro_batch,
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
        flags.update(_torchtitan_stages(pf))
        flags["--training.disable_cuda_graphs"] = True     # torchtitan: CUDA graphs do not support PP yet
    flags["--training.mixed_precision_param"] = "bfloat16" if p.dtype == "bf16" else "float32"
    out: list[str] = []
    for k, v in flags.items():
        if isinstance(v, bool):                     # tyro's boolean flags: --section.key / --section.no_key
            section, _, key = k.rpartition(".")
            out.append(k if v else f"{section}.no_{key}")
        else:
            out += [k, str(v)]
    # activation checkpointing is a tyro subcommand of torchtitan's config (its `selective` is op-level SAC,
    # the plan's op-sac; the plan's Korthikanti `selective` has none: torchtitan_notes says so)
    out.append({"none": "activation-checkpoint:none", "selective": "activation-checkpoint:selective",
                "op-sac": "activation-checkpoint:selective", "full": "activation-checkpoint:full"}[p.recompute])
    return out


def _torchtitan_stages(pf: PlanFile) -> dict[str, int]:
    """torchtitan's pipeline split for the plan's chunks (``sharding.chunk_layers``): it spreads ``layers +
    first_less + last_less`` slots over ``ceil(slots / layers_per_stage)`` virtual stages, the first ones one
    slot more, the embedding taking the first stage's first ``first_less`` slots and the head the last's: the
    plan's rule, with one slot each for ``pp_split="embed-head"`` and none for ``"layers"``."""
    p = pf.plan
    less = 1 if p.pp_split == "embed-head" else 0
    out = {"--parallelism.pipeline_parallel_first_stage_less_layers": less,
           "--parallelism.pipeline_parallel_last_stage_less_layers": less}
    if p.interleave > 1:
        slots, chunks = pf.model.layers + 2 * less, p.pp * p.interleave
        def fits(v: int) -> bool:
            return -(-slots // -(-slots // (p.pp * v))) == p.pp * v

        if not fits(p.interleave):
            ok = [v for v in range(2, slots // p.pp + 1) if fits(v)]
            raise ParallelLabError(f"pp*interleave = {chunks} chunks of {slots} slots cannot be written as "
                                   f"torchtitan's pipeline_parallel_layers_per_stage (ceil({slots} / k) is never "
                                   f"{chunks}); pick interleave in {ok}")
        out["--parallelism.pipeline_parallel_layers_per_stage"] = -(-slots // chunks)
    return out


def torchtitan_notes(pf: PlanFile, config: str | None = None) -> list[str]:
    """Where the torchtitan job will not be the plan the ledger and the step-time model describe (read from
    torchtitan 0.3.0's ``config_registry`` and ``configs``): each a sentence for the launch output, first the
    plan's own differences (:func:`engines.torchtitan_differences`, none for a plan made with --engine
    torchtitan), then its config's."""
    p = pf.plan
    notes = [f"made for the lab's engine, not torchtitan's: {line}"
             for line, refuse in torchtitan_differences(p) if not refuse]
    name = torchtitan_config(pf, config)[3] if config else (TORCHTITAN_CONFIGS.get(pf.model.name) or ":").split(":")[1]
    if name in ("llama3_8b", "llama3_70b", "llama3_405b") and p.loss_chunk == 0:
        notes.append(f"torchtitan's {name} computes the loss in chunks (ChunkedLossWrapper): the whole logits "
                     "the plan counts (loss_chunk=0) are never held")
    if name == "llama3_debugmodel" and pf.model.name == "tiny-llama":
        notes.append("torchtitan's llama3_debugmodel is its own small Llama (dim 256, 6 layers, 16 heads, vocab "
                     "2048), not tiny-llama: the degrees carry over, the numbers of the plan do not; run it from a "
                     "torchtitan checkout, whose tests/assets hold its tokenizer and the c4_test data")
    if name == "llama3_405b":
        notes.append("torchtitan's llama3_405b turns on Float8 linears and torch.compile with async TP: the plan "
                     "predicts bf16 GEMMs and TP collectives between them, so the job will be faster and hold less")
    return notes
