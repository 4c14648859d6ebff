"""Public tests of ep_dispatch: which choices a capacity keeps (a hand-made case), and on 2 ranks (4 experts,
top-2, 12 tokens per rank, a router that overloads one expert) the output equals one process's MoE and the
three all-to-alls carry the counts, the kept rows and their outputs."""

from __future__ import annotations

import functools

from parallel_lab.grading.harness import Fail, checks, doing, points, record_collectives, require, run_ranks


def case(ep, experts, top_k, seq, hidden, capacity_factor, seed, skew=1.0):
    """A one-process MoE (``parallel_lab.distributed.model.moe.MoE``, GPT experts, no aux loss) and ``ep``
    sequences ``x (ep, seq, hidden)`` whose tokens lean towards expert 0 by ``skew`` (so that its capacity binds)."""
    from functools import partial

    import torch

    from parallel_lab.distributed.model.model import MLP
    from parallel_lab.distributed.model.moe import MoE
    from parallel_lab.specs import ModelSpec

    spec = ModelSpec(layers=1, hidden=hidden, heads=2, ffn=2 * hidden, vocab=16, flavour="gpt", experts=experts,
                     top_k=top_k, capacity_factor=capacity_factor, aux_loss_coef=0.0, name="moe-case")
    torch.manual_seed(seed)
    moe = MoE(spec, partial(MLP, spec)).eval()
    g = torch.Generator().manual_seed(seed + 1)
    w0 = moe.router.weight.detach()[0]
    x = torch.randn(ep, seq, hidden, generator=g) + skew * w0 / w0.norm()
    return moe, x


def routing(moe, x):
    """What the router gives one rank's sequence ``x (s, h)``: ``expert (s, k)``, ``gate (s, k)`` (the top-k
    probabilities renormalised), the capacity ``C`` and the kept choices as the library's MoE keeps them."""
    import torch

    from parallel_lab.distributed.model.moe import route

    cap = moe.spec.expert_capacity(x.shape[0])
    probs = torch.softmax(moe.router(x[None]).float(), dim=-1)
    gate_p, expert, slot = route(probs, moe.top_k, cap)
    return expert[0], (gate_p / gate_p.sum(-1, keepdim=True))[0].detach(), cap, slot[0] >= 0


def rank_run(grid, sub, args):
    """One rank: its sequence through the submission's dispatch_combine, and the collectives it made."""
    import torch

    from parallel_lab.sharding import local_experts

    moe, x = case(grid.world, *args)
    expert, gate, cap, _ = routing(moe, x[grid.rank])
    experts = [moe.experts[str(e)] for e in local_experts(moe.n_experts, grid.world, grid.rank)]
    doing(grid, "dispatch_combine")
    with torch.no_grad(), record_collectives() as calls:
        y = sub.dispatch_combine(x[grid.rank].clone(), expert.clone(), gate.clone(), cap, experts)
    return y.detach(), list(calls)


def reference(ep, args):
    """One process: the MoE on all ``ep`` sequences, ``(ep, s, h)``; each rank's kept choices (the library's)."""
    import torch

    moe, x = case(ep, *args)
    with torch.no_grad():
        y = moe(x)
    return y, [routing(moe, x[r]) for r in range(ep)]


def predicted_calls(ep, args):
    """Per rank: the three all-to-alls ``(kind, message_bytes, group)``: the E counts (int64), the kept rows going
    out, the rows coming back (fp32)."""
    n_exp, hidden = args[0], args[3]
    _, routes = reference(ep, args)
    out = []
    for r in range(ep):
        expert, _, _, keep = routes[r]
        local = range(r * n_exp // ep, (r + 1) * n_exp // ep)
        arriving = sum(int(sum(int(e) in local for e in rt[0][rt[3]])) for rt in routes)
        out.append(sorted([("all_to_all", 8 * n_exp, ep), ("all_to_all", 4 * hidden * int(keep.sum()), ep),
                           ("all_to_all", 4 * hidden * arriving, ep)]))
    return out


PUBLIC = (4, 2, 12, 8, 1.0, 7)             # experts, top_k, seq, hidden, capacity_factor, seed


@functools.cache
def ranks(sub, ep, args):
    return run_ranks(rank_run, ep, sub, args)


def check_output(sub, ep, args):
    from parallel_lab.grading.micro import rel_err

    y_ref, _ = reference(ep, args)
    for r, (y, _) in enumerate(ranks(sub, ep, args)):
        if tuple(y.shape) != tuple(y_ref[r].shape):
            raise Fail(f"rank {r}: output shape {tuple(y.shape)}, expected {tuple(y_ref[r].shape)}")
        err = rel_err(y, y_ref[r])
        if err > 1e-5:
            raise Fail(f"rank {r}: the output differs from one process's MoE by {err:.2e} (relative; E={args[0]}, "
                       f"top-{args[1]}, {args[2]} tokens per rank, ep={ep})")


@points(2)
@checks("the capacity keeps, per expert, the first C choices in priority order: every token's first choice "
        "in token order, then every token's second choice, ...", "walk the choices in that order with a count "
        "per expert; a choice that finds its expert full is dropped")
def test_kept_choices_by_hand(sub):
    import torch

    (fn,) = require(sub, "kept_choices")
    expert = torch.tensor([[1, 0], [1, 2], [1, 0], [2, 1], [0, 1]])
    want = [[True, True], [True, True], [False, False], [True, False], [True, False]]
    got = fn(expert, 3, 2)
    if got.dtype != torch.bool or tuple(got.shape) != (5, 2) or got.tolist() != want:
        raise Fail(f"kept_choices(expert={expert.tolist()}, n_experts=3, capacity=2) gave {got.tolist()}; "
                   f"expected {want}")


@points(3)
@checks("dispatch, local experts, combine: each token's output is the gate-weighted sum of its kept experts' "
        "outputs, as one process's MoE computes it", "send each kept row to the rank that holds its expert "
        "(contiguous blocks of E/ep experts), remember where each row came from, and weight by the gate on the way "
        "back; a dropped choice adds nothing")
def test_output_equals_one_process(sub):
    require(sub, "dispatch_combine", "kept_choices")
    check_output(sub, 2, PUBLIC)


@points(2)
@checks("three all-to-alls per rank: the E counts (int64), the kept rows out (uneven splits), the expert outputs "
        "back", "all_to_all_single(output, input, output_split_sizes, input_split_sizes): how does a rank learn how "
        "many rows it will receive from each rank before the rows themselves?")
def test_all_to_all_bytes(sub):
    from parallel_lab.grading.harness import diff_calls

    require(sub, "dispatch_combine", "kept_choices")
    want = predicted_calls(2, PUBLIC)
    for r, (_, calls) in enumerate(ranks(sub, 2, PUBLIC)):
        msg = diff_calls(calls, want[r])
        if msg:
            raise Fail(f"rank {r}: {msg} (bytes: 8 E for the counts, 4 h per row of the kept choices)")
