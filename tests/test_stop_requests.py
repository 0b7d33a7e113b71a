"""A rank's stop requests (zplan/trainer/stop.py), in a process of their own: the first signal is
noted and the rank goes on; a second ends it as the signal would; leaving restores the handlers
that were there. The ranks' agreement is tested through torchrun (tests/test_stop_at_step.py)."""

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
def test_a_second_signal_ends_the_rank_as_the_signal_would(name):
    p = _run(name, True)
    assert p.returncode == -int(getattr(signal, "SIG" + name)), (p.returncode, p.stderr)
    assert "still here" not in p.stdout and "Traceback" not in p.stderr
