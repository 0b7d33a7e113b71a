"""DeepSpeed ZeRO-3's default stage-3 settings, which a run gets where its config leaves them out
(`TrainSpec.deepspeed_defaults`): deepspeed/runtime/zero/config.py, the same at v0.16.6 and
v0.19.2, and what they make it do (the parameters it gathers again in backward, the copies its
reduce stream holds). zplan's own export writes a unit for the buckets instead
(export.deepspeed_config), so a plan it exports gathers and reduces unit by unit."""

import functools
import math

from . import allocator
from .units import DTYPE_BITS

PREFETCH_BUCKET_ELEMS = 50_000_000  # stage3_prefetch_bucket_size
MAX_LIVE_ELEMS = 1_000_000_000  # stage3_max_live_parameters
MAX_REUSE_DISTANCE_ELEMS = 1_000_000_000  # stage3_max_reuse_distance
REDUCE_BUCKET_ELEMS = 500_000_000  # reduce_bucket_size (ZeRO-3; ZeRO-1/2 the same default)
ALLGATHER_BUCKET_ELEMS = 500_000_000  # allgather_bucket_size (ZeRO-1/2)
SUB_GROUP_ELEMS = 1_000_000_000  # sub_group_size: ZeRO-3's optimizer step, one sub-group at a time
PERSISTENCE_THRESHOLD_ELEMS = 100_000  # stage3_param_persistence_threshold: up to it, kept whole
# Without ZeRO (stage 0) the engine all-reduces the gradients after backward has returned, at the
# accumulation boundary only, in buffers of this many elements (engine.py _backward_epilogue ->
# allreduce_gradients -> buffered_allreduce_fallback, MEMORY_OPT_ALLREDUCE_SIZE; v0.16.6)
ALLREDUCE_FALLBACK_ELEMS = 500_000_000


def reduces_after_backward(strategy: str, layout: str) -> bool:
    """DeepSpeed's stage 0 (zplan's ddp in the zero layout): its all-reduce has nothing beside it."""
    return layout == "zero" and strategy == "ddp"


@functools.lru_cache(maxsize=256)
def backward_gathers(units: tuple[tuple[tuple[int, ...], bool], ...],
                     reuse_distance: int = MAX_REUSE_DISTANCE_ELEMS,
                     persistence_threshold: int = PERSISTENCE_THRESHOLD_ELEMS,
                     prefetch_bucket: int = PREFETCH_BUCKET_ELEMS,
                     max_live: int = MAX_LIVE_ELEMS, reentrant: bool = True) -> tuple[tuple[int, ...], ...]:
    """Per unit, the parameters (their element counts, in the order gathered) that ZeRO-3 at its
    default settings gathers for backward (the recompute's forward and the backward itself), one
    micro-batch in the steady state (its module trace recorded).

    `units`: per unit in forward order, its parameters' element counts and whether a checkpoint
    wraps it (its forward runs again in backward). Modules are the parameters here (a Linear or
    a norm holds one). The step's trace: every unit's forward; then, units in reverse, a wrapped
    unit's forward again (the recompute) and each unit's backward, its modules in reverse; under
    a non-reentrant checkpoint (`reentrant=False`) the recompute runs when backward first unpacks
    a saved tensor, after the pre-backward hook of the unit's last module, so that module's
    backward fetch comes first (DeepSpeed's fetch order, logged on gloo ranks). On it,
    deepspeed/runtime/zero/partitioned_param_coordinator.py (v0.16-v0.19, the same rules) as
    simulated here:
    - fetch (a module's pre-forward or pre-backward hook): gather its parameters not available;
      pop its own uses off the parameter queue (the trace's parameters in order, each with the
      step it serves), marking each param's most recent step fetched for; then prefetch: pop on
      from the queue, gathering what is not available, until the elements gathered reach
      min(stage3_max_live_parameters - elements available, stage3_prefetch_bucket_size). A
      parameter popped while available is not gathered, but marked fetched for its later step.
    - release (its post-forward or post-backward hook): each parameter not persistent (over
      stage3_param_persistence_threshold elements), unless marked fetched for a later step, or
      used again within stage3_max_reuse_distance elements of the trace's next modules.
    A step starts with only the persistent parameters gathered (each other one's last use
    released it; reset_step empties the queue and the marks). The simulation is held against
    DeepSpeed's own ZeRO-3 on gloo ranks with its settings scaled with the model
    (tests/test_deepspeed_release.py)."""
    trace: list[tuple[int, int, int, bool]] = []  # (unit, parameter, elements, for backward)
    for i, (params, _) in enumerate(units):
        trace += [(i, j, n, False) for j, n in enumerate(params)]
    for i in range(len(units) - 1, -1, -1):
        params, wrapped = units[i]
        back = [(i, j, params[j], True) for j in range(len(params) - 1, -1, -1)]
        if wrapped and not reentrant and back:
            trace.append(back.pop(0))
        if wrapped:
            trace += [(i, j, n, True) for j, n in enumerate(params)]
        trace += back
    size = {(i, j): n for i, j, n, _ in trace}
    persistent = {k for k, n in size.items() if n <= persistence_threshold}
    # release's reuse scan: from step k on, the first module whose cumulative elements reach the
    # distance ends it; the parameters seen before are kept
    prefix = [0]
    for _, _, n, _ in trace:
        prefix.append(prefix[-1] + n)
    nxt: list[int | None] = [None] * len(trace)
    seen: dict[tuple[int, int], int] = {}
    for k in range(len(trace) - 1, -1, -1):
        nxt[k] = seen.get(trace[k][:2])
        seen[trace[k][:2]] = k
    queue = [(i, j, k) for k, (i, j, _, _) in enumerate(trace)]  # the parameter trace
    head = 0
    available: set[tuple[int, int]] = set(persistent)
    n_available = 0
    fetched_for: dict[tuple[int, int], int] = {}
    again: list[list[int]] = [[] for _ in units]

    def gather(key: tuple[int, int], for_step: int) -> None:
        nonlocal n_available
        available.add(key)
        n_available += size[key]
        if trace[for_step][3]:
            again[key[0]].append(size[key])

    for k, (i, j, n, _) in enumerate(trace):
        key = (i, j)
        if key not in available:
            gather(key, k)
        if fetched_for.get(key, -1) < k:  # its own use, first in the queue
            qi, qj, qk = queue[head]
            head += 1
            fetched_for[(qi, qj)] = qk
        budget = min(max_live - n_available, prefetch_bucket)
        prefetched: set[tuple[int, int]] = set()
        numel = 0
        while head < len(queue) and numel < budget:
            qi, qj, qk = queue[head]
            head += 1
            q = (qi, qj)
            fetched_for[q] = max(fetched_for.get(q, -1), qk)
            if q not in available and q not in prefetched:
                prefetched.add(q)
                numel += size[q]
                gather(q, qk)
        # release after the module ran (the step id is past it: the scan starts at k + 1)
        if key in persistent or fetched_for.get(key, -1) > k:
            continue
        m = nxt[k]
        if m is not None and prefix[m] - prefix[k + 1] < reuse_distance:
            continue
        available.discard(key)
        n_available -= n
    return tuple(tuple(a) for a in again)


def reduce_scatter_copy_elems(backward_sizes: tuple[int, ...], world: int) -> int:
    """The largest flat copy ZeRO-3's gradient reduction makes, in elements: stage3.py (v0.19.2)
    adds each gradient, as backward makes it, to a bucket and reduces the bucket first where the
    gradient would overflow reduce_bucket_size (`reduce_independent_p_g_buckets_and_remove_grads`);
    at its default `reduce_scatter: true` the bucket goes through `__avg_scatter_grads` ->
    comm/coalesced_collectives.py `reduce_scatter_coalesced`, which interleaves the gradients'
    rank partitions, each padded to ceil(n / world), into a new tensor with `torch.cat`, unless
    the bucket holds one gradient that divides evenly. `backward_sizes`: every parameter's
    elements in the order backward makes their gradients."""
    largest, bucket, filled = 0, [], 0
    for n in list(backward_sizes) + [None]:
        if n is None or (bucket and filled + n > REDUCE_BUCKET_ELEMS):
            if not (len(bucket) == 1 and bucket[0] % world == 0):
                largest = max(largest, sum(-(-b // world) * world for b in bucket))
            bucket, filled = [], 0
        if n is not None:
            bucket.append(n)
            filled += n
    return largest


def reduce_stream_bytes(sc, st) -> int:
    """What DeepSpeed ZeRO-3's reduce stream reserves (zero layout at DeepSpeed's defaults, whose
    overlap_comm is on at stage 3: the reduction runs on a stream of its own,
    `reduce_and_partition_stream`, and the caching allocator gives no other stream a block it has
    cached): the largest flat copy of a bucket that reduce_scatter_coalesced makes
    (reduce_scatter_copy_elems, in the reduce dtype) and, with the optimizer offloaded,
    beside it one gradient partition brought back to the GPU and made fp32 for the host's
    optimizer (stage3.py partition_grads at v0.19.2: `grad_buffer.to(device)`,
    `grad_buffer.to(dtype=master)`), the largest. Each its own segment
    (allocator.segment_bytes); a flat --fragmentation leaves it out, and so does --no-overlap
    (overlap_comm off: `reduce_and_partition_stream` is the default stream). One rank reduces
    too: reduce_scatter_coalesced copies a bucket of several gradients over one partition."""
    t = sc.train
    D = sc.shard_degree(st.hsdp)
    if not (t.layout == "zero" and t.deepspeed_defaults and st.params_sharded and sc.assume.overlap) \
            or sc.assume.fragmentation is not None:
        return 0  # without overlap_comm the reduction runs on the default stream
    sizes = [math.prod(s) for u in sc.units for s in u.shapes]
    rb = DTYPE_BITS[t.precision.reduce] // 8
    copy = reduce_scatter_copy_elems(tuple(reversed(sizes)), D) * rb
    out = allocator.segment_bytes(copy, sc.assume.expandable_segments) if copy else 0
    if st.offload_optimizer:
        part = max(-(-n // D) for n in sizes)
        for b in (DTYPE_BITS[t.precision.param] // 8, DTYPE_BITS[t.precision.master] // 8):
            out += allocator.segment_bytes(part * b, sc.assume.expandable_segments)
    return out
