"""The one place zplan starts processes: run torchrun, pass its exit code on, restart a failed
run, and leave nothing behind.

Ctrl-C, SIGTERM or SIGHUP (a closed terminal or ssh session) is forwarded to torchrun and to
every rank (ranks run in sessions of their own: zplan/launch/procs.py finds them); if they have
not ended after GRACE_S they are killed, and the launcher exits 128 + the signal (130, 143,
129). Before, SIGHUP ended the launcher alone and left torchrun and the ranks training. The wait is a poll loop: Popen.wait()
entered before a signal is resumed after the handler returns (PEP 475), so a grace period that
relies on it being interrupted never fires.

A run that stops at a step boundary (zplan's trainer: zplan/trainer/stop.py) is given the first
signal at its ranks alone, SIGTERM for SIGHUP, and STOP_GRACE_S to finish the step and write its
checkpoint; torchrun, left alone, sees its ranks end and ends. A second signal kills everything
at once, as before. A script of the user's stops so where it polls `ctx.stop_requested()`
(zplan/trainer/api.py), whose first call writes the file $ZPLAN_STOP_MARKER names (empty) (in a folder
this launch makes and removes): it is how the launcher knows, when a signal comes. A stop it
agreed on is written there too, so that a script that finished its work before asking again is
not said to be interrupted.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from .procs import become_subreaper, children, die_with_parent, descendants, kill_tree, reap, signal_all

GRACE_S = 5.0
STOP_GRACE_S = 300.0  # a step and a checkpoint; Slurm's and Kubernetes' own kill comes after 30 s
# SIGUSR1: a stop request of the ranks (Slurm's --signal reaches every process of a step; unhandled,
# it ended the launcher)
FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1)
POLL_S = 0.05
STOP_MARKER_ENV = "ZPLAN_STOP_MARKER"  # a script's ranks write it: they stop at a step (api.stop_requested)


def run(argv: list[str], env: dict[str, str], keep_fds: tuple[int, ...] = (), stops_at_step: bool = False) -> int:
    """Run argv; its exit code, or 128 + the signal that ended the launcher. `stops_at_step`:
    its ranks end at a step boundary with a checkpoint when signalled (the module docstring), as
    a script's do once its ranks have asked whether to stop (the marker)."""
    marks = Path(tempfile.mkdtemp(prefix="zplan-launch-"))
    marker = marks / "stops-at-step"
    full_env = dict(os.environ)
    full_env.update(env)
    full_env[STOP_MARKER_ENV] = str(marker)
    full_env.setdefault("OMP_NUM_THREADS", "1")  # torchrun's default, without its banner
    become_subreaper()
    me = os.getpid()
    before = set(descendants(me))
    # keep_fds: the run folder's lock, shared with torchrun so that it stays held while torchrun
    # lives, whatever ends the launcher
    try:
        proc = subprocess.Popen(argv, env=full_env, start_new_session=True, pass_fds=keep_fds,
                                preexec_fn=die_with_parent())
    except BaseException:
        shutil.rmtree(marks, ignore_errors=True)
        raise
    got: list[int] = []
    stopping: list[int] = []  # the first signal, where the ranks were asked to stop after their step

    def ours() -> list[int]:
        return [p for p in descendants(me) if p not in before]

    def forward(signum, _frame):
        got.append(signum)
        ranks = children(proc.pid) if len(got) == 1 and (stops_at_step or marker.exists()) else []
        if ranks:  # none yet (torchrun still starting them): everything stops now, as before
            stopping.append(signum)
            signal_all(ranks, signal.SIGTERM if signum == signal.SIGHUP else signum)
            try:  # a hung-up terminal (SIGHUP) refuses the write: the stop goes on
                os.write(2, f"zplan: {signal.Signals(signum).name}: the ranks stop after this step, with a "
                            f"checkpoint where the run writes them (a second signal stops them at once)\n".encode())
            except OSError:
                pass
            return
        signal_all(ours(), signum if len(got) == 1 else signal.SIGKILL)  # a second signal: at once
        if len(got) == 2 and stopping:
            try:
                os.write(2, f"zplan: {signal.Signals(signum).name} again: every rank killed at once, "
                            f"without waiting for the step's checkpoint\n".encode())
            except OSError:
                pass

    # SIGHUP ignored when zplan started stays ignored (`nohup zplan launch`); SIGINT and SIGTERM
    # are always forwarded (a background job's ignored SIGINT is the shell's, not a wish)
    old = {s: signal.signal(s, forward) for s in FORWARDED
           if not (s == signal.SIGHUP and signal.getsignal(s) is signal.SIG_IGN)}
    try:
        deadline = None
        while (rc := proc.poll()) is None:
            if got and deadline is None:
                deadline = time.monotonic() + (STOP_GRACE_S if stopping else GRACE_S)
            if deadline is not None and time.monotonic() > deadline:
                signal_all(ours(), signal.SIGKILL)
            time.sleep(POLL_S)
    finally:
        for p in ours():  # ranks torchrun left behind (adopted by this subreaper), and their children
            kill_tree(p)
        for s, h in old.items():
            signal.signal(s, h)
        reap()
        try:
            said = marker.read_text()  # a script's ranks: "" asked, "stopped by ..." stopped
        except OSError:
            said = None
        shutil.rmtree(marks, ignore_errors=True)
    if got and stopping and not stops_at_step and rc == 0 and said == "":
        return 0  # the script finished its work before it asked again: not interrupted
    if got:
        return 128 + got[0]
    if rc < 0:  # torchrun itself ended by a signal no one here sent (the OOM killer, kill -9)
        print(f"zplan: error: torchrun was ended by {signal.Signals(-rc).name}, from outside zplan (the "
              f"kernel's OOM killer, or a kill); its ranks were stopped", file=sys.stderr)
    return 128 - rc if rc < 0 else rc


def run_with_restarts(argv: list[str], env: dict[str, str], max_restarts: int,
                      keep_fds: tuple[int, ...] = (), stops_at_step: bool = False) -> int:
    """Run, and after a failure start a fresh torchrun (a new rendezvous, store and port) up to
    max_restarts times; the trainer resumes from the newest complete checkpoint on an attempt
    after the first ($ZPLAN_ATTEMPT). A usage error (exit 2) or a signal is not retried."""
    for attempt in range(max_restarts + 1):
        rc = run(argv, {**env, "ZPLAN_ATTEMPT": str(attempt)}, keep_fds, stops_at_step)
        if rc in (0, 2) or rc in (128 + s for s in FORWARDED) or attempt == max_restarts:
            return rc
        print(f"zplan: attempt {attempt + 1} failed (exit {rc}); restarting "
              f"({attempt + 1} of {max_restarts} restarts)", file=sys.stderr, flush=True)
    return rc
