"""Fuzzing helpers: random ``parallel-lab`` argument lists and damaged plan files, each call in a fork.

Every case runs in a forked child (so a hang, a crash or a memory blow-up cannot take the test runner
with it) under an address-space cap and a CPU-time alarm. The child reports its exit status, its
stdout and stderr, its wall time and how much its resident memory grew. :func:`check_cli_result`
states the contract of issue 18: exit 0 with valid output (valid JSON under ``--json``), or exit 2
with exactly one line ``parallel-lab CMD: error: ...`` on stderr; never a traceback, never more than
``MAX_S`` seconds or ``MAX_MB`` megabytes.

:func:`hostile_files` makes the file arguments of issue 35 (FIFOs, folders, devices, oversized files, absurd
plans, malformed runs rows, damaged profiles and schedules) that :func:`random_argv` draws when given them; a
plan file that loads must lie within the command line's ranges (:func:`refused_as_flags`).
The test files (``test_fuzz_cli.py``, ``test_fuzz_planfile.py``) draw a few hundred cases with
hypothesis; the full-scale run of the issue's done-when is::

    PYTHONPATH=$PWD python tests/fuzzing.py --cli 10000 --plans 1000
"""

from __future__ import annotations

import argparse
import io
import json
import math
import os
import random
import resource
import signal
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

MAX_S = 2.0           # wall seconds per call
MAX_MB = 500.0        # resident-memory growth per call
_HARD_CAP_MB = 2048   # address-space headroom of a child beyond what it inherited (protects the machine)

#: Values that found bugs before (issue 18) and the usual suspects.
NUMBERS = ["0", "-1", "1", "2", "3", "4", "7", "8", "16", "64", "128", "4096", "1e7", "999999999999",
           "100000001", "1e6", "nan", "inf", "-inf", "1e308", "1e-320", "1e-9", "0.5", "1.5", "7e9",
           "nanM", "infG", "16M", "1K", "abc", "", "-", "1_000", "0x10", "\u0661", "9" * 40]
SANE = ["1", "2", "4", "8", "16", "32", "64", "128", "512", "1024", "4096", "131072", "0.1", "0.25"]
WORDS = ["llama3-8b", "tiny-llama", "llama2-7b", "llama3-405b", "gpt5", "h100-sxm", "cpu-gloo", "1f1b",
         "gpipe", "interleaved", "zb-h1", "ring", "ulysses", "none", "full", "selective", "bf16", "fp32",
         "adam-mixed", "adam-fp32", "tp=0", "micro_batch=0", "tp=8,pp=16", "pp=2", "seq=0", "zz=1", "tp=x",
         "1,2,3", "0,1", ",", "x" * 300]


@dataclass
class Result:
    argv: list[str]
    code: int | None       # exit status (None: killed, see ``signal``)
    out: str
    err: str
    wall_s: float          # CPU seconds of the call (see in_fork)
    grew_mb: float
    signal: int | None = None


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def in_fork(fn: Callable[[], int], timeout_s: float = 3 * MAX_S) -> tuple[int | None, str, str, float, float,
                                                                           int | None]:
    """Run ``fn()`` (returns an exit status) in a forked child; ``(code, out, err, seconds, grew_mb, sig)``.

    ``seconds`` is the child's CPU time (user + system): on a machine shared by several people the wall
    time measures the others' load; a child killed by the alarm reports its wall time."""
    import tempfile

    with tempfile.TemporaryFile() as fo, tempfile.TemporaryFile() as fe, tempfile.TemporaryFile() as fm:
        t0 = time.monotonic()
        pid = os.fork()
        if pid == 0:                                      # the child
            code = 70
            try:
                os.dup2(fo.fileno(), 1)
                os.dup2(fe.fileno(), 2)
                sys.stdout = io.TextIOWrapper(os.fdopen(1, "wb", closefd=False), write_through=True)
                sys.stderr = io.TextIOWrapper(os.fdopen(2, "wb", closefd=False), write_through=True)
                base = _rss_mb()
                vm = _vm_mb()
                ru0 = resource.getrusage(resource.RUSAGE_SELF)
                cpu0 = ru0.ru_utime + ru0.ru_stime
                cap = int((vm + _HARD_CAP_MB) * 2**20)
                resource.setrlimit(resource.RLIMIT_AS, (cap, cap))
                cpu = int(math.ceil(timeout_s))               # CPU seconds: the bound; wall: a backstop
                resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
                signal.signal(signal.SIGALRM, signal.SIG_DFL)  # not pytest-timeout's handler
                signal.alarm(int(20 * timeout_s))
                code = fn()
                sys.stdout.flush()
                sys.stderr.flush()
                ru = resource.getrusage(resource.RUSAGE_SELF)
                os.write(fm.fileno(), f"{max(0.0, ru.ru_maxrss / 1024 - base):.1f} "
                                      f"{ru.ru_utime + ru.ru_stime - cpu0:.3f}".encode())
            except SystemExit as e:
                code = e.code if isinstance(e.code, int) else 1
            except BaseException:                         # the harness's own failure: visible as 70
                import traceback
                traceback.print_exc()
            finally:
                try:
                    sys.stdout.flush()
                    sys.stderr.flush()
                finally:
                    os._exit(code if isinstance(code, int) else 1)
        _, status = os.waitpid(pid, 0)
        wall = time.monotonic() - t0
        fo.seek(0)
        fe.seek(0)
        fm.seek(0)
        grew, cpu = (float(x) for x in (fm.read().decode() or "0 0").split())
        code = os.waitstatus_to_exitcode(status)
        sig = -code if code < 0 else None
        return (None if sig else code, fo.read().decode(errors="replace"), fe.read().decode(errors="replace"),
                wall if sig else cpu, grew, sig)


def _vm_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _stub_run() -> None:
    """In a fuzzing child, ``parallel-lab run`` must never start ranks: stop at the launch."""
    from parallel_lab.distributed.runtime import run as run_mod
    from parallel_lab.errors import ParallelLabError

    def refuse(*a: Any, **k: Any) -> Any:
        raise ParallelLabError("(fuzzing: the run was valid and would start here)")

    run_mod.run = refuse


def run_cli_case(argv: Sequence[str]) -> Result:
    """One CLI call in a fork (``run`` stops where it would start ranks)."""
    from parallel_lab import cli

    def call() -> int:
        if argv and argv[0] == "run":
            _stub_run()
        return cli.main(list(argv))

    code, out, err, wall, grew, sig = in_fork(call)
    return Result(list(argv), code, out, err, wall, grew, sig)


def check_cli_result(r: Result) -> list[str]:
    """The contract; returns the broken clauses (empty: fine)."""
    bad = []
    cmd = r.argv[0] if r.argv else ""
    if r.signal is not None:
        bad.append(f"killed by signal {r.signal}")
    if "Traceback" in r.err or "Traceback" in r.out:
        bad.append("traceback")
    if r.wall_s > MAX_S:
        bad.append(f"took {r.wall_s:.2f} s")
    if r.grew_mb > MAX_MB:
        bad.append(f"grew {r.grew_mb:.0f} MB")
    if r.code == 0:
        if "--json" in r.argv and "--help" not in r.argv and "-h" not in r.argv:
            try:
                json.loads(r.out, parse_constant=_no_constant)
            except ValueError as e:
                bad.append(f"invalid JSON ({e})")
    elif r.code == 2:
        lines = r.err.strip().splitlines()
        if len(lines) != 1:
            bad.append(f"{len(lines)} lines on stderr")
        known = FUZZED
        prefix = f"parallel-lab {cmd}: error:" if cmd in known else "parallel-lab: error:"
        if not r.err.startswith(prefix):
            bad.append("stderr does not start with " + prefix)
        if len(r.err) > 1000:
            bad.append(f"message of {len(r.err)} characters")
    elif r.code is not None:
        bad.append(f"exit {r.code}")
    return bad


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


# --------------------------------------------------------------------------------------------------
# Random argument lists
# --------------------------------------------------------------------------------------------------

def cli_flags() -> dict[str, list[tuple[str, Any]]]:
    """Per subcommand: its option strings and their choices (None: a free value; 0: a store_true flag)."""
    from parallel_lab import cli

    out: dict[str, list[tuple[str, Any]]] = {}
    parser = cli.build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    for name, p in sub.choices.items():
        flags = []
        for a in p._actions:
            if not a.option_strings or a.option_strings[0] in ("-h",):
                continue
            kind: Any = 0 if a.nargs == 0 else (list(a.choices) if a.choices else None)
            flags.append((a.option_strings[-1], kind))
        out[name] = flags
    return out


_BASES = {"memory": [["--model", "llama3-8b"], ["--params", "7e9"], ["--layers", "4", "--hidden", "128",
                                                                       "--heads", "4"]],
          "bubble": [["--schedule", "1f1b", "--stages", "4", "--microbatches", "8"]],
          "plan": [["--model", "llama2-7b", "--gpus", "64", "--seq", "4096", "--global-batch-tokens", "4M"]],
          "run": [[], ["--model", "tiny-llama"]]}
_BASES["comm"] = _BASES["flops"] = _BASES["memory"]
_BASES["launch"] = [["examples/plans/tiny-tp2-sp.yaml"], ["examples/plans/llama3-405b-planner-8k.yaml", "--slurm"]]
_BASES["reshard"] = [["examples/plans/tiny-tp2-sp.yaml", "examples/plans/tiny-dp2-zero3.yaml"]]
#: ``calibrate`` fits a model (seconds for many runs): driven only with :func:`hostile_files`' small runs files
_BASES["calibrate"] = [[]]
#: subcommands the fuzzer drives (``grade`` starts graded submissions in subprocesses: tests/grading covers it)
FUZZED = tuple(sorted(_BASES))
#: file arguments, by the kind of file :func:`hostile_files` gives them
FILE_FLAGS = {"--plan": "plan", "--runs": "runs", "--schedule-file": "schedule", "--cluster": "profile"}
#: flags never drawn: they write files, or time kernels and start ranks (seconds by design)
NEVER = ("--save", "--out", "--measure", "--microbench", "--run")


def random_argv(rng: random.Random, flags: dict[str, list[tuple[str, Any]]],
                files: dict[str, list[str]] | None = None) -> list[str]:
    """A subcommand, often a valid base, then 1-5 random flags with random (often hostile) values; with
    ``files`` (:func:`hostile_files`) the file arguments too, and ``calibrate``."""
    if rng.random() < 0.02:
        return [rng.choice(["", "nosuch", "--help", "-x"])]
    cmd = rng.choice([c for c in sorted(flags) if c in FUZZED and (files or c not in ("calibrate", "reshard"))])
    argv = [cmd] + list(rng.choice(_BASES[cmd])) if rng.random() < 0.8 else [cmd]
    if files and cmd in ("launch", "reshard") and argv[1:] and rng.random() < 0.5:
        argv[rng.randint(1, 2 if cmd == "reshard" else 1)] = rng.choice(files["plan"])
    if files and cmd == "calibrate":
        argv += ["--runs", rng.choice(files["runs"])]
    for _ in range(rng.randint(1, 5)):
        flag, kind = rng.choice(flags[cmd])
        if flag in NEVER or (flag in FILE_FLAGS and not files):
            continue      # without files: the plan-file fuzzer covers them; no writes from here
        argv.append(flag)
        if flag in FILE_FLAGS and files:
            argv.append(rng.choice(files[FILE_FLAGS[flag]] + (["h100-sxm", "cpu-gloo"] if flag == "--cluster" else [])))
            continue
        if kind == 0:
            continue
        if isinstance(kind, list) and rng.random() < 0.7:
            argv.append(str(rng.choice(kind)))
        else:
            r = rng.random()
            argv.append(rng.choice(SANE if r < 0.4 else NUMBERS if r < 0.85 else WORDS))
    if rng.random() < 0.5:
        argv.append("--json")
    return argv


# --------------------------------------------------------------------------------------------------
# Damaged plan files
# --------------------------------------------------------------------------------------------------

def damaged_plan(rng: random.Random, good: bytes) -> bytes:
    """One random damage of a good plan file: truncation, deleted/duplicated lines, flipped bytes, YAML
    bombs, deep nesting, huge numbers, odd types, bad encodings."""
    lines = good.split(b"\n")
    kind = rng.randrange(14)
    if kind >= 12:
        return _absurd(rng, good, kind == 12)
    if kind == 0:
        return good[:rng.randrange(len(good))]
    if kind == 1:
        i = rng.randrange(len(lines))
        return b"\n".join(lines[:i] + lines[i + 1:])
    if kind == 2:
        b = bytearray(good)
        for _ in range(rng.randint(1, 8)):
            b[rng.randrange(len(b))] = rng.randrange(256)
        return bytes(b)
    if kind == 3:
        bomb = b"a: &a [x, x, x, x, x, x, x, x, x]\n" + b"".join(
            f"{chr(98 + i)}: &{chr(98 + i)} [*{chr(97 + i)}, *{chr(97 + i)}, *{chr(97 + i)}, *{chr(97 + i)}, "
            f"*{chr(97 + i)}, *{chr(97 + i)}, *{chr(97 + i)}, *{chr(97 + i)}, *{chr(97 + i)}]\n".encode()
            for i in range(8))
        return good + b"\nbomb:\n  " + bomb.replace(b"\n", b"\n  ")
    if kind == 4:
        depth = rng.choice([50, 200, 1000, 5000])
        return good + b"\nnest: " + b"[" * depth + b"]" * depth + b"\n"
    if kind == 5:
        return good.replace(b"gpus: ", b"gpus: " + b"9" * rng.choice([20, 4300, 5000]) + b"#", 1)
    if kind == 6:
        return good + b"\n\xff\xfe\x80 bad utf-8\n"
    if kind == 7:
        keys = [b"seq", b"tp", b"dp", b"micro_batch", b"bubble_ratio", b"fits", b"schema_version", b"value",
                b"field", b"gpus", b"phase", b"total"]
        key = rng.choice(keys)
        val = rng.choice([b"0", b"-1", b"1.0", b".nan", b".inf", b"'8'", b"[]", b"{}", b"null", b"true",
                          b"1e400", b"!!binary aGk=", b"!!python/object:os.system x"])
        return b"\n".join(_replace_value(line, key, val) for line in lines)
    if kind == 8:
        i, j = rng.randrange(len(lines)), rng.randrange(len(lines))
        lines[i], lines[j] = lines[j], lines[i]
        return b"\n".join(lines)
    if kind == 9:
        return rng.choice([b"", b"\n", b"[]", b"null", b"42", b"plan: [", b"\t", b"---\n---\n", b"\x00" * 10,
                           good + b"\n---\n" + good])
    if kind == 10:
        return good + b"\n" + b"x: " + b"y" * rng.choice([10, 2_000_000]) + b"\n"
    i = rng.randrange(len(lines))
    return b"\n".join(lines[:i] + [lines[i]] + lines[i:])


#: values for a field of a model or cluster mapping: in range, at the edge, past it, of the wrong type
ODD = [1, 2, 4, 64, 512, 513, 2**16, 2**16 + 1, 2**17 + 1, 10**6, 10**15, 0, -1, 2.5, 1e300, "'8'", "true",
       ".nan", ".inf", "null", "[1]"]


def _absurd(rng: random.Random, good: bytes, model: bool) -> bytes:
    """The good file with its model (or cluster) written as a mapping, one or two fields set to odd values."""
    if model:
        fields = {"layers": 4, "hidden": 128, "heads": 4, "kv_heads": 2, "ffn": 344, "vocab": 512,
                  "flavour": "llama", "name": "tiny-llama"}
        odd = ["layers", "hidden", "heads", "kv_heads", "ffn", "vocab", "experts", "top_k", "expert_ffn",
               "shared_experts", "max_positions", "capacity_factor", "name", "tied_embeddings"]
    else:
        fields = {"name": "cpu-gloo", "gpus_per_node": 2, "hbm_bytes": 12884901888, "peak_flops": 2e10,
                  "intra": "{name: loopback, bandwidth: 1.4e9, latency: 0.0005}",
                  "inter": "{name: loopback-remote, bandwidth: 1.0e9, latency: 0.001}", "mfu_achievable": 0.5}
        odd = ["gpus_per_node", "hbm_bytes", "peak_flops", "mfu_achievable", "name", "intra", "profile"]
    for key in rng.sample(odd, rng.randint(1, 2)):
        fields[key] = rng.choice(ODD + (["{bandwidth: 1e300}", "{half_width: 1e300}", '"x\\ny"']))
    text = "{" + ", ".join(f"{k}: {v}" for k, v in fields.items()) + "}"
    line = b"model: tiny-llama" if model else b"cluster: cpu-gloo"
    return good.replace(line, line.split(b":")[0] + b": " + text.encode(), 1)


def _replace_value(line: bytes, key: bytes, val: bytes) -> bytes:
    stripped = line.lstrip(b" -")
    if stripped.startswith(key + b":"):
        return line[:len(line) - len(stripped)] + key + b": " + val
    return line


def load_case(path: str) -> Result:
    """``load_plan(path)`` in a fork: exit 0 loaded, 2 refused with one ParallelLabError line."""
    from parallel_lab.errors import ParallelLabError
    from parallel_lab.planfile import load_plan

    def call() -> int:
        try:
            pf = load_plan(path)
        except ParallelLabError as e:
            print(f"parallel-lab run: error: {e}", file=sys.stderr)
            return 2
        over = refused_as_flags(pf)
        if over:              # would start ranks from a plan the command line refuses: exit 3 breaks the contract
            print(f"loaded, but the flags would refuse {over}", file=sys.stderr)
            return 3
        return 0

    code, out, err, wall, grew, sig = in_fork(call)
    return Result(["run", "--plan", path], code, out, err, wall, grew, sig)


def refused_as_flags(pf: Any) -> list[str]:
    """The fields of a loaded plan file outside the command line's ranges (``LIMITS``; ``experts`` 0: dense)."""
    from dataclasses import asdict

    from parallel_lab.inputs import LIMITS

    values = {**asdict(pf.model), **pf.plan.to_dict(), "gpus": pf.gpus}
    return [f"{k}={v}" for k, v in values.items() if k in LIMITS and isinstance(v, int)
            and not (k == "experts" and v == 0) and not LIMITS[k][0] <= v <= LIMITS[k][1]]


def hostile_files(d: str | Path) -> dict[str, list[str]]:
    """File arguments, by kind, made in the folder ``d``: good ones, FIFOs, folders, devices, missing, oversized,
    truncated, absurd plans, malformed runs rows and damaged profiles (issue 35)."""
    d = Path(d)
    good = good_plan_bytes()
    out: dict[str, list[str]] = {}
    for kind, suffix in (("plan", ".yaml"), ("runs", ".csv"), ("schedule", ".csv"), ("profile", ".json")):
        special = [d / f"{kind}-fifo{suffix}", d / f"{kind}-dir{suffix}"]
        if not special[0].exists():
            os.mkfifo(special[0])
            special[1].mkdir()
        (d / f"{kind}-big{suffix}").write_bytes(b"#" * (5 * 2**20))
        out[kind] = [str(p) for p in special] + [str(d / f"{kind}-big{suffix}"), str(d / f"no-such{suffix}"),
                                                  "/dev/zero", "/dev/null", ""]
    rng = random.Random(35)
    for i in range(12):
        (d / f"plan-{i}.yaml").write_bytes(good if i == 0 else _absurd(rng, good, i % 2 == 0))
        out["plan"].append(str(d / f"plan-{i}.yaml"))
    head = "name,model,gpus,dp,tp,seq,micro_batch,grad_accum,tflops_per_gpu\n"
    runs = ["a,llama3-8b,8,8,1,8192,1,4,400\n", "a,llama3-8b,8,8,1,8192,1,4,abc\n", "a,llama3-8b,8,x,1,8192,1,4,1\n",
            "a,llama3-8b,8,8,1,8192,1,4,400,9\n", "a,llama3-8b,8,8,1,99999999999,1,4,400\n",
            "a,gpt5,8,8,1,8192,1,4,1\n", "a,llama3-8b,8,8,1,8192,1,4,-1\n", "a,llama3-8b,8,8,1,8192,1,4,nan\n",
            "a,llama3-8b,16,8,1,8192,1,4,1\n"]
    for i, row in enumerate(runs):
        (d / f"runs-{i}.csv").write_text(head + row)
        out["runs"].append(str(d / f"runs-{i}.csv"))
    for i, text in enumerate(["runs: [1, 2]", "- {1: 2}", "- {model: llama3-8b, tflops_per_gpu: [1]}", "a: &a [1]",
                              "- {model: llama3-8b, step_time_s: 0}", "[" * 5000]):
        (d / f"runs-y{i}.yaml").write_text(text + "\n")
        out["runs"].append(str(d / f"runs-y{i}.yaml"))
    for i, text in enumerate(['{"cluster": "h100-sxm", "profile": {}}', '{"cluster": "h100-sxm", "profile": []}',
                              '{"cluster": "h100-sxm", "profile": {"half_width": 1e999}}', "[" * 100_000, "{",
                              '{"cluster": "h100-sxm", "profile": {}, "intra": {"bandwidth": -1}}']):
        (d / f"profile-{i}.json").write_text(text)
        out["profile"].append(str(d / f"profile-{i}.json"))
    for i, text in enumerate(["0F0,0B0\n", "0F0,1B0\n1F0\n", "0F0,0X1\n", "\x00", ",,,\n" * 1000]):
        (d / f"schedule-{i}.csv").write_text(text)
        out["schedule"].append(str(d / f"schedule-{i}.csv"))
    return out


def good_plan_bytes() -> bytes:
    return (Path(__file__).resolve().parents[1] / "examples" / "plans" / "tiny-pp2-1f1b.yaml").read_bytes()


# --------------------------------------------------------------------------------------------------
# The full-scale run
# --------------------------------------------------------------------------------------------------

def main(argv: list[str] | None = None) -> int:
    import tempfile

    ap = argparse.ArgumentParser(description="fuzz the CLI and the plan-file loader (issue 18)")
    ap.add_argument("--cli", type=int, default=10_000)
    ap.add_argument("--plans", type=int, default=1_000)
    ap.add_argument("--seed", type=int, default=18)
    args = ap.parse_args(argv)
    import parallel_lab.cli  # noqa: F401  (imported once here, before the forks)
    import parallel_lab.distributed.runtime.run  # noqa: F401
    import parallel_lab.planfile  # noqa: F401
    import parallel_lab.planner  # noqa: F401

    rng = random.Random(args.seed)
    flags = cli_flags()
    tally: dict[str, int] = {}
    failures: list[tuple[list[str], list[str], str]] = []
    worst = [0.0, 0.0]
    slow = 0
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory() as fdir:
        files = hostile_files(fdir)
        for i in range(args.cli):
            if i and i % 1000 == 0:
                print(f"  {i} argument lists, {len(failures)} failures, {time.monotonic() - t0:.0f} s", flush=True)
            r = run_cli_case(random_argv(rng, flags, files))
            worst = [max(worst[0], r.wall_s), max(worst[1], r.grew_mb)]
            slow += r.wall_s > MAX_S
            tally[f"exit {r.code}"] = tally.get(f"exit {r.code}", 0) + 1
            bad = check_cli_result(r)
            if bad:
                failures.append((r.argv, bad, r.err[-300:]))
    print(f"CLI: {args.cli} argument lists (file arguments included): {tally}; {tally.get('exit 70', 0)} internal "
          f"errors, {slow} over {MAX_S:g} s; slowest {worst[0]:.2f} s, most memory {worst[1]:.0f} MB; "
          f"{len(failures)} broke the contract")
    good = good_plan_bytes()
    ptally: dict[str, int] = {}
    pworst = [0.0, 0.0]
    with tempfile.TemporaryDirectory() as d:
        for i in range(args.plans):
            path = os.path.join(d, f"p{i}.yaml")
            Path(path).write_bytes(damaged_plan(rng, good))
            r = load_case(path)
            pworst = [max(pworst[0], r.wall_s), max(pworst[1], r.grew_mb)]
            ptally[f"exit {r.code}"] = ptally.get(f"exit {r.code}", 0) + 1
            bad = check_cli_result(r)
            if bad:
                failures.append((r.argv, bad, r.err[-300:]))
            os.unlink(path)
    print(f"plan files: {args.plans} damaged files: {ptally}; slowest {pworst[0]:.2f} s, most memory "
          f"{pworst[1]:.0f} MB; {sum(1 for f in failures if f[0][:2] == ['run', '--plan'])} broke the contract")
    for argv_, bad, err in failures[:40]:
        print("FAIL", argv_, bad, err.strip().splitlines()[-1:] if err.strip() else "")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
