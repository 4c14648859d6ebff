"""Lesson 06: the grid's groups, the bytes per dimension and tier, the 16-rank 4-D run, the planner, the plan file."""

from __future__ import annotations

import ast
import re

from notebook_checks import assert_no_answer_everywhere, figures, markdown_of
from parallel_lab import planner
from parallel_lab.hardware import ClusterSpec
from parallel_lab.quantities import fmt_seconds
from parallel_lab.specs import ModelSpec, Plan

#: Meta's settings, as in tests/test_llama3_published.py (the lesson builds its 8K and 131K plans from them)
META = dict(tp=8, pp=16, sp=True, zero=2, zero2_accumulate="sharded", optimizer="adam-mixed-fp32-grad",
            attention="flash", mlp="fused", recompute="none", schedule="interleaved", interleave=8,
            pp_split="embed-head", micro_batch=1)


def check(text: str, nb) -> None:
    assert_no_answer_everywhere(text, nb)
    # the grid's own code on the page (rank -> coordinates, a group along one axis), then its picture
    assert "rest, tp = divmod(rank, plan.tp)" in text
    assert "return [rank_of(plan, **{**c, dim: i}) for i in range(sizes[dim])]" in text
    assert "groups that cross nodes: tp 0 of 8, cp 32 of 32, pp 32 of 32, dp 32 of 32" in text
    assert figures(nb) >= 3, figures(nb)          # the grid on nodes, the 4-D run's bytes, the planner's plans
    # Meta's 8K and 131K plans under the settings of tests/test_llama3_published.py fit, and DP's bytes are said
    assert "ledger: 63.9 GB per GPU on its fullest stage (1) of 72 GB usable; fits: True" in text
    assert re.search(r"ledger: [\d.]+ GB per GPU; fits: True", text)
    meta = Plan(dp=128, seq=8192, grad_accum=16, **META)
    est = planner.evaluate(ModelSpec.preset("llama3-405b"), ClusterSpec.preset("h100-sxm"), meta)
    dp_exposed = fmt_seconds(est.exposed_s["dp"])
    shown = re.search(r"DP calls per step: 128 x reduce_scatter, 8 x all_gather \(16 micro-batches\); DP sends "
                      r"0\.69 x TP's bytes, 4\.35 s on ib-400g of which the step model leaves (\S+ m?s) exposed", text)
    assert shown and shown.group(1) == dp_exposed, dp_exposed
    assert "last stage minus stage 0 (ledger, bytes): parameters +512, gradients +512, optimizer_states +1,024" in text
    for figure in ("rank 11 belongs to: tp [10, 11], cp [9, 11], pp [11, 15], dp [3, 11]",
                   "tp groups: [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9], [10, 11], [12, 13], [14, 15]]",
                   "dp groups: [[0, 8], [1, 9], [2, 10], [3, 11], [4, 12], [5, 13], [6, 14], [7, 15]]",
                   "tp                 1,281                 301 GB  nvlink4",
                   "TP per step: 695 ms on nvlink4, 6.1 s on ib-400g",
                   "cp             256 calls    16.1 GB per GPU per step on ib-400g",
                   "torchrun --nnodes=8 --nproc-per-node=2"):
        assert figure in text, figure
    # the grid's order is credited to Llama 3, not to Megatron or torchtitan (both put PP outermost)
    prose_md = "\n".join(c.source for c in nb.cells if c.cell_type == "markdown")
    assert "default order is tp-cp-ep-dp-pp" in prose_md.replace("\n", " ")
    assert "like Megatron and torchtitan" not in prose_md
    # the InfiniBand prediction shows what it needs: the latency, the ring steps and the bytes of each kind
    assert re.search(r"ib-400g: bandwidth 50 GB/s per GPU per direction, latency [\d.]+ us per ring step", text)
    assert re.search(r"TP all_reduce\s+[\d,]+ calls over 8 GPUs, 14 ring steps each", text)
    # the guided task's text and explorer agree on the plan
    assert any('GridExplorer(model="llama2-7b", dp=2, tp=2, pp=2, cp=2' in c.source for c in nb.cells)
    # the planner's best for 70B on 32 H100s: TP 8 in a node, no pipeline; an exact tie is named, not hidden
    best = re.search(r"^best: (tp8 cp\d pp1 dp\d z3)", text, re.M)
    assert best, "best plan line"
    tied = re.search(r"^tied at the best step time: (.*)$", text, re.M).group(1).split(", ")
    assert any(t.startswith(best.group(1) + " ") for t in tied), (best.group(1), tied)
    assert all(t.startswith("tp8 ") for t in tied), tied    # every tied plan fills a node with TP
    prose = markdown_of(nb)
    assert f"{len(tied)} plans tie for first place" in prose if len(tied) > 1 else "No other plan" in prose
    rejected = ast.literal_eval(re.search(r"rejected: (\{.*\})$", text, re.M).group(1))
    assert "Rejected families: " + ", ".join(f"{n} ({why})" for why, n in rejected.items()) in prose, rejected
    assert f"overlap the compute: {dp_exposed} left exposed" in prose
    assert "16 ranks," in text                   # the real 4-D run happened
    assert "equal to one process: True; every dim's bytes as predicted: True" in text
    for dim in ("dp", "tp", "tp_vocab", "pp", "cp"):
        row = re.search(rf"^{dim} +([\d,]+) +([\d,]+)  equal$", text, re.M)
        assert row and row.group(1) == row.group(2), dim
    for cat in ("parameters", "gradients", "optimizer_states"):
        m0, e0, m1, e1 = re.search(rf"^{cat} +([\d,]+) +([\d,]+) +([\d,]+) +([\d,]+)$", text, re.M).groups()
        assert (m0, m1) == (e0, e1), (cat, m0, e0, m1, e1)


# The answer key (tests/test_lesson_answers.py): a right answer to every question, worked out from the lesson's
# text; a plausible wrong one (the mistake in its comment); and the diagnosis the feedback must give for it.
ANSWERS = {
    "my_pp_message_bytes": 131072,                # 4 x 64 tokens x 128 x 4 B
    "my_rank": 11,                                # ((1 x 2 + 0) x 2 + 1) x 2 + 1, tp fastest
    "my_groups": 32,                              # 8 groups of 2 along each of 4 dims
    "my_tp_on_ib_s": 6.1,                         # an estimate: the check allows 5%
    "my_best_tp": 8,
    "my_ib_gb": 5.054,                            # the dp traffic alone crosses ib-400g
}
WRONG = {
    "my_pp_message_bytes": 262144,                # the whole sequence, CP forgotten
    "my_rank": 13,                                # dp taken as the fastest dimension
    "my_groups": 8,                               # the groups of one dimension only
    "my_tp_on_ib_s": 3.05,                         # the card taken as 100 GB/s (both directions)
    "my_best_tp": 4,                               # half a node: TP kept small to save bytes
    "my_ib_gb": 8.275,                            # dp and cp, as if the cp groups crossed the nodes too
}
HINTS = {
    "my_pp_message_bytes": "half of the sequence",
    "my_tp_on_ib_s": "a factor 2 smaller",
    "my_best_tp": "a factor 2 smaller",
}
