"""``check(...)``: right, or how far off and which term was missed; never a silent pass.

Targets come from the library (the ledger of llama2-7b with ZeRO) and from the seed's published bytes:
2 + 2 + 12 bytes per parameter for mixed-precision Adam (Rajbhandari et al. 2020).
"""

from __future__ import annotations

import subprocess
import sys

from parallel_lab.grading.feedback import answer_hash, check, check_hash, learner_params
from parallel_lab.ledger import state_bytes
from parallel_lab.specs import Plan

PSI = 7.5e9
ZERO0 = {"parameters": 2 * PSI, "gradients": 2 * PSI, "optimizer_states": 12 * PSI}   # 120 GB per GPU


def test_right_answer_within_tolerance():
    fb = check(120.5e9, ZERO0, unit="B")
    assert fb and fb.correct and "right" in fb.message


def test_missing_answer_is_not_a_pass():
    for a in (None, ...):
        fb = check(a, 1.0)
        assert not fb and "no answer yet" in fb.message
    assert not check("lots", 1.0) and "not a number" in check("lots", 1.0).message


def test_missed_term_is_named():
    fb = check(2 * PSI + 12 * PSI, ZERO0, unit="B")         # forgot the gradients (or the parameters: equal)
    assert not fb and fb.missed == ("gradients", "parameters") and "leaves out one of" in fb.message
    fb = check(2 * PSI + 2 * PSI, ZERO0, unit="B")          # forgot the optimizer states
    assert fb.missed == ("optimizer_states",) and "leaves out optimizer_states (90.000 GB" in fb.message
    fb = check(2 * PSI, ZERO0, unit="B")                    # only the parameters
    assert "optimizer_states" in fb.missed and "leaves out one of" in fb.message


def test_doubled_term_and_unit_slips():
    assert check(120e9 + 2 * PSI, ZERO0).doubled == ("parameters",)
    assert "GB vs GiB" in check(120e9 / 2**30 * 1e9, ZERO0).message
    assert "10^9" in check(120.0, ZERO0).message and "smaller" in check(120.0, ZERO0).message
    fb = check(1.3, 1.0)
    assert not fb and "+30.0%" in fb.message


def test_terms_checked_one_by_one_against_the_ledger():
    from parallel_lab.specs import ModelSpec

    m = ModelSpec.from_params(PSI)
    expected = state_bytes(m, Plan(dp=8, zero=2))
    ans = {"parameters": 2 * PSI, "gradients": 2 * PSI / 8, "optimizer_states": 12 * PSI}   # ZeRO-1 states wrong
    fb = check(ans, expected, unit="B")
    assert not fb and fb.wrong_terms == ("optimizer_states",)
    fb = check({"parameters": 2 * PSI, "gradients": 2 * PSI / 8, "optimizer_states": 12 * PSI / 8}, expected)
    assert fb, fb.message
    assert not check({"parameters": 2 * PSI}, expected) and "missing term" in check({"parameters": 1}, expected).message


def test_salted_hash_and_learner_params_are_deterministic():
    d = answer_hash(26.25e9, "s1")
    assert check_hash(26.25e9, d, "s1") and check_hash(26.2512e9, d, "s1")
    assert not check_hash(26.0e9, d, "s1") and not check_hash(26.25e9, d, "s2")
    p = learner_params("ada", "course-1", {"dp": [2, 4, 8], "zero": [1, 2, 3]})
    assert p == learner_params("ada", "course-1", {"dp": [2, 4, 8], "zero": [1, 2, 3]})
    assert {learner_params(f"l{i}", "c", {"dp": [2, 4, 8]})["dp"] for i in range(30)} == {2, 4, 8}


def test_importing_check_does_not_import_torch():
    code = "import sys; from parallel_lab.grading.feedback import check; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "False", out.stderr


def test_a_unit_slip_says_larger_or_smaller_the_right_way_round():
    # 1e9 / 2**30 < 1: an answer 2**30/1e9 times the expected bytes is LARGER (found in lesson 04 as "smaller")
    fb = check(2**30, 1e9, rtol=0.001, unit="B")
    assert not fb and "GB vs GiB" in fb.message and "larger" in fb.message
    fb = check(1e9, 2**30, rtol=0.001, unit="B")
    assert "GB vs GiB" in fb.message and "smaller" in fb.message
    # a percentage is not bytes: 50 against 46.67 is no GB/GiB slip
    fb = check(50.0, 46.67, atol=1.0, unit="%")
    assert not fb and "GiB" not in fb.message
    assert "factor 1,000 larger" in check(3000.0, 3.0, unit="ms").message


def test_the_tolerance_printed_is_the_one_applied():
    assert "tolerance ±1 %" in check(46.5, 46.67, rtol=0.0, atol=1.0, unit="%").message
    assert "tolerance 0.01" in check(1.005, 1.0, rtol=0.01).message
    assert "tolerance 0 (exact)" in check(3, 3, rtol=0.0).message
