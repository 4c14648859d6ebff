"""Lesson 09: Mixtral's counts, the ep memory and all-to-all figures, and the measured run."""

from __future__ import annotations

from notebook_checks import figures


def check(text: str, nb) -> None:
    assert figures(nb) >= 2, figures(nb)       # the lesson's two pictures
    for figure in ("active per token: 12.88B", "routed experts 45.10B of 46.70B", "ep=8: parameters  14.49 GB",
                   "capacity C = ceil(1.25 * 2 * 4096 / 8) = 1280", "= 83.89 MB = 2.5 activations",
                   "no answer yet"):
        assert figure in text, figure
    assert "ep:   9.40 GB sent per GPU per step" in text and "on nvlink4" in text
    # the library's own code is on the page before the run: the EP dispatch/combine and its all-to-all
    for key in ("class ExpertParallel:", "recv = AllToAll.apply(buf.reshape(n_exp * n, h), self.group)",
                "class AllToAll(torch.autograd.Function):", "return all_to_all(grad, ctx.group), None"):
        assert key in text, key
    # the prediction shows the run's shape and no longer names the function that answers it
    assert "tiny-moe: 2 blocks, 2 of them MoE, E = 4 experts, top-2, capacity factor 1.25, h = 64" in text
    assert not any("ep_dispatch_bytes" in c.source for c in nb.cells if c.cell_type == "markdown")
    if "4 ranks" in text:
        assert text.index("class ExpertParallel:") < text.index("4 ranks")
    if "4 ranks" in text:                          # the real run happened
        assert "largest parameter difference against one process: " in text
        lines = [ln.split() for ln in text.splitlines()]
        for row in lines:
            if row and row[0] in ("ep", "dp", "pp") and len(row) == 3 and row[1][0].isdigit():
                assert row[1] == row[2], row          # measured == predicted bytes
            if row and row[0] in ("parameters", "gradients", "optimizer_states", "activations") and len(row) == 3:
                assert row[1] == row[2], row
        assert "tokens each expert rank computed" in text


# The answer key (tests/test_lesson_answers.py): a right answer to every question, worked out from the lesson's
# text; a plausible wrong one (the mistake in its comment); and the diagnosis the feedback must give for it.
ANSWERS = {
    "my_active_billions": 12.88,                   # the dense part 1.60B + 2 of 8 experts 11.27B
    "my_params_gb_ep8": 14.49,                    # the dense part and one expert per block, bf16
    "my_dispatch_mb": 83.89,                      # E b C h x 2 bytes
    "my_ep_bytes": 2621440,
    "my_capacity_factor": 2.0,
}
WRONG = {
    "my_active_billions": 11.27,                  # the two experts only, the dense part forgotten
    "my_params_gb_ep8": 11.27,                    # the one expert per block only, the dense part forgotten
    "my_dispatch_mb": 33.55,                      # one activation s h x 2 bytes, no capacity slots
    "my_ep_bytes": 1310720,                       # one step of the two
    "my_capacity_factor": 1.25,                   # the default
}
HINTS = {
    "my_active_billions": "leaves out dense part",
    "my_params_gb_ep8": "leaves out dense part",
    "my_dispatch_mb": "that is one activation",
    "my_ep_bytes": "count 2 steps",
}
