"""The analytic core's speed: import time of ``parallel_lab`` and one ledger + comm evaluation.

Import time is measured in fresh interpreters (median of several), next to the interpreter's own
start-up and to ``import torch`` for scale; an evaluation is ``ledger.memory`` + ``comm.report`` of a
Llama 3 70B plan, the work one widget update does.
"""

from __future__ import annotations

import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _fresh_import_seconds(module: str, runs: int) -> list[float]:
    code = f"import time; t = time.perf_counter(); import {module}; print(time.perf_counter() - t)"
    out = []
    for _ in range(runs):
        p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                           timeout=120)
        if p.returncode:
            raise RuntimeError(f"import {module} failed: {p.stderr.strip()[-300:]}")
        out.append(float(p.stdout))
    return out


def _startup_seconds(runs: int) -> list[float]:
    out = []
    for _ in range(runs):
        t = time.perf_counter()
        subprocess.run([sys.executable, "-c", "pass"], check=True, cwd=ROOT)
        out.append(time.perf_counter() - t)
    return out


def main() -> None:
    runs = 7
    startup = statistics.median(_startup_seconds(runs))
    core = _fresh_import_seconds("parallel_lab", runs)
    print(f"python start-up (median of {runs}):            {startup * 1e3:8.1f} ms")
    print(f"import parallel_lab (median of {runs}):        {statistics.median(core) * 1e3:8.1f} ms "
          f"(min {min(core) * 1e3:.1f}, max {max(core) * 1e3:.1f}; the test's limit is 300 ms)")
    try:
        torch = statistics.median(_fresh_import_seconds("torch", 3))
        print(f"import torch (median of 3), for scale:        {torch * 1e3:8.1f} ms "
              f"({torch / statistics.median(core):.0f}x parallel_lab)")
    except RuntimeError as e:
        print(f"import torch: not available ({e})")

    from parallel_lab.comm import report
    from parallel_lab.ledger import memory
    from parallel_lab.specs import ModelSpec, Plan

    model = ModelSpec.preset("llama3-70b")
    plan = Plan(dp=8, tp=8, pp=4, grad_accum=16, seq=8192, zero=1, sp=True)
    n = 20
    t = time.perf_counter()
    for _ in range(n):
        memory(model, plan)
        report(model, plan)
    each = (time.perf_counter() - t) / n
    print(f"ledger.memory + comm.report, llama3-70b dp8 tp8 pp4: {each * 1e3:8.1f} ms per evaluation "
          f"(mean of {n}; every pipeline stage is evaluated to find the fullest/busiest)")
