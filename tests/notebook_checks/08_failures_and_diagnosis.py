"""Lesson 08: the six failure modes, the predicted figures from the library and the three measured runs."""

from __future__ import annotations

import re

from notebook_checks import figures, number


def check(text: str, nb) -> None:
    assert figures(nb) >= 3, figures(nb)       # each rank's compute and wait, the loss curves, goodput
    # the diagnosis's own code on the page: the straggler's ratio, the first rank to die, the hung rank
    assert 'ratio = slow["compute_s"] / others if others > 0 else float("inf")' in text
    assert "return self._died(min(gone, key=lambda r: (self.exited_at[r], r))) if gone else None" in text
    assert "busy = [r for r in behind if not self.action(r)[1]]" in text
    # 1 and 4 are lessons 03 and 04's: a pointer each, not a repeat of their questions
    markdown = "\n".join(c.source for c in nb.cells if c.cell_type == "markdown")
    assert "Lesson 03 (section 4" in markdown and "Lesson 04 measures and prices this one" in markdown
    assert not any(v in c.source for c in nb.cells for v in ("my_tp_slowdown", "my_bubble"))
    # 2. FSDP root-only: the whole bf16 model gathered plus its gradient (2 x 16.06 GB) against per-block units
    assert "zero_unit=block: comm buffers   5.08 GB" in text and "zero_unit=root : comm buffers  32.12 GB" in text
    # 3. logits: over the usable memory at micro-batch 8 (and twice over at the loss's backward, where the fp32
    # logit gradients 2 s b V 4 = 67 GB join them), fitting again with a chunked loss, at its peak too
    assert re.search(r"\n\s+8\s+0\s+34\.70\s+17\.18\s+73\.01\s+135\.27 \(loss backward\s*\)\s+False", text)
    assert re.search(r"\n\s+8\s+1024\s+1\.07\s+17\.18\s+39\.39\s+39\.66 \(loss backward\s*\)\s+True", text)
    # 5 and 6, measured: the straggler, the plan-dependent normalisation, the dead rank with its last action
    assert "rank 1 is a straggler" in text
    assert "rank 0's wait: predicted 2.00 s (rank 1's sleep), measured" in text
    wait0 = number(r"run A rank 0: compute [\d.]+ s, wait ([\d.]+) s", text)
    compute1 = number(r"run A rank 1: compute ([\d.]+) s", text)
    wait1 = number(r"run A rank 1: compute [\d.]+ s, wait ([\d.]+) s", text)
    # rank 1 slept 1 s in each of the 2 counted steps; rank 0 cannot wait longer than rank 1's steps took
    assert 1.0 <= wait0 <= compute1 + wait1 + 0.05 and compute1 >= 2.0, (wait0, compute1, wait1)
    assert "the loss curves DISAGREE from step 1" in text
    assert number(r"A against its one-process reference: largest parameter difference (\S+)\n", text) < 1e-5
    assert number(r"B against its one-process reference: largest parameter difference (\S+)\n", text) > 1e-4
    assert "rank 1 failed after step 1: process killed by SIGKILL" in text
    assert re.search(r"its last action: step 2: forward phase \(last call: .* pp (recv|send) ", text)
    assert number(r"named ([\d.]+) s after the launch", text) < 60
    # 7. goodput: Llama 3's 419 unexpected interruptions in 54 days, Young's interval, the clean steps of N ranks
    assert "job MTBF 3.09 h; one GPU's MTBF 5.8 years" in text
    assert "Young's optimal interval: 19.3 min of work between checkpoints" in text
    assert "16,384 GPUs: MTBF   3.1 h, best interval  19.3 min, goodput 84.2%" in text
    assert "P(no slow rank) at N = 16,384, p = 0.0001: 19.4%" in text
    assert "by halving the suspects: 14 rounds" in text
    assert "one failure every 3.09 h: 5.4% of the wall time" in text        # the restart term, 600 s / MTBF
    # every prediction cell ran with its placeholder and said so (never a silent pass)
    said = [c for c in nb.cells if c.cell_type == "code" and "check(my_" in c.source
            and "no answer yet" in str(c.get("outputs", []))]
    assert len(said) == 9, len(said)


# The answer key (tests/test_lesson_answers.py): a right answer to every question, worked out from the lesson's
# text; a plausible wrong one (the mistake in its comment); and the diagnosis the feedback must give for it.
ANSWERS = {
    "my_restart_pct": 5.388,                      # 600 s / (54 days / 419)
    "my_root_buffers_gb": 32.1,                   # the gathered bf16 model and its full bf16 gradient
    "my_logits_gb": 4.34,                          # fp32 log-probabilities s b V x 4 B + 2 s b h x 2 B inputs
    "my_wait_s": 2.0,
    "my_first_step": 1,
    "my_blamed_rank": 1,
    "my_largest_tp": 2,                           # cpu-gloo has 2 ranks per node
    "my_ckpt_interval_min": 19.3,                 # sqrt(2 x 60 s x 11,135 s) = 1156 s
    "my_p_clean": 0.194,                          # (1 - 1e-4)^16,384
}
WRONG = {
    "my_restart_pct": 5.993,                      # all 466 interruptions counted as failures
    "my_root_buffers_gb": 16.06,                  # the gathered parameters only, not their gradient
    "my_logits_gb": 2.1,                          # the bf16 logits alone, s b V x 2 bytes
    "my_wait_s": 1.0,                             # one step's sleep
    "my_first_step": 0,
    "my_blamed_rank": 0,                          # the rank that reported the broken pipe
    "my_largest_tp": 4,                           # the whole dp = 4 grid
    "my_ckpt_interval_min": 13.6,                 # sqrt(checkpoint x MTBF): the 2 left out
    "my_p_clean": 0.9999,                         # one rank's chance, not all N ranks'
}
HINTS = {
    "my_restart_pct": "466",
    "my_root_buffers_gb": "leaves out one of",
    "my_logits_gb": "that is the bf16 logits",
    "my_wait_s": "leaves out one of",
    "my_first_step": "too low",
    "my_blamed_rank": "too low",
    "my_largest_tp": "a factor 2 larger",
    "my_ckpt_interval_min": "a factor 2 under the root",
    "my_p_clean": "that is one rank's chance",
}
