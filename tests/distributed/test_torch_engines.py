"""Torch's engines beside the lab's (parallel_lab/distributed/runtime/torch_engines.py, companion 10).

The ruler first: ``CollectiveLog`` weighs plain ``dist.*`` calls, DTensor's functional collectives and
point-to-point calls by the conventions' table (all-gather: the gathered output; reduce-scatter: the full
input). Then the engines on 2 gloo ranks: DDP and FSDP2 train to the same parameters as the lab's bitwise,
FSDP2 and the pipeline make exactly the calls ``comm`` predicts, DDP the same bytes in other buckets, and
FSDP2's local shards weigh what the ledger says.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from parallel_lab.distributed.runtime import torch_engines as te
from parallel_lab.distributed.runtime.launch import launch
from parallel_lab.ledger import state_bytes

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(120)]


def _ruler(grid) -> list[tuple[str, int]]:
    import torch.distributed._functional_collectives as funcol

    with te.CollectiveLog() as log:
        dist.all_reduce(torch.ones(10))                                          # 40 B
        dist.all_gather_into_tensor(torch.empty(6), torch.ones(3))               # 24 B gathered
        dist.reduce_scatter_tensor(torch.empty(4, dtype=torch.float64), torch.ones(8, dtype=torch.float64))  # 64 B in
        funcol.all_reduce(torch.ones(5), "sum", dist.group.WORLD).wait()         # 20 B
        funcol.all_gather_tensor(torch.ones(7), 0, dist.group.WORLD).wait()      # 56 B gathered
        if grid.rank == 0:
            dist.send(torch.ones(3), 1)                                          # 12 B
        else:
            dist.recv(torch.empty(3), 0)
        dist.barrier()
    return log.calls


def test_collective_log_weighs_every_path():
    calls = launch(_ruler, 2, timeout_s=60)
    common = [("all_reduce", 40), ("all_gather", 24), ("reduce_scatter", 64), ("all_reduce", 20), ("all_gather", 56)]
    assert calls[0] == [*common, ("send", 12)]
    assert calls[1] == [*common, ("recv", 12)]


@pytest.fixture(scope="module")
def results():
    return launch(te.compare_rank, 2, ("DDP", "FSDP", "PP"), timeout_s=100)


def test_ddp_and_fsdp2_train_bitwise_like_the_lab(results):
    for rank in (0, 1):
        for name in ("DDP", "FSDP"):
            lab, tor = results[rank][name]["lab"], results[rank][name]["torch"]
            assert lab["losses"] == tor["losses"], (rank, name)
            assert len(lab["params"]) == len(tor["params"]) == 21
            assert te.max_param_diff(lab["params"], tor["params"]) == 0.0, (rank, name)
    start = te.build_model(te.SPEC, seed=0).state_dict()
    assert te.max_param_diff(results[0]["FSDP"]["torch"]["params"], start) > 1e-3       # training moved them


def test_fsdp2_and_pipelining_make_the_predicted_calls(results):
    for rank in (0, 1):
        for name in ("FSDP", "PP"):
            rows = te.call_table(name, results, rank)
            assert rows and all(p == lab == t for _, _, p, lab, t in rows), (rank, name, rows)
    assert ("all_gather", 4 * 181_504, 4, 4, 4) in te.call_table("FSDP", results)
    assert te.max_param_diff(results[1]["PP"]["lab"]["params"], results[1]["PP"]["torch"]["params"]) < 1e-6


def test_ddp_sends_the_predicted_bytes_in_other_buckets(results):
    rows = te.call_table("DDP", results)
    totals = [sum(row[1] * row[i] for row in rows) for i in (2, 3, 4)]
    assert totals == [4 * 494_208] * 3
    assert all(p == lab for _, _, p, lab, _ in rows)
    assert sum(t for *_, t in rows) < sum(p for _, _, p, _, _ in rows)     # torch's buckets pass the cap


def test_fsdp2_shards_weigh_what_the_ledger_says(results):
    pred = state_bytes(te.SPEC, te.PLANS["FSDP"])
    for rank in (0, 1):
        assert results[rank]["FSDP"]["torch"]["state"] == {k: int(v) for k, v in pred.items()}
        assert results[rank]["FSDP"]["lab"]["state"] == results[rank]["FSDP"]["torch"]["state"]


def test_context_parallel_is_refused_on_cpu(results):
    cp = results[0]["context_parallel"]
    assert cp["default"].startswith("NotImplementedError") and "flash_attention_for_cpu" in cp["default"]
    assert cp["math"] != "ok"
    assert "_scaled_dot_product_flash_attention_for_cpu" not in te.ring_attention_kernels()
