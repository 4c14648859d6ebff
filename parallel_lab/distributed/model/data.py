"""Deterministic synthetic data: the same global batch for a step whatever the plan.

Every run of a plan and its single-process reference train on :func:`synthetic_batch`, a pure function
of ``(seed, step)``: a sparse random Markov chain over the vocabulary (each token has ``branching``
likely successors, plus 10% uniform noise), so the loss falls quickly and a wrong gradient shows.

Slicing (docs/conventions.md, "Determinism"): the rank with data-parallel coordinate ``d`` takes
sequences ``[d b m, (d + 1) b m)`` (``b = micro_batch``, ``m = grad_accum``), its micro-batch ``i`` the
sequences ``[d b m + i b, d b m + (i + 1) b)`` (``Runtime.micro_batches``); context parallelism then
cuts each micro-batch along the sequence. Positions are those of the full sequence (``arange(seq)``);
with ``packed=True`` a row holds several documents (each starting with ``BOS``) and ``doc_ids`` restricts
attention to the token's own document (the positions are not restarted).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from parallel_lab.specs import ModelSpec, Plan


@dataclass
class Batch:
    """Tokens and next-token targets ``(b, s)``, positions ``(s,)``, optional document ids ``(b, s)``."""

    tokens: Tensor
    targets: Tensor
    positions: Tensor
    doc_ids: Tensor | None = None

    def rows(self, start: int, stop: int) -> Batch:
        """Sequences ``start:stop`` (a data-parallel rank's or a micro-batch's slice), as new tensors (so
        that the ids saved for backward are charged their own bytes, not the global batch's storage)."""
        docs = None if self.doc_ids is None else self.doc_ids[start:stop].clone()
        return Batch(self.tokens[start:stop].clone(), self.targets[start:stop].clone(), self.positions, docs)

    def to(self, device: torch.device | str) -> Batch:
        docs = None if self.doc_ids is None else self.doc_ids.to(device)
        return Batch(self.tokens.to(device), self.targets.to(device), self.positions.to(device), docs)

    @property
    def n_tokens(self) -> int:
        return self.targets.numel()


BOS = 0


@dataclass(frozen=True)
class SyntheticData:
    """A learnable token stream: a sparse random Markov chain (``branching`` successors per token, 10% noise).

    ``batch(step, n_seq, seq)`` is a pure function of ``(seed, step)``: every plan sees the same global
    batch at a step. With ``packed=True`` each row is several documents of random length (at least
    ``min_doc``); a document starts with token ``BOS`` and the chain restarts there; ``doc_ids`` numbers
    the documents of a row from 0.
    """

    vocab: int
    seed: int = 0
    branching: int = 4
    noise: float = 0.1
    packed: bool = False
    min_doc: int = 8

    def _table(self) -> Tensor:
        g = torch.Generator().manual_seed(10_007 * self.seed + 1)
        return torch.randint(1, self.vocab, (self.vocab, self.branching), generator=g)

    def batch(self, step: int, n_seq: int, seq: int) -> Batch:
        g = torch.Generator().manual_seed(1_000_003 * (self.seed + 1) + step)
        table = self._table()
        n = seq + 1
        choice = torch.randint(0, self.branching, (n_seq, n), generator=g)
        noise = torch.rand(n_seq, n, generator=g) < self.noise
        uniform = torch.randint(1, self.vocab, (n_seq, n), generator=g)
        starts = torch.zeros(n_seq, n, dtype=torch.bool)
        starts[:, 0] = True
        if self.packed:
            hi = max(self.min_doc + 1, seq // 2)
            for r in range(n_seq):
                pos = int(torch.randint(self.min_doc, hi, (1,), generator=g))
                while pos < n - self.min_doc:
                    starts[r, pos] = True
                    pos += int(torch.randint(self.min_doc, hi, (1,), generator=g))
        x = torch.empty(n_seq, n, dtype=torch.long)
        x[:, 0] = BOS
        for t in range(1, n):
            nxt = table[x[:, t - 1], choice[:, t]]
            nxt = torch.where(noise[:, t], uniform[:, t], nxt)
            x[:, t] = torch.where(starts[:, t], torch.full_like(nxt, BOS), nxt)
        doc_ids = (starts.long().cumsum(1) - 1)[:, :seq] if self.packed else None
        return Batch(x[:, :seq].clone(), x[:, 1:].clone(), torch.arange(seq), doc_ids)


def synthetic_batch(spec: ModelSpec, plan: Plan, step: int, seed: int = 0, packed: bool = False) -> Batch:
    """The global batch of a step: ``plan.global_batch`` sequences of ``plan.seq`` tokens, same for every plan
    with the same global batch."""
    return SyntheticData(spec.vocab, seed=seed, packed=packed).batch(step, plan.global_batch, plan.seq)


