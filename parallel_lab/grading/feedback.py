"""Inline feedback on a learner's number: right, or how far off and which term was missed.

``check(answer, expected)`` compares a prediction with the library's value and returns a :class:`Feedback`
that is truthy only when the answer is within tolerance. A wrong answer is diagnosed, in this order:

1. a *missed term*: ``answer = total - (t_i + t_j + ...)`` for some of the named terms (every subset of up
   to 10 terms is tried; the smallest subset that explains the answer wins);
2. a *doubled term*: ``answer = total + t_i``;
3. a *unit slip*: ``answer / total`` is one of 10^3, 10^6, 10^9, 2^10, 2^20, 2^30, 10^9 / 2^30 (GB read as
   GiB), 8 (bits for bytes), 2 (a dtype or a ring factor), or the inverse of one of them;
4. otherwise the signed relative error, ``(answer - total) / total``.

Tolerance: ``|answer - total| <= max(atol, rtol * |total|)`` with ``rtol = 0.01`` unless stated. The same
tolerance decides whether a candidate diagnosis matches. Nothing here imports torch.
"""

from __future__ import annotations

import hashlib
import itertools
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

DEFAULT_RTOL = 0.01
MAX_TERMS_FOR_SUBSETS = 10

#: ``ratio -> what it usually means`` (answer / expected).
UNIT_SLIPS: dict[float, str] = {
    1e3: "a factor 1,000 (kB vs B, or ms vs s?)",
    1e6: "a factor 10^6 (MB vs B?)",
    1e9: "a factor 10^9 (GB vs B?)",
    2.0**10: "a factor 1,024 (KiB vs B?)",
    2.0**20: "a factor 2^20 (MiB vs B?)",
    2.0**30: "a factor 2^30 (GiB vs B?)",
    1e9 / 2**30: "GB vs GiB (10^9 vs 2^30 bytes)",
    8.0: "a factor 8 (bits vs bytes?)",
    2.0: "a factor 2 (bytes per element, or the 2 (n-1)/n of a ring all-reduce?)",
}


def _close(a: float, b: float, rtol: float, atol: float) -> bool:
    return abs(a - b) <= max(atol, rtol * abs(b))


def _fmt(x: float, unit: str) -> str:
    if unit == "B":
        for scale, name in ((1e12, "TB"), (1e9, "GB"), (1e6, "MB"), (1e3, "kB")):
            if abs(x) >= scale:
                return f"{x / scale:,.3f} {name} ({x:,.0f} B)"
        return f"{x:,.0f} B"
    if isinstance(x, int) or (abs(x) >= 1000 and float(x).is_integer()):
        return f"{x:,.0f}{' ' + unit if unit else ''}"
    return f"{x:.6g}{' ' + unit if unit else ''}"


def _tolerance(rtol: float, atol: float, unit: str) -> str:
    """``0.01``, ``±0.5 GB`` or ``0.01 or ±0.5 GB``: the tolerance that was applied (the larger one wins)."""
    parts = ([f"{rtol:.2g}"] if rtol else []) + ([f"±{_fmt(atol, unit)}"] if atol else [])
    return " or ".join(parts) or "0 (exact)"


def _pct(rel: float) -> str:
    """``+12.5%``, or two significant digits when small (``-0.0040%``), never a bare ``-0.0%``."""
    if rel == 0 or abs(rel) >= 0.001:
        return f"{rel:+.1%}"
    return f"{rel * 100:+.2g}%"


@dataclass(frozen=True)
class Feedback:
    """The verdict on one answer. ``bool(fb)`` is ``fb.correct``; printing it shows ``fb.message``."""

    correct: bool
    message: str
    answer: Any = None
    expected: Any = None
    relative_error: float | None = None
    missed: tuple[str, ...] = ()
    doubled: tuple[str, ...] = ()
    wrong_terms: tuple[str, ...] = ()
    details: tuple[Feedback, ...] = field(default=())

    def __bool__(self) -> bool:
        return self.correct

    def __str__(self) -> str:
        return self.message

    def __repr__(self) -> str:
        return self.message

    def _repr_markdown_(self) -> str:
        mark = "✅" if self.correct else "❌"
        return f"{mark} {self.message}".replace("\n", "  \n")


def _no_answer(name: str) -> Feedback:
    return Feedback(False, f"{name}: no answer yet; replace the ... (or None) with your number and run the cell "
                           "again")


def _as_number(name: str, value: Any) -> float | Feedback:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        try:
            return float(value)
        except (TypeError, ValueError):
            return Feedback(False, f"{name}: {value!r} is not a number; give a number such as 1.5e9",
                            answer=value)
    if isinstance(value, float) and not math.isfinite(value):
        return Feedback(False, f"{name}: {value!r} is not a finite number", answer=value)
    return value


def _diagnose(x: float, total: float, terms: Mapping[str, float], rtol: float, atol: float,
              unit: str) -> tuple[str, tuple[str, ...], tuple[str, ...]]:
    names = [k for k, v in terms.items() if v]
    if 0 < len(names) <= MAX_TERMS_FOR_SUBSETS:
        for r in range(1, len(names)):
            hits = [sub for sub in itertools.combinations(names, r)
                    if _close(x, total - sum(terms[k] for k in sub), rtol, atol)]
            if hits:
                whats = [", ".join(f"{k} ({_fmt(terms[k], unit)})" for k in sub) for sub in hits]
                if len(hits) == 1:
                    return f"your total leaves out {whats[0]}", hits[0], ()
                if len(hits) > 3:
                    return (f"your total is short by {_fmt(total - x, unit)}, as much as several combinations of "
                            f"terms (e.g. {whats[0]}, or {whats[1]})", (), ())
                return (f"your total leaves out one of: {' or '.join(whats)} (they are equal here)",
                        tuple(sorted({k for sub in hits for k in sub})), ())
        for k in names:
            if _close(x, total + terms[k], rtol, atol):
                return f"you counted {k} ({_fmt(terms[k], unit)}) twice", (), (k,)
    if total and x:
        ratio = x / total
        for r, why in UNIT_SLIPS.items():
            if unit != "B":                     # the hints in brackets are about bytes
                if not why.startswith("a factor"):
                    if unit:
                        continue                # GB vs GiB is a slip of bytes: not of %, s or a count
                else:
                    why = why.split(" (")[0]
            for rr in (r, 1 / r):
                if _close(ratio, rr, rtol, 0.0):
                    return f"it is {why} {'larger' if rr > 1 else 'smaller'} than expected", (), ()
    return "", (), ()


def check(answer: Any, expected: float | Mapping[str, float], *, rtol: float = DEFAULT_RTOL, atol: float = 0.0,
          terms: Mapping[str, float] | None = None, name: str = "your answer", unit: str = "") -> Feedback:
    """Compare ``answer`` with ``expected``; return a :class:`Feedback` (truthy when right).

    ``expected``: a number, or a mapping ``{term: value}`` whose values add up to the expected total.
    ``answer``: a number (compared with the total; a wrong one is diagnosed against the terms), or a mapping
    with the same keys (each term checked on its own). ``terms``: the named parts of a numeric ``expected``
    (used only for the diagnosis). ``rtol``/``atol``: the tolerance, stated in the exercise. ``name``: what
    the answer is, used in the message. ``unit``: ``"B"`` prints bytes as kB/MB/GB; any other string is
    appended to numbers.
    """
    if answer is None or answer is Ellipsis:
        return _no_answer(name)
    if isinstance(expected, Mapping):
        parts = {str(k): float(v) for k, v in expected.items()}
        total = sum(parts.values())
        if isinstance(answer, Mapping):
            return _check_terms(answer, parts, rtol, atol, name, unit)
    else:
        total = float(expected)
        parts = {str(k): float(v) for k, v in (terms or {}).items()}
    x = _as_number(name, answer)
    if isinstance(x, Feedback):
        return x
    rel = (x - total) / total if total else (math.inf if x else 0.0)
    if _close(x, total, rtol, atol):
        return Feedback(True, f"{name}: right, {_fmt(x, unit)} (expected {_fmt(total, unit)}, "
                              f"{_pct(rel)}; tolerance {_tolerance(rtol, atol, unit)})", answer, expected, rel)
    why, missed, doubled = _diagnose(x, total, parts, rtol, atol, unit)
    off = _pct(rel) if math.isfinite(rel) else "expected 0"
    msg = f"{name}: not yet, {_fmt(x, unit)} vs expected {_fmt(total, unit)} ({off})"
    if why:
        msg += f"; {why}"
    elif parts:
        msg += "; the expected value is the sum of " + ", ".join(f"{k} {_fmt(v, unit)}" for k, v in parts.items())
    return Feedback(False, msg, answer, expected, rel, missed, doubled)


def _check_terms(answer: Mapping[str, Any], parts: dict[str, float], rtol: float, atol: float, name: str,
                 unit: str) -> Feedback:
    missing = [k for k in parts if k not in answer]
    unknown = [str(k) for k in answer if str(k) not in parts]
    details = tuple(check(answer[k], v, rtol=rtol, atol=atol, name=k, unit=unit) for k, v in parts.items()
                    if k in answer)
    wrong = tuple(d.message.split(":")[0] for d in details if not d.correct)
    ok = not missing and not unknown and not wrong
    lines = [f"{name}: {'right, every term' if ok else 'not yet'}"]
    if missing:
        lines.append(f"missing term(s): {', '.join(missing)}")
    if unknown:
        lines.append(f"unknown term(s): {', '.join(unknown)}; expected terms are {', '.join(parts)}")
    lines += [("  " if d.correct else "  ") + d.message for d in details]
    return Feedback(ok, "\n".join(lines), dict(answer), parts, None, tuple(missing), (), wrong, details)


# --------------------------------------------------------------------------------------------------
# Salted hashes: check a number without shipping it
# --------------------------------------------------------------------------------------------------

def canonical(value: float, sig: int = 4) -> str:
    """``value`` rounded to ``sig`` significant digits, as text (the form that is hashed)."""
    return f"{float(value):.{sig - 1}e}"


def answer_hash(value: float, salt: str, sig: int = 4) -> str:
    """The salted SHA-256 of ``value`` rounded to ``sig`` significant digits (hex)."""
    return hashlib.sha256(f"{salt}:{canonical(value, sig)}".encode()).hexdigest()


def check_hash(answer: Any, digest: str, salt: str, *, sig: int = 4, name: str = "your answer") -> Feedback:
    """Right when ``answer`` rounds (``sig`` significant digits) to the value behind ``digest``.

    A hash says only right or wrong: it cannot say how far off an answer is. Round your answer the way the
    exercise says (4 significant digits unless stated); a hidden test gives the full diagnosis.
    """
    if answer is None or answer is Ellipsis:
        return _no_answer(name)
    x = _as_number(name, answer)
    if isinstance(x, Feedback):
        return x
    if answer_hash(x, salt, sig) == digest:
        return Feedback(True, f"{name}: right ({canonical(x, sig)})", answer)
    return Feedback(False, f"{name}: not yet ({canonical(x, sig)} at {sig} significant digits does not match); "
                           "recheck each term, or run the exercise's hidden tests for a diagnosis", answer)


def learner_params(learner: str, salt: str, choices: Mapping[str, list[Any]]) -> dict[str, Any]:
    """Per-learner parameters: for each key, one of its ``choices`` picked by a salted hash of ``learner``.

    The same learner id and salt always give the same parameters (deterministic grading).
    """
    out = {}
    for key, options in choices.items():
        h = int(hashlib.sha256(f"{salt}:{learner}:{key}".encode()).hexdigest(), 16)
        out[key] = options[h % len(options)]
    return out
