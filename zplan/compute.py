"""Compute per unit, the overlap of each gather with compute, and the predicted step time.

A unit's forward costs 2·P·T FLOPs plus attention (PaLM appendix B), its backward twice that,
plus what checkpointing recomputes. A gather hides when the compute it runs beside is longer:
in forward the gather of unit i+1 runs beside the compute of unit i (prefetch); in backward the
gather of unit i-1 and the reduce-scatter of unit i+1 run beside the backward of unit i
(FSDP2's schedule, Zhao et al. 2023, PyTorch FSDP, section 3.3). Derivations: docs/formulas.md.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

from . import arch
from . import kernels as K
from . import muon, policy, unit_ops
from .comm import (WHOLE_MATRIX, Collective, UnitComm, ds_coordination, ds_hooked_modules, ds_zero3, gather_dtype,
                   unit_comm)
from .deepspeed import reduces_after_backward
from .memory import Memory, optimizer_state_bytes, optimizer_tensor_sizes
from .scenario import PinnedMemo, Scenario
from .strategies import Strategy
from .units import dtype_bytes


@dataclass(frozen=True)
class UnitOverlap:
    name: str
    forward_s: float
    backward_s: float  # including recompute
    all_gather_s: float
    reduce_s: float
    forward_exposed_s: float  # this unit's gather not hidden in forward
    backward_exposed_s: float  # communication not hidden behind this unit's backward
    forward_hidden: bool
    backward_hidden: bool

    def as_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)}


# bytes per parameter of the CPU AdamW step at fp32 master weights, gradients and states, the
# layout cpu_adam_params_per_s is measured in (ZeRO-Offload's CPU-Adam; zplan calibrate's fused AdamW)
CPU_ADAM_REFERENCE_BYTES = 28


def cpu_optimizer_bytes_per_param(t) -> float:
    """Host memory bytes the CPU optimizer step moves per parameter: the master weight read and
    written, its gradient read (in the master's dtype: DeepSpeed keeps its gradient partition in
    the master's dtype, FSDP casts the reduced gradient to the sharded parameter's), each state
    tensor read and written: 3M + 2·state for master size M; AdamW's m and v, 3M + 4S, the fused
    pass of unit_ops.adamw_fused_bytes (SGD's momentum 3M + 2S and 8-bit Adam's uint8 states with
    their block scales by analogy, an assumption: the evidence below is AdamW's). Source: the
    kernels' loops (DeepSpeed's csrc/adam/cpu_adam_impl.cpp, Adam_Optimizer::Step_1/4/8; torch's
    fused CPU AdamW of pytorch/pytorch PR 123074), one pass over each buffer; the step is memory-bound (kernel-level timings on Ice Lake and Grace run
    at ~70-75% of DRAM bandwidth: docs/accuracy-notes.md 9bn), so its time scales with these
    bytes from the fp32 AdamW reference (28 B)."""
    p = t.precision
    state = optimizer_state_bytes(_STATE_PROBE, t.optimizer, p.optimizer) / _STATE_PROBE
    return 3 * dtype_bytes(p.master) + 2 * state


_STATE_PROBE = 2048 * 1024  # elements: a whole number of 8-bit Adam's blocks


@dataclass(frozen=True)
class Timing:
    compute_s: float  # per step, all micro-batches, recompute included
    exposed_comm_s: float
    optimizer_s: float
    offload_s: float
    step_s: float
    tokens_per_s_per_gpu: float
    mfu: float
    units: list[UnitOverlap]
    contention_s: float = 0.0  # compute slowed by NCCL collectives beside it (SMs, HBM, power)
    contention_share: float = 0.0  # contention_s / the communication hidden under compute
    breakdown_s: dict[str, float] = field(default_factory=dict)  # seconds per step by kind of op
    slowest_rank_s: float = 0.0  # the slowest rank's compute, optimizer, contention beyond the median GPU's

    def as_dict(self) -> dict:
        d = {f.name: getattr(self, f.name) for f in fields(self)}
        d["units"] = [u.as_dict() for u in self.units]
        return d


def uses_kernel_model(sc: Scenario) -> bool:
    """The per-op kernel model, unless the user assumed one efficiency or the GPU preset has no
    kernel constants (a calibrate-written or hand-made preset): then FLOPs / (peak x efficiency)."""
    return sc.assume.compute_efficiency is None and sc.hw.gpu.kernels is not None


def _efficiency(sc: Scenario) -> float:
    if sc.assume.compute_efficiency is not None:
        return sc.assume.compute_efficiency
    return 1.0 if sc.hw.gpu.measured else 0.7


def _flop_rate(sc: Scenario) -> float:
    dtype = sc.train.precision.param
    return sc.hw.gpu.flops(dtype) * _efficiency(sc)


def unit_seconds(sc: Scenario, st: Strategy) -> tuple[list[float], list[float], dict[str, float], float]:
    """Forward and backward (recompute included) seconds per unit for one micro-batch, the
    micro-batch's seconds by kind of op (gemm, attention, memory, recompute), and its seconds
    if every kernel ran beside a collective (each Op's contended_s; the efficiency model: the same)."""
    t, m = sc.train, sc.model
    if not uses_kernel_model(sc):
        rate = _flop_rate(sc)
        fwd = [arch.unit_forward_flop(m, u, t) / rate for u in sc.units]
        bwd = [(2 * arch.unit_forward_flop(m, u, t) + arch.unit_recompute_flop(m, u, t)) / rate
               for u in sc.units]
        return fwd, bwd, {"flops at efficiency": sum(fwd) + sum(bwd)}, sum(fwd) + sum(bwd)
    D = sc.shard_degree(st.hsdp)
    base = _ops_key(sc)
    memo: dict = {}
    fwd, bwd, kinds, beside = [], [], {}, 0.0
    custom = sc.custom_units is not None
    wrapped = policy.wrapped_blocks(t, m.num_layers) if t.checkpointing in policy.PARTIAL_CHECKPOINTING else None
    # DeepSpeed's ZeRO-3: what its coordinator gathers again differs from unit to unit
    ds = ds_coordination(sc, st) if ds_zero3(sc, st) else None
    for i, u in enumerate(sc.units):
        copied = (ds.coalesced[i], ds.coalesced_calls[i]) if ds is not None else None
        # blocks with as many layers have the same shapes (custom units may not: key on size)
        key = (u.blocks, u.name if not u.blocks else "", _wrapped_in(sc, u, wrapped), u.held,
               sc.padded_elems(u, D) if (st.fsdp and custom) else 0, copied)
        if key not in memo:
            f, b, k, c = _unit_op_seconds(sc, u, base)
            if st.fsdp:
                cf, cb = unit_ops.fsdp_copies(sc, st, u, D, gather_dtype(sc, u), copied)
                k = dict(k)
                k["memory"] = k.get("memory", 0.0) + K.total(cf) + K.total(cb)
                f, b = f + K.total(cf), b + K.total(cb)
                c += K.total_contended(cf + cb)
            memo[key] = (f, b, k, c)
        f, b, k, c = memo[key]
        fwd.append(f)
        bwd.append(b)
        beside += c
        for name, v in k.items():
            kinds[name] = kinds.get(name, 0.0) + v
    return fwd, bwd, kinds, beside


def host_seconds(sc: Scenario, st: Strategy) -> tuple[list[float], list[float]]:
    """Per unit, the host's seconds in DeepSpeed ZeRO-3's hooks for one micro-batch (forward;
    backward with the recompute's forward hooks), zeros elsewhere: each module of the
    coordinator's trace costs the host Assumptions.deepspeed_hook_forward_s in forward (and again
    in a checkpointed block's recompute) and deepspeed_hook_backward_s in backward, beyond the
    model's own work (benchmarks/deepspeed_host.py). The coordinator lets the host run at most
    three fetch events ahead of the GPU (partitioned_param_coordinator.py:
    `__max_ongoing_fetch_events = 2`, then `event.synchronize()` on the oldest), so a unit takes
    the longer of its kernels and its hooks (`timing`). Per unit, not per module: a unit whose
    kernels outlast its hooks hides them all, optimistic where its modules differ; modules
    without parameters (Hugging Face's attention and MLP containers, the activation) are not
    counted (docs/formulas.md section 6)."""
    n = len(sc.units)
    if not ds_zero3(sc, st):
        return [0.0] * n, [0.0] * n
    a = sc.assume
    fwd, bwd = [], []
    for u in sc.units:
        mods, again = ds_hooked_modules(sc, u)
        fwd.append(mods * a.deepspeed_hook_forward_s)
        bwd.append(mods * a.deepspeed_hook_backward_s + again * a.deepspeed_hook_forward_s)
    return fwd, bwd


_OPS_CACHE = PinnedMemo()


def _ops_key(sc: Scenario) -> tuple:
    # GPUSpec holds dicts (unhashable): keyed on its identity, pinned by the entry (PinnedMemo)
    return (id(sc.hw.gpu), sc.model, sc.train, sc.assume.loss_fp32)


def _wrapped_in(sc: Scenario, u, wrapped: tuple[bool, ...] | None = None) -> int:
    """How many of the unit's blocks every-k or first-k wraps (0 under the other modes): units
    alike but for their position differ only by it. `wrapped`: policy.wrapped_blocks, where the
    caller has it for every unit."""
    t = sc.train
    if t.checkpointing not in policy.PARTIAL_CHECKPOINTING or not u.blocks:
        return 0
    wrapped = wrapped or policy.wrapped_blocks(t, sc.model.num_layers)
    return sum(wrapped[u.first_block: u.first_block + u.blocks])


def _unit_op_seconds(sc: Scenario, u, base: tuple) -> tuple[float, float, dict[str, float], float]:
    """Forward, backward + recompute seconds of one unit's own kernels (no FSDP copies), by
    kind, and all of them beside a collective; cached across strategies and searches: they
    depend only on the model, the training and the GPU."""
    key = base + (u.blocks, u.name if not u.blocks else "", _wrapped_in(sc, u))

    def make() -> tuple[float, float, dict[str, float], float]:
        f_ops = unit_ops.unit_ops(sc, u, False)
        b_ops = unit_ops.unit_ops(sc, u, True)
        r_ops, r_n = unit_ops.recompute_ops(sc, u)
        k = K.by_kind(f_ops + b_ops)
        k["recompute"] = r_n * K.total(r_ops)
        beside = K.total_contended(f_ops + b_ops) + r_n * K.total_contended(r_ops)
        return K.total(f_ops), K.total(b_ops) + k["recompute"], k, beside
    return _OPS_CACHE.get(key, sc.hw.gpu, make)


def _overlap(sc: Scenario, fwd: list[float], bwd: list[float],
             comms: list[UnitComm], with_reduce: bool) -> list[UnitOverlap]:
    """Exposed communication per unit for one micro-batch.

    A held root that holds the head (tied embeddings, `embed_head_unit` root, root-kept or
    head-root-kept) runs its compute at the other end of the step from its place as unit 0: its
    embedding lookup (taken as no time) first in forward, its norm + head last; in backward the
    head first and the embedding's gradient last (FSDP2's root; memory_timeline.py orders it the
    same). So unit 1's gather has nothing to hide behind, the last block's re-gather hides behind
    the head's backward (the root's own re-gather, where it reshards, is exposed instead), and
    unit 1's reduce-scatter is exposed beside the embedding's backward. Unit 1 is the first
    block's, or under head-root-kept the embeddings' own unit (its lookup no time either: the
    first block's gather and reduce-scatter go bare beside it)."""
    k = len(fwd)
    ov = sc.assume.overlap and sc.train.prefetch
    root_head = sc.units[0].held and k > 1
    gather = [c.all_gather_s + c.h2d_s for c in comms]
    again = [c.backward_gather_s + c.backward_h2d_s for c in comms]
    red = [c.reduce_s if with_reduce else 0.0 for c in comms]
    out = []
    for i in range(k):
        c = comms[i]
        ag = gather[i]
        # forward: my gather runs beside the previous unit's forward (the first has nothing)
        before = 0.0 if (root_head and i == 1) else (fwd[i - 1] if i > 0 else 0.0)
        f_exp = max(0.0, ag - before) if (ov and i > 0) else ag
        # backward (reverse order): beside my backward run the gather of unit i-1 and the
        # reduce-scatter of unit i+1; the last reduce-scatter (unit 0) has nothing to hide behind
        nxt = comms[i - 1] if i > 0 else None
        prefetched = nxt and nxt.gathers_in_backward and not nxt.gathers_for_recompute
        bg = again[i - 1] if (prefetched and not (root_head and i == 1)) else 0.0
        if root_head and i == 0:
            # beside the head's backward: the last block's re-gather; beside the embedding's
            # (no time): the first block's reduce-scatter
            last = comms[k - 1]
            hide = again[k - 1] if (last.gathers_in_backward and not last.gathers_for_recompute) else 0.0
            b_exp = (max(0.0, hide - bwd[0]) if ov else hide) + red[1] + red[0]
            if c.gathers_in_backward:  # the root is gathered again before the head's backward
                b_exp += again[i]
        elif c.gathers_for_recompute:
            # FSDP1 prefetches in backward only a unit whose forward registered its pre-backward
            # hook, and one under a reentrant checkpoint ran without grad: both of its backward
            # gathers are issued on demand on the communicator, after the next unit's
            # reduce-scatter. The recompute waits for the first with nothing beside it; the
            # second runs beside the recompute's forward (policy.regathers_for_recompute)
            b_exp = (red[i + 1] if i + 1 < k else 0.0) + ag + \
                (max(0.0, again[i] - fwd[i]) if ov else again[i])
            if i == 0:
                b_exp += red[0]
        else:
            busy = bg + (red[i + 1] if i + 1 < k else 0.0)
            b_exp = max(0.0, busy - bwd[i]) if ov else busy
            if i == 0:
                b_exp += red[0]
            if i == k - 1 and c.gathers_in_backward and not root_head:
                b_exp += again[i]  # backward begins by re-gathering the last unit
        out.append(UnitOverlap(c.name, fwd[i], bwd[i], ag, red[i], f_exp, b_exp,
                               f_exp <= 1e-12, b_exp <= 1e-12))
    return out


def _optimizer_s(sc: Scenario, st: Strategy, mem: Memory) -> float:
    if st.offload_optimizer:  # the CPU runs the step: offload_s
        return 0.0
    if not uses_kernel_model(sc):
        # memory-bound: reads and writes every byte of the local state once; Muon's
        # Newton-Schulz at the efficiency's FLOP rate on the rank that runs the most
        local = mem.params_bytes + mem.grads_bytes + mem.master_bytes + mem.optimizer_bytes
        ns = 0.0
        if sc.train.optimizer == "muon":
            D = sc.shard_degree(st.hsdp) if st.optim_sharded else 1
            ns = max(muon.newton_schulz_flop(h[3]) for h in muon.holdings(sc, st.name, D)) / _flop_rate(sc)
        return 2 * local / sc.hw.gpu.hbm_bytes_per_s + ns
    return K.total(optimizer_ops(sc, st))


def optimizer_ops(sc: Scenario, st: Strategy) -> list[K.Op]:
    """The GPU kernels of one optimizer step on one rank (none when the CPU runs it: offload_s)."""
    if st.offload_optimizer:
        return []
    D = sc.shard_degree(st.hsdp) if st.optim_sharded else 1
    steps = optimizer_tensor_sizes(sc, D, zero1=st.name == "zero1")
    # the torch layout clips every local gradient: full under ddp and zero1 (DDP's gradients);
    # DeepSpeed clips its flat fp32 partition
    Dg = sc.shard_degree(st.hsdp) if st.grads_sharded else 1
    grads = None if sc.train.layout == "zero" else optimizer_tensor_sizes(sc, Dg)
    if sc.train.optimizer == "muon":  # Muon over the blocks' matrices, AdamW over the rest:
        # the slowest rank's step (ZeroRedundancyOptimizer's ranks run different matrices)
        return max((unit_ops.optimizer_ops(sc, steps, grads, muon_split=h)
                    for h in muon.holdings(sc, st.name, D)), key=K.total)
    return unit_ops.optimizer_ops(sc, steps, grads)


def mfu_peak_flops(sc: Scenario) -> float:
    """The dense peak MFU is taken against: the parameters' dtype's, the dtype the matmuls compute
    in; under float8 never below bf16's, torchtitan's convention for float8 runs (MFU against the
    bf16 peak: torchtitan/tools/utils.py get_peak_flops): fp32 parameters with float8 linears
    read 220% of the fp32 (non-tensor-core) peak, their GEMMs running at float8's."""
    gpu, t = sc.hw.gpu, sc.train
    peak = gpu.flops(t.precision.param)
    return max(peak, gpu.flops("bf16")) if t.float8 else peak


def timing(sc: Scenario, st: Strategy, mem: Memory, colls: list[Collective]) -> Timing:
    """One optimizer step's time (docs/formulas.md section 6): grad_accum micro-batches of
    per-op kernel time (unit_seconds), plus the communication nothing hides (FSDP-style: each
    unit's all-gather against the previous unit's compute, its reduce-scatter against the next
    one's backward, `_overlap`; DDP-style: the final gradient bucket and what does not fit
    beside backward, then the weights' all-gather), plus the optimizer step on this rank's
    state, the CPU step and host copies under offload, the compute lost beside the collectives
    it hides (the preset's measured collective_slowdown, PyTorch PR 172714), and the slowest of
    N ranks' GPU (expected maximum of N normal draws at the preset's rank_speed_spread). MFU:
    model FLOPs (PaLM appendix B) over the step at the bf16 dense peak under float8
    (torchtitan's convention), else the compute dtype's."""
    sc = sc.for_strategy(st.fsdp)
    t, m = sc.train, sc.model
    fwd, bwd, kinds, beside = unit_seconds(sc, st)
    A = t.grad_accum
    mb_compute = sum(fwd) + sum(bwd)  # the median GPU's
    k = sc.hw.gpu.kernels
    kernels = k is not None and uses_kernel_model(sc)
    # the slowest rank paces the step (kernels.slowest_rank_factor): the overlap of each unit's
    # collectives is with its compute, whose extra time hides what communication it can
    f = K.slowest_rank_factor(k, sc.n) if kernels else 1.0
    fwd, bwd = [x * f for x in fwd], [x * f for x in bwd]
    # DeepSpeed ZeRO-3's hooks pace a unit whose kernels (the slowest rank's) take less: the
    # wait, per micro-batch, runs beside no collective's contention (host_seconds)
    h_fwd, h_bwd = host_seconds(sc, st)
    wait = (sum(max(0.0, h - x) for h, x in zip(h_fwd, fwd))
            + sum(max(0.0, h - x) for h, x in zip(h_bwd, bwd)))
    if wait:
        fwd, bwd = [max(x, h) for x, h in zip(fwd, h_fwd)], [max(x, h) for x, h in zip(bwd, h_bwd)]
        beside += wait
    overlaps: list[UnitOverlap] = []
    comm_total = 0.0  # seconds of collectives that run beside compute, per step
    copies = 0.0  # of which host->GPU copies (offload-all): copy engines, no SMs taken
    if st.fsdp:
        comms = unit_comm(sc, st)
        last = _overlap(sc, fwd, bwd, comms, with_reduce=True)
        quiet = _overlap(sc, fwd, bwd, comms, with_reduce=t.reduce_every_microbatch)
        exp_last = sum(u.forward_exposed_s + u.backward_exposed_s for u in last)
        exp_quiet = sum(u.forward_exposed_s + u.backward_exposed_s for u in quiet)
        exposed = exp_last + (A - 1) * exp_quiet
        for ov in (last, quiet):
            mult = 1 if ov is last else A - 1
            # u.all_gather_s: the gather with its host->GPU copy (offload-all); again in backward
            comm_total += mult * sum(u.all_gather_s * (1 + c.gathers_for_recompute) + c.backward_gather_s
                                     + c.backward_h2d_s + u.reduce_s
                                     for u, c in zip(ov, comms))
            copies += mult * sum(c.h2d_s * (1 + c.gathers_for_recompute) + c.backward_h2d_s for c in comms)
        whole = sum(c.seconds_per_call for c in colls if c.name == WHOLE_MATRIX)
        exposed += whole  # Muon's gathers in the optimizer step: beside nothing
        comm_total += whole
        overlaps = last
    else:
        # DDP-style: gradient buckets reduce during backward; the last bucket and whatever does
        # not fit beside backward are exposed; the weight all-gather after the step is exposed.
        exposed = 0.0
        after = reduces_after_backward(st.name, t.layout)  # DeepSpeed stage 0
        for c in colls:
            if c.op not in ("all_reduce", "reduce_scatter", "reduce"):
                continue
            per = c.seconds_per_call
            last_bucket = c.last_bucket_s or per  # backward's end waits for the final bucket
            call = max(last_bucket, per - sum(bwd)) if (sc.assume.overlap and not after) else per
            exposed += c.calls_per_step * call
            comm_total += c.calls_per_step * per
        gathers = sum(c.seconds_per_step for c in colls if c.op == "all_gather")
        exposed += gathers  # after the step, nothing beside them: exposed, and none of them hidden
        comm_total += gathers
    hidden = max(0.0, comm_total - exposed) if sc.assume.overlap else 0.0
    if comm_total > 0:
        hidden *= 1 - copies / comm_total  # NCCL's share of what hides: the copies run on copy
        # engines, no SMs (their HBM traffic, which copy-engine all-gathers measure, is not charged)
    # compute beside a collective runs at mb_compute / beside of its pace (the micro-batch's mix
    # of kernels, each Op's contended_s: GEMMs by their waves over the SMs left, every kernel at
    # least the preset's measured collective_slowdown): that share of the hidden time is lost
    slow = max(0.0, 1 - (mb_compute + wait) / beside) if (kernels and beside > 0) else 0.0  # >= 0: rounding
    contention = hidden * slow
    opt_s = _optimizer_s(sc, st, mem)
    offload_s = 0.0
    if st.offload_optimizer:
        ranks = min(sc.n, sc.hw.cluster.gpus_per_node)
        shard = sum(sc.shard_elems(u, sc.shard_degree(st.hsdp)) for u in sc.units)
        offload_s = (shard * cpu_optimizer_bytes_per_param(t) / CPU_ADAM_REFERENCE_BYTES
                     / (sc.hw.cluster.cpu_adam_params_per_s / ranks))
        offload_s += sum(c.seconds_per_step for c in colls
                         if c.op in ("d2h",) or (c.op == "h2d" and not st.offload_params))
    # the slowest rank's compute, optimizer step and contention beyond the median GPU's (the
    # exposed communication above is already what its slower compute leaves exposed)
    slowest = (A * mb_compute + opt_s + contention) * (f - 1)
    step = A * (mb_compute + wait) + exposed + opt_s + offload_s + contention + slowest
    tokens = t.micro_batch * t.seq_len * A
    flop = arch.model_flop_per_token(m, t.seq_len) * tokens
    peak = mfu_peak_flops(sc)
    breakdown = {name: A * v for name, v in kinds.items()}
    if wait:
        breakdown["host"] = A * wait
    breakdown.update(optimizer=opt_s, contention=contention)
    if kernels:
        breakdown["slowest_rank"] = slowest
    return Timing(
        compute_s=A * (mb_compute + wait),
        exposed_comm_s=exposed,
        optimizer_s=opt_s,
        offload_s=offload_s,
        step_s=step,
        tokens_per_s_per_gpu=tokens / step,
        mfu=flop / (step * peak),
        units=overlaps,
        contention_s=contention,
        contention_share=slow,
        breakdown_s=breakdown,
        slowest_rank_s=slowest,
    )
