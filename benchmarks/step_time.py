"""Predicted against measured step time on this machine, after `zplan calibrate`.

Usage: python benchmarks/step_time.py [--presets DIR]   (runs zplan calibrate into DIR first
when DIR has no calibrated preset). Prints, per cell, the predicted and measured step time and
their ratio, all measured in this one run. Target (issue: prove it): within 20%.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

from zplan.verify import Cell, run_cell

CELLS = [Cell("zero3", 2, "bf16", "none"), Cell("zero3", 2, "fp32", "none"),
         Cell("ddp", 2, "fp32", "none"), Cell("zero2", 2, "bf16", "none"),
         Cell("zero3", 2, "bf16", "full")]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--presets", default=None)
    a = ap.parse_args()
    d = Path(a.presets or tempfile.mkdtemp(prefix="zplan-cal-"))
    if not (d / "gpus" / "calibrated.toml").is_file():
        subprocess.run([sys.executable, "-m", "zplan", "calibrate", "--output", str(d), "--max-mb", "16"],
                       check=True)
    work = Path(tempfile.mkdtemp(prefix="zplan-steps-"))
    print(f"{'cell':32s} {'predicted':>10s} {'measured':>10s} {'measured/predicted':>19s}")
    for c in CELLS:
        r = run_cell(c, work, calibrated=str(d))
        if r.error:
            print(f"{c.name:32s} failed: {r.error}")
            continue
        print(f"{c.name:32s} {r.predicted_step_s * 1e3:>8.0f} ms {r.measured_step_s * 1e3:>8.0f} ms "
              f"{r.measured_step_s / r.predicted_step_s:>19.2f}")


if __name__ == "__main__":
    main()
