"""Lesson 03: the seed's TP figure, the calls per layer, and the two runs measured equal to the prediction."""

from __future__ import annotations

import re

from notebook_checks import assert_no_answer_everywhere, figures


def _equal_pair(text: str, label: str) -> int:
    """The measured figure of a row ``label  measured  predicted`` whose two numbers must be equal."""
    m = re.search(re.escape(label) + r"\s+([\d,]+)\s+([\d,]+)", text)
    assert m, f"row {label!r} missing"
    assert m.group(1) == m.group(2), f"{label}: measured {m.group(1)} != predicted {m.group(2)}"
    return int(m.group(1).replace(",", ""))


def check(text: str, nb) -> None:
    # the picture of the split, with f and g, from the library's sharding of the tiny GPT
    assert "TP split of the MLP on tp = 2: A 128 x 512 -> 128 x 256 per rank, B 512 x 128 -> 256 x 128 per rank" in text
    assert figures(nb) >= 3, figures(nb)          # split, step inside vs across nodes, bytes
    # the seed's figure: 4 all-reduces of s*b*h*2 bytes per layer, ring 2(t-1)/t, 32 layers, t=8
    assert "TP bytes per GPU per step: 7.52 GB   (formula L * 4 * sbh*2 * 2(t-1)/t = 7.516192768 GB)" in text
    assert "forward  2 x all_reduce" in text and "backward 2 x all_reduce" in text
    assert "Plan(tp=16) on 8-GPU nodes: tp=16 spans more than one node" in text
    ratio = float(re.search(r"step time ratio: ([\d.]+)x", text).group(1))
    assert ratio > 2, ratio                       # TP across nodes: the step is several times longer
    # Korthikanti et al.: 104.15 GB on one GPU (lesson 01), sbh(10 + 24/t + 5as/ht) and sbh(34/t + 5as/ht) at t=8
    for figure in ("104.15 GB", "17.72 GB", "13.02 GB"):
        assert figure in text, figure
    assert_no_answer_everywhere(text, nb)
    assert "(1.258x: the column-parallel linears" in text      # SP sends more than TP alone, as section 5 says
    assert "tp=2 on 2 ranks" in text                            # the real runs happened
    # the library's own code is on the page before the run: ColumnParallelLinear, then f and g
    for key in ("class ColumnParallelLinear(nn.Module):", "return F.linear(x, self.weight, self.bias)",
                "class CopyToTP(torch.autograd.Function):", "class ReduceFromTP(torch.autograd.Function):",
                "return ctx.tp.all_reduce(grad.clone(memory_format=torch.contiguous_format), ctx.label), None, None",
                "return tp.all_reduce(x, label)"):
        assert key in text, key
    assert text.index("class CopyToTP") < text.index("tp=2 on 2 ranks")
    tp = _equal_pair(text, "TP payload, tp=2 ")
    assert tp == 8_388_608                    # 2 ranks x 4 layers x 4 all-reduces x (128*4*128*4 B)
    sp = _equal_pair(text, "TP payload, tp=2 + SP")
    assert sp > 2 * tp
    a_tp = _equal_pair(text, "activations, tp=2 ")
    a_sp = _equal_pair(text, "activations, tp=2 + SP")
    assert a_sp < a_tp
    for dim in ("tp ", "tp_vocab"):
        assert re.search(re.escape(dim) + r"\s+([\d,]+)\s+\1\s+equal", text), dim
    assert re.search(r"forward  all_reduce\s+8\s+8", text) and re.search(r"backward all_reduce\s+8\s+8", text)


# The answer key (tests/test_lesson_answers.py): a right answer to every question, worked out from the lesson's
# text; a plausible wrong one (the mistake in its comment); and the diagnosis the feedback must give for it.
ANSWERS = {
    "my_tp_gb": 7.52,                             # 4 all-reduces per layer x 32 layers x 2(t-1)/t x 2 s b h bytes
    "my_tiny_tp_payload": 4194304,
    "my_step_ratio": 2.3,                         # an estimate: the check allows 5% (the library: 2.298)
    "my_sp_activations_gb": 13.02,
    "my_across_factor": 7.6,
    "my_sp_factor": 1.25,
}
WRONG = {
    "my_tp_gb": 4.295,                            # each all-reduce's tensor counted once, no ring factor
    "my_tiny_tp_payload": 2097152,                # the forward's all-reduces only
    "my_step_ratio": 1.5,
    "my_sp_activations_gb": 2.28,                 # the 34 sbh/t linear part only, the scores forgotten
    "my_across_factor": 2,
    "my_sp_factor": 1.0,                          # "SP sends the same bytes as TP"
}
HINTS = {
    "my_tp_gb": "counted as its tensor once",
    "my_tiny_tp_payload": "leaves out one of",
    "my_sp_activations_gb": "leaves out 5 a s^2 b/t",
}
