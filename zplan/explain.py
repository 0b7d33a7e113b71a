"""`zplan explain`: one strategy's figures derived step by step with the user's numbers.

Each line states a formula of docs/formulas.md, then the numbers, then the result, so a reader
can check it by hand. The figures come from the same cost models as estimate (no second copy of
the arithmetic): this module only prints their inputs beside their outputs.
"""

from __future__ import annotations

from . import arch
from .estimate import estimate_one
from .scenario import Scenario
from .units import DTYPE_BITS, GB, fmt_s


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
        out.append(f"{label:16s} = {count:,} elements{' (sharded)' if sharded else ''} -> {_gb(val)}")
    out.append(f"model state      = {_gb(mem.model_state_bytes)}  (= {mem.model_state_bytes / max(1, psi):.3f} bytes/param;"
               f" padding costs {_gb(mem.padding_bytes)})")
    if mem.host_bytes_per_rank:
        out.append(f"in host RAM      = {_gb(mem.host_bytes_per_rank)} per rank x "
                   f"{min(N, hw.cluster.gpus_per_node)} ranks = {_gb(mem.host_bytes_per_node)} per node "
                   f"of {_gb(hw.cluster.host_ram_bytes)}")
    out.append("")
    out.append("## 3. Buffers")
    if st.fsdp:
        big = max(sc.padded_elems(u, D) for u in us)
        how = ("all units stay gathered from forward to backward" if not st.reshard_after_forward
               else "current + prefetched unit" if t.prefetch else "one unit at a time")
        out.append(f"gathered weights ({how}) x {b(p.param)} B = {_gb(mem.gather_buffer_bytes)}")
        out.append(f"reduce: largest unit {big:,} x ({b(p.param)} B grad + {b(p.reduce)} B reduce-scatter input) = {_gb(mem.reduce_buffer_bytes)}")
    else:
        out.append(f"working copy of the weights = {_gb(mem.gather_buffer_bytes)}; buckets = {_gb(mem.reduce_buffer_bytes)}")
    if mem.accum_grad_bytes:
        out.append(f"unsharded grads kept across micro-batches: Ψ x {b(p.reduce)} B = {_gb(mem.accum_grad_bytes)}")
    out.append("")
    out.append(f"## 4. Activations (s={t.seq_len}, b={t.micro_batch}, h={m.hidden}, {t.checkpointing} checkpointing)")
    for k, v in arch.block_activation_terms(m, t).items():
        out.append(f"  per block, {k:24s} {_gb(v)}")
    per = arch.block_saved_bytes(m, t, t.checkpointing if t.checkpointing != "every-k" else "none")
    out.append(f"  kept per block under '{t.checkpointing}': {_gb(per)}")
    for k, v in arch.activation_breakdown(m, t, sc.assume.loss_fp32).items():
        out.append(f"  {k:30s} {_gb(v)}")
    out.append("")
    out.append("## 5. Total")
    out.append(f"tensors + overhead (CUDA context {_gb(sc.assume.cuda_context_bytes)} + "
               f"{sc.assume.fragmentation:.0%} fragmentation) = {_gb(mem.total_bytes)} of "
               f"{_gb(hw.gpu.memory_bytes)}: {'fits' if r.fits else 'does NOT fit'}")
    out.append("")
    out.append("## 6. Communication per step: t = S(n-1)/(n busbw) + (n-1)α, doubled for all-reduce")
    for c in r.collectives:
        if c.op in ("h2d", "d2h"):
            out.append(f"{c.name}: {c.elements:,} x {c.dtype}, {c.calls_per_step} per step, {fmt_s(c.seconds_per_call)} each")
            continue
        out.append(f"{c.name}: S = {c.elements:,} x {c.dtype} over n = {c.group_size} ({c.scope}), "
                   f"{c.calls_per_step} per step -> {fmt_s(c.seconds_per_call)} each")
    out.append(f"elements per step = {r.elements_per_step:,} = {r.elements_per_step / psi:.4f} Ψ; "
               f"bytes = {_gb(r.bytes_per_step)}")
    out.append("")
    tm = r.timing
    rate = hw.gpu.flops(p.param) * sc.assume.compute_efficiency
    out.append(f"## 7. Compute at {hw.gpu.flops(p.param) / 1e12:,.0f} TFLOP/s x {sc.assume.compute_efficiency} = {rate / 1e12:,.0f} TFLOP/s")
    if len(us) > 1:
        u = us[1] if len(us) > 2 else us[0]
        f = arch.unit_forward_flop(m, u, t)
        out.append(f"unit {u.name}: forward 2 x {u.matmul_params:,} x {t.seq_len * t.micro_batch} tokens "
                   f"+ attention = {f / 1e12:.3f} TFLOP -> {fmt_s(f / rate)}; backward 2x")
        if tm.units:
            o = tm.units[1 if len(tm.units) > 2 else 0]
            out.append(f"  its all-gather {fmt_s(o.all_gather_s)} vs the previous unit's forward: "
                       f"{'hidden' if o.forward_hidden else 'exposed ' + fmt_s(o.forward_exposed_s)}")
    out.append(f"step = {t.grad_accum} x compute + exposed comm + optimizer + offload = "
               f"{fmt_s(tm.compute_s)} + {fmt_s(tm.exposed_comm_s)} + {fmt_s(tm.optimizer_s)} + "
               f"{fmt_s(tm.offload_s)} = {fmt_s(tm.step_s)}")
    out.append(f"tokens/s per GPU = {t.micro_batch * t.seq_len * t.grad_accum} / step = {tm.tokens_per_s_per_gpu:,.0f}; "
               f"MFU = {tm.mfu:.1%}")
    return out
