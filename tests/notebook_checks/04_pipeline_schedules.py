"""Lesson 04: the (p-1)/m bubble table, both bubble definitions, in-flight counts, and the measured pipeline runs."""

from __future__ import annotations

import re

from notebook_checks import assert_no_answer_everywhere, figures
from parallel_lab import simulate


def check(text: str, nb) -> None:
    # the closed form (p-1)/m for p=8 at m = 8 and 64 (the chart has 16 and 32 too; same formula)
    assert re.search(r"\(p-1\)/m\s+87\.5%\s+10\.9%", text)
    # GPipe and 1F1B simulated: bubble ratio (p-1)/m and idle fraction (p-1)/(m+p-1)
    for name in ("gpipe", "1f1b"):
        assert re.search(name + r"\s+87\.5% / 46\.7%\s+10\.9% /  9\.9%", text), name
    # the pictures: GPipe/1F1B timelines, the bubble sweep, 1F1B against interleaved, the measured runs
    assert "1f1b, p=4, m=8: bubble 37.5%" in text and "interleaved v=2, p=4, m=8: bubble 18.8%" in text
    assert figures(nb) >= 7, figures(nb)     # and 4b's bubble of Meta's settings, 4c's exposed all-to-all
    # 4b. Llama 3 405B's pipeline: the embedding and the head in a slot each, the bubble of each Table 4 row
    assert "blocks per stage: [7, 8, 8, 8, 8, 8, 8, 8, 8, 8, 8, 8, 8, 8, 8, 7]" in text
    assert re.search(r"8K, 8,192 GPUs \(dp 64, m 32\)\s+simulated bubble\s+5\.9%", text)
    assert re.search(r"131K, 16,384 GPUs \(cp 16, dp 8, m 16\)\s+simulated bubble\s+11\.7%", text)
    assert "131K without context parallelism (dp 128): m = 1, bubble 1500%" in text
    assert "m=24 is not a multiple of it" in text
    # 4c. DualPipe's overlapped pairs on the lab's lists, and the pair time with and without the overlap
    assert "[F7.0+B3.1] [F4.1+B0.0]" in text and "5 overlapped (forward, backward) pairs on rank 0" in text
    assert "serial 6.0, zero-bubble B/W split 6.0, DualPipe 3.0 -> 2.00x" in text
    assert re.search(r"interleaved v=2\s+43\.8% / 30\.4%", text)         # (p-1)/(v m)
    assert "1f1b             [8, 7, 6, 5, 4, 3, 2, 1]" in text            # p - r in flight
    assert "gpipe            [64, 64, 64, 64, 64, 64, 64, 64]" in text
    assert "stage 0: F0 F1 F2 F3 B0 F4 B1 F5 B2 B3 B4 B5" in text         # 1F1B's list on 4 stages, 6 micro-batches
    # failure mode 4 on the 7B-class shape: GPipe at m=64 does not fit, at m=16 it does; 1F1B at m=64 does
    assert re.search(r"gpipe\s+64\s+[\d.]+ GB\s+[\d.]+ GB\s+False", text)
    assert re.search(r"gpipe\s+16\s+[\d.]+ GB\s+[\d.]+ GB\s+True", text)
    assert re.search(r"1f1b\s+64\s+[\d.]+ GB\s+[\d.]+ GB\s+True", text)
    assert_no_answer_everywhere(text, nb)
    # the guided task's answers are on the explorer's slider (1F1B under 15%, ZB-H1 under 10%), and the cell
    # speaks of the learner's own m, never prints the answers
    slider_max, m10 = map(int, re.search(
        r"the explorer's slider runs 1\.\.(\d+); 1F1B under 10% would need m = (\d+)", text).groups())
    a_1f1b = next(k for k in range(2, 257) if simulate.bubble_formula("1f1b", 8, k) < 0.15)
    a_zbh1 = next(k for k in range(2, 257) if simulate.bubble_formula("zb-h1", 8, k) < 0.10)
    assert (a_1f1b, m10) == (47, 71) and a_1f1b <= slider_max and a_zbh1 <= slider_max, (slider_max, a_1f1b, a_zbh1)
    assert "1f1b: type a whole number m >= 2 to see its bubble" in text
    assert "zb-h1: type a whole number m >= 2 to see its bubble" in text
    # the library's own code is on the page: the 1F1B generator before the lists run, the executor's loop
    for key in ("def one_f_one_b_order(p: int, m: int) -> list[list[Action]]:", "order += [fwd(warm + k), bwd(k)]",
                "for i, a in enumerate(self.actions):", "run[a.kind](rt, st, i, a)"):
        assert key in text, key
    assert text.index("run[a.kind](rt, st, i, a)") < text.index("1f1b: p=2, m=4")
    assert "1f1b: p=2, m=4" in text                                     # the real runs happened
    assert "peak in flight per stage: measured [2, 1], simulated [2, 1]" in text
    assert "peak in flight per stage: measured [4, 4], simulated [4, 4]" in text
    acts = re.findall(r"activations \(largest stage\): measured ([\d,]+) B, predicted ([\d,]+) B", text)
    assert len(acts) == 2 and all(a == b for a, b in acts), acts
    one = re.findall(r"GPipe activations, m=(\d): measured ([\d,]+) B, predicted ([\d,]+) B", text)
    assert len(one) == 2 and all(b == c for _, b, c in one), one
    by_m = {int(k): int(b.replace(",", "")) for k, b, _ in one}
    assert by_m[1] < by_m[4]
    # GPipe keeps all m micro-batches: the m=1 run's activations are a quarter of the m=4 run's
    assert re.search(r"activations m=1 / m=4: measured 0\.250, predicted 0\.250", text)
    # one micro-batch on two stages: the stages never overlap, so at least half the GPU-time is idle
    idle = float(re.search(r"GPipe m=1: idle fraction predicted 50\.0%, measured ([\d.]+)%", text).group(1))
    assert idle >= 49.0, idle


# The answer key (tests/test_lesson_answers.py): a right answer to every question, worked out from the lesson's
# text; a plausible wrong one (the mistake in its comment); and the diagnosis the feedback must give for it.
ANSWERS = {
    "my_bubble_pct": 87.5,                        # (p - 1) / m = 7 / 8
    "my_idle_pct": 46.7,                          # (p - 1) / (m + p - 1) = 7 / 15
    "my_inflight": 8,
    "my_kept": 0.77,
    "my_m_1f1b": 47,
    "my_m_zbh1": 24,
    "my_meta_bubble_pct": 11.7,                   # (p - 1) / (v m) = 15 / 128
    "my_pair_speedup": 2.0,                       # (1 + 2 + 3) / max(3, 3)
}
WRONG = {
    "my_bubble_pct": 46.7,                        # the idle fraction, not the bubble ratio
    "my_idle_pct": 87.5,                          # the bubble ratio, not the idle fraction
    "my_inflight": 64,                            # every micro-batch, as in GPipe
    "my_kept": 0.9,                                # a guess: the fill and drain taken as a tenth of the step
    "my_m_1f1b": 46,                              # 7 / 46 is 15.2%: not under 15%
    "my_m_zbh1": 71,                              # 1F1B's bubble, (p - 1) / m < 10%
    "my_meta_bubble_pct": 93.8,                   # (p - 1) / m: the v = 8 chunks forgotten
    "my_pair_speedup": 1.0,                       # nothing hidden, as if DualPipe were zero-bubble's B/W split
}
HINTS = {
    "my_bubble_pct": "looks like the idle fraction",
    "my_idle_pct": "looks like the bubble ratio",
    "my_inflight": "a factor 8 larger",
    "my_meta_bubble_pct": "without interleaving",
    "my_pair_speedup": "nothing hidden",
}
