"""Layer 2: runnable torch.distributed implementations (gloo on CPU, nccl on GPUs, chosen automatically).

Files, one idea each (docs/conventions.md, "Layering and files"): ``launch`` (processes, rendezvous,
errors), ``grid`` (the dp x pp x cp x tp process grid), ``model`` / ``data`` / ``reference`` (the tiny
decoder, its synthetic data, the single-process reference run), ``instruments/`` (traced collectives,
saved-tensor bytes, state memory, timelines), ``runtime`` (one rank's runtime and its training step),
``data_parallel``, ``zero``, ``tensor_parallel``, ``context_parallel`` (+ ``attention``, ``cp_balance``,
``cp_stats``), ``pipeline`` (+ ``pipeline_report``), ``mixed_precision``, ``train`` (the composition:
explicit ``apply_*`` calls in a fixed order) and ``run`` (``parallel-lab run``).

Importing this package imports torch; ``import parallel_lab`` alone does not.
"""
