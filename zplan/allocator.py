"""What PyTorch's CUDA caching allocator reserves for a step, from how it works
(c10/cuda/CUDACachingAllocator.cpp):

- every request is rounded up to a multiple of 512 B (kMinBlockSize); requests of at most
  1 MiB (kSmallSize) come from 2 MiB segments (kSmallBuffer), requests up to 10 MiB
  (kMinLargeAlloc) from 20 MiB segments (kLargeBuffer), larger ones get a segment of their own
  rounded up to 2 MiB (kRoundLarge);
- a freed block is cached, never returned to the driver during training, and reused only for
  a later request on the same CUDA stream (blocks are keyed by stream);
- FSDP2 allocates on three streams (memory_timeline.STREAM): the default stream (weights,
  unsharded parameters and gradients, activations), its all-gather stream (all-gather outputs)
  and its reduce-scatter stream (reduce-scatter inputs and the sharded gradients).

So the reserved peak is at least the sum over streams of each stream's own peak, each rounded
to the segment size: memory one stream has cached cannot serve another. Within a stream the
model assumes cached blocks are reused fully (best-fit with splitting; with
`expandable_segments:True` neighbouring free pages also merge), which is a lower bound there.
`--fragmentation F` replaces this with the flat assumption reserved = (1 + F) x allocated.
"""

from __future__ import annotations

from .memory_timeline import STREAM, Event
from .specs import Assumptions
from .units import MiB

BLOCK_BYTES = 512  # kMinBlockSize
SMALL_BYTES = 1 * MiB  # kSmallSize: the small pool's largest request
SMALL_SEGMENT_BYTES = 2 * MiB  # kSmallBuffer
LARGE_SEGMENT_BYTES = 20 * MiB  # kLargeBuffer, for requests up to kMinLargeAlloc
MIN_LARGE_ALLOC_BYTES = 10 * MiB  # kMinLargeAlloc
ROUND_LARGE_BYTES = 2 * MiB  # kRoundLarge
STREAMS = tuple(sorted(set(STREAM.values())))


def _round_up(n: int, to: int) -> int:
    return -(-int(n) // to) * to


def block_bytes(request: int) -> int:
    """The block one request occupies (CUDACachingAllocator round_size)."""
    return max(BLOCK_BYTES, _round_up(request, BLOCK_BYTES))


def segment_bytes(request: int) -> int:
    """The segment cudaMalloc'd for a request no cached block can serve (get_allocation_size)."""
    if request <= SMALL_BYTES:
        return SMALL_SEGMENT_BYTES
    if request < MIN_LARGE_ALLOC_BYTES:
        return LARGE_SEGMENT_BYTES
    return _round_up(request, ROUND_LARGE_BYTES)


def stream_peaks(events: list[Event]) -> dict[str, int]:
    """Each stream's own peak of live bytes over the step."""
    out = dict.fromkeys(STREAMS, 0)
    for e in events:
        per = dict.fromkeys(STREAMS, 0)
        for k, b in e.live.items():
            per[STREAM[k]] += b
        for s, b in per.items():
            if b > out[s]:
                out[s] = b
    return out


def reserved_bytes(events: list[Event], assume: Assumptions) -> int:
    """Reserved bytes at the step's peak (torch.cuda.max_memory_reserved)."""
    allocated = max((e.total_bytes for e in events), default=0)
    if assume.fragmentation is not None:
        return allocated + int(assume.fragmentation * allocated)
    per = stream_peaks(events)
    return max(allocated, sum(segment_bytes(b) if b else 0 for b in per.values()))
