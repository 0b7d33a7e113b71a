"""zplan's trainer, signalled, ends at a step boundary with a checkpoint (zplan/trainer/stop.py),
through real torchrun and gloo: SIGTERM to zplan launch (which passes it to the ranks alone), and
SIGUSR1 to one rank only (as Slurm's `--signal` reaches every task, in no set order): every rank
stops after the same step, the checkpoint of that step is whole, and resuming it to a later step
gives the weights and losses of an uninterrupted run, bit for bit. Before, any of these killed the ranks
mid-step and the run fell back to its last periodic checkpoint (or to nothing)."""

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tests.test_trainer import launch, make_plan, weights

pytestmark = [pytest.mark.slow, pytest.mark.timeout(420)]

STEPS = 400  # far more than the test waits for: the signal, not the end, stops the run


def _start(plan: Path, run: Path, args: list[str] | None = None):
    """zplan launch of the built-in trainer (or of `args`), a step line on stdout every step; the
    launcher's Popen and a queue of its stdout lines."""
    args = args or ["--plan", str(plan), "--run-dir", str(run), "--steps", str(STEPS), "--save-every", "0",
                    "--", "--log-every", "1"]
    p = subprocess.Popen([sys.executable, "-m", "zplan", "launch", *args],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         preexec_fn=lambda: [signal.signal(s, signal.SIG_DFL) for s in
                                             (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)])
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=_read_lines, args=(p.stdout, lines), daemon=True).start()
    return p, lines


def _read_lines(stream, lines: queue.Queue) -> None:
    try:
        for x in stream:
            lines.put(x)
    except ValueError:  # _finish's communicate() closed the pipe: the lines are not wanted then
        pass
    lines.put("")


def _wait_for_step(p, lines, step: int, prefix: str = "zplan: step {step}/") -> list[str]:
    """Wait for the step's line; the lines read, that one last."""
    deadline = time.monotonic() + 150
    seen = []
    while time.monotonic() < deadline:
        try:
            line = lines.get(timeout=1)
        except queue.Empty:
            continue
        if line == "":
            break
        seen.append(line)
        if line.startswith(prefix.format(step=step)):
            return seen
    p.kill()
    pytest.fail(f"no step {step} line: {p.stderr.read()[-3000:]}")


def _below(launcher: int) -> tuple[list[int], list[int]]:
    """The pids of torchrun (zplan.launch.elastic) and of the trainer's ranks below the launcher
    (whose command line names the module, as torchrun's does too)."""
    from zplan.launch.procs import descendants

    torchrun, ranks = [], []
    for pid in descendants(launcher):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if b"zplan.launch.elastic" in cmd:
            torchrun.append(pid)
        elif b"zplan.trainer" in cmd:
            ranks.append(pid)
    return torchrun, ranks


def _finish(p) -> tuple[int, str]:
    try:
        _, err = p.communicate(timeout=200)
    except subprocess.TimeoutExpired:
        p.kill()
        pytest.fail("the stopped run did not end within 200 s")
    return p.returncode, err


@pytest.mark.parametrize("how", ["launcher", "one rank", "torchrun and every rank"])
def test_a_signal_stops_every_rank_after_the_same_step_with_a_checkpoint(run_zplan, tmp_path, how):
    """`torchrun and every rank`: what Slurm does at a job's end (SIGTERM to every process of the
    step): torchrun passes it on to its ranks, a second SIGTERM each, which killed them mid-step
    when a repeat meant "at once" (a review, reproduced)."""
    world = 2
    make_plan(run_zplan, tmp_path / "p.json", "zero3", world, 8)
    run = tmp_path / "stopped"
    p, lines = _start(tmp_path / "p.json", run)
    _wait_for_step(p, lines, 2)
    sig = signal.SIGUSR1 if how == "one rank" else signal.SIGTERM
    torchrun, ranks = _below(p.pid)
    assert len(torchrun) == 1 and len(ranks) == world, (torchrun, ranks)
    if how == "launcher":
        p.send_signal(sig)
    elif how == "one rank":
        os.kill(max(ranks), sig)  # one rank only: the other learns it at the step's end
    else:
        for pid in torchrun + ranks:
            os.kill(pid, sig)
    code, err = _finish(p)
    assert code == 128 + sig, err[-3000:]
    assert "Traceback" not in err and "error" not in err.lower(), err[-3000:]
    rep = json.loads((run / "run_report.json").read_text())
    stopped = rep["end_step"]
    assert rep["stopped_by"] == sig.name and 2 <= stopped < STEPS, rep
    assert f"zplan: stopped by {sig.name} after step {stopped} of {STEPS}; checkpoint of step {stopped}" in err
    assert f"zplan: interrupted ({sig.name}); `zplan launch --resume" in err.strip().splitlines()[-1]
    assert sorted(d.name for d in run.glob("step_*")) == [f"step_{stopped:08d}"]
    if how != "launcher":
        return
    # resumed to two steps past the stop: the weights of a run never stopped, bit for bit
    end = stopped + 2
    rep, _ = launch(run_zplan, tmp_path / "p.json", run, end, resume=True)
    assert rep["start_step"] == stopped and rep["end_step"] == end and rep["stopped_by"] is None
    straight, _ = launch(run_zplan, tmp_path / "p.json", tmp_path / "straight", end)
    a, b = weights(tmp_path / "straight", tmp_path), weights(run, tmp_path)
    assert a.keys() == b.keys() and all(a[k].equal(b[k]) for k in a)
    # the reported rank-mean losses too: an all-reduce of a launch's losses added them in an
    # order that depends on how many steps it ran (a QA pass saw hsdp's on 4 ranks a last bit
    # apart; zero3 on 4 ranks here did not show it, so 2 ranks keep CI short); they are now
    # summed in rank order (loop._mean_over_ranks)
    assert rep["losses"] == straight["losses"][stopped:]


def _catches(pid: int, sig: int) -> bool:
    """Whether process pid has a handler for sig (/proc's SigCgt mask)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("SigCgt:"):
                return bool(int(line.split()[1], 16) >> (sig - 1) & 1)
    except OSError:
        pass
    return False


def test_a_signal_before_the_first_step_ends_the_ranks_in_one_line_that_is_not_an_error(run_zplan, tmp_path):
    """SIGTERM to zplan launch while the ranks still set up (imports, process group, model): they
    died of the default action, and the launch printed "error: ranks 0, 1 killed by SIGTERM" under
    its promise of a checkpoint (a QA pass). Now each rank, from its first line, ends with one line
    that says what happened, exit 143, nothing to save. The test waits until both ranks catch
    SIGTERM (/proc SigCgt), long before their first step (torch is not imported yet)."""
    make_plan(run_zplan, tmp_path / "p.json", "zero3", 2, 8)
    run = tmp_path / "early"
    p, _lines = _start(tmp_path / "p.json", run)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        _, ranks = _below(p.pid)
        if len(ranks) == 2 and all(_catches(r, signal.SIGTERM) for r in ranks):
            break
        time.sleep(0.01)
    else:
        p.kill()
        pytest.fail("the ranks did not start within 60 s")
    p.send_signal(signal.SIGTERM)
    code, err = _finish(p)
    assert code == 143, err[-3000:]
    assert "zplan: stopped by SIGTERM before its first step; nothing to save" in err, err[-3000:]
    assert "error" not in err.lower() and "Traceback" not in err, err[-3000:]
    assert err.strip().splitlines()[-1] == "zplan: interrupted (SIGTERM); no checkpoint was written in its run folder"
    assert not list(run.glob("step_*"))


def test_a_script_that_asks_stops_after_a_step_and_the_same_launch_continues(tmp_path):
    """A script of one's own that polls ctx.stop_requested() (examples/train_custom.py) stops as
    the built-in trainer does: SIGTERM to zplan launch goes to its ranks alone (the script told
    the launcher at its first poll), both stop after the same step with a checkpoint, and the
    launch with the run's plan continues from it (the line says how: --resume is the built-in
    trainer's). Before, the launcher ended every rank after 5 s, mid-step."""
    example = Path(__file__).resolve().parent.parent / "examples" / "train_custom.py"
    run = tmp_path / "ex"
    p, lines = _start(None, run, ["--run-dir", str(run), "--strategy", "zero3", str(example), str(STEPS)])
    seen = _wait_for_step(p, lines, 2, prefix="step {step}:")
    p.send_signal(signal.SIGTERM)
    err = p.stderr.read()  # not communicate(): the reader thread keeps stdout's lines whole
    code = p.wait(timeout=200)
    rest = []
    while (line := lines.get(timeout=10)) != "":
        rest.append(line)
    stops = [x for x in rest if x.startswith("stopped by SIGTERM after step ")]
    assert code == 128 + signal.SIGTERM and len(stops) == 1, (rest[-5:], err[-3000:])
    stopped = int(stops[0].split()[5].rstrip(","))
    assert 2 <= stopped < STEPS and sorted(d.name for d in run.glob("step_*")) == [f"step_{stopped:08d}"]
    assert "Traceback" not in err and "error" not in err.lower(), err[-3000:]
    assert "zplan: SIGTERM: the ranks stop after this step" in err  # to the ranks alone, 300 s
    last = err.strip().splitlines()[-1]
    said = f"the same launch with `--run-dir {run} --plan {run / 'plan.json'}` continues"
    assert said in last, last
    end = stopped + 6
    # exactly the options the line names (a review: --plan alone made a new run folder, from step 1)
    r = subprocess.run([sys.executable, "-m", "zplan", "launch", "--run-dir", str(run), "--plan", str(run / "plan.json"),
                        str(example), str(end)], capture_output=True, text=True, timeout=200)
    steps = [int(x.split()[1].rstrip(":")) for x in r.stdout.splitlines() if x.startswith("step ")]
    assert steps == list(range(stopped + 1, end + 1)), r.stdout[-2000:] + r.stderr[-3000:]
    losses = [float(x.split()[-1]) for x in seen + rest + r.stdout.splitlines() if x.startswith("step ")]
    assert len(losses) == end and losses[-1] < losses[0] - 1.0, losses  # it trained on, not afresh
    assert "full weights on rank 0: 593,664 parameters" in r.stdout
    assert (run / f"step_{end:08d}").is_dir()
    if r.returncode != 0 and "terminate called without an active exception" in r.stderr:
        # gloo aborted a rank in its teardown once the script had finished its work (checked
        # above). ctx.close(leave=True) now ends the process before interpreter teardown; if this
        # still shows, the abort is inside destroy_process_group. Reported as XFAIL, not hidden.
        pytest.xfail("gloo aborted a rank at exit after the script finished (SIGABRT in teardown)")
    assert r.returncode == 0, r.stderr[-3000:]
