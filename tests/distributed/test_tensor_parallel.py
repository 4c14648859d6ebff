"""Tensor and sequence parallelism against the single-process reference, the comm prediction and the ledger.

Tolerances (fp32, measured on CPU): TP ranks sum partial products in a different order than the
single process, so results agree to rounding. Seen over tp = 2, 4, both flavours, with and without SP:
logits within 5.1e-7, losses within 4.8e-7, every gradient within 9.3e-7 of the largest entry of that
tensor's reference gradient, parameters after 3 AdamW steps within 2.0e-5 (AdamW divides by sqrt(v), which
magnifies rounding in entries whose gradient is tiny). The bounds below leave a margin of 5x or more; the
gradient bound adds 1e-9 absolute for the key bias, whose gradient is 0 in exact arithmetic (softmax
ignores a constant added to every score of a query) and ~1e-11 of rounding on both sides.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from parallel_lab import comm, ledger, ledger_activations
from parallel_lab.distributed.instruments.tracer import CommTracer, compare_calls
from parallel_lab.distributed.model.data import synthetic_batch
from parallel_lab.distributed.model.model import build_model, loss_fn
from parallel_lab.distributed.model.reference import reference_train
from parallel_lab.distributed.runtime.launch import launch
from parallel_lab.distributed.runtime.run import predicted_activations
from parallel_lab.distributed.runtime.train import parallelize
from parallel_lab.distributed.tensor_parallel.tp_communications import (
    TPGroup,
    copy_to_tp,
    gather_from_sequence_parallel,
    reduce_from_tp,
    reduce_scatter_to_sequence_parallel,
)
from parallel_lab.distributed.tensor_parallel.tp_model import check_tp
from parallel_lab.errors import ParallelLabError
from parallel_lab.specs import ModelSpec, Plan

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(150)]

LOGIT_TOL, LOSS_TOL, GRAD_REL_TOL, GRAD_ABS_TOL, PARAM_TOL = 3e-6, 3e-6, 5e-6, 1e-9, 1e-4
LLAMA = ModelSpec.preset("tiny-llama").with_(layers=2)        # heads 4, kv_heads 2: tp=4 replicates kv heads
GPT = ModelSpec.preset("tiny-gpt").with_(layers=2)            # biases, LayerNorm, learned positions
STEPS = 3


def plan(**kw) -> Plan:
    return Plan(**{"micro_batch": 2, "seq": 32, "optimizer": "adam-fp32", "dtype": "fp32", **kw})


def _vocab_gather(x: torch.Tensor, grid) -> torch.Tensor:
    parts = [torch.empty_like(x) for _ in range(grid.size("tp"))]
    dist.all_gather(parts, x.contiguous(), group=grid.groups["tp"])
    return torch.cat(parts, dim=-1)


def _train_rank(grid, spec: ModelSpec, p: Plan, steps: int) -> dict:
    """``steps`` optimizer steps as ``train.train_rank`` runs them, keeping the first step's full logits and
    full gradients (gathered over TP, untraced) for the comparison with the reference."""
    tracer = CommTracer(grid.rank, grid.groups_by_dim())
    rt = parallelize(build_model(spec, 0, recompute=p.recompute, device=grid.device), grid, p, tracer)
    out: dict = {"losses": [], "rank": grid.rank, "tp_rank": grid.tp_rank, "dp_rank": grid.dp_rank}
    seen: dict = {}
    loss = rt.loss

    def loss_keeping_logits(logits, batch):
        seen["logits"] = logits
        return loss(logits, batch)

    def first_step_full(step: int) -> None:                   # logits and synchronised gradients, untraced
        if step == 0:
            tracer.enabled = False
            out["logits"] = _vocab_gather(seen["logits"].detach(), grid)
            grads = {n: q.grad.clone() for n, q in rt.model.named_parameters()}   # DDP reuses its buckets
            for fn in rt.gather_full:
                grads = fn(grads)
            out["grads"] = grads
            tracer.enabled = True

    rt.loss = loss_keeping_logits
    for step in range(steps):
        micro = rt.micro_batches(synthetic_batch(spec, p, step, 0))
        out["losses"].append(rt.train_step(micro, before_step=lambda step=step: first_step_full(step)))
    tracer.enabled = False
    out.update(params=rt.full_parameters(), events=list(tracer.events), activations=int(rt.meter.peak["activations"]),
               logits_and_loss=int(rt.meter.peak["logits_and_loss"]), state=rt.dp.measure_state())
    return out


def _reference_step0(spec: ModelSpec, p: Plan) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model = build_model(spec, 0)
    batch = synthetic_batch(spec, p, 0, 0)
    logits = model(batch.tokens, batch.positions)
    loss_fn(logits, batch.targets).backward()
    return logits.detach(), {n: q.grad for n, q in model.named_parameters()}


def check_against_reference(spec: ModelSpec, p: Plan, full_grads: bool = True) -> list[dict]:
    results = launch(_train_rank, p, spec, p, STEPS, timeout_s=120)
    ref_logits, ref_grads = _reference_step0(spec, p)
    ref = reference_train(spec, p, STEPS, 0)
    rows = p.micro_batch
    for r in results:
        mine = ref_logits[r["dp_rank"] * rows:(r["dp_rank"] + 1) * rows]
        assert (r["logits"] - mine).abs().max() <= LOGIT_TOL, r["rank"]
        assert set(r["grads"]) == set(ref_grads)
        for n, g in (ref_grads if full_grads else {}).items():
            assert r["grads"][n].shape == g.shape, n
            assert (r["grads"][n] - g).abs().max() <= GRAD_REL_TOL * g.abs().max() + GRAD_ABS_TOL, n
        assert (r["params"].keys() == ref.params.keys())
        assert max((r["params"][n] - ref.params[n]).abs().max() for n in ref.params) <= PARAM_TOL
        # every traced call of every rank is one the analytic core predicts, and nothing is missing
        assert compare_calls(r["events"], comm.collectives(spec, p, stage=0), times=STEPS) == \
            {"missing": {}, "extra": {}}, r["rank"]
        state = ledger.state_bytes(spec, p)
        assert r["state"] == {k: int(state[k]) for k in r["state"]}
        assert r["activations"] == predicted_activations(spec, p)
        assert r["logits_and_loss"] == ledger_activations.logits_bytes(spec, p, formula="per-op")
    dp_losses = [sum(r["losses"][i] for r in results if r["tp_rank"] == 0) / p.dp for i in range(STEPS)]
    assert max(abs(a - b) for a, b in zip(dp_losses, ref.losses, strict=True)) <= LOSS_TOL
    return results


@pytest.mark.parametrize("spec", [LLAMA, GPT], ids=["llama", "gpt"])
@pytest.mark.parametrize("tp", [2, 4])
def test_tp_and_sp_match_reference_prediction_and_ledger(spec, tp):
    """Without and with SP: outputs, gradients, parameters, calls, state; SP stores fewer activations."""
    acts = {}
    for sp in (False, True):
        results = check_against_reference(spec, plan(tp=tp, sp=sp))
        acts[sp] = results[0]["activations"]
        events = results[0]["events"]
        kinds = {(e.dim, e.kind, e.phase) for e in events}
        if sp:
            assert ("tp", "all_reduce", "forward") not in kinds
            assert {("tp", "all_gather", "forward"), ("tp", "reduce_scatter", "forward"),
                    ("tp", "reduce_scatter", "backward"), ("tp", "all_gather", "backward")} <= kinds
        else:      # the seed's figure: 2 forward + 2 backward all-reduces of s b h per layer
            M = 32 * 2 * spec.hidden * 4                     # s b h, fp32
            blocks = [e for e in events if e.dim == "tp" and e.kind == "all_reduce" and e.message_bytes == M]
            fwd = sum(e.phase == "forward" for e in blocks)
            assert fwd == len(blocks) - fwd == 2 * spec.layers * STEPS
    # the blocks' norm / residual region is split by tp: the fall the per-op ledger predicts, exactly
    assert acts[True] < acts[False]
    fall = (ledger_activations.activation_bytes(spec, plan(tp=tp), formula="per-op")
            - ledger_activations.activation_bytes(spec, plan(tp=tp, sp=True), formula="per-op"))
    assert acts[False] - acts[True] == fall > 0


def test_tp2_with_dp2_and_sp():
    """TP inside, bucketed DDP over the data-parallel pairs (ranks 0, 2 and 1, 3); SP's replicated-gradient
    all-reduce runs after the DDP average."""
    results = check_against_reference(LLAMA, plan(tp=2, dp=2, sp=True, bucket_mb=0.2))
    dims = {e.dim for e in results[0]["events"]}
    assert dims == {"dp", "tp", "tp_vocab"}


@pytest.mark.parametrize("reduce", ["reduce_scatter", "all_reduce"])
def test_tp2_sp_with_zero1(reduce):
    """ZeRO-1 keeps the full ``p.grad`` after its sync, so SP's all-reduce of the replicated gradients
    (``rt.finalize_grads``) composes with it (ZeRO-2/3 free them: refused). The all-reduce variant leaves
    the averaged gradients everywhere; the default reduce-scatter only in the slice a rank owns, where the
    TP all-reduce (linear) still sums the right values: losses, parameters, bytes and memory agree."""
    check_against_reference(LLAMA, plan(tp=2, dp=2, sp=True, zero=1, zero1_reduce=reduce),
                            full_grads=reduce == "all_reduce")


def test_full_recompute_repeats_the_forward_collectives():
    """Each block recomputed whole in backward: its forward all-gathers and reduce-scatters run again (the
    block's last reduce-scatter too: the model turns off torch's early stop of the recomputation)."""
    results = check_against_reference(LLAMA, plan(tp=2, sp=True, recompute="full"))
    bwd = [e for e in results[0]["events"] if e.phase == "backward" and e.dim == "tp"]
    n = 2 * LLAMA.layers * STEPS
    assert sum(e.kind == "reduce_scatter" for e in bwd) == 2 * n      # recomputed g-bar, grads of gathers
    assert sum(e.kind == "all_gather" for e in bwd) == 3 * n           # recomputed gathers, re-gathers, grads


def _ops_rank(grid) -> dict:
    """The four conjugate operators on a known tensor: forward values, backward values, traced calls."""
    tracer = CommTracer(grid.rank, grid.groups_by_dim())
    tp = TPGroup(grid.groups["tp"], grid.size("tp"), grid.tp_rank)
    t, r = tp.size, tp.rank
    x = (torch.arange(2 * 4 * 3, dtype=torch.float32).view(2, 4, 3) + 100 * r).requires_grad_()
    out = {}
    for name, fn in (("f", copy_to_tp), ("g", reduce_from_tp), ("gather", gather_from_sequence_parallel),
                     ("scatter", reduce_scatter_to_sequence_parallel)):
        xi = x.detach().clone().requires_grad_()
        with tracer.observe():
            y = fn(xi * 1.0, tp)
            weight = torch.arange(y.numel(), dtype=torch.float32).view_as(y) + 1000 * r
            (y * weight).sum().backward()
        out[name] = (y.detach(), xi.grad, weight, [e.key() for e in tracer.events])
        tracer.clear()
    out["t"], out["r"] = t, r
    return out


def test_conjugate_operators_forward_and_backward():
    res = launch(_ops_rank, plan(tp=2), timeout_s=60)
    xs = [torch.arange(24, dtype=torch.float32).view(2, 4, 3) + 100 * r for r in range(2)]
    ws = {name: [res[r][name][2] for r in range(2)] for name in ("f", "g", "gather", "scatter")}
    M = 24 * 4
    for r in range(2):
        y, gx, _, calls = res[r]["f"]                        # identity / all-reduce
        assert torch.equal(y, xs[r]) and torch.equal(gx, ws["f"][0] + ws["f"][1])
        assert calls == [("tp", "all_reduce", M, 2)]
        y, gx, _, calls = res[r]["g"]                        # all-reduce / identity
        assert torch.equal(y, xs[0] + xs[1]) and torch.equal(gx, ws["g"][r])
        assert calls == [("tp", "all_reduce", M, 2)]
        y, gx, _, calls = res[r]["gather"]                   # all-gather along s / reduce-scatter
        assert torch.equal(y, torch.cat(xs, dim=1))
        assert torch.equal(gx, (ws["gather"][0] + ws["gather"][1])[:, 4 * r:4 * (r + 1)])
        assert calls == [("tp", "all_gather", 2 * M, 2), ("tp", "reduce_scatter", 2 * M, 2)]
        y, gx, _, calls = res[r]["scatter"]                  # reduce-scatter along s / all-gather
        assert torch.equal(y, (xs[0] + xs[1])[:, 2 * r:2 * (r + 1)])
        assert torch.equal(gx, torch.cat(ws["scatter"], dim=1))
        assert calls == [("tp", "reduce_scatter", M, 2), ("tp", "all_gather", M, 2)]


def test_impossible_splits_are_clear_errors():
    gqa = ModelSpec(layers=2, hidden=96, heads=12, kv_heads=6, ffn=192, vocab=480, flavour="llama")
    with pytest.raises(ParallelLabError, match=r"tp=4 cannot split kv_heads=6.*tp in \{1, 2, 3, 6, 12\}"):
        check_tp(gqa, plan(tp=4, seq=32))
    with pytest.raises(ParallelLabError, match="tp=8 does not divide vocab=500"):
        check_tp(ModelSpec.preset("tiny-llama").with_(vocab=500, heads=8, kv_heads=8, ffn=512), plan(tp=8))
    with pytest.raises(ParallelLabError, match="seq a multiple of 8"):
        check_tp(LLAMA, plan(tp=4, sp=True, cp=2, seq=36))


def test_cli_run_tp2_sp(cli_json):
    """``parallel-lab run --tp 2 --sp``: losses, parameters, bytes per dim and memory as reported."""
    j = cli_json("run", "--model", "tiny-llama", "--tp", "2", "--sp", "--steps", "2", "--seq", "64")
    assert max(abs(a - b) for a, b in zip(j["losses"], j["reference_losses"], strict=True)) <= LOSS_TOL
    assert j["max_abs_param_diff"] <= PARAM_TOL
    assert set(j["comm"]) == {"tp", "tp_vocab"}
    for c in list(j["comm"].values()) + list(j["memory"].values()):
        assert c["measured_bytes"] == c["predicted_bytes"] > 0
