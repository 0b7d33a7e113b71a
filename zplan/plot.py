"""Pictures: per-GPU memory and step time against N for each strategy (matplotlib, optional)."""

from __future__ import annotations

from dataclasses import replace

from .errors import UsageError
from .estimate import estimate_one
from .scenario import Scenario
from .strategies import STRATEGIES
from .units import GB


def scaling_series(sc: Scenario, max_n: int | None = None) -> dict[str, list[tuple[int, float, float, bool]]]:
    """(N, total GB per GPU, step seconds, fits) for N = 1, 2, 4, ... up to max(64, 8 x N)."""
    max_n = max_n or max(64, 8 * sc.n)
    series: dict[str, list[tuple[int, float, float]]] = {}
    n = 1
    while n <= max_n:
        hw = sc.hw.model_copy(update={"num_gpus": n})
        shard = min(sc.hw.cluster.gpus_per_node, n)
        s = replace(sc, hw=hw, shard_size=shard if n % shard == 0 else None)
        for name in STRATEGIES:
            if name == "hsdp" and s.hsdp_shard >= n:  # one replica is zero3, not an HSDP recommend plans
                continue
            r = estimate_one(s, name)
            if r.memory is not None:
                series.setdefault(name, []).append((n, r.memory.total_bytes / GB, r.timing.step_s, bool(r.fits)))
        n *= 2
    return series


def plot_scaling(sc: Scenario, path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise UsageError("--plot needs matplotlib: pip install 'zplan[plot]'") from None
    series = scaling_series(sc)
    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4.5))
    for name, pts in series.items():
        ns = [p[0] for p in pts]
        line, = a.plot(ns, [p[1] for p in pts], marker="o", label=name)
        # step time only where the configuration fits: a faster one that does not is no option
        b.plot(ns, [p[2] if p[3] else float("nan") for p in pts], marker="o", label=name, color=line.get_color())
    a.axhline(sc.hw.gpu.memory_bytes / GB, color="k", ls="--", label=f"{sc.hw.gpu.name} memory")
    for ax in (a, b):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("GPUs (N)")
        ax.grid(True, alpha=0.3)
    a.set_yscale("log")
    a.set_ylabel("per-GPU memory (GB = 1e9 bytes)")
    b.set_ylabel("predicted step time (s)")
    a.set_title(f"{sc.model.name}: memory per GPU")
    b.set_title(f"step time where it fits the GPU (no headroom), {sc.train.micro_batch} x {sc.train.seq_len} tokens per GPU")
    a.legend(fontsize=7)
    fig.tight_layout()
    import io

    from .files import write_bytes

    buf = io.BytesIO()  # rendered first: a bad target path leaves no half-written PNG behind
    fig.savefig(buf, format="png", dpi=110)
    plt.close(fig)
    write_bytes(path, buf.getvalue(), "plot")
