"""Memory over the events of one training step: the peak is the largest event, not a sum of
separate maxima.

Events, in order: each unit's forward, the loss's forward and backward, each unit's backward
(with its recomputation) and reduce-scatter, the optimizer step with its temporaries. At each
event the live bytes are split by kind: the state at rest (sharded parameters, master weights,
optimizer state), the sharded gradients produced so far, the gathered weights, the reduction
buffers, and the activations. What each FSDP2 event holds follows
torch/distributed/fsdp/_fully_shard (all-gather output then copy-out into the unsharded
parameters; the next unit's all-gather prefetched; each unit's reduce-scatter input kept until
the next unit's reduce-scatter, `reduce_scatter_states`); derivation in docs/formulas.md
section 3.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from itertools import accumulate

from . import activation_memory, arch, policy
from .scenario import Scenario
from .specs import TrainSpec
from .units import DTYPE_BITS

KINDS = ("state", "grads", "gathered", "all_gather", "unsharded_grads", "reduce_scatter",
         "activations", "step_temps")
# The CUDA stream each kind is allocated on: the caching allocator reuses a freed block only for
# requests on the stream it was allocated on. FSDP2 allocates all-gather outputs on its
# all-gather (copy-in) stream and the reduce-scatter outputs (the sharded gradients are views of
# them) on its reduce-scatter stream; the reduce-scatter input is allocated and copied into on
# the default stream since PyTorch 2.5 (pytorch/pytorch#129721; _fsdp_collectives.
# foreach_all_gather, foreach_reduce in torch 2.13).
STREAM = {"state": "default", "gathered": "default", "unsharded_grads": "default",
          "activations": "default", "all_gather": "all-gather", "grads": "reduce-scatter",
          "reduce_scatter": "default", "step_temps": "default"}


def tied_grads_summed_out_of_place(sc: Scenario) -> bool:
    """Whether a tied weight's two gradients (the head's, then the embedding's), which meet in
    autograd's input buffer of its one AccumulateGrad, are summed out of place there: where the
    head's is a view, as nn.Linear's weight gradient is (the transpose of its matmul's,
    TBackward0, which keeps its base alive and so its storage shared), and InputBuffer adds in
    place only into a tensor whose storage it holds alone (torch/csrc/autograd/input_buffer.cpp,
    can_accumulate_inplace). A linear loss's gradient is a plain tensor and takes the embedding's
    in place; so does the head's under autocast, where the cast's backward (ToCopyBackward0)
    hands autograd a fresh tensor in the weight's dtype. Measured on real CPU tensors:
    tests/test_memory.py."""
    return sc.model.tied_embeddings and sc.train.linear_loss == "none" and not sc.train.autocast


def fsdp_tied_grads_summed_out_of_place(sc: Scenario) -> bool:
    """tied_grads_summed_out_of_place for FSDP2's held root: out of place under a linear loss
    too. Measured on real tensors: a tied 2-block model (vocabulary 32000, width 256) under
    zplan's chunked loss on 2 CPU ranks over gloo, zero3, bf16 gather and reduce, full
    checkpointing, peaks at the embedding's backward holding three weight-sized gradients
    (FSDPMemTracker's categories: the loss's weight gradient as an activation, two temps;
    127.75 MB measured against 111.50 priced with two), and the fake trace of Llama 3.2 1B
    agrees; without FSDP the same loss's gradient is taken in place (tests/test_memory.py).
    Liger's loss is priced as the trainer's (not measured)."""
    return sc.model.tied_embeddings and not sc.train.autocast


def gloo_reduce_scatter_copies_its_input(sc: Scenario) -> bool:
    """Whether FSDP2's reduce-scatter holds a second copy of its input while it runs: on CPU
    ranks, whose collectives go over gloo. ProcessGroupGloo implements reduce_scatter_tensor as
    an all-reduce of a clone of the input (`buffers.push_back(inputTensors[i].clone())` in
    reduce_scatter_tensor_coalesced, torch/csrc/distributed/c10d/ProcessGroupGloo.cpp), made on
    the calling thread and released once the chunk is copied out; NCCL reduces from the input
    itself. Measured on 2 CPU ranks: tests/test_timeline_backward.py."""
    return sc.hw.gpu.device == "cpu"


class Event:
    """One moment of the step: its phase, a label, and the live bytes by kind (KINDS; a kind
    not named holds nothing)."""

    __slots__ = ("phase", "label", "live", "total_bytes")

    def __init__(self, phase: str, label: str, live: dict[str, int]):
        self.phase, self.label, self.live = phase, label, live  # phase: setup|forward|loss|backward|optimizer
        self.total_bytes = sum(live.values())

    def __repr__(self) -> str:
        return f"Event({self.phase!r}, {self.label!r}, {self.live!r})"


def _ev(phase: str, label: str, **live: int) -> Event:
    return Event(phase, label, live)


@dataclass(frozen=True)
class Activations:
    """What the activations of one micro-batch hold, per unit (bytes)."""

    saved: tuple[int, ...]  # kept between a unit's forward and its backward
    recompute: tuple[int, ...]  # extra, while one of the unit's blocks is recomputed in backward
    backward_temp: tuple[int, ...]  # gradients of activations alive inside the unit's backward
    logits_elems: int  # logits the head materialises (0 under a linear loss)
    loss_bytes: dict[str, int]  # the loss over the logits at its largest, by phase (activation_memory.loss_peak_bytes)
    linear_loss: dict[str, int]  # a linear loss's bytes by phase (activation_memory.linear_loss_bytes)
    act_bytes: int  # bytes per activation element (the param dtype)
    kept_logit_bytes: int  # bytes per logit the loop keeps (activation_memory.kept_logit_bytes)
    stream_bytes: int  # one hidden-state tensor (s·b·h) in the residual stream's dtype
    cache: tuple[int, ...] = ()  # per unit, the cache the model returns (TrainSpec.kv_cache)
    cache_saved: tuple[int, ...] = ()  # per unit, of that, what `saved` counts already
    # per unit, what its first block keeps (the last of its blocks through backward); `saved`
    # for a unit of one block or none
    first_block_saved: tuple[int, ...] = ()
    batch_ids: int = 0  # the micro-batch's input ids and labels (activation_memory.batch_ids_bytes)
    # per unit, per block in forward order: what each keeps, and what its recompute holds in
    # backward (0 where it is not checkpointed); a unit whose blocks differ (every-k, first-k)
    # is walked block by block through its backward (fsdp_events)
    block_saved: tuple[tuple[int, ...], ...] = ()
    block_recompute: tuple[tuple[int, ...], ...] = ()


class HeldOutputs:
    """What the loop holds at each event, beyond the activations counted: through the micro-
    batch's forward, loss and backward its token ids (Activations.batch_ids), gone at the
    optimizer step; the model's cache (TrainSpec.kv_cache: activation_memory.kv_cache_bytes per block), less what the
    blocks keep for backward anyway while they keep it (kv_cache_saved_bytes); and, where the
    loop holds a micro-batch's output until the next forward returns
    (TrainSpec.outputs_until_next_forward), the previous micro-batch's logits and cache through
    this one's forward and loss, and this one's through the optimizer step. Unit indices are in
    forward order. docs/formulas.md section 3."""

    def __init__(self, train: TrainSpec, acts: Activations):
        n = len(acts.saved)
        cache = acts.cache or (0,) * n
        saved = acts.cache_saved or (0,) * n
        self.total = sum(cache)
        self.extra_upto = [0, *accumulate(c - k for c, k in zip(cache, saved))]
        self.saved_upto = [0, *accumulate(saved)]
        self.held = train.logits_kept  # the loop holds the output until backward returns (at least)
        logits = 0 if train.logits_unreferenced else acts.logits_elems * acts.kept_logit_bytes
        self.previous = self.total + logits if train.outputs_until_next_forward else 0
        self.ids = acts.batch_ids

    def forward(self, i: int) -> int:
        """After unit i's forward: the caches made so far, and the previous output."""
        return self.ids + self.extra_upto[i + 1] + self.previous

    def loss(self, phase: str) -> int:
        """The whole cache; in the loss's forward the previous output too (the loss inside the
        forward); in its backward only while the loop holds the output."""
        if phase == "forward":
            return self.ids + self.extra_upto[-1] + self.previous
        return self.ids + (self.extra_upto[-1] if self.held else 0)

    def backward(self, j: int, done: bool = False) -> int:
        """In unit j's backward (`done`: after it, at its reduce-scatter): the cache, less what
        the units not yet through backward still keep as their activations."""
        return self.ids + (self.total - self.saved_upto[j if done else j + 1] if self.held else 0)

    def optimizer(self) -> int:
        """The step's own output, held into the next forward."""
        return self.previous


def activations(sc: Scenario) -> Activations:
    """Per-unit saved, recomputed and backward-temporary bytes (activation_memory.block_* functions)."""
    if sc.custom_units is None:  # the units follow from the model and the training spec
        return _decoder_activations(sc.model, sc.train, sc.assume.loss_fp32)
    return _unit_activations(sc.model, sc.train, sc.assume.loss_fp32, sc.units)


@lru_cache(maxsize=512)
def _decoder_activations(m, t: TrainSpec, loss_fp32: bool) -> Activations:
    return _unit_activations(m, t, loss_fp32, arch.units(m, t.blocks_per_unit, t.embed_head_unit, t.layout))


def _unit_activations(m, t: TrainSpec, loss_fp32: bool, units) -> Activations:
    B, S = activation_memory.act_dtype_bytes(t), activation_memory.stream_dtype_bytes(t)
    sbh = t.seq_len * t.micro_batch * m.hidden
    temp_b = activation_memory.block_backward_temp_bytes(m, t)
    saved, extra, temp, cache, cache_saved, first = [], [], [], [], [], []
    block_saved, block_rec = [], []
    for u in units:
        if u.blocks == 0:
            head = u.name != "embed" and u.matmul_params > 0
            saved.append(activation_memory.head_saved_bytes(m, t) if head else 0)
            first.append(saved[-1])
            block_saved.append(())
            block_rec.append(())
            extra.append(0)
            if t.kv_cache:
                cache.append(0)
                cache_saved.append(0)
            # the embedding's output gradient; the norm's output and input gradients (under
            # autocast both in the stream's dtype: the head's 16-bit input gradient is cast back)
            temp.append(S * sbh if not head else 2 * S * sbh)
            continue
        modes = [activation_memory.block_mode(t, i, m.num_layers) for i in range(u.first_block, u.first_block + u.blocks)]
        per = [activation_memory.block_saved_bytes(m, t, md) for md in modes]
        saved.append(sum(per))
        first.append(per[0])
        rec = [activation_memory.block_recompute_bytes(m, t, md) for md in modes]
        extra.append(max(rec))
        block_saved.append(tuple(per))
        block_rec.append(tuple(rec))
        temp.append(temp_b)
        if t.kv_cache:
            cache.append(u.blocks * activation_memory.kv_cache_bytes(m, t))
            cache_saved.append(sum(activation_memory.kv_cache_saved_bytes(m, t, md) for md in modes))
    linear = activation_memory.linear_loss_bytes(m, t)
    logits = 0 if t.linear_loss != "none" else t.seq_len * t.micro_batch * m.vocab_size
    return Activations(tuple(saved), tuple(extra), tuple(temp), logits,
                       activation_memory.loss_peak_bytes(t, loss_fp32, logits), linear, B,
                       activation_memory.kept_logit_bytes(t), S * sbh, tuple(cache), tuple(cache_saved),
                       tuple(first), activation_memory.batch_ids_bytes(t), tuple(block_saved),
                       tuple(block_rec))


@dataclass(frozen=True)
class CompiledGraphs:
    """Compiled backward graphs of a replicated strategy (memory.compiled_graphs)."""

    new_grads: tuple[int, ...]  # per unit, the new gradients its graph holds until it returns
    graphs: tuple[range, ...]  # each graph's units (forward order)
    cap_bytes: int  # the most new gradients held at once (DDP: the largest bucket)
    end_temp: tuple[int, ...]  # per unit, what its graph's end holds besides its gradients (the
    # embedding's fp32 gradient buffer)
    tied_head: int = 0  # a tied head's weight gradient, from its backward to its graph's end


@dataclass(frozen=True)
class AutocastCopies:
    """autocast's 16-bit copies of the weights (DDP and ZeRO-1 on master-dtype weights; memory.
    autocast_copies), per unit (bytes): all of them, in autocast's cache from their first use in
    forward until the autocast context exits after the loss's forward; those the unit's saved
    tensors keep until its backward (a matmul saves the copy it used); and those a recomputed
    block makes again in backward (one block's, alive through that block's backward)."""

    made: tuple[int, ...]
    kept: tuple[int, ...]
    recomputed: tuple[int, ...]
    until_head: int = 0  # a held root's head copy (tied embeddings): kept until the head's backward
    # per unit, per block in forward order: the copies its saved tensors keep, and the copies its
    # recomputation makes again (a unit whose blocks differ is walked block by block)
    block_kept: tuple[tuple[int, ...], ...] = ()
    block_recomputed: tuple[tuple[int, ...], ...] = ()


def optimizer_temp_bytes(largest_param_elems: int, local_elems: int, train: TrainSpec, layout: str) -> int:
    """AdamW's temporaries in its step, by implementation (torch/optim/adam.py, torch 2.13), S the
    state dtype's bytes: single (foreach=False) builds `denom` as
    `(exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(eps)`, two temporaries the size of one
    parameter alive at once, 2S x the largest; foreach builds `exp_avg_sq_sqrt =
    _foreach_sqrt(exp_avg_sqs)` for every local parameter at once, S x all local elements (its
    div_, add_ and addcdiv_ work in place); fused updates in place (0), as DeepSpeed's kernels
    (zero layout: 0)."""
    if layout != "torch" or train.optimizer != "adamw" or train.optimizer_kernels == "fused":
        return 0
    S = DTYPE_BITS[train.precision.optimizer] // 8
    if train.optimizer_kernels == "foreach":
        return S * local_elems
    return 2 * S * largest_param_elems


def _blocks_differ(per: tuple[int, ...], rec: tuple[int, ...]) -> bool:
    """Whether a unit's blocks keep or recompute different amounts (every-k, first-k with
    several blocks per unit): its backward is then walked block by block."""
    return len(per) > 1 and len(rec) == len(per) and (len(set(per)) > 1 or len(set(rec)) > 1)


def _run_ends(sig: list) -> list[int]:
    """The units worth an event. Within a run of identical units (the blocks) every kind changes
    linearly with the unit's index, so each stream's largest value is at an end of the run; a
    unit's events also read its neighbours (prefetch, the previous reduce-scatter input), so the
    two units next to each end are kept too."""
    n = len(sig)
    edges = {0, n} | {i for i in range(1, n) if sig[i] != sig[i - 1]}
    return sorted({j for e in edges for j in range(e - 2, e + 2) if 0 <= j < n})


def fsdp_events(sc: Scenario, acts: Activations, state_b: int, gathered: list[int],
                held: list[bool], unsharded_grad: list[int], first_grad: list[int],
                reduce_in: list[int],
                sharded_grad: list[int], reshard: bool, accum: list[int] | None, opt_temp_b: int,
                one_rank_copy: list[int] | None = None,
                reduce_out: list[int] | None = None, last_grad: list[int] | None = None,
                all_reduce_held: list[int] | None = None) -> list[Event]:
    """FSDP2's step, unit by unit (torch layout; bytes per unit in the lists, in forward order).

    `one_rank_copy` given: a shard group of one rank, where FSDP2 issues no all-gather and
    copies each sharded parameter straight into its unsharded one (FSDPParamGroup.unshard and
    wait_for_unshard, `world_size == 1`, since PyTorch 2.9: pytorch/pytorch#160135): no
    all-gather output, none prefetched; each parameter's all-gather input (its param-dtype copy;
    per unit, `one_rank_copy` at its largest parameter) lives while it is copied in, at the
    unit's unshard, on the default stream (wait_for_unshard runs on the current stream; torch
    2.13 _fsdp_param_group.py), so it is counted with the gathered weights.

    `accum` given (accumulation without a reduce until the last micro-batch: the accumulated
    gradients' bytes per unit): every unit's accumulated gradients are there through the forwards and the loss;
    in a unit's backward, in the last micro-batch those of the units not yet through backward
    (the others were reduced and freed: FSDP2's post_backward clears each unit's accumulated
    gradient after its reduce-scatter) beside the reduced ones' sharded gradients; in a micro-
    batch before it, no sharded gradient, and the accumulated ones of every unit from the second
    micro-batch on (of the units already through backward in the first).

    `last_grad` given (bytes per unit): the unit's last parameter's gradient, which the loop
    variable of foreach_reduce's dim-0 check (`for i, (fsdp_param, unsharded_grad) in ...`, run
    where the group has more than one rank) still references after `unsharded_grads.clear()`,
    until foreach_reduce returns (torch 2.11 and 2.13 _fsdp_collectives.py): alive when the
    reduce-scatter output is allocated.

    `all_reduce_held` given (HSDP, bytes per unit): the reduce-scatter output each unit's
    replica all-reduce ran on, where it is not the sharded gradient itself (added into one that
    exists, or cast to the weights' dtype): FSDPParamGroup keeps it in `_all_reduce_state` until
    its finalize_backward at the end of backward (torch 2.11 and 2.13 _fsdp_param_group.py,
    AllReduceState), so at a unit's backward every later unit's is held. A real 4-rank run with
    accumulation: -4.1% without it."""
    n = len(gathered)
    ar = all_reduce_held or [0] * n
    ar_from = [*accumulate(reversed(ar))][::-1] + [0]  # ar_from[k]: held by units >= k
    accum_b = sum(accum) if accum else 0
    one_rank = one_rank_copy is not None
    gloo_copy = gloo_reduce_scatter_copies_its_input(sc) and not one_rank and reduce_out is not None
    prefetch = sc.train.prefetch and not one_rank
    held_b = sum(g for g, h in zip(gathered, held) if h)
    moving = [0 if h else g for g, h in zip(gathered, held)]
    # what the unit's unshard holds besides its unsharded parameters: its all-gather output, or
    # on one rank the copy-in on the default stream
    unshard = (lambda i: 0) if one_rank else (  # noqa: E731
        lambda i: gathered[i] if held[i] else moving[i])
    copy_in = (lambda i: one_rank_copy[i]) if one_rank else (lambda i: 0)  # noqa: E731
    nxt = lambda i: moving[i + 1] if prefetch and i + 1 < n else 0  # noqa: E731
    # the last block's unit where the plan keeps it gathered after forward (TrainSpec.last_block_kept):
    # its unsharded weights stay allocated from its forward to its backward, which gathers nothing
    L = next((k for k, u in enumerate(sc.units) if reshard and not held[k] and policy.holds_kept_last_block(
        sc.train, u.first_block, u.blocks, sc.model.num_layers)), None)
    kept_last = (lambda i: moving[L] if L is not None and i > L else 0)  # noqa: E731
    # backward prefetch all-gathers the previous unit, unless it stayed gathered (no reshard)
    prv = lambda j: moving[j - 1] if prefetch and reshard and j > 0 and j - 1 != L else 0  # noqa: E731
    saved_upto = [0, *accumulate(acts.saved)]  # saved_upto[i]: kept by units < i
    moving_upto = [0, *accumulate(moving)]
    grads_upto = [0, *accumulate(sharded_grad)]
    blocks_saved = acts.block_saved or ((),) * n
    blocks_rec = acts.block_recompute or ((),) * n
    ends = _run_ends(list(zip(moving, acts.saved, acts.recompute, acts.backward_temp,
                              unsharded_grad, first_grad, reduce_in, sharded_grad, blocks_saved, blocks_rec)))
    logits_b = acts.logits_elems * acts.act_bytes  # the head's output, and the logits' gradient
    # the logits stay referenced until backward ends, unless the loop drops them first
    logits_ref = 0 if sc.train.logits_unreferenced else acts.logits_elems * acts.kept_logit_bytes
    out = HeldOutputs(sc.train, acts)  # the model's cache, the previous output (kv_cache)
    # with accumulation and a reduce every micro-batch, the later micro-batches find every
    # sharded gradient allocated (the reduce-scatter output is added into it)
    later = sc.train.grad_accum > 1 and not accum_b
    grads_at = (lambda k: grads_upto[n]) if later else (lambda k: grads_upto[n] - grads_upto[k])  # noqa: E731
    all_grads = grads_upto[n] if later else 0  # through forward and the loss, too
    acc_upto = [0, *accumulate(accum)] if accum else [0] * (n + 1)  # accumulated of units < i
    in_place_acc = bool(accum) and sc.train.precision.reduce == sc.train.precision.param
    # before the last micro-batch: every unit's from the second on, else the units through backward
    skipping = (lambda j: accum_b if sc.train.grad_accum > 2 else accum_b - acc_upto[j + 1]) if accum else None  # noqa: E731
    head = next((i for i, u in enumerate(sc.units) if "head" in u.name), n - 1)
    root_head = held[head]  # the head sits in the held root (tied, or embed_head_unit root)
    # the head's saved tensors (its norm's and its input), counted with the held root, which
    # comes first in forward order: they exist only from the head's forward, at the end of
    # forward, to its backward, at the start of backward (not beside the blocks)
    head_saved = acts.saved[head] if root_head else 0
    ev: list[Event] = []
    for i in ends:
        # its compute, after the copy-out of its all-gather into its unsharded parameters (the
        # held root's too, gathered at its own pre-forward). In forward FSDP2 frees an all-gather
        # output only at the next unit's copy-out (FSDPParamGroup.wait_for_unshard keeps it in
        # comm_ctx.all_gather_state, to overlap the copy-out with the next all-gather; torch
        # 2.13), so this unit's output is still allocated beside the next unit's, prefetched in
        # its pre-forward (explicit prefetch) or allocated at the next pre-forward, after this
        # unit has resharded (none)
        kept = moving_upto[i] if not reshard else 0
        act = saved_upto[i + 1] - head_saved
        if i == n - 1 and not root_head:
            act += logits_b  # the head's output
        ev.append(_ev("forward", f"forward {sc.units[i].name}", state=state_b, grads=all_grads,
                      gathered=held_b + kept + kept_last(i) + moving[i] + copy_in(i),
                      all_gather=unshard(i) + nxt(i),
                      unsharded_grads=accum_b, activations=act + out.forward(i)))
        if not prefetch and not one_rank and i + 1 < n:
            nxt_kept = kept + (moving[i] if not reshard else 0)
            ev.append(_ev("forward", f"all-gather {sc.units[i + 1].name}", state=state_b,
                          grads=all_grads, gathered=held_b + nxt_kept + kept_last(i + 1),
                          all_gather=unshard(i) + unshard(i + 1),
                          unsharded_grads=accum_b, activations=act + out.forward(i)))
    # the root (held) reshards after its forward too when resharding (the trainer passes
    # reshard_after_forward to the root as well) and gathers again in its pre-backward, unless
    # it stays gathered (policy.stays_gathered: FSDP1's kept root). A linear
    # loss runs inside the head's forward (and the root's): the head unit is still gathered, and
    # its pre-backward (a hook on the loss itself) gathers it again before the loss's backward
    # units that stay gathered from their forward to their backward (policy.stays_gathered)
    kept_at_loss = [policy.unit_stays_gathered(u, sc.train, sc.model.num_layers) for u in sc.units]
    at_loss = (sum(g for g, k in zip(gathered, kept_at_loss) if k) if reshard
               else held_b + moving_upto[n])
    linear = sc.train.linear_loss != "none"
    if linear:
        at_loss = held_b + kept_last(n) + (moving[head] if reshard else moving_upto[n])
    # Where the head sits in the held root (tied embeddings, or TrainSpec.embed_head_unit root),
    # its weight gradient, made in the head's backward (a linear loss hands it over in the loss's
    # backward), stays unsharded until the root's reduce-scatter at the end of backward: FSDP
    # reduces a unit once all of its gradients exist (FSDP2: the root's post-backward runs in the
    # final callback; FSDP1: the flat parameter's gradient hook). Where micro-batches skip the
    # reduce, it is added into the accumulated gradients (accum_b) only then, in the root's
    # post-backward, unless they share its dtype (then autograd accumulates into .grad in place)
    p = sc.train.precision
    tied = sc.model.tied_embeddings and root_head
    # a tied weight's two gradients (the head's, then the embedding's) meet in autograd's input
    # buffer of its one AccumulateGrad, which runs only once both exist: the head's waits there
    # whatever the accumulation
    in_place = accum_b and p.reduce == p.param and not tied
    hold = (acts.linear_loss["kept"] if linear else first_grad[head]) if root_head and not in_place else 0
    # ... and are summed out of place (fsdp_tied_grads_summed_out_of_place)
    tied_sum = first_grad[head] if tied and fsdp_tied_grads_summed_out_of_place(sc) else 0
    # a linear loss runs inside the model's forward: the last unit's all-gather output is still
    # allocated then (wait_for_unshard defers its free; the root's post-forward releases it)
    last_ag = unshard(n - 1) if linear and not one_rank else 0
    for phase in ("forward", "backward"):
        ev.append(_ev("loss", f"loss {phase}", state=state_b, grads=all_grads, gathered=at_loss,
                      all_gather=last_ag if phase == "forward" else 0, unsharded_grads=accum_b,
                      activations=saved_upto[n] + acts.loss_bytes[phase]
                      + acts.linear_loss[phase] + out.loss(phase)))
    if linear and root_head and reshard and not kept_at_loss[head]:
        # the held root's pre-backward (a hook on the loss) gathers it again: its all-gather
        # output (on one rank the copy-in's param-dtype cast) beside its unsharded weights at the
        # copy-out, the loss's forward having made every tensor its backward reads
        # (linear_loss_bytes)
        ev.append(_ev("backward", f"gather {sc.units[head].name} again", state=state_b, grads=all_grads,
                      gathered=at_loss + copy_in(head), all_gather=unshard(head), unsharded_grads=accum_b,
                      activations=saved_upto[n] + acts.linear_loss["backward"] + out.loss("backward")))
    if root_head and not linear:
        root = sc.units[head].name
        loss_grad = saved_upto[n] + logits_ref + logits_b + out.loss("backward")  # the logits and their gradient
        if reshard and not kept_at_loss[head]:
            # the root's pre-backward (a hook on its output) gathers it again: copy-out
            ev.append(_ev("backward", f"gather {root} again", state=state_b, grads=all_grads,
                          gathered=held_b + kept_last(n) + copy_in(head), all_gather=unshard(head),
                          unsharded_grads=accum_b, activations=loss_grad))
        # the head's backward inside the root, before the last block's: its input gradient and
        # its new weight gradient; FSDP2's implicit backward prefetch has the last block's
        # all-gather out (the root is not in the trainer's explicit prefetch chain)
        ev.append(_ev("backward", f"backward head (in {root})", state=state_b, grads=all_grads,
                      gathered=held_b + (0 if reshard else moving_upto[n]) + kept_last(n),
                      all_gather=moving[n - 1] if prefetch and reshard and L != n - 1 else 0,
                      unsharded_grads=accum_b + first_grad[head],
                      activations=loss_grad + acts.backward_temp[head]))
    for j in reversed(ends):
        name = sc.units[j].name
        # a held root of norm + head alone (head-root-kept: the embeddings a unit of their own)
        # has nothing left to run at backward's end: its head's backward was priced at
        # backward's start; only its reduce-scatter remains
        runs = not (root_head and j == head and "embed" not in name)
        gath = held_b + moving[j] + (0 if reshard else moving_upto[j]) + kept_last(j)
        before = saved_upto[j] - (head_saved if j > head else 0) + logits_ref
        # the held root's own backward is its embedding's: the head's saved tensors, counted with
        # the root, went in the head's backward at backward's start
        act = (before + acts.saved[j] - (head_saved if j == head else 0) + acts.recompute[j]
               + acts.backward_temp[j] + out.backward(j))
        if j == n - 1 and not root_head:
            act += logits_b  # the logits' gradient (the head's own unit)
        prev_rs = reduce_in[j + 1] if j + 1 < n else 0
        # accumulating without a reduce, two variants: the last micro-batch (the reduced units'
        # accumulated gradients freed, their sharded ones made) and one before it (no sharded
        # one). `fresh`: the unit's gradients are new tensors (in the param dtype autograd adds
        # them into the accumulated ones in place, but in the first micro-batch and for a tied
        # weight, whose gradients are summed in autograd's buffer before its AccumulateGrad);
        # the head's new weight gradient exists beside the logits' gradient either way, made
        # before AccumulateGrad adds it in place (accumulate_grad.h: `variable_grad +=
        # new_grad`; the real-run survey: -0.98% and -1.94% at the head's backward without it);
        # a block's, added in place, is gone before its recompute's peak (FSDPMemTracker, the
        # fake trace of test_accumulating_without_a_reduce_is_priced_micro_batch_by_micro_batch)
        acc_now = acc_upto[j + 1] if accum else accum_b
        in_place_j = in_place_acc and not (tied and j == head)
        variants = [(grads_at(j + 1), acc_now, "", not in_place_j)]
        if accum:
            variants.append((0, skipping(j), ", a micro-batch before the last",
                             not in_place_j or sc.train.grad_accum == 2))
        k = sc.units[j].blocks
        per, rec = blocks_saved[j], blocks_rec[j]
        # blocks that differ (every-k, first-k): the unit's backward begins with its last block,
        # beside every block's kept tensors with that block's own recompute (not the largest)
        mixed = len(per) == k and _blocks_differ(per, rec)
        start = act - acts.recompute[j] + rec[-1] if mixed else act
        for grads_j, acc_j, when, fresh in variants if runs else ():
            # at its largest, early in the unit's backward: one weight's gradient so far
            ev.append(_ev("backward", f"backward {name}{when}", state=state_b,
                          grads=grads_j, gathered=gath, all_gather=prv(j),
                          unsharded_grads=acc_j + (first_grad[j] if fresh or j == head else 0) + hold
                          + (tied_sum if j == head else 0),
                          reduce_scatter=(prev_rs + ar_from[j + 1]) if not when else 0, activations=start))
            if mixed:
                # then each earlier block's backward in turn, with what the blocks before it
                # keep, its own recompute, and the gradients of the blocks after it (unsharded
                # until the unit's post-backward)
                for idx in range(k - 2, -1, -1):
                    done = unsharded_grad[j] * (k - 1 - idx) // k if fresh else 0
                    label = "its first block" if idx == 0 else f"its block {idx + 1} of {k}"
                    ev.append(_ev("backward", f"backward {name} ({label}){when}", state=state_b,
                                  grads=grads_j, gathered=gath, all_gather=prv(j),
                                  unsharded_grads=acc_j + done + (first_grad[j] if fresh else 0) + hold,
                                  reduce_scatter=(prev_rs + ar_from[j + 1]) if not when else 0,
                                  activations=act - acts.saved[j] - acts.recompute[j] + sum(per[:idx + 1]) + rec[idx]))
            elif k > 1:
                # its first block's backward, the unit's last: the other blocks' saved tensors
                # are gone, their weight gradients are all there (unsharded until the unit's
                # post-backward)
                done = unsharded_grad[j] * (k - 1) // k if fresh else 0
                ev.append(_ev("backward", f"backward {name} (its first block){when}", state=state_b,
                              grads=grads_j, gathered=gath, all_gather=prv(j),
                              unsharded_grads=acc_j + done + (first_grad[j] if fresh else 0) + hold,
                              reduce_scatter=(prev_rs + ar_from[j + 1]) if not when else 0,
                              activations=act - acts.saved[j] + acts.first_block_saved[j]))
        # reduce-scatter, at its copy-in: the unit's unsharded gradients copied into the
        # reduce-scatter input (the previous one is released first); its output, the sharded
        # gradient, is allocated only once they are freed (_fsdp_collectives.foreach_reduce:
        # copy-in, unsharded_grads.clear(), then reduce_output). The unit's own weights, the
        # held root's too, are resharded just before (FSDPParamGroup.post_backward:
        # reshard_after_backward, True by default, then foreach_reduce)
        at_reduce = dict(state=state_b, gathered=gath - (gathered[j] if held[j] else moving[j]),
                         all_gather=prv(j), activations=before + acts.stream_bytes + out.backward(j, done=True))
        others = hold if j != head else 0  # the held head's gradient, waiting for the root's reduce
        ev.append(_ev("backward", f"reduce-scatter {name}", grads=grads_at(j + 1),
                      # accumulating (reduce skipped before), the unit's new gradients were added
                      # into its accumulated ones (accum_b), which are what is copied in
                      unsharded_grads=(acc_upto[j + 1] if accum else accum_b + (0 if accum_b else unsharded_grad[j])) + others,
                      reduce_scatter=reduce_in[j] + ar_from[j + 1], **at_reduce))
        lingering = last_grad[j] if last_grad and not one_rank and reduce_in[j] else 0
        if (lingering or one_rank and reduce_in[j]) and not gloo_copy and reduce_out is not None:
            # its output allocated, the gradients cleared but the last one (last_grad); on one
            # rank the output is the input's copy, both whole (a wider reduce dtype than the
            # param dtype makes this the unit's largest moment)
            ev.append(_ev("backward", f"reduce-scatter {name} (output)", grads=grads_at(j + 1) + reduce_out[j],
                          unsharded_grads=(acc_upto[j] if accum else max(0, accum_b - reduce_in[j])) + others
                          + lingering, reduce_scatter=reduce_in[j] + ar_from[j + 1], **at_reduce))
        if gloo_copy and reduce_in[j]:
            # gloo, at the collective: the unit's unsharded (or accumulated) gradients freed
            # (foreach_reduce clears them after the copy-in; post_backward drops an accumulated
            # one first), its output in the reduce dtype allocated, and the input cloned
            # (gloo_reduce_scatter_copies_its_input)
            ev.append(_ev("backward", f"reduce-scatter {name} (gloo's copy)",
                          grads=grads_at(j + 1) + reduce_out[j],
                          unsharded_grads=(acc_upto[j] if accum else max(0, accum_b - reduce_in[j])) + others
                          + lingering, reduce_scatter=2 * reduce_in[j] + ar_from[j + 1], **at_reduce))
    ev.append(_ev("optimizer", "optimizer step", state=state_b, grads=grads_upto[n],
                  step_temps=opt_temp_b, activations=out.optimizer()))
    return ev


def replicated_events(sc: Scenario, acts: Activations, state_b: int, static_b: int,
                      reduce_b: int, opt_temp_b: int, compiled: CompiledGraphs | None = None,
                      step_gathered_b: int | None = None,
                      casts: AutocastCopies | None = None, accum: list[int] | None = None,
                      late: list[int] | None = None, new_weight_grad: list[int] | None = None,
                      own_grads: list[int] | None = None,
                      loss_buffers: tuple[int, int] | None = None) -> list[Event]:
    """DDP and ZeRO-1 (and every strategy of the zero layout, whose buffers are modelled as
    static): gradients and buffers held throughout; activations follow the step. At the
    optimizer step the gathered weights are `step_gathered_b` (default: the static buffer):
    DeepSpeed ZeRO-3 has released its live window at the end of backward. From the forward's
    end through the loss, `loss_buffers` (gathered, reduce side) where given stand for the
    static buffers: DeepSpeed ZeRO-3's coordinator then holds what it has gathered at that
    point, and no gradient exists yet beside its persistent bucket (memory.deepspeed_loss_buffers).

    Compiled backward graphs hold the new gradients they make until they return: a unit's
    backward holds those of the later units of its graph (at most `cap_bytes`), and the graph's
    end holds all of its own with its end temporaries and its input's gradient, beside the
    activations of the units before it.

    autocast's weight copies (`casts`) are counted as gathered weights besides `static_b`: all
    of them through forward and the loss's forward, then what the saved tensors keep, and a
    recomputed block's own; none at the optimizer step.

    `accum` given (DDP accumulating under no_sync: each unit's gradients, tensors of their own
    until the last micro-batch's hooks copy them into the buckets): all of them through the
    forwards and the loss, at a unit's backward those of the units not yet reduced (itself and
    those before it; a tied weight's once, at the end), none at the optimizer step.

    `late` given (one rank, no wrapper, no accumulation: each unit's `.grad`, part of `state_b`):
    zero_grad(set_to_none=True) left none, so a unit's exist from its backward on (a tied
    weight's from the end of backward).

    `new_weight_grad` given (eager, bytes per unit): a weight's gradient as its backward makes
    it, before it is added into `.grad` or copied into its bucket (DDP's hook, then `.grad` is
    the bucket view): under autocast the matmul's 16-bit gradient and the master-dtype copy its
    cast's backward makes; at the head's, after its matmul's backward, the logits' gradient is
    gone but the logits and the head's input gradient are not (the real-run survey: -3.1% on 2
    ranks without it). Counted once each unit's backward is done (its largest weight).

    `own_grads` given (DDP without bucket views, bytes per unit): `.grad` apart from the buckets,
    made in each unit's backward (all of them through a later micro-batch's forward, with
    accumulation), all at the optimizer step."""
    n = len(acts.saved)
    own = own_grads or [0] * n
    own_from = [*accumulate(reversed(own))][::-1] + [0]  # own_from[j]: units >= j
    own_all = own_from[0] if sc.train.grad_accum > 1 else 0  # made by the earlier micro-batches
    new_w = new_weight_grad or [0] * n
    accum_upto = [0, *accumulate(accum or (0,) * n)]  # accum_upto[j + 1]: units 0..j
    absent_upto = [0, *accumulate(late or (0,) * n)]  # absent_upto[j]: units before j, not yet made
    total_saved = sum(acts.saved)
    if casts is None:
        casts = AutocastCopies((0,) * n, (0,) * n, (0,) * n)
    kept_upto = [0, *accumulate(casts.kept)]
    step_kw = dict(state=state_b, gathered=static_b if step_gathered_b is None else step_gathered_b,
                   unsharded_grads=reduce_b + own_from[0])
    kw = dict(state=state_b - absent_upto[n], gathered=static_b, unsharded_grads=reduce_b + accum_upto[n] + own_all)
    made = {**kw, "gathered": static_b + sum(casts.made)}
    at_loss, loss_back = made, {**kw, "gathered": static_b + kept_upto[n] + casts.until_head}
    if loss_buffers is not None:
        lg, lr = loss_buffers
        at_loss = {**made, "gathered": lg + sum(casts.made), "unsharded_grads": made["unsharded_grads"] - reduce_b + lr}
        loss_back = {**loss_back, "gathered": lg + kept_upto[n] + casts.until_head,
                     "unsharded_grads": kw["unsharded_grads"] - reduce_b + lr}
    if compiled is None:  # eager: every gradient accumulated as soon as it is made
        compiled = CompiledGraphs((0,) * n, (), 0, (0,) * n)
    # a compiled graph's tied head gradient: made right after the loss's backward, beside the
    # logits' gradient, held to the graph's end
    tied_graph = compiled.tied_head
    out = HeldOutputs(sc.train, acts)  # the model's cache, the previous output (kv_cache)
    ev = [_ev("forward", "forward end", activations=total_saved + acts.logits_elems * acts.kept_logit_bytes
              + out.forward(n - 1), **at_loss)]
    for phase in ("forward", "backward"):
        ev.append(_ev("loss", f"loss {phase}", activations=total_saved
                      + acts.loss_bytes[phase] + acts.linear_loss[phase]
                      + out.loss(phase),
                      **(at_loss if phase == "forward" else
                         {**loss_back, "unsharded_grads": loss_back["unsharded_grads"] + tied_graph})))
    saved_upto = [0, *accumulate(acts.saved)]
    new, end_temp, cap = compiled.new_grads, compiled.end_temp, compiled.cap_bytes
    graph_of: list[range | None] = [None] * n
    for g in compiled.graphs:
        for i in g:
            graph_of[i] = g
    after = [*accumulate(reversed(new))][::-1] + [0]  # after[j]: new gradients of units >= j
    # new gradients a compiled graph holds at unit j's backward: its later units'
    held = [min(cap, after[j + 1] - after[g.stop]) if (g := graph_of[j]) else 0 for j in range(n)]
    # a unit's blocks through backward, last first: at block i, what blocks 1..i keep (and the
    # weight copies their saved tensors hold) with block i's own recompute (and its copies made
    # again); the unit's largest such moment, as (activations, copies). Blocks alike (or not
    # known one by one): every block's kept tensors beside the unit's recompute
    inside = []
    for j in range(n):
        per = acts.block_saved[j] if acts.block_saved else ()
        rec = acts.block_recompute[j] if acts.block_recompute else ()
        bk = casts.block_kept[j] if casts.block_kept else (0,) * len(per)
        ba = casts.block_recomputed[j] if casts.block_recomputed else (0,) * len(per)
        whole = (acts.saved[j] + acts.recompute[j], casts.kept[j] + casts.recomputed[j])
        if _blocks_differ(per, rec) and len(bk) == len(per):
            whole = max(((sum(per[:i + 1]) + rec[i], sum(bk[:i + 1]) + ba[i]) for i in range(len(per))),
                        key=sum)
        inside.append(whole)
    ends = _run_ends(list(zip(acts.saved, acts.recompute, acts.backward_temp, new, held, end_temp,
                              casts.kept, casts.recomputed, inside)))
    logits_b = acts.logits_elems * acts.act_bytes  # the logits' gradient
    # the logits, referenced until backward ends
    logits_ref = 0 if sc.train.logits_unreferenced else acts.logits_elems * acts.kept_logit_bytes
    # eager where the tied root is in no compiled graph (per-block compile leaves it eager)
    wait = tied_head_grad_wait(sc) if graph_of[0] is None else (0, 0)
    # a tied model's head is in its first unit (forward order): its saved tensors are freed in
    # its backward, at the start of backward, not kept beside the blocks' (fsdp_events alike)
    head = next((i for i, u in enumerate(sc.units) if "head" in u.name), n - 1)
    head_saved = acts.saved[head] if head < n - 1 else 0
    # where `.grad` is made in backward (`late`, or `own_grads` without accumulation), a tied
    # weight's is not made until its one AccumulateGrad runs, after the embedding's backward:
    # at that backward only its waiting gradients are (wait), not its `.grad` besides
    unmade0 = wait[0] if (late or (own_grads and not own_all)) else 0
    for j in reversed(ends):
        act = (saved_upto[j] - (head_saved if j > head else 0) + inside[j][0] + acts.backward_temp[j]
               + logits_ref + out.backward(j))
        if j == n - 1:
            act += logits_b  # their gradient
        ev.append(_ev("backward", f"backward {sc.units[j].name}", activations=act,
                      **{**kw, "state": state_b - absent_upto[j] - (unmade0 if late and j == 0 else 0),
                         "unsharded_grads": reduce_b + accum_upto[j + 1] + held[j] + wait[j == 0] + tied_graph
                         + max(own_all, own_from[j] - (unmade0 if own_grads and j == 0 else 0)),
                         "gathered": static_b + kept_upto[j] + inside[j][1]}))
        if new_w[j] and graph_of[j] is None:
            ev.append(_ev("backward", f"backward {sc.units[j].name} (a weight's new gradient)",
                          activations=saved_upto[j] - (head_saved if j > head else 0) + logits_ref
                          + out.backward(j, done=True) + (acts.stream_bytes if j else 0),
                          **{**kw, "state": state_b - absent_upto[j],
                             "unsharded_grads": reduce_b + accum_upto[j + 1] + wait[j == 0] + new_w[j]
                             + max(own_all, own_from[j]),
                             "gathered": static_b + kept_upto[j]}))
        g = graph_of[j]
        if g is not None and j == g.start:  # the graph returns its gradients
            label = sc.units[g.start].name + (f"..{sc.units[g.stop - 1].name}" if len(g) > 1 else "")
            ev.append(_ev("backward", f"backward graph of {label} returns",
                          activations=saved_upto[j] - (head_saved if j > head else 0) + logits_ref
                          + sum(end_temp[g.start:g.stop])
                          + out.backward(j, done=True)
                          + (acts.stream_bytes if j else 0),  # and its input's gradient
                          **{**kw, "state": state_b - absent_upto[j], "unsharded_grads": reduce_b + accum_upto[j + 1]
                             + min(cap, after[j] - after[g.stop]) + wait[0] + max(own_all, own_from[j])}))
    ev.append(_ev("optimizer", "optimizer step", step_temps=opt_temp_b, activations=out.optimizer(), **step_kw))
    return ev


def tied_head_grad_wait(sc: Scenario) -> tuple[int, int]:
    """Bytes a tied weight's gradients add to a replicated step's backward (DDP and ZeRO-1 in the
    torch layout, every DeepSpeed stage; where embedding and head run eager, as under per-block
    compile too): (at each block's backward, at the embedding's).
    The head's gradient, made in the head's backward, waits in autograd's input buffer of the
    weight's one AccumulateGrad until the embedding's arrives at the very end of backward (the
    node runs once all of its inputs exist: torch/csrc/autograd/input_buffer.cpp, engine.cpp),
    so it is alive through every block's backward; at the embedding's backward it meets the
    embedding's gradient, and under a plain head their sum is a third
    (tied_grads_summed_out_of_place), before AccumulateGrad adds it into `.grad` (the gradient
    buffer the layout already holds). All are in the dtype the weights are stored in: the master
    dtype under the trainer's autocast, the param dtype otherwise. A replicated unit list puts
    embeddings and head in unit 0."""
    if not sc.model.tied_embeddings or "head" not in sc.units[0].name:
        return 0, 0
    p = sc.train.precision
    w = sc.units[0].matmul_params * DTYPE_BITS[p.master if sc.train.autocast else p.param] // 8
    return w, w * (3 if tied_grads_summed_out_of_place(sc) else 2)


def peak(events: list[Event]) -> Event:
    """The event with the most live bytes (the first one, on a tie)."""
    return max(events, key=lambda e: e.total_bytes)
