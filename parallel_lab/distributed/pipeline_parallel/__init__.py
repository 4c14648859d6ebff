"""Pipeline parallelism: the executor that runs a schedule's action list (``parallel_lab.schedules``) on a
stage (``pipeline_parallel.py``: F, B, P2P), the stages each rank holds (``stages.py``), the zero-bubble
weight split and the V's local hand-offs (``zero_bubble.py``), and the report that lays the measured
timeline beside the simulated one."""
