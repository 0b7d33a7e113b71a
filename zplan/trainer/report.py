"""What a run reports: the run report (measured against predicted), rank 0's comparison table,
the step lines of a run without a terminal, and the progress bar of one with a terminal."""

from __future__ import annotations

import json
import math
import statistics
from dataclasses import asdict
from pathlib import Path

from ..errors import UsageError
from ..plan import write_atomic
from ..units import relative_error

GIB = 2**30
MIB = 2**20
# a CPU rank's memory tracker takes the last two steps, after the step whose traffic is counted
# (the third): a run of fewer steps measures no peak (loop.Trainer.run)
MIN_TRACKED_STEPS = 5


def tokens_per_step(plan) -> int:
    """Tokens one rank processes per optimizer step."""
    t = plan.train
    return t.micro_batch * t.seq_len * t.grad_accum


def flop_per_step(plan) -> float:
    """Model FLOP of one rank's step (no recomputation counted: MFU's convention)."""
    from .. import arch

    return arch.model_flop_per_token(plan.model, plan.train.seq_len) * tokens_per_step(plan)


def peak_flops(plan) -> float:
    """The plan's GPU peak for the dtype its matmuls run in (the param dtype)."""
    return plan.gpu.flops(plan.train.precision.param)


def predicted_memory(plan, device_type: str) -> dict:
    """The memory figures a run is compared with.

    allocated: the tensor bytes (total less the CUDA context and fragmentation allowance),
    which is what max_memory_allocated and the CPU tracker count (on a GPU it also counts
    cuBLAS's workspaces, which the plan books with the context: measure.device_peak_memory). reserved: the plan's
    reserved prediction when it has one, else its total (context included; marked)."""
    per = plan.predicted.per_gpu
    total = per["total_bytes"]
    tensors = total - per.get("overhead_bytes", 0)
    if device_type == "cpu" and plan.strategy == "offload-all":
        # a CPU rank has no device memory to offload from: offload-all holds what zero3 does
        from ..estimate import estimate_one

        m = estimate_one(plan.scenario(), "zero3").memory
        return {"allocated": m.total_bytes - m.overhead_bytes, "reserved": None, "reserved_basis": None}
    if device_type == "cpu":
        return {"allocated": tensors, "reserved": None, "reserved_basis": None}
    if "reserved_bytes" in per:
        return {"allocated": tensors, "reserved": per["reserved_bytes"], "reserved_basis": "reserved_bytes"}
    return {"allocated": tensors, "reserved": total, "reserved_basis": "total_bytes (context included)"}


def build_report(tr, start: int, losses: list[float], norms: list[float], times: list[float],
                 peak: dict, counted: int) -> dict:
    """The run report of Trainer `tr` (zplan/trainer/loop.py)."""
    plan = tr.plan
    step_s = statistics.median(times) if times else float("nan")
    rate = flop_per_step(plan) / step_s if times else None
    comm = tr.counter.summary(max(1, counted)) if tr.counter else {}
    measured = {
        "peak_memory_bytes": peak["allocated"],
        "peak_reserved_bytes": peak["reserved"],
        "outside_allocator_bytes": peak.get("outside"),
        "step_s": step_s,
        "tokens_per_s_per_gpu": tokens_per_step(plan) / step_s if times else None,
        "mfu": rate / peak_flops(plan) if rate else None,
        "elements_per_step": comm.get("elements_per_step"),
        "bytes_per_step": comm.get("bytes_per_step"),
        "per_collective": comm.get("per_collective"),
        "memory_by_category_rank0": tr.memory_by_category,
    }
    pred = plan.predicted
    predicted = None
    if pred is not None:
        mem = predicted_memory(plan, tr.device.type)
        predicted = {
            "peak_memory_bytes": mem["allocated"], "peak_reserved_bytes": mem["reserved"],
            "peak_reserved_basis": mem["reserved_basis"],
            "outside_allocator_bytes": plan.assumptions.cuda_context_bytes if tr.device.type == "cuda" else None,
            "step_s": pred.step_s,
            "tokens_per_s_per_gpu": pred.tokens_per_s_per_gpu, "mfu": pred.mfu,
            "elements_per_step": pred.elements_per_step, "bytes_per_step": pred.bytes_per_step,
        }
    return {
        "strategy": plan.strategy, "world_size": tr.world, "device": tr.device.type,
        "backend": tr.backend, "model": plan.model.name, "start_step": start,
        "end_step": tr.step, "stopped_by": getattr(tr, "stopped_by", None), "losses": losses, "grad_norms": [None if n != n else n for n in norms],  # NaN: not clipped, no norm
        "config": asdict(tr.cfg),
        "measured": measured, "predicted": predicted, "warnings": rate_warnings(plan, rate),
    }


def rate_warnings(plan, rate_flop_per_s: float | None) -> list[str]:
    """A measured rate above the preset's peak means the preset does not describe this device."""
    peak = peak_flops(plan)
    if rate_flop_per_s is None or rate_flop_per_s <= peak:
        return []
    return [f"measured {rate_flop_per_s / 1e12:.3g} TFLOP/s per rank exceeds the '{plan.gpu.name}' "
            f"preset's {plan.train.precision.param} peak of {peak / 1e12:.3g} TFLOP/s, so MFU is "
            f"over 100%: the preset does not describe this device (run zplan calibrate)"]


def step_log_line(tr, step: int, steps: int, loss: float, step_s: float,
                  device_memory: tuple[int, int] | None) -> str:
    """One step line: step, loss, step time, tokens/s, MFU, memory (GiB = 2^30 bytes)."""
    plan = tr.plan
    mfu = flop_per_step(plan) / step_s / peak_flops(plan)
    if device_memory is not None:
        mem = f"memory {device_memory[0] / GIB:.2f} GiB allocated, {device_memory[1] / GIB:.2f} GiB reserved"
    else:
        from .measure import host_rss_bytes

        mem = f"host rss {host_rss_bytes() / MIB:,.0f} MiB"
    # over 100%: the preset's peak is not this device's (rate_warnings says so in the report)
    shown = f"MFU {mfu:.1%}" if mfu <= 1 else f"MFU {mfu:.1%} (over the '{plan.gpu.name}' preset's peak)"
    return (f"zplan: step {step}/{steps} loss {loss:.4f} step {step_s * 1e3:,.1f} ms "
            f"tokens/s {tokens_per_step(plan) / step_s:,.0f} {shown} {mem}")


class _NoBar:
    def __enter__(self):
        return None

    def __exit__(self, *a):
        return False


def progress_bar(enabled: bool, total: int):
    if not enabled:
        return _NoBar()
    from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

    return Progress(TextColumn("{task.description}"), BarColumn(), TimeRemainingColumn(),
                    transient=True)


def compare_lines(report: dict) -> list[str]:
    """Predicted against measured, one line per figure (rank 0 prints them); error is
    (predicted - measured) / measured, zplan's one sign convention (units.relative_error)."""
    m, p = report["measured"], report["predicted"] or {}
    reserved = "peak reserved per rank"
    if p.get("peak_reserved_bytes") is not None and p.get("peak_reserved_basis") != "reserved_bytes":
        reserved += " *"
    rows = [("peak allocated per rank", "peak_memory_bytes", lambda v: f"{v / MIB:,.1f} MiB"),
            (reserved, "peak_reserved_bytes", lambda v: f"{v / MIB:,.1f} MiB"),
            ("context, outside alloc.", "outside_allocator_bytes", lambda v: f"{v / MIB:,.1f} MiB"),
            ("communication per step", "elements_per_step", lambda v: f"{v:,} elements"),
            ("bytes per step", "bytes_per_step", lambda v: f"{v / MIB:,.2f} MiB"),
            ("step time", "step_s", lambda v: f"{v * 1e3:,.1f} ms"),
            ("tokens/s per rank", "tokens_per_s_per_gpu", lambda v: f"{v:,.0f}"),
            ("MFU", "mfu", lambda v: f"{v:.1%}")]
    out = [f"{'figure':24s} {'predicted':>20s} {'measured':>20s} {'error':>8s}",
           "(error = (predicted - measured) / measured)"]
    for label, key, fmt in rows:
        mv, pv = m.get(key), p.get(key)
        if mv is None and pv is None:
            continue
        ms = fmt(mv) if mv is not None and not (isinstance(mv, float) and math.isnan(mv)) else "-"
        ps = fmt(pv) if pv is not None else "-"
        err = f"{relative_error(pv, mv):+.1%}" if (mv and pv) else ""
        out.append(f"{label:24s} {ps:>20s} {ms:>20s} {err:>8s}")
    if m.get("peak_memory_bytes") is None and report.get("device") == "cpu":
        start, end = report.get("start_step") or 0, report.get("end_step") or 0
        why = (f"{report['stopped_by']} stopped this one after step {end}, before them" if report.get("stopped_by")
               else f"this one trained {end - start}, steps {start}..{end}: --steps {start + MIN_TRACKED_STEPS} or more"
               if end - start < MIN_TRACKED_STEPS else "this one had it off (the trainer's --no-memory)")
        out.append(f"peak allocated: not measured (a CPU rank's tracker runs on the last two steps "
                   f"of a launch that trains at least {MIN_TRACKED_STEPS} steps; {why})")
    if reserved.endswith("*"):
        out.append("* predicted reserved is the plan's total, CUDA context included (no reserved prediction)")
    if report.get("device") == "cpu" and report.get("strategy") == "offload-all" and m.get("peak_memory_bytes"):
        out.append("peak allocated: offload-all on CPU ranks has no device to offload to, so the run holds what "
                   "zero3 does and is compared with zero3's prediction (estimate --plan shows the GPU's)")
    if report.get("device") == "cpu" and m.get("step_s") is not None:
        out.append("step time, tokens/s, MFU on CPU ranks: zplan's time model prices GPU kernels and NCCL; "
                   "here it prices a nominal (or calibrated) CPU preset and leaves out what dominates a CPU "
                   "step (each op's dispatch, gloo, low-precision arithmetic on cores), so these rows "
                   "rehearse the run, they do not test the model: memory and communication do")
    out += [f"warning: {w}" for w in report.get("warnings", [])]
    return out


def write_report(report: dict, ckpt_dir: str) -> Path:
    from ..launch.run_dir import writable_report

    path = Path(ckpt_dir) / "run_report.json"
    writable_report(path)  # a directory or special file there is one line, not a traceback
    _keep_earlier_segment(path, report)
    write_atomic(path, json.dumps(report, indent=2, default=str) + "\n")
    return path


def _keep_earlier_segment(path: Path, report: dict) -> None:
    """A resumed run's report covers the steps it ran; the report of the run's earlier part
    (its losses, its measured figures) is kept beside it as run_report.steps{A}-{B}.json rather
    than replaced."""
    try:
        old = json.loads(path.read_text()) if path.is_file() else None
    except (OSError, ValueError):
        return
    if not isinstance(old, dict) or not all(type(old.get(k)) is int and 0 <= old[k] < 10**12
                                            for k in ("start_step", "end_step")) \
            or old["start_step"] >= report.get("start_step", 0):
        return  # not a report this trainer wrote (data, never a path to follow), or the same part
    kept = path.with_name(f"run_report.steps{old['start_step']}-{old['end_step']}.json")
    try:  # a copy kept at best: it never stands in the way of the run's own report
        if not kept.exists():
            write_atomic(kept, path.read_text())
    except (OSError, UsageError):
        pass
