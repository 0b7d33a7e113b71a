"""`zplan verify`: short real trainings over a matrix of configurations on this machine, each
held against the planner: per-rank peak memory within a tolerance, traffic exactly.

Each cell writes a plan (the tiny model on CPU ranks, or this machine's GPUs), runs the trainer
through torchrun, and reads its run report.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field
from pathlib import Path

DEFAULT_STRATEGIES = ("ddp", "zero1", "zero2", "zero3", "zero3-noreshard", "hsdp", "offload-all")
STEPS = 6  # warm-up, counted step, timed steps, then the memory tracker's two steps


@dataclass(frozen=True)
class Cell:
    strategy: str
    world: int
    param_dtype: str
    checkpointing: str
    shard_size: int | None = None

    @property
    def name(self) -> str:
        hs = f" {self.world // self.shard_size}x{self.shard_size}" if self.shard_size else ""
        return f"{self.strategy}{hs} N={self.world} {self.param_dtype} ckpt={self.checkpointing}"


@dataclass
class CellResult:
    cell: Cell
    predicted_memory: int = 0
    measured_memory: int = 0
    predicted_elements: int = 0
    measured_elements: int = 0
    predicted_step_s: float = 0.0
    measured_step_s: float = 0.0
    error: str | None = None
    memory_by_category: dict = field(default_factory=dict)

    @property
    def memory_error(self) -> float:
        return (self.measured_memory - self.predicted_memory) / max(1, self.predicted_memory)

    def ok(self, tolerance: float) -> bool:
        return (self.error is None and abs(self.memory_error) <= tolerance
                and self.measured_elements == self.predicted_elements)


def matrix(strategies=DEFAULT_STRATEGIES, worlds=(1, 2, 4), dtypes=("fp32", "bf16"),
           checkpointing=("none", "full")) -> list[Cell]:
    cells = []
    for s in strategies:
        for n in worlds:
            if s == "hsdp":
                if n != 4:
                    continue
                cells += [Cell(s, n, d, c, 2) for d in dtypes for c in checkpointing]
                continue
            cells += [Cell(s, n, d, c) for d in dtypes for c in checkpointing]
    return cells


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
                     checkpointing=cell.checkpointing, shard_size=cell.shard_size)
    sc = build(opts)
    r = estimate_one(sc, cell.strategy)
    return make_plan(sc, cell.strategy, per_rank * cell.world, r)


def run_cell(cell: Cell, workdir: Path, calibrated: str | None = None) -> CellResult:
    from .launch.command import LaunchSpec, torchrun_argv
    from .plan import save

    res = CellResult(cell)
    d = workdir / cell.name.replace(" ", "_").replace("=", "")
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
    res.predicted_memory, res.measured_memory = p["peak_memory_bytes"], m["peak_memory_bytes"]
    res.predicted_elements, res.measured_elements = p["elements_per_step"], m["elements_per_step"] or 0
    res.predicted_step_s, res.measured_step_s = p["step_s"], m["step_s"]
    res.memory_by_category = m.get("memory_by_category_rank0") or {}
    return res


def table(results: list[CellResult], tolerance: float) -> list[str]:
    head = ("| cell | predicted memory | measured | error | traffic predicted | measured | "
            "step predicted | measured | ok |")
    lines = [head, "|" + "---|" * 9]
    for r in results:
        if r.error:
            lines.append(f"| {r.cell.name} | | | | | | | | FAILED: {r.error} |")
            continue
        ok = "yes" if r.ok(tolerance) else "**no**"
        lines.append(
            f"| {r.cell.name} | {r.predicted_memory / 2**20:.2f} MiB | {r.measured_memory / 2**20:.2f} MiB | "
            f"{r.memory_error:+.1%} | {r.predicted_elements:,} | {r.measured_elements:,} | "
            f"{r.predicted_step_s * 1e3:.0f} ms | {r.measured_step_s * 1e3:.0f} ms | {ok} |")
    return lines


def progress(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)
