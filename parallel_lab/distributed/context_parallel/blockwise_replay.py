"""The blockwise kernel's tile loop under fake tensors: a few representative tile pairs, the same peak.

``parallel-lab memory --measure`` runs the kernel on fake tensors, where a tile pair computes nothing but
costs its Python and dispatch overhead: 1,024 pairs (528 computed) per layer and direction at 8K tokens.
What the memory tracker sees of the loop is the bytes alive at each op. Between two pairs the loop keeps
only the last computed pair's scores (backward: also its ``dP``) and the previous pair's mask; every other
temporary of a pair dies within it. So the bytes alive at each op of a pair depend only on the pair's
*shape* (its tile sizes, and whether it builds a mask) and on the *state* it starts in (the tile sizes of
the last computed pair, and of the previous pair if it built a mask). :func:`replay_runs` walks the pairs
in the loop's order on the tiles' metadata alone (``tile_mask(..., build=False)``) and returns runs of
real pairs that meet every (state, shape) the loop meets; a run starts with nothing kept, so its first pair
holds no more than the same pair did in the loop. The replay's peak is the loop's, byte for byte
(tests/distributed/test_kernels.py measures both); uniform causal tiles need 3 computed pairs per call,
at any length. docs/kernels.md, "Measured in fake tensors".
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from parallel_lab.distributed.context_parallel.blockwise_attention import KernelStats, Tile, Tokens

#: ``blockwise_attention.tile_mask``; with ``build=False``: False (hidden), None (visible), True (masked)
MaskOf = Callable[..., Any]


def _size(pair: tuple[Tile, Tile] | None) -> tuple[int, int] | None:
    return None if pair is None else (pair[0].stop - pair[0].start, pair[1].stop - pair[1].start)


def replay_runs(q: Tokens, kv: Tokens, causal: bool, mask_of: MaskOf, batch: int,
                stats: KernelStats | None = None) -> list[list[tuple[Tile, Tile]]]:
    """Runs of ``(query tile, key tile)`` pairs whose replay meets every (state, shape) of the full loop over
    ``q.tiles x kv.tiles``; ``stats`` (optional) counts the full loop's pairs as the loop would."""
    runs: list[list[tuple[Tile, Tile]]] = []
    seen: set[Any] = set()
    last: tuple[Tile, Tile] | None = None              # the last computed pair
    prev: tuple[Tile, Tile] | None = None              # the previous pair, and what it left
    prev_masked = prev_skipped = False
    end: Any = None                       # the state after the last run's last pair
    for qt in q.tiles:
        for kt in kv.tiles:
            pair, kind = (qt, kt), mask_of(q, qt, kv, kt, causal, build=False)
            if kind is False:
                if stats is not None:
                    stats.tiles_skipped += 1
                prev, prev_masked, prev_skipped = pair, False, True
                continue
            if stats is not None:
                stats.tiles_computed += 1
                stats.pairs_computed += batch * (qt.stop - qt.start) * (kt.stop - kt.start)
            state = (_size(last), _size(prev) if prev_masked else None)
            key = (state, _size(pair), bool(kind))
            if key not in seen:
                seen.add(key)
                if end == state:                                       # go on from where the last run ended
                    runs[-1].append(pair)
                elif end is not None and end[0] == state[0] and prev_skipped:
                    runs[-1] += [prev, pair]                           # a hidden pair drops the mask
                else:                                                  # set the state up from nothing
                    setup = [] if last is None else [last, prev] if prev_skipped else [last]
                    runs.append([*setup, pair])
                end = (_size(pair), _size(pair) if kind else None)
            last, prev, prev_masked, prev_skipped = pair, pair, bool(kind), False
    return runs
