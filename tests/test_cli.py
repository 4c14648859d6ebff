"""The `parallel-lab` command line: seed figures end to end, flags, errors, and the subcommand registry."""

from __future__ import annotations

import json

import pytest
from conftest import run_cli

from parallel_lab import cli, plan_flags
from parallel_lab.cli import comm as comm_cmd
from parallel_lab.specs import RUN_DEFAULTS

SEED_SHAPE = ["--layers", "32", "--hidden", "4096", "--heads", "32", "--seq", "4096", "--micro-batch", "1"]


def state_gb(j: dict) -> float:
    d = j["per_gpu_bytes"]
    return (d["parameters"] + d["gradients"] + d["optimizer_states"]) / 1e9


# ---- seed figures through a fresh interpreter (`python -m parallel_lab ... --json`) -------------------

@pytest.mark.parametrize("params,row", [("7e9", (112.0, 38.5, 26.25, 14.0)),
                                        ("13e9", (208.0, 71.5, 48.75, 26.0)),
                                        ("70e9", (1120.0, 385.0, 262.5, 140.0))])
def test_seed_state_table_cli(cli_json, params, row):
    for zero, want in enumerate(row):
        assert state_gb(cli_json("memory", "--params", params, "--dp", "8", "--zero", str(zero))) == want


def test_seed_sgd_momentum_cli(cli_json):
    """Seed: SGD with momentum keeps 12 bytes per parameter (fp32 weights, gradients, momentum)."""
    assert state_gb(cli_json("memory", "--params", "7e9", "--dp", "8", "--optimizer", "sgd-momentum")) == 84.0


# the seed prints 104.13 GB for "none": an arithmetic slip; its own formula gives 104,152,956,928 bytes
@pytest.mark.parametrize("recompute,want_bytes,gb", [("none", 104_152_956_928, 104.15),
                                                     ("selective", 18_253_611_008, 18.25),
                                                     ("full", 1_073_741_824, 1.07)])
def test_seed_activations_cli(cli_json, recompute, want_bytes, gb):
    j = cli_json("memory", *SEED_SHAPE, "--recompute", recompute)
    assert j["per_gpu_bytes"]["activations"] == want_bytes
    assert round(j["per_gpu_bytes"]["activations"] / 1e9, 2) == gb
    assert {"per_gpu_bytes", "total_bytes", "hbm_bytes", "fits"} <= set(j)


def test_seed_tp_bytes_cli(cli_json):
    j = cli_json("comm", *SEED_SHAPE, "--tp", "8")
    assert j["per_step_bytes"]["tp"] == 7_516_192_768
    assert {"per_step_bytes", "collectives", "time_s"} <= set(j)
    c = j["collectives"][0]
    assert {"dim", "kind", "message_bytes", "group_size", "count", "phase", "note", "wire_bytes"} <= set(c)


def test_flops_cli(cli_json):
    j = cli_json("flops", "--model", "llama3-405b", "--seq", "8192", "--gpus", "16384", "--tp", "8",
                 "--pp", "16", "--grad-accum", "16", "--step-time", "6.72")
    assert j["plan"]["dp"] == 128
    assert j["model_flops_per_step"] == pytest.approx(4.4047e19, rel=1e-4)
    assert j["hardware_flops_per_step"] == j["model_flops_per_step"]
    assert 0.40 < j["mfu"] < 0.41                          # ~400 TFLOP/s per GPU of 989


# ---- flags and errors (in-process: fast) --------------------------------------------------------------

def run_main(capsys, *argv: str) -> tuple[int, str, str]:
    try:
        code = cli.main(list(argv))
    except SystemExit as e:                                # argparse's own usage errors
        code = e.code
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize("argv,words", [
    (["memory", "--model", "llama2-7b", "--layers", "3"], ["--model llama2-7b", "--layers"]),
    (["memory", "--params", "7e9", "--tp", "2"], ["parameter count", "--params"]),
    (["memory", "--params", "7e9", "--layers", "2"], ["--params", "--layers"]),
    (["memory", "--model", "llama2-7b", "--gpus", "8", "--dp", "2", "--tp", "2"], ["gpus=8"]),
    (["memory", "--model", "llama2-7b", "--gpus", "10", "--tp", "4"], ["--gpus 10", "tp*pp*cp = 4"]),
    (["memory", "--layers", "4", "--hidden", "64"], ["--heads"]),
    (["memory"], ["no model given"]),
    (["comm", "--model", "llama2-7b", "--tp", "3"], ["tp=3", "pick tp in"]),
    (["memory", "--model", "gpt5"], ["gpt5", "pick one of"]),
    (["memory", "--model", "tiny-llama", "--cluster", "tpu-v9"], ["tpu-v9"]),
    (["memory", "--model", "tiny-llama", "--zero", "2"], ["zero=2", "dp"]),
    (["memory", "--model", "tiny-llama", "--seq", "128", "--stage", "1"], ["stage=1"]),
    (["flops", "--params", "7e9"], ["shape"]),
])
def test_contradictions_are_clear_errors(capsys, argv, words):
    code, out, err = run_main(capsys, *argv)
    assert code == 2 and out == ""
    assert err.startswith(f"parallel-lab {argv[0]}: error:") and "Traceback" not in err
    for w in words:
        assert w in err


@pytest.mark.parametrize("argv", [["memory", "--params", "7.5"], ["memory", "--params", "abc"],
                                  ["memory", "--model", "tiny-llama", "--recompute", "some"], ["nosuch"],
                                  ["memory", "--model", "tiny-llama", "--bogus"]])
def test_bad_flag_values_exit_2(capsys, argv):
    code, _, err = run_main(capsys, *argv)
    assert code == 2 and "error" in err and "Traceback" not in err


def test_error_in_fresh_process_has_no_traceback():
    p = run_cli("memory", "--params", "7e9", "--tp", "2")
    assert p.returncode == 2 and "Traceback" not in p.stderr and p.stdout == ""


def test_gpus_infers_dp_and_defaults(capsys):
    code, out, _ = run_main(capsys, "memory", "--model", "tiny-llama", "--seq", "128", "--gpus", "8",
                            "--tp", "2", "--json")
    plan = json.loads(out)["plan"]
    assert code == 0 and (plan["dp"], plan["tp"], plan["pp"], plan["cp"]) == (4, 2, 1, 1)
    code, out, _ = run_main(capsys, "memory", "--layers", "2", "--hidden", "64", "--heads", "4", "--json")
    j = json.loads(out)
    # gpt defaults: ffn 4h, vocab 32000 (untied), 2048 positions; a block has 12 h^2 + 13 h parameters
    h = 64
    assert j["model"]["n_params"] == 2 * (12 * h * h + 13 * h) + 2 * 32000 * h + 2048 * h + 2 * h


def test_readable_table(capsys):
    code, out, _ = run_main(capsys, "memory", "--model", "llama2-7b", "--seq", "4096", "--tp", "2",
                            "--dp", "4")
    assert code == 0
    assert "optimizer_states" in out and " GB (" in out and "GiB)" in out and "does NOT fit" in out
    code, out, _ = run_main(capsys, "comm", "--model", "llama2-7b", "--seq", "4096", "--tp", "2", "--dp", "4")
    assert code == 0 and "all_reduce" in out and "ms" in out


def test_per_op_flag(capsys):
    code, out, err = run_main(capsys, "memory", "--model", "tiny-llama", "--seq", "128", "--activation-model",
                              "per-op", "--json")
    assert code == 0 or "per-op" in err


def test_every_subcommand_has_json():
    parser = cli.build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    for name, p in sub.choices.items():
        assert any("--json" in a.option_strings for a in p._actions), name


def test_a_subcommand_is_one_small_edit(capsys, monkeypatch):
    """The structure other subcommands (bubble, plan, run) plug into: a registrar plus a handler."""
    def _hello(args):
        model = plan_flags.model_from_args(args)
        return plan_flags.Output({"layers": model.layers, "dp": plan_flags.plan_from_args(args, model).dp}, "hello")

    def _add_hello(sub):
        p = plan_flags.subcommand(sub, "hello", _hello, "a test subcommand")
        plan_flags.add_model_args(p)
        plan_flags.add_plan_args(p)

    monkeypatch.setattr(cli, "SUBCOMMANDS", [*cli.SUBCOMMANDS, _add_hello])
    code, out, _ = run_main(capsys, "hello", "--model", "tiny-llama", "--gpus", "2", "--json")
    assert code == 0 and json.loads(out) == {"layers": 4, "dp": 2}
    code, out, _ = run_main(capsys, "hello", "--model", "tiny-llama")
    assert code == 0 and out.strip() == "hello"


# ---- issue 18: every bad input one line and exit 2, bounded work, valid JSON ----------------------------

SEED_7B = ["--model", "llama2-7b", "--gpus", "64", "--seq", "4096", "--global-batch-tokens", "4M"]
BUBBLE = ["bubble", "--schedule", "1f1b", "--stages", "4", "--microbatches", "8"]


def one_line_error(capsys, *argv: str) -> str:
    code, out, err = run_main(capsys, *argv)
    assert code == 2 and out == "", (code, out, err)
    assert err.startswith(f"parallel-lab {argv[0]}: error:") and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1 and len(err) <= cli.MAX_MESSAGE + 100
    return err


@pytest.mark.parametrize("argv,words", [
    (["memory", "--model", "llama3-8b", "--gpus", "8", "--tp", "0"], ["--tp", "'0'", "[1,"]),
    (["memory", "--model", "llama3-8b", "--pp", "0"], ["--pp", "'0'"]),
    (["memory", "--model", "llama3-8b", "--cp", "0"], ["--cp", "'0'"]),
    (["plan", *SEED_7B, "--fix", "tp=0"], ["--fix tp=0", "outside"]),
    (["plan", *SEED_7B, "--fix", "micro_batch=0"], ["micro_batch=0"]),
    (["plan", "--model", "llama2-7b", "--gpus", "64", "--seq", "0", "--global-batch-tokens", "4M"], ["--seq"]),
    ([*BUBBLE, "--w", "nan"], ["--w", "'nan'", "finite"]),
    ([*BUBBLE, "--p2p", "inf"], ["--p2p", "finite"]),
    ([*BUBBLE, "--p2p", "nan", "--json"], ["--p2p"]),
    ([*BUBBLE, "--f", "1e308"], ["--f"]),
    ([*BUBBLE, "--width", "0"], ["--width"]),
    (["plan", "--model", "llama2-7b", "--gpus", "64", "--seq", "4096", "--global-batch-tokens", "nanM"],
     ["nanM", "token count"]),
    (["plan", "--model", "llama2-7b", "--gpus", "64", "--seq", "4096", "--global-batch-tokens", "infG"], ["infG"]),
    (["memory", "--layers", "999999999999", "--hidden", "128", "--heads", "4"], ["--layers", "outside"]),
    (["memory", "--layers", "1e6", "--hidden", "128", "--heads", "4"], ["--layers"]),
    (["comm", "--model", "llama3-8b", "--dp", "1e7"], ["--dp"]),
    (["plan", "--model", "llama2-7b", "--gpus", "999999999999", "--seq", "4096", "--global-batch", "8"],
     ["--gpus"]),
    (["memory", "--hidden", "100000001", "--layers", "2", "--heads", "3"], ["--hidden"]),
    (["flops", "--model", "llama3-8b", "--step-time", "1e-9"], ["--step-time 1e-09", "peak", "MFU > 100%"]),
    (["flops", "--model", "llama3-8b", "--step-time", "1e-320", "--json"], ["--step-time", "peak"]),
    (["memory", "--model", "x" * 5000], ["pick one of"]),
])
def test_bad_values_are_one_line_errors(capsys, argv, words):
    err = one_line_error(capsys, *argv)
    for w in words:
        assert w in err


def test_divisor_suggestions_are_short_and_fast(capsys):
    """ffn = 2^24 - 1 has 96 divisors: the message suggests only the tp that also split heads and kv heads, at
    once (was a hang listing every divisor); a long list of suggestions shows its ends and the count."""
    from parallel_lab.errors import divisors, fmt_set

    err = one_line_error(capsys, "memory", "--layers", "2", "--hidden", "128", "--heads", "8", "--ffn",
                         "16777215", "--tp", "8")
    assert "tp=8 does not divide ffn=16777215; pick tp in {1}" in err and len(err) < 200
    shown = fmt_set(divisors(16777215))
    assert "(96 values)" in shown and ", ..., " in shown and len(shown) < 120


def test_bubble_beyond_the_simulator_uses_the_closed_form(capsys):
    import time

    t0 = time.perf_counter()
    code, out, _ = run_main(capsys, "bubble", "--schedule", "1f1b", "--stages", "4096", "--microbatches", "8192",
                            "--json")
    assert code == 0 and time.perf_counter() - t0 < 1.0
    j = json.loads(out)
    assert j["bubble_ratio"] == 4095 / 8192 and j["simulated"] is False
    err = one_line_error(capsys, "bubble", "--schedule", "1f1b", "--stages", "4096", "--microbatches", "8192",
                         "--p2p", "0.1")
    assert "no closed form" in err
    # every schedule with an expression answers from it (simulate.bubble_closed_form, the one home)
    code, out, _ = run_main(capsys, "bubble", "--schedule", "zb-v", "--stages", "64", "--microbatches", "128",
                            "--json")
    assert code == 0 and json.loads(out)["bubble_ratio"] == max(63, 4 * 64 - 2 * 128 - 2) / (6 * 128)
    err = one_line_error(capsys, "bubble", "--schedule", "zb-v", "--stages", "64", "--microbatches", "128",
                         "--w", "2")
    assert "zb-v with these costs has no closed form" in err


def test_unwritable_save_targets_are_one_line_errors(capsys, tmp_path):
    base = ["plan", "--model", "tiny-llama", "--cluster", "cpu-gloo", "--gpus", "2", "--seq", "128",
            "--global-batch", "8"]
    assert "it is a directory" in one_line_error(capsys, *base, "--save", str(tmp_path))
    assert "does not exist" in one_line_error(capsys, *base, "--save", str(tmp_path / "no" / "p.yaml"))
    code, _, _ = run_main(capsys, *base, "--save", str(tmp_path / "p.yaml"))
    assert code == 0 and (tmp_path / "p.yaml").read_text().startswith("# parallel_lab plan file")
    assert [p.name for p in tmp_path.iterdir()] == ["p.yaml"]          # no temporary file left behind


def test_json_output_never_has_nan_or_infinity(capsys, monkeypatch):
    """A non-finite number reaching the JSON printer is a bug: one line and exit 70, never 'NaN' on stdout."""
    from parallel_lab import ledger

    real = ledger.memory

    def poisoned(*a, **k):
        led = real(*a, **k)
        led.per_gpu_bytes["parameters"] = float("nan")
        return led

    monkeypatch.setattr(ledger, "memory", poisoned)
    code, out, err = run_main(capsys, "memory", "--model", "tiny-llama", "--json")
    assert code == cli.EXIT_INTERNAL and out == "" and "internal error" in err and len(err.splitlines()) == 1


def test_interrupt_and_internal_errors_are_one_line(capsys, monkeypatch):
    def interrupted(args):
        raise KeyboardInterrupt

    def broken(args):
        raise TypeError("a bug")

    for handler, code_wanted, words in ((interrupted, 130, "interrupted"), (broken, cli.EXIT_INTERNAL, "a bug")):
        monkeypatch.setattr(comm_cmd, "handle", handler)
        code, out, err = run_main(capsys, "comm", "--model", "tiny-llama")
        assert code == code_wanted and out == "" and words in err and "Traceback" not in err


def test_argparse_errors_are_one_line(capsys):
    for argv in (["memory", "--bogus"], ["memory", "--tp"], ["nosuch"], ["bubble", "--schedule", "1f1b"]):
        code, out, err = run_main(capsys, *argv)
        assert code == 2 and out == "" and len(err.strip().splitlines()) == 1, err
        assert err.startswith("parallel-lab") and ": error:" in err


# ---- run: refused before any process starts -------------------------------------------------------------

@pytest.fixture
def no_launch(monkeypatch):
    """Fail the test if `run` would start a process."""
    from parallel_lab.distributed.runtime import run as run_mod

    def refuse(*a, **k):
        raise AssertionError("a process was started")

    monkeypatch.setattr(run_mod, "launch", refuse)


def test_issue_11_tied_embeddings_with_pp_is_refused_before_start(capsys, no_launch):
    err = one_line_error(capsys, "run", "--layers", "4", "--hidden", "128", "--heads", "4", "--vocab", "512",
                         "--flavour", "llama", "--tied-embeddings", "--pp", "2", "--grad-accum", "2")
    assert "tied embeddings" in err and "pp=1" in err


def test_run_refuses_a_plan_that_does_not_fit_this_machine(capsys, no_launch, monkeypatch):
    err = one_line_error(capsys, "run", "--model", "llama3-8b", "--dp", "2")
    assert "available" in err and "3 x" in err and "GB" in err
    err = one_line_error(capsys, "run", "--plan", "examples/plans/llama3-405b-planner-8k.yaml",
                         "--optimizer", "adam-fp32", "--dtype", "fp32", "--zero", "0")
    assert "16,384 ranks" in err and "per core" in err
    monkeypatch.setattr(plan_flags, "available_memory_bytes", lambda: 10**6)       # a machine with 1 MB free
    err = one_line_error(capsys, "run", "--dp", "2")
    assert "this host has 1.00 MB (0.95 MiB) available" in err


def test_run_plan_empty_path_is_refused(capsys, no_launch):
    assert "no path given" in one_line_error(capsys, "run", "--plan", "")


def test_run_help_shows_the_run_defaults(capsys):
    code, out, _ = run_main(capsys, "run", "--help")
    assert code == 0
    flat = " ".join(out.split())
    for words in ("(default for run: 128)", "(default for run: 4)", "(default for run: adam-fp32)",
                  "(default for run: fp32)", "progress timeout", "--time-limit"):
        assert words in flat, words
    assert RUN_DEFAULTS == {"seq": 128, "micro_batch": 4, "dtype": "fp32", "optimizer": "adam-fp32"}


@pytest.mark.parametrize("flag,value", [("--recompute", "128"), ("--recompute", "١"), ("--zero-stages", "131072"),
                                        ("--schedules", "nosuch")])
def test_plan_refuses_unknown_search_options_in_one_line(capsys, flag, value):
    """Found by the full-scale fuzzer: unknown values of the search lists were a KeyError deep in the planner."""
    err = one_line_error(capsys, "plan", "--model", "llama2-7b", "--gpus", "64", "--seq", "4096",
                         "--global-batch-tokens", "4M", flag, value)
    assert "pick from" in err


@pytest.mark.parametrize("command", [["run", "--dp", "2"], ["compare", "dp=2", "dp=1,grad_accum=2"]])
def test_runs_refuse_the_formula_activation_model_they_cannot_measure(command, capsys):
    """run and compare check what the ranks save against the per-op model; Korthikanti's formulas are memory's."""
    from parallel_lab.cli import main

    assert main([*command, "--steps", "1", "--activation-model", "korthikanti"]) == 2
    err = capsys.readouterr().err
    assert "--activation-model korthikanti" in err and "parallel-lab memory --activation-model korthikanti" in err
    with pytest.raises(SystemExit):
        main([command[0], "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert f"(default for {command[0]}: 128)" in out and "per-op model only" in out
