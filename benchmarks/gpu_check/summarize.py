"""The GPU check's report: predicted (preset and calibrated) against measured, and the checks.

    python benchmarks/gpu_check/summarize.py RESULTS_DIR

reads RESULTS_DIR/{steps.tsv, env.txt, run/run_report.json (the planned model's run),
first.json and resumed.json (the tiny model's run with a checkpoint, and its resume from it),
calibrate.json, estimate-calibrated.json} (any may be missing: a failed step
says so), writes RESULTS_DIR/report.txt and RESULTS_DIR/summary.json, prints the report, and
exits 1 if a check failed. Standard library only, so it runs whatever the GPU machine lacks.
Memory in MiB (2^20 bytes); error is (predicted - measured) / measured, as everywhere in zplan.
"""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path

MIB = 2**20


def _load(path: Path):
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _err(measured, predicted) -> str:
    """(predicted - measured) / measured: zplan's one sign convention (zplan.units.relative_error)."""
    if not measured or not predicted or (isinstance(measured, float) and math.isnan(measured)):
        return ""
    return f"{(predicted - measured) / measured:+.1%}"


def _fmt(v, unit: str) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    if unit == "MiB":
        return f"{v / MIB:,.1f} MiB"
    if unit == "ms":
        return f"{v * 1e3:,.1f} ms"
    if unit == "%":
        return f"{v:.1%}"
    return f"{v:,.0f}"


ROWS = [("peak allocated per rank", "peak_memory_bytes", "MiB"),
        ("peak reserved per rank", "peak_reserved_bytes", "MiB"),
        ("context, outside alloc.", "outside_allocator_bytes", "MiB"),
        ("bytes per step", "bytes_per_step", "n"),
        ("step time", "step_s", "ms"),
        ("tokens/s per rank", "tokens_per_s_per_gpu", "n"),
        ("MFU", "mfu", "%")]


def _calibrated(est) -> dict:
    """The figures of `zplan estimate --json` for one strategy, named as in the run report."""
    try:
        x = est["strategies"][0]
        per, t = x["per_gpu"], x["time"]
        return {"peak_memory_bytes": per["total_bytes"] - per.get("overhead_bytes", 0),
                "step_s": t["step_s"], "tokens_per_s_per_gpu": t["tokens_per_s_per_gpu"],
                "bytes_per_step": x["comm"]["bytes_per_step"]}  # its MFU is of another peak
    except (TypeError, KeyError, IndexError):
        return {}


def summarize(res: Path) -> tuple[list[str], dict]:
    steps = []
    tsv = res / "steps.tsv"
    if tsv.exists():
        for line in tsv.read_text().splitlines():
            name, rc, secs = (line.split("\t") + ["", ""])[:3]
            steps.append({"step": name, "rc": int(rc) if rc.lstrip("-").isdigit() else None,
                          "seconds": float(secs) if secs else None})
    report = _load(res / "run" / "run_report.json")
    first = _load(res / "first.json")
    resumed = _load(res / "resumed.json")
    calibrated = _calibrated(_load(res / "estimate-calibrated.json"))
    cal = _load(res / "calibrate.json")
    lines = [f"zplan GPU check: {res}"]
    env = res / "env.txt"
    if env.exists():
        lines += ["  " + ln for ln in env.read_text().splitlines()[:6]]
    lines.append("")
    lines.append(f"{'step':28s} {'exit':>5s} {'seconds':>8s}")
    for s in steps:
        lines.append(f"{s['step']:28s} {s['rc'] if s['rc'] is not None else '?':>5} "
                     f"{s['seconds'] if s['seconds'] is not None else 0:>8.1f}")
    checks = {s["step"]: s["rc"] == 0 for s in steps}
    summary: dict = {"steps": steps, "figures": {}}
    if report is not None:
        m, p = report["measured"], report.get("predicted") or {}
        lines += ["", f"{report['strategy']} on {report['world_size']} {report['device']} rank(s), "
                      f"{report['model']}, backend {report.get('backend', '?')}, steps "
                      f"{report['start_step']}..{report['end_step']}",
                  f"{'figure':26s} {'predicted (preset)':>20s} {'predicted (calib.)':>20s} "
                  f"{'measured':>16s} {'error':>8s} {'err calib.':>10s}"]
        for label, key, unit in ROWS:
            mv, pv, cv = m.get(key), p.get(key), calibrated.get(key) if key != "peak_reserved_bytes" else None
            summary["figures"][key] = {"predicted": pv, "predicted_calibrated": cv, "measured": mv}
            if pv is None and cv is None and mv is None:
                continue  # reserved on CPU ranks
            lines.append(f"{label:26s} {_fmt(pv, unit):>20s} {_fmt(cv, unit):>20s} {_fmt(mv, unit):>16s} "
                         f"{_err(mv, pv):>8s} {_err(mv, cv):>10s}")
        if p.get("peak_reserved_basis") not in (None, "reserved_bytes"):
            lines.append(f"  predicted reserved: {p['peak_reserved_basis']}")
        losses = report.get("losses") or []
        if losses:
            lines.append(f"loss {losses[0]:.4f} -> {losses[-1]:.4f} over {len(losses)} steps")
            checks["loss finite"] = all(x == x and abs(x) != float("inf") for x in losses)
        for w in report.get("warnings", []):
            lines.append(f"warning: {w}")

    else:
        checks["run report written"] = False
    # the tiny model's checkpoint, then its resume: failed until both reports say so (a run
    # killed before them must not read as passed)
    checks["resumed from the checkpoint"] = (first is not None and resumed is not None
                                             and resumed["start_step"] == first["end_step"] > 0
                                             and resumed["end_step"] > resumed["start_step"])
    if cal is not None:
        g = cal.get("gpu", {})
        lines.append("calibrated: peak " + ", ".join(f"{k} {v / 1e12:,.1f} TFLOP/s" for k, v in
                                                   g.get("peak_flops", {}).items())
                     + f"; memory {g.get('hbm_bytes_per_s', 0) / 1e9:,.0f} GB/s"
                     + f"; host link {g.get('host_link_bytes_per_s', 0) / 1e9:,.1f} GB/s")
    summary["checks"] = checks
    failed = [k for k, ok in checks.items() if not ok]
    lines.append("error = (predicted - measured) / measured")
    lines += ["", "checks: " + ("all passed" if not failed else "FAILED: " + ", ".join(failed))]
    summary["passed"] = not failed
    return lines, summary


def _write(path: Path, text: str) -> None:
    """Atomically: a reader sees the old file or the whole new one."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: summarize.py RESULTS_DIR", file=sys.stderr)
        return 2
    res = Path(argv[0])
    lines, summary = summarize(res)
    text = "\n".join(lines) + "\n"
    _write(res / "report.txt", text)
    _write(res / "summary.json", json.dumps(summary, indent=2) + "\n")
    print(text, end="")
    return 0 if summary["passed"] else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
