"""Public tests of predict_ledger: the worked example llama2-7b (L=32, h=4096, 32 heads, ffn 11008, V=32000),
then grouped-query attention and tensor parallelism on a small made-up model, and the shape of your ANSWER.

The expected numbers of llama2-7b are stored as salted hashes: a test says right or wrong, not the number.
"""

from __future__ import annotations

from parallel_lab.grading.feedback import check_hash
from parallel_lab.grading.feedback import check_revealed as check
from parallel_lab.grading.harness import Fail, checks, points, require

SALT = "predict_ledger-public"
N_PARAMS_HASH = "da78dc4e49d5456378da4eeb2d0706b9928838e9c3093f2a0158406dfbfab03f"  # 10 digits
STATE_TOTAL_HASH = "7b89c1aaada4e0803b60e3a3b8397df15d75055624d8dd1dd3f2112f498020c6"  # 4 digits
LLAMA2_7B = dict(layers=32, hidden=4096, heads=32, kv_heads=32, ffn=11008, vocab=32000)
#: a made-up model with 4 query heads per key/value head and an odd vocabulary (not a preset)
SMALL_GQA = dict(layers=3, hidden=256, heads=8, kv_heads=2, ffn=688, vocab=1001)


@points(2)
@checks("the parameter count of a model without GQA (llama2-7b: every head has its own keys and values)",
        "list every tensor of a block and outside the blocks with its shape; count the norm weights too")
def test_llama2_7b_count(sub):
    (fn,) = require(sub, "n_params")
    fb = check_hash(fn(**LLAMA2_7B), N_PARAMS_HASH, SALT, sig=10, name="n_params(llama2-7b)")
    if not fb:
        raise Fail(fb.message)


@points(1)
@checks("the model state per GPU at tp=1 with mixed-precision Adam (2 + 2 + 12 bytes per parameter)",
        "parameters, gradients and optimizer states are each the parameter count times their bytes")
def test_llama2_7b_state_total(sub):
    (fn,) = require(sub, "state_per_gpu")
    fb = check_hash(sum(fn(**LLAMA2_7B).values()), STATE_TOTAL_HASH, SALT, name="total state of llama2-7b")
    if not fb:
        raise Fail(fb.message)


@points(2)
@checks("grouped-query attention and tensor parallelism: a model with fewer key/value heads than query heads, "
        "at tp=1 and tp=2", "how wide are wk and wv when kv < a? Which tensors does TP split, and which does "
        "every rank keep whole?")
def test_gqa_and_tp(sub):
    from parallel_lab import ledger
    from parallel_lab.specs import ModelSpec, Plan

    count, state = require(sub, "n_params", "state_per_gpu")
    m = ModelSpec(**SMALL_GQA, flavour="llama", name="small-gqa")
    if count(**SMALL_GQA) != m.n_params:
        raise Fail(f"n_params({SMALL_GQA}) = {count(**SMALL_GQA):,}; the model has {m.n_params:,} "
                   f"({count(**SMALL_GQA) - m.n_params:+,})")
    for tp in (1, 2):
        want = {k: float(v) for k, v in ledger.state_bytes(m, Plan(tp=tp)).items()}
        fb = check(state(**SMALL_GQA, tp=tp), want, rtol=0.0, unit="B", name=f"state per GPU of {SMALL_GQA}, tp={tp}")
        if not fb:
            raise Fail(fb.message)


@points(1)
@checks("your ANSWER is a ledger of mixed-precision Adam: three positive terms, gradients as large as the "
        "parameters (2 bytes each) and optimizer states six times as large (12 bytes)",
        "fill in all three terms for your ASSIGNMENT; the exact numbers are graded by your teacher")
def test_answer_is_a_ledger(sub):
    (answer,) = require(sub, "ANSWER")
    if not isinstance(answer, dict) or set(answer) != {"parameters", "gradients", "optimizer_states"}:
        raise Fail(f"ANSWER must be a dict with the keys parameters, gradients, optimizer_states; it is {answer!r}")
    for k, v in answer.items():
        if v is None or v is Ellipsis or not isinstance(v, (int, float)) or v <= 0:
            raise Fail(f"ANSWER[{k!r}] is {v!r}: give a positive number of bytes")
    for k, ratio in (("gradients", 1.0), ("optimizer_states", 6.0)):
        fb = check(answer[k] / answer["parameters"], ratio, rtol=0.005, name=f"ANSWER[{k!r}] / ANSWER['parameters']")
        if not fb:
            raise Fail(fb.message)
