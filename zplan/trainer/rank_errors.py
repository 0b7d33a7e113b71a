"""Errors inside a rank, reported like the CLI's: one line, exit 2 for usage, 1 for a plan or
run that cannot go on, the traceback only under ZPLAN_DEBUG=1.

Under zplan launch (ZPLAN_LAUNCHER=1) a failing rank writes its line into the error file that
torchrun names in $TORCHELASTIC_ERROR_FILE and prints nothing: the launcher (zplan.launch.elastic)
prints each distinct line once, from the ranks that failed first. Under plain torchrun or Slurm
the failing rank prints its line itself.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time

# what a rank sees when another rank died first: not the cause, reported only if nothing else is
_PEER_LOST = ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "connectFullMesh",
              "Connection refused", "Timed out waiting", "DistNetworkError", "failed to recv", "failed to send",
              # NCCL (ProcessGroupNCCL): a peer gone, or the watchdog aborting after it
              "remote process exited", "ncclRemoteError", "Watchdog caught collective operation timeout",
              "communicator was aborted", "NCCL communicator aborted")


def dcp_failures(e: BaseException) -> list[BaseException]:
    """The per-rank exceptions inside DCP's CheckpointException. Its `failures` maps each rank
    to (exception, traceback summary) on torch 2.11 and 2.13; a bare exception is taken as is."""
    failures = getattr(e, "failures", None)
    if not isinstance(failures, dict):
        return []
    out = [v[0] if isinstance(v, tuple) and v else v for v in failures.values()]
    return [x for x in out if isinstance(x, BaseException)]


def classify(e: BaseException) -> tuple[str, int, bool]:
    """(one line, exit code, whether it is only the echo of another rank's failure)."""
    from ..errors import ZplanError

    from .stop import StoppedBeforeTraining

    if isinstance(e, StoppedBeforeTraining):
        # SIGTERM is also how torchrun stops the other ranks once one has failed: then an echo
        # (zplan.launch.elastic prints it only where no rank failed on its own)
        return str(e), e.exit_code, e.exit_code == 128 + signal.SIGTERM
    if isinstance(e, ZplanError):
        return str(e), e.exit_code, False
    if isinstance(e, KeyboardInterrupt):
        return "interrupted", 130, False
    failures = dcp_failures(e)  # DCP's CheckpointException: one per failed rank
    if failures:
        inner = [classify(x) for x in failures]
        if inner:  # the most telling: zplan's own lines, then the rest, then echoes
            line, code, secondary = min(inner, key=lambda t: (t[2], t[0].startswith("internal error")))
            if line.startswith("internal error"):
                x = failures[0]
                from .checkpoint import first_sentence

                line = f"checkpoint cannot be loaded ({type(x).__name__}: {first_sentence(str(x))})"
            return line, code, secondary
    if isinstance(e, OSError):
        where = f"{e.filename}: " if e.filename else ""
        return f"{where}{e.strerror or e} (errno {e.errno}); check the path and its filesystem", 1, False
    text = f"{type(e).__name__}: {e}"
    if type(e).__name__ == "OutOfMemoryError" or "CUDA out of memory" in text:
        first = str(e).split(". GPU")[0].splitlines()[0][:200] if str(e) else "out of memory"
        return (f"the GPU ran out of memory ({first}): plan again with more --headroom, a smaller "
                f"--micro-batch or more --checkpointing (zplan recommend), or set "
                f"PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True against fragmentation", 1, False)
    if any(s in text for s in _PEER_LOST):
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        return f"lost contact with another rank ({first[:200]}); see that rank's error", 1, True
    first = str(e).splitlines()[0][:300] if str(e) else ""
    return (f"internal error: {type(e).__name__}: {first} (rerun with ZPLAN_DEBUG=1 and report it)",
            1, False)


def report(e: BaseException) -> int:
    """Report `e` the zplan way; return the exit code."""
    line, code, secondary = classify(e)
    rank = os.environ.get("RANK", "0")
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if path:
        from ..errors import ZplanError
        from ..files import write_text

        record = {"message": {"message": line, "extraInfo": {"py_callstack": "",
                                                             "timestamp": str(int(time.time()))}},
                  "zplan": {"line": line, "exit_code": code, "secondary": secondary,
                            "rank": int(rank), "time_s": time.time(), "stopped": _stopped(e)}}
        try:  # renamed into place whole: torchrun's agent, which kills the other ranks once one
            # fails, reads the file of a rank killed mid-write (an empty file crashed it)
            write_text(path, json.dumps(record), "error file")
        except (OSError, ZplanError):
            path = None
    if not (path and os.environ.get("ZPLAN_LAUNCHER") == "1"):
        what = "" if _stopped(e) else "error: "
        print(f"zplan trainer: {what}rank {rank}: {line}", file=sys.stderr, flush=True)
    return code


def _stopped(e: BaseException) -> bool:
    """A stop the user asked for before the first step (stop.StoppedBeforeTraining): said, not
    an error."""
    from .stop import StoppedBeforeTraining

    return isinstance(e, StoppedBeforeTraining)


def leave(code: int):
    """End this rank's process now with `code`, its output flushed: no interpreter finalization
    and no C++ static destructors. A process group that the model's FSDP state or a device mesh
    still references outlives destroy_process_group; gloo's worker threads can then abort the
    process in interpreter teardown ("terminate called without an active exception", SIGABRT;
    seen in 2 of 3 whole-suite runs once, pytorch/pytorch#179291 describes it). Everything a
    rank writes (checkpoints, the run report) is complete and closed before it gets here."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError, RuntimeError):  # a closed or broken pipe, or a write the
            # stop handler cut into (a reentrant flush), must not bring teardown back
            pass
    os._exit(code)


def guarded(fn, *args) -> int:
    """Run fn(*args) -> exit code; any error becomes one line (the traceback with ZPLAN_DEBUG=1).

    After an error the process leaves at once (os._exit): gloo's teardown with a peer gone can
    abort, and the other ranks must see this one gone to fail in turn rather than wait."""
    try:
        return fn(*args)
    except SystemExit:
        raise
    except BaseException as e:
        ignore_stop_signals()
        if os.environ.get("ZPLAN_DEBUG") == "1":
            raise
        leave(report(e))


def ignore_stop_signals() -> None:
    """A failed rank ignores stop signals while it writes its line and leaves: torchrun SIGTERMs
    the ranks once one has failed, and where two fail alike (a checkpoint that no rank can load)
    that SIGTERM reached one mid-write, whose stop handler then cut the report short (it raised
    stop.StoppedBeforeTraining: a traceback and exit 1 for a usage error, seen once in CI; it
    would now end the rank with the stop's line and 143 instead of the error's).
    leave() follows at once; torchrun's SIGKILL 30 s on still ends a rank that hangs here."""
    import threading

    from .stop import STOP_SIGNALS

    if threading.current_thread() is threading.main_thread():
        for s in STOP_SIGNALS:
            signal.signal(s, signal.SIG_IGN)
