"""What PyTorch's CUDA caching allocator reserves for a step, from how it works
(c10/cuda/CUDACachingAllocator.cpp; simulated in caching_allocator.py):

- every request is rounded up to a multiple of 512 B (kMinBlockSize); requests of at most
  1 MiB (kSmallSize) come from 2 MiB segments (kSmallBuffer), requests up to 10 MiB
  (kMinLargeAlloc) from 20 MiB segments (kLargeBuffer), larger ones get a segment of their own
  rounded up to 2 MiB (kRoundLarge); with `expandable_segments:True` each stream's pool is one
  segment mapped in 20 MiB pages;
- a freed block is cached, never returned to the driver during training, and reused only for
  a later request on the same CUDA stream (blocks are keyed by stream);
- FSDP2 allocates on three streams (memory_timeline.STREAM): the default stream (weights,
  unsharded parameters and gradients, activations, the reduce-scatter input), its all-gather
  stream (all-gather outputs) and its reduce-scatter stream (the sharded gradients).

So the reserved peak is at least the sum over streams of each stream's own peak, each rounded
to the segment size: memory one stream has cached cannot serve another. Within the default
stream the loss leaves a hole no later request fits: its vocabulary-sized tensors are made and
freed in an order (activation_memory.loss_tensor_steps) the allocator can only partly reuse -- where
the loop drops the logits, the logits and their fp32 copy free a block one and a half times the
size of the two fp32 gradients of the backward, which take it and fresh memory beside it; and
under FSDP2 the head unit's reduce-scatter input, at short sequences larger than any block the
loss freed, takes fresh memory too, as does, at the end of backward, the reduce-scatter input of
the unit reduced last where it is a root holding embedding and head (4 GiB in fp32 for Llama 3.1
8B). The loss's tensors, the head unit's and the end of backward's (HeadTail) run through the
allocator simulation on top of everything else the default stream holds then (assumed packed),
and beside the blocks a checkpointed forward has left cached, too small for the loss's
tensors (forward_holes: the forward simulated tensor by tensor, what its blocks keep leaving
holes in the blocks they freed; forward_residue_bytes), and the default stream reserves at
least that; the all-gather
stream is simulated whole (all_gather_stream_reserved). Elsewhere the model assumes cached
blocks are reused fully (docs/reserved-matrix.md holds it against the allocator replayed over
every tensor of traced steps: from -0.9% to +0.6% with classic segments, mean -0.2%).
`--fragmentation F` replaces all this with the flat assumption reserved = (1 + F) x allocated.
"""

from __future__ import annotations

from dataclasses import dataclass

from .activation_memory import loss_tensor_steps
from .caching_allocator import (LARGE_SEGMENT_BYTES, MIN_LARGE_ALLOC_BYTES, SMALL_BYTES, CachingAllocator,
                                allocation_size, round_size)
from .memory_timeline import STREAM, Event
from .specs import Assumptions, TrainSpec

STREAMS = tuple(sorted(set(STREAM.values())))


def block_bytes(request: int) -> int:
    """The block one request occupies (CUDACachingAllocator round_size)."""
    return round_size(int(request))


def segment_bytes(request: int, expandable: bool = False) -> int:
    """The segment cudaMalloc'd for a request no cached block can serve (get_allocation_size), or
    with expandable segments the pages mapped for it (20 MiB in the large pool, 2 MiB in the
    small one)."""
    if expandable and request > SMALL_BYTES:
        return -(-int(request) // LARGE_SEGMENT_BYTES) * LARGE_SEGMENT_BYTES
    return allocation_size(int(request))


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


@dataclass(frozen=True)
class HeadTail:
    """The head unit's own tensors around the loss (FSDP2, torch layout), bytes: its unsharded
    weights in the param dtype where it is gathered again for backward (0 where it stays
    gathered from its forward), its unsharded weight gradients and its input gradient, and its
    reduce-scatter input where it is reduced as its backward ends (0 for a held root, reduced
    with everything else at the end of backward). Weights and gradients are one block per
    parameter (a tuple; an int is one tensor): FSDP2's all-gather outputs are one storage per
    parameter (FSDPParam.all_gather_outputs, padded on dim 0), and autograd makes each
    gradient in its parameter's shape; the reduce-scatter input is one flat tensor
    (foreach_reduce). Until 2026-12-07 a unit's weights were one block: Llama 3.1 8B's head
    and norm 8 KiB over the 1002 MiB blocks its loss frees at seq 2048, a segment of their own
    each, 0.9 GiB over the allocator replayed over a traced step."""

    weights_bytes: int | tuple[int, ...]
    grad_bytes: int | tuple[int, ...]
    input_grad_bytes: int
    reduce_in_bytes: int
    # the unit reduced last, as backward ends (the embedding's, or the held root): its weights
    # gathered again for its backward (a held root's are weights_bytes, kept from the head's
    # backward to its own reshard), the gradient its backward makes then (the embedding
    # weight's) and its reduce-scatter input; and the blocks' activations, alive through the
    # loss and freed by then: with classic segments the largest one tensor (each has a segment
    # of its own), with expandable segments all of them (one segment, below the loss's tensors)
    last_weights_bytes: int | tuple[int, ...] = 0
    last_grad_bytes: int | tuple[int, ...] = 0
    last_reduce_in_bytes: int = 0
    freed_block_bytes: int = 0
    held_root: bool = False  # the head sits in the root, reduced with the embedding at the end
    tied: bool = False  # one weight: the embedding's gradient is added into the head's
    tied_out_of_place: bool = False  # ... into a new tensor, where the head's is a view (a plain
    # head: nn.Linear's weight gradient is a transpose); a linear loss's takes it in place
    accumulating: bool = False  # micro-batches skip the reduce: the new gradients go into the
    # accumulated ones before the reduce-scatter input is allocated (FSDPParam accumulation)


def loss_reserved_bytes(logits_elems: int, train: TrainSpec, loss_fp32: bool, expandable: bool,
                        head: HeadTail | None = None) -> int:
    """What the allocator reserves for the loss's own tensors (activation_memory.loss_tensor_steps, each
    `logits_elems` logits), run through caching_allocator.CachingAllocator from nothing cached:
    their peak plus the holes none of them fits. With `head`, the head unit's tensors around it,
    in FSDP2's order: its weights gathered for its forward and freed after it (reshard after
    forward), the loss, its weights gathered again (pre-backward), its input and weight
    gradients while the logits' gradient is alive, then that gradient freed, the weights freed
    (reshard after backward) and the reduce-scatter input allocated before the unsharded
    gradients are released (_fsdp_collectives.foreach_reduce: copy-in, then clear)."""
    return loss_reserve(logits_elems, train, loss_fp32, expandable, head)[0]


def loss_releasable_bytes(logits_elems: int, train: TrainSpec, loss_fp32: bool, expandable: bool,
                          head: HeadTail | None = None) -> int:
    """Of loss_reserved_bytes, what sits in segments wholly free when the reserve peaks: a
    block the loss freed that none of its later tensors fits (under a model's fp32 logits, the
    head's 16-bit output, freed once cast), the head's weights resharded. PyTorch's allocator
    hands such segments back to the driver and retries before it fails a cudaMalloc
    (CUDACachingAllocator.cpp release_cached_blocks); with expandable segments it unmaps the
    whole pages inside each free block (CachingAllocator.unmappable_bytes)."""
    return loss_reserve(logits_elems, train, loss_fp32, expandable, head)[1]


def loss_reserve(logits_elems: int, train: TrainSpec, loss_fp32: bool, expandable: bool,
                 head: HeadTail | None = None) -> tuple[int, int]:
    """(loss_reserved_bytes, loss_releasable_bytes) from one simulation."""
    if logits_elems <= 0 and not (head and head.last_reduce_in_bytes):
        return 0, 0
    sim = CachingAllocator(expandable, track_releasable=True)
    blocks_bytes = 0
    if head and head.freed_block_bytes:
        # the blocks' activations, alive through the loss; their bytes are counted with
        # everything else the stream holds then (default_stream_floor), so they are taken off
        # below (the rounding of their block stays: the real ones have it too)
        _put(sim, "blocks' activations", head.freed_block_bytes)
        blocks_bytes = round_size(head.freed_block_bytes)
    if logits_elems <= 0:
        return _linear_loss_backward(sim, head) - blocks_bytes, sim.releasable_at_peak_bytes
    w = head.weights_bytes if head else 0
    if w:
        _put(sim, "head weights", w)
    live = []
    steps = loss_tensor_steps(train, loss_fp32, logits_elems)
    for _, op, name, nbytes in steps:
        if op == "+":
            sim.malloc(name, nbytes)
            live.append(name)
            if name == steps[0][2] and w:  # the head's forward made them: it reshards
                _drop(sim, "head weights")
        else:
            sim.free(name)
            live.remove(name)
    if head:
        if train.logits_unreferenced and "logits" in live:  # a compiled or fused loss's saved
            sim.free("logits")  # logits go when its backward ends, where the loop holds none
            live.remove("logits")
        if w:
            _put(sim, "head weights", w)
        for name, b in (("head input grad", head.input_grad_bytes), ("head grad", head.grad_bytes)):
            _put(sim, name, b)
        sim.free(live[-1])  # the logits' gradient, consumed by the head's backward
        _head_reduce(sim, head)
    return sim.peak_reserved_bytes - blocks_bytes, sim.releasable_at_peak_bytes


def _parts(b: int | tuple[int, ...]) -> tuple[int, ...]:
    """A HeadTail field as its tensors' bytes: one tensor, or one per parameter."""
    return (b,) if isinstance(b, int) else b


def _put(sim: CachingAllocator, name: str, b: int | tuple[int, ...]) -> None:
    """Allocate `name`'s tensors (HeadTail's bytes, one block each; none of 0 bytes)."""
    for j, x in enumerate(x for x in _parts(b) if x):
        sim.malloc((name, j), x)


def _drop(sim: CachingAllocator, name: str) -> None:
    """Free `name`'s tensors, where live (_put numbers them from 0)."""
    j = 0
    while (name, j) in sim:
        sim.free((name, j))
        j += 1


def _head_reduce(sim: CachingAllocator, head: HeadTail) -> None:
    """The head unit's post-backward: its weights resharded (a held root's only after its own
    backward, at the end), its reduce-scatter input allocated; then the end of backward."""
    if head.weights_bytes and not head.held_root:
        _drop(sim, "head weights")
    if head.reduce_in_bytes:
        _put(sim, "reduce-scatter input", head.reduce_in_bytes)
    if head.last_reduce_in_bytes:
        _backward_end(sim, head)


def _linear_loss_backward(sim: CachingAllocator, head: HeadTail) -> int:
    """Under a linear loss (no logits): the head's weight gradient, made in the loss's forward
    and counted with what the stream holds at the loss (so taken off again), then the head's
    backward as FSDP2 runs it -- its weights gathered again where it resharded, its input
    gradient, its reduce-scatter input (a held root's waits) -- and the end of backward."""
    _put(sim, "head grad", head.grad_bytes)
    _put(sim, "head weights", head.weights_bytes)
    _put(sim, "head input grad", head.input_grad_bytes)
    _head_reduce(sim, head)
    return sim.peak_reserved_bytes - sum(round_size(b) for b in _parts(head.grad_bytes) if b)


def _backward_end(sim: CachingAllocator, head: HeadTail) -> None:
    """The end of backward on top of the loss's and the head's tensors (`sim`): the head's input
    gradient is consumed by the last block's backward, its unsharded gradients by its
    reduce-scatter input's copy-in (a held root keeps its head gradient, and its weights, to its
    own post-backward), and that input is released at the next unit's reduce-scatter; the
    blocks have freed their activations. The last unit -- the embedding's, or the held root --
    is gathered again where it resharded, makes the embedding's gradient, and in its
    post-backward (FSDPParamGroup.post_backward, torch 2.13) adds its new gradients into the
    accumulated ones where micro-batches skip the reduce, reshards, and allocates its
    reduce-scatter input, which the cached blocks may not fit: a held root's embedding, norm
    and head in fp32, 4 GiB for Llama 3.1 8B, where the loss's largest block is 1 GiB at seq
    2048 and, with the norm's weight, 16 KiB too small at 8192. What is still live from the
    loss (the logits the loop holds until backward returns) stays."""
    gone = ["head input grad", "reduce-scatter input", "blocks' activations"]
    if not head.held_root:  # a held root's head gradient waits for the root's reduce-scatter
        gone.append("head grad")
    for name in gone:
        _drop(sim, name)
    _put(sim, "last weights", head.last_weights_bytes)
    _put(sim, "last grad", head.last_grad_bytes)
    # FSDPParamGroup.post_backward: the new gradients added into the accumulated ones (or, tied,
    # autograd added the embedding's into the head's in place), the unit resharded, then
    # foreach_reduce allocates the input
    gone = (["last grad", "head grad"] if head.accumulating else ["last grad"] if head.tied else [])
    if head.tied and head.tied_out_of_place:  # autograd's input buffer: head's + embedding's, into
        _put(sim, "tied sum", sum(_parts(head.grad_bytes)))  # a new tensor, which becomes .grad
        _drop(sim, "last grad")
        _drop(sim, "head grad")
        gone = ["tied sum"] if head.accumulating else []
    for name in gone + ["last weights", "head weights"]:
        _drop(sim, name)
    sim.malloc("last reduce-scatter input", head.last_reduce_in_bytes)


def forward_residue_bytes(transient: int, largest: int, loss_tensors: list[int], expandable: bool) -> int:
    """The forward's freed working set still cached when the loss begins, which the loss cannot
    use: a checkpointed block's first forward (activation_memory.forward_transient_bytes,
    `transient` bytes freed, its largest tensor `largest`) leaves each of those tensors' blocks free in
    segments of their own, block after block, and the loss's vocabulary-sized tensors are
    larger than any of them, so new segments are reserved beside them. The loss's own tensors
    (`loss_tensors`) that do fit such a block take it instead; the head's around the loss are
    placed by loss_reserved_bytes already. With expandable segments the same, over the holes
    inside the stream's one segment (forward_holes with `expandable`: the free block at its end
    is where the loss grows it, not a residue). Held against the caching allocator replayed over
    traced steps (docs/reserved-matrix.md; Llama 2 7B at 16,384 tokens per micro-batch, full
    checkpointing: 1.36 GiB of such blocks free when the loss began, where this gives 1.13)."""
    if transient <= 0 or largest < MIN_LARGE_ALLOC_BYTES:
        # tensors under 10 MiB share 20 MiB segments, which later requests reuse; with expandable
        # segments, holes that small inside the one segment are assumed reused the same way
        return 0
    return max(0, transient - sum(b for b in loss_tensors if 0 < b <= largest))


def forward_holes(steps: tuple[tuple[str, str, int], ...], input_bytes: int,
                  unit_params: tuple[tuple[int, ...], ...], reshard: tuple[bool, ...],
                  blocks_per_unit: tuple[int, ...], freed_first: int = 0,
                  block_steps: tuple = (), expandable: bool = False) -> tuple[int, int, int]:
    """The default stream's free cached bytes when a checkpointed forward ends, its largest free
    block, and of those bytes the segments wholly free (the last block's working set; a hole
    is the rest of a segment a kept tensor holds): the block units' forward run through
    CachingAllocator, every block of it (the holes' increments do not repeat
    regularly enough to extrapolate: a unit kept gathered, a last unit of fewer blocks, weights
    kept by reshard_after_forward=False). First a block of `freed_first` bytes freed (the
    embedding unit's gathered weight, where it is a unit of its own that reshards) and the first
    block's input (`input_bytes`, kept). Each unit gathers its weights at its start
    (`unit_params`, bytes per parameter: FSDP2 copies each into a storage of its own on the
    default stream; empty where nothing is gathered then), runs its blocks' steps
    (activation_memory.forward_tensor_steps: each block keeps what the policy saves, and its
    input but where a step "in" frees it), and frees the weights as it ends where `reshard` says so. A kept tensor taking the
    front of a freed larger block leaves a remainder the next block's larger tensors do not fit:
    holes that grow unit after unit (docs/formulas.md section 3). `block_steps`, where given, is
    each block's own steps, in block order (every-k and first-k: a checkpointed block's and one
    that keeps its intermediates, activation_memory.block_mode); else every block runs `steps`.
    With `expandable` segments (one segment mapped in 20 MiB pages): the free bytes inside it, not
    the free block at its end (a later request no hole fits merges with that one and maps only
    the rest), the largest of them, and the whole pages inside them (what release_cached_blocks
    unmaps: caching_allocator.CachingAllocator.unmappable_bytes)."""
    def planned(steps):  # "in": the block's input (the previous block's output), index None
        index = {name: i for i, (op, name, _) in enumerate(steps) if op == "+"}
        return [(op == "+", index.get(name) if name != "in" else None, b) for op, name, b in steps], index["out"]
    variants = {}
    for st in (steps,) + tuple(block_steps):
        if st not in variants:
            variants[st] = planned(st)
    width = max(len(st) for st in variants) + 1
    sim = CachingAllocator(expandable)
    if freed_first:
        sim.malloc(-2, freed_first)
    sim.malloc(-1, input_bytes)
    if freed_first:
        sim.free(-2)
    block, previous_out = 0, -1
    for u, (params, drop, n) in enumerate(zip(unit_params, reshard, blocks_per_unit)):
        for j, b in enumerate(params):
            sim.malloc(("param", u, j), b)
        for _ in range(n):
            base = block * width
            plan, out = variants[block_steps[block] if block_steps else steps]
            for alloc, i, b in plan:
                if alloc:
                    sim.malloc(base + i, b)
                else:
                    sim.free(previous_out if i is None else base + i)
            previous_out = base + out
            block += 1
        if drop:
            for j in range(len(params)):
                sim.free(("param", u, j))
    if expandable:  # the free block at the segment's end is where the loss grows it
        tail = sim.free_tail_bytes()
        return (sim.reserved_bytes - sim.allocated_bytes - tail, sim.largest_free_block(inner=True),
                sim.unmappable_bytes(inner=True))
    return sim.reserved_bytes - sim.allocated_bytes, sim.largest_free_block(), sim.wholly_free_bytes()


def cached_param_blocks(param_bytes: tuple[int, ...], kept: tuple[int, ...], working: tuple[int, ...],
                        layers: int) -> tuple[int, int]:
    """What of the parameters' own cached blocks the step leaves unused at its peak, and the part
    of that in segments wholly free, bytes. DeepSpeed ZeRO-1/2 from 0.19.0 (stage_1_and_2.py,
    `flatten_on_accelerator`, PR #7828) flattens the 16-bit parameters on the GPU beside them and
    makes each parameter a view of the flat buffer: the parameters' own storages (`param_bytes`,
    in model order, one caching-allocator block each) are freed with no empty_cache after, so
    their segments stay reserved and free when the first step begins. The step's tensors take
    them where they fit (best fit, the front of a larger block), the rest of the step reserves
    new segments as it would without them. Run through CachingAllocator: the parameters made and
    freed, then each of `layers` blocks' kept tensors (`kept`, bytes, forward order), then one
    block's working set on top (`working`: what its recompute, or its backward, holds at the
    peak); the cache's bytes not holding a step tensor then are what the step reserves beyond
    its own need (docs/formulas.md section 3). The model state is left out: the flat buffer never
    fits a parameter's block, the fp32 master weights and the optimizer's state do at 32 ranks and
    more for an 8B model (its 1002 MiB embedding and head blocks), which this overstates by well
    under a GiB (a reviewer's replay)."""
    sim = CachingAllocator()
    for i, b in enumerate(param_bytes):
        sim.malloc(("param", i), b)
    cache, mark = sim.reserved_bytes, sim.mark()
    for i in range(len(param_bytes)):
        sim.free(("param", i))
    for layer in range(layers):
        for j, b in enumerate(kept):
            sim.malloc(("kept", layer, j), b)
    for j, b in enumerate(working):
        sim.malloc(("working", j), b)
    return cache - sim.live_bytes_below(mark), sim.wholly_free_bytes()


def all_gather_stream_reserved(forward: list[int], backward: list[int], expandable: bool) -> int:
    """What FSDP2's all-gather stream reserves over a step, its all-gather outputs run through
    CachingAllocator in the order FSDP2 makes and frees them (torch 2.13 _fsdp_param_group.py):
    in forward each unit's output (`forward`, bytes in forward order, 0 for none) is allocated
    before the previous unit's is freed, at this unit's copy-out (wait_for_unshard keeps it in
    the all-gather state to overlap the copy-out with the next all-gather: two alive), the last
    one when forward ends; in backward a unit gathered again (`backward`, in backward order) is
    freed at its own copy-out, before its pre-backward prefetches the next. The stream's peak of
    live bytes packed (stream_peaks) undercounts where the units differ in size: a block's
    output takes part of the embedding unit's freed block, and a head unit larger than any
    free block (by its norm's 16 KiB beside the embedding's) takes a segment of its own: three
    segments (embedding, block, head) where two outputs are ever alive. Not modelled: a unit
    gathered once more for its recompute (FSDP1's reentrant wrap, freed before the next); the
    all-gather input FSDP2 copies a unit's shards into under mixed precision (one shard in the
    param dtype, on the same stream, freed after the collective: _fsdp_collectives.py); FSDP1's
    flat parameters (the configurations named after it, root-kept and a checkpoint around the
    unit, are priced in FSDP2's order)."""
    sim = CachingAllocator(expandable)
    prev = None
    for i, b in enumerate(forward):
        if b > 0:
            sim.malloc(("forward", i), b, "all-gather")
            if prev is not None:
                sim.free(prev)
            prev = ("forward", i)
    if prev is not None:
        sim.free(prev)
    for j, b in enumerate(backward):
        if b > 0:
            sim.malloc(("backward", j), b, "all-gather")
            sim.free(("backward", j))
    return sim.peak_reserved_bytes


def default_stream_floor(start: Event | None, loss_bytes: int, loss_reserved: int,
                         forward_residue: int = 0) -> int:
    """The default stream's reserve through the loss: what it holds besides the loss's tensors
    when the loss begins (`start`, the "loss forward" event, less the loss's own `loss_bytes`),
    the forward's cached blocks the loss cannot use (forward_residue_bytes), and the loss's own
    reserve on top; 0 where no event is the loss's or neither reserve exists. A linear loss
    makes no logits (`loss_bytes` 0): its tensors are in `start`'s live bytes already."""
    if start is None or not (loss_reserved or forward_residue):
        return 0
    held = sum(b for k, b in start.live.items() if STREAM[k] == "default") - loss_bytes
    return max(held, 0) + forward_residue + loss_reserved


def reserved_bytes(events: list[Event], assume: Assumptions, default_floor: int = 0) -> int:
    """Reserved bytes at the step's peak (torch.cuda.max_memory_reserved): the sum over streams
    of each stream's peak in whole segments, the default stream's at least `default_floor`."""
    allocated = max((e.total_bytes for e in events), default=0)
    return reserved_from_peaks(allocated, stream_peaks(events), assume, default_floor)


def reserved_from_peaks(allocated: int, per_stream: dict[str, int], assume: Assumptions,
                        default_floor: int = 0, all_gather: int = 0) -> int:
    """reserved_bytes from the step's peak of live bytes and each stream's own peak
    (stream_peaks), the default stream's at least `default_floor` and the all-gather stream's at
    least `all_gather` (all_gather_stream_reserved, already in whole segments), or a flat
    --fragmentation over the allocated peak where one is given."""
    if assume.fragmentation is not None:
        return allocated + int(assume.fragmentation * allocated)
    per = {**per_stream, "default": max(per_stream.get("default", 0), default_floor)}
    expandable = assume.expandable_segments
    segments = {s: segment_bytes(b, expandable) if b else 0 for s, b in per.items()}
    if "all-gather" in segments:
        segments["all-gather"] = max(segments["all-gather"], all_gather)
    return max(allocated, sum(segments.values()))
