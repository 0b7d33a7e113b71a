"""DeepSpeed ZeRO-3's default stage-3 settings, which a run gets where its config leaves them out
(`TrainSpec.deepspeed_defaults`): deepspeed/runtime/zero/config.py, the same at v0.16.6 and
v0.19.2, and what they make it do (the parameters it gathers again in backward, the copies its
reduce stream holds). zplan's own export writes a unit for the buckets instead
(export.deepspeed_config, from `stage3_settings`), so a plan it exports gathers and reduces unit
by unit, and what it gathers again is the same simulation at those settings."""

import functools
import itertools
import math
from typing import NamedTuple

from . import allocator
from .units import DTYPE_BITS

PREFETCH_BUCKET_ELEMS = 50_000_000  # stage3_prefetch_bucket_size
MAX_LIVE_ELEMS = 1_000_000_000  # stage3_max_live_parameters
MAX_REUSE_DISTANCE_ELEMS = 1_000_000_000  # stage3_max_reuse_distance
REDUCE_BUCKET_ELEMS = 500_000_000  # reduce_bucket_size (ZeRO-3; ZeRO-1/2 the same default)
ALLGATHER_BUCKET_ELEMS = 500_000_000  # allgather_bucket_size (ZeRO-1/2)
PERSISTENCE_THRESHOLD_ELEMS = 100_000  # stage3_param_persistence_threshold: up to it, kept whole
# Without ZeRO (stage 0) the engine all-reduces the gradients after backward has returned, at the
# accumulation boundary only, in buffers of this many elements (engine.py _backward_epilogue ->
# allreduce_gradients -> buffered_allreduce_fallback, MEMORY_OPT_ALLREDUCE_SIZE; v0.16.6)
ALLREDUCE_FALLBACK_ELEMS = 500_000_000


KEEP_GATHERED_ELEMS = 10**12  # more than any model: what zplan's export writes so nothing is released


class Stage3(NamedTuple):
    """The stage-3 settings that decide what ZeRO-3 gathers, in elements."""
    reuse_distance: int  # stage3_max_reuse_distance
    persistence_threshold: int  # stage3_param_persistence_threshold
    prefetch_bucket: int  # stage3_prefetch_bucket_size
    max_live: int  # stage3_max_live_parameters


DEFAULT_STAGE3 = Stage3(MAX_REUSE_DISTANCE_ELEMS, PERSISTENCE_THRESHOLD_ELEMS, PREFETCH_BUCKET_ELEMS, MAX_LIVE_ELEMS)


def unit_elements(sc, hsdp: bool) -> tuple[int, int, int]:
    """(largest unit, held + the largest pair of consecutive units, all units), in elements, as
    the plan gathers them (padded to the shard degree: zplan.scenario): what zplan's export
    sizes DeepSpeed's buckets by."""
    d = sc.shard_degree(hsdp)
    sizes = [sc.padded_elems(u, d) for u in sc.units]
    held = sum(g for g, u in zip(sizes, sc.units) if u.held)
    moving = [g for g, u in zip(sizes, sc.units) if not u.held] or [0]
    pair = max((a + b for a, b in zip(moving, moving[1:])), default=moving[0])
    return max(moving), held + pair, sum(sizes)


def stage3_settings(sc, hsdp: bool, reshard: bool) -> Stage3:
    """The stage-3 settings of a run: DeepSpeed's own where the config leaves them out
    (`TrainSpec.deepspeed_defaults`), else those zplan's export writes (export.deepspeed_config
    reads them here): every parameter sharded (persistence 0); resharded, each released after
    use (reuse distance 0) with a unit prefetched (0 without --prefetch) and two units live;
    not resharded, nothing ever released."""
    if sc.train.deepspeed_defaults:
        return DEFAULT_STAGE3
    unit, live, everything = unit_elements(sc, hsdp)
    prefetch = unit if sc.train.prefetch else 0
    if reshard:
        return Stage3(0, 0, prefetch, live)
    return Stage3(KEEP_GATHERED_ELEMS, 0, prefetch, max(everything, KEEP_GATHERED_ELEMS))


def reduces_after_backward(strategy: str, layout: str) -> bool:
    """DeepSpeed's stage 0 (zplan's ddp in the zero layout): its all-reduce has nothing beside it."""
    return layout == "zero" and strategy == "ddp"


Step = tuple[int, int, int, bool] | None  # (unit, parameter, elements, for backward); None: a container


def module_trace(units: tuple[tuple[tuple[int, ...], bool], ...], containers: tuple[bool, ...],
                 reentrant: bool) -> tuple[list[Step], set[int]]:
    """The fetches of one training step, in DeepSpeed's order (its hooks' order, logged from
    DeepSpeed on gloo ranks), and the steps after which no release runs.

    Modules are the parameters (a Linear or a norm holds one); a unit with a container (a
    block's own module, which holds no parameter) fetches it first, as the model's root does
    at the start of forward and of backward. Forward: root, then every unit (its container,
    its parameters in order). Backward, units in reverse: a checkpointed unit's recompute (its
    container, its parameters in order), then its backward (its container, its parameters in
    reverse). Under a non-reentrant checkpoint the recompute starts at backward's first unpack
    of a saved tensor, after the pre-backward hooks of the container and of the unit's last
    module: their fetches come first, and the last module's release waits for its backward,
    which runs after the recompute (whose forward of that module early stop cuts short of its
    post-forward hook): released at the recompute's step."""
    trace: list[Step] = [None]
    for i, (params, _) in enumerate(units):
        trace += [None] * containers[i] + [(i, j, n, False) for j, n in enumerate(params)]
    trace.append(None)
    no_release: set[int] = set()
    for i in range(len(units) - 1, -1, -1):
        params, wrapped = units[i]
        back = [(i, j, params[j], True) for j in range(len(params) - 1, -1, -1)]
        recompute = [(i, j, n, True) for j, n in enumerate(params)]
        box = [None] * containers[i]
        if wrapped and not reentrant and back:
            no_release.add(len(trace) + len(box))
            trace += box + [back.pop(0)] + box + recompute + back
        elif wrapped:
            trace += box + recompute + box + back
        else:
            trace += box + back
    return trace, no_release


class Coordination(NamedTuple):
    """What ZeRO-3's coordinator does in one micro-batch (`coordinate`)."""
    again: tuple[tuple[int, ...], ...]  # per unit, the parameters gathered for backward (backward_gathers)
    peak_gathered: int  # elements of parameters gathered at once, at most (persistent ones included)
    # per unit, forward and backward: the parameters gathered in calls of several parameters
    # (a prefetch of more than one: _all_gather_coalesced, which copies; a call of one copies
    # nothing), and how many such calls begin with one of its parameters
    coalesced: tuple[tuple[tuple[int, ...], tuple[int, ...]], ...] = ()
    coalesced_calls: tuple[tuple[int, int], ...] = ()
    # every parameter gathered in the micro-batch, in order: its unit, its elements, whether for
    # backward; and where each all-gather call (a module's own fetch, or one prefetch) begins
    gathered_units: tuple[int, ...] = ()
    gathered_elems: tuple[int, ...] = ()
    gathered_backward: tuple[bool, ...] = ()
    call_starts: tuple[int, ...] = ()
    # the most elements held at once for them, beside the gathered ones: each call of several
    # parameters' flat buffer, from its first wait (which copies them all out) until the last of
    # them is fetched (persistent parameters included)
    peak_held: int = 0
    # what is gathered and held when the loss runs (between the forward's last release and the
    # root's pre-backward fetch), persistent parameters included
    held_at_loss: int = 0

    @property
    def calls(self) -> tuple[tuple[tuple[int, int, bool], ...], ...]:
        """Each call's parameters, (unit, elements, for backward), in order."""
        ends = self.call_starts[1:] + (len(self.gathered_units),)
        z = list(zip(self.gathered_units, self.gathered_elems, self.gathered_backward))
        return tuple(tuple(z[a:b]) for a, b in zip(self.call_starts, ends))


def backward_gathers(units: tuple[tuple[tuple[int, ...], bool], ...],
                     reuse_distance: int = MAX_REUSE_DISTANCE_ELEMS,
                     persistence_threshold: int = PERSISTENCE_THRESHOLD_ELEMS,
                     prefetch_bucket: int = PREFETCH_BUCKET_ELEMS,
                     max_live: int = MAX_LIVE_ELEMS, reentrant: bool = True,
                     containers: tuple[bool, ...] | None = None) -> tuple[tuple[int, ...], ...]:
    """Per unit, the parameters ZeRO-3 gathers for backward (`coordinate`'s `again`)."""
    return coordinate(units, reuse_distance, persistence_threshold, prefetch_bucket, max_live, reentrant,
                      containers).again


@functools.lru_cache(maxsize=256)
def coordinate(units: tuple[tuple[tuple[int, ...], bool], ...],
               reuse_distance: int = MAX_REUSE_DISTANCE_ELEMS,
               persistence_threshold: int = PERSISTENCE_THRESHOLD_ELEMS,
               prefetch_bucket: int = PREFETCH_BUCKET_ELEMS,
               max_live: int = MAX_LIVE_ELEMS, reentrant: bool = True,
               containers: tuple[bool, ...] | None = None) -> Coordination:
    """Per unit, the parameters (their element counts, in the order gathered) that ZeRO-3 at
    these settings (DeepSpeed's defaults unless given) gathers for backward (the recompute's
    forward and the backward itself), one micro-batch in the steady state (its module trace
    recorded).

    `units`: per unit in forward order, its modules (a module of one parameter as its element
    count, of several as a tuple of theirs: one fetch gathers them) and whether a checkpoint
    wraps it (its forward runs again in backward); `containers`: per unit, whether a module
    without parameters of its own holds it (a block; default: every unit of more than one
    parameter). The step's fetches: module_trace. On them,
    deepspeed/runtime/zero/partitioned_param_coordinator.py (v0.16-v0.19, the same rules) as
    simulated here:
    - fetch (any module's pre-forward or pre-backward hook, containers too): gather its
      parameters not available; pop its own uses off the parameter queue (the trace's
      parameters in order, each with the step it serves), marking each param's most recent
      step fetched for; then prefetch: pop on from the queue, gathering what is not available,
      until the elements gathered reach min(stage3_max_live_parameters - elements available,
      stage3_prefetch_bucket_size). A parameter popped while available is not gathered, but
      marked fetched for its later step.
    - release (its post-forward or post-backward hook, with the step counter past it): each
      parameter not persistent (over stage3_param_persistence_threshold elements), unless
      marked fetched for a step after the next, or used again within stage3_max_reuse_distance
      elements of the trace's next modules.
    A step starts with only the persistent parameters gathered (each other one's last use
    released it; reset_step empties the queue and the marks). The simulation is held against
    DeepSpeed's own ZeRO-3 on gloo ranks with its settings scaled with the model, and at the
    settings zplan's export writes (tests/test_deepspeed_release.py).

    Also the most elements gathered at once (`peak_gathered`, the persistent parameters, always
    gathered, included; each fetch gathers its module's parameters whatever the live limit, and
    the prefetcher checks the limit before each parameter, so it can pass it by one): the same
    runs' peak of gathered elements, measured in DeepSpeed (ds_status), agrees.

    The queue, the marks, the gathers and the releases are of parameters, as DeepSpeed keeps
    them: a prefetch pops parameter after parameter and can stop inside a module (an MoE
    block's experts, a Linear's weight without its bias), whose own fetch then gathers the rest.

    And what is held beside the gathered parameters (`peak_held`): a call of several copies its
    parameters out of its flat buffer at its first wait, and the buffer lives until the last of
    them is waited on. A module waits on its parameters in the order of a Python set of them
    (by address), so where they came in several calls of several, one call's last wait may
    come before or after another's first: priced in the order that holds most (a review saw
    DeepSpeed hold either, engine to engine, at a module of three tensors).

    And which parameters are gathered in calls of several (`coalesced`): a module's own fetch is
    one call of its parameters not gathered (a tuple's, or one), each prefetch one call of all
    the parameters it gathers
    (`__all_gather_params_` -> `all_gather_coalesced`), which copies where it holds more than one
    (partition_parameters.py: `_all_gather_coalesced`; one parameter goes through
    `_all_gather_sequential`, which copies nothing; unit_ops.fsdp_copies)."""
    if containers is None:
        containers = tuple(len(params) > 1 for params, _ in units)
    # a module of several parameters (a tuple) is fetched in one call of those not persistent;
    # its persistent ones (at most stage3_param_persistence_threshold elements) stay whole on
    # every rank. The trace is of modules; the queue, the marks and what is gathered and
    # released are of parameters, as DeepSpeed keeps them (__param_queue holds a __ParamInTrace
    # per parameter and use: a prefetch can stop inside a module). Persistent parameters are
    # left out of the queue: a prefetch passes them gathering nothing, and a fetch pops them as
    # it pops its others, so the parameters gathered are the same.
    mods = [[m if isinstance(m, tuple) else (m,) for m in params] for params, _ in units]
    trace, no_release = module_trace(tuple((tuple(sum(m) for m in ms), w) for ms, (_, w) in zip(mods, units)),
                                     containers, reentrant)
    # modules and parameters as integers in trace order, which is the units' order (the loop
    # below runs per module of a whole step, in recommend's search once per candidate: lists)
    offset, o = [], 0
    for ms in mods:
        offset.append(o)
        o += len(ms)
    whole = [sum(m) for ms in mods for m in ms]  # the reuse walk counts persistent ones too
    own: list[list[int]] = []  # per module, its parameters not persistent
    sz: list[int] = []  # per parameter, its elements
    unit_of: list[int] = []
    held = 0  # persistent parameters, whole beside the gathered ones
    for i, ms in enumerate(mods):
        for m in ms:
            ids = []
            for n in m:
                if n > persistence_threshold:
                    ids.append(len(sz))
                    sz.append(n)
                    unit_of.append(i)
                else:
                    held += n
            own.append(ids)
    tp = [offset[e[0]] + e[1] if e else -1 for e in trace]
    back = [bool(e and e[3]) for e in trace]
    stop = [False] * len(trace)
    for k in no_release:
        stop[k] = True
    prefix = list(itertools.accumulate((whole[m] if m >= 0 else 0 for m in tp), initial=0))
    if reuse_distance >= prefix[-1]:  # every next use within reach: all kept (zplan's export
        # without resharding): nothing is released, every parameter gathered by the forward's end
        keep = [True] * len(trace)
    else:
        # release's reuse walk: from step k + 1 on, modules are passed, each adding its elements,
        # until the walk has reached the distance; the parameters seen before are kept
        nxt = [-1] * len(trace)
        seen = [-1] * len(whole)
        for k in range(len(trace) - 1, -1, -1):
            m = tp[k]
            if m >= 0:
                nxt[k] = seen[m]
                seen[m] = k
        # per step, whether its release is skipped whatever the marks: a module with nothing
        # sharded, no release there, or the next use within the reuse distance
        keep = [m < 0 or stop[k] or not own[m] or (nxt[k] >= 0 and prefix[nxt[k]] - prefix[k + 1] < reuse_distance)
                for k, m in enumerate(tp)]
    # the parameter queue: each use of each parameter, with the step it serves
    qp = [q for m in tp if m >= 0 for q in own[m]]
    qk = [k for k, m in enumerate(tp) if m >= 0 for _ in own[m]]
    nq, head = len(qp), 0
    avail = [False] * len(sz)
    n_available = peak = 0
    fetched_for = [-1] * len(sz)
    iq: list[int] = []  # every parameter gathered, in order: 2 x its id + 1 if gathered for backward
    starts: list[int] = []  # where in iq each call begins
    never_released = all(keep)
    everything = sum(sz)
    # what is held beside the gathered parameters: a call of several copies each parameter out of
    # its flat buffer at its first wait, and the buffer lives until the last of them is fetched
    pending = [-1] * len(sz)  # the call of several a parameter has still to be waited on in
    flat: list[int] = []  # per call of several, its elements
    left: list[int] = []  # and its parameters not yet waited on (negative: none waited on yet)
    extra = physical = 0
    open_calls = 0  # calls of several whose last parameter is not waited on yet
    # the root's pre-backward fetch: the step after the forward's modules (module_trace)
    loss_step = 1 + sum(containers[i] + len(params) for i, (params, _) in enumerate(units))
    at_loss = -1
    for k, m in enumerate(tp):
        if k == loss_step:
            at_loss = n_available + extra
        if m >= 0:
            ps = own[m]
            if len(ps) == 1:  # most modules (a Linear without bias): no list to build
                get = () if avail[ps[0]] else ps
            else:
                get = [q for q in ps if not avail[q]]
            if get:  # one call of the module's parameters not available (the prefetch gathers alike)
                starts.append(len(iq))
                numel = 0
                for q in get:
                    avail[q] = True
                    numel += sz[q]
                    iq.append(2 * q + back[k])
                n_available += numel
                if len(get) > 1:  # a call of several: it copies, and is waited on at once
                    for q in get:
                        pending[q] = len(flat)
                    flat.append(numel)
                    left.append(-len(get))
                    open_calls += 1
            if n_available + extra > physical:
                physical = n_available + extra
            # the module waits on its parameters in the order of a Python set of them
            # (params_to_fetch: by address, not by ds_id), so where they came in calls of
            # several, a call's last wait may come after another call's first: priced in the
            # order that holds most, every first wait before any buffer is freed (a review saw
            # DeepSpeed hold either, engine to engine)
            popped = 0
            for q in ps:
                c = pending[q]
                if c >= 0 and left[c] < 0:  # the first wait on a call copies every parameter out
                    left[c] = -left[c]
                    extra += flat[c]
                if fetched_for[q] < k:  # its own use, first in the queue
                    popped += 1
            if n_available + extra > physical:
                physical = n_available + extra
            for q in ps:
                c = pending[q]
                if c >= 0:
                    pending[q] = -1
                    left[c] -= 1
                    if not left[c]:  # the last waited on: the flat buffer is freed
                        extra -= flat[c]
                        open_calls -= 1
            for _ in range(popped):
                fetched_for[qp[head]] = qk[head]
                head += 1
        budget = max_live - n_available
        if budget > prefetch_bucket:
            budget = prefetch_bucket
        numel = 0
        first = len(iq)
        while numel < budget and head < nq:
            q, qs = qp[head], qk[head]
            head += 1
            if fetched_for[q] < qs:
                fetched_for[q] = qs
            if not avail[q]:  # a repeat in the queue is not gathered twice
                numel += sz[q]
                avail[q] = True
                iq.append(2 * q + back[qs])
        if numel:  # the prefetch is one call
            starts.append(first)
            n_available += numel
            if len(iq) - first > 1:
                for j in range(first, len(iq)):
                    pending[iq[j] >> 1] = len(flat)
                flat.append(numel)
                left.append(first - len(iq))
                open_calls += 1
        if n_available + extra > physical:
            physical = n_available + extra
        if n_available > peak:  # gathered only rises before the release below
            peak = n_available
        if never_released and peak == everything and not open_calls:  # all gathered and waited on,
            break  # none to release: done (a call not yet waited on still copies out of its buffer)
        if keep[k]:
            continue
        for q in own[m]:
            if fetched_for[q] <= k + 1:
                avail[q] = False
                n_available -= sz[q]
    again: list[list[int]] = [[] for _ in units]
    coalesced: list[tuple[list[int], list[int]]] = [([], []) for _ in units]
    calls = [[0, 0] for _ in units]
    iu = tuple(unit_of[q >> 1] for q in iq)
    isz = tuple(sz[q >> 1] for q in iq)
    ib = tuple(bool(q & 1) for q in iq)
    for u, n, for_backward in zip(iu, isz, ib):
        if for_backward:
            again[u].append(n)
    for a, b in zip(starts, starts[1:] + [len(iq)]):
        if b - a > 1:  # one all_gather_coalesced call of several parameters
            for j in range(a, b):
                coalesced[iu[j]][ib[j]].append(isz[j])
            calls[iu[a]][ib[a]] += 1
    return Coordination(tuple(tuple(a) for a in again), peak + held,
                        tuple((tuple(f), tuple(b)) for f, b in coalesced), tuple((f, b) for f, b in calls),
                        iu, isz, ib, tuple(starts), physical + held,
                        # the loop stops early where nothing is ever released: all gathered and
                        # waited on from there, no flat buffer left
                        (at_loss if at_loss >= 0 else n_available + extra) + held)


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
