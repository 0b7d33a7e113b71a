"""Finding every process a launch started, so none outlives it.

torchrun starts each rank in a session of its own (start_new_session=True), so a signal to
torchrun's process group never reaches the ranks, and a rank whose torchrun died is reparented
away. The launcher therefore makes itself a child subreaper (Linux prctl PR_SET_CHILD_SUBREAPER:
orphaned descendants are reparented to it, not to init) and finds descendants through /proc.
"""

from __future__ import annotations

import ctypes
import os
import signal
from pathlib import Path

PR_SET_CHILD_SUBREAPER = 36


def become_subreaper() -> bool:
    """Adopt orphaned descendants (Linux); False where the kernel does not offer it."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


PR_SET_PDEATHSIG = 1


def die_with_parent():
    """A preexec_fn for torchrun: SIGTERM it when the launcher dies (kill -9, the OOM killer),
    which no handler of the launcher's can forward; torchrun then stops its ranks. prctl is looked
    up here, in the parent (no dlopen between fork and exec); a launcher that died before the
    child's prctl is caught by its parent pid. PR_SET_PDEATHSIG follows the thread that forks:
    runner.run starts torchrun from the launcher's main thread. None where there is no prctl."""
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    parent = os.getpid()

    def child() -> None:
        prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
        if os.getppid() != parent:  # the launcher ended before prctl took hold
            os.kill(os.getpid(), signal.SIGTERM)
    return child


def _parents() -> dict[int, int]:
    out = {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            stat = (d / "stat").read_text()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        if fields[0] != "Z":  # a zombie has ended
            out[int(d.name)] = int(fields[1])
    return out


def descendants(pid: int) -> list[int]:
    """Live processes below pid (children, their children, ...)."""
    kids: dict[int, list[int]] = {}
    for child, parent in _parents().items():
        kids.setdefault(parent, []).append(child)
    out, todo = [], list(kids.get(pid, []))
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(kids.get(p, []))
    return out


def children(pid: int) -> list[int]:
    """Live processes whose parent is pid (torchrun's: the ranks)."""
    return [c for c, parent in _parents().items() if parent == pid]


def signal_all(pids, sig: int) -> None:
    for p in pids:
        try:
            os.kill(p, sig)
        except (ProcessLookupError, PermissionError):
            pass


def reap() -> None:
    """Collect the exit status of adopted children that have ended (no zombies left behind)."""
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def kill_tree(root: int, sig: int = signal.SIGKILL) -> list[int]:
    """Signal root's descendants and root; return who was signalled."""
    pids = descendants(root) + [root]
    signal_all(pids, sig)
    return pids
