"""The long fuzz run: up to 100,000 hostile cases over every planner command and input file type.

Usage: python benchmarks/fuzz_cli.py [--cases 100000] [--minutes 60] [--out report.json]

The same generators and oracle as tests/test_fuzz.py (tests/fuzzing.py, tests/fuzz_oracle.py),
run in chunks of fresh hypothesis runs until the case count or the time is reached; nothing is
raised on a bad case: each problem class is counted with its first example, and the report
gives cases per command and exit code, cases per second and the slowest cases.
"""

from __future__ import annotations

import argparse
import collections
import itertools
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from hypothesis import HealthCheck, given, settings  # noqa: E402

from tests.fuzz_oracle import problems, run_case  # noqa: E402
from tests.fuzzing import cases  # noqa: E402

CHUNK = 1000


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", type=int, default=100_000)
    ap.add_argument("--minutes", type=float, default=600.0)
    ap.add_argument("--out", default=None, help="also write the report as JSON here")
    args = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="zplan-fuzz-"))
    ids = itertools.count()
    outcomes: collections.Counter = collections.Counter()
    found: collections.Counter = collections.Counter()
    first: dict[str, list] = {}
    slowest: list[tuple[float, str]] = []
    stop = time.monotonic() + args.minutes * 60
    t0 = time.monotonic()

    @settings(max_examples=min(CHUNK, args.cases), deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(case=cases())
    def one(case):
        if time.monotonic() > stop:
            return
        i = next(ids)
        rc, out, err, dt = run_case(case, root / str(i))
        outcomes[f"{case.command} exit {rc}"] += 1
        slowest.append((round(dt, 3), " ".join(case.argv)[:200]))
        slowest.sort(key=lambda x: -x[0])
        del slowest[10:]
        for p in problems(case, rc, out, err):
            key = p[:80]
            found[key] += 1
            if key not in first:
                first[key] = [case.argv, err.strip()[-300:],  # and the files, to replay it
                              {n: d[:2000].decode("utf-8", "replace") for n, d in case.files.items()},
                              (case.project or b"")[:2000].decode("utf-8", "replace"), case.specials]
                print(f"new problem: {key}\n  {case.argv}\n  {first[key][1]}", file=sys.stderr)

    while sum(outcomes.values()) < args.cases and time.monotonic() < stop:
        one()
        shutil.rmtree(root, ignore_errors=True)  # each case had its own folder; clear the chunk's
        root.mkdir()
        n = sum(outcomes.values())
        print(f"{n} cases, {sum(found.values())} problems, {n / (time.monotonic() - t0):.1f} cases/s",
              file=sys.stderr)
    n = sum(outcomes.values())
    report = {"cases": n, "seconds": round(time.monotonic() - t0, 1),
              "problems": sum(found.values()), "classes": {k: [v, first[k]] for k, v in found.items()},
              "outcomes": dict(sorted(outcomes.items())), "slowest": slowest}
    print(json.dumps(report, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
