"""Inline feedback on a learner's answer: right, or a hint first and the expected value on the second try.

``check(answer, expected)`` returns a :class:`Feedback`, truthy only when the answer is within tolerance. A
wrong answer first gets a **hint** that does not give the expected value away: which term is missing or
doubled, which unit slip it looks like, or which direction (too high / too low) and how far. A second wrong
try of the same question in the same kernel (or ``reveal=True``) shows the expected value and the full
diagnosis: a *missed term* (every subset of up to 10 terms is tried), a *doubled term*, a *unit slip*
(10^3, 10^6, 10^9, 2^10, 2^20, 2^30, GB vs GiB, bits vs bytes, a factor 2) or the signed relative error. A
question may name its own likely mistakes, ``slips={answer / expected: hint}`` (the bubble ratio given for
the idle fraction, the forward pass's 2 N D for 6 N D): they come first, and their words replace the
generic ones.

Tolerance ``|answer - total| <= max(atol, rtol * |total|)``; by default an estimate (a float ``expected``)
passes within 5% and a count (an ``int``) must be exact. An answer may be a string with a size unit
("112 GB", "104 GiB", "7.5e9 B"): it is converted when the question's ``unit`` is bytes or a size (B, kB, MB,
GB, TB, KiB, MiB, GiB, TiB), and explained otherwise. A string ``expected`` is a category: right or not,
never a percentage. Nothing here imports torch.
"""

from __future__ import annotations

import hashlib
import itertools
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

ESTIMATE_RTOL = 0.05
DEFAULT_RTOL = ESTIMATE_RTOL        # kept for callers that import it: the tolerance of an estimate
MAX_TERMS_FOR_SUBSETS = 10
SLIP_RTOL = 0.01                    # a unit slip is named only when the ratio is this close (GB/GiB is 7% apart)
SCIENTIFIC_FROM = 1e15              # numbers this large are written 1.27e+25, not digit by digit

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

#: Bytes per size unit, for answers written with a unit and for questions asked in one.
SIZE_UNITS: dict[str, float] = {"b": 1.0, "kb": 1e3, "mb": 1e6, "gb": 1e9, "tb": 1e12,
                                "kib": 2.0**10, "mib": 2.0**20, "gib": 2.0**30, "tib": 2.0**40}
_WITH_UNIT = re.compile(r"^\s*([-+]?[\d,]*\.?\d+(?:[eE][-+]?\d+)?)\s*([A-Za-z%]*)\s*$")

#: Wrong tries so far per question (name and expected value) in this kernel: the second one reveals.
_WRONG_TRIES: dict[tuple[str, str], int] = {}


def reset_tries() -> None:
    """Forget the wrong tries counted so far (a fresh kernel's state)."""
    _WRONG_TRIES.clear()


def _close(a: float, b: float, rtol: float, atol: float) -> bool:
    return abs(a - b) <= max(atol, rtol * abs(b))


def _is_size(unit: str) -> bool:
    return unit.strip().lower() in SIZE_UNITS


def _fmt(x: float, unit: str) -> str:
    unit = unit.strip()
    if unit == "B":
        for scale, name in ((1e12, "TB"), (1e9, "GB"), (1e6, "MB"), (1e3, "kB")):
            if abs(x) >= scale:
                whole = f"{x:,.0f}" if abs(x) < SCIENTIFIC_FROM else f"{float(x):.6g}"
                return f"{x / scale:,.3f} {name} ({whole} B)"
        return f"{x:,.0f} B"
    if abs(x) >= SCIENTIFIC_FROM:                   # 1.27e+25, not 12,700,000,000,000,000,914,358,272
        return f"{float(x):.6g}{' ' + unit if unit else ''}"
    if isinstance(x, int) or (abs(x) >= 1000 and float(x).is_integer()):
        return f"{x:,.0f}{' ' + unit if unit else ''}"
    return f"{x:.6g}{' ' + unit if unit else ''}"


def _tolerance(rtol: float, atol: float, unit: str) -> str:
    """``5%``, ``±0.5 GB`` or ``5% or ±0.5 GB``: the tolerance that was applied (the larger one wins)."""
    parts = ([f"{rtol:.2g}" if rtol < 0.01 else f"{rtol:.0%}"] if rtol else []) \
        + ([f"±{_fmt(atol, unit)}"] if atol else [])
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
    revealed: bool = True

    def __bool__(self) -> bool:
        return self.correct

    def __str__(self) -> str:
        return self.message

    def __repr__(self) -> str:
        return self.message

    def _repr_markdown_(self) -> str:
        mark = "[right]" if self.correct else "[not yet]"
        return f"**{mark}** {self.message}".replace("\n", "  \n")


def _no_answer(name: str) -> Feedback:
    return Feedback(False, f"{name}: no answer yet; replace the ... (or None) with your number and run the cell "
                           "again")


def _example(unit: str) -> str:
    unit = unit.strip()
    if unit == "B":
        return "a number of bytes such as 1.5e9, or a size with its unit such as '1.5 GB'"
    if _is_size(unit):
        return f"a number of {unit} such as 1.5, or a size with its unit such as '1.5 {unit}'"
    return f"a plain number{' of ' + unit if unit else ''} such as 1.5"


def _as_number(name: str, value: Any, unit: str = "") -> float | Feedback:
    """``value`` as a number in the question's ``unit``; a string with a unit is converted or explained."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        m = _WITH_UNIT.match(value) if isinstance(value, str) else None
        if m is None:
            try:
                return float(value)
            except (TypeError, ValueError):
                return Feedback(False, f"{name}: {value!r} is not a number; give {_example(unit)}", answer=value)
        x, given = float(m.group(1).replace(",", "")), m.group(2)
        want = unit.strip()
        if not given or given.lower() == want.lower():
            return x
        if given.lower() in SIZE_UNITS and _is_size(want):
            return x * SIZE_UNITS[given.lower()] / SIZE_UNITS[want.lower()]
        asked = f"in {want}" if want else "as a plain number (no unit)"
        return Feedback(False, f"{name}: {value!r} carries the unit {given!r}, but this question is asked {asked}; "
                               f"give {_example(unit)}", answer=value)
    if isinstance(value, float) and not math.isfinite(value):
        return Feedback(False, f"{name}: {value!r} is not a finite number", answer=value)
    return value


def _slip_text(why: str, unit: str) -> str | None:
    """The unit slip's words for a question in ``unit`` (None: not a slip of that kind of quantity)."""
    if unit == "B" or _is_size(unit):
        return why if unit == "B" or not why.startswith("a factor") or "bits" in why else why.split(" (")[0]
    if not why.startswith("a factor"):
        return None if unit else why                # GB vs GiB is a slip of bytes: not of %, s or a count
    return why.split(" (")[0]


def _own_slip(x: float, total: float, slips: Mapping[float, str], rtol: float, atol: float) -> str:
    """The question's own words for a likely mistake: ``slips`` maps ``answer / expected`` to the hint. The
    answer matches a slip when it is within the question's tolerance of ``ratio x expected``."""
    for ratio, why in slips.items():
        if _close(x, float(ratio) * total, max(rtol, 1e-9), atol):
            return why
    return ""


def _diagnose(x: float, total: float, terms: Mapping[str, float], rtol: float, atol: float, unit: str,
              reveal: bool, slips: Mapping[float, str] | None = None) -> tuple[str, tuple[str, ...], tuple[str, ...]]:
    if slips and (own := _own_slip(x, total, slips, rtol, atol)):
        return own, (), ()
    val = (lambda k: f" ({_fmt(terms[k], unit)})") if reveal else (lambda k: "")
    names = [k for k, v in terms.items() if v]
    if 0 < len(names) <= MAX_TERMS_FOR_SUBSETS:
        for r in range(1, len(names)):
            hits = [sub for sub in itertools.combinations(names, r)
                    if _close(x, total - sum(terms[k] for k in sub), rtol, atol)]
            if hits:
                whats = [", ".join(f"{k}{val(k)}" for k in sub) for sub in hits]
                if len(hits) == 1:
                    return f"your total leaves out {whats[0]}", hits[0], ()
                if len(hits) > 3:
                    short = f" by {_fmt(total - x, unit)}" if reveal else ""
                    return (f"your total is short{short}, as much as several combinations of terms (e.g. "
                            f"{whats[0]}, or {whats[1]})", (), ())
                return (f"your total leaves out one of: {' or '.join(whats)} (they are equal here)",
                        tuple(sorted({k for sub in hits for k in sub})), ())
        for k in names:
            if _close(x, total + terms[k], rtol, atol):
                return f"you counted {k}{val(k)} twice", (), (k,)
    if total and x:
        ratio = x / total
        for r, why in UNIT_SLIPS.items():
            text = _slip_text(why, unit.strip())
            if text is None:
                continue
            for rr in (r, 1 / r):
                if _close(ratio, rr, min(rtol, SLIP_RTOL), 0.0):
                    return f"it is {text} {'larger' if rr > 1 else 'smaller'} than expected", (), ()
    return "", (), ()


def _direction(x: float, total: float) -> str:
    """Too high or too low, and roughly how far, without the expected value."""
    if total == 0:
        return "it should be 0"
    ratio = x / total
    side = "high" if x > total else "low"
    if x == 0:                                  # 0 for 1 is too low, not a wrong sign
        return f"too {side} (it should not be 0)"
    if ratio <= 0:
        return f"the sign is wrong (it should be {'positive' if total > 0 else 'negative'})"
    if 0.8 <= ratio <= 1.25:
        return f"close, but too {side} (within 25%)"
    if 0.5 <= ratio <= 2:
        return f"too {side} (by less than a factor 2)"
    return f"far too {side} (off by more than a factor 2)"


def _first_try(name: str, expected: Any, reveal: bool | None) -> bool:
    """Count a wrong try of this question; True when its expected value is to be shown."""
    key = (name, repr(expected))
    tries = _WRONG_TRIES.get(key, 0)
    _WRONG_TRIES[key] = tries + 1
    return bool(reveal) or (reveal is None and tries >= 1)


_AGAIN = "; try again (a second wrong try, or check(..., reveal=True), shows the expected value)"


def check(answer: Any, expected: Any, *, rtol: float | None = None, atol: float = 0.0,
          terms: Mapping[str, float] | None = None, name: str = "your answer", unit: str = "",
          reveal: bool | None = None, slips: Mapping[float, str] | None = None) -> Feedback:
    """Compare ``answer`` with ``expected``; return a :class:`Feedback` (truthy when right).

    ``expected``: a number, a mapping ``{term: value}`` whose values add up to the expected total, or a string
    (a category). ``answer``: a number or a string with a unit (compared with the total; a wrong one is
    diagnosed against the terms), or a mapping with the same keys (each term checked on its own). ``terms``:
    the named parts of a numeric ``expected``. ``rtol``: default 5% for an estimate, 0 for a count (an
    ``int`` expected); ``atol`` absolute. ``name``: the question, in the message and as the key of its tries.
    ``unit``: ``"B"`` prints bytes as kB/MB/GB; another size unit (``"GB"``) converts answers given with a
    unit; any other string is appended to numbers. ``reveal``: ``True`` shows the expected value at once,
    ``False`` never, ``None`` (default) from the second wrong try of this question in this kernel.
    ``slips``: the question's own likely mistakes, ``{answer / expected: hint}`` (``{2.0: "both halves of the
    moments? rank 0 reads only rank 1's half"}``); an answer within tolerance of ``ratio x expected`` gets that
    hint, before the terms and the generic unit slips (whose factor-2 words it overrides). Name the mistake,
    not the value: the hint is shown at the first wrong try.
    """
    if answer is None or answer is Ellipsis:
        return _no_answer(name)
    if isinstance(expected, str):
        return _check_category(answer, expected, name, reveal)
    if isinstance(expected, Mapping):
        parts = {str(k): float(v) for k, v in expected.items()}
        exact = all(isinstance(v, int) and not isinstance(v, bool) for v in expected.values())
    else:
        parts = {str(k): float(v) for k, v in (terms or {}).items()}
        exact = isinstance(expected, int) and not isinstance(expected, bool)
    rtol = (0.0 if exact else ESTIMATE_RTOL) if rtol is None else rtol
    total = sum(parts.values()) if isinstance(expected, Mapping) else float(expected)
    if isinstance(expected, Mapping) and isinstance(answer, Mapping):
        return _check_terms(answer, parts, rtol, atol, name, unit, reveal)
    x = _as_number(name, answer, unit)
    if isinstance(x, Feedback):
        return x
    rel = (x - total) / total if total else (math.inf if x else 0.0)
    if _close(x, total, rtol, atol):
        return Feedback(True, f"{name}: right, {_fmt(x, unit)} (expected {_fmt(total, unit)}, "
                              f"{_pct(rel)}; tolerance {_tolerance(rtol, atol, unit)})", answer, expected, rel)
    show = _first_try(name, expected, reveal)
    why, missed, doubled = _diagnose(x, total, parts, rtol, atol, unit, show, slips)
    if not show:
        msg = f"{name}: not yet, {_fmt(x, unit)}: {why or _direction(x, total)}"
        if not why and parts:
            msg += "; the expected value is the sum of " + ", ".join(parts)
        msg += f" (tolerance {_tolerance(rtol, atol, unit)})" + _AGAIN
        return Feedback(False, msg, answer, expected, None, missed, doubled, revealed=False)
    off = _pct(rel) if math.isfinite(rel) else "expected 0"
    msg = f"{name}: not yet, {_fmt(x, unit)} vs expected {_fmt(total, unit)} ({off})"
    if why:
        msg += f"; {why}"
    elif parts:
        msg += "; the expected value is the sum of " + ", ".join(f"{k} {_fmt(v, unit)}" for k, v in parts.items())
    return Feedback(False, msg, answer, expected, rel, missed, doubled)


def check_revealed(answer: Any, expected: Any, **kwargs: Any) -> Feedback:
    """:func:`check` with ``reveal=True``: the full diagnosis at once (graders' tests, where nobody retries)."""
    return check(answer, expected, reveal=True, **kwargs)


def _check_category(answer: Any, expected: str, name: str, reveal: bool | None) -> Feedback:
    """A category answer (a string): right or not, case and spaces ignored; no percentages."""
    if str(answer).strip().lower() == expected.strip().lower():
        return Feedback(True, f"{name}: right, {expected!r}", answer, expected)
    if _first_try(name, expected, reveal):
        return Feedback(False, f"{name}: not yet, {answer!r}; the expected answer is {expected!r}", answer, expected)
    return Feedback(False, f"{name}: not yet, {answer!r} is not it" + _AGAIN, answer, expected, revealed=False)


def _check_terms(answer: Mapping[str, Any], parts: dict[str, float], rtol: float, atol: float, name: str,
                 unit: str, reveal: bool | None) -> Feedback:
    missing = [k for k in parts if k not in answer]
    unknown = [str(k) for k in answer if str(k) not in parts]
    details = tuple(check(answer[k], v, rtol=rtol, atol=atol, name=k, unit=unit, reveal=reveal)
                    for k, v in parts.items() if k in answer)
    wrong = tuple(d.message.split(":")[0] for d in details if not d.correct)
    ok = not missing and not unknown and not wrong
    lines = [f"{name}: {'right, every term' if ok else 'not yet'}"]
    if missing:
        lines.append(f"missing term(s): {', '.join(missing)}")
    if unknown:
        lines.append(f"unknown term(s): {', '.join(unknown)}; expected terms are {', '.join(parts)}")
    lines += ["  " + d.message for d in details]
    return Feedback(ok, "\n".join(lines), dict(answer), parts, None, tuple(missing), (), wrong, details,
                    all(d.revealed for d in details))


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
