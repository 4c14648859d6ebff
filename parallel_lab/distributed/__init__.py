"""Layer 2: runnable torch.distributed implementations (gloo on CPU, nccl on GPUs, chosen automatically).

Folders by kind (docs/code_map.md lists each parallelism's files, lesson and exercise):

* the parallelisms, one folder each: ``data_parallel/``, ``zero/``, ``tensor_parallel/``,
  ``pipeline_parallel/``, ``context_parallel/``, ``expert_parallel/``;
* ``model/``: the tiny decoder (no parallel code), its CPU kernels, data and the one-process reference;
* ``runtime/``: launch, the process grid, one rank's runtime, the ordered ``apply_*`` calls, ``run``;
* ``instruments/``: traced collectives (observed from outside), saved-tensor bytes, buffer peaks,
  timelines, measurements; ``probe.py``: what an algorithm tells a measurement (a no-op unless one listens).

Importing this package imports torch; ``import parallel_lab`` alone does not.
"""
