"""A run asked to stop ends at a step boundary with a checkpoint, so `zplan launch --resume`
loses no step: SIGTERM (what Slurm and Kubernetes send ahead of their SIGKILL, 30 s later by
default: Slurm's KillWait, Kubernetes' terminationGracePeriodSeconds), SIGUSR1 (`kill -USR1`,
or Slurm's `--signal=USR1@<seconds>`: zplan's torchrun, zplan.launch.elastic, which zplan
launch and its `--slurm` script run, passes it on to the ranks), SIGINT (Ctrl-C, which zplan
launch forwards to the ranks). Before, any of them killed the ranks mid-step and the run fell
back to its last periodic checkpoint. A script of one's own gets the same through
`ctx.stop_requested()` (zplan/trainer/api.py).

A rank's handler only notes the signal. At the end of every step the ranks agree on it (a MAX
all-reduce of one integer on the host: every zplan group has gloo for the host, so this neither
waits for the GPU nor counts as the step's traffic), so that all stop after the same step,
whichever of them the signal reached first. The handlers stay in place until the run's last
checkpoint is written, so a signal during a save is noted, not fatal.

A rank ignores further signals: under Slurm or Kubernetes the same SIGTERM reaches a rank twice,
straight and through torchrun (whose own handler passes it on to its workers and kills them 30 s
later), and a rank that died of the second would die mid-step. What stops a run at once is
zplan launch's answer to a second signal (a SIGKILL of everything) or the scheduler's SIGKILL.
"""

from __future__ import annotations

import signal
import threading

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)


class StoppedBeforeTraining(Exception):
    """A stop signal before the first step (imports, the process group, the model, a resume):
    nothing to save, so the rank ends there, with 128 + the signal and one line that is not an
    error (rank_errors.report marks it, zplan.launch.elastic prints it as such).

    Reported and ended from the handler itself (StopRequests._note), not raised: Python runs a
    handler wherever the main thread is, and an exception raised there was once swallowed during
    the ranks' start ("Exception ignored in: <function _get_module_lock.<locals>.cb>", under load,
    one run in three): the rank went on, into a rendezvous with a peer that had left (torchrun's
    SIGKILL 30 s later), or trained every step."""

    def __init__(self, signum: int):
        self.exit_code = 128 + signum
        super().__init__(f"stopped by {signal.Signals(signum).name} before its first step; nothing to save")


class StopRequests:
    """While entered (in the main thread: Python runs signal handlers there only), the first
    of STOP_SIGNALS is noted in `signum`; later ones change nothing. Until `armed` (the training
    loop's start) a stop signal ends the rank instead, with StoppedBeforeTraining's one line: a
    rank entered at its start neither dies of the signal's default action (an "error" for a stop
    the user asked for) nor trains on."""

    def __init__(self, armed: bool = True) -> None:
        self.signum = 0
        self.armed = armed
        self._old: dict[int, object] = {}

    def __enter__(self) -> "StopRequests":
        if not self.armed:  # what _note's report runs, loaded now: not imported inside a handler
            from .. import errors, files  # noqa: F401
            from . import rank_errors  # noqa: F401
        if threading.current_thread() is threading.main_thread():
            for s in STOP_SIGNALS:
                self._old[s] = signal.signal(s, self._note)
        return self

    def __exit__(self, *exc) -> None:
        for s, h in self._old.items():
            signal.signal(s, h)
        self._old.clear()

    def _note(self, signum: int, _frame) -> None:
        if not self.armed:
            self.armed = True
            self.signum = signum
            from .rank_errors import leave, report

            leave(report(StoppedBeforeTraining(signum)))  # the rank ends here: nothing to save
        if not self.signum:
            self.signum = signum

    def agreed(self) -> int:
        """The signal any rank has noted, the same on every rank (0: none). A collective: every
        rank calls it after the same step."""
        import torch
        import torch.distributed as dist

        noted = torch.tensor([self.signum], dtype=torch.int64)  # on the host: gloo carries it
        dist.all_reduce(noted, op=dist.ReduceOp.MAX)
        return int(noted)
