"""Held-out step-time errors: fitted on one published set, every other published set the project holds.

The A100 sets are Megatron-LM's PTD-P runs (GPT 174.6B and 529.6B; Narayanan et al. 2021, Table 2) and the
FlashAttention-2 paper's GPT-3 1.3B runs (Dao 2023, Table 1); the H100 set is Llama 3 405B (Dubey et al.
2024, Table 4). A fit never sees the rows it is tested on (checked by name). The table and its reading:
docs/validation.md, "Held out: fitted on one set, tested on the others".
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from parallel_lab.calibrate import Run, fit_profile, load_runs, predicted_tflops, with_attention_kernel
from parallel_lab.hardware import FITTED_PROFILES, ClusterSpec

CAL = Path(__file__).resolve().parents[1] / "examples" / "calibration"
#: every fit here starts from the prior preset (no fitted constant): the default preset's profile is what is tested
A100 = ClusterSpec.preset("a100-80gb-prior")


def _sets() -> dict[str, list[Run]]:
    return {"megatron": load_runs(CAL / "megatron_2021.csv"), "fa2": load_runs(CAL / "flashattention2_2023.csv")}


def _cases(sets: dict[str, list[Run]]) -> list[tuple[str, list[Run], list[Run]]]:
    """(label, the rows fitted on, the rows held out): each set whole against the other, and one row of each
    against every row of another model."""
    meg, fa2 = sets["megatron"], sets["fa2"]
    return [("megatron, all 6", meg, fa2),
            ("fa2, both", fa2, meg),
            ("megatron 174.6B 384", meg[:1], meg[3:] + fa2),
            ("fa2 2K", fa2[:1], meg)]


def heldout_errors(cluster: ClusterSpec) -> dict[str, dict[str, float]]:
    """label -> {held-out run: predicted / measured - 1} with the profile fitted on that case's rows."""
    out = {}
    for label, fit_rows, held in _cases(_sets()):
        fitted, _ = fit_profile(fit_rows, cluster)
        seen = fitted.profile.source.partition(": ")[2].split(", ")
        assert seen == [r.name for r in fit_rows] and not {r.name for r in held} & set(seen), label
        out[label] = {r.name: predicted_tflops(r, fitted) / r.tflops_per_gpu - 1 for r in held}
    return out


def _worst(errors: dict[str, dict[str, float]]) -> float:
    return max(abs(e) for case in errors.values() for e in case.values())


def test_the_held_out_errors_with_and_without_the_memory_bound_term():
    """With the memory-bound term the worst held-out error over 1.3B to 529.6B is 8.7% (fitted on the
    FlashAttention-2 rows, the 529.6B 2,240-GPU row); without it (no HBM bandwidth: the roofline alone) 10.2%.
    Fitted on the 174.6B row, the 529.6B rows go from 8.9-10.1% slow to 4.2-5.5% slow."""
    after, before = heldout_errors(A100), heldout_errors(replace(A100, hbm_bandwidth=0.0))
    assert _worst(after) < 0.09 and _worst(before) > 0.10, (_worst(after), _worst(before))
    one_row = "megatron 174.6B 384"
    big = [n for n in after[one_row] if "529.6B" in n]
    assert all(-0.06 < after[one_row][n] < -0.04 for n in big), after[one_row]
    assert all(-0.11 < before[one_row][n] < -0.08 for n in big), before[one_row]


def test_the_fitted_presets_are_the_fits_of_their_set():
    """The default ``a100-80gb`` carries calibrate's fit to the six Megatron rows; ``h100-sxm`` its fit to Llama
    3's 8K 16,384-GPU row counted causally with cuDNN's speed, which predicts the other two rows within 1.5%;
    both refitted here from the ``-prior`` presets. ``h200`` takes H100's fit and says it is untested there."""
    meg = _sets()["megatron"]
    a100, _ = fit_profile(meg, A100)
    shipped = ClusterSpec.preset("a100-80gb").profile
    assert shipped == FITTED_PROFILES["a100-80gb"] and "Narayanan et al. 2021" in shipped.source
    assert a100.profile.matmul_efficiency == pytest.approx(shipped.matmul_efficiency, abs=1e-4)
    assert a100.profile.attention_efficiency == shipped.attention_efficiency
    llama = load_runs(CAL / "llama3_405b.csv", "causal")
    h100, _ = fit_profile([llama[1]], with_attention_kernel(ClusterSpec.preset("h100-sxm-prior"), "cudnn"))
    preset = ClusterSpec.preset("h100-sxm")
    assert "Dubey et al. 2024" in preset.profile.source
    assert h100.profile.matmul_efficiency == pytest.approx(preset.profile.matmul_efficiency, abs=1e-4)
    assert preset.profile.attention_efficiency == h100.profile.attention_efficiency
    for r in (llama[0], llama[2]):
        assert abs(predicted_tflops(r, preset) / r.tflops_per_gpu - 1) < 0.015, r.name
    h200 = ClusterSpec.preset("h200").profile
    assert h200.source.startswith("H100's fit, untested on H200") and \
        replace(h200, source=preset.profile.source) == preset.profile
    for name in ("a100-80gb", "h100-sxm", "h200"):
        assert ClusterSpec.preset(f"{name}-prior").profile is None
        assert replace(ClusterSpec.preset(name), name=f"{name}-prior", profile=None) == \
            ClusterSpec.preset(f"{name}-prior")


def test_the_term_is_what_the_bytes_say():
    """One block of GPT 174.6B (tp 8, no SP, micro-batch 1, 2K, eager core, dropout) moves per token
    2 x 2h + 2 x 3h bytes of norms and adds at 2 B plus 2h mask bytes, the gelu 2 ffn / 8, the softmax
    2 x 12 heads x 2048 and dropout (2 x 2 + 1) x 12 x 2048; backward twice, full recompute once more."""
    from parallel_lab.membound import block_bytes, block_forward_bytes
    from parallel_lab.specs import ModelSpec
    m = ModelSpec.preset("megatron-175b")
    h, s = 12288, 2048
    per_token = (10 * h * 2 + 2 * h) + 2 * (4 * h // 8) * 2 + 2 * 12 * s * 2 + 5 * 12 * s
    fwd, core = block_forward_bytes(m, s, 8, 1, False, 1, "eager")
    assert fwd == s * per_token and core == s * (2 * 12 * s * 2 + 5 * 12 * s)
    assert block_bytes(m, s, 8, 1, False, 1, "full", "eager") == 4 * fwd
    assert block_bytes(m, s, 8, 1, True, 1, "none", "flash") < fwd      # SP divides the norm region by tp


def test_the_term_counts_the_tensors_the_activation_model_saves():
    """The term's shapes are the per-op activation model's: an eager GPT block without recomputation saves
    the softmax's probabilities, the dropout's mask and dropped probabilities, and the gelu's input; the
    term's core moves the first twice (read the scores, write them) and the other two once each, and its
    activation reads the gelu's input and writes its output."""
    from parallel_lab.activations import block_saves
    from parallel_lab.membound import block_forward_bytes
    from parallel_lab.specs import ModelSpec, Plan
    m, plan = ModelSpec.preset("megatron-175b"), Plan(tp=8, seq=2048, micro_batch=2)
    saved = {(x.op, x.tensor): x.nbytes for x in block_saves(m, plan)}
    probs, mask = saved[("core.softmax", "probabilities")], saved[("core.dropout", "mask")]
    dropped, fc = saved[("core.pv", "dropped probabilities")], saved[("gelu", "fc output")]
    fwd, core = block_forward_bytes(m, 2048, 8, 1, False, 2, "eager")
    assert core == 2 * probs + probs + dropped + mask
    norm_region = 2 * saved[("attn_norm", "input")] + 3 * saved[("attn_norm", "input")]
    masks = 2 * saved[("attn dropout", "mask")]
    assert fwd == 2 * norm_region + masks + 2 * fc + core


def test_the_fitted_a100_preset_ranks_megatrons_plans():
    """With ``a100-80gb`` (its fitted profile) and the paper's recomputation, schedule and micro-batch (full, 1F1B,
    1; no SP, ZeRO 0, cp 1), the published 174.6B degrees (dp 4 tp 8 pp 12) are 7th of 25, 6.1% behind dp 6 tp 4 pp 16
    (4th and 2.9% behind without the term: docs/validation.md); the 529.6B degrees (dp 2 tp 8 pp 35) lead."""
    from parallel_lab.planner import plan_search
    from parallel_lab.planner_constraints import Constraints
    cluster = ClusterSpec.preset("a100-80gb")
    cons = Constraints(fixed={"recompute": "full", "micro_batch": 1, "schedule": "1f1b", "sp": False, "zero": 0,
                              "cp": 1})
    meg = _sets()["megatron"]
    for r, rank, behind in ((meg[0], 7, 0.061), (meg[3], 1, 0.0)):
        p = r.plan
        res = plan_search(r.model, cluster, p.world, p.seq, global_batch=p.dp * p.micro_batch * p.grad_accum,
                          constraints=cons)
        assert res.rank_of(tp=p.tp, pp=p.pp, dp=p.dp) == rank, r.name
        top = res.top(rank)
        assert top[-1].step_time_s / top[0].step_time_s - 1 == pytest.approx(behind, abs=0.001), r.name
        if rank > 1:
            assert (top[0].fields["dp"], top[0].fields["tp"], top[0].fields["pp"]) == (6, 4, 16)


def _pct(x: float) -> str:
    return f"{x:+.1%}".replace("-0.0%", "+0.0%")


def test_the_default_presets_before_and_after_on_the_published_rows():
    """docs/validation.md, "The default presets, before and after": each published row's step time on the
    ``-prior`` preset (fixed half of peak) and on the default (fitted) one, against the step time its throughput
    implies (Llama 3 counted causally); every cell of the table is this computation's."""
    import re

    from parallel_lab.planner import evaluate
    doc = (CAL.parents[1] / "docs" / "validation.md").read_text()
    table = doc.split("### The default presets, before and after")[1].split("How the planner ranks")[0]
    shown = {m[0]: m[1:] for m in re.findall(r"^\| ([\w.\- ]+ (?:GPUs|A100)) \| ([\d.]+) \| ([^|]+) \| ([^|]+) \|",
                                             table, re.M)}
    rows = [(r, "h100-sxm") for r in load_runs(CAL / "llama3_405b.csv", "causal")]
    rows += [(r, "a100-80gb") for s in _sets().values() for r in s]
    assert set(shown) == {r.name for r, _ in rows}
    for r, gpu in rows:
        implied = r.model_flops() / (r.tflops_per_gpu * 1e12 * r.plan.world)
        before, after = (evaluate(r.model, ClusterSpec.preset(name), r.plan).step_time_s
                         for name in (f"{gpu}-prior", gpu))
        want = (f"{implied:.3f}", f"{before:.3f} ({_pct(before / implied - 1)})",
                f"{after:.3f} ({_pct(after / implied - 1)})")
        assert tuple(x.strip() for x in shown[r.name]) == want, r.name
