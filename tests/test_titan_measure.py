"""torchtitan 0.3's own Llama 3.1 8B job (seq 8192, FSDP over 8 and 128 ranks, local batch 1 and 2, each of its
activation-checkpointing modes) measured in fake tensors beside the ledger (instruments/titan_measure.py).
Two of the 32 blocks are built on both sides (TITAN_LAYERS): every per-block category scales with the blocks
exactly (32 blocks, op-sac, FSDP 8: 16.0625 GiB measured = 16 x the 2-block figure; docs/measure.md). The ledger's
torchtitan terms (``ledger_titan``) equal every measured category; the module-scoped fixture measures each case once."""

from __future__ import annotations

import json

import pytest

from parallel_lab.cli import main
from parallel_lab.specs import ModelSpec, Plan

TITAN_LAYERS = 2
#: the ledger's six categories: each equal to torchtitan's measured tensors (to the tens of bytes of scalars and
#: index tensors the ledger does not name)
MATCH = ("parameters", "gradients", "optimizer_states", "activations", "logits_and_loss", "comm_buffers")
EXACT = 1e-5
CASES = [(w, b, r) for w in (8, 128) for b in (1, 2) for r in ("none", "full", "op-sac")]


def _plan(world: int, batch: int, recompute: str) -> Plan:
    return Plan(seq=8192, micro_batch=batch, dp=world, zero=3, optimizer="fsdp2-mixed", dtype="bf16",
                recompute=recompute, attention="flash")


@pytest.fixture(scope="module")
def measured() -> dict:
    import torchtitan  # noqa: F401  (the titan extra, which make test installs: a missing one fails, not skips)

    from parallel_lab.distributed.instruments.titan_measure import measure_titan

    model = ModelSpec.preset("llama3-8b")
    return {c: measure_titan(model, _plan(*c), layers=TITAN_LAYERS) for c in CASES}


@pytest.mark.parametrize("case", CASES, ids=[f"fsdp{w}-b{b}-{r}" for w, b, r in CASES])
def test_ledger_equals_torchtitans_job(measured, case):
    m = measured[case]
    for k in MATCH:
        assert abs(m.error(k)) <= EXACT, f"{case} {k}: ledger {m.predicted[k]:.6g} vs torchtitan {m.measured[k]:.6g}"


def test_state_shards_with_the_world_and_activations_with_the_batch(measured):
    one, two = measured[(8, 1, "op-sac")], measured[(8, 2, "op-sac")]
    assert two.measured["activations"] == pytest.approx(2 * one.measured["activations"], rel=1e-6)
    big = measured[(128, 1, "op-sac")]
    assert one.measured["parameters"] / big.measured["parameters"] == pytest.approx(16, rel=1e-3)
    assert big.measured["activations"] == pytest.approx(one.measured["activations"], rel=1e-6)
    full, sac, none = (measured[(8, 1, r)].measured["activations"] for r in ("full", "op-sac", "none"))
    assert full < sac < none
    # full: the block input only, 8192 tokens x 4096 x 2 bytes per block
    assert full == pytest.approx(TITAN_LAYERS * 8192 * 4096 * 2, rel=1e-6)


@pytest.mark.parametrize("batch,recompute", [(1, "op-sac"), (2, "none"), (1, "full")])
def test_tensor_and_sequence_parallel_job_within_1_percent(batch, recompute):
    # Llama 3 70B, TP 8 + SP, FSDP 8: op-sac also keeps the two reduce-scatter outputs (its save list names
    # reduce_scatter_tensor); measured within 0.25% (about 80 kB per sequence of small tensors not named)
    import torchtitan  # noqa: F401

    from parallel_lab.distributed.instruments.titan_measure import measure_titan

    plan = Plan(seq=8192, micro_batch=batch, dp=8, tp=8, sp=True, zero=3, optimizer="fsdp2-mixed", dtype="bf16",
                recompute=recompute, attention="flash")
    m = measure_titan(ModelSpec.preset("llama3-70b"), plan, layers=TITAN_LAYERS)
    for k in MATCH:
        assert abs(m.error(k)) <= 0.01, f"{k}: ledger {m.predicted[k]:.6g} vs torchtitan {m.measured[k]:.6g}"


def test_cli_measures_torchtitans_job_and_refuses_cleanly(capsys, monkeypatch):
    import torchtitan  # noqa: F401

    import parallel_lab.distributed.instruments.titan_measure as tm

    real = tm.measure_titan
    monkeypatch.setattr(tm, "measure_titan", lambda model, plan, **kw: real(model, plan, layers=TITAN_LAYERS, **kw))
    flags = ["memory", "--model", "llama3-8b", "--seq", "8192", "--dp", "8", "--zero", "3", "--optimizer",
             "fsdp2-mixed", "--attention", "flash", "--recompute", "full", "--measure", "--engine", "torchtitan"]
    assert main([*flags, "--json"]) == 0
    got = json.loads(capsys.readouterr().out)["measured_torchtitan"]
    assert got["engine"] == "torchtitan" and abs(got["error"]["activations"]) <= 0.03
    assert set(got["measured"]) >= {"parameters", "activations", "temporaries"}
    assert main(flags) == 0
    assert "torchtitan's job measured in fake tensors" in capsys.readouterr().out
    assert main([*flags[:8], "1", *flags[9:]]) == 2                       # zero=1: no torchtitan setting
    assert "zero=1" in capsys.readouterr().err
    assert main([f for f in flags if f != "--measure"]) == 2
    assert "add --measure" in capsys.readouterr().err


def test_missing_torchtitan_is_refused_naming_the_install(capsys, monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_titan(name, *a, **kw):
        if name == "torchtitan" or name.startswith("torchtitan."):
            raise ImportError("No module named 'torchtitan'")
        return real_import(name, *a, **kw)

    monkeypatch.setattr(builtins, "__import__", no_titan)
    assert main(["memory", "--model", "llama3-8b", "--dp", "8", "--zero", "3", "--optimizer", "fsdp2-mixed",
                 "--measure", "--engine", "torchtitan"]) == 2
    err = capsys.readouterr().err
    assert "pip install -e '.[titan]'" in err and len(err.strip().splitlines()) == 1


def test_titan_terms_name_the_norm_and_refuse_what_they_do_not_model():
    from parallel_lab.errors import ParallelLabError
    from parallel_lab.ledger_titan import titan_block_terms

    model, plan = ModelSpec.preset("llama3-8b"), _plan(8, 1, "none")
    per_token = {n: titan_block_terms(model, plan, norm=n)["norms"] / 8192 for n in ("composite", "fused")}
    assert per_token == {"composite": 2 * (4096 * 8 + 4), "fused": 2 * (4096 * 2 + 4)}
    with pytest.raises(ParallelLabError, match="norm="):
        titan_block_terms(model, plan, norm="eager")
    with pytest.raises(ParallelLabError, match="dense llama3 block"):
        titan_block_terms(ModelSpec.preset("gpt3-1.3b"), plan, norm="fused")
