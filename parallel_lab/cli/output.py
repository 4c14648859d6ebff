"""What the subcommands print: aligned tables, the model and plan they computed, and the report of a run that
failed after it started (with its exit status).

Messages are bounded (:data:`MAX_MESSAGE` characters; a long value is shown truncated). A run that fails
after it started prints a short report (which rank, what it was doing, how it ended, where its log is) and
exits with :data:`EXIT_RUN_FAILED` (a rank died or raised) or :data:`EXIT_RUN_TIMEOUT` (no progress, or over
the wall-clock limit).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

from ..errors import ParallelLabError
from ..specs import ModelSpec, Plan

PROG = "parallel-lab"
EXIT_RUN_FAILED = 3     #: ``run``: a rank raised, died (signal, OOM killer) or could not start
EXIT_RUN_TIMEOUT = 4    #: ``run``: no step completed within --timeout, or over --time-limit
MAX_MESSAGE = 600       #: characters of one error line


class RunFailed(Exception):
    """A run that started and then failed: ``report`` (a few lines for the user) and the exit ``code``."""

    def __init__(self, report: str, code: int):
        super().__init__(report)
        self.report, self.code = report, code


def bounded(message: str, n: int = MAX_MESSAGE) -> str:
    """One line of at most ``n`` characters; a word over 60 characters (a pasted value) is cut to 40."""
    one = " ".join(w if len(w) <= 60 else w[:40] + "..." for w in str(message).split())
    return one if len(one) <= n else one[:n - 3] + "..."


def table(rows: Sequence[Sequence[Any]], header: Sequence[str] | None = None,
          left: Sequence[int] = (0,)) -> str:
    """A plain aligned text table: columns ``left`` left-aligned (default the first), the others right."""
    all_rows = [list(map(str, r)) for r in ([header] if header else []) + list(rows)]
    if not all_rows:
        return ""
    widths = [max(len(r[i]) for r in all_rows if i < len(r)) for i in range(max(map(len, all_rows)))]
    lines = []
    for k, r in enumerate(all_rows):
        cells = [c.ljust(widths[i]) if i in left else c.rjust(widths[i]) for i, c in enumerate(r)]
        lines.append("  ".join(cells).rstrip())
        if header and k == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def echo(model: ModelSpec, plan: Plan) -> dict[str, Any]:
    """The ``model`` and ``plan`` keys every JSON answer carries (what was actually computed)."""
    return {"model": {"name": model.name, "n_params": model.n_params, "shape_known": model.shape_known},
            "plan": plan.to_dict()}


def describe(model: ModelSpec, plan: Plan) -> str:
    """The model and plan lines a table starts with (what was actually computed)."""
    p = plan
    return (f"{model.summary()}\nplan: dp={p.dp} tp={p.tp} pp={p.pp} cp={p.cp}"
            + (f" ep={p.ep}" if p.ep > 1 else "") + f" zero={p.zero} sp={p.sp} "
            f"seq={p.seq} micro_batch={p.micro_batch} grad_accum={p.grad_accum} recompute={p.recompute} "
            f"optimizer={p.optimizer} dtype={p.dtype} schedule={p.schedule}"
            + (f" interleave={p.interleave}" if p.interleave > 1 else "")
            + f" attention={p.attention} mlp={p.mlp}" + f" ({p.world} GPUs)")


def rank_failed(e: Any, steps: int) -> Exception:
    """The short report of a rank that raised or died (or a one-line error when the rank found bad input)."""
    if e.exc_type == "ParallelLabError":
        return ParallelLabError(f"rank {e.rank}: {e.last_line.split(':', 1)[-1].strip()}")
    done = "before its first step" if not e.step else f"after step {e.step} of {steps}"
    if e.signal is not None:
        how = f"was killed by signal {e.signal}" + (" (SIGKILL: kill -9 or the out-of-memory killer)"
                                                    if e.signal == 9 else "")
    elif e.exc_type is None:
        how = e.last_line.replace("process ", "", 1)
    else:
        line = re.sub(rf"^[\w.]*\.{re.escape(e.exc_type)}:", f"{e.exc_type}:", e.last_line)   # drop the module path
        how = f"raised {bounded(line, 300)}"
    log = (f"its traceback: {e.log}" if e.log else
           "it left no traceback (its own output, if any, is above)")
    doing = f"\n  its last action: {e.last_action}" if getattr(e, "last_action", None) else ""
    return RunFailed(f"\n{PROG} run: failed: rank {e.rank} {how} {done}; the other ranks were stopped{doing}\n"
                     f"  {log}", EXIT_RUN_FAILED)
