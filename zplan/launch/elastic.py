"""`python -m zplan.launch.elastic [torchrun options] SCRIPT ...`: torchrun, reporting a failure
the zplan way.

This is torch.distributed.run's own `main` (the same options, agent, rendezvous and restarts),
with its failure turned into an exit code and one line per distinct error instead of torchrun's
banner and traceback:
- the exit code is the failed ranks' own when they agree (a script's `sys.exit(3)` gives 3;
  a rank killed by signal S gives 128 + S), else 1;
- a zplan trainer rank writes its one-line error into torchrun's per-rank error file
  ($TORCHELASTIC_ERROR_FILE, see zplan/trainer/rank_errors.py); each distinct line is printed
  once, the ranks that failed first before those that only lost contact with them or were stopped by torchrun
  (SIGTERM) after another rank failed, or killed by torchrun (SIGKILL) when its SIGTERM had not
  ended them within 30 s (PContext.close's timeout: a rank blocked on a collective with a dead
  peer, as NCCL's can be; told from the OOM killer's SIGKILL by torchrun's timestamps);
- SIGUSR1 (a stop request to zplan's trainer: zplan/trainer/stop.py) is passed on to the ranks,
  not fatal to torchrun: `kill -USR1` of torchrun, or Slurm's `--signal` where it reaches only
  srun's task, stops the run after a step; a rank notes the first signal and ignores repeats, so
  a signal that reaches every process besides is harmless.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys

from .procs import children, signal_all


# torchrun's PContext.close(timeout=30): SIGTERM to the ranks still running once one has failed,
# SIGKILL to those alive 30 s later; it records those failures after close() returns
# (SubprocessContext._poll), so their ProcessFailure.timestamp is at least 30 s after the first's
TORCHRUN_KILL_AFTER_S = 30


def _zplan_record(failure) -> dict | None:
    try:
        with open(failure.error_file) as f:
            rec = json.load(f).get("zplan")
    except (OSError, ValueError, AttributeError, TypeError):
        return None
    return rec if isinstance(rec, dict) else None


def _ranks(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks))


def summarize(failures: dict) -> tuple[list[str], int]:
    """(lines to print, exit code) for torchrun's failures: global rank -> ProcessFailure.

    A zplan rank's own line is printed once however many ranks report it; a rank without one
    is described by its exit code or signal. Lines of ranks that only lost contact with a rank
    that failed first are left out when there is any other."""
    groups: dict[tuple[bool, str, int], list[int]] = {}
    stamps = {rank: getattr(f, "timestamp", None) for rank, f in failures.items()}
    for rank, f in sorted(failures.items()):
        rec = _zplan_record(f)
        if rec is not None:
            line = str(rec.get("line", ""))  # a stop before the first step is said, not an error
            key = (bool(rec.get("secondary")), line if rec.get("stopped") is True else f"error: {line}",
                   int(rec.get("exit_code", 1)))
        elif f.exitcode < 0:
            sig = -f.exitcode
            name = signal.Signals(sig).name if sig in signal.valid_signals() else str(sig)
            # SIGTERM is how torchrun stops the other ranks once one has failed: an echo
            key = (sig == signal.SIGTERM, f"error: {{ranks}} killed by {name}", 128 + sig)
        else:
            key = (False, f"error: {{ranks}} exited with code {f.exitcode}", f.exitcode)
        groups.setdefault(key, []).append(rank)
    primary = {k: v for k, v in groups.items() if not k[0]}
    killed = {k for k in primary if k[1] == "error: {ranks} killed by SIGKILL"}
    others = [stamps[r] for k, ranks in primary.items() if k not in killed for r in ranks]
    if killed and others and None not in others:
        first = min(others)
        echoes = {k for k in killed if all(stamps[r] is not None and stamps[r] - first >= TORCHRUN_KILL_AFTER_S - 2
                                           for r in primary[k])}
        primary = {k: v for k, v in primary.items() if k not in echoes}
    primary = primary or groups
    lines = [f"zplan: {line.replace('{ranks}', _ranks(ranks))}" for (_, line, _), ranks in primary.items()]
    codes = {code for (_, _, code) in primary}
    return lines, codes.pop() if len(codes) == 1 else 1


def _pass_on(signum: int, _frame) -> None:
    """Give a signal to this torchrun's ranks: its children (torchrun starts each with Popen)."""
    signal_all(children(os.getpid()), signum)


def main(argv: list[str] | None = None) -> int:
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main as torchrun

    if os.environ.get("ZPLAN_DEBUG") != "1":  # the failure is summarised below instead
        for name in ("torch.distributed.elastic.multiprocessing.api",
                     "torch.distributed.elastic.multiprocessing.errors"):
            logging.getLogger(name).setLevel(logging.CRITICAL)
    os.environ["ZPLAN_LAUNCHER"] = "1"  # ranks leave their error lines to us
    # SIGUSR1 is the ranks' (a stop request: zplan/trainer/stop.py); unhandled it would end torchrun.
    # A handler, not SIG_IGN: the ranks, exec'd, start with the default action again.
    signal.signal(signal.SIGUSR1, _pass_on)
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
