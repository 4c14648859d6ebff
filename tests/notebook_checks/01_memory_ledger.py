"""Lesson 01: the seed's figures, computed by the library inside the notebook, the measured runs (CPU ranks
and the real-scale fake-tensor step) and the feedback of every prediction cell."""

from __future__ import annotations

from notebook_checks import assert_no_answer_everywhere, figures, number
from parallel_lab.hardware import ClusterSpec
from parallel_lab.ledger import memory
from parallel_lab.specs import ModelSpec, Plan


def check(text: str, nb) -> None:
    for figure in ("112.00 GB", "38.50", "26.25", "14.00", "104.15 GB", "18.25 GB", "1.07 GB"):
        assert figure in text, figure
    assert "linear x2, scores x4" in text
    # the ledger's own code on the page: the optimizer's split and the rank view's three sharding conditions
    assert '"adam-mixed": (2, 2, 12),' in text
    assert '"optimizer_states": float((sharded if p.zero >= 1 else full) * o.optim_bytes),' in text
    assert figures(nb) >= 5, figures(nb)       # optimizers, ZeRO sweep, activation terms, measured rank, three plans
    # 1b. the model state of the 7B model per optimizer: 8-bit Adam's 10 B and SGD with momentum's 12 B per parameter
    assert "adam-8bit           10     14.0     14.0       42.0      70.0" in text
    assert "sgd-momentum        12     28.0     28.0       28.0      84.0" in text
    # every prediction cell gives feedback (the placeholders: "no answer yet"), never a silent pass
    checks = [c for c in nb.cells if c.cell_type == "code" and "check(" in c.source]
    assert len(checks) >= 8, len(checks)
    assert_no_answer_everywhere(text, nb)                      # exactly one Feedback per check(...)
    for c in checks:
        shown = " ".join(str(v) for o in c.outputs for v in o.get("data", {}).values())
        assert "no answer yet" in shown, c.source
    # GPT block vs llama2-7b, term by term
    assert "total                        104.15      54.49      +49.66" in text
    assert "dropout: +52.61 GB of the gap; the MLP: -2.95 GB; key/value heads: 32 vs 32" in text
    # the guided task's answer (llama2-7b, dp=8, ZeRO-3, selective, H100): the longest slider value that fits
    llama, h100 = ModelSpec.preset("llama2-7b"), ClusterSpec.preset("h100-sxm")
    fits = [q for q in (4096, 8192, 16384) if memory(llama, Plan(dp=8, zero=3, recompute="selective", seq=q),
                                                        h100).fits]
    assert fits == [4096, 8192], fits
    assert "ZeRO-0 on 2 ranks" in text    # the real run happened
    assert "measured state bytes per parameter per rank: 16.00" in text
    assert "measured state bytes per parameter per rank: 8.00" in text          # ZeRO-3 at dp=2
    assert number(r"largest relative difference over both runs and all categories: ([\d.]+)%", text) < 2
    assert "measured in fake tensors" in text
    assert "state (parameters, gradients, optimizer states): measured = ledger, 3.85 GB" in text
    for row in ("parameters              0.96           0.96   +0.0%",
                "optimizer_states        1.92           1.92   +0.0%",
                "activations             6.04           6.04   +0.0%         5.50   -9.0%",
                "logits_and_loss         4.40           4.40   +0.0%"):
        assert row in text, row
    measured = number(r"peak: measured ([\d.]+) GB", text)
    ledger_total = number(r"ledger total ([\d.]+) GB;", text)
    # the peak holds one block's attention-core backward temporaries that no category counts, and not the
    # logits or the root unit's gradient, which the total sums: with 4 blocks measured is 4-12% above it
    assert 1.04 < measured / ledger_total < 1.12, (measured, ledger_total)
    assert "comm_buffers: measured 9.28 GB (gathered units, one unit's gradient), ledger 9.28 GB" in text
    assert 2.0 < number(r"= ([\d.]+) x one block's a x s x s scores", text) < 2.6
    assert "logits_and_loss: per-op minus korthikanti = 1.00 x one s x h bf16 tensor" in text


# The answer key (tests/test_lesson_answers.py): a right answer to every question, worked out from the lesson's
# text; a plausible wrong one (the mistake in its comment); and the diagnosis the feedback must give for it.
ANSWERS = {
    "my_sgd_gb": 84,                              # 12 B per parameter x 7e9
    "my_prediction_gb": 112,                      # 16 B per parameter x 7e9
    "my_first_zero_stage": 1,
    "my_activations_gb": 104.15,
    "my_growth": {"linear": 2, "scores": 4},
    "my_gap_gb": 49.66,
    "my_state_bytes": 16887808,                   # 16 B x 1,055,488 parameters (fp32 Adam, ZeRO-0)
    "my_shard_gb": 0.9616,
    "my_longest_seq": 8192,
    "my_adam8bit_gb": 70,                         # 10 B per parameter x 7e9
}
WRONG = {
    "my_sgd_gb": 56,                              # weights and gradients, the momentum forgotten
    "my_prediction_gb": 28,                       # bf16 weights and gradients, the optimizer states forgotten
    "my_first_zero_stage": 3,                     # "only ZeRO-3 fits"
    "my_activations_gb": 18.25,                   # the s^2 attention scores forgotten
    "my_growth": {"linear": 2, "scores": 2},      # the scores taken as linear in s
    "my_gap_gb": 52.61,                           # dropout alone, the MLP's difference forgotten
    "my_state_bytes": 8443904,                    # parameters and gradients, no Adam moments
    "my_shard_gb": 7.69,                          # the whole model's fp32 parameters, not one rank's shard of 8
    "my_longest_seq": 16384,
    "my_adam8bit_gb": 112,                        # mixed-precision Adam's 16 B, the 8-bit moments missed
}
HINTS = {
    "my_sgd_gb": "momentum",
    "my_prediction_gb": "leaves out optimizer states",
    "my_activations_gb": "leaves out scores",
    "my_growth": "a factor 2 smaller",
    "my_gap_gb": "leaves out SwiGLU MLP",
    "my_state_bytes": "leaves out optimizer_states",
    "my_shard_gb": "each of the 8 ranks holds one shard",
    "my_longest_seq": "a factor 2 larger",
    "my_adam8bit_gb": "mixed-precision Adam's 16 B",
}
