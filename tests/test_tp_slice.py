"""The TP slice (``sharding.tp_slice``), the one rule that says which rows or columns of a full parameter a TP
rank holds: the split parts tile the full tensor, replicated parts have one first holder, the ledger's count
is rank 0's slice, and a mixture-of-experts parameter under tp > 1 is refused."""

from __future__ import annotations

import math

import pytest

from parallel_lab import sharding
from parallel_lab.errors import ParallelLabError
from parallel_lab.specs import ModelSpec

LLAMA = ModelSpec.preset("tiny-llama")                 # heads 4, kv_heads 2: tp=4 replicates the kv heads
GPT = ModelSpec.preset("tiny-gpt")                     # biases, learned positions
UNEVEN = GPT.with_(vocab=GPT.vocab + 3)                # the last vocabulary shard is cut short


def _numel(box: sharding.Box) -> int:
    return math.prod(b - a for a, b in box)


@pytest.mark.parametrize("model", [LLAMA, GPT, UNEVEN], ids=["llama", "gpt", "uneven-vocab"])
@pytest.mark.parametrize("tp", [1, 2, 4])
def test_the_first_holders_tile_every_parameter_once(model, tp):
    for name, shape in model.parameter_shapes():
        cuts = [sharding.tp_slice(model, name, shape, tp, r) for r in range(tp)]
        firsts = [c.box for c in cuts if c.first]
        assert sum(_numel(b) for b in firsts) == math.prod(shape), name
        assert len(set(firsts)) == len(firsts), name
        assert {c.axis for c in cuts} == {None if tp == 1 else cuts[0].axis}, name
        numel, replicated = sharding._local(model, name, shape, tp)
        assert numel == max(_numel(c.box) for c in cuts) == _numel(cuts[0].box), name
        assert replicated == (cuts[0].axis is None), name


def test_kv_heads_shared_when_tp_exceeds_them():
    shape = dict(LLAMA.parameter_shapes())["blocks.0.attn.wk.weight"]
    cuts = [sharding.tp_slice(LLAMA, "blocks.0.attn.wk.weight", shape, 4, r) for r in range(4)]
    d = LLAMA.head_dim
    assert [c.box[0] for c in cuts] == [(0, d), (0, d), (d, 2 * d), (d, 2 * d)]
    assert [c.first for c in cuts] == [True, False, True, False]


def test_expert_parameters_are_not_cut():
    moe = ModelSpec.preset("tiny-moe")
    name, shape = next((n, s) for n, s in moe.parameter_shapes() if ".experts." in n)
    with pytest.raises(ParallelLabError, match=r"tp=2: tensor-parallel experts are not modelled.*set tp=1"):
        sharding.tp_slice(moe, name, shape, 2, 0)
