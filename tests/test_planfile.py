"""Plan files: round trip, validation errors, the example files under examples/plans/."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from parallel_lab import comm, ledger
from parallel_lab.errors import ParallelLabError
from parallel_lab.hardware import ClusterSpec, LinkTier
from parallel_lab.planfile import (
    PlanFile,
    ReplanCondition,
    expectations,
    load_plan,
    make_plan_file,
    meta_examples,
    save_plan,
    tiny_examples,
)
from parallel_lab.specs import ModelSpec, Plan

EXAMPLES = Path(__file__).resolve().parent.parent / "examples" / "plans"
TINY = ModelSpec.preset("tiny-llama")
CPU = ClusterSpec.preset("cpu-gloo")


def tiny_file() -> PlanFile:
    plan = Plan(dp=2, zero=3, seq=128, micro_batch=4, dtype="fp32", optimizer="adam-fp32")
    return make_plan_file(TINY, CPU, plan, phase="tiny-dp2-zero3")


def test_round_trip(tmp_path):
    pf = tiny_file()
    path = tmp_path / "plan.yaml"
    written = save_plan(path, pf)
    assert written == pf
    back = load_plan(path)
    assert back == pf
    assert back.plan == pf.plan and back.model == TINY and back.cluster == CPU
    # a second round trip writes the same text
    save_plan(tmp_path / "again.yaml", back)
    assert (tmp_path / "again.yaml").read_text() == path.read_text()


def test_round_trip_custom_model_and_cluster(tmp_path):
    model = ModelSpec(layers=6, hidden=256, heads=8, kv_heads=4, ffn=688, vocab=1000, flavour="llama",
                      name="my-model")
    cluster = ClusterSpec("lab", 4, 24e9, 100e12, LinkTier("pcie", 25e9, 5e-6), LinkTier("eth", 5e9, 20e-6))
    plan = Plan(dp=2, tp=2, pp=3, grad_accum=6, schedule="zb-h1", seq=512)
    pf = make_plan_file(model, cluster, plan, phase="custom.1", gpus=12)
    save_plan(tmp_path / "c.yaml", pf)
    data = yaml.safe_load((tmp_path / "c.yaml").read_text())
    assert isinstance(data["model"], dict) and isinstance(data["cluster"], dict)
    assert load_plan(tmp_path / "c.yaml") == pf


def test_expectations_are_the_analytic_core():
    pf = tiny_file()
    led = ledger.memory(TINY, pf.plan, CPU)
    assert pf.expected.memory_bytes_per_gpu["total"] == led.total_bytes
    assert pf.expected.memory_bytes_per_gpu["parameters"] == led.per_gpu_bytes["parameters"]
    assert pf.expected.bytes_per_step == comm.report(TINY, pf.plan, CPU).per_step_bytes
    assert pf.expected.bubble_ratio == 0.0 and pf.expected.fits


def test_needs_replan():
    pf = tiny_file()
    assert pf.needs_replan(seq=128, gpus=2) == []
    broken = pf.needs_replan(seq=256, gpus=4, global_batch=8)
    assert [c.field for c in broken] == ["seq", "gpus"]
    assert all(isinstance(c, ReplanCondition) and c.reason for c in broken)


def _write(tmp_path, text: str) -> Path:
    p = tmp_path / "x.yaml"
    p.write_text(text + "\n# end of plan file\n")
    return p


def _good_data() -> dict:
    return tiny_file().to_dict()


def test_corrupted_yaml(tmp_path):
    good = (tmp_path / "g.yaml")
    save_plan(good, tiny_file())
    text = good.read_text().replace("plan:\n  dp: 2", "plan:\n  dp: [2\n")
    with pytest.raises(ParallelLabError, match=r"x.yaml is not valid YAML at line \d+"):
        load_plan(_write(tmp_path, text))
    with pytest.raises(ParallelLabError, match="must be a mapping"):
        load_plan(_write(tmp_path, "- just\n- a list\n"))
    with pytest.raises(ParallelLabError, match="cannot be read"):
        load_plan(tmp_path / "missing.yaml")


def test_unknown_version_and_fields(tmp_path):
    d = _good_data()
    d["schema_version"] = 2
    with pytest.raises(ParallelLabError, match=r"schema_version 2 is not known; this parallel_lab reads 1"):
        load_plan(_write(tmp_path, yaml.safe_dump(d)))
    d = _good_data()
    del d["schema_version"]
    with pytest.raises(ParallelLabError, match="no schema_version"):
        load_plan(_write(tmp_path, yaml.safe_dump(d)))
    d = _good_data()
    d["colour"] = "blue"
    with pytest.raises(ParallelLabError, match=r"unknown field\(s\) \['colour'\]"):
        load_plan(_write(tmp_path, yaml.safe_dump(d)))
    d = _good_data()
    d["plan"]["pipeline"] = 2
    with pytest.raises(ParallelLabError, match=r"x.yaml: unknown plan field\(s\) \['pipeline'\]"):
        load_plan(_write(tmp_path, yaml.safe_dump(d)))
    d = _good_data()
    d["expected"]["joy"] = 1
    with pytest.raises(ParallelLabError, match=r"expected: unknown field\(s\) \['joy'\]"):
        load_plan(_write(tmp_path, yaml.safe_dump(d)))


def test_invalid_plan_for_the_model(tmp_path):
    d = _good_data()
    d["plan"]["tp"] = 3
    d["gpus"] = 6
    with pytest.raises(ParallelLabError, match=r"x.yaml: tp=3 does not divide heads=4"):
        load_plan(_write(tmp_path, yaml.safe_dump(d)))
    d = _good_data()
    d["gpus"] = 4
    with pytest.raises(ParallelLabError, match="must multiply to the number of GPUs"):
        load_plan(_write(tmp_path, yaml.safe_dump(d)))
    d = _good_data()
    d["model"] = "llama-9000"
    with pytest.raises(ParallelLabError, match="model preset 'llama-9000' is not known"):
        load_plan(_write(tmp_path, yaml.safe_dump(d)))
    d = _good_data()
    d["phase"] = "pre train!"
    with pytest.raises(ParallelLabError, match="phase"):
        load_plan(_write(tmp_path, yaml.safe_dump(d)))


# ---- the example files ----------------------------------------------------------------------------

def test_tiny_examples_are_generated_by_this_code():
    made = {**tiny_examples(), **meta_examples()}
    assert "tiny-dp2-zero3" in made and made["llama3-405b-meta-8k"].engine == "torchtitan"
    for name, pf in made.items():
        path = EXAMPLES / f"{name}.yaml"
        assert path.exists(), f"{path} missing: run parallel_lab.planfile.write_examples('examples/plans')"
        assert load_plan(path) == pf, f"{path} is stale: regenerate with planfile.write_examples"


def test_tiny_dp2_zero3_example_is_runnable_shape():
    pf = load_plan(EXAMPLES / "tiny-dp2-zero3.yaml")
    assert pf.model.name == "tiny-llama" and pf.gpus == 2
    assert (pf.plan.dp, pf.plan.zero, pf.plan.dtype, pf.plan.optimizer, pf.plan.seq) == (2, 3, "fp32",
                                                                                        "adam-fp32", 128)


@pytest.mark.parametrize("name,phase,seq", [("llama3-405b-planner-8k", "pretrain-8k", 8192),
                                            ("llama3-405b-planner-131k", "long-context-131k", 131072)])
def test_405b_examples_load_and_match_the_core(name, phase, seq):
    # written by `parallel-lab plan ... --save` (the planner's best plan) before plan files named their engine:
    # they load as plans for the lab's engine; their expectations are still what the ledger and comm module say
    pf = load_plan(EXAMPLES / f"{name}.yaml")
    assert "engine" not in (EXAMPLES / f"{name}.yaml").read_text() and pf.engine == "lab"
    assert pf.phase == phase and pf.plan.seq == seq and pf.gpus == 16384
    assert pf.plan.global_batch_tokens == 16 * 2**20
    again = expectations(pf.model, pf.cluster, pf.plan)
    assert again.memory_bytes_per_gpu == pytest.approx(pf.expected.memory_bytes_per_gpu, rel=1e-12)
    assert again.bytes_per_step == pytest.approx(pf.expected.bytes_per_step, rel=1e-12)
    assert again.step_time_s == pytest.approx(pf.expected.step_time_s, rel=1e-9)
    assert pf.expected.fits


# ---- issue 18: the schema, bounded parsing, atomic save ---------------------------------------------------

def _write_bytes(tmp_path, raw: bytes, end: bool = True) -> Path:
    p = tmp_path / "x.yaml"
    p.write_bytes(raw + (b"\n# end of plan file\n" if end else b""))
    return p


def _refused(tmp_path, data_or_raw, *words: str) -> str:
    raw = data_or_raw if isinstance(data_or_raw, bytes) else yaml.safe_dump(data_or_raw).encode()
    with pytest.raises(ParallelLabError) as info:
        load_plan(_write_bytes(tmp_path, raw))
    msg = str(info.value)
    assert "\n" not in msg and len(msg) < 700 and "x.yaml" in msg
    for w in words:
        assert w in msg, (w, msg)
    return msg


def test_a_plan_file_without_seq_is_refused_naming_it(tmp_path):
    """Was: loaded with Plan's default seq 2048 while its own expected/replan_when said 128."""
    d = _good_data()
    del d["plan"]["seq"]
    _refused(tmp_path, d, "plan: missing field(s) ['seq']")


@pytest.mark.parametrize("path,value,words", [
    (("schema_version",), 1.0, ["schema_version 1.0 is not known", "an integer"]),
    (("schema_version",), True, ["schema_version True"]),
    (("gpus",), "2", ["gpus='2'"]),
    (("plan", "tp"), 1.0, ["plan.tp=1.0"]),
    (("plan", "sp"), "no", ["plan.sp='no'", "true or false"]),
    (("plan", "bucket_mb"), float("nan"), ["plan.bucket_mb=nan"]),
    (("expected", "fits"), "yes", ["expected.fits='yes'"]),
    (("expected", "bubble_ratio"), float("inf"), ["expected.bubble_ratio=inf"]),
    (("expected", "memory_stage"), 5, ["memory_stage=5", "0..0"]),
    (("expected", "mfu"), 3.0, ["expected.mfu=3.0"]),
    (("expected", "memory_bytes_per_gpu"), [1, 2], ["expected.memory_bytes_per_gpu must be a mapping"]),
    (("expected", "bytes_per_step", "dp"), -5, ["expected.bytes_per_step.dp=-5"]),
    (("replan_when",), {"field": "seq"}, ["replan_when must be a list"]),
])
def test_types_and_ranges_are_checked(tmp_path, path, value, words):
    d = _good_data()
    node = d
    for k in path[:-1]:
        node = node[k]
    node[path[-1]] = value
    _refused(tmp_path, d, *words)


def test_replan_when_entries_are_checked_and_agree_with_the_plan(tmp_path):
    d = _good_data()
    d["replan_when"][0]["value"] = "128"
    _refused(tmp_path, d, "replan_when[0].value='128'")
    d = _good_data()
    d["replan_when"][0]["field"] = "weather"
    _refused(tmp_path, d, "replan_when[0].field='weather' is not known")
    d = _good_data()
    del d["replan_when"][1]["reason"]
    _refused(tmp_path, d, "replan_when[1]: missing field(s) ['reason']")
    d = _good_data()
    d["replan_when"][0]["value"] = 2048
    _refused(tmp_path, d, "says seq=2048 but the file's plan has seq=128")
    d = _good_data()
    del d["replan_when"]                                      # documented default: []
    assert load_plan(_write_bytes(tmp_path, yaml.safe_dump(d).encode())).replan_when == []


def test_every_required_field_is_required(tmp_path):
    for top in ("phase", "model", "cluster", "gpus", "plan", "expected"):
        d = _good_data()
        del d[top]
        _refused(tmp_path, d, f"missing field(s) ['{top}']")
    for key in ("memory_bytes_per_gpu", "memory_stage", "fits", "bytes_per_step", "bubble_ratio"):
        d = _good_data()
        del d["expected"][key]
        _refused(tmp_path, d, f"expected: missing field(s) ['{key}']")
    d = _good_data()
    del d["expected"]["mfu"], d["expected"]["step_time_s"]   # documented default: null
    pf = load_plan(_write_bytes(tmp_path, yaml.safe_dump(d).encode()))
    assert pf.expected.mfu is None and pf.expected.step_time_s is None


def test_truncated_files_never_load(tmp_path):
    good = (EXAMPLES / "tiny-pp2-1f1b.yaml").read_bytes()
    cuts = sorted({len(good) * k // 29 for k in range(1, 29)} | {good.rindex(b"\n- field")})
    loaded = []
    for n in cuts:
        try:
            load_plan(_write_bytes(tmp_path, good[:n], end=False))
            loaded.append(n)
        except ParallelLabError:
            pass
    assert loaded == [], loaded
    with pytest.raises(ParallelLabError, match="does not end with the line '# end of plan file': it was cut short"):
        load_plan(_write_bytes(tmp_path, good[:good.rindex(b"\n- field")], end=False))


def test_yaml_bombs_deep_nesting_and_huge_numbers_are_refused_fast(tmp_path):
    import time

    good = (EXAMPLES / "tiny-pp2-1f1b.yaml").read_bytes()
    bomb = b"a: &a [x, x, x, x, x, x, x, x, x]\n" + b"".join(
        f"{chr(98 + i)}: &{chr(98 + i)} [" .encode() + b", ".join([f"*{chr(97 + i)}".encode()] * 9) + b"]\n"
        for i in range(9))
    assert len(bomb) < 2000                                   # ~9^10 strings when expanded
    t0 = time.process_time()                                 # CPU time: the machine is shared
    _refused(tmp_path, bomb, "anchors and aliases", "line 1")
    _refused(tmp_path, good.replace(b"phase: ", b"phase: &p ", 1), "anchors and aliases")
    _refused(tmp_path, good + b"\nx: " + b"[" * 1000 + b"]" * 1000 + b"\n", f"nesting deeper than {8}")
    _refused(tmp_path, good.replace(b"gpus: 2", b"gpus: " + b"9" * 4300, 1), "gpus=999", "2^53")
    _refused(tmp_path, good.replace(b"gpus: 2", b"gpus: " + b"9" * 5000, 1), "cannot be read")
    _refused(tmp_path, good + b"\n\xff\xfe bad\n", "not UTF-8", "byte")
    _refused(tmp_path, good + b"\nphase: again\n", "'phase' appears twice")
    _refused(tmp_path, good + b"\n" + b"#" * (300 * 1024), "bytes; a plan file is at most")
    _refused(tmp_path, b"x: !!python/object/apply:os.system [echo hi]\n", "not valid YAML")
    assert time.process_time() - t0 < 2.0


def test_save_is_atomic(tmp_path, monkeypatch):
    """A save interrupted before the rename leaves the old file whole and no temporary file behind."""
    import os

    path = tmp_path / "p.yaml"
    save_plan(path, tiny_file())
    before = path.read_bytes()

    def interrupted(src, dst):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", interrupted)
    other = make_plan_file(TINY, CPU, Plan(dp=2, seq=64, micro_batch=4, dtype="fp32", optimizer="adam-fp32"),
                           phase="other")
    with pytest.raises(ParallelLabError, match="No space left on device"):
        save_plan(path, other)
    assert path.read_bytes() == before and sorted(p.name for p in tmp_path.iterdir()) == ["p.yaml"]


def test_a_plan_file_records_its_engine_and_a_torchtitan_plan_is_what_torchtitan_runs(tmp_path):
    d = _good_data()
    assert "engine" not in d or d.pop("engine")
    p = _write_bytes(tmp_path, yaml.safe_dump(d).encode())
    assert load_plan(p).engine == "lab"                                   # a file without the field
    d["engine"] = "megatron"
    _refused(tmp_path, d, "engine='megatron' is not known", "lab, torchtitan")
    d["engine"] = "torchtitan"
    d["plan"]["attention"] = "eager"
    _refused(tmp_path, d, "engine=torchtitan but attention=eager")
    pf = meta_examples()["llama3-405b-meta-8k"]
    save_plan(tmp_path / "m.yaml", pf)
    assert "engine: torchtitan" in (tmp_path / "m.yaml").read_text() and load_plan(tmp_path / "m.yaml") == pf
    with pytest.raises(ParallelLabError, match="engine=torchtitan but schedule=zb-h1"):
        make_plan_file(pf.model, pf.cluster, pf.plan.with_(schedule="zb-h1", interleave=1, pp_split="layers"),
                       phase="x", engine="torchtitan")
