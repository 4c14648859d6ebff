"""A model of PyTorch's CUDA caching allocator: what it reserves (``max_memory_reserved``) for a sequence
of tensor allocations and frees.

The rules are torch's own (``c10/cuda/CUDACachingAllocator.cpp``; docs "CUDA semantics: memory management"):
sizes round up to 512 B (``roundup_power2_divisions`` rounds to a power-of-two division instead); requests of
at most 1 MiB use the small pool, served from 2 MiB segments; larger ones the large pool, from a 20 MiB
segment below 10 MiB, else a segment of the size rounded up to 2 MiB; the smallest cached free block that
fits is taken (best fit, lowest address on ties) and split when the remainder is >= 512 B (small pool) or
> 1 MiB (large pool); a freed block merges with free neighbours of its segment; segments are kept until a
device allocation fails (then every fully free segment is released and the allocation retried). With
``expandable_segments`` each pool is one segment that maps 2 MiB (small) or 20 MiB (large) pages as it grows.
Simplified: one device and one stream, no events or ``record_stream``, no graph pools, no
``garbage_collection_threshold``. Derivations: docs/reserve.md.
"""

from __future__ import annotations

import bisect
from collections.abc import Hashable, Iterable
from dataclasses import dataclass, field

from .errors import ParallelLabError

MiB = 1 << 20
MIN_BLOCK = 512                  # kMinBlockSize: every size rounds up to a multiple of 512 B
SMALL_SIZE = MiB                 # kSmallSize: the largest "small" request
SMALL_BUFFER = 2 * MiB           # kSmallBuffer: a small-pool segment
LARGE_BUFFER = 20 * MiB          # kLargeBuffer: the segment of a request in (1 MiB, 10 MiB)
MIN_LARGE_ALLOC = 10 * MiB       # kMinLargeAlloc
ROUND_LARGE = 2 * MiB            # kRoundLarge: larger segments round up to 2 MiB

#: One event: ``("alloc", key, nbytes)`` or ``("free", key)``.
Event = tuple


@dataclass(frozen=True)
class AllocatorConfig:
    """The ``PYTORCH_CUDA_ALLOC_CONF`` options the model follows (:meth:`parse` reads the string)."""

    roundup_power2_divisions: int = 0
    max_split_size: int | None = None        # bytes; None: unlimited (torch's default)
    expandable_segments: bool = False

    @classmethod
    def parse(cls, conf: str) -> AllocatorConfig:
        """``"expandable_segments:True,max_split_size_mb:512,roundup_power2_divisions:4"``."""
        kw: dict = {}
        for item in filter(None, (s.strip() for s in conf.split(","))):
            key, _, val = item.partition(":")
            if key == "expandable_segments":
                kw["expandable_segments"] = val.strip().lower() == "true"
            elif key == "max_split_size_mb":
                kw["max_split_size"] = int(val) * MiB
            elif key == "roundup_power2_divisions" and val.strip().isdigit():
                kw["roundup_power2_divisions"] = int(val)
            else:
                raise ParallelLabError(f"allocator option {item!r} is not modelled; use expandable_segments, "
                                       "max_split_size_mb or roundup_power2_divisions:N")
        return cls(**kw)


def round_size(nbytes: int, config: AllocatorConfig = AllocatorConfig()) -> int:
    """torch's ``round_size``: at least 512 B, a multiple of 512 B, or the next of ``divisions`` steps
    between two powers of two when ``roundup_power2_divisions`` is set and the size exceeds ``512 * divisions``."""
    if nbytes < MIN_BLOCK:
        return MIN_BLOCK
    div = config.roundup_power2_divisions
    if div > 1 and nbytes > MIN_BLOCK * div:
        floor2 = 1 << (nbytes.bit_length() - 1)
        if floor2 == nbytes:
            return nbytes
        step = floor2 >> (div.bit_length() - 1)
        if step == 0:
            return floor2 << 1
        low = nbytes & ~(step - 1)
        return nbytes if low == nbytes else low + step
    return MIN_BLOCK * -(-nbytes // MIN_BLOCK)


def segment_size(rounded: int) -> int:
    """torch's ``get_allocation_size``: the segment a new device allocation gets for a rounded request."""
    if rounded <= SMALL_SIZE:
        return SMALL_BUFFER
    if rounded < MIN_LARGE_ALLOC:
        return LARGE_BUFFER
    return ROUND_LARGE * -(-rounded // ROUND_LARGE)


@dataclass
class _Block:
    addr: int
    size: int
    small: bool
    seg: int                      # the segment's base address
    allocated: bool = False
    prev: _Block | None = None
    next: _Block | None = None


@dataclass
class Replay:
    """What :func:`replay` found: peaks of reserved and allocated (block) bytes, the requested bytes' peak,
    the segments made, and ``reserved`` after each event."""

    peak_reserved: int
    peak_allocated: int
    peak_requested: int
    segments: int
    reserved: list[int] = field(default_factory=list)


class CachingAllocator:
    """The caching allocator on one device and one stream (module docstring). ``capacity``: bytes a device
    allocation may reach (None: unlimited); beyond it the fully free segments are released, then
    :class:`ParallelLabError` (out of memory)."""

    def __init__(self, config: AllocatorConfig = AllocatorConfig(), capacity: int | None = None) -> None:
        self.config, self.capacity = config, capacity
        self.free_sets: dict[bool, list[tuple[int, int]]] = {True: [], False: []}    # (size, addr), sorted
        self.blocks: dict[int, _Block] = {}
        self.live: dict[Hashable, tuple[_Block, int]] = {}
        self.segs: dict[int, int] = {}            # base -> size
        self.grow: dict[bool, int] = {}           # expandable: the pool's segment base
        self.tail: dict[int, _Block] = {}         # expandable: the segment's last block
        self.next_addr = 0
        self.reserved = self.allocated = self.requested = 0
        self.peak_reserved = self.peak_allocated = self.peak_requested = 0

    # ---- the free sets ------------------------------------------------------------------------------
    def _insert(self, b: _Block) -> None:
        bisect.insort(self.free_sets[b.small], (b.size, b.addr))

    def _remove(self, b: _Block) -> None:
        s = self.free_sets[b.small]
        del s[bisect.bisect_left(s, (b.size, b.addr))]

    def _best_fit(self, small: bool, size: int) -> _Block | None:
        s = self.free_sets[small]
        i = bisect.bisect_left(s, (size, -1))
        if i == len(s):
            return None
        b = self.blocks[s[i][1]]
        mss = self.config.max_split_size
        if mss is not None and ((size < mss <= b.size) or (size >= mss and b.size >= size + LARGE_BUFFER)):
            return None
        return b

    # ---- device memory ------------------------------------------------------------------------------
    def _device_alloc(self, nbytes: int) -> bool:
        if self.capacity is not None and self.reserved + nbytes > self.capacity:
            return False
        self.reserved += nbytes
        self.peak_reserved = max(self.peak_reserved, self.reserved)
        return True

    def _new_segment(self, small: bool, size: int) -> _Block | None:
        if self.config.expandable_segments:
            return self._expand(small, size)
        seg = segment_size(size)
        if not self._device_alloc(seg):
            return None
        b = _Block(self.next_addr, seg, small, self.next_addr)
        self.segs[b.addr] = seg
        self.blocks[b.addr] = b
        self.next_addr += seg
        return b

    def _expand(self, small: bool, size: int) -> _Block | None:
        """Map pages at the end of the pool's one segment: enough for ``size`` beyond its free tail."""
        page = SMALL_BUFFER if small else LARGE_BUFFER
        if small not in self.grow:
            self.grow[small] = self.next_addr
            self.segs[self.next_addr] = 0
            self.next_addr += 1 << 48                     # the reserved address range
        base = self.grow[small]
        end = base + self.segs[base]
        tail = self.tail.get(base)
        have = tail.size if tail is not None and not tail.allocated else 0
        more = page * -(-(size - have) // page)
        if not self._device_alloc(more):
            return None
        self.segs[base] += more
        if have:
            self._remove(tail)
            tail.size += more
            return tail
        b = _Block(end, more, small, base, prev=tail)
        if tail is not None:
            tail.next = b
        self.blocks[b.addr] = b
        self.tail[base] = b
        return b

    def _release_cached(self) -> None:
        """Release every fully free segment (torch's ``release_cached_blocks``); expandable: unmap free pages."""
        for base, size in list(self.segs.items()):
            b = self.blocks.get(base)
            if b is not None and not b.allocated and b.prev is None and b.next is None and b.size == size:
                self._remove(b)
                del self.blocks[base], self.segs[base]
                self.reserved -= size
                self.tail.pop(base, None)
                if self.grow.get(b.small) == base:
                    self.segs[base] = 0

    # ---- alloc and free -----------------------------------------------------------------------------
    def alloc(self, key: Hashable, nbytes: int) -> int:
        """Allocate ``nbytes`` for ``key``; returns the block's size (the rounded request, or more)."""
        if key in self.live:
            raise ParallelLabError(f"allocator replay: {key!r} allocated twice without a free")
        size = round_size(int(nbytes), self.config)
        small = size <= SMALL_SIZE
        b = self._best_fit(small, size)
        if b is not None:
            self._remove(b)
        else:
            b = self._new_segment(small, size)
            if b is None:
                self._release_cached()
                b = self._new_segment(small, size)
            if b is None:
                raise ParallelLabError(f"allocator replay: out of memory allocating {size} B with "
                                       f"{self.reserved} B reserved of {self.capacity} B")
        rest = b.size - size
        split = rest >= MIN_BLOCK if (small or self.config.expandable_segments) else (
            rest > SMALL_SIZE and (self.config.max_split_size is None or size < self.config.max_split_size))
        if split:
            r = _Block(b.addr + size, rest, small, b.seg, prev=b, next=b.next)
            if b.next is not None:
                b.next.prev = r
            b.next, b.size = r, size
            if self.tail.get(b.seg) is b:
                self.tail[b.seg] = r
            self.blocks[r.addr] = r
            self._insert(r)
        b.allocated = True
        self.live[key] = (b, int(nbytes))
        self.allocated += b.size
        self.requested += int(nbytes)
        self.peak_allocated = max(self.peak_allocated, self.allocated)
        self.peak_requested = max(self.peak_requested, self.requested)
        return b.size

    def free(self, key: Hashable) -> None:
        """Return ``key``'s block to its pool, merged with free neighbours of its segment."""
        b, n = self.live.pop(key)
        b.allocated = False
        del self.blocks[b.addr]
        self.allocated -= b.size
        self.requested -= n
        for other in (b.prev, b.next):
            if other is not None and not other.allocated:
                self._remove(other)
                del self.blocks[other.addr]
                if other is b.prev:
                    b.addr, b.prev = other.addr, other.prev
                    if b.prev is not None:
                        b.prev.next = b
                else:
                    b.next = other.next
                    if b.next is not None:
                        b.next.prev = b
                    if self.tail.get(b.seg) is other:
                        self.tail[b.seg] = b
                b.size += other.size
        self.blocks[b.addr] = b
        self._insert(b)


def replay(events: Iterable[Event], config: AllocatorConfig = AllocatorConfig(),
           capacity: int | None = None) -> Replay:
    """Run ``events`` (``("alloc", key, nbytes)``, ``("free", key)``) through :class:`CachingAllocator`."""
    a = CachingAllocator(config, capacity)
    over: list[int] = []
    for ev in events:
        if ev[0] == "alloc":
            a.alloc(ev[1], ev[2])
        elif ev[0] == "free":
            a.free(ev[1])
        else:
            raise ParallelLabError(f"allocator replay: unknown event {ev!r}; use ('alloc', key, nbytes) or "
                                   "('free', key)")
        over.append(a.reserved)
    return Replay(a.peak_reserved, a.peak_allocated, a.peak_requested, len(a.segs), over)
