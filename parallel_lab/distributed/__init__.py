"""Layer 2: runnable torch.distributed implementations (gloo on CPU, nccl on GPUs, chosen automatically).

Files, one idea each: ``launch`` (processes, rendezvous, errors), ``grid`` (the dp x pp x cp x tp process
grid), ``model`` (the tiny reference decoder, data, single-process reference), ``instruments`` (traced
collectives, saved-tensor bytes, timelines), ``data_parallel`` (DDP naive and bucketed), ``train`` (the
per-rank training loop and the composition of parallelisms), ``run`` (``parallel-lab run``). The
parallelisms of later issues plug into ``train`` (see its docstring).

Importing this package imports torch; ``import parallel_lab`` alone does not.
"""
