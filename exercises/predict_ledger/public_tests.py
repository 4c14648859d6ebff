"""Public tests of predict_ledger: the worked example llama2-7b (L=32, h=4096, 32 heads, ffn 11008, V=32000).

The expected numbers are stored as salted hashes: a test says right or wrong, not the number.
"""

from __future__ import annotations

from parallel_lab.grading.feedback import check_hash
from parallel_lab.grading.harness import Fail, points, require

SALT = "predict_ledger-public"
N_PARAMS_HASH = "da78dc4e49d5456378da4eeb2d0706b9928838e9c3093f2a0158406dfbfab03f"  # 10 digits
STATE_TOTAL_HASH = "7b89c1aaada4e0803b60e3a3b8397df15d75055624d8dd1dd3f2112f498020c6"  # 4 digits
LLAMA2_7B = dict(layers=32, hidden=4096, heads=32, kv_heads=32, ffn=11008, vocab=32000)


@points(2)
def test_llama2_7b_count(sub):
    (fn,) = require(sub, "n_params")
    fb = check_hash(fn(**LLAMA2_7B), N_PARAMS_HASH, SALT, sig=10, name="n_params(llama2-7b)")
    if not fb:
        raise Fail(fb.message)


@points(1)
def test_llama2_7b_state_total(sub):
    (fn,) = require(sub, "state_per_gpu")
    fb = check_hash(sum(fn(**LLAMA2_7B).values()), STATE_TOTAL_HASH, SALT, name="total state of llama2-7b")
    if not fb:
        raise Fail(fb.message)
