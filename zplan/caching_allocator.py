"""PyTorch's CUDA caching allocator, simulated over a sequence of allocations and frees: what it
reserves (torch.cuda.max_memory_reserved) for a given order of tensors, block rounding, segment
sizes and splitting, best fit, coalescing and expandable segments included.

Follows c10/cuda/CUDACachingAllocator.cpp (PyTorch 2.5-2.13, DeviceCachingAllocator::malloc,
get_free_block, alloc_block, should_split, free_block/try_merge_blocks,
try_allocate_expandable_block, map_block):

- a request is rounded up to 512 B (round_size); one of at most 1 MiB is served from the small
  pool, a larger one from the large pool; blocks are cached per (stream, pool) and never go back
  to the driver during training (release only on an allocation failure or empty_cache: not
  simulated, reserved memory is assumed unbounded; with `track_releasable` what
  release_cached_blocks would hand back at each new reserved peak is recorded: the classic
  segments wholly free, and in expandable segments the whole pages inside each free block, which
  release_blocks unmaps (unmap_block: from the first page boundary at or above the block's start
  to the last at or below its end) -- the later cudaMallocs a release would cause are not
  re-simulated);
- best fit: the cached block of the request's stream and pool with the smallest size >= the
  request, the lowest address on a tie (BlockComparatorSize);
- classic segments: where no cached block fits, cudaMalloc 2 MiB (request <= 1 MiB), 20 MiB
  (request < 10 MiB) or the request rounded up to 2 MiB (get_allocation_size); a block is split
  when what remains is >= 512 B (small pool) or > 1 MiB (large pool); the allocation takes the
  block's low end; freed blocks merge with free neighbours of the same segment;
- expandable segments (`PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`): one segment of
  virtual address space per (stream, pool), mapped in pages of 2 MiB (small pool) or 20 MiB
  (large pool); a request no free block fits extends the segment at its end, merging with a free
  block there; any remainder of at least 512 B is split off; among blocks that fit, best fit
  prefers one that cannot grow (get_free_block's expandable_size) over the free block at the end.

Pure Python, no torch: the planner (allocator.py) runs it over the loss's tensors and the fake
trace (trainer/fake_trace.py) over every tensor of a traced step. Derivation: docs/formulas.md
section 3 (reserved memory).
"""

from __future__ import annotations

import bisect

BLOCK_BYTES = 512  # kMinBlockSize
SMALL_BYTES = 1 << 20  # kSmallSize
SMALL_SEGMENT_BYTES = 2 << 20  # kSmallBuffer: small segments, and the small pool's page
LARGE_SEGMENT_BYTES = 20 << 20  # kLargeBuffer: mid-size segments, and the large pool's page
MIN_LARGE_ALLOC_BYTES = 10 << 20  # kMinLargeAlloc
ROUND_LARGE_BYTES = 2 << 20  # kRoundLarge


def round_size(nbytes: int) -> int:
    """The block one request occupies (round_size, without roundup_power2_divisions)."""
    return BLOCK_BYTES if nbytes < BLOCK_BYTES else -(-nbytes // BLOCK_BYTES) * BLOCK_BYTES


def allocation_size(size: int) -> int:
    """The classic segment cudaMalloc'd for a request no cached block fits (get_allocation_size)."""
    if size <= SMALL_BYTES:
        return SMALL_SEGMENT_BYTES
    if size < MIN_LARGE_ALLOC_BYTES:
        return LARGE_SEGMENT_BYTES
    return -(-size // ROUND_LARGE_BYTES) * ROUND_LARGE_BYTES


class _Block:
    __slots__ = ("addr", "size", "free", "prev", "next", "segment", "pool", "grows")

    def __init__(self, addr: int, size: int, segment: object, pool: "_Pool"):
        self.addr, self.size, self.segment, self.pool = addr, size, segment, pool
        self.free, self.prev, self.next = True, None, None
        self.grows = isinstance(segment, _Segment)  # in an expandable segment


class _Segment:
    """An expandable segment: its base address, the bytes mapped so far and its last block."""

    __slots__ = ("base", "mapped", "last")

    def __init__(self, base: int):
        self.base, self.mapped, self.last = base, 0, None


_KEY_SHIFT = 96  # a free block's key: size << _KEY_SHIFT | address, addresses all below 2^96


class _Pool:
    """The cached free blocks of one (stream, pool), ordered by (size, address): as one integer
    each (recommend's search runs the allocator over every block of a forward, per candidate)."""

    def __init__(self) -> None:
        self.keys: list[int] = []
        self.blocks: dict[int, _Block] = {}


def _merge(pool: _Pool, lo: _Block, hi: _Block, cached: _Block) -> None:
    """Neighbours `lo` and `hi` of one segment made one block (`lo`); `cached`, the one of them
    that is a cached free block, leaves the pool (free_block -> try_merge_blocks)."""
    k = cached.size << _KEY_SHIFT | cached.addr
    del pool.keys[bisect.bisect_left(pool.keys, k)]
    del pool.blocks[k]
    lo.size += hi.size
    lo.next = hi.next
    if hi.next is not None:
        hi.next.prev = lo
    if lo.grows and lo.segment.last is hi:
        lo.segment.last = lo


_ADDRESS_SPACE = 1 << 48  # apart: no two segments ever touch


class CachingAllocator:
    """malloc(key, nbytes, stream) and free(key) in program order; `reserved_bytes`,
    `allocated_bytes` and their peaks (bytes) follow the allocator's own statistics."""

    def __init__(self, expandable_segments: bool = False, track_releasable: bool = False):
        self.expandable = expandable_segments
        # at each new reserved peak, what release_cached_blocks hands back to the driver before
        # it retries a failed cudaMalloc: classic segments wholly free, expandable segments' free pages
        self.track_releasable = track_releasable
        self.releasable_at_peak_bytes = 0
        self._pools: dict[tuple[str, bool], _Pool] = {}
        self._segments: dict[tuple[str, bool], _Segment] = {}
        self._live: dict[object, _Block] = {}
        self._next_base = 0
        self.allocated_bytes = self.reserved_bytes = 0
        self.peak_allocated_bytes = self.peak_reserved_bytes = 0

    def malloc(self, key: object, nbytes: int, stream: str = "default") -> None:
        nbytes = int(nbytes)
        size = BLOCK_BYTES if nbytes < BLOCK_BYTES else -(-nbytes // BLOCK_BYTES) * BLOCK_BYTES  # round_size
        small = size <= SMALL_BYTES
        pool = self._pools.get((stream, small))
        if pool is None:
            pool = self._pools[(stream, small)] = _Pool()
        keys, blocks = pool.keys, pool.blocks
        i = bisect.bisect_left(keys, size << _KEY_SHIFT)
        if i == len(keys):  # no cached block fits
            b = self._extend(pool, stream, small, size) if self.expandable else self._segment(size, pool)
        elif self.expandable:
            b = self._best_fit(pool, i)
            del keys[bisect.bisect_left(keys, b.size << _KEY_SHIFT | b.addr)]
            del blocks[b.size << _KEY_SHIFT | b.addr]
        else:  # best fit: the smallest size, then the lowest address (the first key at or above)
            b = blocks.pop(keys.pop(i))
        remaining = b.size - size
        if remaining >= BLOCK_BYTES if (small or self.expandable) else remaining > SMALL_BYTES:
            rest = _Block(b.addr + size, remaining, b.segment, pool)
            rest.prev, rest.next = b, b.next
            if b.next is not None:
                b.next.prev = rest
            b.next, b.size = rest, size
            if b.grows and b.segment.last is b:
                b.segment.last = rest
            k = remaining << _KEY_SHIFT | rest.addr
            bisect.insort(keys, k)
            blocks[k] = rest
        b.free = False
        self._live[key] = b
        self.allocated_bytes += b.size
        if self.allocated_bytes > self.peak_allocated_bytes:
            self.peak_allocated_bytes = self.allocated_bytes

    def largest_free_block(self, stream: str = "default", inner: bool = False) -> int:
        """The largest cached free block of the stream's large pool (0 if none); `inner`: not
        counting an expandable segment's free block at its end."""
        pool = self._pools.get((stream, False))
        if pool is None or not pool.keys:
            return 0
        if not inner:
            return pool.keys[-1] >> _KEY_SHIFT
        return max((b.size for b in pool.blocks.values()
                    if not (b.grows and b.segment.last is b)), default=0)

    def free_tail_bytes(self, stream: str = "default") -> int:
        """The free block at the end of the stream's expandable large-pool segment (0 if none):
        a request no other block fits merges with it and maps only the rest."""
        seg = self._segments.get((stream, False))
        return seg.last.size if seg is not None and seg.last is not None and seg.last.free else 0

    def __contains__(self, key: object) -> bool:
        return key in self._live

    def free(self, key: object) -> None:
        b = self._live.pop(key)
        self.allocated_bytes -= b.size
        b.free = True
        pool, lo, hi = b.pool, b.prev, b.next
        if lo is not None and lo.free:  # merge into the free block below
            _merge(pool, lo, b, lo)
            b = lo
        if hi is not None and hi.free:  # and the free block above into it
            _merge(pool, b, hi, hi)
        k = b.size << _KEY_SHIFT | b.addr
        bisect.insort(pool.keys, k)
        pool.blocks[k] = b

    def _best_fit(self, pool: _Pool, i: int) -> _Block:
        """Expandable segments: from the smallest block that fits (keys[i]) on, the free block at a
        segment's end counts as able to grow (get_free_block's expandable_size)."""
        b = pool.blocks[pool.keys[i]]

        def reach(x: _Block) -> int:
            return x.size + (_ADDRESS_SPACE if x.segment.last is x else 0)
        for j in range(i + 1, len(pool.keys)):
            nxt = pool.blocks[pool.keys[j]]
            if reach(nxt) >= reach(b):
                break
            b = nxt
        return b

    def _segment(self, size: int, pool: _Pool) -> _Block:
        n = allocation_size(size)
        b = _Block(self._next_base, n, object(), pool)
        self._next_base += n + _ADDRESS_SPACE
        self._grow(n)
        return b

    def _extend(self, pool: _Pool, stream: str, small: bool, size: int) -> _Block:
        seg = self._segments.get((stream, small))
        if seg is None:
            seg = self._segments[(stream, small)] = _Segment(self._next_base)
            self._next_base += _ADDRESS_SPACE
        page = SMALL_SEGMENT_BYTES if small else LARGE_SEGMENT_BYTES
        last = seg.last
        have = last.size if last is not None and last.free else 0
        grow = -(-(size - have) // page) * page
        seg.mapped += grow
        if have:  # taken before the reserve grows: the new peak's free pages are not its
            k = last.size << _KEY_SHIFT | last.addr
            del pool.keys[bisect.bisect_left(pool.keys, k)]
            del pool.blocks[k]
            self._grow(grow)
            last.size += grow
            return last
        self._grow(grow)
        b = _Block(seg.base + seg.mapped - grow, grow, seg, pool)
        b.prev = last
        if last is not None:
            last.next = b
        seg.last = b
        return b

    def _grow(self, n: int) -> None:
        self.reserved_bytes += n
        if self.reserved_bytes > self.peak_reserved_bytes:
            self.peak_reserved_bytes = self.reserved_bytes
            if self.track_releasable:
                self.releasable_at_peak_bytes = self.wholly_free_bytes() + self.unmappable_bytes()

    def mark(self) -> int:
        """An address at or above every block made so far (for live_bytes_below)."""
        return self._next_base

    def live_bytes_below(self, mark: int) -> int:
        """Bytes of the live blocks in segments made before `mark` was taken."""
        return sum(b.size for b in self._live.values() if b.addr < mark)

    def wholly_free_bytes(self) -> int:
        """The classic segments wholly free now (one free block, no neighbour): what
        release_cached_blocks would hand back to the driver."""
        return sum(b.size for pool in self._pools.values() for b in pool.blocks.values()
                   if b.prev is None and b.next is None and not b.grows)

    def unmappable_bytes(self, inner: bool = False) -> int:
        """The whole pages inside the free blocks of expandable segments now: what
        release_cached_blocks unmaps there (release_blocks -> unmap_block ->
        ExpandableSegment::unmap, segmentRight of the block's start to segmentLeft of its end;
        pages of 2 MiB in the small pool, 20 MiB in the large)."""
        total = 0
        for (_, small), pool in self._pools.items():
            page = SMALL_SEGMENT_BYTES if small else LARGE_SEGMENT_BYTES
            for b in pool.blocks.values():
                if b.grows and not (inner and b.segment.last is b):
                    lo = b.addr - b.segment.base
                    total += max(0, (lo + b.size) // page * page - -(-lo // page) * page)
        return total
