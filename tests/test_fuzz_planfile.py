"""Fuzzing the plan-file loader (issue 18): random damage to a good plan file, each load in a fork.

Damage (:func:`fuzzing.damaged_plan`): truncation, deleted, swapped or duplicated lines, flipped bytes,
alias bombs, deep nesting, huge integers, odd values and tags, invalid UTF-8, oversized files, models and
clusters written as mappings with absurd or mistyped fields. Every load must succeed, within the command
line's ranges, or raise one line of ParallelLabError, never a traceback, within the time and memory bounds.
The full-scale run (1,000 files) is ``python tests/fuzzing.py``.
"""

from __future__ import annotations

import random

import fuzzing
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import parallel_lab.planfile  # noqa: F401  (imported once, before the forks)

GOOD = fuzzing.good_plan_bytes()


@settings(max_examples=40, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(st.integers(min_value=0, max_value=2**32))
def test_damaged_plan_files_load_or_fail_in_one_line(tmp_path_factory, seed):
    path = tmp_path_factory.mktemp("damaged") / "plan.yaml"
    path.write_bytes(fuzzing.damaged_plan(random.Random(seed), GOOD))
    r = fuzzing.load_case(str(path))
    assert fuzzing.check_cli_result(r) == [], (r.code, r.err[-400:])
    assert r.code in (0, 2)


def test_the_good_file_loads():
    import tempfile

    with tempfile.NamedTemporaryFile(suffix=".yaml") as f:
        f.write(GOOD)
        f.flush()
        assert fuzzing.load_case(f.name).code == 0
