"""Running a fuzz case in this process, and the oracle that judges its outcome.

The oracle is independent of the code under test: exit 0, 1 or 2; no traceback and no
"internal error"; on 1 or 2 exactly one "zplan: error:" line, and on 2 it names something the
case gave (a flag, a value, a file, a zplan.toml key); every stderr line is zplan's; --json
output parses as strict JSON with every number finite and, but for headroom_bytes,
non-negative; no case runs past HANG_S.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import os
import signal
import time
from pathlib import Path

from tests.fuzzing import PROJECT_KEYS, Case

HANG_S = 30.0  # a hang, not a speed test: a busy 2-core CI machine ran a bare recommend past 10 s
SIGNED = {"headroom_bytes", "bias"}  # negative by design: how far over the GPU's memory; the public set's mean signed error


def _never_launch(*args, **kwargs):
    raise AssertionError("the fuzzer reached a real torchrun launch")


# ------------------------------------------------------------------ running and judging

class Hang(BaseException):
    """Raised by the alarm in a case that runs past HANG_S (BaseException: no boundary eats it)."""


def _alarm(signum, frame):
    raise Hang()


def run_case(case: Case, folder: Path) -> tuple[int, str, str, float]:
    """Write the case's files into `folder` (new: preset files are cached by path), run it there
    in-process; (exit code, stdout, stderr, seconds)."""
    from zplan.cli.main import run

    folder.mkdir(parents=True)
    for name, data in case.files.items():
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_bytes(data)
    for name, kind in case.specials.items():
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        os.mkfifo(folder / name) if kind == "fifo" else (folder / name).mkdir(exist_ok=True)
    if case.project is not None:
        (folder / "zplan.toml").write_bytes(case.project)
    import zplan.launch.runner

    real_run = zplan.launch.runner.run
    zplan.launch.runner.run = _never_launch  # a safety net: cases always carry --dry-run
    out, err = io.StringIO(), io.StringIO()
    cwd = os.getcwd()
    old = signal.signal(signal.SIGALRM, _alarm)
    t0 = time.perf_counter()
    try:
        os.chdir(folder)
        signal.setitimer(signal.ITIMER_REAL, HANG_S)
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            rc = run(list(case.argv))
    except Hang:
        rc = -1
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
        os.chdir(cwd)
        zplan.launch.runner.run = real_run  # the worker runs other tests after this one
    return rc, out.getvalue(), err.getvalue(), time.perf_counter() - t0


def _no_constant(name: str):
    raise ValueError(f"{name} in --json output")


def _bad_json_numbers(obj, key: str = "") -> str | None:
    stack = [(obj, key)]
    while stack:
        o, k = stack.pop()
        if isinstance(o, dict):
            stack.extend((v, kk) for kk, v in o.items())
        elif isinstance(o, list):
            stack.extend((v, k) for v in o)
        elif isinstance(o, (int, float)) and not isinstance(o, bool):
            if not math.isfinite(o):
                return f"{k} = {o}"
            if o < 0 and k not in SIGNED:
                return f"{k} = {o} is negative"
    return None


def shown(text: str) -> str:
    """How an error line shows a value: whitespace runs as one space, other unprintable
    characters as their Python escapes (README: errors are one printable line)."""
    return "".join(c if c.isprintable() else c.encode("unicode_escape").decode() for c in " ".join(text.split()))


def names_something(case: Case, line: str) -> bool:
    """Does the error line name a flag, value or file of the case (a zplan.toml key as its flag)?"""
    given = [shown(a) for a in case.argv[1:] if len(a.strip()) > 1] + ["zplan.toml"]
    given += ["".join(c if c.isprintable() else f"\\x{ord(c):02x}" if ord(c) < 256 else  # click's escapes
                      c.encode("unicode_escape").decode() for c in a) for a in case.argv[1:]]
    given += [repr(a) for a in case.argv[1:]] + [f"'{a}'" for a in case.argv[1:]]
    # a long value is shown cut short (presets.py: its first 77 characters and "..."): its start names it
    given += [shown(a)[:40] for a in case.argv[1:] if len(shown(a)) > 80]
    if case.project is not None:
        given += ["--" + k.replace("_", "-") for k in PROJECT_KEYS]
    if "" in case.argv:
        given.append("()")  # click's "unexpected extra argument(s) ()" for an empty argument
    if "No such option: " in line:  # click names the option it could not parse, a prefix of one given
        opt = line.split("No such option: ", 1)[1].split()[0]
        given += [opt for a in case.argv if a.startswith(opt)]
    return any(a in line for a in given)


def problems(case: Case, rc: int, out: str, err: str) -> list[str]:
    """What is wrong with one case's outcome; [] when it behaved."""
    found = []
    if rc == -1:
        return [f"hang over {HANG_S:.0f} s"]
    if rc not in (0, 1, 2):
        found.append(f"exit {rc}")
    if "Traceback" in err or "internal error" in err:
        found.append("internal error: " + err.strip().splitlines()[-1][:200])
    lines = err.strip().splitlines()
    errors = [ln for ln in lines if ln.startswith("zplan: error:")]
    stray = [ln for ln in lines if not ln.startswith("zplan: ")]
    if stray:
        found.append(f"stderr line not from zplan: {stray[0][:120]!r}")
    if rc in (1, 2) and len(errors) != 1:
        found.append(f"{len(errors)} error lines on exit {rc}")
    if rc in (1, 2) and any(not ln.isprintable() for ln in lines):
        found.append("unprintable character in stderr")
    if rc == 2 and len(errors) == 1 and not names_something(case, errors[0]):
        found.append(f"error names nothing given: {errors[0][:160]}")
    if rc == 0 and errors:
        found.append("error line on exit 0")
    if "--json" in case.argv and rc in (0, 1) and out.strip():
        try:
            why = _bad_json_numbers(json.loads(out, parse_constant=_no_constant))
        except ValueError as e:
            why = f"not JSON: {e}"
        if why:
            found.append(f"--json: {why}")
    return found
