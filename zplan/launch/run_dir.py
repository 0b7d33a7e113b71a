"""The run directory: where the plan, the checkpoints and the report go. Checked before any rank
starts (the launcher) and again by the trainer (which may run under plain torchrun or Slurm).

Torch-free: the launcher calls it in its dry runs too.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import tempfile
from pathlib import Path

from ..errors import PlanError, UsageError

CKPT_BYTES_PER_PARAM = 12  # fp32 master weights + AdamW's two fp32 moments (torch.optim.AdamW)


def checkpoint_bytes(param_count: int) -> int:
    """Bytes of one checkpoint: 12 per parameter (fp32 weights, exp_avg, exp_avg_sq), the
    state DCP writes for AdamW; the few scalars beside them are negligible."""
    return CKPT_BYTES_PER_PARAM * param_count


def holds_run(p: Path) -> str:
    """What of a run a folder holds (its report, its checkpoints), '' for none: a fresh launch
    there would put its checkpoints beside the old run's (a later --resume loading the newer of
    either) and replace the old run's report and plan."""
    steps = sorted(step_folders(p))
    found = (["run_report.json"] if (p / "run_report.json").is_file() else []) + steps[-1:]
    return ", ".join(found)


def check_run_dir(path: str | Path, resume: bool = False, need_bytes: int = 0, create: bool = True,
                  fresh: bool | None = None) -> Path:
    """Refuse, with one line, a run directory that is the wrong kind of file, missing on
    --resume, unwritable, or without room for one checkpoint; return it resolved. `fresh` (a
    new run of zplan's trainer; default: not resume) also refuses one that holds a run. A
    user's script keeps its own folder's meaning (api.init resumes by itself)."""
    p = Path(path)
    if p.exists() and not p.is_dir():
        raise UsageError(f"run directory {p} exists and is not a directory; pass a folder with --run-dir")
    if resume and not p.is_dir():
        raise UsageError(f"--resume: run directory {p} does not exist; pass the run's folder with --run-dir")
    if (not resume if fresh is None else fresh) and p.is_dir():
        held = holds_run(p)
        if held:
            raise UsageError(f"run directory {p} already holds a run ({held}): --resume continues it; pass "
                             f"another --run-dir for a new run")
    if not create and not p.is_dir():
        return p.resolve()
    made = [a for a in (p, *p.parents) if not a.exists()]  # the folders mkdir makes, deepest first
    try:
        try:
            p.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryFile(dir=p, prefix=".zplan-write-check-"):
                pass
        except OSError as e:  # the machine refused the write (read-only, permission, full): exit 1,
            # as docs/reliability.md says; a path that cannot be a folder is a usage error
            kind = UsageError if e.errno in (errno.ENOTDIR, errno.EEXIST, errno.ENAMETOOLONG) else PlanError
            raise kind(f"run directory {p} is not writable ({e.strerror}); pass another with --run-dir") from None
        if need_bytes:
            free = shutil.disk_usage(p).free
            if free < need_bytes:
                raise PlanError(f"run directory {p} has {free / 1e9:.2f} GB free but one checkpoint needs about "
                                f"{need_bytes / 1e9:.2f} GB: free space or pass another --run-dir")
    except (UsageError, PlanError):
        for a in made:  # a refused run leaves no empty folder behind
            with contextlib.suppress(OSError):
                a.rmdir()
        raise
    return p.resolve()


LOCK_NAME = ".zplan-launch.lock"


def hold_run_dir(run: Path):
    """An exclusive lock on the run directory for as long as the returned file stays open (the
    launch): a second `zplan launch` there (a --resume while the run still trains) is refused in
    one line; before, it resumed from the first run's checkpoint and removed the checkpoint
    folder the first was writing (.tmp-step_N), which then failed. fcntl.flock: released by the
    kernel when the launcher and torchrun (which shares the open file, runner.run's keep_fds) have
    both ended, however they end. None where the platform has no flock."""
    try:
        import fcntl
    except ImportError:
        return None
    f = open(run / LOCK_NAME, "a")  # noqa: SIM115 - held open for the launch's lifetime
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        f.close()
        raise UsageError(f"another zplan launch is running in {run} (it holds {run / LOCK_NAME}); wait for "
                         f"it to end, or pass another --run-dir") from None
    return f


def step_folders(run: Path) -> set[str]:
    """The run's checkpoint folders (step_N) now."""
    try:
        return {c.name for c in run.iterdir() if c.name.startswith("step_") and c.is_dir()}
    except OSError:
        return set()


def writable_report(path: str | Path, other: str = "pass another --run-dir") -> None:
    """Refuse a report (or consolidate's output, `other` naming its fix) that is a directory or a
    special file."""
    p = Path(path)
    if p.exists() and not p.is_file():
        raise UsageError(f"{p} exists and is not a regular file; move it away or {other}")
    if os.path.realpath(p).startswith(("/proc/", "/sys/", "/dev/")):
        raise UsageError(f"{p} is under /proc, /sys or /dev; {other}")


def resumed_data_note(run: Path, data: str | None) -> str | None:
    """A resume reading other data than the run's report says it trained on (its config's
    `data`: a path as the run was given it, or None for the built-in synthetic tokens): said,
    not refused (a run may move on to new data on purpose). None where they agree or the report
    is missing or unreadable (it is data: anything but a string or null names nothing)."""
    from ..files import read_json

    report = run / "run_report.json"
    if not report.is_file():
        return None
    try:
        config = read_json(report, "run report").get("config", {})
        before = config.get("data")
    except (UsageError, AttributeError):
        return None
    if before is not None and not isinstance(before, str):
        return None
    if (before is None) == (data is None) and (data is None or Path(before).resolve() == Path(data).resolve()):
        return None
    was = f"--data {before}" if before is not None else "the built-in synthetic tokens"
    now = f"--data {data}" if data is not None else "the built-in synthetic tokens (no --data)"
    return f"the run's report says it trained on {was}; this resume reads {now}"
