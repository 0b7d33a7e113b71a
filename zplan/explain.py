"""`zplan explain`: one strategy's figures derived step by step with the user's numbers.

Each line states a formula of docs/formulas.md, then the numbers, then the result, so a reader
can check it by hand. The figures come from the same cost models as estimate (no second copy of
the arithmetic): this module only prints their inputs beside their outputs.
"""

from __future__ import annotations

from . import activation_memory, arch
from . import kernels as K
from . import nccl, policy
from . import unit_ops
from .comm import ds_hooked_modules, ds_zero3, gather_dtype
from .compute import CPU_ADAM_REFERENCE_BYTES, cpu_optimizer_bytes_per_param, optimizer_ops, uses_kernel_model
from .estimate import TIGHT_FREE_FRACTION, estimate_one
from .deepspeed import reduce_stream_bytes
from .scenario import Scenario
from .units import DTYPE_BITS, GB, fmt_s, nbytes


def _gb(b: int) -> str:
    return f"{b / GB:,.3f} GB"


def explain_lines(sc: Scenario, name: str) -> list[str]:
    r = estimate_one(sc, name)
    m, t, p, hw = sc.model, sc.train, sc.train.precision, sc.hw
    psi, N = sc.params, sc.n
    out = [f"# {name} for {m.name} on {N} x {hw.gpu.name} ({hw.cluster.name}), layout {t.layout}",
           "Sizes in GB = 10^9 bytes. Formulas: docs/formulas.md.", ""]
    if r.unavailable:
        return out + [f"{name} is unavailable: {r.unavailable}"]
    mem, st = r.memory, r.strategy
    sc = sc.for_strategy(st.fsdp)  # what the strategy is priced on (DDP: its own units, autocast)
    m, t, p = sc.model, sc.train, sc.train.precision
    D = sc.shard_degree(st.hsdp)
    out.append("## 1. Parameters")
    us = sc.units
    out.append(f"Ψ = Σ units = {' + '.join(f'{u.numel:,}' for u in us[:3])}"
               f"{' + ...' if len(us) > 3 else ''} = {psi:,}  ({len(us)} units)")
    shard = sum(sc.shard_elems(u, D) for u in us)
    out.append(f"sharding degree D = {D}; per-rank shard = Σ ⌈unit / D⌉ = {shard:,} elements "
               f"(padding {shard * D - psi:,} elements in all)")
    out.append("")
    out.append("## 2. Model state per GPU")
    b = lambda d: DTYPE_BITS[d] // 8  # noqa: E731
    for label, val, sharded in (("weights", mem.params_bytes, st.params_sharded),
                                ("gradients", mem.grads_bytes, st.grads_sharded),
                                ("master weights", mem.master_bytes, st.optim_sharded),
                                ("optimizer state", mem.optimizer_bytes, st.optim_sharded)):
        count = shard if sharded else psi
        offloaded = st.offload_params if label == "weights" else st.offload_optimizer
        where = " (on the host: offload)" if offloaded and val == 0 else ""
        out.append(f"{label:16s} = {count:,} elements{' (sharded)' if sharded else ''} -> {_gb(val)}{where}")
    if t.optimizer == "muon" and not st.offload_optimizer:
        from . import muon
        from .memory import muon_state_bytes
        h = max(muon.holdings(sc, st.name, D if st.optim_sharded else 1),
                key=lambda h: muon_state_bytes(h, p.optimizer))
        out.append(f"  of which Muon's momentum for the blocks' matrices {h[0]:,} x {b(p.optimizer)} B, "
                   f"AdamW's two states for the rest {sum(h[2]):,} x {2 * b(p.optimizer)} B (zplan/muon.py)")
    out.append(f"model state      = {_gb(mem.model_state_bytes)}  (= {mem.model_state_bytes / max(1, psi):.3f} bytes/param;"
               f" padding costs {_gb(mem.padding_bytes)})")
    if mem.host_bytes_per_rank:
        out.append(f"in host RAM      = {_gb(mem.host_bytes_per_rank)} per rank x "
                   f"{min(N, hw.cluster.gpus_per_node)} ranks = {_gb(mem.host_bytes_per_node)} per node "
                   f"of {_gb(hw.cluster.host_ram_bytes)}")
    out.append("")
    out.append("## 3. Buffers")
    if st.fsdp and t.layout == "zero" and t.deepspeed_defaults and st.reshard_after_forward:
        out.append(f"gathered weights (DeepSpeed's defaults: every module's hook prefetches until 1e9 "
                   f"elements are live, overshooting by the largest parameter) x {b(p.param)} B = "
                   f"{_gb(mem.gather_buffer_bytes)}")
        out.append(f"reduce: the 5e8-element bucket x {b(p.reduce)} B + the largest parameter's gradient "
                   f"x {b(p.param)} B = {_gb(mem.reduce_buffer_bytes)}")
        stream = reduce_stream_bytes(sc.for_strategy(st.fsdp), st)
        if stream:
            out.append(f"reduce stream (overlap_comm), reserved beside the step: a bucket's flat copy in "
                       f"reduce_scatter_coalesced{' + a gradient partition in the param and master dtypes (offload)' if st.offload_optimizer else ''}"
                       f" = {_gb(stream)}")
    elif st.fsdp:
        big = max(sc.padded_elems(u, D) for u in us)
        how = ("all units stay gathered from forward to backward" if not st.reshard_after_forward
               else "current + prefetched unit" if t.prefetch else "one unit at a time")
        out.append(f"gathered weights live at the peak ({how}) x {b(p.param)} B = {_gb(mem.gather_buffer_bytes)} "
                   f"(at the peak's phase, {mem.peak_phase}; a whole unit's, the largest: {_gb(big * b(p.param))})")
        whole = big * (b(p.param) + b(p.reduce))
        out.append(f"reduce: unsharded gradients + reduce-scatter inputs live at the peak = {_gb(mem.reduce_buffer_bytes)} "
                   f"(a whole unit's, the largest: {big:,} x ({b(p.param)} B grad + {b(p.reduce)} B reduce-scatter "
                   f"input) = {_gb(whole)})")
    else:
        out.append(f"working copy of the weights = {_gb(mem.gather_buffer_bytes)}; buckets = {_gb(mem.reduce_buffer_bytes)}")
    if mem.accum_grad_bytes:
        if st.grads_sharded:
            out.append(f"unsharded grads kept across micro-batches: Ψ x {b(p.reduce)} B = {_gb(mem.accum_grad_bytes)}")
        else:  # DDP under no_sync: .grad tensors of their own beside the buckets
            out.append(f"gradients accumulated under no_sync beside the buckets: Ψ x {b(p.master)} B = "
                       f"{_gb(mem.accum_grad_bytes)}")
    out.append("")
    out.append(f"## 4. Activations (s={t.seq_len}, b={t.micro_batch}, h={m.hidden}, "
               f"{policy.checkpointing_label(t)} checkpointing)")
    for k, v in activation_memory.block_activation_terms(m, t).items():
        out.append(f"  per block, {k:24s} {_gb(v)}")
    if t.checkpointing in policy.PARTIAL_CHECKPOINTING:  # two kinds of block: wrapped or not
        wrapped = sum(policy.wrapped_blocks(t, m.num_layers))
        for mode, count in (("full", wrapped), ("none", m.num_layers - wrapped)):
            out.append(f"  kept per block, the {count} {'checkpointed' if mode == 'full' else 'not checkpointed'}: "
                       f"{_gb(activation_memory.block_saved_bytes(m, t, mode))}")
    else:
        out.append(f"  kept per block under '{t.checkpointing}': "
                   f"{_gb(activation_memory.block_saved_bytes(m, t, t.checkpointing))}")
    for k, v in activation_memory.activation_breakdown(m, t, sc.assume.loss_fp32).items():
        out.append(f"  {k:30s} {_gb(v)}")
    out.append("")
    out.append("## 5. Total")
    frag = sc.assume.fragmentation
    how = f"{frag:.0%} fragmentation (assumed)" if frag is not None else "caching-allocator model"
    out.append(f"peak at {mem.peak_event} ({mem.peak_phase}): allocated {_gb(mem.allocated_bytes)}, "
               f"reserved {_gb(mem.reserved_bytes)} ({how})")
    if mem.releasable_bytes and sc.assume.expandable_segments:
        out.append(f"of the reserve, {_gb(mem.releasable_bytes)} is whole pages inside blocks free at the peak "
                   "(the loss's blocks no later tensor of it fits): the allocator unmaps them "
                   "and retries before failing, so the fit counts the rest")
    elif mem.releasable_bytes:
        cached = mem.released_once_bytes
        out.append(f"of the reserve, {_gb(mem.releasable_bytes)} sits in segments wholly free at the peak "
                   "(the last checkpointed block's freed working set and weights, not the "
                   "holes beside what the blocks keep; the loss's blocks no later tensor of it "
                   "fits; all-gather "
                   "segments beyond the stream's peak"
                   + (f"; DeepSpeed's cached parameter blocks, {_gb(cached)} of them, released once "
                      "and never made again (docs/formulas.md section 3)" if cached else "")
                   + "): the allocator releases them and retries before failing, so the fit counts the rest")
    if mem.step_temp_bytes:
        out.append(f"of the allocated peak, {_gb(mem.step_temp_bytes)} is the optimizer step's temporaries")
    out.append(f"reserved + CUDA context {_gb(sc.assume.cuda_context_bytes)} = {_gb(mem.total_bytes)} of "
               f"{_gb(hw.gpu.memory_bytes)}: {'fits' if r.fits else 'does NOT fit'}"
               + (f" (tight: under {TIGHT_FREE_FRACTION:.0%} free, inside the memory model's error)"
                  if r.tight else ""))
    out.append("")
    out.append("## 6. Communication per step, as NCCL runs it (zplan/nccl.py): per call t = latency + "
               "S(n-1)/(n busbw), twice the volume for all-reduce, S/busbw for a reduce; FSDP one call per unit, "
               "DeepSpeed's ZeRO-3 each fetch and prefetch of its coordinator, DDP and DeepSpeed's ZeRO-1/2 per bucket")
    for c in r.collectives:
        if c.op in ("h2d", "d2h"):
            out.append(f"{c.name}: {c.elements:,} x {c.dtype}, {c.calls_per_step} per step, {fmt_s(c.seconds_per_call)} each")
            continue
        out.append(f"{c.name}: S = {c.elements:,} x {c.dtype} over n = {c.group_size} ({c.scope}), "
                   f"{c.calls_per_step} per step -> {fmt_s(c.seconds_per_call)} each")
    out += _nccl_lines(sc, st, D, r.collectives)
    out.append(f"elements per step = {r.elements_per_step:,} = {r.elements_per_step / psi:.4f} Ψ; "
               f"bytes = {_gb(r.bytes_per_step)}")
    out.append("")
    tm = r.timing
    out += _compute_lines(sc, r)
    k = sc.hw.gpu.kernels
    if tm.slowest_rank_s:
        out.append(f"slowest of {sc.n} ranks: GPU speeds spread {k.rank_speed_spread:.2%} (one standard "
                   f"deviation) around the median GPU; the slowest is {K.expected_max_normal(sc.n):.2f} "
                   f"standard deviations slower (the expected maximum of {sc.n} normal draws) and paces "
                   f"every step: (compute + optimizer + contention) x {K.slowest_rank_factor(k, sc.n) - 1:.2%}, "
                   f"its slower compute also in the overlap above")
    out.append(f"step = {t.grad_accum} x compute + exposed comm + optimizer + offload + contention + slowest rank = "
               f"{fmt_s(tm.compute_s)} + {fmt_s(tm.exposed_comm_s)} + {fmt_s(tm.optimizer_s)} + "
               f"{fmt_s(tm.offload_s)} + {fmt_s(tm.contention_s)} + {fmt_s(tm.slowest_rank_s)} = {fmt_s(tm.step_s)}")
    out.append(f"tokens/s per GPU = {t.micro_batch * t.seq_len * t.grad_accum} / step = {tm.tokens_per_s_per_gpu:,.0f}; "
               f"MFU = {tm.mfu:.1%}")
    return out


def _compute_lines(sc: Scenario, r) -> list[str]:
    """Section 7: the kernels of one block (or the FLOP rate of --efficiency) and the step's
    seconds by kind of op."""
    m, t, hw = sc.model, sc.train, sc.hw
    us, tm = sc.units, r.timing
    b0 = next((i for i, x in enumerate(us) if x.blocks), 0)  # the first block's unit
    u = us[b0]
    if not uses_kernel_model(sc):
        eff = sc.assume.compute_efficiency or 1.0
        rate = hw.gpu.flops(t.precision.param) * eff
        out = [f"## 7. Compute at {hw.gpu.flops(t.precision.param) / 1e12:,.0f} TFLOP/s x {eff} = "
               f"{rate / 1e12:,.0f} TFLOP/s (one assumed efficiency)"]
        f = arch.unit_forward_flop(m, u, t)
        out.append(f"unit {u.name}: forward 2 x {u.matmul_params:,} x {t.seq_len * t.micro_batch} tokens "
                   f"+ attention = {f / 1e12:.3f} TFLOP -> {fmt_s(f / rate)}; backward 2x")
    else:
        k = hw.gpu.kernels
        if t.flash_attention:
            a_f, a_b = K.attention_rates(hw.gpu, t.attention_kernel, m.head_dim, t.precision.param)
            attn = (f"attention ({t.attention_kernel}) {a_f / 1e12:,.0f}/{a_b / 1e12:,.0f} TFLOP/s "
                    f"fwd/bwd x s/(s+{K.attention_half_seq(hw.gpu, t.attention_kernel):g})")
        else:
            attn = "attention as GEMMs + softmax (no flash kernel)"
        fixed = (f" + {k.gemm_fixed_s * 1e6:g} us each" if k.gemm_fixed_s else "") + (
            f" + {k.gemm_wave_s * 1e6:g} us per wave" if k.gemm_wave_s else "")
        out = [f"## 7. Compute from kernels (docs/formulas.md section 6): GEMM {K.gemm_rate(hw.gpu, k, t.precision.param) / 1e12:,.0f} "
               f"TFLOP/s x wave efficiency{fixed}, {attn}, "
               f"HBM {k.hbm_achieved_bytes_per_s / 1e9:,.0f} GB/s"
               + (f" (fused eager norms at {k.eager_norm_efficiency:.0%} of it, measured)"
                  if k.eager_norm_efficiency else "")
               + f", floor {k.kernel_floor_s * 1e6:g} us per kernel"]
        both = []
        for phase, backward in (("forward", False), ("backward", True)):
            ops = unit_ops.unit_ops(sc, u, backward)
            both += ops
            out.append(f"unit {u.name}, {phase}, one micro-batch of {t.seq_len * t.micro_batch} tokens:")
            once, n = _per_block(ops, u.blocks)
            if n > 1:
                out.append(f"  each of its {n} blocks:")
            for o in once:
                what = f"{o.flop / 1e9:,.1f} GFLOP" if o.flop else f"{o.bytes / 1e6:,.1f} MB"
                out.append(f"  {o.name:32s} {o.kind:9s} {what:>14s} x{o.kernels:<3d} -> {fmt_s(o.seconds)}")
            out.append(f"  = {fmt_s(K.total(ops))}")
        alone, beside = K.total(both), K.total_contended(both)
        measured = (f"; kernels {k.collective_slowdown:g}x as long at least, the slowdown measured "
                    f"beside a collective (launch floor and GEMMs' fixed time excepted)"
                    if k.collective_slowdown else "")
        out.append(f"beside a collective (NCCL holding {K.taken_sms(k)} of {k.sm_count} SMs: GEMMs in waves "
                   f"over the SMs left, other kernels at {k.sm_count - K.taken_sms(k)}/{k.sm_count} of "
                   f"their speed{measured}): this unit {fmt_s(alone)} -> {fmt_s(beside)}; over the step's kernels, "
                   f"contention charges {r.timing.contention_share:.1%} of the communication hidden")
        rec, n = unit_ops.recompute_ops(sc, u)
        if n:
            out.append(f"recompute ({t.checkpointing}): {n:g} x {fmt_s(K.total(rec))}")
        st = r.strategy
        if st.fsdp and t.layout == "torch":
            s2 = sc.for_strategy(True)
            cf, cb = unit_ops.fsdp_copies(s2, st, u, s2.shard_degree(st.hsdp), gather_dtype(s2, u))

            def listed(ops: list) -> str:
                return ", ".join(f"{o.name} {o.bytes / 1e6:,.1f} MB" for o in ops) or "none"
            out.append(f"{'FSDP1' if t.fsdp1 else 'FSDP2'}'s copies around unit {u.name}'s collectives "
                       f"(unit_ops.fsdp_copies): forward {listed(cf)}; backward {listed(cb)} -> "
                       f"{fmt_s(K.total(cf))} + {fmt_s(K.total(cb))}")
        opt = optimizer_ops(sc, r.strategy)
        if opt:
            out.append("optimizer step, this rank's state: " + "; ".join(
                f"{o.name} {o.bytes / 1e9:,.2f} GB x{o.kernels} -> {fmt_s(o.seconds)}" for o in opt))
    if r.strategy.offload_optimizer and tm.offload_s:
        rate = sc.hw.cluster.cpu_adam_params_per_s
        per = cpu_optimizer_bytes_per_param(t)
        out.append(f"CPU optimizer ({t.optimizer}): {per:g} B a parameter (3 x master + 2 x state) over the "
                   f"{CPU_ADAM_REFERENCE_BYTES} B at which the node's {rate:.3g} parameters/s were measured, "
                   f"shared by {min(sc.n, sc.hw.cluster.gpus_per_node)} ranks; with the host-link copies: "
                   f"offload {fmt_s(tm.offload_s)} per step")
    if tm.units:
        o = tm.units[b0]
        out.append(f"  its all-gather {fmt_s(o.all_gather_s)} vs the previous unit's forward: "
                   f"{'hidden' if o.forward_hidden else 'exposed ' + fmt_s(o.forward_exposed_s)}")
    if ds_zero3(sc, r.strategy):
        a = sc.assume
        n, again = ds_hooked_modules(sc, u)
        out.append(f"DeepSpeed ZeRO-3's hooks on the host: unit {u.name}'s {n} modules x "
                   f"{a.deepspeed_hook_forward_s * 1e3:g} ms forward"
                   + (f" (and {again} of them again in its recompute)" if again else "")
                   + f", x {a.deepspeed_hook_backward_s * 1e3:g} ms backward (--deepspeed-hook-forward-ms, "
                   f"--deepspeed-hook-backward-ms; measured on a CPU): the host, a few fetches ahead at most, "
                   f"paces a unit whose kernels take less; over the step "
                   f"{fmt_s(tm.breakdown_s.get('host', 0.0))} of waiting (kind 'host')")
    if tm.breakdown_s:
        out.append("per step by kind: " + ", ".join(f"{k_} {fmt_s(v)}" for k_, v in tm.breakdown_s.items()))
    return out


def _per_block(ops: list, blocks: int) -> tuple[list, int]:
    """A unit of n blocks runs one block's ops n times over (unit_ops): (one block's ops, n)."""
    if blocks > 1 and len(ops) % blocks == 0 and ops == ops[:len(ops) // blocks] * blocks:
        return ops[:len(ops) // blocks], blocks
    return ops, 1


def _nccl_lines(sc: Scenario, st, D: int, colls) -> list[str]:
    """How NCCL runs the largest single call of each of the step's collectives, as section 6
    prices them: the shape, size and description of that call come from comm.collectives (a
    unit, a bucket, a parameter), so this restates none of its rules. Identical calls (a unit's
    gather in forward and again in backward) get one line."""
    if sc.n <= 1:
        return []
    out: list[str] = []
    if st.fsdp and D <= 1:  # HSDP with --shard-size 1: each rank holds whole weights, nothing is gathered
        out.append("shard group of 1 rank: no all-gather (the weights are replicated, as under DDP)")
    seen: set[tuple] = set()
    for c in colls:
        if c.op in ("h2d", "d2h") or not c.moves or not c.call_bytes:
            continue
        key = (c.op, c.call_bytes, c.group_size, c.per_node)
        if key in seen:
            continue
        seen.add(key)
        out.append(_nccl_call(sc.hw.cluster, f"{c.name}, one call ({c.call})", c.op, c.call_bytes,
                              c.group_size, c.per_node))
    return out


def _nccl_call(c, what: str, op: str, b: int, n: int, g: int) -> str:
    """How NCCL runs one call: the group's shape, algorithm and protocol, busbw, and for the
    Simple ring and NVLS (t = latency + f·S(n-1)/(n·busbw); a reduce, S/busbw) the split of the time."""
    ct = nccl.collective_time(c, op, b, n, g)
    head = (f"{what}: {b / GB:,.3f} GB over {n} ranks, {g} per node ({ct.nodes} node(s)): "
            f"{ct.algorithm}/{ct.protocol}, busbw {ct.busbw_bytes_per_s / GB:,.0f} GB/s -> ")
    if ct.protocol != "Simple" or ct.algorithm not in ("ring", "nvls"):  # tree, LL: their own forms
        return head + f"{fmt_s(ct.seconds)} (docs/formulas.md section 5)"
    wire = (b if op == "reduce" else (2 if op == "all_reduce" else 1) * b * (n - 1) / n) / ct.busbw_bytes_per_s
    return head + f"latency {fmt_s(ct.seconds - wire)} + transfer {fmt_s(wire)} = {fmt_s(ct.seconds)}"
