"""What the planner may choose: :class:`Constraints` (the options tried and the fixed Plan fields), and
the parsing of ``--fix`` and of a global batch given in tokens (``16M`` = ``16 * 2**20`` tokens, the
batch Llama 3 used: 2048 sequences of 8192).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field, fields
from typing import Any

from .engines import DEFAULT_ENGINE, ENGINES, TORCHTITAN
from .errors import ParallelLabError
from .specs import CP_KINDS, RECOMPUTE, SCHEDULES, ZERO2_ACCUMULATES

#: Plan fields a constraint may fix (``--fix tp=8,pp=16``).
FIXABLE = ("dp", "tp", "pp", "cp", "zero", "sp", "micro_batch", "grad_accum", "recompute", "schedule",
           "interleave", "cp_kind", "ep")


def shorten_list(values: Iterable[Any], n: int = 4) -> str:
    """``['128', 'x']``, at most ``n`` values, each cut to 20 characters (error messages stay short)."""
    vals = [str(v)[:20] for v in values]
    return repr(vals[:n] + (["..."] if len(vals) > n else []))


def parse_tokens(text: str | int) -> int:
    """``"16M"`` -> ``16 * 2**20`` tokens (K, M, G are powers of 2**10, as Llama 3's "16M tokens");
    a plain number is taken as is (``"16777216"``, ``"1.6e7"``)."""
    if isinstance(text, int):
        return text
    t = str(text).strip().upper()
    mult = {"K": 2**10, "M": 2**20, "G": 2**30}
    try:
        if t and t[-1] in mult:
            value = float(t[:-1]) * mult[t[-1]]
        else:
            value = float(t)
    except ValueError:
        raise ParallelLabError(f"global batch {text!r} is not a token count; e.g. 16M (= 16*2^20 tokens) "
                               "or 16777216") from None
    if value < 1 or value != int(value):
        raise ParallelLabError(f"global batch {text!r} must be a whole positive number of tokens")
    return int(value)


def global_batch_sequences(seq: int, global_batch: int | None = None,
                           global_batch_tokens: int | str | None = None) -> int:
    """Sequences per optimizer step from either a count of sequences or of tokens (exactly one)."""
    if (global_batch is None) == (global_batch_tokens is None):
        raise ParallelLabError("give the global batch either in sequences (global_batch=2048) or in tokens "
                               "(global_batch_tokens='16M'), not both and not neither")
    if global_batch is not None:
        if isinstance(global_batch, bool) or not isinstance(global_batch, int) or global_batch < 1:
            raise ParallelLabError(f"global_batch={global_batch!r} must be a positive number of sequences")
        return global_batch
    tokens = parse_tokens(global_batch_tokens)  # type: ignore[arg-type]
    if tokens % seq:
        raise ParallelLabError(f"global batch of {tokens:,} tokens is not a whole number of sequences of "
                               f"seq={seq}; pick a multiple of {seq}")
    return tokens // seq


@dataclass(frozen=True)
class Constraints:
    """What the planner may choose. ``fixed`` pins Plan fields (e.g. ``{"tp": 8, "pp": 16}``); the other
    fields list the options tried. ``max_tp`` defaults to the GPUs of one node.

    GPipe is left out of the default schedules: in this model it has 1F1B's bubble and traffic and holds
    ``m >= min(m, p)`` micro-batches, so it never beats its 1F1B twin. Add it to ``schedules`` (or fix
    ``schedule="gpipe"``) to see it ranked."""

    fixed: dict[str, Any] = field(default_factory=dict)
    max_tp: int | None = None
    zero_stages: tuple[int, ...] = (0, 1, 2, 3)
    recompute: tuple[str, ...] = ("none", "selective", "full")
    schedules: tuple[str, ...] = ("1f1b", "interleaved", "zb-h1")
    sp: tuple[bool, ...] = (False, True)
    cp_kind: str = "ring"
    optimizer: str = "adam-mixed"
    dtype: str = "bf16"
    margin: float = 0.1
    max_micro_batch: int | None = None
    attention: str = "eager"
    mlp: str = "eager"
    pp_split: str = "layers"
    #: ZeRO-2's gradient accumulation variants tried (``Plan.zero2_accumulate``): hold the full gradients
    #: until the last micro-batch ("unsharded"), or reduce-scatter every micro-batch ("sharded", FSDP's)
    zero2_accumulate: tuple[str, ...] = ("unsharded",)
    #: ``lab`` (every choice the ledger models) or ``torchtitan`` (only what its trainer runs: engines.py)
    engine: str = DEFAULT_ENGINE

    def __post_init__(self) -> None:
        unknown = sorted(set(self.fixed) - set(FIXABLE))
        if unknown:
            raise ParallelLabError(f"cannot fix {unknown}; fixable fields: {', '.join(FIXABLE)}")
        if self.cp_kind not in CP_KINDS:
            raise ParallelLabError(f"cp_kind={self.cp_kind!r}; pick one of {', '.join(CP_KINDS)}")
        if not 0 <= self.margin < 1:
            raise ParallelLabError(f"margin={self.margin} must be a fraction in [0, 1); e.g. 0.1")
        for name, values, known in (("recompute", self.recompute, RECOMPUTE), ("schedules", self.schedules, SCHEDULES),
                                    ("zero_stages", self.zero_stages, (0, 1, 2, 3)),
                                    ("zero2_accumulate", self.zero2_accumulate, ZERO2_ACCUMULATES)):
            bad = [v for v in values if v not in known]
            if bad or not values:
                raise ParallelLabError(f"{name}={shorten_list(bad or values)} is not known; pick from "
                                       f"{', '.join(map(str, known))}")
        if self.engine not in ENGINES:
            raise ParallelLabError(f"engine={str(self.engine)[:40]!r} is not known; pick one of {', '.join(ENGINES)}")
        if self.engine == "torchtitan":
            self._for_torchtitan()

    def _for_torchtitan(self) -> None:
        """Keep only what torchtitan runs: the lab's defaults narrowed to it, an explicit choice outside it
        refused, and torchtitan's own storage (fsdp2-mixed, flash attention, all-gather CP) where the lab's
        default was left."""
        t, defaults = TORCHTITAN, {f.name: f.default for f in fields(Constraints)}
        for name, fixed, allowed in (("schedules", "schedule", t.schedules), ("zero_stages", "zero", t.zero_stages),
                                     ("recompute", "recompute", t.recompute)):
            values = getattr(self, name)
            if values == defaults[name]:
                values = tuple(v for v in values if v in allowed) + \
                    (("op-sac",) if name == "recompute" and "selective" in values else ())
                object.__setattr__(self, name, tuple(dict.fromkeys(values)))
            bad = [v for v in (*getattr(self, name), *([self.fixed[fixed]] if fixed in self.fixed else []))
                   if v not in allowed]
            if bad:
                raise ParallelLabError(f"{fixed}={bad[0]} is not something torchtitan runs (--engine torchtitan); "
                                       f"pick from {', '.join(map(str, allowed))}, or plan with --engine lab")
        cp_kind = self.fixed.get("cp_kind", self.cp_kind)
        if cp_kind not in t.cp_kinds and cp_kind != defaults["cp_kind"]:
            raise ParallelLabError(f"cp_kind={cp_kind} is not something torchtitan runs (--engine torchtitan): its "
                                   f"context parallelism all-gathers K and V; use --cp-kind allgather")
        object.__setattr__(self, "cp_kind", t.cp_kinds[0])
        if "cp_kind" in self.fixed:
            self.fixed["cp_kind"] = t.cp_kinds[0]
        if self.optimizer == defaults["optimizer"] and self.dtype != "fp32":
            object.__setattr__(self, "optimizer", t.optimizer)
        if self.attention == defaults["attention"]:
            object.__setattr__(self, "attention", t.attention)

    def options(self, name: str, default: Iterable[Any]) -> list[Any]:
        return [self.fixed[name]] if name in self.fixed else list(default)


def parse_fix(text: str | None) -> dict[str, Any]:
    """``"tp=8,pp=16,schedule=interleaved"`` -> ``{"tp": 8, "pp": 16, "schedule": "interleaved"}``."""
    out: dict[str, Any] = {}
    if not text:
        return out
    for part in text.split(","):
        if "=" not in part:
            raise ParallelLabError(f"--fix entry {part!r} is not NAME=VALUE; e.g. --fix tp=8,pp=16")
        k, v = (s.strip() for s in part.split("=", 1))
        k = k.replace("-", "_")
        if k not in FIXABLE:
            raise ParallelLabError(f"--fix {k}: not a fixable field; pick from {', '.join(FIXABLE)}")
        if k in ("recompute", "schedule", "cp_kind"):
            out[k] = v
        elif k == "sp":
            out[k] = v.lower() in ("1", "true", "yes", "on")
        else:
            try:
                out[k] = int(v)
            except ValueError:
                raise ParallelLabError(f"--fix {k}={v!r} must be an integer") from None
    return out
