"""The exercises as a course: order, prerequisite lesson, time, points and written questions of each one.

``EXERCISES`` lists them in the handout's order (``exercises/README.md``); ``parallel-lab grade --list``
prints it as a table. ``points`` is the total of the public and the hidden tests (``@points(n)`` of each
``test_`` function, 1 unless stated; ``tests/grading/test_catalog.py`` counts them); ``minutes`` is an
estimate for a learner who has read the lesson. ``questions`` are the written answers an exercise asks
for (ungraded): a ``.py`` submission holds each as a module-level string named after the key in upper
case, a ``.yaml`` one as comment lines ``# key: text``. ``written_answers(exercise, path)`` reads them
without running the submission; the batch CSV carries them to the teacher. Pure Python, no torch.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass, field
from pathlib import Path


@dataclass(frozen=True)
class Exercise:
    name: str
    kind: str                 # predict, implement or design
    lesson: str               # the notebook(s) to read first
    minutes: int
    points: int               # public + hidden tests
    topic: str
    questions: dict[str, str] = field(default_factory=dict)


BUBBLE_VS_MEMORY = ("1F1B has the bubble of GPipe; interleaving divides it by v and ZB-H1 shrinks it further. "
                    "What does each of them cost in activation memory or in messages, and when would you "
                    "accept the larger bubble? (a few sentences, ungraded)")
WHY_PLAN = ("Why does your plan beat the step time: which collectives does it expose or hide, what does its "
            "ZeRO stage save, what does its bubble cost, and what did you try that lost? (a few sentences, "
            "ungraded)")

EXERCISES: tuple[Exercise, ...] = (
    Exercise("predict_ledger", "predict", "01", 40, 16, "the parameters and model state of a Llama plan by hand"),
    Exercise("predict_zero", "predict", "02", 30, 12, "ZeRO 0-3: memory and bytes per GPU"),
    Exercise("ddp_buckets", "implement", "02", 60, 13, "bucketed DDP's gradient hooks, overlapped with backward"),
    Exercise("zero1_step", "implement", "02", 60, 11, "the ZeRO-1 sharded optimizer step"),
    Exercise("predict_tp", "predict", "03", 30, 12, "tensor parallelism's bytes and time on two links"),
    Exercise("tp_mlp", "implement", "03", 60, 10, "Megatron's f and g, a column- then row-parallel MLP"),
    Exercise("predict_activations", "predict", "01, 03", 45, 10,
             "the activations a block saves: TP, SP, recomputation"),
    Exercise("predict_bubble", "predict", "04", 40, 9,
             "the bubble and in-flight micro-batches of GPipe, 1F1B, interleaved, ZB-H1",
             {"bubble_vs_memory": BUBBLE_VS_MEMORY}),
    Exercise("pipeline_1f1b", "implement", "04", 45, 13, "1F1B as an action list, run by the pipeline executor"),
    Exercise("online_softmax", "implement", "05", 45, 12, "ring attention's merge of partial softmax results"),
    Exercise("zigzag", "implement", "05", 30, 9, "load balancing of causal attention over context-parallel ranks"),
    Exercise("grid_4d", "implement", "06", 30, 10, "the 4-D process grid and its groups"),
    Exercise("predict_ep", "predict", "09", 40, 12, "expert parallelism: capacity, all-to-all bytes, parameters"),
    Exercise("design_plan", "design", "06, 07", 90, 9, "a plan for Llama 3 8B on 16 H100s: fit, and beat a step time",
             {"why": WHY_PLAN}),
    # implementation exercises added after the first fourteen (handout rows 15 on)
    Exercise("interleaved_1f1b", "implement", "04", 60, 16,
             "interleaved 1F1B as action lists: v chunks per rank, the bubble divided by v"),
    Exercise("ep_dispatch", "implement", "09", 60, 17,
             "expert parallelism's dispatch and combine: all-to-alls with uneven splits, a capacity"),
)
# Deeper implementations, each after the exercises of its lesson (the handout's rows 15-17).
EXERCISES += (
    Exercise("zero3_gather_free", "implement", "02", 60, 12,
             "ZeRO-3 / FSDP: gather a unit before use, free it after, reduce-scatter its gradient"),
    Exercise("sp_collectives", "implement", "03", 45, 12,
             "sequence parallelism's all-gather / reduce-scatter pair, forward and backward"),
    Exercise("ring_attention_loop", "implement", "05", 45, 11,
             "the causal ring-attention loop: K/V round the ring, merged, future chunks skipped"),
)
BY_NAME = {e.name: e for e in EXERCISES}


def listing(names: list[str]) -> tuple[list[dict], str]:
    """The exercises found on disk, in the handout's order (unknown ones last): rows for ``--json`` and a table."""
    known = [e for e in EXERCISES if e.name in names]
    rows = [{"exercise": e.name, "kind": e.kind, "lesson": e.lesson, "minutes": e.minutes, "points": e.points,
             "topic": e.topic} for e in known]
    rows += [{"exercise": n, "kind": "", "lesson": "", "minutes": None, "points": None, "topic": ""}
             for n in names if n not in BY_NAME]
    lines = [f"{'#':>2}  {'exercise':<20} {'kind':<9} {'lesson':<7} {'time':>7} {'points':>6}  topic"]
    for i, r in enumerate(rows, 1):
        time = f"{r['minutes']} min" if r["minutes"] else "?"
        lines.append(f"{i:>2}  {r['exercise']:<20} {r['kind']:<9} {r['lesson']:<7} {time:>7} "
                     f"{r['points'] if r['points'] is not None else '?':>6}  {r['topic']}")
    total = sum(r["minutes"] or 0 for r in rows)
    lines.append(f"{len(rows)} exercises, about {total / 60:.0f} hours; the handout is exercises/README.md")
    return rows, "\n".join(lines)


def written_answers(exercise: str, path: str | Path) -> dict[str, str]:
    """The written answers ``exercise`` asks for, read from the submission at ``path`` (never run): ``{key: text}``,
    ``""`` for a question left unanswered; ``{}`` when the exercise asks none."""
    questions = BY_NAME[exercise].questions if exercise in BY_NAME else {}
    if not questions:
        return {}
    p = Path(path)
    text = p.read_text(errors="replace") if p.is_file() else ""
    out = dict.fromkeys(questions, "")
    if p.suffix == ".py":
        try:
            tree = ast.parse(text)
        except SyntaxError:
            return out
        for node in tree.body:
            if isinstance(node, (ast.Assign, ast.AnnAssign)) and isinstance(node.value, ast.Constant) \
                    and isinstance(node.value.value, str):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                for t in targets:
                    if isinstance(t, ast.Name) and t.id.lower() in out:
                        out[t.id.lower()] = " ".join(node.value.value.split())
    else:
        for key in out:
            lines = re.findall(rf"^\s*#\s*{re.escape(key)}:(.*)$", text, flags=re.MULTILINE)
            out[key] = " ".join(" ".join(lines).split())
    return out


def missing_answer(exercise: str, path: str | Path, min_words: int = 15) -> str:
    """``""`` when every written question of ``exercise`` has an answer of at least ``min_words`` words, else
    what is missing and where to write it (the feedback of the ungraded test that reminds the learner)."""
    for key, text in written_answers(exercise, path).items():
        if len(text.split()) < min_words:
            where = f"`# {key}: ...` comment lines" if Path(path).suffix != ".py" else f"the string {key.upper()}"
            return (f"written answer {key!r}: {len(text.split())} words; answer in {where} (at least {min_words} "
                    f"words). The question: {BY_NAME[exercise].questions[key]}")
    return ""


def answers_text(exercise: str, path: str | Path) -> str:
    """The written answers as one CSV cell: ``key: text | key: text`` (empty when none are asked)."""
    return " | ".join(f"{k}: {v or '(no answer)'}" for k, v in written_answers(exercise, path).items())
