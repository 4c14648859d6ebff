"""``parallel-lab launch``: a plan file as the job a cluster runs: the torchrun command of every node, an sbatch
script, torchtitan's flags (:mod:`parallel_lab.cluster_job`)."""

from __future__ import annotations

import argparse
from typing import Any

from ..errors import ParallelLabError
from ..plan_flags import Output, subcommand


def add(sub: Any) -> None:
    p = subcommand(sub, "launch", handle,
                   "turn a plan file into the job a cluster runs: torchrun per node, sbatch script, torchtitan flags")
    p.add_argument("plan_file", metavar="PLAN.yaml", help="a plan file (see parallel-lab plan --save)")
    p.add_argument("--torchrun", action="store_true", help="print the torchrun command of every node (default)")
    p.add_argument("--slurm", action="store_true", help="print (or --out: write) an sbatch script")
    p.add_argument("--out", metavar="FILE", help="with --slurm: write the script to FILE")
    p.add_argument("--entry", choices=("parallel-lab", "torchtitan"), default="parallel-lab",
                   help="what each rank runs: the lab's `parallel_lab run --plan` or torchtitan's trainer")
    p.add_argument("--rdzv-endpoint", metavar="HOST[:PORT]",
                   help="the c10d rendezvous, spelled as torchrun spells it (default: $HEAD_NODE, the first node "
                        "of the allocation, port 29500)")
    p.add_argument("--rdzv-port", dest="port", type=int, default=None,
                   help="only the rendezvous port (default 29500; or give it in --rdzv-endpoint)")
    p.add_argument("--torchtitan-config", metavar="MODULE:CONFIG",
                   help="torchtitan's --module and --config (default: from the model preset, e.g. llama3:llama3_8b)")
    p.add_argument("--time", default="04:00:00", help="sbatch --time (default 04:00:00)")
    p.add_argument("--partition", help="sbatch --partition")


def handle(args: argparse.Namespace) -> Output:
    from .. import cluster_job
    from ..planfile import load_plan

    pf = load_plan(args.plan_file)
    head, port = cluster_job.rendezvous(args.rdzv_endpoint, args.port)
    job = cluster_job.job_of(pf, port)
    cmd = cluster_job.torchrun_command(pf, args.plan_file, entry=args.entry, port=port, head=head or "$HEAD_NODE",
                                       config=args.torchtitan_config)
    data: dict[str, Any] = {"nodes": job.nodes, "gpus_per_node": job.gpus_per_node, "world": job.world,
                            "entry": args.entry, "engine": pf.engine, "torchrun": cmd}
    try:
        data["torchtitan_flags"] = cluster_job.torchtitan_flags(pf)
    except ParallelLabError as e:
        data["torchtitan_flags"] = None
        data["torchtitan_note"] = str(e)
    data["torchtitan_notes"] = cluster_job.torchtitan_notes(pf, args.torchtitan_config)
    lines = [f"{pf.phase}: {job.nodes} node(s) x {job.gpus_per_node} GPUs ({pf.cluster.name}), "
             f"c10d rendezvous on {head or 'the head node'}, port {job.port}"]
    if args.slurm:
        script = cluster_job.sbatch_script(pf, args.plan_file, entry=args.entry, port=port, time=args.time,
                                           partition=args.partition, config=args.torchtitan_config, head=head)
        data["sbatch"] = script
        if args.out:
            cluster_job.write_script(args.out, script)
            lines.append(f"wrote {args.out}: sbatch {args.out}")
        else:
            lines.append(script.rstrip())
    if args.entry == "torchtitan":
        lines += [f"note: {n}" for n in data["torchtitan_notes"]]
    if args.torchrun or not args.slurm:
        where = "" if head else ", HEAD_NODE = the first node's address"
        lines += [f"on every node, the same line (c10d numbers the nodes{where}):", "  " + cmd]
    return Output(data, "\n".join(lines))
