"""`zplan calibrate`: measure this machine and write presets the planner can use.

Measures, on the device the trainer would use (a GPU, or one CPU thread as a torchrun rank has):
achievable matmul FLOP/s per dtype, memory bandwidth (a large copy), the node's CPU AdamW
throughput on all its CPUs together (for offload), and the bus bandwidth of all-gather,
reduce-scatter and all-reduce over message sizes (nccl-tests' definitions) between N local
processes (NCCL on GPUs, gloo on CPUs), and how much longer GEMMs take beside an all-gather
(the kernel model's collective_slowdown; written on GPUs). Writes
OUT/gpus/NAME.toml and OUT/clusters/NAME.toml; use them with --presets OUT --gpu NAME
--cluster NAME. The GPU preset is marked `measured`, so the efficiency assumption defaults to 1.
"""

from __future__ import annotations

import contextlib
import math
import os
import statistics
import tempfile
import time
from pathlib import Path

DTYPES = ("fp32", "bf16")


def _timeit(fn, device, reps: int, min_batch_s: float = 0.02, agree=None) -> float:
    """Seconds per call of `fn`: the median over `reps` batches of calls issued back to back
    between two device synchronisations, each batch long enough (`min_batch_s`) that the
    synchronisation and the first launch, tens of microseconds on a GPU, do not count in a
    kernel of a few (one call per sync would time a 5 us kernel at 35). The way nccl-tests and
    _gemm_seconds time, too. Where `fn` is a collective every rank must call it as often:
    `agree` turns this rank's batch size into the ranks' common one."""
    fn()  # warm up
    _sync(device)
    t0 = time.perf_counter()
    fn()
    _sync(device)
    once = time.perf_counter() - t0
    inner = _calls_per_batch(once, min_batch_s, 1, 1000)
    if agree is not None:
        inner = agree(inner)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for _ in range(inner):
            fn()
        _sync(device)
        times.append((time.perf_counter() - t0) / inner)
    return statistics.median(times)


def _calls_per_batch(once_s: float, min_batch_s: float, least: int, most: int) -> int:
    """How many calls of `once_s` each fill a batch of `min_batch_s` between two device
    synchronisations (the sync and the first launch, tens of microseconds, then do not count),
    within least..most."""
    return max(least, min(most, math.ceil(min_batch_s / max(once_s, 1e-9))))


def matmul_flops(device, sizes=None, reps: int = 5,
                 budget_s: float = 0.5) -> dict[str, dict[int, float]]:
    """Matmul FLOP/s per dtype and square size. Sizes grow until one product takes longer than
    `budget_s`: the rate has saturated by then, and a CPU without bf16 matrix units runs a bf16
    2048-cube product for about a minute (measured here: 62 s on one thread), which would make
    calibrate take minutes for a figure the smaller sizes already give. A GPU also runs 4096 and
    8192 cubes (a 2048 cube is tens of microseconds there, short of the saturated rate)."""
    import torch

    if sizes is None:
        sizes = (256, 512, 1024, 2048) + ((4096, 8192) if device.type == "cuda" else ())
    out: dict[str, dict[int, float]] = {}
    for name, dt in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        out[name] = {}
        w = torch.ones(64, 64, device=device, dtype=dt)
        w @ w  # library start-up (a cuBLAS handle, lazy module loading) is not a product's time
        _sync(device)
        for n in sizes:
            a = torch.randn(n, n, device=device, dtype=dt)
            b = torch.randn(n, n, device=device, dtype=dt)
            t0 = time.perf_counter()
            a @ b  # warm-up, and the probe of how long one product takes
            _sync(device)
            once = time.perf_counter() - t0
            if once > budget_s:  # long enough to time by itself; larger sizes would only be slower
                out[name][n] = 2 * n**3 / once
                break
            out[name][n] = 2 * n**3 / _timeit(lambda: a @ b, device, reps)
    return out


def memory_bandwidth(device, nbytes: int = 256 * 2**20, reps: int = 5) -> float:
    """Bytes per second of a large copy (read + write)."""
    import torch

    src = torch.empty(nbytes // 4, device=device)
    dst = torch.empty_like(src)
    t = _timeit(lambda: dst.copy_(src), device, reps)
    return 2 * nbytes / t


def adamw_params_per_s(n: int = 4_000_000, reps: int = 3, threads: int | None = None) -> float:
    """CPU AdamW throughput with the trainer's kernel (fused: zplan/trainer/parallel.py
    build_optimizer) on `threads` threads (None: as torch is set), the offload strategies'
    optimizer step. A node's figure is measured on all its usable CPUs at once, as the ranks of
    an offload-all run share them (zplan/trainer/run_setup.py host_threads): the step is
    memory-bound, so one thread's rate times the cores overstates a many-core node."""
    import torch

    before = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        p = torch.nn.Parameter(torch.randn(n))
        p.grad = torch.randn(n)
        opt = torch.optim.AdamW([p], fused=True)
        t = _timeit(opt.step, torch.device("cpu"), reps)
    finally:
        torch.set_num_threads(before)
    return n / t


def _overlap_times(device, dist, full, part, reps: int, agree=None) -> dict:
    """One all-gather (`part` into `full`) alone, GEMMs alone, and the two issued together (the
    all-gather asynchronous, on NCCL's stream or gloo's thread, the GEMMs on the current stream),
    seconds. The GEMMs are repeated until they take about twice the all-gather, so that the
    collective runs beside compute from start to end (collective_slowdown's rule)."""
    import torch

    from . import tensor_collectives

    dt = torch.bfloat16 if device.type == "cuda" else torch.float32
    n = 8192 if device.type == "cuda" else 256
    a = torch.randn(n, n, device=device, dtype=dt)
    b = torch.randn(n, n, device=device, dtype=dt)
    m_s = _timeit(lambda: tensor_collectives.all_gather(full, part), device, reps, agree=agree)
    one = _timeit(lambda: a @ b, device, reps)
    count = max(1, math.ceil(2 * m_s / one))
    if agree is not None:  # every rank computes beside the all-gather as long: the largest count
        count = agree(count)

    def gemms():
        for _ in range(count):
            a @ b

    def both():
        work = tensor_collectives.all_gather(full, part, async_op=True)
        gemms()
        work.wait()

    dist.barrier()
    c_s = _timeit(gemms, device, reps)
    dist.barrier()
    t_s = _timeit(both, device, reps, agree=agree)
    return {"collective_s": m_s, "gemm_s": c_s, "overlapped_s": t_s, "gemms": count, "n": n}


def slowdown_beside(collective_s: float, gemm_s: float, overlapped_s: float) -> float | None:
    """How many times longer compute runs beside a collective, from the three times of
    _overlap_times: compute.timing's rule, T = C + M (1 - 1/f) for a collective hidden under
    compute (C >= M), solved for f = M / (C + M - T); 1 where the overlap cost nothing, the
    field's cap 4 where nothing overlapped, None where the collective outlasted the compute (the
    rule does not apply)."""
    if gemm_s < collective_s or collective_s <= 0:
        return None
    lost = overlapped_s - gemm_s
    if lost <= 0:
        return 1.0
    if lost >= collective_s:
        return 4.0
    return min(4.0, collective_s / (collective_s - lost))


def _collective_worker(rank, world, init, sizes, reps, backend, out):
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    if backend == "nccl":
        torch.cuda.set_device(rank)
    device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
    # the bookkeeping all-reduce below is of CPU tensors: on GPUs gloo carries it beside NCCL
    from .trainer.distributed import init_process_group_for
    from . import tensor_collectives

    init_process_group_for(device, init_method=init, rank=rank, world_size=world)
    res = {"all_gather": {}, "reduce_scatter": {}, "all_reduce": {}, "overlap": {}}

    def agree(inner: int) -> int:  # the largest batch any rank asks for (a CPU tensor: gloo)
        k = torch.tensor([inner], dtype=torch.int64)
        dist.all_reduce(k, op=dist.ReduceOp.MAX)
        return int(k)

    try:
        for nbytes in sizes:
            n = max(world, nbytes // 4 // world * world)
            full = torch.ones(n, device=device)
            part = torch.ones(n // world, device=device)
            ops = {
                "all_gather": lambda: tensor_collectives.all_gather(full, part),
                "reduce_scatter": lambda: tensor_collectives.reduce_scatter(part, full),
                "all_reduce": lambda: dist.all_reduce(full),
            }
            for name, fn in ops.items():
                dist.barrier()
                t = _timeit(fn, device, reps, agree=agree)
                tt = torch.tensor([t], dtype=torch.float64)
                dist.all_reduce(tt, op=dist.ReduceOp.MAX)
                res[name][n * 4] = float(tt)
        # compute beside a collective, at the largest size (kernels.collective_slowdown)
        ov = _overlap_times(device, dist, full, part, reps, agree)
        tt = torch.tensor([ov["collective_s"], ov["gemm_s"], ov["overlapped_s"]], dtype=torch.float64)
        dist.all_reduce(tt, op=dist.ReduceOp.MAX)
        res["overlap"] = dict(ov, collective_s=float(tt[0]), gemm_s=float(tt[1]), overlapped_s=float(tt[2]),
                              nbytes=n * 4)
        # each rank's GEMM, all ranks at once as in a training step (kernels.slowest_rank_factor)
        dist.barrier()
        per = torch.zeros(world, dtype=torch.float64)
        per[rank] = _gemm_seconds(device, *((8192,) * 3 if device.type == "cuda" else (256,) * 3), 1.0)
        dist.all_reduce(per)
        res["gemm_per_rank_s"] = per.tolist()
        if rank == 0:
            torch.save(res, out)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    os._exit(0)  # as zplan.reference.selfcheck: skip gloo's teardown, which can abort


def rank_speed_spread(per_rank_s: list[float]) -> float | None:
    """The standard deviation of the ranks' GEMM times over their median (the preset's
    rank_speed_spread, as measured on Perlmutter: benchmarks/published/kernels/README.md), from
    one GEMM timed on every rank at once; None under 4 ranks, too few to say anything of a
    spread (with 8 the estimate itself is uncertain by about a quarter)."""
    import statistics

    if len(per_rank_s) < 4 or min(per_rank_s) <= 0:
        return None
    med = statistics.median(per_rank_s)
    return statistics.pstdev([t / med for t in per_rank_s])


def record_spread(kernels: dict, spread: float | None, world: int) -> None:
    """Put a measured rank_speed_spread into a preset's [kernels] table where it is the part's
    own: within the preset's bound of 10% (KernelSpec); above it a GPU of the node is throttled
    or shared, which the source says instead (a preset with it would not load)."""
    if spread is None:
        return
    if spread <= 0.1:
        kernels["rank_speed_spread"] = float(f"{spread:.3g}")
        kernels["source"] += f"; GPU speed spread: one 8192^3 GEMM on each of {world} GPUs at once"
    else:
        kernels["source"] += (f"; GPU speed spread measured {spread:.1%} over {world} GPUs, above the "
                              f"10% a healthy node shows (a throttled or shared GPU): not written")


def keep_identity(gpu: dict, base: str | None) -> None:
    """A measured GPU preset stays the part it was measured on: `base`, the preset of the GPU's
    own name (hardware.preset_for), decides which attention kernels run there and which GPU its
    plans are for (GPUSpec.family); and the float8 GEMM rate, which calibrate does not measure,
    is the base preset's achieved one (its [kernels] gemm_flops.fp8, from that preset's source),
    said so in the source. Without a base (a GPU zplan has no preset for) nothing is added."""
    if base is None:
        return
    from . import presets
    from .errors import UsageError

    gpu["base"] = base
    try:
        b = presets.gpu(base)
    except UsageError:  # a base without a preset file adds nothing more
        return
    fp8 = b.kernels.gemm_flops.get("fp8") if b.kernels is not None else None
    if fp8 and "fp8" not in gpu["peak_flops"]:
        gpu["peak_flops"]["fp8"] = fp8
        if "kernels" in gpu:
            gpu["kernels"]["gemm_flops"]["fp8"] = fp8
            gpu["kernels"]["source"] += f"; fp8 GEMM not measured: the {base} preset's achieved {fp8 / 1e12:.0f} TFLOP/s"


LINK_FIELDS = ("intra_node_busbw_bytes_per_s", "intra_node_allreduce_busbw_bytes_per_s", "intra_node_allreduce_gpus",
               "inter_node_busbw_bytes_per_s", "intra_node_latency_s", "inter_node_latency_s", "base_latency_s",
               "intra_node_ring_fill_s", "link", "ll_max_busbw_bytes_per_s", "tree_busbw_fraction")
# (net_overhead_s stays this host's: calibrate reads it from the CPU, hardware.nccl_net_overhead_s)

def one_gpu_links(cluster: dict, base: str | None, what: str = "GPU") -> None:
    """With one GPU no collective is measured: the cluster preset takes its link figures from
    the base GPU preset's own node (GPUSpec.cluster: hgx-h200 for an H200), said so in its source, so that a
    plan for more GPUs on it is priced on that node's links, not at this GPU's copy rate; its
    node shape stays this machine's (one GPU a node: more GPUs are more such nodes, on the
    stock cluster's network share). Without a stock cluster the source says the links are not
    measured."""
    from . import presets

    home = presets.home_cluster(presets.gpu(base)) if base is not None else None
    stock = presets.cluster(home) if home is not None else None
    if stock is None:
        cluster["source"] += f"; one {what}: no collective measured, the link figures are its copy rate"
        return
    for f in LINK_FIELDS:
        v = getattr(stock, f)
        if v is None:
            cluster.pop(f, None)
        else:
            cluster[f] = list(v) if isinstance(v, tuple) else v
    cluster["source"] += f"; one {what}: no collective measured, links as the {stock.name} preset's"


def collective_times(world: int, sizes: list[int], reps: int = 3, backend: str = "gloo") -> dict:
    """Seconds per collective per message size (bytes of the full tensor)."""
    import torch
    import torch.multiprocessing as mp

    from .netutil import free_port

    if backend == "nccl" and world > torch.cuda.device_count():
        from .errors import UsageError  # each rank takes GPU `rank`: one past the last is a CUDA error in a child

        raise UsageError(f"--ranks {world}: this machine shows {torch.cuda.device_count()} GPU(s); "
                         f"pass at most that many (one rank per GPU)")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    with tempfile.TemporaryDirectory() as d:
        out = str(Path(d) / "res.pt")
        mp.start_processes(_collective_worker,
                           args=(world, f"tcp://127.0.0.1:{free_port()}", sizes, reps, backend, out),
                           nprocs=world, join=True, start_method="spawn")
        return torch.load(out)


def fit_link(times: dict, world: int) -> tuple[float, float, dict]:
    """Bus bandwidth (nccl-tests: algbw x (n-1)/n, x 2(n-1)/n for all-reduce) at the largest
    messages, and the per-step latency that the smallest message implies."""
    busbw: dict = {}
    for op in ("all_gather", "reduce_scatter", "all_reduce"):
        per = times[op]
        f = (2 if op == "all_reduce" else 1) * (world - 1) / world
        busbw[op] = {s: s / t * f for s, t in per.items()}
    big = max(times["all_gather"])
    bw = statistics.median([busbw[op][big] for op in busbw])
    small = min(times["all_gather"])
    t_small = times["all_gather"][small]
    alpha = max(0.0, (t_small - small * (world - 1) / (world * bw)) / max(1, world - 1))
    return bw, alpha, busbw


def nvls_fields(busbw: dict, ring_bw: float, world: int) -> dict:
    """Cluster fields for an all-reduce faster than the node's ring: where NCCL ran NVLS (an
    NVSwitch node of more than 2 GPUs: nccl-tests on 8 H100 measure ~480 GB/s all-reduce busbw
    against ~360 all-gather), the all-reduce's own busbw at the largest message, measured over
    `world` GPUs (zplan/nccl.py scales it for smaller groups). fit_link's median of the three
    collectives is the ring's figure and would price such all-reduces a quarter slow. Nothing
    where the all-reduce is within 5% of the ring (no NVLS, PCIe, gloo)."""
    big = max(busbw["all_reduce"])
    ar = busbw["all_reduce"][big]
    if world <= 2 or ar <= 1.05 * ring_bw:
        return {}
    return {"intra_node_allreduce_busbw_bytes_per_s": float(f"{ar:.4g}"), "intra_node_allreduce_gpus": int(world)}


def _sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)  # the timed device, current or not


def _gemm_seconds(device, M: int, N: int, K: int, seconds: float, min_batch_s: float = 0.02) -> float:
    """Seconds per bf16 (M, K) x (K, N) GEMM, run back to back for `seconds`, synchronised once
    per batch of at least `min_batch_s` of GEMMs (as _timeit batches): a sync every few GEMMs
    would leave the device idle after each one, which a 14 us GEMM would count in full and the
    fit of gemm_fixed_s would take as the GEMM's own time."""
    import torch

    a = torch.randn(M, K, device=device, dtype=torch.bfloat16)
    b = torch.randn(K, N, device=device, dtype=torch.bfloat16)
    a @ b
    _sync(device)
    t0 = time.perf_counter()
    for _ in range(5):
        a @ b
    _sync(device)
    batch = _calls_per_batch((time.perf_counter() - t0) / 5, min_batch_s, 5, 100_000)
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        for _ in range(batch):
            a @ b
        _sync(device)
        n += batch
    return (time.perf_counter() - t0) / n


def gemm_rates(device, shapes=((8192, 8192, 8192), (4096, 4096, 4096), (16384, 4096, 4096),
                               (16384, 1024, 4096), (2048, 2048, 2048)), seconds: float = 2.0) -> dict:
    """Sustained bf16 FLOP/s per (M, N, K): each shape run back to back for `seconds`, so the
    GPU reaches its power-saturated clock (mamf-finder's MSMF, not a boost burst)."""
    return {(M, N, K): 2 * M * N * K / _gemm_seconds(device, M, N, K, seconds) for M, N, K in shapes}


# gemm_time_constants' sweep: output shapes of 2, 4 and 16 waves of 128 x 256 tiles on a 132-SM
# GPU (the first three are those of XLA's measured table that fill the SMs; docs/formulas.md
# section 6), each at every K.
GEMM_SWEEP_MN = ((2048, 4096), (4096, 2048), (4096, 4096), (8192, 8192))
GEMM_SWEEP_K = (256, 512, 1024, 2048, 4096)


def fit_gemm_times(samples: list[tuple[int, int, int, float]], sm_count: int, hbm_bytes_per_s: float,
                   tile_m: int = 128, tile_n: int = 256) -> tuple[float, float, float]:
    """(fixed_s, per_wave_s, rate) of zplan's GEMM time (kernels.gemm: max(FLOPs at the rate x
    the waves' efficiency, bytes at the copy rate) + fixed + per wave x waves) fitted to bf16
    GEMM times (M, N, K, seconds): for each rate in 0.5% steps, the two times by least squares
    on relative error (weights 1/t^2), both at least 0; the rate whose fit misses least in
    log(time) is kept. The rate is a nuisance parameter (a sweep's short runs may hold another
    clock than the sustained gemm_flops): only the two times go into the preset."""
    from types import SimpleNamespace

    from .kernels import wave_efficiency, waves

    k = SimpleNamespace(gemm_tile_m=tile_m, gemm_tile_n=tile_n, sm_count=sm_count)
    rows = [(2 * M * N * K / wave_efficiency(k, M, N), (M * K + K * N + M * N) * 2 / hbm_bytes_per_s,
             waves(k, M, N), t) for M, N, K, t in samples]
    top = max(2 * M * N * K / t for M, N, K, t in samples)  # the sweep's best achieved rate
    best = None
    for step in range(100, 400):
        rate = top * step / 200
        base = [max(work / rate, byt) for work, byt, _, _ in rows]
        w = [1 / t ** 2 for *_, t in rows]
        r = [t - b for b, (*_, t) in zip(base, rows)]
        x = [wv for _, _, wv, _ in rows]
        sw, sx, sxx = sum(w), sum(a * b for a, b in zip(w, x)), sum(a * b * b for a, b in zip(w, x))
        sr, sxr = sum(a * b for a, b in zip(w, r)), sum(a * b * c for a, b, c in zip(w, x, r))
        det = sw * sxx - sx * sx
        fixed, per = ((sxx * sr - sx * sxr) / det, (sw * sxr - sx * sr) / det) if det > 0 else (sr / sw, 0.0)
        if per < 0:
            fixed, per = sr / sw, 0.0
        if fixed < 0:
            fixed, per = 0.0, max(0.0, sxr / sxx)
        fixed = max(0.0, fixed)
        err = sum(math.log((b + fixed + per * wv) / t) ** 2 for b, (_, _, wv, t) in zip(base, rows))
        if best is None or err < best[0]:
            best = (err, fixed, per, rate)
    return best[1], best[2], best[3]


def gemm_time_constants(device, sm_count: int, hbm_bytes_per_s: float, mn=GEMM_SWEEP_MN,
                        ks=GEMM_SWEEP_K, seconds: float = 0.5) -> tuple[float, float]:
    """The GPU preset's gemm_fixed_s and gemm_wave_s, measured: every (M, N) of the sweep at every
    K, each run back to back for `seconds`, fitted in zplan's own GEMM form (fit_gemm_times),
    as the h100/b200 presets' times were fitted to XLA's measured table."""
    samples = [(m, n, k, _gemm_seconds(device, m, n, k, seconds)) for m, n in mn for k in ks]
    fixed, per_wave, _ = fit_gemm_times(samples, sm_count, hbm_bytes_per_s)
    return fixed, per_wave


def _head_gemm_seconds(device, tokens: int, vocab: int, hidden: int, seconds: float) -> float:
    """Seconds of an output head's three bf16 GEMMs, as a linear runs them (logits = x Wᵀ,
    dX = dY W, dW = dYᵀ x), each run back to back for `seconds` / 3."""
    import torch

    dt = torch.bfloat16
    x = torch.randn(tokens, hidden, device=device, dtype=dt)
    w = torch.randn(vocab, hidden, device=device, dtype=dt)
    dy = torch.randn(tokens, vocab, device=device, dtype=dt)
    total = 0.0
    for f in (lambda: x @ w.t(), lambda: dy @ w, lambda: dy.t() @ x):
        f()
        _sync(device)
        n, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < seconds / 3:
            for _ in range(3):
                f()
            _sync(device)
            n += 3
        total += (time.perf_counter() - t0) / n
    return total


def unaligned_gemm_slowdown(device, tokens: int = 8192, vocab: int = 50257, hidden: int = 1024,
                            seconds: float = 1.0) -> float:
    """How many times longer, per FLOP, an output head's GEMMs run at a vocabulary that is not a
    multiple of 8 (its rows not 16-byte aligned in bf16: GPT-2's 50257) than at the same
    vocabulary padded to a multiple of 64 (nanoGPT's 50304): the GPU preset's
    unaligned_gemm_slowdown, at least 1, at most 20."""
    padded = -(-vocab // 64) * 64
    t_odd = _head_gemm_seconds(device, tokens, vocab, hidden, seconds) / vocab
    t_pad = _head_gemm_seconds(device, tokens, padded, hidden, seconds) / padded
    return min(20.0, max(1.0, t_odd / t_pad))


def attention_rates(device, seq: int = 4096, heads: int = 16, head_dim: int = 128,
                    reps: int = 10, batch: int = 1, flash: bool = True,
                    cudnn: bool = False, masked: bool = False) -> tuple[float, float]:
    """Causal scaled_dot_product_attention forward and backward FLOP/s, counted as the flash-attn
    benchmarks do: forward 4·s²·heads·d / 2 per sequence, backward 2.5x that. SDPA held to its
    flash kernel (`flash`), to cuDNN's (`cudnn`), or left to choose; `masked`: the causal mask
    passed as a boolean tensor (is_causal off, as Hugging Face passes a padded batch's mask) to
    SDPA held to its memory-efficient kernel (on a GPU; a CPU runs what it has), still counted
    causal."""
    import torch
    import torch.nn.functional as F

    dt = torch.bfloat16 if device.type == "cuda" else torch.float32
    q, k, v = (torch.randn(batch, heads, seq, head_dim, device=device, dtype=dt, requires_grad=True)
               for _ in range(3))
    fwd_flop = batch * 4 * seq * seq * heads * head_dim // 2
    kw: dict = {"is_causal": True}
    if masked:
        kw = {"attn_mask": torch.ones(seq, seq, device=device, dtype=torch.bool).tril()[None, None]}
        held = _efficient_backend(device)
    else:
        held = _cudnn_backend(device) if cudnn else (_flash_backend(device) if flash else contextlib.nullcontext())
    with held:
        t_f = _timeit(lambda: F.scaled_dot_product_attention(q, k, v, **kw), device, reps)
        o = F.scaled_dot_product_attention(q, k, v, **kw)
        g = torch.randn_like(o)

        def fb():  # autograd.grad: no add into q/k/v.grad after the first call (.backward's)
            torch.autograd.grad(F.scaled_dot_product_attention(q, k, v, **kw), (q, k, v), g)

        t_fb = _timeit(fb, device, reps)
    return fwd_flop / t_f, 2.5 * fwd_flop / max(t_fb - t_f, 1e-9)


def attention_constants(device, cap: float) -> tuple[float, float, float, str]:
    """(forward, backward, half length, a note for the source) of the preset's attention: SDPA
    at s=4096 (one sequence) and s=512 (32 sequences of 512: ~80 us of kernel a call on an H200,
    longer than the host's launch), the long-sequence rates and the ramp solved from the two
    (seq_half, the long rate at most `cap`, the bf16 GEMM rate), backward scaled as forward (the
    planner's ramp is the same for both). Where SDPA has no FlashAttention kernel for this GPU
    (before sm80, some ROCm builds) the kernel SDPA picks is timed, and the note says so."""
    note = ""
    try:
        fwd, bwd = attention_rates(device)
        r512, _ = attention_rates(device, seq=512, heads=16, batch=32)
    except RuntimeError as e:  # "No available kernel" under the flash-only context; not an OOM
        if "No available kernel" not in str(e):
            raise
        fwd, bwd = attention_rates(device, flash=False)
        r512, _ = attention_rates(device, seq=512, heads=16, batch=32, flash=False)
        note = "; SDPA has no FlashAttention kernel on this GPU: the kernel it picks was timed"
    half, limit = seq_half(512, r512, 4096, fwd, cap=cap)
    return limit, bwd * limit / fwd, half, note


def cudnn_attention_speed(device) -> tuple[float, float] | None:
    """cuDNN's fused attention over FlashAttention-2, forward and backward, both as SDPA runs them
    at the calibration's shape (causal, s = 4096, 16 heads of 128): the preset's
    cudnn_attention_speed (zplan/kernels.py cudnn_speed). None on a CPU, and where SDPA has no
    cuDNN kernel for this GPU or build."""
    import torch

    if (device.type if hasattr(device, "type") else torch.device(device).type) != "cuda":
        return None
    try:
        c_f, c_b = attention_rates(device, cudnn=True)
        f, b = attention_rates(device)  # a build may have cuDNN's kernel and no flash one
    except RuntimeError as e:  # "No available kernel" under a one-kernel context, or cuDNN's
        # own refusal ("cuDNN Frontend error: ... No execution plans support the graph",
        # pytorch/pytorch#140930); an out-of-memory error is not one of them
        if "out of memory" in str(e) or not ("No available kernel" in str(e) or "cuDNN" in str(e)):
            raise
        return None
    return round(c_f / f, 3), round(c_b / b, 3)


def masked_attention_speed(device) -> tuple[float, float] | None:
    """SDPA's memory-efficient kernel under an explicit causal mask (Hugging Face's padded
    batches) over FlashAttention-2's causal kernel, forward and backward, per causal FLOP at the
    calibration's shape (s = 4096, 16 heads of 128): the preset's masked_attention_speed
    (zplan/kernels.py OLDER_KERNEL_SPEED's `efficient`). None on a CPU and where SDPA has no
    memory-efficient kernel for this GPU or build."""
    import torch

    if (device.type if hasattr(device, "type") else torch.device(device).type) != "cuda":
        return None
    try:
        m_f, m_b = attention_rates(device, masked=True)
        f, b = attention_rates(device)  # a build may have the efficient kernel and no flash one
    except RuntimeError as e:  # "No available kernel" under a one-kernel context; not an OOM
        if "out of memory" in str(e) or "No available kernel" not in str(e):
            raise
        return None
    return round(m_f / f, 3), round(m_b / b, 3)


def _efficient_backend(device):
    """On a GPU, SDPA held to its memory-efficient kernel; on a CPU (which has none), whatever
    SDPA runs."""
    if device.type != "cuda":
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION])


def _cudnn_backend(device):
    """SDPA held to cuDNN's attention (a GPU only; the caller checks)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([SDPBackend.CUDNN_ATTENTION])


def _flash_backend(device):
    """On a GPU, SDPA held to its FlashAttention-2 kernel: the presets' attention constants are
    FlashAttention-2's as SDPA runs it, and SDPA may otherwise pick cuDNN's attention, which
    recent PyTorch prefers on Hopper with a new cuDNN (torch/nn/attention, SDPBackend; the
    cuDNN preference of pytorch/pytorch PR 169849). On a CPU, whatever SDPA runs."""
    if device.type != "cuda":
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([SDPBackend.FLASH_ATTENTION])


def _norm_seconds(device, rows: int, width: int, reps: int = 10) -> float:
    """Seconds of one eager torch.nn.functional.layer_norm forward and backward (fp32, with a
    weight and a bias), the kernels Liger-Kernel's benchmark times (benchmarks/published/kernels/)."""
    import torch
    import torch.nn.functional as F

    x = torch.randn(rows, width, device=device, requires_grad=True)
    w = torch.ones(width, device=device, requires_grad=True)
    b = torch.zeros(width, device=device, requires_grad=True)
    dy = torch.randn(rows, width, device=device)

    def fb():  # autograd.grad: the gradients are returned, not accumulated into .grad (an add)
        torch.autograd.grad(F.layer_norm(x, (width,), w, b), (x, w, b), dy)

    return _timeit(fb, device, reps)


def eager_norm_efficiency(device, copy_bytes_per_s: float, rows: int = 4096,
                          width: int = 8192) -> float:
    """The share of the copy rate an eager norm reaches: zplan's bytes for a fused norm's forward
    and backward (unit_ops.norm_bytes; fp32) over the measured time, at most 1 (a CPU's caches
    can beat its copy rate)."""
    from types import SimpleNamespace

    from .unit_ops import norm_bytes

    fused = SimpleNamespace(fused_norm=True, compile=False)
    per = norm_bytes(fused, 4, False)[0] + norm_bytes(fused, 4, True)[0]
    nbytes = per * rows * width
    return min(1.0, nbytes / copy_bytes_per_s / _norm_seconds(device, rows, width))


def kernel_floor_s(device, n: int = 2000) -> float:
    """Seconds per tiny kernel issued back to back from eager PyTorch (launch + dispatch)."""
    import torch

    x = torch.zeros(1, device=device)
    x.add_(1)
    _sync(device)
    t0 = time.perf_counter()
    for _ in range(n):
        x.add_(1)
    _sync(device)
    return (time.perf_counter() - t0) / n


def kernel_constants(device, gemm_seconds: float = 2.0) -> dict:
    """The [kernels] table of a GPU preset (zplan/kernels.py), measured on this device."""
    import torch

    rates = gemm_rates(device, seconds=gemm_seconds)
    fwd, bwd, half, attention_note = attention_constants(device, cap=max(rates.values()))
    half = float(f"{half:.3g}")
    hbm = memory_bandwidth(device, nbytes=1 << 30)
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1
    fixed, per_wave = gemm_time_constants(device, int(sms), hbm)
    shapes = ", ".join(f"{m}x{n}x{k}: {r / 1e12:.0f}" for (m, n, k), r in rates.items())
    cudnn = cudnn_attention_speed(device)
    measured_attention = ({"cudnn_attention_speed": list(cudnn)} if cudnn else {})
    attention_kernels_note = (f"; cuDNN's attention (SDPA's cudnn backend) at s=4096: {cudnn[0]:.3g}x / {cudnn[1]:.3g}x "
                  f"FlashAttention-2 forward / backward" if cudnn else "")
    masked = masked_attention_speed(device)
    if masked:  # beside cuDNN's, the other measured attention kernel
        measured_attention["masked_attention_speed"] = list(masked)
        attention_kernels_note += (f"; SDPA's memory-efficient kernel under a causal mask tensor at s=4096: {masked[0]:.3g}x / "
                       f"{masked[1]:.3g}x FlashAttention-2 forward / backward per causal FLOP")
    return {
        "gemm_flops": {"bf16": float(f"{max(rates.values()):.4g}")},
        "sm_count": int(sms),
        "attention_forward_flops": float(f"{fwd:.4g}"),
        "attention_backward_flops": float(f"{bwd:.4g}"),
        "attention_half_seq": half,
        "hbm_achieved_bytes_per_s": float(f"{hbm:.4g}"),
        "eager_norm_efficiency": round(eager_norm_efficiency(device, hbm), 3),
        "kernel_floor_s": float(f"{kernel_floor_s(device):.3g}"),
        "gemm_fixed_s": float(f"{fixed:.3g}"),
        "unaligned_gemm_slowdown": round(unaligned_gemm_slowdown(device), 3),
        "gemm_wave_s": float(f"{per_wave:.3g}"),
        "nccl_sm_fraction": round(min(0.5, 16 / sms), 3) if device.type == "cuda" else 0.0,
        **measured_attention,
        "source": f"zplan calibrate: sustained bf16 GEMM TFLOP/s by shape {shapes}; causal SDPA "
                  f"(its FlashAttention-2 kernel) at s=4096 and 512, head dim 128, the long-sequence rate and "
                  f"half length solved from the two; 1 GiB copy; fp32 layer_norm forward and backward, 4096 x 8192; "
                  f"tiny-kernel loop; an output head's three GEMMs at vocabulary 50257 against "
                  f"50304 (8192 tokens, width 1024); GEMM fixed and per-wave times fitted over "
                  f"{len(GEMM_SWEEP_MN) * len(GEMM_SWEEP_K)} shapes (M, N) in {GEMM_SWEEP_MN} x K in {GEMM_SWEEP_K}"
                  + attention_note + attention_kernels_note
                  + "; nccl_sm_fraction ASSUMED (16 channels' SMs, not measured)",
    }


def seq_half(s1: int, r1: float, s2: int, r2: float, cap: float | None = None) -> tuple[float, float]:
    """(s_half, R) of the planner's attention rate, rate(s) = R · s/(s + s_half) (zplan/kernels.py
    `attention`), through two measured rates r1 at s1 < s2 and r2 at s2: the two equations
    r = R · s/(s + s_half) give s_half = (r2 - r1) / (r1/s1 - r2/s2) and R = r2 (s2 + s_half)/s2.
    Where the shorter sequence runs as fast or faster, no ramp: (0, r2). R is at most `cap` (an
    attention kernel does not outrun the GPU's GEMMs; a short sequence timed slow, the launch
    more than the kernel, would ask more): then s_half keeps r2 exact, s2 (R/r2 - 1)."""
    if r1 >= r2:
        return 0.0, r2
    if r1 / s1 <= r2 / s2:  # a rate growing as fast as s or faster: the form's limit, s_half large
        half = SEQ_HALF_MAX
    else:
        half = min(SEQ_HALF_MAX, (r2 - r1) / (r1 / s1 - r2 / s2))
    limit = r2 * (s2 + half) / s2
    if cap is not None and limit > cap:
        limit = max(cap, r2)
        half = s2 * (limit / r2 - 1)
    return half, limit


SEQ_HALF_MAX = 65536.0  # seq_half's bound, where two rates fit no finite s_half


def write_presets(out: Path, name: str, gpu: dict, cluster: dict) -> tuple[Path, Path]:
    from .plan import write_atomic

    def value(v) -> str:
        if isinstance(v, dict):
            return "{ " + ", ".join(f"{a} = {value(b)}" for a, b in v.items()) + " }"
        if isinstance(v, bool):
            return "true" if v else "false"
        if isinstance(v, str):
            return '"' + v.replace("\\", "\\\\").replace('"', "'") + '"'
        return repr(v)

    def toml(d: dict) -> str:
        tables = {k: v for k, v in d.items() if k == "kernels" and isinstance(v, dict)}
        lines = [f"{k} = {value(v)}" for k, v in d.items() if k not in tables]
        for name, t in tables.items():
            lines += ["", f"[{name}]"] + [f"{k} = {value(v)}" for k, v in t.items()]
        return "\n".join(lines) + "\n"

    g, c = out / "gpus" / f"{name}.toml", out / "clusters" / f"{name}.toml"
    write_atomic(g, toml(gpu))
    write_atomic(c, toml(cluster))
    return g, c
