"""Reference solution of ep_dispatch."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor


def kept_choices(expert: Tensor, n_experts: int, capacity: int) -> Tensor:
    s, k = expert.shape
    keep = torch.zeros(s, k, dtype=torch.bool)
    used = [0] * n_experts
    for j in range(k):                       # priority: every token's choice 0, then every token's choice 1, ...
        for t in range(s):
            e = int(expert[t, j])
            if used[e] < capacity:
                keep[t, j] = True
                used[e] += 1
    return keep


def dispatch_combine(x: Tensor, expert: Tensor, gate: Tensor, capacity: int, experts: list) -> Tensor:
    ep = dist.get_world_size()
    n_local = len(experts)
    n_exp = ep * n_local
    keep = kept_choices(expert, n_exp, capacity)
    tok, choice = keep.nonzero(as_tuple=True)                           # kept choices, in any order
    dest_expert = expert[tok, choice]
    order = torch.argsort(dest_expert, stable=True)                     # grouped by expert, so by owner rank
    tok, choice, dest_expert = tok[order], choice[order], dest_expert[order]
    counts = torch.bincount(dest_expert, minlength=n_exp)               # (E,) rows per expert
    recv_counts = torch.empty_like(counts)
    dist.all_to_all_single(recv_counts, counts)                         # (ep, E/ep): from rank i, per local expert
    send_split = counts.view(ep, n_local).sum(1).tolist()
    recv_per = recv_counts.view(ep, n_local)
    recv_split = recv_per.sum(1).tolist()
    send = x[tok].contiguous()
    recv = x.new_empty(sum(recv_split), x.shape[1])
    dist.all_to_all_single(recv, send, output_split_sizes=recv_split, input_split_sizes=send_split)
    # recv: source 0's rows (expert 0's, expert 1's, ...), then source 1's rows, ...
    local = torch.arange(n_local).repeat(ep).repeat_interleave(recv_per.flatten())
    out = torch.empty_like(recv)
    with torch.no_grad():
        for i, f in enumerate(experts):
            rows = (local == i).nonzero(as_tuple=True)[0]
            if len(rows):
                out[rows] = f(recv[rows])
    back = x.new_empty(send.shape[0], x.shape[1])
    dist.all_to_all_single(back, out, output_split_sizes=send_split, input_split_sizes=recv_split)
    y = torch.zeros_like(x)
    y.index_add_(0, tok, back * gate[tok, choice][:, None].to(back.dtype))
    return y
