"""Communication per step: every collective, its size, and its time.

Volume convention (Rajbhandari et al. 2020, section 7): an all-gather or a reduce-scatter of a
tensor of S elements counts S, an all-reduce counts 2S; so DDP moves 2Ψ per step and ZeRO-3 3Ψ.
Time is NCCL's own cost model with the cluster's nccl-tests bandwidths (zplan.nccl), charged per
call as the framework issues them: FSDP one all-gather and one reduce-scatter per unit, DDP and
DeepSpeed ZeRO-1/2 one per gradient bucket. Derivations: docs/formulas.md.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace
from functools import lru_cache
from typing import NamedTuple

from . import arch, muon, policy
from .deepspeed import ALLREDUCE_FALLBACK_ELEMS, reduces_after_backward
from .nccl import collective_time, contiguous_shape, strided_shape
from .scenario import PinnedMemo, Scenario
from .strategies import Strategy
from .units import DTYPE_BITS, nbytes


WHOLE_MATRIX = "all-gather (whole matrices for the optimizer)"


def bucket_elements(bucket_bytes: int, dtype: str) -> int:
    """A bucket of `bucket_bytes` in elements of `dtype`, as DeepSpeed's reduce_bucket_size and
    allgather_bucket_size count it: the one conversion the DeepSpeed export writes and the
    ZeRO-1/2 collectives are timed with (whole elements, at least one)."""
    return max(1, bucket_bytes // nbytes(1, dtype))


@dataclass(frozen=True)
class Collective:
    name: str  # e.g. "all-gather (forward)"
    op: str  # all_gather | reduce_scatter | all_reduce | reduce | h2d | d2h
    elements: int  # size of the full tensor the op works on, per call
    dtype: str
    group_size: int
    scope: str  # intra-node | inter-node | pcie
    calls_per_step: int
    seconds_per_call: float
    # a gradient reduction issued in buckets as backward fills them (DDP, DeepSpeed ZeRO-1/2):
    # the seconds of its final bucket, the one backward's end waits for, and of the calls that
    # wait on each other with nothing beside them (DeepSpeed's per-owner reduces, _owner_reduces);
    # 0 where not bucketed
    last_bucket_s: float = 0.0
    per_node: int = 0  # GPUs of the group in one node (the shape NCCL's algorithm sees)
    call_bytes: int = 0  # the largest single call as issued (a unit, a bucket, a parameter)
    call: str = ""  # what that call is

    @property
    def volume_factor(self) -> int:
        return 2 if self.op == "all_reduce" else 1

    @property
    def moves(self) -> bool:
        """A collective over one rank moves nothing (FSDP2 and the reference skip it)."""
        return self.group_size > 1 or self.op in ("h2d", "d2h")

    @property
    def seconds_per_step(self) -> float:
        return self.seconds_per_call * self.calls_per_step

    @property
    def elements_per_step(self) -> int:
        if self.op in ("h2d", "d2h") or not self.moves:
            return 0
        return self.volume_factor * self.elements * self.calls_per_step

    @property
    def bytes_per_step(self) -> int:
        if not self.moves:
            return 0
        return self.volume_factor * nbytes(self.elements, self.dtype) * self.calls_per_step

    def as_dict(self) -> dict:
        d = {f.name: getattr(self, f.name) for f in fields(self)}
        d.update(elements_per_step=self.elements_per_step, bytes_per_step=self.bytes_per_step)
        return d


def call_seconds(sc: Scenario, op: str, nbytes_: int, n: int, per_node: int) -> float:
    """One call as NCCL runs it on this cluster (zplan.nccl)."""
    return collective_time(sc.hw.cluster, op, nbytes_, n, per_node).seconds


def bucketed_seconds(sc: Scenario, op: str, total_bytes: int, n: int, per_node: int,
                     bucket_bytes: int) -> float:
    """A collective split evenly into calls of at most `bucket_bytes` (DeepSpeed's all-gather of
    the updated weights in allgather_bucket_size pieces; a unit's share of ZeRO-3's default
    reduce bucket), each timed as NCCL runs it. Gradient buckets as the libraries fill them are
    bucket_calls'."""
    if bucket_bytes <= 0 or total_bytes <= bucket_bytes:
        return call_seconds(sc, op, total_bytes, n, per_node)
    full, rest = divmod(total_bytes, bucket_bytes)
    t = full * call_seconds(sc, op, bucket_bytes, n, per_node)
    return t + (call_seconds(sc, op, rest, n, per_node) if rest else 0.0)


DDP_FIRST_BUCKET_BYTES = 2**20  # DDP's first bucket (c10d reducer.hpp kDefaultFirstBucketBytes)
DDP_DEFAULT_BUCKET_BYTES = 25 * 2**20  # DistributedDataParallel's bucket_cap_mb default


def ddp_first_bucket_bytes(bucket_bytes: int) -> int:
    """DDP's first bucket: 1 MiB where the run leaves bucket_cap_mb at its default, else the cap
    itself (torch/nn/parallel/distributed.py, 2.11 and 2.13: first_bucket_bytes_cap is
    _DEFAULT_FIRST_BUCKET_BYTES only when the bucket size is the default; a real 2-rank run with
    0.25 MiB buckets issues the 26 all-reduces this gives, not 24: tests/test_deepspeed_reduce.py)."""
    return DDP_FIRST_BUCKET_BYTES if bucket_bytes == DDP_DEFAULT_BUCKET_BYTES else bucket_bytes


def ddp_bucket_cap_mb(bucket_bytes: int) -> float | None:
    """The bucket_cap_mb the trainer gives DDP for the plan's bucket: None at the default, so that
    DDP keeps the 1 MiB first bucket the plan prices (ddp_first_bucket_bytes)."""
    return None if bucket_bytes == DDP_DEFAULT_BUCKET_BYTES else bucket_bytes / 2**20


def gradient_buckets(sc: Scenario, grad_b: int, cap_bytes: int, first_cap_bytes: int | None = None,
                     close_before_overflow: bool = False) -> list[int]:
    """The gradient bytes of each bucket as backward fills them, last layer first: parameters in
    reverse order. DDP's Reducer (and DDPOptimizer's graphs) closes a bucket once it holds at
    least its cap, the first's 1 MiB (torch/_dynamo/backends/distributed.py); DeepSpeed's IPG
    bucket (`close_before_overflow`) closes before the parameter that would overflow it
    (stage_1_and_2.py reduce_independent_p_g_buckets_and_remove_grads), so a parameter larger
    than the cap goes alone. The last holds the embedding's gradient: backward's end waits for it."""
    first = cap_bytes if first_cap_bytes is None else first_cap_bytes
    out, cur, cap = [], 0, first
    for u in reversed(sc.units):
        for shape in reversed(u.shapes):
            size = math.prod(shape) * grad_b
            if cur and (cur >= cap or (close_before_overflow and cur + size > cap)):
                out.append(cur)
                cur, cap = 0, max(cap_bytes, first)
            cur += size
    return out + [cur] if cur else out


def bucket_calls(sc: Scenario, dtype: str, total_bytes: int, bucket_bytes: int,
                 first_bucket_bytes: int | None = None, deepspeed: bool = False) -> list[int]:
    """The bytes of each call of a gradient reduction issued in buckets, in the order backward
    fills them (gradient_buckets: DDP's Reducer, or DeepSpeed's IPG bucket where `deepspeed`):
    the parameters' gradients only (DeepSpeed pads its flat partition at its end and reduces no
    padding, stage_1_and_2.py average_tensor); the whole `total_bytes` as one call where the
    model has no parameter shapes to bucket."""
    return gradient_buckets(sc, nbytes(1, dtype), bucket_bytes, first_bucket_bytes, deepspeed) or [total_bytes]


def calls_seconds(sc: Scenario, op: str, sizes: list[int], n: int, per_node: int) -> float:
    """The calls of these sizes one after another, each as NCCL runs it (call_seconds)."""
    seen: dict[int, float] = {}
    for b in sizes:
        if b not in seen:
            seen[b] = call_seconds(sc, op, b, n, per_node)
    return sum(seen[b] for b in sizes)


def _coll(sc, name, op, elements, dtype, group, per_node, calls, bucket_bytes=0,
          first_bucket_bytes=None, deepspeed=False) -> Collective:
    """One collective; a gradient reduction in buckets (bucket_bytes > 0) is the calls its
    buckets make, each timed as NCCL runs it (bucket_calls: a parameter larger than the cap
    makes a bucket of its own, an embedding's gradient GBs against DDP's 25 MiB), and also
    times its final bucket, which nothing hides; other bucketed calls (DeepSpeed's all-gather
    of the updated weights) split the tensor evenly."""
    scope = "intra-node" if group <= per_node else "inter-node"
    total = nbytes(elements, dtype)
    last = 0.0
    call_b, call = total, "the whole tensor"
    # DDP (first_bucket_bytes given) buckets at any cap: at 0 its Reducer closes a bucket after
    # every parameter (torch/nn/parallel/distributed.py _BucketCapacityConfig, bucket_cap_mb=0)
    if (bucket_bytes > 0 or first_bucket_bytes is not None) and op in ("all_reduce", "reduce_scatter"):
        buckets = bucket_calls(sc, dtype, total, bucket_bytes, first_bucket_bytes, deepspeed)
        t = calls_seconds(sc, op, buckets, group, per_node)
        last = call_seconds(sc, op, buckets[-1], group, per_node)
        if len(buckets) > 1:
            call_b, call = max(buckets), "the largest bucket"
    else:
        t = bucketed_seconds(sc, op, total, group, per_node, bucket_bytes)
        if 0 < bucket_bytes < total:
            call_b, call = bucket_bytes, "a bucket"
    return Collective(name, op, elements, dtype, group, scope, calls, t, last, per_node, call_b, call)


def owner_reduce_calls(buckets: list[int], n: int) -> list[list[int]]:
    """Per bucket of gradient elements (backward's order: the flat buffer's parameters, filled
    from their end), the elements of each reduce DeepSpeed's ZeRO-1/2 issues without
    use_multi_rank_bucket_allreduce: one per owning rank whose partition the bucket overlaps
    (stage_1_and_2.py average_tensor: slices merged by destination -> allreduce_no_retain(rank=
    dst) -> dist.reduce). The flat buffer is padded at its end to a multiple of 2n elements
    (flatten_dense_tensors_aligned with nccl_start_alignment_factor 2) and split into n
    contiguous partitions; the padding is never reduced. Held against a real DeepSpeed run at 2
    and 3 ranks (tests/test_deepspeed_reduce.py)."""
    if n < 1 or any(b < 0 for b in buckets):
        raise ValueError(f"owner_reduce_calls: n {n}, buckets {buckets}")
    total = sum(buckets)
    part = 2 * -(-total // (2 * n)) if total else 1
    out, end = [], total
    for b in buckets:
        lo, hi = end - b, end
        out.append([min(hi, (r + 1) * part) - max(lo, r * part)
                    for r in range(lo // part, -(-hi // part)) if min(hi, (r + 1) * part) > max(lo, r * part)])
        end = lo
    return out


def _owner_reduces(sc, elements, dtype, group, per_node, calls, bucket_bytes) -> Collective:
    """DeepSpeed's ZeRO-1/2 gradient reduction with use_multi_rank_bucket_allreduce off: per IPG
    bucket, a reduce to each owning rank (owner_reduce_calls), each timed as NCCL runs a reduce.
    Under overlap_comm each reduce first synchronises the device (stage_1_and_2.py
    allreduce_and_copy: get_accelerator().synchronize(), 0.19.8), so every reduce of a bucket
    but its last is waited on by the synchronisation before the next, with no compute issued
    beside it: those are exposed (with the final bucket's, in `last_bucket_s`); the drains'
    launch gaps, and the wait of a bucket's first synchronisation on the previous bucket's last
    reduce, are not priced."""
    eb = nbytes(1, dtype)
    buckets = [b // eb for b in bucket_calls(sc, dtype, nbytes(elements, dtype), bucket_bytes, None, True)]
    per_bucket = [[e * eb for e in bs] for bs in owner_reduce_calls(buckets, group)]
    t = calls_seconds(sc, "reduce", [b for bs in per_bucket for b in bs], group, per_node)
    serialised = [b for bs in per_bucket[:-1] for b in bs[:-1]]
    last = calls_seconds(sc, "reduce", per_bucket[-1] + serialised, group, per_node)
    big = max((b for bs in per_bucket for b in bs), default=0)
    return Collective("reduce (gradients, to each owning rank)", "reduce", elements, dtype, group,
                      "intra-node" if group <= per_node else "inter-node", calls, t, last, per_node,
                      big, "the largest slice")


@dataclass(frozen=True)
class UnitComm:
    """Per unit, per micro-batch: seconds of its gathers and of its gradient reduction."""

    name: str
    gathered_elements: int
    all_gather_s: float
    reduce_s: float  # reduce-scatter (+ HSDP replica all-reduce) of its gradients
    h2d_s: float  # offload: bringing its shard from host memory before the gather
    gathers_in_backward: bool
    gathers_for_recompute: bool = False  # once more in backward, unprefetched (checkpoint around it)
    backward_gather_s: float = 0.0  # its gathers in backward (the recompute's, where it is wrapped)
    backward_h2d_s: float = 0.0  # offload: the host->GPU copies of those gathers (each fetch copies)


def _shapes(sc: Scenario, st: Strategy) -> tuple[int, int, int, int]:
    """(D, GPUs per node of the shard group, R, GPUs per node of the replica group)."""
    gpn = sc.hw.cluster.gpus_per_node
    D = sc.shard_degree(st.hsdp)
    R = sc.n // D if st.hsdp else 1
    return D, contiguous_shape(D, gpn, sc.n), R, strided_shape(R, D, gpn)


def unit_comm(sc: Scenario, st: Strategy) -> list[UnitComm]:
    """Gathers and reductions of each sharded unit (FSDP-style strategies only), one call each."""
    p = sc.train.precision
    D, g, R, g_rep = _shapes(sc, st)
    out = []
    ds_back = _ds_backward_seconds(sc, st, D, g) if ds_zero3(sc, st) else None
    for i, u in enumerate(sc.units):
        full = sc.padded_elems(u, D)
        ag = gather_seconds(sc, st, u, gather_dtype(sc, u), D, g)
        rs = reduce_seconds(sc, st, u, D, g)
        if st.hsdp and R > 1:
            rs += call_seconds(sc, "all_reduce", nbytes(full // D, p.reduce), R, g_rep)
        # whether it is gathered again for backward, from what is gathered (on one rank a gather
        # takes no time, but an offloaded shard is still copied in)
        again = bool(_ds_again(sc, st)[i]) if ds_back is not None else regathered(sc, st, u)
        bag = ds_back[i] if ds_back is not None else (ag if again else 0.0)
        h2d = h2d_back = 0.0
        if st.offload_params:
            store = p.master if sc.train.layout == "torch" else p.param
            link = sc.hw.gpu.host_link_bytes_per_s
            h2d = nbytes(full // D, store) / link
            h2d_back = h2d if again else 0.0
            if ds_back is not None:  # each fetch copies its parameters' shards (_all_gather_dtype)
                h2d_back = nbytes(sum(-(-n // D) for n in _ds_again(sc, st)[i]), store) / link
        out.append(UnitComm(u.name, full, ag, rs, h2d, again, gathers_for_recompute(sc, st, u), bag,
                            h2d_back))
    return out


def _wrapped(sc: Scenario, u, blocks: tuple[bool, ...] | None = None) -> bool:
    """Whether a checkpoint wraps the unit (it holds a checkpointed block): its forward runs
    again in backward. `blocks`: policy.wrapped_blocks, where the caller asks for every unit."""
    wrapped = blocks if blocks is not None else policy.wrapped_blocks(sc.train, sc.model.num_layers)
    return bool(u.blocks) and any(wrapped[u.first_block: u.first_block + u.blocks])


def ds_zero3(sc: Scenario, st: Strategy) -> bool:
    """DeepSpeed ZeRO-3 (the zero layout, parameters sharded), at its defaults or at the settings
    zplan's export writes: what it gathers again in backward is its coordinator's (_ds_again)."""
    return sc.train.layout == "zero" and st.params_sharded


_DS_COORDINATION = PinnedMemo(1024)  # estimate asks per unit and per collective: once per scenario


def ds_coordination(sc: Scenario, st: Strategy):
    """DeepSpeed ZeRO-3's coordinator at the run's stage-3 settings (deepspeed.stage3_settings: its
    defaults, or the export's) over the step's module trace (deepspeed.coordinate): what it gathers
    again in backward, and the most it holds gathered at once. A checkpoint without early stop is
    reentrant, as Hugging Face's."""
    from .deepspeed import coordinate, stage3_settings

    t = sc.train

    def make():
        s3 = stage3_settings(sc, st.hsdp, st.reshard_after_forward)
        blocks = policy.wrapped_blocks(t, sc.model.num_layers)
        return coordinate(tuple((_ds_parameters(sc, u), _wrapped(sc, u, blocks)) for u in sc.units),
                          *s3, reentrant=not t.checkpoint_early_stop,
                          containers=tuple(bool(u.blocks) for u in sc.units))

    return _DS_COORDINATION.get(_ds_key(sc, st), sc.hw, make)


def ds_hooked_modules(sc: Scenario, u) -> tuple[int, int]:
    """One unit's modules in DeepSpeed ZeRO-3's trace, each pass (its blocks' own modules and
    its modules with parameters: deepspeed.module_trace), and of them those whose forward runs
    again in backward (the checkpointed blocks', policy.wrapped_blocks: under every-k or first-k
    a unit of several blocks can hold some)."""
    n = u.blocks + len(_ds_parameters(sc, u))
    if not u.blocks:
        return n, 0
    wrapped = policy.wrapped_blocks(sc.train, sc.model.num_layers)
    return n, n * sum(wrapped[u.first_block: u.first_block + u.blocks]) // u.blocks


def _ds_parameters(sc: Scenario, u) -> tuple:
    """A unit's modules as DeepSpeed's coordinator fetches them, in forward order: a module of
    one parameter as its elements, of several as a tuple of theirs (one call gathers them:
    arch.block_modules; embeddings one module each, the final norm one). A synthetic model's
    unit (bare --params: one flat tensor per block, arch.units) is the decoder block its spec
    describes (arch.synthetic: GELU MLP of 4h, so 12 h^2): four attention matrices of a twelfth
    of it and two MLP matrices of a third, the remainder on the last: DeepSpeed fetches module
    by module (and queues its prefetch parameter by parameter), and a unit of one
    billion-element tensor is no model's.
    Units given by the user (custom units) are one module a parameter."""
    if sc.custom_units is not None:
        return tuple(math.prod(s) for s in u.shapes)
    return _unit_modules(sc.model, sc.train.layout, u.blocks, u.name, u.shapes)


@lru_cache(maxsize=1024)
def _unit_modules(m, layout: str, blocks: int, name: str, shapes: tuple) -> tuple:
    """_ds_parameters of a unit arch.units made (recommend asks once per candidate)."""
    flat = tuple(math.prod(s) for s in shapes)
    if m.total_params is not None and len(shapes) == 1:  # a decoder block's six matrices each block
        out = []
        for b in range(max(blocks, 1)):
            n = flat[0] // max(blocks, 1) + (flat[0] % max(blocks, 1) if b == 0 else 0)
            a, f = n // 12, n // 3
            out += [a, a, a, a, f, n - 4 * a - f]
        return tuple(out)
    if blocks:
        mods = list(arch.block_modules(m, layout)) * blocks
    else:
        norm = arch.head_shapes(m)[:len(arch.head_shapes(m)) - (0 if m.tied_embeddings else 1)]
        mods = ([(s,) for s in arch.embed_shapes(m)] if "embed" in name else []) + (
            [tuple(norm)] + [(s,) for s in arch.head_shapes(m)[len(norm):]] if "head" in name else [])
    out = tuple(math.prod(mod[0]) if len(mod) == 1 else tuple(math.prod(s) for s in mod) for mod in mods)
    grouped = sorted(n for e in out for n in (e if isinstance(e, tuple) else (e,)))
    return out if grouped == sorted(flat) else flat  # a unit arch.units makes otherwise: by parameter


def _ds_key(sc: Scenario, st: Strategy) -> tuple:
    """What ds_coordination depends on: the units, the stage-3 settings and the trace (recommend's
    candidates differ in micro-batches and dtypes that change none of them); policy.wrapped_blocks
    reads the three checkpointing fields."""
    t = sc.train
    return (sc.model, id(sc.hw), t.blocks_per_unit, t.embed_head_unit, t.layout, t.checkpointing,
            t.checkpoint_every, t.checkpoint_first, t.prefetch, t.deepspeed_defaults, t.checkpoint_early_stop,
            sc.shard_size, sc.custom_units, st.hsdp, st.reshard_after_forward)


def _ds_again(sc: Scenario, st: Strategy) -> tuple[tuple[int, ...], ...]:
    """Per unit, the parameters DeepSpeed's ZeRO-3 gathers again in backward (ds_coordination)."""
    return ds_coordination(sc, st).again


class DsGathers(NamedTuple):
    """DeepSpeed ZeRO-3's all-gathers in one micro-batch, as its coordinator issues them."""
    forward_s: tuple[float, ...]  # per unit: its parameters' share of the calls gathering them for forward
    backward_s: tuple[float, ...]  # and for backward (the recompute's forward and the backward)
    largest_forward_bytes: int  # the largest single call, by the use of its first parameter
    largest_backward_bytes: int
    index: dict  # unit name -> its place in sc.units


def ds_gathers(sc: Scenario, st: Strategy, D: int, g: int) -> DsGathers:
    """DeepSpeed ZeRO-3's all-gather calls as its coordinator issues them (ds_coordination's
    `calls`: each module's own fetch, one call of its parameters; each prefetch, one call of all
    it gathers; partitioned_param_coordinator.py `__all_gather_params_` -> all_gather_coalesced),
    each timed as NCCL runs it (each parameter padded to D, as DeepSpeed pads each partition,
    in their gather dtype). A call's
    time is shared among the parameters it gathers by their elements, each charged to its unit,
    forward or backward by the use it is gathered for."""
    def make() -> DsGathers:
        units = sc.units
        bits = [DTYPE_BITS[gather_dtype(sc, u)] for u in units]
        fwd, back = [0.0] * len(units), [0.0] * len(units)
        big = [0, 0]
        timed: dict[int, float] = {}  # many calls are one weight of the same shape
        c = ds_coordination(sc, st)
        us, ns, bs = c.gathered_units, c.gathered_elems, c.gathered_backward
        for a, e in zip(c.call_starts, c.call_starts[1:] + (len(us),)):
            one = e - a == 1
            b = (-(-ns[a] // D) * D * bits[us[a]] if one
                 else sum(-(-ns[j] // D) * D * bits[us[j]] for j in range(a, e))) // 8
            t = timed.get(b)
            if t is None:
                t = timed[b] = call_seconds(sc, "all_gather", b, D, g)
            if one:
                (back if bs[a] else fwd)[us[a]] += t
            else:
                total = sum(ns[a:e])
                for j in range(a, e):
                    (back if bs[j] else fwd)[us[j]] += t * ns[j] / total
            if b > big[bs[a]]:
                big[bs[a]] = b
        return DsGathers(tuple(fwd), tuple(back), big[0], big[1], {u.name: i for i, u in enumerate(units)})

    t = sc.train  # gather_dtype reads the param dtype and float8 gathers
    return _DS_GATHERS.get((*_ds_key(sc, st), D, g, t.precision.param, t.float8_gather), sc.hw, make)


_DS_GATHERS = PinnedMemo(1024)


def _ds_backward_seconds(sc: Scenario, st: Strategy, D: int, g: int) -> list[float]:
    """DeepSpeed ZeRO-3, per unit: its share of the calls gathering parameters for backward."""
    return list(ds_gathers(sc, st, D, g).backward_s)


def _module_calls(sc: Scenario, st: Strategy) -> bool:
    """DeepSpeed ZeRO-3 at its default stage-3 settings (TrainSpec.deepspeed_defaults)."""
    return sc.train.layout == "zero" and sc.train.deepspeed_defaults and st.params_sharded


def gather_seconds(sc: Scenario, st: Strategy, u, dtype: str, D: int, g: int) -> float:
    """One unit's all-gather for its forward: one call of the unit (FSDP), timed as NCCL runs
    it; DeepSpeed's ZeRO-3, the unit's share of the calls its coordinator issues (ds_gathers)."""
    if ds_zero3(sc, st):
        dg = ds_gathers(sc, st, D, g)
        return dg.forward_s[dg.index[u.name]]
    return call_seconds(sc, "all_gather", nbytes(sc.padded_elems(u, D), dtype), D, g)


def _ds_reduce_bucket(sc: Scenario, D: int) -> int:
    """DeepSpeed ZeRO-3's reduce call at its defaults, bytes: reduce_bucket_size in the reduce
    dtype, or the whole model's gradients where they are fewer."""
    from .deepspeed import REDUCE_BUCKET_ELEMS

    r = sc.train.precision.reduce
    return min(nbytes(REDUCE_BUCKET_ELEMS, r), sum(nbytes(sc.padded_elems(v, D), r) for v in sc.units))


def reduce_seconds(sc: Scenario, st: Strategy, u, D: int, g: int) -> float:
    """One unit's gradient reduce-scatter: one call (FSDP, zplan's DeepSpeed export), or, at
    DeepSpeed's defaults, its share of the reduce_bucket_size calls its gradients fill."""
    b = nbytes(sc.padded_elems(u, D), sc.train.precision.reduce)
    op = "all_reduce" if policy.all_reduces_gradients(st, sc.train) else "reduce_scatter"
    if not _module_calls(sc, st):
        return call_seconds(sc, op, b, D, g)
    bucket = _ds_reduce_bucket(sc, D)
    if b >= bucket:
        return bucketed_seconds(sc, op, b, D, g, bucket)
    return b / bucket * call_seconds(sc, op, bucket, D, g)


def _gather_call(sc: Scenario, st: Strategy, us, dtype: str, D: int) -> tuple[int, str]:
    """The largest single all-gather call among units `us` for forward: a unit (FSDP), or
    DeepSpeed's largest fetch or prefetch (ds_gathers)."""
    if ds_zero3(sc, st):
        return ds_gathers(sc, st, D, _shapes(sc, st)[1]).largest_forward_bytes, "the largest fetch or prefetch"
    return max((nbytes(sc.padded_elems(u, D), dtype) for u in us), default=0), "the largest unit"


def _reduce_call(sc: Scenario, st: Strategy, D: int) -> tuple[int, str]:
    """The largest single reduce-scatter call, as reduce_seconds issues them."""
    if _module_calls(sc, st):
        return _ds_reduce_bucket(sc, D), "a bucket"
    return max(nbytes(sc.padded_elems(u, D), sc.train.precision.reduce) for u in sc.units), "the largest unit"


def regathered(sc: Scenario, st: Strategy, u) -> bool:
    """Whether a unit is all-gathered again for its backward: resharded after forward, unless it
    stays gathered in between (policy.stays_gathered: FSDP1's kept root, torchtitan's kept head
    or last block)."""
    return st.reshard_after_forward and not policy.unit_stays_gathered(u, sc.train, sc.model.num_layers)


def gathers_for_recompute(sc: Scenario, st: Strategy, u) -> bool:
    """Whether a unit is gathered once more in backward, for its recompute: it holds a
    checkpointed block and the checkpoint wraps it from outside, reentrant
    (policy.regathers_for_recompute)."""
    return policy.regathers_for_recompute(sc.train, st.fsdp, st.reshard_after_forward) and _wrapped(sc, u)


def gather_dtype(sc: Scenario, u) -> str:
    """What an FSDP all-gather moves per element: the param dtype, or float8 for the linear
    weights of a block under torchao's tensorwise float8 with float8 all-gather (norms stay in
    bf16, which is a fraction of a percent of a block and is neglected). TransformerEngine
    casts inside its linears: the gather moves the param dtype."""
    if sc.train.float8_gather and u.blocks > 0:
        return "fp8"
    return sc.train.precision.param


def collectives(sc: Scenario, st: Strategy) -> list[Collective]:
    """Every collective of one optimizer step (grad_accum micro-batches)."""
    sc = sc.for_strategy(st.fsdp)
    t, p, psi, N = sc.train, sc.train.precision, sc.params, sc.n
    A = t.grad_accum
    gpn = sc.hw.cluster.gpus_per_node
    g_world = contiguous_shape(N, gpn, N)
    rs_calls = A if t.reduce_every_microbatch else 1
    out: list[Collective] = []
    if t.optimizer == "muon" and policy.optimizer_splits_matrices(st, t.layout) and N > 1:
        # Muon orthogonalises whole matrices: each sharded update gathers its matrix first, over
        # the group that shards the optimizer state (HSDP: its shard group)
        # (Muon's matrices only: AdamW steps the embedding, head and gains on their shards)
        D, g = (_shapes(sc, st)[:2]) if st.fsdp else (N, g_world)
        whole = _coll(sc, WHOLE_MATRIX, "all_gather", muon.matrix_elements(sc), p.param, D, g, 1)
        out.append(replace(whole, call="every matrix as one call, as priced"))
    if not st.fsdp:
        torch = t.layout == "torch"
        ddp_bucket = sc.assume.ddp_bucket_bytes
        if st.name == "ddp" or (st.name == "zero1" and torch):
            # torch layout (DDP with autocast): the parameters are stored in the master dtype, so
            # DDP's gradient buckets and ZeroRedundancyOptimizer's broadcasts are in that dtype
            store = p.master if torch else p.param
            if not reduces_after_backward(st.name, t.layout):
                out.append(_coll(sc, "all-reduce (gradients)", "all_reduce", psi, p.master, N,
                                 g_world, rs_calls, ddp_bucket, ddp_first_bucket_bytes(ddp_bucket)))
            else:  # DeepSpeed stage 0: once per step, after backward, in its fallback buffers
                out.append(_coll(sc, "all-reduce (gradients, after backward, in fallback buffers)",
                                 "all_reduce", psi, p.reduce, N,
                                 g_world, 1, nbytes(ALLREDUCE_FALLBACK_ELEMS, p.reduce)))
            if st.name == "zero1":  # ZeroRedundancyOptimizer: owners broadcast whole parameters
                out.append(_coll(sc, "broadcast (updated weights)", "all_gather", psi, store, N,
                                 g_world, 1))
            return out
        # DeepSpeed pads each flat partition to a multiple of N, as the reference does, and
        # reduces and gathers in the plan's buckets (reduce_bucket_size and
        # allgather_bucket_size, which the export writes from the same assumption)
        padded = sum(sc.padded_elems(u, N) for u in sc.units)
        grad_calls = rs_calls if st.name == "zero2" else 1
        rs_bucket = nbytes(bucket_elements(ddp_bucket, p.reduce), p.reduce)
        ag_bucket = nbytes(bucket_elements(ddp_bucket, p.param), p.param)
        if t.deepspeed_defaults:  # DeepSpeed's default reduce_bucket_size and allgather_bucket_size
            from .deepspeed import ALLGATHER_BUCKET_ELEMS, REDUCE_BUCKET_ELEMS

            rs_bucket = nbytes(REDUCE_BUCKET_ELEMS, p.reduce)
            ag_bucket = nbytes(ALLGATHER_BUCKET_ELEMS, p.param)
        if t.deepspeed_bucket_allreduce:  # DeepSpeed's default since 0.12.4: every rank gets every bucket
            out.append(_coll(sc, "all-reduce (gradients, each bucket: DeepSpeed's multi-rank bucket all-reduce)",
                             "all_reduce", padded, p.reduce, N, g_world, grad_calls, rs_bucket, deepspeed=True))
        else:
            out.append(_owner_reduces(sc, padded, p.reduce, N, g_world, grad_calls, rs_bucket))
        out.append(_coll(sc, "all-gather (updated weights)", "all_gather", padded, p.param, N,
                         g_world, 1, ag_bucket))
        return out
    D, g, R, g_rep = _shapes(sc, st)
    units = sc.units
    regather = [u for u in units if regathered(sc, st, u)] if not ds_zero3(sc, st) else []
    gathered = sum(sc.padded_elems(u, D) for u in units)
    scope = "intra-node" if D <= g else "inter-node"
    for label, group in (("forward", units), ("backward", regather)):
        by_dtype: dict[str, list] = {}
        for u in group:
            by_dtype.setdefault(gather_dtype(sc, u), []).append(u)
        for dt, us in by_dtype.items():
            name = f"all-gather ({label}{', float8 linears' if dt == 'fp8' and dt != p.param else ''})"
            out.append(Collective(name, "all_gather", sum(sc.padded_elems(u, D) for u in us), dt,
                                  D, scope, A, sum(gather_seconds(sc, st, u, dt, D, g) for u in us),
                                  0.0, g, *_gather_call(sc, st, us, dt, D)))
    if ds_zero3(sc, st):  # DeepSpeed: what its coordinator gathers again at the run's settings
        back = _ds_again(sc, st)
        elems = sum(-(-n // D) * D for a in back for n in a)
        if elems:
            dg = ds_gathers(sc, st, D, g)
            out.append(Collective("all-gather (backward)", "all_gather", elems, p.param, D, scope, A,
                                  sum(dg.backward_s), 0.0, g, dg.largest_backward_bytes,
                                  "the largest fetch or prefetch"))
    again = [u for u in units if gathers_for_recompute(sc, st, u)]
    if again:  # block units all: one gather dtype
        dt = gather_dtype(sc, again[0])
        out.append(Collective("all-gather (backward, again after the recompute: checkpoint around the unit)",
                              "all_gather", sum(sc.padded_elems(u, D) for u in again), dt, D, scope, A,
                              sum(gather_seconds(sc, st, u, dt, D, g) for u in again),
                              0.0, g, *_gather_call(sc, st, again, dt, D)))
    reduce = (("all-reduce (gradients: DeepSpeed's ZeRO-3 with Muon, reduce_scatter off)", "all_reduce")
              if policy.all_reduces_gradients(st, t) else ("reduce-scatter (gradients)", "reduce_scatter"))
    out.append(Collective(*reduce, gathered, p.reduce, D,
                          scope, rs_calls, sum(reduce_seconds(sc, st, u, D, g) for u in units),
                          0.0, g, *_reduce_call(sc, st, D)))
    if st.hsdp and R > 1:
        ar = sum(call_seconds(sc, "all_reduce", nbytes(sc.padded_elems(u, D) // D, p.reduce),
                              R, g_rep) for u in units)
        big = max(nbytes(sc.padded_elems(u, D) // D, p.reduce) for u in units)
        out.append(Collective("all-reduce (replicas, 1/S shard)", "all_reduce", gathered // D,
                              p.reduce, R, "intra-node" if R <= g_rep else "inter-node",
                              rs_calls, ar, 0.0, g_rep, big, "the largest unit's shard"))
    shard = gathered // D
    link_bw = sc.hw.gpu.host_link_bytes_per_s
    if st.offload_params:
        # each gather copies the shards it gathers from host memory first (FSDP's unshard,
        # DeepSpeed's fetch): in forward every unit, in backward those gathered again
        store = p.master if t.layout == "torch" else p.param
        out.append(Collective("host->GPU (sharded weights)", "h2d", shard, store, 1, "pcie",
                              A, nbytes(shard, store) / link_bw))
        if ds_zero3(sc, st):
            back = sum(-(-n // D) for a in _ds_again(sc, st) for n in a)
        else:
            back = sum(sc.padded_elems(u, D) // D * (int(regathered(sc, st, u)) + int(gathers_for_recompute(sc, st, u)))
                       for u in units)
        if back:
            out.append(Collective("host->GPU (sharded weights, gathered again in backward)", "h2d", back,
                                  store, 1, "pcie", A, nbytes(back, store) / link_bw))
    if st.offload_optimizer:
        out.append(Collective("GPU->host (gradients)", "d2h", shard, p.reduce, 1, "pcie",
                              rs_calls, nbytes(shard, p.reduce) / link_bw))
        if not st.offload_params:
            out.append(Collective("host->GPU (updated weights)", "h2d", shard, p.param, 1, "pcie",
                                  1, nbytes(shard, p.param) / link_bw))
    return out
