"""What every input means and in which unit, and a short glossary of the terms the app uses.

:data:`TOOLTIPS` maps each explorer input (by its name in ``Explorer.widgets``) to the sentence its
tooltip shows: what the knob is, its unit, and what it changes. :class:`~.base.Explorer` gives every
input its tooltip and refuses an input without one, so a new knob cannot ship with a blank ("null")
tooltip. :data:`GLOSSARY` explains the words that appear in the pictures and status lines; the app shows
it under the tabs.
"""

from __future__ import annotations

import html

TOOLTIPS: dict[str, str] = {
    # model
    "model": "Model to place: a preset (shapes of the published model) or 'custom' to type a shape",
    "layers": "Transformer blocks L (count)",
    "hidden": "Hidden size h: width of the residual stream (elements per token)",
    "heads": "Attention heads a (count); h must be a multiple of a",
    "kv_heads": "Key/value heads (count): = heads for multi-head, fewer for GQA, 1 for MQA",
    "ffn": "MLP inner width (elements per token)",
    "vocab": "Vocabulary size V (tokens): sets the embedding, the head and the logits",
    "flavour": "gpt: LayerNorm + GELU MLP with biases; llama: RMSNorm + SwiGLU, no biases",
    # mixture of experts (routing explorer)
    "skew": "Router skew: expert e's popularity ~ (e + 1)^-skew; 0 is balanced, larger sends most tokens to a few",
    "capacity_factor": "Capacity factor: slots per expert = min(s, ceil(factor x top_k x s / experts)) per sequence",
    "ep": "Expert-parallel degree (count): experts split over ep ranks borrowed from dp",
    # batch and sequence
    "seq": "Sequence length s (tokens per sample)",
    "micro_batch": "Micro-batch b: samples per forward/backward on one GPU (sequences)",
    "grad_accum": "Micro-batches per optimizer step on each data-parallel replica (count; m for pipelines)",
    "batch_tokens": "Global batch: tokens per optimizer step over the whole cluster",
    # degrees
    "gpus": "GPUs in the job (count) = dp x tp x pp x cp; a degree change updates it, typing it sets dp",
    "dp": "Data-parallel degree: replicas that each see different samples (count)",
    "tp": "Tensor-parallel degree: GPUs that split every weight matrix of a layer (count)",
    "pp": "Pipeline-parallel degree: stages the layers are cut into (count)",
    "cp": "Context-parallel degree: GPUs that split one sequence's tokens (count)",
    "zero": "ZeRO stage: 0 none; 1 shards optimizer states, 2 also gradients, 3 also parameters over dp",
    "sp": "Sequence parallelism: TP ranks also split the LayerNorm/dropout activations along s",
    "recompute": "Activation recomputation: none; selective drops the attention scores; full keeps one "
                 "input per layer",
    "optimizer": "Optimizer and precision: bytes per parameter for weights, gradients and states",
    "cluster": "GPU type and its links: HBM per GPU (GB), NVLink inside a node, network across nodes",
    "activation_model": "Activation formula: korthikanti (Korthikanti et al. 2022, per layer) or per-op "
                        "(the tensors torch saves, op by op)",
    "sweep": "What the right-hand chart sweeps: ZeRO stage, sequence length or dp",
    "cp_kind": "Context-parallel algorithm: ring passes K/V blocks around; all-gather collects them once",
    "tp_across_nodes": "Time TP's collectives on the inter-node link, as if the TP group spanned two nodes",
    "color_by": "Which groups the grid colours: ranks that differ only in this coordinate talk in one group",
    "balance": "How the sequence is cut for context parallelism: contiguous slices, or zigzag (rank r holds "
               "chunks r and 2 cp - 1 - r, equal causal work)",
    "step": "Ring step (1 .. cp): at step t each rank holds the key/value block of the rank t places before it",
    # pipeline
    "schedule": "Pipeline schedule: order of forward (F), backward (B) and weight-gradient (W) actions",
    "interleave": "Model chunks per pipeline rank v (interleaved schedule only; count)",
    "stages": "Pipeline stages p (ranks, one row each)",
    "microbatches": "Micro-batches m per step (count)",
    "f": "Forward time of one micro-batch on one chunk (cost units; F = 1 is the yardstick)",
    "b": "Backward-for-input time of one micro-batch on one chunk (cost units)",
    "w": "Weight-gradient time of one micro-batch on one chunk (cost units); unsplit backward = b + w",
    "p2p": "Time to send an activation to the next stage (cost units)",
    "zero_unit": "ZeRO/FSDP unit: block gathers one transformer block at a time (plus a root unit of embeddings "
                 "and head); root gathers the whole model at once",
    "ring_step": "Step of the ring all-reduce (0 .. 2 (tp - 1)): the first tp - 1 reduce-scatter, the rest "
                 "all-gather; each moves one chunk of M / tp bytes per rank",
    # run
    "steps": "Optimizer steps the run trains (count); each is one global batch on every rank",
    # planner
    "top": "How many of the best plans to list (count)",
    "engine": "What will run the plan: lab (every plan the ledger models) or torchtitan (only what its trainer "
              "runs: parallel-lab plan --engine torchtitan); the saved plan file records it",
    "chosen": "Which listed plan to draw (rank in the list, 1 = fastest estimate)",
}

GLOSSARY: tuple[tuple[str, str], ...] = (
    ("bubble", "idle time of the busiest pipeline rank over its compute time, (W - busy) / busy; "
               "(p - 1) / m for 1F1B with equal costs; the CLI's `parallel-lab bubble` prints the same ratio"),
    ("in-flight", "micro-batches whose forward ran and whose backward has not: each holds its activations"),
    ("ZeRO-1/2/3", "optimizer states / + gradients / + parameters sharded over the data-parallel ranks"),
    ("korthikanti / per-op", "two activation models: the paper's per-layer formula s b h (34 + 5 a s / h), "
                             "or the tensors torch saves for backward, op by op"),
    ("tp_vocab", "the all-reduces of the vocabulary-parallel embedding and loss (tensor parallelism on V)"),
    ("HBM / usable", "the GPU's memory, and what is left after the ledger's safety margin"),
    ("link tier", "the link a group's collectives cross: inside a node (NVLink) or between nodes"),
    ("MFU", "model FLOPs utilisation: the model's FLOPs per second over the GPUs' peak"),
)


def tooltip(name: str) -> str:
    """The tooltip of input ``name``; a name without one is a bug (raises ``KeyError`` naming it)."""
    try:
        return TOOLTIPS[name]
    except KeyError:
        raise KeyError(f"input {name!r} has no tooltip; add one to parallel_lab.viz.explorers.help.TOOLTIPS"
                       ) from None


def glossary_html() -> str:
    """The glossary as a collapsed HTML list."""
    items = "".join(f"<dt><b>{html.escape(t)}</b></dt><dd style='margin:0 0 4px 16px'>{html.escape(d)}</dd>"
                    for t, d in GLOSSARY)
    return (f"<details class='pl-glossary' style='font-size:12px;margin-top:8px'><summary>Glossary</summary>"
            f"<dl style='margin:4px 0'>{items}</dl></details>")
