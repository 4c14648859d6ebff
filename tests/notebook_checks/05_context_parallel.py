"""Lesson 05: the ledger's s vs s^2 figures, the online-softmax merge, the causal balance, and the measured runs."""

from __future__ import annotations

import re

from notebook_checks import assert_no_answer_everywhere, figures


def check(text: str, nb) -> None:
    assert_no_answer_everywhere(text, nb)
    # the pictures: s vs s^2, causal work per rank, work under a document mask, the runs' bytes, measured pairs
    assert figures(nb) >= 5, figures(nb)
    assert "contiguous busiest rank / mean: " in text and "pairs [" not in text   # a chart, not wrapped lists
    # the library's own code is on the page: the online-softmax merge, then the ring loop before the runs
    for key in ("def update(self, a: int, z: int, scores: Tensor, v: Tensor) -> None:",
                "alpha = torch.exp(m_old - ref)",
                "works = grp.exchange(kv, nxt)", "src = (grp.index - t) % n",
                "return finish_forward(ctx, state, q.dtype, qg, kv_local, grp, seq, causal)"):
        assert key in text, key
    assert text.index("works = grp.exchange(kv, nxt)") < text.index("every byte as predicted")
    for figure in ("linear terms 10.27 GB (x16), attention scores 549.76 GB (x256)",
                   "cp = 16: linear terms 0.642 GB per layer per GPU (the 8K figure: 0.642 GB)",
                   "after block B: m = 3, l = 1.5032",
                   "busiest / least busy 7.00", "zigzag     pairs per rank ['8,389,632', '8,389,632', '8,389,632', "
                   "'8,389,632'], busiest / least busy 1.00",
                   "zigzag     busiest rank / mean: 1.27", "work       busiest rank / mean: 1.03",
                   "TP 8 + SP + CP 16  activations   0.71 GB per layer"):
        assert figure in text, figure
    assert re.search(r"^allgather +forward +all_gather +1 +262,144 B  gather K and V$", text, re.M)
    merged, full = map(float, re.search(r"merged output ([\d.]+), softmax over all three keys at once ([\d.]+)",
                                        text).groups())
    assert abs(merged - full) < 1e-5 * full, (merged, full)
    # the real runs: bytes, parameters and activations measured = predicted (activations are exact here, so exact)
    assert "every byte as predicted: True; every run equal to one process (parameters within 1e-4): True" in text
    for kind in ("ring", "allgather", "ulysses"):
        row = re.search(rf"^{kind} +([\d,]+) +([\d,]+) +([\d,]+) +([\d,]+) +\S+ +([\d,]+) / ([\d,]+) ", text, re.M)
        assert row, kind
        cp_m, cp_p, dp_m, dp_p, act_m, act_p = row.groups()
        assert (cp_m, dp_m, act_m) == (cp_p, dp_p, act_p), (kind, row.groups())
    # why the all-gather sends less: the ring's backward sends K/V again with dK/dV; the all-gather keeps K/V
    assert "ring       sent per rank per layer and micro-batch: forward 131,072 B, backward 262,144 B" in text
    assert "allgather  sent per rank per layer and micro-batch: forward 131,072 B, backward 131,072 B" in text
    assert re.search(r"all-gather minus ring, activations measured: [\d,]+ B = the other rank's K and V "
                     r"\(131,072 B\) x 4 layers: True", text)
    measured, predicted = re.search(r"pairs computed per rank .*: measured (\[[\d, ]+\]), predicted from the "
                                    r"ring's tiles (\[[\d, ]+\])", text).groups()
    assert measured == predicted, (measured, predicted)
    assert "work bound on cp = 2 (zigzag, equal pairs by construction): 2.00x of a 2.00x ceiling; measured: the " \
           "pairs; not measured: the time" in text


# The answer key (tests/test_lesson_answers.py): a right answer to every question, worked out from the lesson's
# text; a plausible wrong one (the mistake in its comment); and the diagnosis the feedback must give for it.
ANSWERS = {
    "my_doc_imbalance": 1.599,                    # 262,400 / 164,096 pairs
    "my_linear_131k_gb": 10.27,                   # 16 x the 8K figure
    "my_scores_131k_gb": 549.8,                   # 256 x the 8K figure
    "my_cp": 16,
    "my_l": 1.5032,                               # (1 + e^-1) e^(2-3) + e^0
    "my_ratio": 7.0,
    "my_allgather_bytes": 262144,
    "my_explorer_ratio": 15.0,
}
WRONG = {
    "my_doc_imbalance": 1.0,                      # the zigzag taken as balanced under documents
    "my_linear_131k_gb": 0.642,                   # the 8K figure, not scaled with s
    "my_scores_131k_gb": 34.36,                   # the scores scaled by 16 like the linear terms, not by 16^2
    "my_cp": 4,                                   # sqrt(16), as if the linear terms grew with s^2
    "my_l": 2.3679,                               # the old l not rescaled by e^(m - m')
    "my_ratio": 4,                                # the degree cp
    "my_allgather_bytes": 131072,                 # this rank's K and V only
    "my_explorer_ratio": 8,                       # the degree cp
}
HINTS = {
    "my_doc_imbalance": "balances positions",
    "my_scores_131k_gb": "scaled by 16 like the linear terms",
    "my_l": "must first be rescaled",
    "my_allgather_bytes": "leaves out one of",
}
