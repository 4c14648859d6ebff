"""The `parallel-lab` command line: seed figures end to end, flags, errors, and the subcommand registry."""

from __future__ import annotations

import json

import pytest
from conftest import run_cli

from parallel_lab import cli

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
        model = cli.model_from_args(args)
        return cli.Output({"layers": model.layers, "dp": cli.plan_from_args(args, model).dp}, "hello")

    def _add_hello(sub):
        p = cli.subcommand(sub, "hello", _hello, "a test subcommand")
        cli.add_model_args(p)
        cli.add_plan_args(p)

    monkeypatch.setattr(cli, "SUBCOMMANDS", [*cli.SUBCOMMANDS, _add_hello])
    code, out, _ = run_main(capsys, "hello", "--model", "tiny-llama", "--gpus", "2", "--json")
    assert code == 0 and json.loads(out) == {"layers": 4, "dp": 2}
    code, out, _ = run_main(capsys, "hello", "--model", "tiny-llama")
    assert code == 0 and out.strip() == "hello"
