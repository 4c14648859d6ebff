"""Two torchrun agents on 127.0.0.1, each a "node" of 2 ranks, running ``parallel-lab run`` unchanged.

The agents meet through torchrun's c10d rendezvous on a free port (the way one ``torchrun`` per machine of a
cluster does, ``--nnodes=2``). torchrun numbers the ranks node by node (``RANK = GROUP_RANK *
LOCAL_WORLD_SIZE + LOCAL_RANK``, the group rank chosen by the rendezvous), so with dp=2, tp=2 each TP group
lives inside a node and each DP group spans both: the ranks' grids see exactly that from
``LOCAL_WORLD_SIZE``, and the report says which groups crossed a node (and that this is what
``mesh.crossing_groups`` predicts). Rank 0 gathers the results and
prints the report; the other ranks print nothing.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from parallel_lab.distributed.runtime.launch import free_port

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(300)]

REPO = Path(__file__).resolve().parents[2]


def _agents(port: int, args: list[str], timeout_s: float) -> list[subprocess.CompletedProcess]:
    torchrun = Path(sys.executable).with_name("torchrun")
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    cmd = [str(torchrun), "--nnodes=2", "--nproc-per-node=2", "--rdzv-backend=c10d",
           f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=parallel-lab-test", "--max-restarts=0",
           "--monitor-interval=0.5", "-m", "parallel_lab", *args]
    procs = [subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              start_new_session=True) for _ in range(2)]
    out = []
    try:
        for p in procs:
            stdout, stderr = p.communicate(timeout=timeout_s)
            out.append(subprocess.CompletedProcess(p.args, p.returncode, stdout, stderr))
    finally:
        for p in procs:                        # each agent and its ranks: one process group per agent
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    return out


def test_two_agents_run_parallel_lab_run_and_report_the_groups_crossing_a_node():
    agents = _agents(free_port(), ["run", "--dp", "2", "--tp", "2", "--steps", "2", "--seq", "64", "--json"], 240)
    for a in agents:
        assert a.returncode == 0, a.stderr[-3000:]
    printed = [a.stdout.strip() for a in agents if a.stdout.strip()]
    assert len(printed) == 1, printed                 # rank 0 only (on whichever agent it landed)
    j = json.loads(printed[0])
    assert j["max_abs_param_diff"] <= 2e-5
    for dim, c in j["comm"].items():
        assert c["measured_bytes"] == c["predicted_bytes"] > 0, dim
    nodes = j["nodes"]
    assert nodes["ranks_per_node"] == 2 and nodes["nodes"] == 2 and nodes["node_of_rank"] == [0, 0, 1, 1]
    assert nodes["crossing"] == nodes["predicted_crossing"]
    assert nodes["crossing"]["dp"] == [[0, 2], [1, 3]]         # DP spans the nodes; TP stays inside one
    assert nodes["crossing"]["tp"] == [] and nodes["crossing"]["pp"] == [] and nodes["crossing"]["cp"] == []


def test_node_rule_of_layer_1():
    """``mesh.crossing_groups``: the prediction the report compares with; the link tiers use the same rule."""
    from parallel_lab import mesh
    from parallel_lab.hardware import ClusterSpec
    from parallel_lab.specs import Plan

    plan = Plan(dp=2, tp=2, pp=2, grad_accum=2)                   # ranks (dp, pp, tp): tp innermost
    assert mesh.crossing_groups(plan, "tp", 2) == []
    assert mesh.crossing_groups(plan, "pp", 2) == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert mesh.crossing_groups(plan, "pp", 4) == [] and mesh.crossing_groups(plan, "dp", 8) == []
    assert mesh.crossing_groups(plan, "dp", 4) == [[0, 4], [1, 5], [2, 6], [3, 7]]
    cluster = ClusterSpec.preset("cpu-gloo")                      # 2 ranks per node
    for dim in ("dp", "pp", "tp"):
        for g in mesh.all_groups(plan, dim):
            assert (mesh.tier_of(cluster, g) is cluster.inter) == mesh.crosses_nodes(g, cluster.gpus_per_node)


def test_node_count_is_the_number_of_nodes_node_of_names():
    """``mesh.node_count``: the rows of the grid explorer; a partly filled last node still counts."""
    from parallel_lab import mesh
    from parallel_lab.errors import ParallelLabError

    for world in range(1, 40):
        for rpn in (1, 2, 3, 8):
            assert mesh.node_count(world, rpn) == len({mesh.node_of(r, rpn) for r in range(world)}), (world, rpn)
    assert mesh.node_count(16, 8) == 2 and mesh.node_count(17, 8) == 3 and mesh.node_count(4, 8) == 1
    with pytest.raises(ParallelLabError, match="world=0"):
        mesh.node_count(0, 8)
