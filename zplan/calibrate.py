"""`zplan calibrate`: measure this machine and write presets the planner can use.

Measures, on the device the trainer would use (a GPU, or one CPU thread as a torchrun rank has):
achievable matmul FLOP/s per dtype, memory bandwidth (a large copy), the CPU's AdamW throughput
(for offload), and the bus bandwidth of all-gather, reduce-scatter and all-reduce over message
sizes (nccl-tests' definitions) between N local processes (NCCL on GPUs, gloo on CPUs). Writes
OUT/gpus/NAME.toml and OUT/clusters/NAME.toml; use them with --presets OUT --gpu NAME
--cluster NAME. The GPU preset is marked `measured`, so the efficiency assumption defaults to 1.
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time
from pathlib import Path

DTYPES = ("fp32", "bf16")


def _timeit(fn, device, reps: int) -> float:
    import torch

    fn()  # warm up
    if device.type == "cuda":
        torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def matmul_flops(device, sizes=(256, 512, 1024, 2048), reps: int = 5) -> dict[str, dict[int, float]]:
    import torch

    out: dict[str, dict[int, float]] = {}
    for name, dt in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        out[name] = {}
        for n in sizes:
            a = torch.randn(n, n, device=device, dtype=dt)
            b = torch.randn(n, n, device=device, dtype=dt)
            t = _timeit(lambda: a @ b, device, reps)
            out[name][n] = 2 * n**3 / t
    return out


def memory_bandwidth(device, nbytes: int = 256 * 2**20, reps: int = 5) -> float:
    """Bytes per second of a large copy (read + write)."""
    import torch

    src = torch.empty(nbytes // 4, device=device)
    dst = torch.empty_like(src)
    t = _timeit(lambda: dst.copy_(src), device, reps)
    return 2 * nbytes / t


def adamw_params_per_s(n: int = 4_000_000, reps: int = 3) -> float:
    """CPU AdamW throughput (one thread), the offload strategies' optimizer step."""
    import torch

    p = torch.nn.Parameter(torch.randn(n))
    p.grad = torch.randn(n)
    opt = torch.optim.AdamW([p], foreach=False)
    t = _timeit(opt.step, torch.device("cpu"), reps)
    return n / t


def _collective_worker(rank, world, init, sizes, reps, backend, out):
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    if backend == "nccl":
        torch.cuda.set_device(rank)
    device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
    dist.init_process_group(backend, init_method=init, rank=rank, world_size=world)
    res = {"all_gather": {}, "reduce_scatter": {}, "all_reduce": {}}
    try:
        for nbytes in sizes:
            n = max(world, nbytes // 4 // world * world)
            full = torch.ones(n, device=device)
            part = torch.ones(n // world, device=device)
            ops = {
                "all_gather": lambda: dist.all_gather_into_tensor(full, part),
                "reduce_scatter": lambda: dist.reduce_scatter_tensor(part, full),
                "all_reduce": lambda: dist.all_reduce(full),
            }
            for name, fn in ops.items():
                dist.barrier()
                t = _timeit(fn, device, reps)
                tt = torch.tensor([t], dtype=torch.float64)
                dist.all_reduce(tt, op=dist.ReduceOp.MAX)
                res[name][n * 4] = float(tt)
        if rank == 0:
            torch.save(res, out)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    os._exit(0)  # as zplan.reference.selfcheck: skip gloo's teardown, which can abort


def collective_times(world: int, sizes: list[int], reps: int = 3, backend: str = "gloo") -> dict:
    """Seconds per collective per message size (bytes of the full tensor)."""
    import torch
    import torch.multiprocessing as mp

    from .netutil import free_port

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
    for op, per in times.items():
        f = (2 if op == "all_reduce" else 1) * (world - 1) / world
        busbw[op] = {s: s / t * f for s, t in per.items()}
    big = max(times["all_gather"])
    bw = statistics.median([busbw[op][big] for op in busbw])
    small = min(times["all_gather"])
    t_small = times["all_gather"][small]
    alpha = max(0.0, (t_small - small * (world - 1) / (world * bw)) / max(1, world - 1))
    return bw, alpha, busbw


def write_presets(out: Path, name: str, gpu: dict, cluster: dict) -> tuple[Path, Path]:
    from .plan import write_atomic

    def toml(d: dict) -> str:
        lines = []
        for k, v in d.items():
            if isinstance(v, dict):
                inner = ", ".join(f"{a} = {b!r}" for a, b in v.items())
                lines.append(f"{k} = {{ {inner} }}")
            elif isinstance(v, bool):
                lines.append(f"{k} = {'true' if v else 'false'}")
            elif isinstance(v, str):
                lines.append(f"{k} = {v!r}".replace("'", '"'))
            else:
                lines.append(f"{k} = {v!r}")
        return "\n".join(lines) + "\n"

    g, c = out / "gpus" / f"{name}.toml", out / "clusters" / f"{name}.toml"
    write_atomic(g, toml(gpu))
    write_atomic(c, toml(cluster))
    return g, c
