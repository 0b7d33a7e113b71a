"""`zplan verify`: short real trainings over a matrix of configurations on this machine, each
held against the planner: per-rank peak memory within a tolerance, traffic in bytes exactly.

Each cell writes a plan (the tiny model on CPU ranks), runs the trainer through torchrun, and
reads its run report. The default is the quick matrix (each strategy once, both dtypes across
it); `--full` is the whole matrix behind docs/verification.md (benchmarks/verify_matrix.py).

Sign convention, in every table and in JSON: error = (predicted - measured) / measured, so a
negative error means the planner predicted too little (zplan.units.relative_error).
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field
from pathlib import Path

from .policy import K_FIELD
from .units import relative_error

ALL_STRATEGIES = ("ddp", "zero1", "zero2", "zero3", "zero3-noreshard", "hsdp", "offload-all")
# offload-all is left out of the CPU matrix: on a CPU rank the "device" and the host are the
# same memory, and FSDP2's CPUOffloadPolicy moves nothing off it, so the planner's per-GPU
# figure (the memory left on the GPU) has nothing on a CPU rank to be held against. It needs a
# GPU; no check here covers it yet.
CPU_LEFT_OUT = {"offload-all": "left out of the CPU matrix: on a CPU rank device and host are the "
                               "same memory, so there is no per-GPU figure to measure (it needs a GPU)"}
DEFAULT_STRATEGIES = tuple(s for s in ALL_STRATEGIES if s not in CPU_LEFT_OUT)
STEPS = 6  # warm-up, counted step, timed steps, then the memory tracker's two steps
SIGN = "error = (predicted - measured) / measured"


@dataclass(frozen=True)
class Cell:
    strategy: str
    world: int
    param_dtype: str
    checkpointing: str
    shard_size: int | None = None
    checkpoint_k: int | None = None  # every-k's k or first-k's k; None: the planner's default

    @property
    def name(self) -> str:
        hs = f" {self.world // self.shard_size}x{self.shard_size}" if self.shard_size else ""
        k = f" k={self.checkpoint_k}" if self.checkpoint_k and self.checkpointing in K_FIELD else ""
        return f"{self.strategy}{hs} N={self.world} {self.param_dtype} ckpt={self.checkpointing}{k}"


@dataclass
class CellResult:
    cell: Cell
    predicted_memory_bytes: int = 0
    measured_memory_bytes: int = 0
    predicted_traffic_bytes: int = 0
    measured_traffic_bytes: int = 0
    predicted_step_s: float = 0.0
    measured_step_s: float = 0.0
    error: str | None = None
    skipped: str | None = None  # a cell this machine cannot measure, and why
    memory_by_category: dict = field(default_factory=dict)

    @property
    def memory_error(self) -> float:
        """(predicted - measured) / measured."""
        return relative_error(self.predicted_memory_bytes, self.measured_memory_bytes)

    def ok(self, tolerance: float) -> bool:
        if self.skipped:
            return True
        return (self.error is None and abs(self.memory_error) <= tolerance
                and self.measured_traffic_bytes == self.predicted_traffic_bytes)

    def as_dict(self, tolerance: float) -> dict:
        return {"cell": self.cell.name, "strategy": self.cell.strategy, "world": self.cell.world,
                "param_dtype": self.cell.param_dtype, "checkpointing": self.cell.checkpointing,
                "checkpoint_k": self.cell.checkpoint_k,
                "shard_size": self.cell.shard_size,
                "predicted_memory_bytes": self.predicted_memory_bytes,
                "measured_memory_bytes": self.measured_memory_bytes,
                "memory_error": None if self.error or self.skipped else self.memory_error,
                "predicted_traffic_bytes": self.predicted_traffic_bytes,
                "measured_traffic_bytes": self.measured_traffic_bytes,
                "predicted_step_s": self.predicted_step_s, "measured_step_s": self.measured_step_s,
                "memory_by_category": self.memory_by_category,
                "error": self.error, "skipped": self.skipped, "ok": self.ok(tolerance)}


def matrix(strategies=DEFAULT_STRATEGIES, worlds=(1, 2, 4), dtypes=("fp32", "bf16"),
           checkpointing=("none", "full"), every: int | None = None,
           first: int | None = None) -> list[Cell]:
    """The full matrix: strategy x N x dtype x checkpointing (HSDP only at N = 4, as 2 x 2);
    `every` / `first`: the k of every-k / first-k cells (the planner's default where None)."""
    def k(c: str) -> int | None:
        return every if c == "every-k" else first if c == "first-k" else None

    cells = []
    for s in strategies:
        for n in worlds:
            if s == "hsdp":
                if n != 4:
                    continue
                cells += [Cell(s, n, d, c, 2, k(c)) for d in dtypes for c in checkpointing]
                continue
            cells += [Cell(s, n, d, c, checkpoint_k=k(c)) for d in dtypes for c in checkpointing]
    return cells


# Each strategy once at 2 ranks (HSDP at 4, as 2 x 2), both dtypes and both checkpointing modes
# across the set. Which dtype goes with which strategy is a choice (docs/verification.md lists
# every cell of the full matrix, the ones outside tolerance included).
QUICK = (Cell("ddp", 2, "fp32", "none"), Cell("zero1", 2, "fp32", "full"),
         Cell("zero2", 2, "bf16", "none"), Cell("zero3", 2, "bf16", "full"),
         Cell("zero3-noreshard", 2, "bf16", "none"), Cell("hsdp", 4, "bf16", "full", 2))


def quick_matrix() -> list[Cell]:
    return list(QUICK)


def plan_for(cell: Cell, model: str = "tiny", seq_len: int = 128, per_rank: int = 2,
             calibrated: str | None = None):
    """calibrated: a folder written by zplan calibrate (preset name "calibrated")."""
    from .scenario_options import build, cpu_ranks
    from .estimate import estimate_one
    from .plan import make_plan

    opts = cpu_ranks(model=model, gpu="calibrated" if calibrated else "cpu",
                     cluster="calibrated" if calibrated else "cpu-local",
                     presets_dir=[calibrated] if calibrated else None,
                     gpus=str(cell.world), gpus_per_node=max(2, cell.world),
                     seq_len=seq_len, micro_batch=per_rank, param_dtype=cell.param_dtype,
                     checkpointing=cell.checkpointing, shard_size=cell.shard_size,
                     **({K_FIELD[cell.checkpointing]: cell.checkpoint_k}
                        if cell.checkpoint_k and cell.checkpointing in K_FIELD else {}))
    sc = build(opts)
    r = estimate_one(sc, cell.strategy)
    return make_plan(sc, cell.strategy, per_rank * cell.world, r)


def run_cell(cell: Cell, workdir: Path, calibrated: str | None = None) -> CellResult:
    from .launch.command import LaunchSpec, torchrun_argv
    from .plan import save

    res = CellResult(cell)
    if cell.strategy in CPU_LEFT_OUT:
        res.skipped = CPU_LEFT_OUT[cell.strategy]
        return res
    from .launch.run_dir import holds_run

    base = cell.name.replace(" ", "_").replace("=", "")
    d, k = workdir / base, 2
    while d.is_dir() and holds_run(d):  # a reused --workdir, or a cell asked twice: a fresh folder
        d, k = workdir / f"{base}-{k}", k + 1
    d.mkdir(parents=True, exist_ok=True)
    try:
        plan = plan_for(cell, calibrated=calibrated)
    except Exception as e:  # a cell the planner refuses is reported, not raised
        res.error = f"plan: {e}"
        return res
    save(plan, d / "plan.json")
    spec = LaunchSpec(str(d / "plan.json"), cell.world,
                      script_args=("--ckpt-dir", str(d), "--steps", str(STEPS), "--no-progress"))
    argv, env = torchrun_argv(spec)
    with open(d / "log.txt", "w") as log:
        import subprocess
        import os

        full_env = dict(os.environ, **env)
        rc = subprocess.run(argv, env=full_env, stdout=log, stderr=subprocess.STDOUT).returncode
    if rc != 0:
        res.error = f"trainer exited {rc} (see {d / 'log.txt'})"
        return res
    rep = json.loads((d / "run_report.json").read_text())
    m, p = rep["measured"], rep["predicted"]
    res.predicted_memory_bytes, res.measured_memory_bytes = p["peak_memory_bytes"], m["peak_memory_bytes"]
    res.predicted_traffic_bytes, res.measured_traffic_bytes = p["bytes_per_step"], m["bytes_per_step"] or 0
    res.predicted_step_s, res.measured_step_s = p["step_s"], m["step_s"]
    res.memory_by_category = m.get("memory_by_category_rank0") or {}
    return res


def _pct(x: float, tolerance: float) -> str:
    """A signed percentage with the digits the tolerance needs: at --tolerance 0.00001 a failing
    cell read '+0.0%', the difference it fails on rounded away."""
    digits = 4 if tolerance == 0 else 1  # at 0 any difference fails: show it
    while digits < 6 and 0 < tolerance < 10 ** -(digits + 2) * 5:
        digits += 1
    return f"{x:+.{digits}%}"


def table(results: list[CellResult], tolerance: float) -> list[str]:
    """Markdown: one row per cell, sizes in MiB (2^20 bytes), traffic in bytes."""
    head = ("| cell | predicted memory | measured | error | traffic predicted (bytes) | measured | "
            "step predicted | measured | ok |")
    lines = [f"Memory in MiB (2^20 bytes); {SIGN} (negative: the planner predicted too little); "
             f"tolerance {_pct(tolerance, tolerance).lstrip('+')} for memory, traffic exact.", "", head,
             "|" + "---|" * 9]
    for r in results:
        if r.skipped:
            lines.append(f"| {r.cell.name} | | | | | | | | skipped: {r.skipped} |")
            continue
        if r.error:
            lines.append(f"| {r.cell.name} | | | | | | | | FAILED: {r.error} |")
            continue
        ok = "yes" if r.ok(tolerance) else "**no**"
        lines.append(
            f"| {r.cell.name} | {r.predicted_memory_bytes / 2**20:.2f} MiB | "
            f"{r.measured_memory_bytes / 2**20:.2f} MiB | {_pct(r.memory_error, tolerance)} | "
            f"{r.predicted_traffic_bytes:,} | {r.measured_traffic_bytes:,} | "
            f"{r.predicted_step_s * 1e3:.0f} ms | {r.measured_step_s * 1e3:.0f} ms | {ok} |")
    return lines


def progress(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)
