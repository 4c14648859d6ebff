"""The runtime: processes and rendezvous (``launch``), the process grid (``grid``), one rank's runtime and
step (``runtime``), the ordered ``apply_*`` composition (``train``), ``parallel-lab run``/``compare``,
faults and their diagnosis, and re-sharding on ranks."""
