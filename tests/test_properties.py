"""Hypothesis properties of the analytic core: monotone in dp, never negative, errors are always ours."""

from __future__ import annotations

import contextlib
import io

from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from parallel_lab import cli
from parallel_lab.comm import collectives, report
from parallel_lab.errors import ParallelLabError
from parallel_lab.flops import step_flops
from parallel_lab.ledger import memory, state_bytes
from parallel_lab.optimizers import OPTIMIZERS
from parallel_lab.specs import ModelSpec, Plan

SETTINGS = settings(max_examples=60, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])


@st.composite
def models(draw) -> ModelSpec:
    if draw(st.booleans()):
        return ModelSpec.from_params(draw(st.integers(1, 10**12)))
    heads = draw(st.sampled_from([1, 2, 4, 8]))
    kv = draw(st.sampled_from([k for k in (1, 2, 4, 8) if heads % k == 0]))
    return ModelSpec(layers=draw(st.integers(1, 8)), hidden=heads * draw(st.sampled_from([8, 16, 32])),
                     heads=heads, kv_heads=kv, ffn=draw(st.sampled_from([None, 64, 96])),
                     vocab=draw(st.integers(2, 600)), flavour=draw(st.sampled_from(["gpt", "llama"])),
                     tied_embeddings=draw(st.booleans()), max_positions=256)


@st.composite
def plans(draw) -> dict:
    """Plans that are mostly valid: dependent fields are drawn consistently (validation still filters)."""
    dp, tp = draw(st.sampled_from([1, 2, 3, 4, 8])), draw(st.sampled_from([1, 2, 4]))
    pp = draw(st.sampled_from([1, 2, 3]))
    schedule = draw(st.sampled_from(["gpipe", "1f1b", "interleaved", "zb-h1"]))
    interleaved = schedule == "interleaved"
    return dict(dp=dp, tp=tp, pp=pp, cp=draw(st.sampled_from([1, 2])),
                zero=draw(st.integers(0, 3)) if dp > 1 else 0, sp=tp > 1 and draw(st.booleans()),
                micro_batch=draw(st.integers(1, 3)),
                grad_accum=pp * draw(st.sampled_from([1, 2])) if interleaved else draw(st.integers(1, 6)),
                seq=draw(st.sampled_from([16, 64, 128, 256])),
                recompute=draw(st.sampled_from(["none", "selective", "full"])),
                optimizer=draw(st.sampled_from(sorted(OPTIMIZERS))),
                dtype=draw(st.sampled_from(["bf16", "fp32"])), schedule=schedule,
                interleave=draw(st.sampled_from([1, 2])) if interleaved else 1,
                cp_kind=draw(st.sampled_from(["ring", "allgather", "ulysses"])),
                dp_kind=draw(st.sampled_from(["bucketed", "naive"])),
                bucket_mb=draw(st.sampled_from([0.01, 25.0])),
                zero_unit=draw(st.sampled_from(["block", "root"])))


def valid(model: ModelSpec, kw: dict) -> Plan | None:
    try:
        return Plan(**kw).validate(model)
    except ParallelLabError:
        return None


@SETTINGS
@given(models(), plans(), st.sampled_from([1, 2, 3, 4, 6, 8, 16]))
def test_state_memory_never_grows_with_dp(model, kw, factor):
    small = valid(model, kw)
    assume(small is not None)
    big = valid(model, {**kw, "dp": kw["dp"] * factor})
    assume(big is not None)
    a, b = state_bytes(model, small), state_bytes(model, big)
    for k in a:
        assert b[k] <= a[k], (k, a, b)


@SETTINGS
@given(models(), plans())
def test_bytes_and_flops_never_negative(model, kw):
    plan = valid(model, kw)
    assume(plan is not None)
    led = memory(model, plan)
    assert all(v >= 0 for v in led.per_gpu_bytes.values()) and led.total_bytes >= 0
    for stage in range(plan.pp):
        for c in collectives(model, plan, stage=stage):
            assert c.message_bytes >= 0 and c.wire_bytes >= 0 and c.count >= 1 and c.group_size >= 1
    rep = report(model, plan)
    assert all(v >= 0 for v in rep.per_step_bytes.values()) and all(v >= 0 for v in rep.time_s.values())
    if model.shape_known:
        f = step_flops(model, plan)
        assert f.hardware_flops_per_step >= f.model_flops_per_step > 0


anything = st.one_of(st.integers(-3, 40), st.text(max_size=4), st.none(), st.booleans(), st.floats(-1, 50))


@SETTINGS
@given(st.dictionaries(st.sampled_from(sorted(Plan.__dataclass_fields__)), anything, max_size=5), models())
def test_invalid_plans_raise_our_error(fields, model):
    try:
        plan = Plan(**fields).validate(model)
        memory(model, plan)
        report(model, plan)
        if model.shape_known:
            step_flops(model, plan)
    except ParallelLabError as e:
        assert str(e)                                        # a message, naming the value and the fix


@SETTINGS
@given(st.sampled_from(sorted(Plan.__dataclass_fields__)), anything)
def test_one_bad_plan_field_raises_our_error(field, value):
    try:
        Plan(**{field: value}).validate(ModelSpec.preset("tiny-llama"))
    except ParallelLabError as e:
        assert str(e)


model_fields = sorted(f for f in ModelSpec.__dataclass_fields__ if f != "name")


@SETTINGS
@given(st.dictionaries(st.sampled_from(model_fields), anything, max_size=3))
def test_invalid_models_raise_our_error(fields):
    kw = {"layers": 2, "hidden": 64, "heads": 4, **fields}
    try:
        m = ModelSpec(**kw)
        memory(m, Plan(seq=16))
    except ParallelLabError as e:
        assert str(e)


flag_values = {
    "--layers": st.sampled_from(["0", "2", "-1", "x"]), "--hidden": st.sampled_from(["64", "63", "0"]),
    "--heads": st.sampled_from(["4", "3", "0"]), "--params": st.sampled_from(["7e9", "1.5", "0"]),
    "--dp": st.sampled_from(["1", "2", "0", "3"]), "--tp": st.sampled_from(["1", "2", "3", "-2"]),
    "--pp": st.sampled_from(["1", "2", "9"]), "--cp": st.sampled_from(["1", "2", "5"]),
    "--zero": st.sampled_from(["0", "3", "5"]), "--seq": st.sampled_from(["128", "0", "7"]),
    "--gpus": st.sampled_from(["4", "6", "0"]), "--model": st.sampled_from(["tiny-llama", "nope"]),
    "--grad-accum": st.sampled_from(["1", "4", "0"]), "--interleave": st.sampled_from(["1", "2"]),
    "--schedule": st.sampled_from(["1f1b", "interleaved", "x"]), "--stage": st.sampled_from(["0", "1", "-1"]),
}


@SETTINGS
@given(st.sampled_from(["memory", "comm", "flops"]),
       st.dictionaries(st.sampled_from(sorted(flag_values)), st.just(None), max_size=6), st.data())
def test_cli_never_tracebacks(command, chosen, data):
    argv = [command]
    for flag in chosen:
        argv += [flag, data.draw(flag_values[flag])]
    # (flops has no --stage: argparse rejects it with exit 2, which is also a clean error)
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = cli.main(argv + ["--json"])
        except SystemExit as e:
            code = e.code
    assert code in (0, 2), (argv, err.getvalue())
    if code == 2:
        assert "error" in err.getvalue()
