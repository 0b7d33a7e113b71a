"""Time the recommend search in-process and as a whole process; report candidates per second.

Usage: python benchmarks/recommend_speed.py
The target is a default search under one second on a 2-core machine (issue: zplan recommend).
"""

from __future__ import annotations

import subprocess
import sys
import time

from zplan.scenario_options import ScenarioOptions, build
from zplan.errors import PlanError
from zplan.recommend import plan_for_runner, search

CASES = [
    dict(model="llama-3.1-8b", gpus="8", global_batch=64),
    dict(model="llama-3.1-70b", gpus="64", seq_len=8192, global_batch=512),
    # seq 4096: at 8192 nothing fits 405B on 1024 GPUs in the torch layout the CLI plans for
    # (the all-gather stream and a checkpointed forward's blocks reserved; docs/accuracy-notes.md 9al, 9am)
    dict(model="llama-3.1-405b", gpus="1024", seq_len=4096, global_batch=2048),
    # DeepSpeed's ZeRO-3 at its defaults: its coordinator simulated per candidate (1.0-1.1 s whole
    # process before 2026-12-07, when first-k's least k was still found by bisection)
    dict(model="llama-3.1-70b", gpus="64", global_batch=512, runner="deepspeed"),
]


def main() -> None:
    for case in CASES:
        gb = case.pop("global_batch")
        runner = case.pop("runner", None)
        opts = ScenarioOptions(**case)
        plan_for_runner(opts, runner)  # the layout the CLI plans in (zplan's trainer: torch)
        sc = build(opts)
        t0 = time.perf_counter()
        try:
            r = search(sc, gb)
        except PlanError as e:  # the search ran; nothing fitted (the CLI exits 1 with this line)
            print(f"{case['model']} on {case['gpus']}: {time.perf_counter() - t0:.2f} s, nothing fits: {e}")
            continue
        dt = time.perf_counter() - t0
        args = ["recommend", "--global-batch", str(gb)] + (["--for", runner] if runner else [])
        for k, v in case.items():
            flag = f"--{k.replace('_', '-')}"
            args += [flag] if v is True else [flag, str(v)]
        t1 = time.perf_counter()
        p = subprocess.run([sys.executable, "-m", "zplan", *args], stdout=subprocess.DEVNULL,
                           stderr=subprocess.PIPE, text=True)
        proc = time.perf_counter() - t1
        if p.returncode != 0:  # a process that failed early would time nothing
            print(f"zplan {' '.join(args)}: exit {p.returncode}: {p.stderr.strip()[-300:]}")
        print(f"{case['model']} on {case['gpus']}{' for ' + runner if runner else ''}: {r.evaluated} candidates in {dt * 1e3:.0f} ms = "
              f"{r.evaluated / dt:,.0f}/s; whole process {proc * 1e3:.0f} ms "
              f"({proc:.2f} of the 1 s budget); winner {r.winner.label()}")


if __name__ == "__main__":
    main()
