"""The one error type of parallel_lab, and what its messages need: the divisors they suggest, the set they print.

Every invalid model, cluster, plan or file raises :class:`ParallelLabError` (a ``ValueError``) with a message
that names the bad value and says how to fix it: ``tp=3 does not divide heads=32; pick tp in {1, 2, 4, 8, 16,
32}``. It lives in the lowest module, with :func:`divisors` (from the prime factorisation: Miller-Rabin with
fixed bases, Pollard's rho) and :func:`fmt_set`, so that every other module can raise it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, TypeVar

T = TypeVar("T")


class ParallelLabError(ValueError):
    """The one error type of parallel_lab: an invalid model, cluster or plan, named with its fix."""


def check_positive_int(owner: str, name: str, value: Any) -> None:
    """Raise unless ``value`` is a positive integer (a bool is not)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ParallelLabError(f"{owner}.{name}={value!r} must be a positive integer; e.g. {name}=1")


def check_real(owner: str, name: str, value: Any) -> None:
    """A real number (not a bool, not NaN); range checks follow at the caller."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value:
        raise ParallelLabError(f"{owner}.{name}={value!r} must be a number")


def check_choice(owner: str, name: str, value: Any, options: tuple[str, ...]) -> None:
    """Raise unless ``value`` is one of ``options``."""
    if value not in options:
        raise ParallelLabError(f"{owner}.{name}={value!r} is not known; pick one of {', '.join(options)}")


def lookup_preset(what: str, name: str, presets: Mapping[str, T]) -> T:
    """The preset ``name`` (any case) of ``presets``; an unknown name raises, listing the known ones."""
    key = name.lower()
    if key not in presets:
        raise ParallelLabError(f"{what} preset {name!r} is not known; pick one of {', '.join(presets)}")
    return presets[key]


def _is_prime(n: int) -> bool:
    """Miller-Rabin with the first 12 primes as bases: exact for every n < 3.3e24 (Sorenson & Webster 2015)."""
    small = (2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37)
    if n < 2:
        return False
    for p in small:
        if n % p == 0:
            return n == p
    d, s = n - 1, 0
    while d % 2 == 0:
        d, s = d // 2, s + 1
    for a in small:
        x = pow(a, d, n)
        if x in (1, n - 1):
            continue
        for _ in range(s - 1):
            x = x * x % n
            if x == n - 1:
                break
        else:
            return False
    return True


def _factor(n: int, out: dict[int, int]) -> None:
    """Add the prime factorisation of ``n`` to ``out`` (small primes by division, the rest by Pollard's rho)."""
    for p in (2, 3, 5, 7, 11, 13):
        while n % p == 0:
            out[p] = out.get(p, 0) + 1
            n //= p
    if n == 1:
        return
    if _is_prime(n):
        out[n] = out.get(n, 0) + 1
        return
    c = 1
    while True:                          # Pollard's rho, Floyd cycle finding: ~n^(1/4) steps per factor
        x = y = 2
        d = 1
        while d == 1:
            x = (x * x + c) % n
            y = (y * y + c) % n
            y = (y * y + c) % n
            d = math.gcd(abs(x - y), n)
        if d != n:
            _factor(d, out)
            _factor(n // d, out)
            return
        c += 1


def divisors(n: int) -> list[int]:
    """All positive divisors of ``n`` in increasing order (used to suggest valid degrees).

    From the prime factorisation, never by trial division up to ``n``: ``divisors(999999999999)`` is
    immediate. ``n`` beyond 10^24 (no model or cluster is that large) is refused."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ParallelLabError(f"divisors({n!r}): need a positive integer")
    if n > 10**18:
        raise ParallelLabError(f"divisors of {str(n)[:12]}... ({len(str(n))} digits): too large; "
                               "no degree or size of a model is over 10^18")
    primes: dict[int, int] = {}
    _factor(n, primes)
    out = [1]
    for p, k in primes.items():
        out = [d * p**i for d in out for i in range(k + 1)]
    return sorted(out)


def fmt_set(values: list[int], limit: int = 16) -> str:
    """``{1, 2, 4, 8}``; a long list keeps its ends: ``{1, 2, 3, ..., 5000, 10000} (48 values)``."""
    if len(values) <= limit:
        return "{" + ", ".join(str(v) for v in values) + "}"
    head, tail = values[:limit - 4], values[-3:]
    return "{" + ", ".join(map(str, head)) + ", ..., " + ", ".join(map(str, tail)) + f"}} ({len(values)} values)"
