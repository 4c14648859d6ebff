"""Lesson 02: the global batch, DDP buckets and overlap, ZeRO 1/2/3 memory and bytes, FSDP units and the
loss normalisation of gradient accumulation, each predicted by the library and measured on 2 ranks."""

from __future__ import annotations

import re

from notebook_checks import assert_no_answer_everywhere, figures, number


def check(text: str, nb) -> None:
    # ZeRO's shards per rank and stage, as a picture drawn from the ledger (what each stage shards, printed)
    assert "ZeRO-1: sharded ['optimizer_states']" in text
    assert "ZeRO-2: sharded ['gradients', 'optimizer_states']" in text
    assert "ZeRO-3: sharded ['parameters', 'gradients', 'optimizer_states']" in text
    assert figures(nb) >= 5, figures(nb)   # DDP timelines, shards per stage, state per rank, unit peaks, losses
    assert "global batch = 1 x 16 x 128 = 2048 sequences = 16,777,216 tokens" in text
    # every prediction cell gives feedback (the placeholders: "no answer yet"), never a silent pass
    checks = [c for c in nb.cells if c.cell_type == "code" and "check(" in c.source]
    assert len(checks) >= 7, len(checks)
    assert_no_answer_everywhere(text, nb)                      # exactly one Feedback per check(...)
    for c in checks:
        shown = " ".join(str(v) for o in c.outputs for v in o.get("data", {}).values())
        assert "no answer yet" in shown, c.source
    assert "10 variants trained on 2 ranks" in text
    # the library's own code is on the page, before the launch (DDP hook, ZeRO-1/2 step, ZeRO-3 gather/free)
    for key in ("def _on_grad(self, p: Tensor) -> None:", "all_reduce_sum(bucket.buffer, self.group, async_op=True)",
                "all_gather_flat(full, src, self.group)", "def _before_block_hook(self, k: int):",
                "output.register_hook(lambda grad: self._before_block_backward(k))",
                "parallel_lab/distributed/zero/fsdp.py, lines"):
        assert key in text, key
    assert text.index("def _on_grad") < text.index("10 variants trained on 2 ranks")
    # the bucket question shows what it needs: every gradient in backward order and the cap
    assert "then blocks 7, 6, ..., 0, each: mlp.down.weight 176,128" in text
    assert "cap 1,000,000 bytes per bucket" in text
    # DDP: buckets predicted = measured, naive launches nothing during backward, bucketed all of its buckets
    assert "bucket sizes equal: True" in text
    assert "buckets measured  (7)" in text
    assert "DDP naive     all-reduces per rank: 75, launched during backward: 0;" in text
    assert "DDP bucketed  all-reduces per rank: 7, launched during backward: 7;" in text
    assert "same bytes, naive and bucketed: True" in text
    assert text.count("measured 25,331,712 B, predicted 25,331,712 B") == 2
    # ZeRO: every state category measured = predicted; bytes 2, 2, 2 and 2.917 x Psi (n-1)/n
    rows = re.findall(r"^(DDP bucketed|ZeRO-\d) +([\d,]+) / +([\d,]+) +([\d,]+) / +([\d,]+) +([\d,]+) / +([\d,]+)"
                      r" +([\d,]+) / +([\d,]+)$", text, re.M)
    assert len(rows) == 4, rows
    for row in rows:
        nums = row[1:]
        assert nums[0::2] == nums[1::2], row
    for name, ratio in (("DDP bucketed", "2.000"), ("ZeRO-1", "2.000"), ("ZeRO-2", "2.000"), ("ZeRO-3", "2.917")):
        assert f"{name:<13} sent per GPU per step = {ratio} x Psi (n-1)/n" in text, name
    assert "measured ZeRO-3 / DDP: 1.459; the root unit is 8.3% of Psi" in text
    # FSDP units: measured = predicted peak; per block below DDP, root-only above it
    assert "ZeRO-3                      5,143,296    5,143,296   0.81 x DDP" in text
    assert "ZeRO-3 root-only            9,499,392    9,499,392   1.50 x DDP" in text
    assert "tiny-llama, 4 blocks, dp=2: per-block ZeRO-3 parameter peak (ledger) 1.08 x DDP" in text
    # accumulation: right matches the one-process run, wrong does not
    right = number(r"largest difference from the one-process run: right ([\d.e+-]+),", text)
    wrong = number(r"largest difference from the one-process run: right [\d.e+-]+, wrong ([\d.e+-]+)", text)
    assert right < 1e-5 and wrong > 1e-3, (right, wrong)
    adam = number(r"the same bug under AdamW: largest loss difference ([\d.e+-]+)", text)
    assert adam < wrong, (adam, wrong)


# The answer key (tests/test_lesson_answers.py): a right answer to every question, worked out from the lesson's
# text; a plausible wrong one (the mistake in its comment); and the diagnosis the feedback must give for it.
ANSWERS = {
    "my_grad_accum": 16,                          # 2048 / (1 x 128)
    "my_buckets": 7,
    "my_zero2_gradients": 3166464,
    "my_zero3_ratio": 1.5,
    "my_root_peak": 9499392,
    "my_update_factor": 4,
    "my_smallest_dp": 4,
}
WRONG = {
    "my_grad_accum": 2048,                        # the 128 data-parallel ranks forgotten
    "my_buckets": 6,                              # 6,332,928 B / 10^6 rounded down, as if every bucket were full
    "my_zero2_gradients": 6332928,                # the gradients of both ranks: no sharding
    "my_zero3_ratio": 1.0,                        # "ZeRO-3 sends what DDP sends"
    "my_root_peak": 6332928,                      # the gathered model alone, the rank's own shard forgotten
    "my_update_factor": 0.25,                     # 1/m, the factor the fix applies, not the one forgotten
    "my_smallest_dp": 2,
}
HINTS = {
    "my_zero2_gradients": "a factor 2",
    "my_root_peak": "leaves out parameter shard",
}
