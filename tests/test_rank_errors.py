"""Errors inside ranks: one line per distinct error, from the ranks that failed, classified like
the CLI's (2 usage, 1 a run that cannot go on), the traceback only under ZPLAN_DEBUG=1."""

import json
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest

from zplan.errors import PlanError, UsageError
from zplan.launch.elastic import summarize
from zplan.trainer import rank_errors


def _failure(tmp_path, rank, exc=None, exitcode=1, monkeypatch=None):
    """What torchrun hands the launcher for a failed rank: its exit code and its error file,
    written by the rank's own reporting code."""
    path = tmp_path / f"error{rank}.json"
    if exc is not None:
        monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(path))
        monkeypatch.setenv("ZPLAN_LAUNCHER", "1")
        monkeypatch.setenv("RANK", str(rank))
        exitcode = rank_errors.report(exc)
    return SimpleNamespace(exitcode=exitcode, error_file=str(path))


def test_classification():
    assert rank_errors.classify(UsageError("bad flag")) == ("bad flag", 2, False)
    assert rank_errors.classify(PlanError("does not fit")) == ("does not fit", 1, False)
    line, code, secondary = rank_errors.classify(IsADirectoryError(21, "Is a directory", "/r/run_report.json"))
    assert code == 1 and not secondary and line.startswith("/r/run_report.json: Is a directory")
    assert "internal error" not in line
    line, code, secondary = rank_errors.classify(RuntimeError("[gloo] Connection closed by peer [10.0.0.2]:4411"))
    assert secondary and code == 1
    assert "internal error" in rank_errors.classify(KeyError("x"))[0]
    import torch

    oom = torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total "
                                 "capacity of 79.10 GiB of which 1.21 GiB is free.")
    line, code, secondary = rank_errors.classify(oom)
    assert (code, secondary) == (1, False) and "internal error" not in line
    assert "ran out of memory (CUDA out of memory. Tried to allocate 2.00 GiB)" in line and "--headroom" in line
    nccl = torch.distributed.DistBackendError("NCCL error in: ProcessGroupNCCL.cpp:2034, remote process "
                                              "exited or there was a network error, NCCL version 2.27.3")
    assert rank_errors.classify(nccl)[1:] == (1, True)  # the echo of another rank's death


def test_checkpoint_exception_is_caught_and_unwrapped():
    from torch.distributed.checkpoint.api import CheckpointException

    e = CheckpointException("load", {0: ValueError("size mismatch"), 1: UsageError("wrong model")})
    assert not isinstance(e, Exception)  # why `except Exception` misses it
    assert rank_errors.classify(e) == ("wrong model", 2, False)


def test_checkpoint_exception_as_dcp_raises_it_is_unwrapped():
    """DCP fills `failures` with (exception, traceback summary) pairs (its _wrap_exception, torch
    2.11 and 2.13), not bare exceptions: the line names the exception, not the pair."""
    from torch.distributed.checkpoint.api import CheckpointException, _wrap_exception

    try:
        raise ValueError("size mismatch for model.0.weight")
    except ValueError as err:
        mismatch = _wrap_exception(err)
    e = CheckpointException("load", {0: mismatch, 1: _wrap_exception(UsageError("wrong model"))})
    assert rank_errors.classify(e) == ("wrong model", 2, False)
    line = rank_errors.classify(CheckpointException("load", {0: mismatch}))[0]
    assert line == "checkpoint cannot be loaded (ValueError: size mismatch for model.0.weight)"


def test_one_line_per_distinct_error_and_the_agreed_code(tmp_path, monkeypatch, capsys):
    same = {r: _failure(tmp_path, r, UsageError("the plan is for 4 ranks"), monkeypatch=monkeypatch) for r in (0, 1)}
    assert capsys.readouterr().err == ""  # under the launcher the ranks leave their lines to it
    assert summarize(same) == (["zplan: error: the plan is for 4 ranks"], 2)
    cause = _failure(tmp_path, 1, OSError(28, "No space left on device", "/run/step_2/__1_0.distcp"),
                     monkeypatch=monkeypatch)
    echo = _failure(tmp_path, 0, RuntimeError("Connection closed by peer"), monkeypatch=monkeypatch)
    lines, code = summarize({0: echo, 1: cause})
    assert code == 1 and len(lines) == 1 and "No space left on device" in lines[0]
    plain = {0: _failure(tmp_path, 7, exitcode=3), 1: _failure(tmp_path, 8, exitcode=4)}
    assert summarize(plain) == (["zplan: error: rank 0 exited with code 3",
                                 "zplan: error: rank 1 exited with code 4"], 1)
    assert summarize({0: _failure(tmp_path, 9, exitcode=-9)}) == (["zplan: error: rank 0 killed by SIGKILL"], 137)


def test_torchruns_sigkill_after_another_ranks_error_is_an_echo(tmp_path, monkeypatch):
    """torchrun SIGTERMs the other ranks when one fails and SIGKILLs those still alive 30 s later
    (PContext.close), recording them after close() returns: an armed zplan rank notes the
    SIGTERM and finishes its step, which under NCCL can block on the dead peer until the SIGKILL.
    That death, 30 s after the first failure by torchrun's own timestamps (ProcessFailure, as
    torchrun builds it from the error file or the time it saw the exit), is the failure's echo:
    the failing rank's line and code are said alone. A SIGKILL beside the failure (the OOM
    killer, kill -9: a review reproduced one hidden) is said with it, and alone it is the failure."""
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    def failure(rank, exc=None, exitcode=1, after_s=0):
        f = _failure(tmp_path, rank, exc, exitcode, monkeypatch)
        real = ProcessFailure(local_rank=rank, pid=1000 + rank, exitcode=f.exitcode, error_file=f.error_file)
        real.timestamp += after_s  # torchrun's clock when it recorded the exit
        return real

    cause = failure(0, PlanError("loss is nan at step 7"))
    assert summarize({0: cause, 1: failure(11, exitcode=-9, after_s=31)}) == (["zplan: error: loss is nan at step 7"], 1)
    assert summarize({0: failure(13, exitcode=3), 1: failure(14, exitcode=-9, after_s=30)}) == (
        ["zplan: error: rank 0 exited with code 3"], 3)
    # beside the failure, not 30 s after it: a cause of its own, said too
    assert summarize({0: failure(15, exitcode=3), 1: failure(16, exitcode=-9, after_s=1)}) == (
        ["zplan: error: rank 0 exited with code 3", "zplan: error: rank 1 killed by SIGKILL"], 1)
    echo = failure(1, RuntimeError("Connection closed by peer"))
    assert summarize({0: failure(12, exitcode=-9), 1: echo}) == (["zplan: error: rank 0 killed by SIGKILL"], 137)


def test_error_file_is_whole_or_absent(tmp_path, monkeypatch, capsys):
    """torchrun's agent reads a failed rank's error file while it kills the others; a rank stopped
    mid-write must not leave a half file (an empty one crashed the agent with a JSONDecodeError,
    seen once in CI). The file is renamed into place whole: a write stopped before the rename
    leaves no file and no temporary beside it, and the rank prints its line itself."""
    import zplan.files

    def stopped(*a):
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(zplan.files.os, "replace", stopped)
    f = _failure(tmp_path, 3, UsageError("the plan is for 4 ranks"), monkeypatch=monkeypatch)
    assert list(tmp_path.iterdir()) == []
    assert "rank 3: the plan is for 4 ranks" in capsys.readouterr().err
    assert summarize({3: f}) == (["zplan: error: rank 3 exited with code 2"], 2)


# ------------------------------------------------------------------ through torchrun (slow)

def _make_plan(run_zplan, path, strategy):
    from tests.test_trainer import make_plan

    make_plan(run_zplan, path, strategy, 2, 4)


def _craft_checkpoint(run_dir, manifest):
    """A real DCP checkpoint (written in a child process) with the manifest given."""
    code = ("import torch, torch.distributed.checkpoint as dcp, warnings, sys\n"
            "warnings.simplefilter('ignore')\n"
            "dcp.save({'model': {'w': torch.zeros(2)}}, checkpoint_id=sys.argv[1], no_dist=True)\n")
    folder = run_dir / "step_00000002"
    subprocess.run([sys.executable, "-c", code, str(folder)], check=True)
    (folder / "zplan.json").write_text(json.dumps(manifest))


def _errors(stderr):
    """Error lines: zplan's, a trainer rank's own, or any exception's name or traceback."""
    return [l for l in stderr.splitlines()
            if l.startswith(("zplan: error", "zplan trainer: error")) or "Error" in l or "Traceback" in l]


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_usage_error_before_the_group_one_line_then_traceback_with_debug(run_zplan, tmp_path):
    _make_plan(run_zplan, tmp_path / "ddp.json", "ddp")
    args = ("launch", "--plan", str(tmp_path / "ddp.json"), "--run-dir", str(tmp_path / "r"), "--",
            "--deterministic")
    p = run_zplan(*args, timeout=200)
    assert p.returncode == 2
    assert _errors(p.stderr) == ["zplan: error: --deterministic applies to the FSDP2 strategies, not ddp: "
                                 "drop it or plan with --strategy zero3"], p.stderr
    p = run_zplan(*args, env={"ZPLAN_DEBUG": "1"}, timeout=200)
    assert p.returncode != 0 and "Traceback" in p.stderr and "UsageError" in p.stderr


@pytest.mark.slow
@pytest.mark.timeout(400)
@pytest.mark.parametrize("strategy,manifest,msg", [
    ("zero3", {"step": 2, "world_size": 2, "strategy": "zero3", "model": "llama-7b"},
     "is of model 'llama-7b' but the plan trains 'tiny'"),
    ("zero1", {"step": 2, "world_size": 4, "strategy": "zero1", "model": "tiny"},
     "was saved at world size 4; ZeroRedundancyOptimizer state resumes only at the same size"),
])
def test_wrong_checkpoint_inside_the_ranks_is_one_line(run_zplan, tmp_path, strategy, manifest, msg):
    _make_plan(run_zplan, tmp_path / "p.json", strategy)
    run_dir = tmp_path / "run"
    _craft_checkpoint(run_dir, manifest)
    p = run_zplan("launch", "--plan", str(tmp_path / "p.json"), "--run-dir", str(run_dir), "--resume",
                  "--steps", "4", timeout=300)
    assert p.returncode == 2, p.stderr[-3000:]
    errors = _errors(p.stderr)
    assert len(errors) == 1 and msg in errors[0], p.stderr[-3000:]
    assert not (run_dir / "run_report.json").exists()


def test_a_bad_trainer_option_is_a_usage_error():
    from zplan.trainer.__main__ import parse

    with pytest.raises(UsageError, match="unrecognized arguments: --determinstic"):
        parse(["--determinstic"])
    with pytest.raises(UsageError, match="--steps: invalid int value: 'x'"):
        parse(["--steps", "x"])


SIGTERM_WHILE_REPORTING = r"""
import os, signal, sys
import zplan.files
from zplan.errors import UsageError
from zplan.trainer import rank_errors
from zplan.trainer.stop import StopRequests

StopRequests(armed=False).__enter__()  # as the trainer's main: before its first step
write = zplan.files.write_text
def write_text(path, text, what):  # torchrun's SIGTERM lands while the error file is written
    os.kill(os.getpid(), signal.SIGTERM)
    write(path, text, what)
zplan.files.write_text = write_text
sys.exit(rank_errors.guarded(lambda: (_ for _ in ()).throw(UsageError("the checkpoint is of another world size"))))
"""


def test_a_stop_signal_while_a_failed_rank_reports_does_not_replace_its_error(tmp_path):
    """torchrun SIGTERMs the other ranks when one fails; where both failed alike, the second rank
    got it while writing its own error file, and its stop handler raised out of the report (a
    traceback, exit 1 for a usage error; CI, test_wrong_checkpoint_inside_the_ranks_is_one_line).
    The failed rank's line and code stand."""
    err_file = tmp_path / "error.json"
    env = {**os.environ, "TORCHELASTIC_ERROR_FILE": str(err_file), "ZPLAN_LAUNCHER": "1", "RANK": "1"}
    p = subprocess.run([sys.executable, "-c", SIGTERM_WHILE_REPORTING], env=env, capture_output=True, text=True,
                       timeout=60)
    assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr[-2000:]
    rec = json.loads(err_file.read_text())["zplan"]
    assert rec["line"] == "the checkpoint is of another world size" and rec["exit_code"] == 2
