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

from . import arch
from .scenario import Scenario
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
    gather_buffer_bytes: int  # unsharded weights alive at the peak (current + prefetched units)
    reduce_buffer_bytes: int  # unsharded grads + reduce-scatter input, or DDP buckets
    accum_grad_bytes: int  # unsharded grads held across micro-batches when the reduce is skipped
    activation_bytes: int
    overhead_bytes: int  # CUDA context + allocator fragmentation (assumptions)
    total_bytes: int
    host_bytes_per_rank: int
    host_bytes_per_node: int

    def as_dict(self) -> dict[str, int]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


def optimizer_state_bytes(elements: int, optimizer: str, dtype: str) -> int:
    """AdamW: m and v. SGD: momentum. 8-bit Adam: two uint8 states plus one fp32 absmax per
    block of 2048 (Dettmers et al. 2022, block-wise quantization). Muon: momentum only."""
    if optimizer == "adamw":
        return 2 * nbytes(elements, dtype)
    if optimizer in ("sgd", "muon"):
        return nbytes(elements, dtype)
    if optimizer == "adam8bit":
        return 2 * (elements + 4 * ceil_div(elements, 2048))
    raise ValueError(optimizer)


def zero1_torch_max_rank(sc: Scenario) -> int:
    """Elements of optimizer state on the fullest rank under ZeroRedundancyOptimizer.

    It assigns whole parameters, largest first, each to the rank holding the fewest elements so
    far (torch.distributed.optim.ZeroRedundancyOptimizer._partition_parameters)."""
    sizes = sorted((math.prod(s) for u in sc.units for s in u.shapes), reverse=True)
    loads = [0] * sc.n
    heapq.heapify(loads)
    for size in sizes:
        heapq.heappush(loads, heapq.heappop(loads) + size)
    return max(loads)


def memory(sc: Scenario, st: Strategy) -> Memory:
    """Peak memory per GPU (bytes) and host memory for offload, for one strategy."""
    t, p, psi = sc.train, sc.train.precision, sc.params
    torch = t.layout == "torch"
    D = sc.shard_degree(st.hsdp)
    shard = sum(sc.shard_elems(u, D) for u in sc.units)  # per-rank shard, padded
    flat = lambda sharded: shard if sharded else psi  # noqa: E731

    if torch:
        store = p.master  # FSDP2 / DDP keep the weights in full precision; they are the master
        params_b = nbytes(flat(st.params_sharded), store)
        master_b = 0
        grads_b = nbytes(flat(st.grads_sharded), store)
        opt_elems = zero1_torch_max_rank(sc) if st.name == "zero1" else flat(st.optim_sharded)
    else:
        params_b = nbytes(flat(st.params_sharded), p.param)
        grads_b = nbytes(flat(st.grads_sharded), p.param)
        master_same = p.master == p.param
        master_b = 0 if master_same else nbytes(flat(st.optim_sharded), p.master)
        opt_elems = flat(st.optim_sharded)
    opt_b = optimizer_state_bytes(opt_elems, t.optimizer, p.optimizer)
    # What padding each unit to a multiple of D adds to the sharded state on this rank.
    sharded_b = sum(b for b, on in ((params_b, st.params_sharded), (grads_b, st.grads_sharded),
                                     (master_b + opt_b, st.optim_sharded)) if on)
    pad_b = 0 if (torch and st.name == "zero1") else sharded_b * (shard * D - psi) // (shard * D)

    host = 0
    if st.offload_optimizer:
        host += master_b + opt_b + nbytes(shard, p.reduce)
        master_b = opt_b = 0
        grads_b = 0 if torch else grads_b
    if st.offload_params:
        host += params_b
        params_b = 0
    model_state = params_b + grads_b + master_b + opt_b

    # Gather and reduce buffers
    pb, rb = DTYPE_BITS[p.param] // 8, DTYPE_BITS[p.reduce] // 8
    gathered = [sc.padded_elems(u, D) for u in sc.units]
    held = sum(g for g, u in zip(gathered, sc.units) if u.held)
    moving = [g for g, u in zip(gathered, sc.units) if not u.held]
    biggest = max(moving, default=0)
    if st.fsdp:
        if not st.reshard_after_forward:
            gather_elems = sum(gathered)
        elif t.prefetch and len(moving) > 1:
            gather_elems = held + max(a + b for a, b in zip(moving, moving[1:]))
        else:
            gather_elems = held + biggest
        gather_b = gather_elems * pb
        reduce_b = biggest * (pb + rb)  # the unit's unsharded grads, then the reduce-scatter input
    else:
        cast = psi * pb if (torch and p.master != p.param) else 0  # autocast's low-precision weights
        gather_b = cast
        # DeepSpeed holds reduce buckets; zplan's DDP uses gradient_as_bucket_view=True, so the
        # gradients are the buckets and nothing extra is held
        reduce_b = 0 if torch else 2 * sc.assume.ddp_bucket_bytes
    accum_b = 0
    if t.grad_accum > 1 and not t.reduce_every_microbatch and st.grads_sharded:
        accum_b = psi * rb  # FSDP2 keeps unsharded grads in the reduce dtype across micro-batches

    act_b = arch.activation_breakdown(sc.model, t, sc.assume.loss_fp32)["total"]
    transient = gather_b + reduce_b + accum_b + act_b
    if torch and st.fsdp:
        # FSDP2 allocates each sharded gradient at its unit's reduce-scatter (after zero_grad
        # set_to_none), while that unit's activations are being freed. Without recomputation
        # the peak is at the start of backward, before any gradient: rest + max(the two). With
        # recomputation it is late in backward, re-running the first blocks, when all but the
        # first two units' gradients exist.
        # A unit's reduce-scatter buffers appear once its backward has freed its (recomputed)
        # activations: only their excess over those adds to the peak.
        unit_act = arch.block_saved_bytes(sc.model, t, "none") * t.blocks_per_unit
        transient = gather_b + accum_b + act_b + max(0, reduce_b - unit_act)
        if t.checkpointing == "none":
            tensors = model_state - grads_b + max(grads_b, transient)
        else:
            early = sum(sc.shard_elems(u, D) for u in sc.units[:2])
            late_grads = grads_b * max(0, shard - early) // max(1, shard)
            if not st.reshard_after_forward:
                # late in backward, the units already done have released their weights: what
                # remains gathered is about the current and the next unit, as with resharding
                pair = max((a + b for a, b in zip(moving, moving[1:])), default=biggest)
                transient += (held + pair) * pb - gather_b
            tensors = model_state - grads_b + late_grads + transient
    else:
        tensors = model_state + transient
    overhead = sc.assume.cuda_context_bytes + int(sc.assume.fragmentation * tensors)
    ranks_per_node = min(sc.n, sc.hw.cluster.gpus_per_node)
    return Memory(
        params_bytes=params_b,
        grads_bytes=grads_b,
        master_bytes=master_b,
        optimizer_bytes=opt_b,
        model_state_bytes=model_state,
        padding_bytes=pad_b,
        gather_buffer_bytes=gather_b,
        reduce_buffer_bytes=reduce_b,
        accum_grad_bytes=accum_b,
        activation_bytes=act_b,
        overhead_bytes=overhead,
        total_bytes=tensors + overhead,
        host_bytes_per_rank=host,
        host_bytes_per_node=host * ranks_per_node,
    )
