"""Per-GPU memory of one strategy: model states, gather buffers, activations, overheads.

Model states follow Rajbhandari et al. 2020 (ZeRO, section 3 and figure 1): with mixed-precision
AdamW each parameter costs 2 + 2 + K bytes (K = 12: fp32 master, momentum, variance), sharded by
stage. The torch layout follows what PyTorch runs: DDP and ZeroRedundancyOptimizer keep fp32
parameters and gradients; FSDP2 keeps fp32 sharded parameters (they are the master) and fp32
sharded gradients, gathers in the param dtype and reduce-scatters in the reduce dtype.
Derivations and every assumption: docs/formulas.md.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass, fields
from functools import lru_cache

from . import activation_memory, allocator, arch, muon, policy
from .comm import DDP_FIRST_BUCKET_BYTES, ds_coordination, gather_dtype, gradient_buckets
from .deepspeed import reduce_stream_bytes
from . import memory_timeline as mt
from . import memory_reserve as reserve
from .memory_timeline import Event
from .scenario import Scenario, SegmentFreeMemo
from .strategies import Strategy
from .units import DTYPE_BITS, ceil_div, nbytes


@dataclass(frozen=True)
class Memory:
    params_bytes: int
    grads_bytes: int
    master_bytes: int
    optimizer_bytes: int
    model_state_bytes: int
    padding_bytes: int  # of model_state_bytes, what padding to a multiple of the degree adds
    gather_buffer_bytes: int  # gathered weights alive at the peak (current + prefetched units)
    reduce_buffer_bytes: int  # unsharded grads + reduce-scatter inputs at the peak, or DDP buckets
    accum_grad_bytes: int  # unsharded grads held across micro-batches when the reduce is skipped
    activation_bytes: int  # activations, loss and backward temporaries alive at the peak
    overhead_bytes: int  # CUDA context + what the allocator reserves beyond the live tensors
    allocated_bytes: int  # live tensors at the peak (torch.cuda.max_memory_allocated)
    reserved_bytes: int  # the caching allocator's segments then (max_memory_reserved)
    total_bytes: int  # reserved + CUDA context: what has to fit
    peak_phase: str  # setup | forward | loss | backward | optimizer
    peak_event: str
    host_bytes_per_rank: int
    host_bytes_per_node: int
    # of reserved_bytes, what sits in segments wholly free at the peak (a checkpointed block's
    # freed working set, not the holes beside what the blocks keep; the loss's blocks none of its
    # later tensors fits; all-gather segments beyond
    # the stream's packed peak): the caching allocator
    # releases them and retries before failing an allocation, so "fits" does not count them
    releasable_bytes: int = 0
    # the optimizer step's temporaries alive at the peak (foreach AdamW's, DeepSpeed's flat fp32
    # gradient partition, Newton-Schulz's): 0 unless the peak is the step
    step_temp_bytes: int = 0
    # of releasable_bytes, what is released once and not made again: DeepSpeed ZeRO-1/2's cached
    # parameter blocks in wholly free segments (the first failed cudaMalloc hands them back for
    # good; the step's own freed blocks would be re-reserved every step)
    released_once_bytes: int = 0

    @property
    def steady_bytes(self) -> int:
        """The reserve a run keeps step after step: total_bytes less what it releases once and
        never makes again (released_once_bytes). estimate's headroom and tight, and recommend's
        headroom, read this."""
        return self.total_bytes - self.released_once_bytes

    def as_dict(self) -> dict[str, int]:
        """The byte figures (the plan file's per_gpu); the peak's phase and event are apart."""
        return {f.name: getattr(self, f.name) for f in fields(self) if f.type == "int"}


ADAM8BIT_BLOCK = 256  # bitsandbytes >= 0.46 (optim/optimizer.py, 0cafa7f4 "Specify blocksize")
ADAM8BIT_MIN_8BIT_SIZE = 4096  # min_8bit_size's default: smaller tensors keep fp32 states


def optimizer_state_bytes(elements: int, optimizer: str, dtype: str) -> int:
    """AdamW: m and v. SGD: momentum. 8-bit Adam over one tensor of `elements`
    (adam8bit_state_bytes). Muon: momentum only (of the tensors it steps: model_state gives the
    rest AdamW's two, zplan/muon.py)."""
    if optimizer == "adamw":
        return 2 * nbytes(elements, dtype)
    if optimizer in ("sgd", "muon"):
        return nbytes(elements, dtype)
    if optimizer == "adam8bit":
        return adam8bit_state_bytes([elements])
    raise ValueError(optimizer)


def adam8bit_state_bytes(tensor_sizes) -> int:
    """bitsandbytes' AdamW8bit state over the tensors it steps (Optimizer2State.init_state,
    bitsandbytes >= 0.46): per tensor two uint8 states and, for each, one fp32 absmax per block
    of 256 elements (block-wise quantization, Dettmers et al. 2022, with the block 0.46 fixed;
    2048 before); a tensor under min_8bit_size (4096 elements: norm gains, biases) keeps both
    states in fp32, 8 bytes an element. The two shared 256-entry quantization maps (2 KiB) are
    left out. Held against bitsandbytes' own optimizer on CPU tensors (tests/test_golden.py)."""
    return sum(8 * n if n < ADAM8BIT_MIN_8BIT_SIZE else 2 * (n + 4 * ceil_div(n, ADAM8BIT_BLOCK))
               for n in tensor_sizes)


def muon_state_bytes(holding, dtype: str) -> int:
    """One rank's state under --optimizer muon (muon.holdings): Muon's momentum for its matrices,
    AdamW's two states for the rest."""
    elems, _, adamw, _ = holding
    return optimizer_state_bytes(elems, "muon", dtype) + optimizer_state_bytes(sum(adamw), "adamw", dtype)


def zero1_torch_max_rank(sc: Scenario) -> int:
    """Elements of optimizer state on the fullest rank under ZeroRedundancyOptimizer."""
    return sum(zero1_torch_partition(sc))


def zero1_torch_partition(sc: Scenario) -> list[int]:
    """The parameter sizes ZeroRedundancyOptimizer gives its fullest rank: it assigns whole
    parameters, largest first, each to the rank holding the fewest elements so far
    (torch.distributed.optim.ZeroRedundancyOptimizer._partition_parameters)."""
    return list(_zero1_partition(tuple(math.prod(s) for u in sc.units for s in u.shapes), sc.n))


def optimizer_tensor_sizes(sc: Scenario, D: int, zero1: bool = False) -> list[int]:
    """Element counts of the tensors one rank's optimizer steps: zero layout, DeepSpeed's one
    flat partition; torch layout, every parameter's dim-0 shard (Scenario.shard_elems' rule), or
    under zero1 the whole parameters ZeroRedundancyOptimizer gives the fullest rank."""
    if sc.train.layout == "zero":
        return [sum(sc.shard_elems(u, D) for u in sc.units)]
    if zero1 and D > 1:
        return zero1_torch_partition(sc)
    if sc.custom_units is None:
        return list(_decoder_dim0_shards(sc.model, sc.train.blocks_per_unit, D, sc.train.embed_head_unit, sc.n))
    return [arch.fsdp_shard_elems(s, D, sc.n) for u in sc.units for s in u.shapes]


@lru_cache(maxsize=1024)
def _decoder_dim0_shards(model, blocks_per_unit: int, D: int, embed_head_unit: str, world: int) -> tuple[int, ...]:
    return tuple(arch.fsdp_shard_elems(s, D, world)
                 for u in arch.units(model, blocks_per_unit, embed_head_unit, "torch") for s in u.shapes)


@lru_cache(maxsize=256)
def _zero1_partition(sizes: tuple[int, ...], n: int) -> tuple[int, ...]:
    held: list[list[int]] = [[] for _ in range(n)]
    loads = [(0, r) for r in range(n)]  # (elements so far, rank): the lowest rank on a tie
    for size in sorted(sizes, reverse=True):
        load, r = heapq.heappop(loads)
        held[r].append(size)
        heapq.heappush(loads, (load + size, r))
    return tuple(held[max(loads)[1]])


@dataclass(frozen=True)
class ModelState:
    """Persistent bytes per GPU: weights, gradients, master weights, optimizer state."""

    params_bytes: int
    grads_bytes: int
    master_bytes: int
    optimizer_bytes: int
    padding_bytes: int
    host_bytes: int  # offloaded to host RAM, per rank
    unit_shards: tuple[int, ...] = ()  # elements of each unit on one rank (padded)

    @property
    def total_bytes(self) -> int:
        return self.params_bytes + self.grads_bytes + self.master_bytes + self.optimizer_bytes


def model_state(sc: Scenario, st: Strategy) -> ModelState:
    """Model states per GPU by stage (ZeRO section 3; torch layout: FSDP2 keeps fp32 shards)."""
    t, p, psi = sc.train, sc.train.precision, sc.params
    torch = t.layout == "torch"
    D = sc.shard_degree(st.hsdp)
    shards = tuple(sc.shard_elems(u, D) for u in sc.units)
    shard = sum(shards)  # per-rank shard, padded
    flat = lambda sharded: shard if sharded else psi  # noqa: E731
    if torch:
        store = p.master  # FSDP2 / DDP keep the weights in full precision; they are the master
        params_b = nbytes(flat(st.params_sharded), store)
        master_b = 0
        grads_b = nbytes(flat(st.grads_sharded), store)
        opt_elems = zero1_torch_max_rank(sc) if st.name == "zero1" else flat(st.optim_sharded)
    else:
        params_b = nbytes(flat(st.params_sharded), p.param)
        # ZeRO-1 with overlap_comm (the export writes it from the overlap assumption) moves each
        # gradient into the reduce bucket as backward makes it, at the accumulation boundary,
        # and keeps only its partition (stage_1_and_2.py reduce_ready_partitions_and_remove_grads
        # -> reduce_independent_p_g_buckets_and_remove_grads): as ZeRO-2 when every micro-batch
        # is a boundary; with accumulation the earlier micro-batches hold them whole
        boundary_only = st.name == "zero1" and t.grad_accum == 1 and sc.assume.overlap
        grads_b = nbytes(flat(st.grads_sharded or boundary_only), p.param)
        # DeepSpeed's ZeRO-1/2/3 keep the master partition as a copy of its own even where its dtype
        # is the weights' (bf16_master_weights_and_grads, or fp32 training): stage_1_and_2.py
        # clones each partition (`weights_partition = ...detach().clone().to(...)`), and stage3.py
        # _create_fp32_partitions shares the weights' partition only where `tensor.device ==
        # self.device`, a torch.device against the string 'cuda:N' (current_device_name), never
        # equal (the condition since PR 7700, 39a682d, v0.18.3; v0.18.2 alone, PR 7651, shared fp32
        # weights by dtype). Stage 0 steps fp32 weights in place (no lower precision allowed).
        separate = p.master != p.param or st.optim_sharded
        master_b = nbytes(flat(st.optim_sharded), p.master) if separate else 0
        opt_elems = flat(st.optim_sharded)
    if t.optimizer == "muon":  # Muon over the blocks' matrices, AdamW over the rest (zplan/muon.py)
        opt_b = max(muon_state_bytes(h, p.optimizer) for h in muon.holdings(sc, st.name, D if st.optim_sharded else 1))
    elif t.optimizer == "adam8bit":  # its state is per tensor: the tensors this rank's optimizer steps
        opt_b = adam8bit_state_bytes(optimizer_tensor_sizes(sc, D if st.optim_sharded else 1, zero1=st.name == "zero1"))
    else:
        opt_b = optimizer_state_bytes(opt_elems, t.optimizer, p.optimizer)
    # What padding each unit to a multiple of D adds to the sharded state on this rank.
    sharded_b = sum(b for b, on in ((params_b, st.params_sharded), (grads_b, st.grads_sharded),
                                     (master_b + opt_b, st.optim_sharded)) if on)
    pad_b = 0 if (torch and st.name == "zero1") else sharded_b * (shard * D - psi) // (shard * D)
    host = 0
    if st.offload_optimizer:
        # the gradient shard lives on the host too: FSDP2's CPUOffloadPolicy copies the reduced
        # gradient out in the parameters' own dtype (_fsdp_collectives.py: _to_dtype_if_needed(
        # reduce_output, orig_dtype)); DeepSpeed's ZeRO-1/2 keeps an fp32 gradient partition on
        # the host (stage_1_and_2.py initialize_optimizer_states: single_partition_of_fp32_groups
        # [i].grad; copy_grads_in_partition returns before allocating grads_in_partition under
        # cpu_offload), ZeRO-3 both its 16-bit grad_partitions_flat_buffer on self.device (the
        # CPU under offload_optimizer) and an fp32 gradient buffer per subgroup (stage3.py
        # initialize_optimizer_states: subgroup_gradient_buffer), v0.16.6
        grads_host = nbytes(shard, p.master)
        if not torch and st.params_sharded:
            grads_host += nbytes(shard, p.param)
        host += master_b + opt_b + grads_host
        master_b = opt_b = grads_b = 0
    if st.offload_params:
        host += params_b
        params_b = 0
    return ModelState(params_b, grads_b, master_b, opt_b, pad_b, host, shards)


def _largest_params(sc: Scenario, degree: int) -> list[int]:
    """Per unit, its largest single parameter tensor on a rank (the dim-0 shard at `degree`)."""
    if sc.custom_units is None:
        t = sc.train
        return _decoder_largest(sc.model, t.blocks_per_unit, degree, t.embed_head_unit, t.layout, sc.n)
    return [_largest_shard(u.shapes, degree, sc.n) for u in sc.units]


@lru_cache(maxsize=1024)
def _decoder_largest(model, blocks_per_unit: int, degree: int, embed_head_unit: str, layout: str,
                     world: int) -> list[int]:
    return [_largest_shard(u.shapes, degree, world)
            for u in arch.units(model, blocks_per_unit, embed_head_unit, layout)]


def _largest_shard(shapes: tuple, degree: int, world: int | None = None) -> int:
    return max((arch.fsdp_shard_elems(s, degree, world) for s in shapes), default=0)


def accum_grad_bytes(sc: Scenario, st: Strategy) -> int:
    """Gradients held whole across micro-batches that skip the reduce (reduce_last_only).
    FSDP2 keeps each unit's unsharded gradients in the reduce dtype (set_requires_gradient_sync
    False). DDP (and the trainer's ZeRO-1, which runs on DDP) under `no_sync()`: the reducer's
    hooks do nothing, so AccumulateGrad makes and keeps `.grad` as a tensor of its own, in the
    weights' dtype, beside the persistent buckets (zero_grad(set_to_none=True) left `.grad`
    None, so it is not a bucket view); only the last micro-batch's hooks copy each into its
    bucket view and point `.grad` at it (torch/csrc/distributed/c10d/reducer.cpp
    mark_variable_ready_dense: `at::mul_out(bucket_view, grad, ...)`, then `grad =
    bucket_view` under gradient_as_bucket_view). A real 2-rank run held them: -14.3% without."""
    t = sc.train
    if t.grad_accum <= 1 or t.reduce_every_microbatch:
        return 0
    if st.grads_sharded:
        return nbytes(sc.params, t.precision.reduce)
    if t.layout == "torch" and sc.n > 1 and t.ddp_bucket_view:  # one rank: no wrapper (trainer/
        # parallel.py replicate); without bucket views `.grad` is apart anyway (ddp_grads_apart)
        return nbytes(sc.params, t.precision.master)
    return 0


def ddp_grads_apart(sc: Scenario, st: Strategy) -> bool:
    """Whether DDP's `.grad` are tensors apart from its buckets: the gradients are not
    bucket views (`TrainSpec.ddp_bucket_view` False: PyTorch's default, gradient_as_bucket_view
    False): AccumulateGrad makes each `.grad` (zero_grad(set_to_none=True) left none) and the
    reducer copies it into the bucket (`bucket_view.copy_(grad)`, or `mul_out`), then back after
    the all-reduce (reducer.cpp mark_variable_ready_dense, finalize_bucket_dense): the buckets
    (the model state's gradients) and these, from each unit's backward on, both at the step.
    False where the gradients are the buckets, or one rank runs unwrapped."""
    t = sc.train
    return t.layout == "torch" and not st.fsdp and sc.n > 1 and not t.ddp_bucket_view


def replicated_new_grads(sc: Scenario, st: Strategy) -> list[int] | None:
    """Per unit, the bytes a weight's new gradient holds before it reaches `.grad` (DDP and ZeRO-1
    in the torch layout; memory_timeline.replicated_events `new_weight_grad`): its largest
    weight's gradient in the master dtype, where `.grad` (or DDP's bucket) already holds one
    (AccumulateGrad adds it in, or the reducer copies it into the bucket view and frees it; one
    rank unwrapped without accumulation steals it into `.grad`, counted there), and under
    autocast besides the matmul's gradient in the param dtype, which its cast's backward turns
    into the master-dtype one. An embedding's gradient is made in the master dtype. Not where a
    tied weight's gradients wait for each other (tied_head_grad_wait prices them)."""
    t, p = sc.train, sc.train.precision
    if t.layout != "torch" or st.fsdp:
        return None
    mb = DTYPE_BITS[p.master] // 8
    cast_b = DTYPE_BITS[p.param] // 8 if t.autocast else 0
    # stolen into a `.grad` of its own (counted there) where none exists yet: one rank unwrapped,
    # or DDP without bucket views in a micro-batch after zero_grad
    stolen = grads_made_in_backward(sc, st) or (ddp_grads_apart(sc, st) and t.grad_accum == 1)
    tied = sc.model.tied_embeddings
    out = []
    for u in sc.units:
        w = _largest_shard(u.shapes, 1)
        # a synthetic unit (--params) is one flat shape: its weights' sizes are not known
        if tied and "head" in u.name or not w or all(len(shape) == 1 for shape in u.shapes):
            out.append(0)
            continue
        matmul = u.matmul_params > 0 and not (u.name.split("+")[0] == "embed" and w == math.prod(u.shapes[0]))
        out.append(w * ((cast_b if matmul else 0) + (0 if stolen else mb)))
    return out


def hsdp_all_reduce_holds(sc: Scenario, st: Strategy) -> bool:
    """Whether FSDP2's HSDP holds each unit's reduce-scatter output apart from its sharded
    gradient until the end of backward (memory_timeline.fsdp_events `all_reduce_held`): with
    more than one replica, where the output is added into a sharded gradient that exists
    (accumulation with a reduce every micro-batch) or cast to the weights' dtype (a reduce
    dtype other than the master's). One replica runs as plain FSDP (the trainer builds no
    replicate dimension, trainer/parallel.py build_mesh): nothing held."""
    t, p = sc.train, sc.train.precision
    if not st.hsdp or sc.n <= sc.shard_degree(True):
        return False
    later = t.grad_accum > 1 and t.reduce_every_microbatch
    return later or p.reduce != p.master


def grads_made_in_backward(sc: Scenario, st: Strategy) -> bool:
    """One rank of a replicated strategy runs unwrapped (trainer/parallel.py replicate, as
    single-GPU training loops do): no buckets hold the gradients, so after
    zero_grad(set_to_none=True) a micro-batch's `.grad` exist only from their backward on;
    with accumulation the earlier micro-batches made them."""
    t = sc.train
    return t.layout == "torch" and not st.fsdp and sc.n == 1 and t.grad_accum == 1


def deepspeed_sub_groups_largest(partitions: list[int] | tuple[int, ...], sub_group: int) -> int:
    """The largest of DeepSpeed ZeRO-3's optimizer sub-groups (stage3.py _create_fp16_sub_groups,
    v0.16-v0.19): the rank's parameter partitions in order, a sub-group closed once it holds
    `sub_group` elements or more (so it passes that by less than one partition), one group of all
    where `sub_group` covers them."""
    total = sum(partitions)
    if sub_group >= total:
        return total
    largest = held = 0
    for n in partitions:
        held += n
        if held >= sub_group:
            largest, held = max(largest, held), 0
    return max(largest, held)


def deepspeed_step_temps(local_elems: int, params_sharded: bool, p, sub_group_elems: int = 0) -> tuple[int, ...]:
    """DeepSpeed ZeRO-1/2/3's optimizer step makes its fp32 gradient partition from the 16-bit
    one: `flatten(averaged_gradients).to(fp32)`, both alive for a moment (stage_1_and_2.py step;
    stage3.py _prepare_fp32_grad_for_sub_group, one sub-group at a time: ZeRO-3's
    `sub_group_elems`, the largest, deepspeed_sub_groups_largest),
    the fp32 one through the update (FusedAdam works in place). With 16-bit master weights `.to`
    returns the flat copy itself. Bytes of each tensor."""
    chunk = sub_group_elems if params_sharded else local_elems
    return (nbytes(chunk, p.param),) + ((nbytes(chunk, p.master),) if p.master != p.param else ())


def deepspeed_step_temp_bytes(local_elems: int, params_sharded: bool, p, sub_group_elems: int = 0) -> int:
    """The bytes of deepspeed_step_temps, alive together."""
    return sum(deepspeed_step_temps(local_elems, params_sharded, p, sub_group_elems))


def timeline(sc: Scenario, st: Strategy, ms: ModelState | None = None) -> list[Event]:
    """The step's events with their live bytes (memory_timeline), for one strategy."""
    sc = sc.for_strategy(st.fsdp)
    t, p = sc.train, sc.train.precision
    ms = ms or model_state(sc, st)
    D = sc.shard_degree(st.hsdp)
    pb, rb = DTYPE_BITS[p.param] // 8, DTYPE_BITS[p.reduce] // 8
    acts = mt.activations(sc)
    accum_b = accum_grad_bytes(sc, st)
    opt_temp = 0
    if not st.offload_optimizer:
        steps = optimizer_tensor_sizes(sc, D if st.optim_sharded else 1, zero1=st.name == "zero1")
        opt_temp = mt.optimizer_temp_bytes(max(steps, default=0), sum(steps), t, t.layout)
        if t.layout == "zero" and st.optim_sharded:
            group = 0
            if st.params_sharded:  # ZeRO-3: each parameter's partition, ceil(n / D), in model order
                group = deepspeed_sub_groups_largest([-(-math.prod(s) // D) for u in sc.units for s in u.shapes],
                                                     t.deepspeed_sub_group)
            opt_temp = deepspeed_step_temp_bytes(sum(steps), st.params_sharded, p, group)
        if t.optimizer == "muon":  # Newton-Schulz's temporaries (AdamW's for the rest: fused, none),
            # on the rank whose state and temporaries together are largest: ms holds the largest state
            gather_b = DTYPE_BITS[p.param] // 8 if policy.optimizer_splits_matrices(st, t.layout) else 0
            both = [muon_state_bytes(h, p.optimizer)
                    + muon.step_temp_bytes(h[3], DTYPE_BITS[p.master] // 8, gather_b)
                    for h in muon.holdings(sc, st.name, D if st.optim_sharded else 1)]
            opt_temp = max(opt_temp, max(both, default=0) - ms.optimizer_bytes)
    shards = ms.unit_shards
    padded = [x * D for x in shards]  # Scenario.padded_elems
    if t.layout == "torch" and st.fsdp:
        state = ms.params_bytes + ms.master_bytes + ms.optimizer_bytes
        grad_store = DTYPE_BITS[p.master] // 8 if not st.offload_optimizer else 0
        # one rank: each parameter's all-gather input, a param-dtype cast of its shard (a view
        # without mixed precision), after its host-to-device copy under offload
        per_elem = (pb if p.param != p.master else 0) + (DTYPE_BITS[p.master] // 8 if st.offload_params else 0)
        one_copy = [x * per_elem for x in _largest_params(sc, 1)]
        return mt.fsdp_events(
            sc, acts, state, [nbytes(g, gather_dtype(sc, u)) for g, u in zip(padded, sc.units)],
            [u.held for u in sc.units],
            [g * pb for g in padded], [x * pb for x in _largest_params(sc, 1)],
            [g * rb for g in padded],
            [x * grad_store for x in shards],
            st.reshard_after_forward, [nbytes(u.numel, p.reduce) for u in sc.units] if accum_b else None,
            opt_temp, one_rank_copy=one_copy if D == 1 else None, reduce_out=[x * rb for x in shards],
            last_grad=[math.prod(u.shapes[-1]) * (rb if accum_b else pb) if u.shapes else 0 for u in sc.units],
            all_reduce_held=[x * rb for x in shards] if hsdp_all_reduce_holds(sc, st) else None)
    static, reduce_b = static_buffers(sc, st, padded, pb, rb)
    # DeepSpeed ZeRO-3 releases every gathered parameter at the end of backward
    # (PartitionedParameterCoordinator.release_and_reset_all): none is gathered at the step
    # and the torch layout's static buffer is compile's autocast weight copies: what the graphs
    # saved for backward, none left at the step (a tied GPT-2 under Inductor, PyTorch's profiler)
    released = t.layout == "torch" or (st.params_sharded and st.reshard_after_forward)
    # each unit's `.grad` in the weights' dtype: held apart (accum, own_grads) or made late
    unit_grads = [nbytes(u.numel, p.master) for u in sc.units]
    return setup_events(sc, st) + mt.replicated_events(
        sc, acts, ms.total_bytes, static, reduce_b, opt_temp, compiled_graphs(sc, st),
        loss_buffers=deepspeed_loss_buffers(sc, st, padded, pb, rb),
        step_gathered_b=0 if released else None, casts=autocast_copies(sc),
        accum=unit_grads if accum_b else None,
        late=unit_grads if grads_made_in_backward(sc, st) else None,
        new_weight_grad=replicated_new_grads(sc, st), own_grads=unit_grads if ddp_grads_apart(sc, st) else None)


def setup_events(sc: Scenario, st: Strategy) -> list[Event]:
    """Before the first step, what the run holds that the step does not: DeepSpeed ZeRO-3 given a
    model built outside deepspeed.zero.Init (`TrainSpec.zero_init` False). deepspeed.initialize
    casts the model to the param dtype and moves it whole to the GPU (runtime/engine.py
    _configure_distributed_model: `if not (self.dont_change_device or is_zero_init_model):
    self.module.to(self.device)`), then partitions it one parameter at a time
    (zero/parameter_offload.py _convert_to_zero_parameters -> partition_parameters.py Init(module=)
    -> _zero_init_param -> partition, whose free_param releases the full tensor): the most held
    at once is the whole model, Psi x param bytes (checked at DeepSpeed v0.16.6 and v0.19.2). The
    caching allocator keeps those blocks and torch.cuda.max_memory_* keep the peak unless reset,
    so it is the run's peak wherever the step needs less; and where the model does not fit one
    GPU whole, the run fails here. The blocks themselves do not stay cached: the optimizer's
    defragment (zero/utils.py) empties the cache before the step, except under offload_param
    (offload-all), where they stay (not modelled). ZeRO-1/2 keep the whole model
    on the GPU anyway; from v0.19.0 they keep its per-parameter blocks cached too
    (memory_reserve.param_block_cache; docs/accuracy-notes.md 9as)."""
    t = sc.train
    if t.layout != "zero" or t.zero_init or not st.params_sharded:
        return []
    return [Event("setup", "deepspeed.initialize (the whole model on the GPU)",
                  {"gathered": nbytes(sc.params, t.precision.param)})]


def compiled_graphs(sc: Scenario, st: Strategy) -> mt.CompiledGraphs | None:
    """The compiled backward graphs of a replicated strategy (DDP, ZeRO-1) and the gradients
    they hold until they return; None where eager autograd's accumulation is what runs.

    AOTAutograd compiles a backward into one graph whose outputs are the parameters' gradients
    (torch/_functorch/_aot_autograd/runtime_wrappers.py, CompiledFunction.backward): each is
    alive from the op that makes it until the graph returns, and only then do the AccumulateGrad
    nodes after it add them into `.grad` (measured on CPU with PyTorch's memory profiler in
    tests/test_compile_scope.py). Where `.grad` is already allocated that is a second copy of
    the graph's gradients: with accumulation (the earlier micro-batches), and always under DDP,
    whose gradients are views of its persistent buckets (gradient_as_bucket_view). On one rank
    without accumulation the graph's outputs become `.grad`.

    What one graph covers: torch.compile(model) over an unwrapped model (one rank) is one graph
    over every unit; per-block compile is a graph per block (embedding and head stay eager).
    Under DDP, dynamo's DDPOptimizer (torch._dynamo.config.optimize_ddp, on by default) splits
    graphs at the gradient buckets (ddp_graph_buckets): at most the largest bucket held. Inductor
    decomposes the embedding's backward (torch/_inductor/decomposition.py registers
    torch/_decomp's embedding_dense_backward on every device but XPU) into an index_put into a
    zeroed vocabulary x hidden buffer in the computation dtype (fp32 for bf16/fp16) and a cast to
    the gradient's dtype: both alive at the end of a graph that holds the embedding. FSDP2's
    hooks are `_dynamo_disable`d (torch/distributed/fsdp/_fully_shard/_fsdp_common.py), so
    torch.compile(model) breaks at each unit as per-block compile does, and a unit's gradients
    are held no longer than its reduce-scatter event already counts (fsdp_events); DeepSpeed's
    engine accumulates through its own hooks: neither is modelled here."""
    t = sc.train
    if not (t.compile and t.layout == "torch" and not st.fsdp):
        return None
    grad_b = DTYPE_BITS[t.precision.master] // 8  # DDP keeps gradients in the weights' dtype
    n = len(sc.units)
    whole = t.compile_scope == "model"
    graphs = (range(0, n),) if whole else tuple(range(i, i + 1) for i, u in enumerate(sc.units) if u.blocks)
    in_graph = {i for g in graphs for i in g}
    second = t.grad_accum > 1 or sc.n > 1
    # per unit, what its graph holds: under per-block compile one block's share of the unit
    per = [u.numel * grad_b // (1 if whole else max(u.blocks, 1)) if second and i in in_graph else 0
           for i, u in enumerate(sc.units)]
    # a tied weight in the graph (whole-model compile: unit 0 holds embedding and head): the
    # head's matmul gradient, in the computation dtype, is held from the head's backward (right
    # after the loss's) to the graph's last kernel, which adds it to the embedding's gradient;
    # with fp32 gradients the fp32 embedding buffer is a tensor of its own there, beside the head's
    # and their sum, which is `.grad` (PyTorch's memory profiler on Inductor's CPU code, a tied
    # GPT-2 of 4 layers: the bf16 head gradient alive from the backward's second allocation to its
    # end; the fp32 buffer and the sum only in the last kernel); with 16-bit gradients the head's
    # is added into the fp32 buffer before the cast (tests/test_compile_scope.py, a tied Llama
    # shape in bf16: within 1.4% with the buffer alone at the end, 2.4% over with both)
    tied = (sc.model.tied_embeddings and 0 in in_graph and "head" in sc.units[0].name
            and sc.units[0].name.split("+")[0] == "embed")
    head_b = math.prod(sc.units[0].shapes[0]) * (DTYPE_BITS[t.precision.param] // 8) if tied else 0
    return mt.CompiledGraphs(
        new_grads=tuple(per), graphs=graphs,
        cap_bytes=sum(per) if sc.n == 1 else max(ddp_graph_buckets(sc, grad_b), default=0),
        end_temp=tuple((math.prod(u.shapes[0]) * 4 if grad_b < 4 or (tied and i == 0) else 0)
                       + (head_b if i == 0 and grad_b == 4 else 0)
                       if u.name.split("+")[0] == "embed" and i in in_graph else 0 for i, u in enumerate(sc.units)),
        tied_head=head_b)


def ddp_graph_buckets(sc: Scenario, grad_b: int) -> list[int]:
    """The gradient bytes of each graph DDPOptimizer splits a compiled model into, last layer
    first: buckets as DDP's (comm.gradient_buckets), the first of 1 MiB whatever the cap
    (torch/_dynamo/convert_frame.py builds DDPOptimizer with the module's bucket_bytes_cap and
    no first_bucket_cap, so torch/_dynamo/backends/distributed.py takes
    _DEFAULT_FIRST_BUCKET_BYTES; 2.11 and 2.13), where DDP's own Reducer keeps 1 MiB only at
    its default cap (comm.ddp_first_bucket_bytes). zplan walks the units' parameters in
    reverse; DDPOptimizer walks graph nodes, so a boundary may fall a few parameters apart."""
    return gradient_buckets(sc, grad_b, sc.assume.ddp_bucket_bytes, DDP_FIRST_BUCKET_BYTES)


def static_buffers(sc: Scenario, st: Strategy, padded: list[int], pb: int, rb: int) -> tuple[int, int]:
    """Gather and reduce buffers held through the step where they are not modelled unit by unit:
    DeepSpeed's (zero layout), and under autocast with torch.compile the low-precision weight
    copies, all of them throughout (a bound: what AOTAutograd's partitioner saves of them is not
    modelled; eager, autocast_copies follows them event by event)."""
    t = sc.train
    if t.layout == "torch":
        cast = sc.params * pb if t.autocast and t.compile else 0
        # zplan's DDP uses gradient_as_bucket_view=True: the gradients are the buckets
        return cast, 0
    if not st.fsdp:
        if t.deepspeed_defaults:  # DeepSpeed's default reduce_bucket_size, two with overlap_comm
            from .deepspeed import REDUCE_BUCKET_ELEMS

            return 0, 2 * REDUCE_BUCKET_ELEMS * rb
        return 0, 2 * sc.assume.ddp_bucket_bytes  # DeepSpeed's reduce buckets
    # one partition: DeepSpeed points each parameter at its shard, gathering nothing
    # (partition_parameters.py all_gather_coalesced: `_no_gather_coalesced` when num_partitions
    # == 1, v0.16.6 and v0.19.2): a view where the shard is on the GPU; under offload_param the
    # shard is in host memory and NoGatherHandle copies it to the GPU
    # (`param.ds_tensor.data.to(device=current_device_name())`, v0.19.8), the gathered set as on
    # more ranks
    one = sc.shard_degree(st.hsdp) == 1 and not st.offload_params
    # resharded, at DeepSpeed's defaults or the settings zplan's export writes: what its
    # coordinator holds for the gathered parameters at most (deepspeed.coordinate's peak_held:
    # its prefetcher fills the live limit and passes it by up to a parameter, and a call of
    # several keeps its flat buffer beside the parameters copied out of it until the last is
    # fetched); not resharded, every unit, or more while a call's flat buffer is alive
    c = ds_coordination(sc, st)
    gather = c.peak_held if st.reshard_after_forward else max(sum(padded), c.peak_held)
    if t.deepspeed_defaults and st.reshard_after_forward:
        return (0 if one else gather * pb), deepspeed_default_reduce_bytes(sc, pb, rb)
    biggest = _largest_resharded_unit(sc, padded)
    return (0 if one else gather * pb), biggest * (pb + rb)  # the unit's unsharded grads, then the reduce input


def _largest_resharded_unit(sc: Scenario, padded: list[int]) -> int:
    """Elements of the largest unit not held gathered (the reduce side's bucket at zplan's export
    settings: one unit)."""
    return max((g for g, u in zip(padded, sc.units) if not u.held), default=0)


def deepspeed_loss_buffers(sc: Scenario, st: Strategy, padded: list[int], pb: int, rb: int) -> tuple[int, int] | None:
    """DeepSpeed ZeRO-3's buffers (zero layout, resharded) from the forward's end through the
    loss, where `static_buffers` holds the step's largest: what its coordinator has gathered then
    (deepspeed.coordinate's held_at_loss: the head, kept for its backward within the reuse
    distance, and what the last prefetch took), and of the reduce side only the persistent
    bucket (stage3.py allocates its flat buffer at init): no parameter's gradient exists before
    the head's backward, the hooks on each AccumulateGrad copying one in as autograd makes it.
    None where the static buffers stand for the loss too."""
    t = sc.train
    if t.layout != "zero" or not (st.fsdp and st.reshard_after_forward):
        return None
    one = sc.shard_degree(st.hsdp) == 1 and not st.offload_params
    gather = 0 if one else ds_coordination(sc, st).held_at_loss * pb
    if t.deepspeed_defaults:
        from .deepspeed import REDUCE_BUCKET_ELEMS

        return gather, REDUCE_BUCKET_ELEMS * rb
    biggest = _largest_resharded_unit(sc, padded)
    return gather, biggest * rb


def autocast_copies(sc: Scenario) -> mt.AutocastCopies | None:
    """autocast's 16-bit copies of the weights, per unit, eager (torch/csrc/autograd/
    autocast_mode.cpp cached_cast: a leaf parameter that requires grad is cast once per autocast
    context and cached until the outermost context exits, `torch.clear_autocast_cache()` in
    torch/amp/autocast_mode.py __exit__). The copied weights are the matmuls' (linear weights and
    biases, the router, the head): the embedding and the norms run in the weights' dtype. The
    trainer's autocast covers forward and the loss's forward (trainer/micro_batch.py); after it a
    copy lives while a saved tensor holds it: the blocks that keep their activations (checkpointing
    none, Megatron's attention-only mode) and the head until their backward; a checkpointed
    block's recomputation runs under the autocast state it recorded (torch/utils/checkpoint.py),
    so it casts its weights again and holds them through its backward. MemTracker on the
    trainer's model under autocast: tests/test_memory.py."""
    t, m = sc.train, sc.model
    if not t.autocast or t.compile:
        return None
    pb = DTYPE_BITS[t.precision.param] // 8
    norms = 2 * m.hidden * (2 if m.norm == "layernorm" else 1)  # a block's two norms
    # a linear loss casts the head's weight itself (trainer/linear_loss.py, `w.to(dtype)`,
    # autocast off inside) and saves only the gradients it made: the copy is not kept
    head_kept = t.linear_loss == "none"
    made, kept, again, root = [], [], [], 0
    block_kept, block_again = [], []
    for u in sc.units:
        if not u.blocks:  # the embedding (no matmul), the head (its weight; tied: the embedding's)
            block_kept.append(())
            block_again.append(())
            made.append(u.matmul_params * pb)
            # a root holding the head comes first in forward order but its head's backward
            # comes first too: its copy is gone before any block's backward
            kept.append(0 if u.held or not head_kept else u.matmul_params * pb)
            root += u.matmul_params * pb if u.held and head_kept else 0
            again.append(0)
            continue
        synthetic = m.total_params is not None or sc.custom_units is not None
        per_block = (u.numel if synthetic else u.numel - u.blocks * norms) * pb // u.blocks
        modes = [activation_memory.block_mode(t, i, m.num_layers)
                 for i in range(u.first_block, u.first_block + u.blocks)]
        made.append(per_block * u.blocks)
        kept.append(per_block * sum(md in ("none", "attention") for md in modes))
        again.append(per_block if any(md in ("full", "selective") for md in modes) else 0)
        block_kept.append(tuple(per_block if md in ("none", "attention") else 0 for md in modes))
        block_again.append(tuple(per_block if md in ("full", "selective") else 0 for md in modes))
    return mt.AutocastCopies(tuple(made), tuple(kept), tuple(again), root, tuple(block_kept), tuple(block_again))


def deepspeed_default_reduce_bytes(sc: Scenario, pb: int, rb: int) -> int:
    """DeepSpeed ZeRO-3 under its default stage-3 settings (zplan/deepspeed.py), the reduce side's
    bytes held at the step's largest moment: the persistent bucket of reduce_bucket_size elements
    in the reduce dtype (stage3.py, ipg_buckets' buffer) and one gradient as autograd makes it
    before it is copied in (one larger than the bucket is reduced as it is): the largest
    parameter's. Counted with the gathered parameters (deepspeed.coordinate's peak) at every
    event (the zero layout's buffers are static), which over-counts where their peaks differ."""
    from .deepspeed import REDUCE_BUCKET_ELEMS

    largest = max((math.prod(s) for u in sc.units for s in u.shapes), default=0)
    return REDUCE_BUCKET_ELEMS * rb + largest * pb


@dataclass(frozen=True)
class _Allocation:
    """What memory() reads from a step's events: the peak event, each stream's own peak, and the
    loss's first event (None without one). The same for classic and expandable segments."""
    state: ModelState
    top: Event
    stream_peaks: tuple[tuple[str, int], ...]
    loss_start: Event | None
    step_peak_bytes: int  # the largest event after setup (setup_events)
    optimizer_peak_bytes: int  # the largest event of the optimizer step
    activation_peak_bytes: int  # the largest event of forward, loss and backward


_ALLOCATIONS = SegmentFreeMemo()


def _allocation(sc: Scenario, st: Strategy) -> _Allocation:
    """model_state and the step's events, reduced to what memory() needs (_Allocation), made once
    per scenario and strategy (SegmentFreeMemo: the segment kind changes only what is
    reserved). `sc` is for_strategy's view."""
    def make() -> _Allocation:
        ms = model_state(sc, st)
        events = timeline(sc, st, ms)
        return _Allocation(ms, mt.peak(events), tuple(allocator.stream_peaks(events).items()),
                           next((e for e in events if e.label == "loss forward"), None),
                           max((e.total_bytes for e in events if e.phase != "setup"), default=0),
                           max((e.total_bytes for e in events if e.phase == "optimizer"), default=0),
                           max((e.total_bytes for e in events if e.phase not in ("setup", "optimizer")),
                               default=0))
    return _ALLOCATIONS.get(sc, st, make)


def allocated_bytes(sc: Scenario, st: Strategy) -> int:
    """memory(sc, st).allocated_bytes from the step's events alone, without the allocator
    model: what the reserve is never below (reserved_from_peaks answers at least the allocated
    peak). recommend asks it first: most configurations it tries fail on it."""
    sc = sc.for_strategy(st.fsdp)
    return _allocation(sc, st).top.total_bytes


def memory(sc: Scenario, st: Strategy) -> Memory:
    """Peak memory per GPU (bytes) over the step's timeline, allocated and reserved, and host
    memory for offload, for one strategy."""
    sc = sc.for_strategy(st.fsdp)
    alloc = _allocation(sc, st)
    ms, top = alloc.state, alloc.top
    allocated = top.total_bytes
    acts = mt.activations(sc)
    loss_b = acts.loss_bytes["forward"]
    start = alloc.loss_start
    head = reserve.head_tail(sc, st, ms, start)
    loss_reserved, loss_releasable = reserve.loss_reserve(acts.logits_elems, sc.train, sc.assume.loss_fp32,
                                                   sc.assume.expandable_segments, head)
    residue, residue_releasable = reserve.forward_residue(sc, st, acts.logits_elems)
    floor = allocator.default_stream_floor(start, loss_b, loss_reserved, residue)
    peaks = dict(alloc.stream_peaks)
    # DeepSpeed ZeRO-1/2's cached parameter blocks (reserve.param_block_cache): each moment with what it
    # leaves unused of them, the activations' (the reserve of the step's streams, whose floors
    # are the loss's) and the optimizer step's (its live bytes: no activation holds a block
    # then, so the cache is wholly unused beside the step's flat temporaries, however little
    # checkpointing keeps); the reserve is the larger
    acts_unused, acts_free = reserve.param_block_cache(sc, st)
    step_unused, step_free = reserve.param_block_cache_at_step(sc, st)
    streams = allocator.reserved_from_peaks(allocated, peaks, sc.assume, floor, reserve.all_gather_reserved(sc, st, ms))
    step_b = alloc.optimizer_peak_bytes
    at_acts = streams + acts_unused
    at_step = step_b + step_unused if step_unused else 0
    reserved = max(at_acts, at_step)
    cache_free_segments = acts_free if at_acts >= at_step else step_free
    reduce_stream = reduce_stream_bytes(sc, st)

    def beside_step(r: int) -> int:  # the reduce stream is made in backward: beside the step only
        return max(r, alloc.step_peak_bytes + reduce_stream) if top.phase == "setup" else r + reduce_stream
    reserved = beside_step(reserved)
    # what of it sits in segments wholly free at the peak: the forward's freed blocks (not the
    # holes beside what it kept), the
    # loss's blocks none of its later tensors fits, and the all-gather stream's segments beyond
    # its packed peak; the allocator releases those and retries before it fails a cudaMalloc
    # (slower, no out-of-memory)
    loss_packed = loss_reserved - loss_releasable
    packed = allocator.reserved_from_peaks(allocated, peaks, sc.assume, allocator.default_stream_floor(
        start, loss_b, loss_packed, residue - residue_releasable)) + acts_unused - acts_free
    packed = max(packed, step_b + step_unused - step_free if step_unused else 0)
    packed = beside_step(packed)
    ranks_per_node = min(sc.n, sc.hw.cluster.gpus_per_node)
    live = top.live
    accum = accum_grad_bytes(sc, st)
    return Memory(
        params_bytes=ms.params_bytes,
        grads_bytes=ms.grads_bytes,
        master_bytes=ms.master_bytes,
        optimizer_bytes=ms.optimizer_bytes,
        model_state_bytes=ms.total_bytes,
        padding_bytes=ms.padding_bytes,
        gather_buffer_bytes=live.get("gathered", 0) + live.get("all_gather", 0),
        # the accumulated gradients sit in the unsharded_grads kind: reported once, on their own
        # (and, under offload, a sharded gradient on the GPU on its way to the host, which the
        # model state counts there: no component held it, allocated exceeded their sum)
        reduce_buffer_bytes=(live.get("unsharded_grads", 0) - min(accum, live.get("unsharded_grads", 0))
                             + live.get("reduce_scatter", 0) + max(0, live.get("grads", 0) - ms.grads_bytes)),
        accum_grad_bytes=accum,
        activation_bytes=live.get("activations", 0),
        step_temp_bytes=live.get("step_temps", 0),
        overhead_bytes=sc.assume.cuda_context_bytes + reserved - allocated,
        allocated_bytes=allocated,
        reserved_bytes=reserved,
        total_bytes=reserved + sc.assume.cuda_context_bytes,
        releasable_bytes=max(0, reserved - packed),
        released_once_bytes=min(max(0, reserved - packed), cache_free_segments),
        peak_phase=top.phase,
        peak_event=top.label,
        host_bytes_per_rank=ms.host_bytes,
        host_bytes_per_node=ms.host_bytes * ranks_per_node,
    )
