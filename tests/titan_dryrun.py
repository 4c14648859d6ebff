"""torchtitan's own set-up of a plan, on a CPU build of torch: ``python tests/titan_dryrun.py JOBS.json``.

What ``torchrun -m torchtitan.train ... --comm.mode fake_backend`` does before its first step, in-process: its
ConfigManager parses the flags ``launch --entry torchtitan`` exports, ``init_fake_mode`` joins a fake process
group of the plan's world as one rank, ``ParallelDims`` builds the device mesh, the model is built on the meta
device and torchtitan's own ``pipelining_fn`` / ``parallelize_fn`` (TP, CP, activation checkpointing, FSDP)
are applied to it. The trainer itself stops on CPU torch (``torch.cuda.set_device``: torchtitan takes "cuda"
when no accelerator is found), so its device is set to "cpu" here; parameters stay on meta, nothing is
allocated, and a 405B plan of 16,384 ranks takes seconds. Two settings differ from the job: llama3_405b's
Float8 linears refuse to build without an SM89 GPU, so its model is put in llama3_70b's trainer config (the
same config sections), and ``spmd_backend=partial_dtensor`` (DTensor on the model-parallel axes) replaces the
default ``spmd_types``, whose fully_shard refuses the meta parameters of a rank with TP or FSDP under the fake
process group (``full_dtensor``: those of the last pipeline stage). Prints one JSON object per job.
"""

from __future__ import annotations

import json
import os
import sys


def setup(world: int, rank: int, args: list[str]) -> dict:
    import torch
    import torch.distributed as dist
    import torchtitan.distributed.parallel_dims as pdm
    import torchtitan.distributed.utils as du
    import torchtitan.tools.utils as tu
    from torchtitan.config import ConfigManager
    from torchtitan.distributed.parallel_dims import ParallelDims

    tu.device_type, tu.device_module = "cpu", torch.cpu
    pdm.device_type = du.device_type = "cpu"
    args = list(args)
    big = args[args.index("--config") + 1] == "llama3_405b"
    if big:
        args[args.index("--config") + 1] = "llama3_70b"
    cfg = ConfigManager().parse_args([*args[:-1], "--parallelism.spmd_backend", "partial_dtensor", args[-1]])
    if big:
        from torchtitan.models.llama3 import model_registry
        cfg.model_spec = model_registry("405B")
    os.environ["NGPU"] = str(world)
    du.init_fake_mode(world, "fake_backend", rank=rank)
    try:
        pd = ParallelDims.from_config(cfg.parallelism, world)
        pd.build_mesh()
        du.set_spmd_backend(cfg.parallelism.spmd_backend)
        spec, mc = cfg.model_spec, cfg.model_spec.model
        mc.update_from_config(config=cfg)
        with torch.device("meta"):
            model = mc.build()
        batch = pd.get_mesh("batch").size() if pd.dp_enabled else 1
        kw = dict(parallel_dims=pd, training=cfg.training, parallelism=cfg.parallelism, compile_config=cfg.compile,
                  ac_config=cfg.activation_checkpoint, dump_folder=cfg.dump_folder)
        out = {"world": world, "rank": rank, "model_params": sum(p.numel() for p in model.parameters()),
               "accumulation": cfg.training.global_batch_size // (cfg.training.local_batch_size * batch)}
        if pd.pp_enabled:
            _, parts, first, last = spec.pipelining_fn(model, **kw, device=torch.device("cpu"), model_config=mc,
                                                       parallelize_fn=spec.parallelize_fn,
                                                       loss_fn=cfg.loss.build(compile_config=cfg.compile))
            out.update(first=first, last=last, microbatches=cfg.training.local_batch_size
                       // cfg.parallelism.pipeline_parallel_microbatch_size)
        else:
            parts = [spec.parallelize_fn(model, **kw)]
        out["layers"] = [len(getattr(m, "layers", {}) or {}) for m in parts]
        out["local_params"] = sum(p.to_local().numel() if hasattr(p, "to_local") else p.numel()
                                  for m in parts for p in m.parameters())
        out["dtensor"] = all(type(p).__name__ == "DTensor" for m in parts for p in m.parameters())
        return out
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    for job in json.load(open(sys.argv[1])):
        try:
            result = setup(job["world"], job["rank"], job["args"])
        except Exception as e:                      # reported, so the test names the plan and the reason
            result = {"error": f"{type(e).__name__}: {e}"[:600]}
        print(json.dumps({"name": job["name"], **result}), flush=True)
