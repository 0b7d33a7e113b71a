"""The one place zplan starts processes: run torchrun, pass its exit code on, and leave nothing
behind. Ctrl-C or SIGTERM is forwarded to torchrun's whole process group (torchrun then ends
every rank); if it has not exited after a grace period, the group is killed."""

from __future__ import annotations

import os
import signal
import subprocess

GRACE_S = 15.0


def run(argv: list[str], env: dict[str, str]) -> int:
    full_env = dict(os.environ)
    full_env.update(env)
    proc = subprocess.Popen(argv, env=full_env, start_new_session=True)
    forwarded = {"sig": None}

    def forward(signum, _frame):
        forwarded["sig"] = signum
        try:
            os.killpg(proc.pid, signum)
        except ProcessLookupError:
            pass

    old = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        while True:
            try:
                rc = proc.wait(timeout=GRACE_S if forwarded["sig"] else None)
                break
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
    finally:
        for s, h in old.items():
            signal.signal(s, h)
        try:  # nothing of the group may outlive the launcher
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    if rc < 0:  # killed by a signal: the shell convention
        return 128 - rc
    return rc
