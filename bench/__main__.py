"""Run every ``bench/bench_*.py`` module's ``main()`` in name order.

A module that fails prints its error and the rest still run; the exit status is 1 if any failed.
``python -m bench core ledger`` runs only the modules whose names contain one of the words.
"""

from __future__ import annotations

import importlib
import sys
import time
import traceback
from pathlib import Path


def modules(words: list[str]) -> list[str]:
    names = sorted(p.stem for p in Path(__file__).parent.glob("bench_*.py"))
    return [n for n in names if not words or any(w in n for w in words)]


def main(argv: list[str] | None = None) -> int:
    failed = []
    for name in modules(sys.argv[1:] if argv is None else argv):
        print(f"=== bench.{name} ===", flush=True)
        t0 = time.perf_counter()
        try:
            importlib.import_module(f"bench.{name}").main()
        except Exception:                                   # report and go on with the next benchmark
            traceback.print_exc()
            failed.append(name)
        print(f"--- bench.{name}: {time.perf_counter() - t0:.1f} s{' (FAILED)' if name in failed else ''}\n",
              flush=True)
    if failed:
        print(f"failed: {', '.join(failed)}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
