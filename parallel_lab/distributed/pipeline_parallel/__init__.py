"""Pipeline parallelism: the executor that runs a schedule's action list (``parallel_lab.schedules``) on a
stage, and the report that lays the measured timeline beside the simulated one."""
