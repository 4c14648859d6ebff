"""Diagnosis on the ranks: what a rank was doing, how long it waited, where a NaN first appeared.

The tutorial's sixth failure mode (docs/sources.md) is raising the collective timeout until a stuck job
"works". A timeout only
says that *some* collective waited too long; the useful answer names the rank and what it was doing. Three
instruments, each cheap enough to stay on in every ``parallel-lab run``:

* :class:`ActionLog` hears every call of the tracer (``CommTracer.on_action``) and the step's phases, and
  writes the rank's current action into the launcher's shared memory (``grid.record``). A rank that dies
  is then named with its last action, and a hung rank is told apart from the peers blocked waiting for it:
  they are inside a collective, it is not (``launch._Watch.stuck``). The log also sums the time the rank
  was *blocked* in calls that need its peers, per step: its wait time.
* :func:`step_time_report`: per rank, compute = step time - wait. A straggler computes longer than its
  peers (who wait for it at the next collective): named when its compute is at least
  :data:`STRAGGLER_RATIO` times the median of the others'.
* :class:`FiniteWatch`: a forward hook on every module that raises :class:`NonFiniteError` naming the
  rank, step and module whose output first held a NaN or an inf (one ``isfinite`` per module output: on
  a GPU that is one synchronisation per module, so it is meant for diagnosis runs there).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import Tensor, nn

#: A rank is a straggler when its compute time is at least this many times the median of the other ranks'.
STRAGGLER_RATIO = 1.5
#: ... and longer by at least this many seconds per step (noise on a loaded machine is a few ms).
STRAGGLER_MIN_GAP_S = 0.05


class ActionLog:
    """A rank's current action for the launcher, and the seconds it spent blocked on its peers per step.

    Called as ``log(text, waiting)`` by the tracer (``waiting``: the rank is now blocked in a call that
    needs its peers; the next call with ``waiting=False`` ends the wait). ``record``: ``grid.record`` (or
    None outside the launcher). :meth:`begin_step` starts a step; :attr:`wait_s` lists the blocked
    seconds of every step begun so far.
    """

    def __init__(self, record: Callable[[str, bool], None] | None, clock: Callable[[], float] = time.perf_counter):
        self.record, self.clock = record, clock
        self.step = 0
        self.wait_s: list[float] = []
        self.last_call: str | None = None
        self._since: float | None = None

    def begin_step(self, step: int) -> None:
        self.step = step
        self.wait_s.append(0.0)
        self(f"step {step} begins", False)

    def __call__(self, text: str, waiting: bool) -> None:
        now = self.clock()
        if self._since is not None and self.wait_s:
            self.wait_s[-1] += now - self._since
        self._since = now if waiting else None
        if text.endswith(" phase") and self.last_call:
            text = f"{text} (last call: {self.last_call})"
        elif text.startswith(("in ", "after ", "posted ", "waiting ")):
            self.last_call = text
        if self.record is not None:
            self.record(f"step {self.step}: {text}", waiting)


def step_time_report(step_times: Iterable[Iterable[float]], wait_s: Iterable[Iterable[float]]) -> dict[str, Any]:
    """Per rank (in rank order) its total step, wait and compute seconds, and the straggler if any.

    ``{"ranks": [{"rank", "step_s", "wait_s", "compute_s"}, ...], "straggler": rank or None,
    "ratio": slowest compute / median of the others, "why": one line}``. The first step is left out when
    there are more (it pays for warm-up: allocations, gloo's first connections).
    """
    rows, counted = [], 1
    for r, (steps, waits) in enumerate(zip(step_times, wait_s, strict=True)):
        steps, waits = list(steps), list(waits)
        keep = slice(1, None) if len(steps) > 1 else slice(None)
        counted = max(1, len(steps[keep]))
        s, w = sum(steps[keep]), sum(waits[keep])
        rows.append({"rank": r, "step_s": s, "wait_s": w, "compute_s": max(s - w, 0.0)})
    out: dict[str, Any] = {"ranks": rows, "straggler": None, "ratio": 1.0, "why": "a single rank"}
    if len(rows) < 2:
        return out
    slow = max(rows, key=lambda x: x["compute_s"])
    others = statistics.median(x["compute_s"] for x in rows if x is not slow)
    ratio = slow["compute_s"] / others if others > 0 else float("inf")
    out["ratio"] = ratio if ratio != float("inf") else 1e9
    gap = (slow["compute_s"] - others) / counted
    if ratio >= STRAGGLER_RATIO and gap >= STRAGGLER_MIN_GAP_S:
        out["straggler"] = slow["rank"]
        out["why"] = (f"rank {slow['rank']} is a straggler: it computes {ratio:.1f}x the median of the other "
                      f"ranks ({slow['compute_s']:.2f} s against {others:.2f} s), and they wait for it "
                      f"(largest wait {max(x['wait_s'] for x in rows):.2f} s)")
    else:
        out["why"] = (f"no straggler: the slowest rank ({slow['rank']}) computes {ratio:.2f}x the median of "
                      f"the others (a straggler needs {STRAGGLER_RATIO:g}x and {STRAGGLER_MIN_GAP_S:g} s per step)")
    return out


def format_step_times(report: dict[str, Any]) -> str:
    """The per-rank table of :func:`step_time_report` and its verdict, for ``run``'s summary."""
    lines = ["per-rank time, steps after the first (s)", "rank   compute   wait (blocked on peers)"]
    for x in report["ranks"]:
        mark = "  <- straggler" if x["rank"] == report["straggler"] else ""
        lines.append(f"{x['rank']:>4}  {x['compute_s']:>8.3f}  {x['wait_s']:>8.3f}{mark}")
    lines.append(report["why"])
    return "\n".join(lines)


class NonFiniteError(RuntimeError):
    """A NaN or inf appeared; ``rank``, ``step``, ``module`` (its qualified name) say where first."""

    def __init__(self, rank: int, step: int, module: str, what: str):
        super().__init__(f"non-finite values (NaN or inf) first appeared on rank {rank} at step {step} in {what} "
                         f"of {module}")
        self.rank, self.step, self.module = rank, step, module


def _tensors(x: Any) -> Iterable[Tensor]:
    if isinstance(x, Tensor):
        yield x
    elif isinstance(x, (tuple, list)):
        for y in x:
            yield from _tensors(y)
    elif isinstance(x, dict):
        for y in x.values():
            yield from _tensors(y)


def _finite(x: Any) -> bool:
    # detached: isfinite is composite (abs, ne, ...), and on a tensor that requires grad it would record
    # a graph whose saved inputs the saved-tensor meter would count as activations
    return all(bool(torch.isfinite(t.detach()).all()) for t in _tensors(x) if t.is_floating_point())


class FiniteWatch:
    """Forward hooks on every module of ``model``: the first output with a NaN or inf raises
    :class:`NonFiniteError` (set :attr:`step` each step). Hooks fire when a module finishes, innermost
    first, so the module named is the smallest one whose own output went bad. :meth:`check_loss` catches
    what forward did not see (a NaN born in backward or the optimizer reaches the loss one step later,
    through the parameters, and is then named at the first module that reads them)."""

    def __init__(self, model: nn.Module, rank: int):
        self.rank, self.step = rank, 0
        self._pending: list[tuple[str, torch.Tensor]] = []
        self._handles = [mod.register_forward_hook(self._hook(name or "the model"))
                         for name, mod in model.named_modules()]

    def _hook(self, name: str) -> Callable[..., None]:
        def check(module: nn.Module, args: Any, out: Any) -> None:
            tensors = [t for t in _tensors(out) if t.is_floating_point()]
            if tensors and tensors[0].device.type != "cpu":
                # on an accelerator a check per module would synchronise the stream every module: keep the
                # flags on the device and read them once, at the end of the step (:meth:`check_loss`)
                self._pending += [(name, torch.isfinite(t.detach()).all()) for t in tensors]
            elif not _finite(out):
                raise NonFiniteError(self.rank, self.step, name, "the forward output")
        return check

    def check_loss(self, loss: float) -> None:
        pending, self._pending = self._pending, []
        if pending:
            ok = torch.stack([flag for _, flag in pending]).cpu()        # one synchronisation per step
            if not bool(ok.all()):
                first = int((~ok).nonzero()[0])
                raise NonFiniteError(self.rank, self.step, pending[first][0], "the forward output")
        if loss != loss or loss in (float("inf"), float("-inf")):
            raise NonFiniteError(self.rank, self.step, "the loss", "the value")

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
