"""A rank's stop requests (zplan/trainer/stop.py), in a process of their own: the first signal is
noted and the rank goes on; a repeat changes nothing (under Slurm the same SIGTERM reaches a rank
straight and through torchrun: a rank that died of the second died mid-step, a review found);
leaving restores the handlers that were there. The ranks' agreement is tested through torchrun
(tests/test_stop_at_step.py)."""

import os
import signal
import subprocess
import sys

import pytest

SCRIPT = """
import os, signal, sys
from zplan.trainer.stop import StopRequests

before = signal.getsignal(signal.SIGTERM)
with StopRequests() as stops:
    os.kill(os.getpid(), signal.SIG{first})
    print("noted", stops.signum, flush=True)
    if {second}:
        os.kill(os.getpid(), signal.SIG{first})
        os.kill(os.getpid(), signal.SIGTERM)
        assert stops.signum == signal.SIG{first}
        print("still here", flush=True)
print("restored", signal.getsignal(signal.SIGTERM) is before, flush=True)
"""


def _run(first: str, second: bool):
    code = SCRIPT.format(first=first, second=second)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("name", ["TERM", "INT", "USR1"])
def test_the_first_signal_is_noted_and_the_rank_goes_on(name):
    p = _run(name, False)
    assert p.returncode == 0, p.stderr
    assert p.stdout.split() == ["noted", str(int(getattr(signal, "SIG" + name))), "restored", "True"]


@pytest.mark.parametrize("name", ["TERM", "INT", "USR1"])
def test_a_repeated_signal_changes_nothing(name):
    p = _run(name, True)
    assert p.returncode == 0, (p.returncode, p.stderr)
    number = str(int(getattr(signal, "SIG" + name)))
    assert p.stdout.split() == ["noted", number, "still", "here", "restored", "True"]


def test_the_launchs_exit_code_follows_its_own_run_report(tmp_path):
    """zplan launch's exit code after the built-in trainer (cli/launch_cmd._outcome): a run its
    ranks stopped on a signal from outside (torchrun exits 0) is 128 + that signal; a run that
    had finished its last step when the launcher was signalled exits 0; a report an earlier
    launch left (the same file, untouched) decides nothing: no clock is compared."""
    import json
    import os

    from zplan.cli.launch_cmd import _fresh_report, _outcome, _report_stamp

    run = tmp_path
    report = run / "run_report.json"
    report.write_text(json.dumps({"stopped_by": "SIGUSR1", "end_step": 3}))
    before = _report_stamp(run)  # an earlier launch's, left as it was
    assert _fresh_report(run, before) is None and _outcome(0, _fresh_report(run, before), 20) == 0
    tmp = run / "new.json"  # written as the trainer writes it: a new file renamed over the old
    tmp.write_text(json.dumps({"stopped_by": "SIGUSR1", "end_step": 3}))
    os.replace(tmp, report)
    fresh = _fresh_report(run, before)
    assert fresh is not None and _outcome(0, fresh, 20) == 128 + signal.SIGUSR1
    assert _outcome(1, fresh, 20) == 1  # a failure stays a failure
    done = {"stopped_by": None, "end_step": 20}
    assert _outcome(128 + signal.SIGTERM, done, 20) == 0
    assert _outcome(128 + signal.SIGTERM, {"stopped_by": "SIGTERM", "end_step": 7}, 20) == 128 + signal.SIGTERM
    assert _outcome(128 + signal.SIGINT, None, 20) == 128 + signal.SIGINT


RANK_WAITING_FOR_USR1 = """
import os, signal, sys, time
from pathlib import Path
out = Path(sys.argv[1])
got = []
signal.signal(signal.SIGUSR1, lambda s, f: got.append(s))
(out / f"ready{os.environ['RANK']}").write_text("")
deadline = time.monotonic() + 60
while not got and time.monotonic() < deadline:
    time.sleep(0.05)
(out / f"got{os.environ['RANK']}").write_text(str(len(got)))
"""


@pytest.mark.slow  # a real torchrun (zplan.launch.elastic) of two ranks
def test_zplans_torchrun_passes_sigusr1_on_to_its_ranks(tmp_path):
    """SIGUSR1 to zplan's torchrun alone (`kill -USR1`, or Slurm's `--signal` where it reaches
    srun's task only) reaches every rank once, and torchrun lives on to see them end: plain
    torchrun died of it, and the `--slurm` script ran plain torchrun."""
    import time

    script = tmp_path / "rank.py"
    script.write_text(RANK_WAITING_FOR_USR1)
    p = subprocess.Popen([sys.executable, "-m", "zplan.launch.elastic", "--standalone", "--nproc-per-node=2",
                          str(script), str(tmp_path)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 120
    while not all((tmp_path / f"ready{r}").exists() for r in (0, 1)):
        assert p.poll() is None and time.monotonic() < deadline, p.communicate()[0][-3000:]
        time.sleep(0.1)
    p.send_signal(signal.SIGUSR1)
    out, _ = p.communicate(timeout=90)
    assert p.returncode == 0, out[-3000:]
    assert [(tmp_path / f"got{r}").read_text() for r in (0, 1)] == ["1", "1"], out[-3000:]


ASKING_SCRIPT = r"""
import os, signal, sys, threading
import torch, torch.distributed as dist
from zplan.errors import UsageError
from zplan.trainer import api

dist.init_process_group("gloo", init_method="file://" + sys.argv[1], rank=0, world_size=1)
marker = os.environ["ZPLAN_STOP_MARKER"]
ctx = api.Context(None, 0, 1, torch.device("cpu"), sys.argv[2])  # what stop_requested uses of it
refused = []
def off_main():
    try:
        ctx.stop_requested()
    except UsageError as e:
        refused.append(str(e))
t = threading.Thread(target=off_main); t.start(); t.join()
print("refused off the main thread", bool(refused) and "main thread" in refused[0], not os.path.exists(marker))
print("first", ctx.stop_requested(), repr(open(marker).read()))
os.kill(os.getpid(), signal.SIGUSR1)
print("then", ctx.stop_requested().name, repr(open(marker).read()))
t = threading.Thread(target=ctx.close); t.start(); t.join()  # off the main thread: no error
print("closed")
"""


@pytest.mark.slow  # a process group (one gloo rank), in a process of its own
def test_stop_requested_tells_the_launcher_and_refuses_other_threads(tmp_path):
    """ctx.stop_requested(): refused off the main thread (no handler could run there, yet the
    launcher was told the ranks stop at a step: a review); the first call writes the launcher's
    marker empty (asked), a stop writes what stopped it (a script that finished before asking
    again is then not said to be interrupted); close() off the main thread does not raise."""
    marker = tmp_path / "stops-at-step"
    env = {**os.environ, "ZPLAN_STOP_MARKER": str(marker)}
    p = subprocess.run([sys.executable, "-c", ASKING_SCRIPT, str(tmp_path / "store"), str(tmp_path)], env=env,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-3000:]
    assert p.stdout.splitlines() == ["refused off the main thread True True", "first None ''",
                                     "then SIGUSR1 'stopped by SIGUSR1\\n'", "closed"], p.stdout + p.stderr[-2000:]
