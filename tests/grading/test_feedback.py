"""``check(...)``: right, or a hint first and the expected value on the second try; never a silent pass.

Targets come from the library (the ledger of llama2-7b with ZeRO) and from the tutorial's published bytes:
2 + 2 + 12 bytes per parameter for mixed-precision Adam (Rajbhandari et al. 2020). The diagnoses with values
are asked with ``reveal=True``; the hint-first behaviour has its own tests below.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from parallel_lab.grading import feedback
from parallel_lab.grading.feedback import answer_hash, check_hash, learner_params
from parallel_lab.grading.feedback import check as hinting_check
from parallel_lab.ledger import state_bytes
from parallel_lab.specs import Plan


def check(*args, **kwargs):
    """The full diagnosis at once (what a second wrong try shows)."""
    kwargs.setdefault("reveal", True)
    return hinting_check(*args, **kwargs)


@pytest.fixture(autouse=True)
def fresh_kernel():
    feedback.reset_tries()
    yield
    feedback.reset_tries()

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
    assert "tolerance 1%" in check(1.005, 1.0, rtol=0.01).message
    assert "tolerance 0 (exact)" in check(3, 3, rtol=0.0).message


def test_an_estimate_passes_within_5_percent_and_a_count_must_be_exact():
    assert check(110, 112.0, unit="GB") and "tolerance 5%" in check(110, 112.0, unit="GB").message
    assert not check(105, 112.0, unit="GB")                        # 6% off an estimate
    assert not check(46, 47) and not check(48, 47) and check(47, 47)   # an int expected is a count
    assert check({"a": 3, "b": 4}, {"a": 3, "b": 4}) and not check(8, {"a": 3, "b": 4})
    assert check(46.9, 47, rtol=0.01)                              # a stated tolerance wins


def test_the_first_wrong_try_hints_without_the_value_the_second_reveals_it():
    first = hinting_check(2 * PSI + 2 * PSI, ZERO0, unit="B", name="state")      # optimizer states left out
    assert not first and not first.revealed
    assert "your total leaves out optimizer_states" in first.message
    assert "120" not in first.message and "90" not in first.message and "reveal=True" in first.message
    second = hinting_check(2 * PSI + 2 * PSI, ZERO0, unit="B", name="state")
    assert second.revealed and "expected 120.000 GB" in second.message
    low = hinting_check(80.0, 100.0, name="low")
    assert "far" not in low.message and "too low" in low.message and "100" not in low.message
    assert "far too high" in hinting_check(250.0, 100.0, name="high").message
    assert "close, but too high" in hinting_check(110.0, 100.0, name="close").message
    # another question keeps its own count; reveal=False never shows the value
    assert not hinting_check(80.0, 100.0, name="other").revealed
    assert not hinting_check(80.0, 100.0, name="low", reveal=False).revealed
    assert hinting_check(80.0, 100.0, name="new", reveal=True).revealed


def test_a_unit_slip_is_named_at_the_first_try():
    fb = hinting_check(120e9 / 2**30, 120.0, unit="GB", name="gib")
    assert not fb.revealed and "GB vs GiB" in fb.message


def test_sizes_written_with_a_unit_are_understood():
    assert check("112 GB", 112e9, unit="B")
    assert check("104.3 GiB", 112e9, unit="B")
    assert check("112GB", 112.0, unit="GB") and check("104 GiB", 112.0, unit=" GB")
    assert check("110", 112.0, unit="GB") and check("1,024 B", 1024, unit="B")
    fb = check("112 GB", 2.0, unit="s")
    assert not fb and "carries the unit 'GB'" in fb.message and "in s" in fb.message
    fb = check("lots", 112.0, unit="GB")
    assert "not a number" in fb.message and "1.5e9" not in fb.message and "number of GB" in fb.message
    assert "number of bytes such as 1.5e9" in check("lots", 1e9, unit="B").message


def test_a_category_is_right_or_not_without_percentages():
    assert check(" Zigzag ", "zigzag") and not hinting_check("ring", "zigzag", name="kind")
    fb = hinting_check("ring", "zigzag", name="kind")
    assert "'zigzag'" in fb.message and "%" not in fb.message


def test_marks_are_plain_text():
    assert check(1.0, 1.0)._repr_markdown_().startswith("**[right]**")
    assert hinting_check(2.0, 1.0, name="m")._repr_markdown_().startswith("**[not yet]**")
    assert not any(ord(ch) > 0x2000 for ch in check(2.0, 1.0)._repr_markdown_())


def test_a_question_names_its_own_likely_mistake():
    # 704,512 B read; 2x that is "both halves of the moments", not bytes per element or a ring's factor
    why = "rank 1 of A wrote only the second half of each unit's moments"
    fb = hinting_check(2 * 704512, 704512, unit="B", name="own", slips={2.0: why})
    assert not fb and not fb.revealed and why in fb.message
    assert "bytes per element" not in fb.message and "704,512" not in fb.message
    assert "bytes per element" in hinting_check(2 * 704512, 704512, unit="B", name="generic").message
    # a ratio that is no unit slip: the bubble ratio (p-1)/m for the idle fraction (p-1)/(m+p-1), p = m = 8
    bubble, idle = 100 * 7 / 8, 100 * 7 / 15
    fb = check(46.7, bubble, rtol=0, atol=1.0, unit="%", slips={idle / bubble: "looks like the idle fraction"})
    assert not fb and "looks like the idle fraction" in fb.message and "expected 87.5 %" in fb.message
    # matched within the question's own tolerance, and only that ratio
    assert "idle" in check(47.5, bubble, rtol=0, atol=1.0, unit="%", slips={idle / bubble: "idle"}).message
    assert "idle" not in check(50.0, bubble, rtol=0, atol=1.0, unit="%", slips={idle / bubble: "idle"}).message
    assert check(87.0, bubble, rtol=0, atol=1.0, slips={idle / bubble: "idle"})        # right stays right
    # the question's slip comes before the terms' diagnosis
    fb = check(2.1, 4.34, rtol=0.1, unit="GB", terms={"fp32 log-probabilities": 4.2, "inputs": 0.14},
               slips={2.1 / 4.34: "that is the bf16 logits"})
    assert "that is the bf16 logits" in fb.message and "leaves out" not in fb.message


def test_large_numbers_are_written_in_scientific_notation():
    fb = hinting_check(1.27e25, 3.8e25, name="flops")
    assert "1.27e+25" in fb.message and "914" not in fb.message
    assert "expected 3.8e+25" in check(1.27e25, 3.8e25).message
    assert "1.27e+25 FLOPs" in check(1.27e25, 3.8e25, unit="FLOPs").message
    assert "(1.27e+25 B)" in check(1.27e25, 3.8e25, unit="B").message
    assert "4,000,000 B" in check(4e6, 4e6, unit="B").message and "1,000" in check(1000.0, 1000.0).message
    assert "999,999,999,999,999" in check(999_999_999_999_999, 999_999_999_999_999).message


def test_an_mfu_estimate_read_off_a_round_peak_is_right():
    # 400 TFLOPS on an H100's 989: 0.404; read as 400 / 1,000 = 0.400 (-1.1%), inside an estimate's 5%
    fb = hinting_check(0.400, 400e12 / 989e12, name="mfu")
    assert fb and "tolerance 5%" in fb.message


def test_a_zero_answer_is_too_low_not_a_wrong_sign():
    fb = hinting_check(0, 1, name="first step")
    assert not fb and "too low (it should not be 0)" in fb.message and "sign" not in fb.message
    assert "too high" in hinting_check(0, -2.0, name="negative").message
    assert "the sign is wrong" in hinting_check(-1.0, 1.0, name="sign").message
