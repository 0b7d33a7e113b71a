"""`python -m zplan.launch.elastic [torchrun options] SCRIPT ...`: torchrun, reporting a failure
the zplan way.

This is torch.distributed.run's own `main` (the same options, agent, rendezvous and restarts),
with its failure turned into an exit code and one line per distinct error instead of torchrun's
banner and traceback:
- the exit code is the failed ranks' own when they agree (a script's `sys.exit(3)` gives 3;
  a rank killed by signal S gives 128 + S), else 1;
- a zplan trainer rank writes its one-line error into torchrun's per-rank error file
  ($TORCHELASTIC_ERROR_FILE, see zplan/trainer/rank_errors.py); each distinct line is printed
  once, the ranks that failed first before those that only lost contact with them.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys


def _zplan_record(failure) -> dict | None:
    try:
        with open(failure.error_file) as f:
            rec = json.load(f).get("zplan")
    except (OSError, ValueError, AttributeError, TypeError):
        return None
    return rec if isinstance(rec, dict) else None


def summarize(failures: dict) -> tuple[list[str], int]:
    """(lines to print, exit code) for torchrun's failures: global rank -> ProcessFailure."""
    rows = []
    for rank, f in sorted(failures.items()):
        rec = _zplan_record(f)
        if rec is not None:
            rows.append((bool(rec.get("secondary")), rank, str(rec.get("line", "")), int(rec.get("exit_code", 1))))
        elif f.exitcode < 0:
            sig = -f.exitcode
            name = signal.Signals(sig).name if sig in signal.valid_signals() else str(sig)
            rows.append((False, rank, f"rank {rank} was killed by {name}", 128 + sig))
        else:
            rows.append((False, rank, f"rank {rank} exited with code {f.exitcode}", f.exitcode))
    primary = [r for r in rows if not r[0]] or rows
    codes = {r[3] for r in primary}
    lines, seen = [], set()
    for _, rank, line, _ in primary:
        if line not in seen:
            seen.add(line)
            lines.append(line)
    return [f"zplan: error: {line}" for line in lines], codes.pop() if len(codes) == 1 else 1


def main(argv: list[str] | None = None) -> int:
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main as torchrun

    if os.environ.get("ZPLAN_DEBUG") != "1":  # the failure is summarised below instead
        logging.getLogger("torch.distributed.elastic.multiprocessing.api").setLevel(logging.CRITICAL)
    os.environ["ZPLAN_LAUNCHER"] = "1"  # ranks leave their error lines to us
    try:
        torchrun(argv)
    except ChildFailedError as e:
        lines, code = summarize(e.failures)
        for line in lines:
            print(line, file=sys.stderr, flush=True)
        return code
    except SignalException as e:
        return 128 + int(e.sigval)
    return 0


if __name__ == "__main__":
    sys.exit(main())
