"""Time `zplan estimate` as a whole process (start-up included), and report ratios.

Usage: python benchmarks/estimate_speed.py [--runs 10]
Reports the median wall time of the estimate process, against a bare `python -c pass` and
against the 0.5 s budget, all measured in this one run.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time

CASES = [
    ["estimate", "--params", "70e9", "--gpus", "64", "--json"],
    ["estimate", "--model", "llama-3.1-70b", "--gpus", "64", "--checkpointing", "full"],
    ["estimate", "--model", "llama-3.1-405b", "--gpus", "1024", "--checkpointing", "full", "--json"],
]
BUDGET_S = 0.5


def wall(cmd: list[str], runs: int) -> float:
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=10)
    a = ap.parse_args()
    base = wall([sys.executable, "-c", "pass"], a.runs)
    print(f"python start-up: {base * 1e3:.0f} ms (median of {a.runs})")
    worst = 0.0
    for case in CASES:
        t = wall([sys.executable, "-m", "zplan", *case], a.runs)
        worst = max(worst, t)
        print(f"zplan {' '.join(case)}: {t * 1e3:.0f} ms = {t / base:.1f}x start-up, "
              f"{t / BUDGET_S:.2f} of the {BUDGET_S} s budget")
    print(f"worst: {worst / BUDGET_S:.2f} of budget ({'within' if worst < BUDGET_S else 'OVER'})")


if __name__ == "__main__":
    main()
