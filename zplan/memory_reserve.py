"""The reserve side of the memory model, per scenario: what the CUDA caching allocator keeps
beyond the allocated peak (zplan/allocator.py simulates it; these functions feed it this
scenario's tensors): the loss's blocks and the head's tensors around it, the all-gather stream's
segments, what the forward leaves cached, and DeepSpeed ZeRO-1/2's cached parameter blocks.
memory.memory() combines them with the step's allocated timeline. Derivations: docs/formulas.md
section 3.
"""

from __future__ import annotations

import math
from contextlib import contextmanager
from contextvars import ContextVar
from functools import lru_cache

from . import activation_memory, allocator, arch, policy
from . import memory as _memory  # the model state and its helpers (read at call time: memory imports this module)
from . import memory_timeline as mt
from .comm import gather_dtype, regathered
from .memory_timeline import Event
from .scenario import Scenario
from .strategies import Strategy
from .units import DTYPE_BITS, nbytes


@lru_cache(maxsize=256)
def loss_reserve(logits_elems: int, train, loss_fp32: bool, expandable: bool,
                  head: allocator.HeadTail | None) -> tuple[int, int]:
    """(allocator.loss_reserved_bytes, allocator.loss_releasable_bytes): one simulation."""
    return allocator.loss_reserve(logits_elems, train, loss_fp32, expandable, head)


def head_tail(sc: Scenario, st: Strategy, ms: _memory.ModelState,
               start: Event | None = None) -> allocator.HeadTail | None:
    """The head unit's tensors around the loss (allocator.HeadTail) under FSDP2, from the sizes
    timeline's events use: its gathered weights where it is gathered again for backward
    (comm.regathered; each parameter's all-gather output, dim 0 padded to the shard degree),
    its unsharded gradients in the param dtype (each parameter's, its own shape), its input gradient, and
    its reduce-scatter input in the reduce dtype unless it is the held root (whose head gradient
    is the head weight's alone in the head's backward, as the timeline's: the embedding's comes
    at the end of backward). The blocks' activations freed by the end of backward: their
    largest tensor's segment, or with expandable segments (and the step's loss `start` event)
    all those alive at the loss, one region below its tensors (assumed: no tensor still alive
    splits it) -- a linear loss's weight gradient, made in the loss's forward, not among them."""
    if sc.train.layout != "torch" or not st.fsdp:
        return None
    i = next((k for k, u in enumerate(sc.units) if "head" in u.name), None)
    if i is None:
        return None
    u, t = sc.units[i], sc.train
    degree = sc.shard_degree(st.hsdp)
    first = embedding_unit(sc)
    padded, last = ms.unit_shards[i] * degree, ms.unit_shards[0] * degree
    largest = _memory._largest_params(sc, 1)
    pb, rb = DTYPE_BITS[t.precision.param], DTYPE_BITS[t.precision.reduce]

    def grads(unit) -> tuple[int, ...]:  # autograd's gradient of each, the parameter's own shape
        return tuple(math.prod(s) * pb // 8 for s in unit.shapes)
    freed = activation_memory.largest_block_tensor_bytes(sc.model, t)
    if sc.assume.expandable_segments and start is not None:
        acts = mt.activations(sc)
        loss_b = acts.loss_bytes["forward"]
        freed = max(start.live.get("activations", 0) - loss_b - acts.linear_loss["kept"], 0)
    return allocator.HeadTail(
        weights_bytes=gathered_param_bytes(sc, st, u) if regathered(sc, st, u) else 0,
        grad_bytes=largest[i] * pb // 8 if u.held else grads(u),
        input_grad_bytes=t.seq_len * t.micro_batch * sc.model.hidden * activation_memory.act_dtype_bytes(t),
        reduce_in_bytes=0 if u.held else padded * rb // 8,
        # the unit reduced last: its weights where gathered again (not the head's own unit),
        # the embedding weight's gradient (a held root's other gradients exist already), the
        # whole unit's reduce-scatter input
        last_weights_bytes=gathered_param_bytes(sc, st, first) if first is not u and regathered(sc, st, first) else 0,
        last_grad_bytes=largest[0] * pb // 8 if first.held else grads(first),
        last_reduce_in_bytes=last * rb // 8,
        freed_block_bytes=freed,
        held_root=u.held, tied=u.held and sc.model.tied_embeddings,
        tied_out_of_place=u.held and mt.fsdp_tied_grads_summed_out_of_place(sc),
        accumulating=_memory.accum_grad_bytes(sc, st) > 0)


def embedding_unit(sc: Scenario):
    """The unit that holds the embeddings: their own (separate, head-kept, head-root-kept) or the
    held root (root, root-kept, tied); the first unit where none is named for them."""
    return next((u for u in sc.units if "embed" in u.name), sc.units[0])


def gathered_param_bytes(sc: Scenario, st: Strategy, unit) -> tuple[int, ...]:
    """Each of a unit's parameters gathered by FSDP2 (torch layout), bytes: one storage per
    parameter (FSDPParam.all_gather_outputs), its dim 0 padded to the shard degree
    (arch.fsdp_shard_elems), in the dtype it is gathered in (comm.gather_dtype)."""
    return _gathered(unit.shapes, sc.shard_degree(st.hsdp), sc.n, gather_dtype(sc, unit))


@lru_cache(maxsize=1024)
def _gathered(shapes: tuple, degree: int, world: int, dtype: str) -> tuple[int, ...]:
    return tuple(nbytes(arch.fsdp_shard_elems(s, degree, world) * degree, dtype) for s in shapes)


def all_gather_reserved(sc: Scenario, st: Strategy, ms: _memory.ModelState) -> int:
    """allocator.all_gather_stream_reserved for FSDP2 (torch layout, more than one rank): each
    unit's all-gather output in forward, and in backward those gathered again (comm.regathered,
    which the traffic reads too); 0 elsewhere (no all-gather stream)."""
    D = sc.shard_degree(st.hsdp)
    if sc.train.layout != "torch" or not st.fsdp or D == 1:
        return 0
    out = [nbytes(x * D, gather_dtype(sc, u)) for x, u in zip(ms.unit_shards, sc.units)]
    again = [b if regathered(sc, st, u) else 0 for b, u in zip(out, sc.units)]
    # backward: the held root first (its pre-backward hook sits on the model's output), then
    # the other units in reverse
    back = [b for b, u in zip(again, sc.units) if u.held] + [b for b, u in zip(again, sc.units) if not u.held][::-1]
    return _ag_reserved(tuple(out), tuple(back), sc.assume.expandable_segments)


@lru_cache(maxsize=1024)
def _ag_reserved(forward: tuple[int, ...], backward: tuple[int, ...], expandable: bool) -> int:
    return allocator.all_gather_stream_reserved(list(forward), list(backward), expandable)


_HOLES_PRICED = ContextVar("forward_holes_priced", default=True)


@contextmanager
def without_forward_holes():
    """forward_holes answers None inside (no hole priced): a relaxation, never more reserved
    than with them, for recommend's gate on its expandable-segments search."""
    token = _HOLES_PRICED.set(False)
    try:
        yield
    finally:
        _HOLES_PRICED.reset(token)


def forward_holes(sc: Scenario, st: Strategy) -> tuple[int, int, int] | None:
    """allocator.forward_holes for this scenario and strategy (classic or expandable segments, a
    block order activation_memory.forward_tensor_steps derives): FSDP2 (torch layout) gathers each block
    unit's weights into per-parameter storages on the default stream and frees them at its
    reshard after forward (not where the unit stays gathered: policy.unit_stays_gathered), as
    it does an embedding unit of its own, freed before the first block. DDP and ZeRO-1 gather
    nothing; DeepSpeed's gathered window is counted apart (static_buffers). None
    where the block's order is not derived, and under a flat --fragmentation (which replaces
    the allocator model). Expandable segments were None here before 2026-12-07 (no hole priced:
    the planner read 0.5-3.9% below the replay in every cell of docs/reserved-matrix.md)."""
    t, m = sc.train, sc.model
    if sc.assume.fragmentation is not None or not _HOLES_PRICED.get():
        return None
    steps, block_steps = activation_memory.forward_tensor_steps(m, t), ()
    if steps is None and policy.uniform_mode(t, m.num_layers) in policy.PARTIAL_CHECKPOINTING:
        # every-k, first-k: each block under its own mode, the checkpointed blocks' holes
        # beside the others' kept tensors (before 2026-12-06 one block's freed working set was
        # priced for these, and nothing without checkpointing, none of what full checkpointing's
        # simulation found: first-125 of Llama 3.1 405B's 126 blocks reserved 3.6 GB less than
        # full checkpointing; tests/test_first_k_holes.py)
        modes = tuple(activation_memory.block_mode(t, i, m.num_layers) for i in range(m.num_layers))
        by_mode = {md: activation_memory.forward_tensor_steps(m, t, md) for md in set(modes)}
        if all(v is not None for v in by_mode.values()):
            block_steps = tuple(by_mode[md] for md in modes)
            steps = block_steps[0]
    if steps is None:
        return None
    units = [u for u in sc.units if u.blocks]
    gathers = st.fsdp and t.layout == "torch"
    params = tuple(gathered_param_bytes(sc, st, u) if gathers else () for u in units)
    reshard = tuple(gathers and st.reshard_after_forward and not policy.unit_stays_gathered(u, t, m.num_layers)
                    for u in units)
    first = embedding_unit(sc)  # freed after its forward where it is a unit of its own
    embed = (sum(gathered_param_bytes(sc, st, first))
             if gathers and st.reshard_after_forward and not (first.blocks or first.held) else 0)
    input_b = activation_memory.stream_dtype_bytes(t) * t.seq_len * t.micro_batch * m.hidden
    return _holes(steps, input_b, params, reshard, tuple(u.blocks for u in units), embed, block_steps,
                  sc.assume.expandable_segments)


@lru_cache(maxsize=256)
def _holes(steps, input_b: int, params, reshard, blocks, embed: int, block_steps=(),
           expandable: bool = False) -> tuple[int, int, int]:
    return allocator.forward_holes(steps, input_b, params, reshard, blocks, embed, block_steps, expandable)


def forward_residue(sc: Scenario, st: Strategy, logits_elems: int) -> tuple[int, int]:
    """allocator.forward_residue_bytes for this scenario: the loss's requests are its own
    tensors (activation_memory.loss_tensor_steps); the head's around it are not: the loss simulation
    places them already (the input gradient in a block the loss freed; the weights and their
    gradients, vocabulary-sized, fit no block a block unit's weights left). A linear loss: the
    trainer's chunked one, none (its chunks fit the freed blocks); Liger's, its weight-sized
    tensors (activation_memory.liger_loss_tensors) fit none below 64k tokens of Llama 3 8B, so
    the freed working set stays reserved beside them. What the forward leaves cached is simulated tensor by
    tensor where the block's order is derived (forward_holes), else one block's freed working
    set (activation_memory.forward_transient_bytes; none with expandable segments, where that
    working set is the segment's free end, which the loss grows). Returns (the residue, the part of it in
    segments wholly free, which the allocator releases before it fails a cudaMalloc): a hole
    shares its segment with a kept tensor and is not released; one block's freed working set is
    its own segments."""
    liger = sc.train.linear_loss == "liger"
    if logits_elems <= 0 and not liger:
        return 0, 0
    holes = forward_holes(sc, st)
    if holes is None and sc.assume.expandable_segments:
        return 0, 0  # one block's freed working set: at the segment's end, where the loss grows it
    if holes is None:
        transient, largest = activation_memory.forward_transient_bytes(sc.model, sc.train)
        whole = transient
    else:
        transient, largest, whole = holes
    if not transient:
        return 0, 0
    if liger:
        loss = list(activation_memory.liger_loss_tensors(sc.model, sc.train))
    else:
        loss = [b for _, op, _, b in activation_memory.loss_tensor_steps(sc.train, sc.assume.loss_fp32, logits_elems)
                if op == "+"]
    residue = allocator.forward_residue_bytes(transient, largest, loss, sc.assume.expandable_segments)
    return residue, min(whole, residue)


def param_block_cache(sc: Scenario, st: Strategy) -> tuple[int, int]:
    """What DeepSpeed ZeRO-1/2 leaves cached of the parameters' own blocks and the step does not
    use, and the part of it in segments wholly free (releasable), bytes (allocator.
    cached_param_blocks): where the optimizer holds the parameters in one group
    (TrainSpec.deepspeed_param_groups "one") and the GPU had room to flatten beside them
    (stage_1_and_2.py: free memory after empty_cache, the parameters and the CUDA context
    resident, at least the flat buffer's 2 Psi bytes). The step's tensors: each block's kept
    tensors (activation_memory.block_kept_tensors) and, under checkpointing, one block's
    recomputed tensors on top (activation_memory.block_recompute_tensors). (0, 0) where not priced (cache_unpriced says why)."""
    t, m = sc.train, sc.model
    if not _cache_priced(sc, st):
        return 0, 0
    mode = policy.uniform_mode(t, m.num_layers)  # every-1 and first-L are full
    kept = activation_memory.block_kept_tensors(m, t, mode)
    working = activation_memory.block_recompute_tensors(m, t, mode)
    if working is None:  # the sets not derived: the whole no-recomputation list, a bound
        working = activation_memory.block_kept_tensors(m, t, "none")
    return _cached_blocks(_param_blocks(sc), kept, working, m.num_layers)


def _param_blocks(sc: Scenario) -> tuple[int, ...]:
    """Each parameter's own block, bytes in the param dtype, model order."""
    pb = DTYPE_BITS[sc.train.precision.param] // 8
    return tuple(math.prod(s) * pb for u in sc.units for s in u.shapes)


def _cache_priced(sc: Scenario, st: Strategy) -> bool:
    """Whether DeepSpeed ZeRO-1/2's cached parameter blocks are priced (both moments): the zero
    layout's unsharded weights with a sharded optimizer in one group, and no reason against it
    (cache_unpriced)."""
    t = sc.train
    return (t.layout == "zero" and not st.params_sharded and st.optim_sharded
            and t.deepspeed_param_groups == "one" and not cache_unpriced(sc, st))


def param_block_cache_at_step(sc: Scenario, st: Strategy) -> tuple[int, int]:
    """param_block_cache at the optimizer step: every activation freed, the step's flat
    temporaries made (deepspeed_step_temps: the 16-bit gradient partition flattened and its fp32
    copy, each one tensor of the rank's partition, which fits a parameter's block only at many
    ranks); what of the cache they leave unused, and the wholly free part. (0, 0) where the
    cache is not priced."""
    if not _cache_priced(sc, st):
        return 0, 0
    local = sum(_memory.optimizer_tensor_sizes(sc, sc.shard_degree(st.hsdp), zero1=st.name == "zero1"))
    temps = _memory.deepspeed_step_temps(local, st.params_sharded, sc.train.precision)
    return _cached_blocks(_param_blocks(sc), (), temps, 0)


def cache_unpriced(sc: Scenario, st: Strategy) -> str:
    """Why the parameters' cached blocks are not priced for this scenario ('' where they are)."""
    t, m = sc.train, sc.model
    if sc.assume.expandable_segments:
        return "expandable segments (the freed parameters are one free range the step's tensors reuse)"
    if sc.assume.fragmentation is not None:
        return "a flat --fragmentation replaces the allocator model"
    if st.name == "zero1" and not (t.grad_accum == 1 and sc.assume.overlap):
        return ("each parameter's gradient is held whole between accumulation boundaries, one of "
                "each parameter's size, and takes its block")
    if (activation_memory.block_kept_tensors(m, t, policy.uniform_mode(t, m.num_layers)) is None
            or activation_memory.block_kept_tensors(m, t, "none") is None):
        return ("the block's kept tensors are not split one by one here (MoE, compiled or float8 "
                "blocks, dropout, attention without a flash kernel, autocast, every-k, first-k, a returned "
                "cache)")
    pb = DTYPE_BITS[t.precision.param] // 8
    if sc.hw.gpu.memory_bytes - sc.assume.cuda_context_bytes < 2 * sc.params * pb:
        return "no room to flatten beside the parameters: DeepSpeed flattens on the host"
    return ""


def param_block_cache_priced(sc: Scenario) -> str:
    """For estimate's assumptions: why DeepSpeed ZeRO-2's cached parameter blocks are not
    priced for this scenario ('' where they are), ZeRO-1's own reason added."""
    from .strategies import effective

    why = cache_unpriced(sc.for_strategy(False), effective("zero2", "zero"))
    z1 = cache_unpriced(sc.for_strategy(False), effective("zero1", "zero"))
    return why or (f"under ZeRO-1: {z1}" if z1 else "")


@lru_cache(maxsize=64)
def _cached_blocks(params, kept, working, layers: int) -> tuple[int, int]:
    return allocator.cached_param_blocks(params, kept, working, layers)
