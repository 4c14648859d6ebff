"""Quantities as text: bytes and seconds in the unit that suits the value (the one home of ``fmt_bytes``).

Decimal units as everywhere in the lab (``docs/conventions.md``: GB means 10**9 bytes). Two byte styles:
:func:`fmt_bytes` (``7.52 GB``: ``digits`` significant digits, the charts' labels and the app's text) and
:func:`fmt_bytes_gib` (``12.35 GB (11.50 GiB)``: two decimals with the binary figure alongside, what the
command line prints, since ``nvidia-smi`` and torch report GiB). Pure Python, no plotting package.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from .specs import GB, GiB

#: Decimal byte units and time units, smallest first.
BYTE_UNITS: tuple[tuple[str, float], ...] = (("B", 1.0), ("kB", 1e3), ("MB", 1e6), ("GB", 1e9), ("TB", 1e12),
                                             ("PB", 1e15))
TIME_UNITS: tuple[tuple[str, float], ...] = (("ns", 1e-9), ("µs", 1e-6), ("ms", 1e-3), ("s", 1.0))


def unit_for(x: float, units: Sequence[tuple[str, float]] = BYTE_UNITS) -> tuple[str, float]:
    """The largest unit of ``units`` that ``|x|`` reaches (the smallest for 0): ``(name, scale)``."""
    chosen = units[0]
    for unit in units:
        if abs(x) >= unit[1] * (1 - 1e-12):
            chosen = unit
    return chosen


def fmt_number(v: float, digits: int = 3) -> str:
    """``v`` with ``digits`` significant digits in plain notation, trailing zeros dropped: never ``1e+03``."""
    if v == 0 or not math.isfinite(v):
        return "0" if v == 0 else str(v)
    decimals = max(0, digits - 1 - math.floor(math.log10(abs(v))))
    text = f"{v:.{decimals}f}"
    return text.rstrip("0").rstrip(".") if "." in text else text


def fmt_quantity(x: float, units: Sequence[tuple[str, float]], digits: int = 3) -> str:
    """``x`` in the unit that suits it: ``fmt_quantity(1.7e6, BYTE_UNITS) == "1.7 MB"``."""
    if x == 0:
        return f"0 {units[0][0]}"
    name, scale = unit_for(x, units)
    text = fmt_number(x / scale, digits)
    bigger = [u for u in units if u[1] > scale]
    if abs(float(text)) >= 1000 and bigger:                 # 999.96 MB rounds to 1 GB, not "1000 MB"
        return fmt_quantity(x, bigger, digits)
    return f"{text} {name}"


def fmt_bytes(n: float, digits: int = 3) -> str:
    """``7.52 GB``, ``312 MB``, ``4.1 kB``, ``96 B``: ``digits`` significant digits in the unit that suits ``n``."""
    return fmt_quantity(n, BYTE_UNITS, digits)


def fmt_bytes_gib(n: float) -> str:
    """``12.35 GB (11.50 GiB)``: GB = 10^9 bytes, GiB = 2^30 bytes (MB/MiB, kB/KiB below 0.1 GB, 0.1 MB)."""
    if abs(n) >= 0.1 * GB or n == 0:
        return f"{n / GB:,.2f} GB ({n / GiB:,.2f} GiB)"
    if abs(n) >= 1e5:
        return f"{n / 1e6:,.2f} MB ({n / 2**20:,.2f} MiB)"
    return f"{n / 1e3:,.2f} kB ({n / 2**10:,.2f} KiB)"


def fmt_seconds(t: float, digits: int = 3) -> str:
    """``8.35 ms``, ``1.2 s``, ``40 µs``."""
    return "0 s" if t == 0 else fmt_quantity(t, TIME_UNITS, digits)
