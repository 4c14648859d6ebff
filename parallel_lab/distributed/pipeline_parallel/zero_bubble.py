"""The zero-bubble pieces of the executor: the weight-gradient split (W) and the V's local hand-offs.

ZB-H1 (Qi et al. 2023, "Zero Bubble Pipeline Parallelism") splits a backward into B, the input gradient
``dX = dY W`` (``backward(y, dy, inputs=[x], retain_graph=True)``, a pre-hook keeping ``dY`` at every node
where the input path and a weight path part), and W, ``dW = dY^T X`` (each such node run again for its
weights only, through ``GradientEdge``); B + W costs one ordinary backward. On a V placement (ZB-V,
DualPipeV) stages ``p - 1`` and ``p`` share a rank, so an activation and its gradient cross between them
without a message. The executor (``pipeline_parallel.py``) calls these through :func:`backward_input_only`,
:func:`backward_weights` and :class:`LocalHandoffs`. Derivation: ``docs/pipeline.md``.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor
from torch.autograd.graph import GradientEdge, Node

from parallel_lab.distributed.pipeline_parallel.stages import StageLayout
from parallel_lab.errors import ParallelLabError
from parallel_lab.schedules.actions import Action

#: what B keeps for W: ``(node, its weights, the gradient dY that reached the node)``
Held = list[tuple[Node, list[Tensor], tuple]]

# --------------------------------------------------------------------------------------------------
# Splitting a backward into B (input gradient) and W (weight gradients)
# --------------------------------------------------------------------------------------------------

def _nodes_leading_to(root: Node, target: Tensor) -> dict[Node, bool]:
    """For every node reachable from ``root``: does a path lead from it to the leaf ``target``?"""
    leads: dict[Node, bool] = {}
    stack: list[tuple[Node, bool]] = [(root, False)]
    while stack:                                  # iterative post-order (graphs are deep)
        node, children_done = stack.pop()
        if node in leads:
            continue
        nexts = [f for f, _ in node.next_functions if f is not None]
        if children_done:
            leads[node] = getattr(node, "variable", None) is target or any(leads[f] for f in nexts)
        else:
            stack.append((node, True))
            stack.extend((f, False) for f in nexts if f not in leads)
    return leads


def _weights_below(node: Node, wanted: dict[int, Tensor]) -> list[Tensor]:
    """Parameters (of ``wanted``, keyed by ``id``) whose gradient accumulators lie below ``node``."""
    out, seen, stack = [], set(), [node]
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        var = getattr(n, "variable", None)
        if var is not None and id(var) in wanted:
            out.append(wanted[id(var)])
        stack.extend(f for f, _ in n.next_functions if f is not None)
    return out


def weight_split_points(root: Node, x: Tensor, params: Iterable[Tensor]) -> list[tuple[Node, list[Tensor]]]:
    """Where the input-gradient path and the weight-gradient paths of a backward part.

    ``root``: the output's ``grad_fn``; ``x``: the chunk's input (a leaf). Returns ``(node, weights)`` for
    every node that lies on a path from ``root`` to ``x`` and has an edge leaving that path towards
    parameters (each linear's matmul, each norm's product with its weight). Running such a node for its
    weights alone, with the gradient it received during B, gives exactly their gradients (W).
    Raises ParallelLabError when a weight sits below two such nodes (a weight used twice), for which
    per-node W passes would count a gradient twice.
    """
    wanted = {id(p): p for p in params if p.requires_grad}
    leads = _nodes_leading_to(root, x)
    points, owner = [], {}
    for node, on_path in leads.items():
        if not on_path:
            continue
        ws: list[Tensor] = []
        for f, _ in node.next_functions:
            if f is not None and not leads[f]:
                ws += _weights_below(f, wanted)
        if ws:
            for w in ws:
                if id(w) in owner:
                    raise ParallelLabError(
                        "a parameter is used by two operations of one pipeline chunk, so its weight gradient "
                        "cannot be split from the input gradient per operation; use a schedule without W "
                        "(gpipe, 1f1b, interleaved)")
                owner[id(w)] = node
            points.append((node, ws))
    return points


def backward_input_only(y: Tensor, x: Tensor, dy: Tensor | None, params: list[Tensor]) -> Held:
    """B of a split backward: ``dL/dx`` only, keeping ``dY`` at every split node for W."""
    points = weight_split_points(y.grad_fn, x, params)
    caught: dict[Node, tuple] = {}
    handles = [node.register_prehook(lambda g, node=node: caught.__setitem__(node, tuple(g)))
               for node, _ in points]
    try:
        torch.autograd.backward(y, dy, inputs=[x], retain_graph=True)
    finally:
        for h in handles:
            h.remove()
    return [(node, ws, caught[node]) for node, ws in points if node in caught]


def backward_weights(held: Held) -> None:
    """W: every split node again for its weights only (``dW = dY^T X`` from the activations saved)."""
    for node, weights, grads in held:
        edges = [(GradientEdge(node, i), g) for i, g in enumerate(grads) if g is not None]
        if edges:
            torch.autograd.backward([e for e, _ in edges], [g for _, g in edges], inputs=weights)


# --------------------------------------------------------------------------------------------------
# The V's local hand-offs
# --------------------------------------------------------------------------------------------------

class LocalHandoffs:
    """Tensors handed between two chunks of one rank (a V's turn), kept until the consumer takes them.

    ``F``: a chunk's output, the input of the next virtual stage; ``B``: a chunk's input gradient, the
    output gradient of the previous virtual stage."""

    def __init__(self, layout: StageLayout):
        self.layout = layout
        self.held: dict[tuple[str, int, int], Tensor] = {}     # (F|B, mb, consumer chunk)

    def take(self, kind: str, a: Action) -> Tensor | None:
        """What the local neighbour left for ``a`` (F: its input; B: its output gradient); None when that
        neighbour is on another rank (the tensor then comes as a message)."""
        if self.layout.local_neighbour(a.chunk, -1 if kind == "F" else +1) is None:
            return None
        return self.held.pop((kind, a.microbatch, a.chunk))

    def give(self, kind: str, a: Action, tensor: Tensor) -> bool:
        """Hand ``tensor`` to the neighbour on this rank (F: the next stage; B: the previous); False when
        that neighbour is on another rank (the tensor then goes as a message)."""
        nb = self.layout.local_neighbour(a.chunk, +1 if kind == "F" else -1)
        if nb is None:
            return False
        self.held[(kind, a.microbatch, nb)] = tensor
        return True

    def pending(self) -> list[Any]:
        return sorted(self.held)
