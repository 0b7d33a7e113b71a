"""Time the recommend search in-process and as a whole process; report candidates per second.

Usage: python benchmarks/recommend_speed.py
The target is a default search under one second on a 2-core machine (issue: zplan recommend).
"""

from __future__ import annotations

import subprocess
import sys
import time

from zplan.scenario_options import ScenarioOptions, build
from zplan.recommend import search

CASES = [
    dict(model="llama-3.1-8b", gpus="8", global_batch=64),
    dict(model="llama-3.1-70b", gpus="64", seq_len=8192, global_batch=512),
    dict(model="llama-3.1-405b", gpus="1024", seq_len=8192, global_batch=2048),
]


def main() -> None:
    for case in CASES:
        gb = case.pop("global_batch")
        sc = build(ScenarioOptions(**case))
        t0 = time.perf_counter()
        r = search(sc, gb)
        dt = time.perf_counter() - t0
        args = ["recommend", "--global-batch", str(gb)]
        for k, v in case.items():
            args += [f"--{k.replace('_', '-')}", str(v)]
        t1 = time.perf_counter()
        subprocess.run([sys.executable, "-m", "zplan", *args], stdout=subprocess.DEVNULL,
                       stderr=subprocess.DEVNULL)
        proc = time.perf_counter() - t1
        print(f"{case['model']} on {case['gpus']}: {r.evaluated} candidates in {dt * 1e3:.0f} ms = "
              f"{r.evaluated / dt:,.0f}/s; whole process {proc * 1e3:.0f} ms "
              f"({proc:.2f} of the 1 s budget); winner {r.winner.label()}")


if __name__ == "__main__":
    main()
