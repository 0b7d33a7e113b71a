"""zplan launch: the torchrun command as data, the Slurm script, detection through a fake NVML."""

import json
import os
import signal
import subprocess
import sys
import time
import types
from pathlib import Path

import pytest

from tests.conftest import ROOT
from zplan.errors import UsageError
from zplan.hardware import detect, preset_for
from zplan.launch.command import LaunchSpec, shell_line, slurm_script, torchrun_argv


def test_one_node_argv():
    argv, env = torchrun_argv(LaunchSpec("/r/plan.json", 8, python="python"))
    assert argv == ["python", "-m", "zplan.launch.elastic", "--standalone", "--nnodes=1",
                    "--nproc-per-node=8", "--max-restarts=0", "-m", "zplan.trainer"]
    assert env == {"ZPLAN_PLAN": "/r/plan.json"}


def test_multi_node_argv_with_script():
    spec = LaunchSpec("p.json", 8, nnodes=4, node_rank=2, rdzv_endpoint="head:29500", rdzv_id="job7",
                      max_restarts=3, script="train.py", script_args=("--lr", "1e-4"), python="python",
                      torchrun_opts=("--log-dir=/l", "--redirects=3"))
    argv, _ = torchrun_argv(spec)
    assert argv == ["python", "-m", "zplan.launch.elastic", "--nnodes=4", "--rdzv-backend=c10d",
                    "--rdzv-endpoint=head:29500", "--rdzv-id=job7", "--node-rank=2",
                    "--nproc-per-node=8", "--max-restarts=3", "--log-dir=/l", "--redirects=3",
                    "train.py", "--lr", "1e-4"]
    assert shell_line(argv, {"ZPLAN_PLAN": "p.json"}).startswith("ZPLAN_PLAN=p.json python -m")


@pytest.mark.parametrize("kw,msg", [(dict(nnodes=2), "needs --rdzv-endpoint"),
                                    (dict(nnodes=2, rdzv_endpoint="h:1", node_rank=2), "--node-rank 2"),
                                    (dict(max_restarts=-1), "--max-restarts -1")])
def test_bad_launch_options(kw, msg):
    with pytest.raises(UsageError, match=msg):
        torchrun_argv(LaunchSpec("p", 8, **kw))


SLURM_GOLDEN = """#!/bin/bash
#SBATCH --job-name=zplan
#SBATCH --nodes=4
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-task=8
#SBATCH --cpus-per-task=32
# 300 s before the time limit: the trainer stops after its step, with a checkpoint (at the limit Slurm's SIGTERM gives 30 s, its KillWait)
#SBATCH --signal=USR1@300
#SBATCH --output=zplan-%j.out
set -euo pipefail
# sed reads every line: `head -n 1` would end the pipe early, and pipefail turns that into an exit
head_node=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | sed -n 1p)
export ZPLAN_PLAN=/shared/run/plan.json
srun --kill-on-bad-exit=1 /opt/env/bin/python -m zplan.launch.elastic \\
    --nnodes=4 --nproc-per-node=8 \\
    --rdzv-backend=c10d --rdzv-endpoint="$head_node:29500" --rdzv-id="$SLURM_JOB_ID" \\
    --max-restarts=1 --log-dir=/shared/logs \\
    -m zplan.trainer --steps 100
"""


def test_slurm_script_golden():
    spec = LaunchSpec("/shared/run/plan.json", 8, nnodes=4, max_restarts=1, script_args=("--steps", "100"),
                      python="/opt/env/bin/python", torchrun_opts=("--log-dir=/shared/logs",))
    assert slurm_script(spec, 8, 32) == SLURM_GOLDEN


def test_slurm_uses_a_given_rendezvous_endpoint():
    text = slurm_script(LaunchSpec("p.json", 8, nnodes=2, rdzv_endpoint="login1:29600"), 8)
    assert '--rdzv-endpoint="login1:29600"' in text and "head_node:" not in text.split("srun")[1]


def test_slurm_one_node_cpu():
    text = slurm_script(LaunchSpec("p.json", 2), 0)
    assert "--gpus-per-task" not in text and "--nnodes=1 --nproc-per-node=2" in text


def test_slurm_asks_for_the_stop_signal_only_for_the_built_in_trainer():
    """SIGUSR1 before the time limit stops zplan's trainer after a step with a checkpoint; a
    script of one's own that does not handle it would die of it, minutes early."""
    assert "#SBATCH --signal=USR1@300" in slurm_script(LaunchSpec("p.json", 8), 8)
    assert "--signal" not in slurm_script(LaunchSpec("p.json", 8, script="train.py"), 8)


class _NotFound(Exception):
    pass


def _uuid(i):
    return f"GPU-{i:x}{i:x}c0ffee-1111-2222-3333-44445555666{i:x}"


def _fake_nvml(names, mem=80 * 2**30, fail=False, migs=None):
    """NVML as pynvml shows it: devices by index and by UUID, and MIG slices. migs: parent index
    -> [(gpu instance, compute instance, uuid, memory bytes)]."""
    migs = migs or {}
    m = types.SimpleNamespace()
    def init():
        if fail:
            raise RuntimeError("Driver Not Loaded")
    slices = {u: (p, gi, ci, b) for p, lst in migs.items() for gi, ci, u, b in lst}
    m.nvmlInit = init
    m.nvmlShutdown = lambda: None
    m.nvmlDeviceGetCount = lambda: len(names)
    m.nvmlDeviceGetHandleByIndex = lambda i: ("gpu", i)
    m.nvmlDeviceGetUUID = lambda h: (_uuid(h[1]) if h[0] == "gpu" else h[1]).encode()
    m.nvmlDeviceGetName = lambda h: (names[h[1]] if h[0] == "gpu" else
                                     f"{names[slices[h[1]][0]]} MIG 1g.10gb").encode()
    m.nvmlDeviceGetMemoryInfo = lambda h: types.SimpleNamespace(
        total=mem if h[0] == "gpu" else slices[h[1]][3])
    def by_uuid(u):
        if u in slices:
            return ("mig", u)
        for i in range(len(names)):
            if _uuid(i) == u:
                return ("gpu", i)
        raise _NotFound(u)
    m.nvmlDeviceGetHandleByUUID = by_uuid
    m.nvmlDeviceGetDeviceHandleFromMigDeviceHandle = lambda h: ("gpu", slices[h[1]][0])
    m.nvmlDeviceGetIndex = lambda h: h[1]
    m.nvmlDeviceGetMaxMigDeviceCount = lambda h: 7
    def mig_by_index(h, j):
        lst = migs.get(h[1], [])
        if j >= len(lst):
            raise _NotFound(j)
        return ("mig", lst[j][2])
    m.nvmlDeviceGetMigDeviceHandleByIndex = mig_by_index
    m.nvmlDeviceGetGpuInstanceId = lambda h: slices[h[1]][1]
    m.nvmlDeviceGetComputeInstanceId = lambda h: slices[h[1]][2]
    return m


H100 = "NVIDIA H100 80GB HBM3"


def test_detect_reports_what_cuda_lends_not_nvmls_total(monkeypatch):
    """nvidia-smi -q on 8 H100 with driver 565.57.01: Total 81559 MiB, Reserved 454, and CUDA's
    deviceQuery on the same node 81106 MiB (thamada/gls e20f22d): the v2 query's total less its
    reserve, as the preset holds it; a driver without the v2 call gives the v1 total."""
    from zplan import presets

    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    m = _fake_nvml([H100] * 2, mem=81559 * 2**20)
    m.nvmlMemory_v2 = 0x02000028
    v1 = m.nvmlDeviceGetMemoryInfo
    def info(h, version=None):
        if version is None:
            return v1(h)
        assert version == m.nvmlMemory_v2
        return types.SimpleNamespace(total=81559 * 2**20, reserved=454 * 2**20, free=81105 * 2**20, used=2**20)
    m.nvmlDeviceGetMemoryInfo = info
    got = detect(m).gpus[0].memory_bytes
    assert got == 81105 * 2**20
    assert abs(got - presets.gpu("h100-sxm").memory_bytes) < 2**20
    def old_driver(h, version=None):
        if version is not None:
            raise _NotFound("nvmlDeviceGetMemoryInfo_v2")
        return v1(h)
    m.nvmlDeviceGetMemoryInfo = old_driver
    assert detect(m).gpus[0].memory_bytes == 81559 * 2**20


def test_detect_with_a_fake_nvml(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    d = detect(_fake_nvml([H100] * 8))
    assert len(d.gpus) == 8 and d.gpu_preset == "h100-sxm"
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,5")
    d = detect(_fake_nvml([H100] * 8))
    assert [g.index for g in d.gpus] == [2, 5] and "2 of 8" in d.gpu_reason
    d = detect(_fake_nvml([], fail=True))
    assert d.gpus == [] and "Driver Not Loaded" in d.gpu_reason
    assert d.host_ram_bytes > 0


def _visible(monkeypatch, env, nvml):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", env)
    return [g.index for g in detect(nvml).gpus]


def test_visible_devices_rules(monkeypatch):
    four = _fake_nvml([H100] * 4)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert [g.index for g in detect(four).gpus] == [0, 1, 2, 3]
    assert _visible(monkeypatch, "", four) == []
    assert _visible(monkeypatch, "1,7,2", four) == [1]  # CUDA stops at the first invalid ordinal
    assert _visible(monkeypatch, "3,1", four) == [3, 1]
    assert _visible(monkeypatch, "3,3,1", four) == [3]  # and at a repeated one


def test_gpu_uuids_are_understood(monkeypatch):
    """Issue 9 item 7: UUIDs (full or a unique prefix) select GPUs by NVML UUID, in CUDA's order."""
    nvml = _fake_nvml([H100] * 8)
    d_env = f"{_uuid(6)},{_uuid(1)}"
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", d_env)
    d = detect(nvml)
    assert [(g.index, g.uuid) for g in d.gpus] == [(6, _uuid(6)), (1, _uuid(1))]
    assert d.gpu_preset == "h100-sxm" and "2 of 8" in d.gpu_reason
    assert _visible(monkeypatch, _uuid(3)[:12], nvml) == [3]  # GPU-33c0ffee: a unique prefix
    assert _visible(monkeypatch, "GPU-", nvml) == []  # a prefix of every UUID names none
    assert _visible(monkeypatch, f"{_uuid(2)},GPU-deadbeef,{_uuid(4)}", nvml) == [2]  # stops at the unknown
    assert _visible(monkeypatch, f"{_uuid(5)},5", nvml) == [5]  # the same GPU twice


def test_mig_identifiers_are_understood(monkeypatch):
    slice_mem = 10 * 2**30
    migs = {1: [(7, 0, "MIG-aaaa1111-2222-3333-4444-555566667777", slice_mem),
                (8, 0, "MIG-bbbb1111-2222-3333-4444-555566667777", slice_mem)]}
    nvml = _fake_nvml([H100] * 2, migs=migs)
    for env in ("MIG-bbbb1111-2222-3333-4444-555566667777", f"MIG-{_uuid(1)}/8/0"):
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", env)
        d = detect(nvml)
        assert len(d.gpus) == 1, env
        g = d.gpus[0]
        assert (g.index, g.mig, g.memory_bytes, g.uuid) == (1, True, slice_mem, migs[1][1][2])
        assert g.preset is None and "MIG" in d.gpu_reason  # a slice is not the preset's GPU
    assert _visible(monkeypatch, f"MIG-{_uuid(1)}/9/0", nvml) == []  # no such instance
    assert _visible(monkeypatch, "MIG-ffff0000-0000-0000-0000-000000000000", nvml) == []


def test_preset_names():
    assert preset_for("NVIDIA H100 PCIe") == "h100-pcie"
    assert preset_for("NVIDIA A100-SXM4-80GB") == "a100-80gb"
    assert preset_for("NVIDIA H200") == "h200"
    assert preset_for("Tesla T4") is None
    # parts whose names contain a preset's: a GH200 (96 GB) is no H200 (141 GB), an H100 NVL no
    # SXM part, a GB200 no B200 (its own preset); the most specific pattern comes first
    assert preset_for("NVIDIA GH200 480GB") is None
    assert preset_for("NVIDIA H100 NVL") is None
    assert preset_for("NVIDIA GB200") == "gb200"
    assert preset_for("NVIDIA B200") == "b200"
    assert preset_for("NVIDIA H100 80GB HBM3") == "h100-sxm"


def test_cgroup_limit(tmp_path):
    from zplan.hardware import cgroup_memory_limit
    (tmp_path / "memory.max").write_text("1073741824\n")
    assert cgroup_memory_limit(tmp_path) == 2**30
    (tmp_path / "memory.max").write_text("max\n")
    assert cgroup_memory_limit(tmp_path) is None


def test_cgroup_cpu_quota(tmp_path):
    import os

    from zplan.hardware import cgroup_cpu_limit, usable_cpus
    assert cgroup_cpu_limit(tmp_path) is None
    assert usable_cpus(tmp_path) == len(os.sched_getaffinity(0))  # no quota: the affinity
    (tmp_path / "cpu.max").write_text("150000 100000\n")
    assert cgroup_cpu_limit(tmp_path) == 2  # 1.5 CPUs of quota: 2 CPUs run it
    (tmp_path / "cpu.max").write_text("50000 100000\n")
    assert usable_cpus(tmp_path) == 1
    (tmp_path / "cpu.max").write_text("max 100000\n")
    assert cgroup_cpu_limit(tmp_path) is None
    v1 = tmp_path / "v1" / "cpu"
    v1.mkdir(parents=True)
    (v1 / "cpu.cfs_quota_us").write_text("300000\n")
    (v1 / "cpu.cfs_period_us").write_text("100000\n")
    assert cgroup_cpu_limit(tmp_path / "v1") == 3


def test_launch_dry_run_cli(run_zplan, tmp_path):
    p = run_zplan("launch", "--dry-run", "--run-dir", str(tmp_path / "r"), "--steps", "5")
    assert p.returncode == 0, p.stderr
    line = p.stdout.strip()
    assert line.startswith(f"ZPLAN_PLAN={tmp_path}/r/plan.json ")
    assert "--standalone --nnodes=1 --nproc-per-node=2 --max-restarts=0 -m zplan.trainer" in line
    assert "--steps 5" in line
    assert "-m zplan.launch.elastic" in line
    assert (tmp_path / "r" / "plan.json").is_file()  # the plan it names


def test_detect_cli():
    """The CPU count follows the process's affinity: pinned to one CPU, detect says 1 (the
    oracle is the affinity this test sets, not the code under test)."""
    import json
    import os
    import subprocess
    import sys

    one = min(os.sched_getaffinity(0))
    p = subprocess.run([sys.executable, "-m", "zplan", "detect", "--json"], capture_output=True,
                       text=True, timeout=60, preexec_fn=lambda: os.sched_setaffinity(0, {one}))
    assert p.returncode == 0, p.stderr
    d = json.loads(p.stdout)
    assert d["cpus"] == 1 and d["host_ram_bytes"] > 0
    info = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    flags = [ln.split(":", 1)[1].split() for ln in info.splitlines()
             if ln.split(":", 1)[0].strip().lower() in ("flags", "features") and ":" in ln]
    if flags:  # the kernel's flags, read here on their own
        assert d["cpu_bf16"] is any(w in f for f in flags for w in ("avx512_bf16", "amx_bf16", "bf16"))


RANK_SCRIPT = """
import os, signal, sys
if len(sys.argv) > 1 and sys.argv[1] == "ignore":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
# one write: torchrun runs ranks with `python -u`, where print() issues a write per piece and
# two ranks' "pid", " ", "123" and newline interleave in the shared pipe (the lost pids)
os.write(1, f"pid {os.getpid()}\\n".encode())
while True:
    signal.pause()
"""


def _alive(pid: int) -> bool:
    """Whether pid is a live process (a zombie counts as ended)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


def _launch_ranks(tmp_path, mode):
    """zplan launch of RANK_SCRIPT on 2 CPU ranks: the launcher's Popen, the ranks' pids (read from
    its stdout) and the file its stderr goes to."""
    import queue
    import threading

    script = tmp_path / "rank.py"
    script.write_text(RANK_SCRIPT)
    err_path = tmp_path / "launch.err"  # kept for the failure message
    with open(err_path, "w") as err:
        # the signals' default dispositions in the launcher, whatever this process inherited (a
        # harness under nohup ignores SIGHUP, which the launcher then keeps ignoring, as it should)
        p = subprocess.Popen([sys.executable, "-m", "zplan", "launch", "--run-dir", str(tmp_path / "r"),
                              str(script), mode], stdout=subprocess.PIPE, stderr=err, text=True,
                             preexec_fn=lambda: [signal.signal(s, signal.SIG_DFL) for s in
                                                 (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)])
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: ([lines.put(x) for x in p.stdout], lines.put("")), daemon=True).start()
    pids, deadline = [], time.monotonic() + 120
    while len(pids) < 2:
        try:
            line = lines.get(timeout=max(0.1, deadline - time.monotonic()))
        except queue.Empty:
            line = None
        if not line:
            if p.poll() is None:
                p.send_signal(signal.SIGINT)  # the launcher's own clean-up ends torchrun and ranks
                try:
                    p.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    p.kill()
            why = "the launcher ended" if line == "" else "no rank reported its pid within 120 s"
            pytest.fail(f"{why} ({len(pids)} of 2 pids); launcher stderr:\n{err_path.read_text()[-3000:]}")
        if line.startswith("pid "):
            pids.append(int(line.split()[1]))
    assert all(_alive(pid) for pid in pids)
    return p, pids, err_path


def _ranks_end(pids, within_s):
    deadline = time.monotonic() + within_s
    while any(_alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    return [pid for pid in pids if _alive(pid)] == []


@pytest.mark.slow
@pytest.mark.timeout(180)
@pytest.mark.parametrize("sig,mode,code", [(signal.SIGINT, "plain", 130), (signal.SIGTERM, "ignore", 143),
                                           (signal.SIGHUP, "plain", 129), (signal.SIGKILL, "plain", -9)])
def test_signal_ends_every_rank(tmp_path, sig, mode, code):
    """Ctrl-C, SIGTERM or SIGHUP (a closed terminal: it ended the launcher alone and left the
    ranks training) to zplan launch ends torchrun and every rank, even ranks that ignore the
    signal (the grace-period kill), and exits 128 + the signal, saying how to resume. kill -9 (the
    OOM killer, a scheduler's hard stop) runs no handler: torchrun and its ranks went on training
    with the run folder unlocked, and a second --resume trained beside them (a QA pass); torchrun
    now gets SIGTERM when the launcher dies (PR_SET_PDEATHSIG). Ranks report their pids on stdout;
    the test reads them from the pipe, then checks /proc. While they run, a second launch in the
    same run directory is refused (it resumed beside the first and removed its checkpoint)."""
    p, pids, err_path = _launch_ranks(tmp_path, mode)
    if sig == signal.SIGHUP:
        second = subprocess.run([sys.executable, "-m", "zplan", "launch", "--run-dir", str(tmp_path / "r"),
                                 str(tmp_path / "rank.py"), mode], capture_output=True, text=True, timeout=60)
        assert second.returncode == 2 and "another zplan launch is running" in second.stderr, second.stderr
    p.send_signal(sig)
    # torchrun alone would wait 30 s for ranks that ignore SIGTERM: the grace kill is sooner
    assert p.wait(timeout=25) == code
    # SIGKILL was sent to the group before the launcher returned; it lands within moments (after
    # a kill -9 of the launcher, torchrun's own SIGTERM handling stops the ranks)
    assert _ranks_end(pids, 30 if sig == signal.SIGKILL else 5), "ranks outlived the launcher"
    if sig != signal.SIGKILL:
        last = err_path.read_text().strip().splitlines()[-1]
        assert last.startswith(f"zplan: interrupted ({signal.Signals(sig).name})") and "--resume" not in last, last


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_torchrun_killed_from_outside_is_said(tmp_path):
    """kill -9 of torchrun itself (the OOM killer picks the biggest process, often an agent's
    parent) ended the launch with exit 137 and not a word (a QA pass): one line names the signal;
    the ranks, adopted by the launcher, are stopped."""
    p, pids, err_path = _launch_ranks(tmp_path, "plain")
    torchrun = int(Path(f"/proc/{pids[0]}/stat").read_text().rsplit(")", 1)[1].split()[1])  # the rank's parent
    os.kill(torchrun, signal.SIGKILL)
    assert p.wait(timeout=30) == 137
    assert _ranks_end(pids, 10), "ranks outlived torchrun"
    last = err_path.read_text().strip().splitlines()[-1]
    assert last.startswith("zplan: error: torchrun was ended by SIGKILL"), last


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_failing_script_exit_code_passes_through(tmp_path):
    """A script's own exit code comes back, with one line (which ranks it names depends on
    whether torchrun stopped the other rank first: 1 when failed ranks disagree is a unit test,
    tests/test_rank_errors.py)."""
    import re

    bad = tmp_path / "bad.py"
    bad.write_text("import sys\nsys.exit(3)\n")
    p = subprocess.run([sys.executable, "-m", "zplan", "launch", "--run-dir", str(tmp_path / "r"), str(bad)],
                       capture_output=True, text=True, timeout=100)
    assert p.returncode == 3, p.stderr
    errors = [l for l in p.stderr.splitlines() if "error" in l.lower()]
    assert len(errors) == 1 and re.fullmatch(r"zplan: error: ranks? (0|1|0, 1) exited with code 3", errors[0]), p.stderr


# ---------------------------------------------------------------- the launch command's arguments
from tests.helpers import cli  # noqa: E402


def _dry(capsys, tmp_path, *args):
    return cli(capsys, "launch", "--dry-run", "--run-dir", str(tmp_path / "r"), *args)


def test_everything_after_the_script_is_the_scripts(capsys, tmp_path):
    script = tmp_path / "train.py"
    script.write_text("")
    p = _dry(capsys, tmp_path, str(script), "--steps", "5", "--run-dir", "elsewhere", "--resume")
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip().endswith(f"{script} --steps 5 --run-dir elsewhere --resume")
    assert (tmp_path / "r" / "plan.json").is_file() and not (tmp_path / "elsewhere").exists()


def test_trainer_options_follow_double_dash(capsys, tmp_path):
    p = _dry(capsys, tmp_path, "--deterministic")
    assert p.returncode == 2 and "--deterministic" in p.stderr and len(p.stderr.strip().splitlines()) == 1
    p = _dry(capsys, tmp_path, "--steps", "7", "--keep", "2", "--log-every", "3", "--", "--deterministic")
    assert p.returncode == 0, p.stderr
    assert "-m zplan.trainer" in p.stdout and "--steps 7" in p.stdout and "--keep 2" in p.stdout
    assert p.stdout.strip().endswith("--log-every 3 --deterministic")


@pytest.mark.slow  # over a second in all: the fast loop leaves it to CI
@pytest.mark.parametrize("args,msg", [
    (["--steps", "5", "SCRIPT"], "--steps is an option of zplan's trainer"),
    (["--plan", "PLAN", "--model", "gpt2"], "--model applies to a fresh plan"),
    (["--resume"], "--resume needs --run-dir"),
    (["--nnodes", "2", "--rdzv-endpoint", "h:1"], "several nodes need --run-dir"),
    (["--slurm", "job.sh"], "a --slurm job needs --run-dir"),  # one node asked: "several nodes" misled
    (["--save-every", "-5"], "--save-every"),
    (["--no-save", "--save-every", "2"], "--save-every 2 with --no-save"),
    (["--no-save", "--max-restarts", "1"], "--max-restarts 1 resumes from checkpoints, which --no-save"),
    (["--max-restarts", "1", "--", "--no-save"], "--max-restarts 1 resumes from checkpoints, which --no-save"),
    (["--keep", "2", "--no-save"], "--keep 2 with --no-save"),
    (["--no-save", "SCRIPT"], "--save/--no-save is an option of zplan's trainer"),
])
def test_nothing_is_silently_taken_or_dropped(capsys, tmp_path, args, msg):
    script = tmp_path / "train.py"
    script.write_text("")
    plan = tmp_path / "p.json"
    assert cli(capsys, "recommend", "--model", "tiny", "--gpu", "cpu", "--cluster", "cpu-local", "--gpus", "2",
               "--layout", "torch", "--write", str(plan)).returncode == 0
    args = [str(script) if a == "SCRIPT" else str(plan) if a == "PLAN" else a for a in args]
    p = cli(capsys, "launch", "--dry-run", *args)
    assert p.returncode == 2 and msg in p.stderr, p.stderr
    assert len(p.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize("source, said", [("def f(:\n    pass\n", "line 1: SyntaxError"),
                                           ("if True:\nprint(1)\n", "line 2: IndentationError"),
                                           ("x = 1\0\n", "null bytes")])
def test_a_script_that_does_not_parse_is_one_line_before_any_rank(capsys, tmp_path, monkeypatch, source, said):
    """A script with a syntax error failed inside every rank, a traceback each, after torchrun
    started (a QA pass): Python's own compiler is the oracle, and nothing starts."""
    script = tmp_path / "train.py"
    script.write_text(source)
    with pytest.raises((SyntaxError, ValueError)):  # ValueError: null bytes before Python 3.12
        compile(source, str(script), "exec")
    monkeypatch.setattr("zplan.launch.runner.run_with_restarts", lambda *a, **k: pytest.fail("torchrun started"))
    p = cli(capsys, "launch", "--run-dir", str(tmp_path / "r"), str(script))
    assert p.returncode == 2 and said in p.stderr and len(p.stderr.strip().splitlines()) == 1, p.stderr
    assert not (tmp_path / "r").exists()


def test_a_resume_keeps_the_runs_length_and_checkpoint_cadence(capsys, tmp_path, monkeypatch):
    """A run started with --save-every 1 --keep 3, killed and resumed with --steps alone, went back
    to saving only at its end and keeping every checkpoint (a QA pass): the resume takes the run's
    own (launch.json beside its plan) unless given again. torchrun is not started: the argv it
    would get is the oracle."""
    got = []
    monkeypatch.setattr("zplan.launch.runner.run_with_restarts", lambda argv, *a, **k: got.append(argv) or 0)
    run = tmp_path / "run"
    plan = tmp_path / "p.json"
    assert cli(capsys, "recommend", "--model", "tiny", "--gpu", "cpu", "--cluster", "cpu-local",
               "--gpus", "2", "--layout", "torch", "--write", str(plan)).returncode == 0

    def cadence(argv):
        return argv[argv.index("--save-every") + 1], argv[argv.index("--keep") + 1]

    assert cli(capsys, "launch", "--plan", str(plan), "--run-dir", str(run), "--save-every", "1",
               "--keep", "3").returncode == 0
    assert cadence(got[-1]) == ("1", "3")
    p = cli(capsys, "launch", "--resume", "--run-dir", str(run), "--steps", "30")
    assert p.returncode == 0 and cadence(got[-1]) == ("1", "3"), p.stderr
    assert "--resume keeps the run's --save-every 1 --keep 3" in p.stderr
    p = cli(capsys, "launch", "--resume", "--run-dir", str(run), "--steps", "40", "--save-every", "0")
    assert p.returncode == 0 and cadence(got[-1]) == ("0", "3"), p.stderr  # given again: taken
    (run / "launch.json").write_text('{"save_every": "__import__(\'os\')", "keep": -4}')  # data, not code
    p = cli(capsys, "launch", "--resume", "--run-dir", str(run), "--steps", "50")
    assert p.returncode == 0 and cadence(got[-1]) == ("0", "0"), p.stderr
    # its length too: a 300-step run stopped by a signal, resumed as its hint says (no --steps),
    # trained to the default 20 (a QA pass)
    long = tmp_path / "long"
    assert cli(capsys, "launch", "--plan", str(plan), "--run-dir", str(long), "--steps", "300").returncode == 0
    p = cli(capsys, "launch", "--resume", "--run-dir", str(long))
    assert p.returncode == 0 and got[-1][got[-1].index("--steps") + 1] == "300", p.stderr
    assert "--resume keeps the run's --steps 300" in p.stderr
    p = cli(capsys, "launch", "--resume", "--run-dir", str(long), "--steps", "400")
    assert p.returncode == 0 and got[-1][got[-1].index("--steps") + 1] == "400", p.stderr


def test_no_save_reaches_the_trainer_and_asks_no_room(capsys, tmp_path, monkeypatch):
    """--no-save is passed to the built-in trainer, and the run folder is not asked for a
    checkpoint's room (a benchmark of a model whose checkpoint would not fit the disk)."""
    import shutil as sh

    real = sh.disk_usage(tmp_path)
    monkeypatch.setattr("zplan.launch.run_dir.shutil.disk_usage", lambda p: real._replace(free=10))
    plan = tmp_path / "p.json"
    assert cli(capsys, "recommend", "--model", "tiny", "--gpu", "cpu", "--cluster", "cpu-local",
               "--gpus", "2", "--layout", "torch", "--write", str(plan)).returncode == 0
    # a dry run prints the command and says the launch itself would stop for the disk's room
    p = cli(capsys, "launch", "--dry-run", "--plan", str(plan), "--run-dir", str(tmp_path / "run"))
    assert p.returncode == 0 and "checkpoint needs about" in p.stderr and "would stop here" in p.stderr, p.stderr
    assert "zplan.trainer" in p.stdout
    monkeypatch.setattr("zplan.launch.runner.run_with_restarts", lambda *a, **k: pytest.fail("started a run"))
    p = cli(capsys, "launch", "--plan", str(plan), "--run-dir", str(tmp_path / "run3"))
    assert p.returncode == 1 and "checkpoint needs about" in p.stderr, p.stderr
    p = cli(capsys, "launch", "--dry-run", "--plan", str(plan), "--run-dir", str(tmp_path / "run"), "--no-save")
    assert p.returncode == 0, p.stderr
    assert p.stdout.count(" --no-save") == 1
    p = cli(capsys, "launch", "--dry-run", "--plan", str(plan), "--run-dir", str(tmp_path / "run"), "--", "--no-save")
    assert p.returncode == 0 and p.stdout.count(" --no-save") == 1, p.stderr  # after `--`: the same


def test_a_gpu_plan_where_there_is_no_gpu_is_refused_before_anything_starts(capsys, tmp_path, monkeypatch):
    """The launcher never asked node_problem: an H100 plan on this CPU-only machine started
    torchrun and its ranks, each then refusing it (or, for an 8B plan, a disk-space error hid the
    reason). Now one line, exit 2, before torchrun or the run folder."""
    import zplan.launch.runner as runner

    monkeypatch.setattr(runner, "run_with_restarts", lambda *a, **k: pytest.fail("torchrun started"))
    plan = tmp_path / "h100.json"
    assert cli(capsys, "recommend", "--model", "tiny", "--gpus", "2", "--gpu", "h100-sxm",
               "--write", str(plan)).returncode == 0
    p = cli(capsys, "launch", "--plan", str(plan), "--run-dir", str(tmp_path / "r"), "--steps", "1")
    assert p.returncode == 2 and "the plan is for h100-sxm GPUs but this node has none" in p.stderr, p.stderr
    assert len(p.stderr.strip().splitlines()) == 1 and not (tmp_path / "r").exists()


def test_run_directory_is_checked_before_anything_runs(capsys, tmp_path):
    (tmp_path / "file").write_text("x")
    p = cli(capsys, "launch", "--dry-run", "--run-dir", str(tmp_path / "file"))
    assert p.returncode == 2 and "is not a directory" in p.stderr
    p = cli(capsys, "launch", "--dry-run", "--resume", "--run-dir", str(tmp_path / "typo"))
    assert p.returncode == 2 and "does not exist" in p.stderr and not (tmp_path / "typo").exists()
    p = cli(capsys, "launch", "--dry-run", "--run-dir", "/sys/zplan-run")  # read-only even for root
    # the machine refused a write: exit 1, as docs/reliability.md says (it was 2; a QA pass)
    assert p.returncode == 1 and "/sys/zplan-run is not writable" in p.stderr, p.stderr
    p = cli(capsys, "launch", "--dry-run", "--run-dir", str(tmp_path / "file" / "r"))  # under a file: usage
    assert p.returncode == 2 and "is not writable (Not a directory)" in p.stderr, p.stderr


def test_the_first_node_of_several_holds_the_run_directory(capsys, tmp_path):
    """Multi-node launches shared their run folder without a lock: a second job's node 0 in the
    same folder resumed beside a running one. Node 0 now holds it (the other nodes share it)."""
    from zplan.launch.run_dir import hold_run_dir

    run = tmp_path / "r"
    run.mkdir()
    held = hold_run_dir(run)  # a running launch's lock
    try:
        p = cli(capsys, "launch", "--nnodes", "2", "--node-rank", "0", "--nproc", "1",
                "--rdzv-endpoint", "127.0.0.1:29999", "--run-dir", str(run))
        assert p.returncode == 2 and "another zplan launch is running" in p.stderr, p.stderr
    finally:
        held.close()


def test_run_directory_without_room_is_refused(monkeypatch, tmp_path):
    import shutil as sh

    from zplan.errors import PlanError
    from zplan.launch.run_dir import check_run_dir, checkpoint_bytes

    real = sh.disk_usage(tmp_path)
    monkeypatch.setattr("zplan.launch.run_dir.shutil.disk_usage",
                        lambda p: real._replace(free=10**9))
    check_run_dir(tmp_path / "a", need_bytes=checkpoint_bytes(80_000_000))  # 0.96 GB fits
    with pytest.raises(PlanError, match="1.00 GB free but one checkpoint needs about 1.20 GB"):
        check_run_dir(tmp_path / "b", need_bytes=checkpoint_bytes(100_000_000))


def _plan16(capsys, tmp_path):
    plan = tmp_path / "p16.json"
    p = cli(capsys, "recommend", "--model", "tiny", "--gpu", "h100-sxm", "--gpus", "16", "--write", str(plan))
    assert p.returncode == 0, p.stderr
    return plan


def _eight_gpus(monkeypatch):
    from zplan import hardware

    fake = detect(_fake_nvml(["NVIDIA H100 80GB HBM3"] * 8))
    monkeypatch.setattr(hardware, "detect", lambda *a, **k: fake)


def test_sixteen_ranks_on_an_eight_gpu_node_is_refused(capsys, tmp_path, monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    _eight_gpus(monkeypatch)
    plan = _plan16(capsys, tmp_path)
    p = cli(capsys, "launch", "--dry-run", "--plan", str(plan), "--run-dir", str(tmp_path / "r"))
    assert p.returncode == 2 and "16 ranks per node but this node has 8 GPUs" in p.stderr
    p = cli(capsys, "launch", "--dry-run", "--plan", str(plan), "--run-dir", str(tmp_path / "r"),
            "--nnodes", "2", "--node-rank", "0", "--rdzv-endpoint", "head:29400",
            "--log-dir", "/l", "--redirects", "3", "--local-ranks-filter", "0")
    assert p.returncode == 0, p.stderr
    assert "--nnodes=2 --rdzv-backend=c10d --rdzv-endpoint=head:29400" in p.stdout
    assert "--nproc-per-node=8 --max-restarts=0 --log-dir=/l --redirects=3 --local-ranks-filter=0" in p.stdout


def test_slurm_script_for_a_sixteen_gpu_plan(capsys, tmp_path, monkeypatch):
    """--slurm: nodes from the plan's N and the GPUs per node, one task per node, this Python,
    the plan beside the script; it passes bash -n and, under stub srun/scontrol, runs torchrun
    with rendezvous at the first node of the allocation."""
    plan = _plan16(capsys, tmp_path)
    out = tmp_path / "job.sbatch"
    p = cli(capsys, "launch", "--plan", str(plan), "--slurm", str(out), "--run-dir", "/shared/run",
            "--max-restarts", "2", "--steps", "100")
    assert p.returncode == 0, p.stderr
    text = out.read_text()
    for line in ("#SBATCH --nodes=2", "#SBATCH --ntasks-per-node=1", "#SBATCH --gpus-per-task=8",
                 "#SBATCH --cpus-per-task=32", f"srun --kill-on-bad-exit=1 {sys.executable} -m zplan.launch.elastic"):
        assert line in text, text
    beside = tmp_path / "job.plan.json"
    assert beside.is_file() and f"export ZPLAN_PLAN={beside}" in text
    assert subprocess.run(["bash", "-n", str(out)]).returncode == 0
    stubs = tmp_path / "bin"
    stubs.mkdir()
    (stubs / "scontrol").write_text('#!/bin/bash\n[ "$1 $2" = "show hostnames" ] && printf "gpu-a7\\ngpu-a8\\n"; seq 100000 | sed s/^/gpu-b/\n')
    (stubs / "srun").write_text('#!/bin/bash\nprintf "%s\\n" "$@" > "$STUB_OUT"\necho "ZPLAN_PLAN=$ZPLAN_PLAN" >> "$STUB_OUT"\n')
    for f in stubs.iterdir():
        f.chmod(0o755)
    env = {**os.environ, "PATH": f"{stubs}:{os.environ['PATH']}", "SLURM_JOB_NODELIST": "gpu-a[7-8]",
           "SLURM_JOB_ID": "4242", "STUB_OUT": str(tmp_path / "srun.args")}
    assert subprocess.run(["bash", str(out)], env=env).returncode == 0
    args = (tmp_path / "srun.args").read_text().splitlines()
    assert args[:4] == ["--kill-on-bad-exit=1", sys.executable, "-m", "zplan.launch.elastic"]
    assert "--rdzv-endpoint=gpu-a7:29500" in args and "--rdzv-id=4242" in args and "--nnodes=2" in args
    assert "--max-restarts=2" in args and "--nproc-per-node=8" in args
    assert args[args.index("--ckpt-dir") + 1] == "/shared/run" and args[args.index("--steps") + 1] == "100"
    assert args[-1] == f"ZPLAN_PLAN={beside}"
    assert not Path("/shared/run").exists()  # the run directory is the cluster's, not made here


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_two_nodes_train_checkpoint_to_one_run_dir_and_resume(run_zplan, tmp_path):
    """Two torchrun invocations (--nnodes 2, two ranks each, loopback c10d rendezvous) train one
    4-rank plan, write one checkpoint into one run directory, and resume from it."""
    import json
    import socket

    from tests.test_trainer import make_plan

    make_plan(run_zplan, tmp_path / "p4.json", "zero3", 4, 8)
    run_dir = tmp_path / "shared-run"

    def both(steps, *extra):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        procs = [subprocess.Popen(
            [sys.executable, "-m", "zplan", "launch", "--plan", str(tmp_path / "p4.json"), "--nnodes", "2",
             "--node-rank", str(node), "--nproc", "2", "--rdzv-endpoint", f"127.0.0.1:{port}",
             "--rdzv-id", f"two-{steps}", "--run-dir", str(run_dir), "--steps", str(steps), *extra,
             "--", "--no-memory"],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for node in (0, 1)]
        outs = [p.communicate(timeout=400) for p in procs]
        for p, (out, err) in zip(procs, outs):
            assert p.returncode == 0, err[-3000:]
        return json.loads((run_dir / "run_report.json").read_text())

    first = both(2)
    assert first["world_size"] == 4 and first["end_step"] == 2
    shards = sorted(f.name for f in (run_dir / "step_00000002").glob("*.distcp"))
    assert len(shards) == 4, shards  # every rank of both nodes wrote its shard into the one folder
    second = both(3, "--resume")
    assert second["start_step"] == 2 and second["end_step"] == 3
    assert second["losses"][0] < first["losses"][0]  # it continued from the trained weights


def test_rank_env_adds_expandable_segments_to_what_the_user_set():
    from zplan.launch.command import rank_env

    assert rank_env(False, {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:False"}) == ()
    assert rank_env(True, {}) == (("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True"),)
    assert rank_env(True, {"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:512"}) == (
        ("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:512,expandable_segments:True"),)
    assert rank_env(True, {"PYTORCH_ALLOC_CONF": "expandable_segments:True"}) == ()
    with pytest.raises(UsageError, match="expandable_segments:False.*--expandable-segments"):
        rank_env(True, {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:False"})
    # spaces around an option are PyTorch's too: the user's off is refused, not overridden
    with pytest.raises(UsageError, match="expandable_segments:False"):
        rank_env(True, {"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:128, expandable_segments:False"})
    with pytest.raises(UsageError, match="backend:cudaMallocAsync"):
        rank_env(True, {"PYTORCH_CUDA_ALLOC_CONF": "backend:cudaMallocAsync"})
    # an empty variable is set (PyTorch reads it, and then not the other name): both get the option
    assert rank_env(True, {"PYTORCH_CUDA_ALLOC_CONF": "", "PYTORCH_ALLOC_CONF": "max_split_size_mb:512"}) == (
        ("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True"),
        ("PYTORCH_ALLOC_CONF", "max_split_size_mb:512,expandable_segments:True"))
    spec = LaunchSpec("/p.json", 8, env=rank_env(True, {}))
    assert torchrun_argv(spec)[1] == {"ZPLAN_PLAN": "/p.json", "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
    assert "export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True\n" in slurm_script(spec, 8)


def test_a_plan_made_for_expandable_segments_runs_with_them(capsys, tmp_path, monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    monkeypatch.delenv("PYTORCH_ALLOC_CONF", raising=False)
    _eight_gpus(monkeypatch)
    plan = tmp_path / "p.json"
    p = cli(capsys, "recommend", "--model", "tiny", "--gpu", "h100-sxm", "--gpus", "8",
            "--expandable-segments", "--write", str(plan))
    assert p.returncode == 0, p.stderr
    p = cli(capsys, "launch", "--dry-run", "--plan", str(plan), "--run-dir", str(tmp_path / "r"))
    assert p.returncode == 0, p.stderr
    assert "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True" in p.stdout
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:False")
    p = cli(capsys, "launch", "--dry-run", "--plan", str(plan), "--run-dir", str(tmp_path / "r"))
    assert p.returncode == 2 and "expandable_segments:False" in p.stderr and "Traceback" not in p.stderr


@pytest.mark.parametrize("text,want", [
    ("processor\t: 0\nflags\t\t: fpu sse2 avx avx2 fma\n", False),  # an AVX2-only x86 CPU
    ("processor\t: 0\nflags\t\t: avx2 avx512f avx512_bf16\n", True),  # AVX-512 BF16
    ("processor\t: 0\nflags\t\t: avx2 avx512f amx_bf16 amx_tile\n", True),  # AMX
    ("processor\t: 0\nFeatures\t: fp asimd sve i8mm bf16\n", True),  # Arm FEAT_BF16
    ("processor\t: 0\nFeatures\t: fp asimd evtstrm\n", False),
    ("processor\t: 0\nmodel name\t: something\n", None),  # no flags at all: unknown
])
def test_cpu_bf16_from_the_kernels_flags(tmp_path, text, want):
    from zplan.hardware import cpu_has_bf16

    f = tmp_path / "cpuinfo"
    f.write_text(text)
    assert cpu_has_bf16(f) is want
    assert cpu_has_bf16(tmp_path / "missing") is None


@pytest.mark.parametrize("bf16,dtype", [(False, "fp32"), (True, "bf16"), (None, "bf16")])
def test_cpu_ranks_train_in_fp32_where_the_cpu_emulates_bf16(capsys, tmp_path, monkeypatch, bf16, dtype):
    """A fresh plan on CPU ranks: bf16 where the CPU has bf16 instructions (or nothing says
    otherwise), fp32 where bf16 matmuls would be emulated, said on stderr."""
    import json

    from zplan import hardware

    fake = hardware.Detected([], "no NVML", 16 * 2**30, "psutil (host)", 2, bf16)
    monkeypatch.setattr(hardware, "detect", lambda *a, **k: fake)
    p = cli(capsys, "launch", "--dry-run", "--run-dir", str(tmp_path / "r"))
    assert p.returncode == 0, p.stderr
    plan = json.loads((tmp_path / "r" / "plan.json").read_text())
    assert plan["train"]["precision"]["param"] == dtype, plan["train"]["precision"]
    assert ("train in fp32" in p.stderr) is (dtype == "fp32")
    # the bf16 plan run as given: said to be slow where the CPU emulates bf16
    bf16_plan = tmp_path / "bf16.json"
    cli(capsys, "recommend", "--model", "tiny", "--gpu", "cpu", "--cluster", "cpu-local", "--gpus", "2",
        "--param-dtype", "bf16", "--write", str(bf16_plan))
    p = cli(capsys, "launch", "--dry-run", "--plan", str(bf16_plan), "--run-dir", str(tmp_path / "r2"))
    assert p.returncode == 0, p.stderr
    assert ("computes in bf16 on CPU ranks" in p.stderr) is (bf16 is False)


def test_a_slurm_plan_is_not_chosen_by_the_login_nodes_cpu(capsys, tmp_path, monkeypatch):
    """--slurm runs on other nodes: a fresh plan keeps bf16 whatever this node's CPU lacks."""
    import json

    from zplan import hardware

    fake = hardware.Detected([], "no NVML", 16 * 2**30, "psutil (host)", 2, False)
    monkeypatch.setattr(hardware, "detect", lambda *a, **k: fake)
    job = tmp_path / "job.sbatch"
    p = cli(capsys, "launch", "--slurm", str(job), "--run-dir", "/shared/run")
    assert p.returncode == 0, p.stderr
    plan = json.loads(job.with_suffix(".plan.json").read_text())
    assert plan["train"]["precision"]["param"] == "bf16" and "train in fp32" not in p.stderr


def test_a_multi_node_plan_launched_on_one_node_says_its_network_is_not_the_plans(tmp_path, capsys):
    """launch --dry-run of a 64-GPU plan priced as 8 nodes of 8 printed one node of 64 ranks
    without a word (the QA pass): the shape it runs differs from the one priced, and the note
    says how to run the plan's (export --to torchrun prints the per-node command)."""
    from tests.helpers import cli
    plan = tmp_path / "p.json"
    assert cli(capsys, "recommend", "--model", "llama-3.1-70b", "--gpus", "64", "--write", str(plan)).returncode == 0
    r = cli(capsys, "launch", "--plan", str(plan), "--dry-run", "--no-save", "--run-dir", str(tmp_path / "run"))
    assert r.returncode == 0 and "--nproc-per-node=64" in r.stdout
    assert "priced for 8 node(s) of 8 (dgx-h100's links)" in r.stderr and "--nnodes 8 --nproc 8" in r.stderr
    r = cli(capsys, "launch", "--plan", str(plan), "--dry-run", "--no-save", "--nnodes", "8", "--node-rank", "0",
            "--rdzv-endpoint", "head:29500", "--run-dir", str(tmp_path / "run8"))
    assert r.returncode == 0 and "--nproc-per-node=8" in r.stdout and "priced for" not in r.stderr


def test_an_uneven_plan_launched_says_equal_nodes_and_exports_the_last_nodes_count(tmp_path, capsys):
    """A 12-GPU plan on 8-GPU nodes (8 + 4): launch's note does not advise --nnodes 2 --nproc 8
    (16 ranks, which launch refuses) but says launch runs equal nodes; export --to torchrun
    says the last node runs 4 (the review found it printing one node of 8)."""
    from tests.helpers import cli
    plan = tmp_path / "p.json"
    assert cli(capsys, "recommend", "--model", "tiny", "--gpus", "12", "--write", str(plan)).returncode == 0
    r = cli(capsys, "launch", "--plan", str(plan), "--dry-run", "--no-save", "--run-dir", str(tmp_path / "r"))
    assert r.returncode == 0 and "2 node(s) of 8, the last with 4" in r.stderr
    assert "--nproc 8 on each node" not in r.stderr and "a multiple of 8 GPUs" in r.stderr
    r = cli(capsys, "export", "--plan", str(plan), "--to", "torchrun")
    assert r.returncode == 0 and "--nnodes=2 --nproc-per-node=8" in r.stdout
    assert "the last, which runs 4 (--nproc-per-node=4 there)" in r.stdout


def test_a_run_directory_keeps_its_run_and_its_plan(tmp_path, capsys, monkeypatch):
    """The run-half QA pass: a fresh launch into a folder holding a run put its checkpoints beside
    the old ones (a later --resume loaded the old run's newer step) and replaced its report and
    plan; --resume wrote a fresh recommendation over the run's plan (zero2 at seq 64 became ddp
    at 256). Now: a fresh run refuses such a folder; --resume continues the run's own plan and
    refuses flags that would change it; --resume under another --plan keeps the run's as
    plan.prev.json and says what changes. All before a rank starts (dry runs here)."""
    from tests.helpers import cli
    monkeypatch.chdir(tmp_path)
    run = tmp_path / "run"
    base = ("launch", "--dry-run", "--no-save", "--nproc", "2", "--run-dir", str(run))
    assert cli(capsys, *base, "--seq-len", "64", "--strategy", "zero2").returncode == 0
    own = (run / "plan.json").read_bytes()
    assert json.loads(own)["strategy"] == "zero2"
    for held in ("run_report.json", "step_00000002"):
        (run / held).mkdir() if held.startswith("step_") else (run / held).write_text("{}")
        r = cli(capsys, *base, "--seq-len", "64")
        assert r.returncode == 2 and f"already holds a run" in r.stderr and held in r.stderr and "--resume" in r.stderr
        assert (run / "plan.json").read_bytes() == own
    r = cli(capsys, *base, "--resume", "--strategy", "ddp")
    assert r.returncode == 2 and "--resume continues the run's plan" in r.stderr and "--strategy" in r.stderr
    r = cli(capsys, *base, "--resume")
    assert r.returncode == 0 and f"ZPLAN_PLAN={run.resolve() / 'plan.json'}" in r.stdout
    assert (run / "plan.json").read_bytes() == own and not (run / "plan.prev.json").exists()
    other = tmp_path / "ddp.json"
    assert cli(capsys, "recommend", "--model", "tiny", "--gpus", "2", "--seq-len", "64", "--gpu", "cpu",
               "--strategy", "ddp", "--write", str(other)).returncode == 0
    # what a (non-dry) resume under another plan does before it writes the new one: keep each
    # replaced plan, and say what changes
    from zplan.cli.launch_cmd import _keep_replaced_plan
    from zplan.plan import load, save
    new = load(str(other))
    _keep_replaced_plan(run / "plan.json", new)
    assert "under another plan (strategy zero2 -> ddp" in capsys.readouterr().err
    assert (run / "plan.prev.json").read_bytes() == own
    save(new, run / "plan.json")
    _keep_replaced_plan(run / "plan.json", load(str(run / "plan.prev.json")))
    assert (run / "plan.prev2.json").is_file() and (run / "plan.prev.json").read_bytes() == own


def test_a_data_file_too_short_is_refused_before_the_ranks(tmp_path, capsys):
    """--data shorter than a sequence: one line, exit 2, before a folder is made (it was the
    trainer's ValueError inside the ranks: 'internal error', exit 1, a folder left behind); the
    trainer's own check is a usage error too."""
    from tests.helpers import cli
    from zplan.errors import UsageError
    from zplan.trainer.data import TokenSource
    short = tmp_path / "short.txt"
    short.write_bytes(b"x" * 65)
    r = cli(capsys, "launch", "--nproc", "1", "--steps", "2", "--seq-len", "64", "--data", str(short),
            "--run-dir", str(tmp_path / "run"))
    assert r.returncode == 2 and "has 65 bytes; the trainer needs more than seq_len + 1 = 65" in r.stderr
    assert not (tmp_path / "run").exists()
    with pytest.raises(UsageError, match="needs more than seq_len"):
        TokenSource(256, 64, text=str(short))


def test_resume_rules_the_review_found(tmp_path, capsys, monkeypatch):
    """After review: --resume with a flag equal to the run's plan is fine (re-running the first
    command with --resume added); --resume without the run's plan.json asks for --plan (a
    --slurm run keeps its plan beside the script) and with a damaged one says so; a dry run
    under another --plan leaves the run's plan alone and prints the command reading the plan
    given; --slurm --resume writes its script into a folder that holds the run."""
    from tests.helpers import cli
    monkeypatch.chdir(tmp_path)
    run = tmp_path / "run"
    base = ("launch", "--dry-run", "--no-save", "--nproc", "2", "--run-dir", str(run))
    assert cli(capsys, *base, "--seq-len", "64", "--strategy", "zero2").returncode == 0
    (run / "step_00000002").mkdir()
    own = (run / "plan.json").read_bytes()
    assert cli(capsys, *base, "--seq-len", "64", "--strategy", "zero2", "--resume").returncode == 0
    r = cli(capsys, *base, "--seq-len", "128", "--resume")
    assert r.returncode == 2 and "(seq len 64); --seq-len 128 would change it" in r.stderr
    assert cli(capsys, *base, "--model", "TINY", "--resume").returncode == 0  # the plan's model, as typed
    other = tmp_path / "ddp.json"
    assert cli(capsys, "recommend", "--model", "tiny", "--gpus", "2", "--seq-len", "64", "--gpu", "cpu",
               "--strategy", "ddp", "--write", str(other)).returncode == 0
    r = cli(capsys, "launch", "--dry-run", "--no-save", "--run-dir", str(run), "--resume", "--plan", str(other))
    assert r.returncode == 0 and f"ZPLAN_PLAN={other.resolve()}" in r.stdout
    assert (run / "plan.json").read_bytes() == own and not (run / "plan.prev.json").exists()
    r = cli(capsys, "launch", "--slurm", str(tmp_path / "job.sbatch"), "--run-dir", str(run), "--resume",
            "--plan", str(other))
    assert r.returncode == 0 and (tmp_path / "job.sbatch").is_file()
    (run / "plan.json").write_text("{broken")
    r = cli(capsys, *base, "--resume")
    assert r.returncode == 2 and "the run's plan cannot be read" in r.stderr and "--plan" in r.stderr
    (run / "plan.json").unlink()
    r = cli(capsys, *base, "--resume")
    assert r.returncode == 2 and "plan.json is not there" in r.stderr and "--plan" in r.stderr


def test_a_users_script_may_reuse_its_run_directory(tmp_path, capsys):
    """A script through api.init resumes by itself in its folder: a second launch of the same
    command there is not refused as a fresh run of zplan's trainer would be (the review)."""
    from tests.helpers import cli
    run = tmp_path / "run"
    run.mkdir()
    (run / "step_00000008").mkdir()
    script = tmp_path / "train.py"
    script.write_text("print('hi')\n")
    r = cli(capsys, "launch", "--dry-run", "--nproc", "1", "--run-dir", str(run), str(script))
    assert r.returncode == 0, r.stderr
    r = cli(capsys, "launch", "--dry-run", "--nproc", "1", "--run-dir", str(run))
    assert r.returncode == 2 and "already holds a run" in r.stderr


def test_more_cpu_ranks_than_cpus_is_said(tmp_path, capsys, monkeypatch):
    """--nproc 100 on a 2-CPU host passed --dry-run without a word (the run-half QA pass)."""
    from tests.helpers import cli
    from zplan import hardware
    from dataclasses import replace
    real = hardware.detect
    monkeypatch.setattr(hardware, "detect", lambda: replace(real(), gpus=[], cpus=2))
    r = cli(capsys, "launch", "--dry-run", "--no-save", "--nproc", "4", "--run-dir", str(tmp_path / "r"))
    assert r.returncode == 0 and "4 CPU ranks on 2 usable CPUs" in r.stderr
    r = cli(capsys, "launch", "--dry-run", "--no-save", "--nproc", "2", "--run-dir", str(tmp_path / "r2"))
    assert r.returncode == 0 and "usable CPUs" not in r.stderr


@pytest.mark.parametrize("flags,needle", [
    (("--redirects", "9"), "--redirects '9'"),
    (("--local-ranks-filter", "abc"), "--local-ranks-filter 'abc'"),
    (("--rdzv-endpoint", "localhost:99999"), "port in 1..65535"),
    (("--rdzv-endpoint", "bad host:29500"), "--rdzv-endpoint 'bad host:29500'"),
    (("--rdzv-id", ""), "--rdzv-id ''"),
    (("--log-dir", "FILE"), "is not a folder"),
    (("--redirects", "0:3,1:0", "--local-ranks-filter", "0", "--rdzv-endpoint", "[::1]:29400"), None),
])
def test_torchrun_options_are_checked_before_torchrun_sees_them(capsys, tmp_path, flags, needle):
    """Values zplan passes through to torchrun, which torchrun answered with a traceback
    (ValueError from its redirects/endpoint parsers, NotADirectoryError for a log-dir file) after
    the run directory was made: one line, exit 2, and nothing made; good values pass."""
    from tests.helpers import cli

    (tmp_path / "FILE").write_text("x")
    flags = tuple(str(tmp_path / "FILE") if f == "FILE" else f for f in flags)
    run = tmp_path / "run"
    r = cli(capsys, "launch", "--dry-run", "--steps", "2", "--nproc", "1", "--run-dir", str(run), *flags)
    if needle is None:
        assert r.returncode == 0, r.stderr
        return
    assert r.returncode == 2 and needle in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert "Traceback" not in r.stderr and not run.exists()


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_resume_the_ranks_refuse_leaves_the_runs_plan(run_zplan, tmp_path):
    """--resume --plan P keeps the run's plan as plan.prev.json and writes P before the ranks
    start; when the ranks refused it (a checkpoint of another model; zero1 at another world
    size), the folder named a plan that never ran and a plain --resume repeated the refusal.
    Now, with no checkpoint written under P, the run's plan is put back."""
    run = tmp_path / "run"
    common = ("--gpu", "cpu", "--cluster", "cpu-local", "--gpus", "1", "--seq-len", "32", "--global-batch", "1",
              "--strategy", "zero3")
    tiny, other = tmp_path / "tiny.json", tmp_path / "other.json"
    assert run_zplan("recommend", "--model", "tiny", *common, "--write", str(tiny)).returncode == 0
    text = (ROOT / "presets" / "models" / "tiny.toml").read_text().replace('name = "tiny"', 'name = "tiny2"')
    (tmp_path / "tiny2.toml").write_text(text)
    assert run_zplan("recommend", "--model", str(tmp_path / "tiny2.toml"), *common, "--write", str(other)).returncode == 0
    first = run_zplan("launch", "--plan", str(tiny), "--run-dir", str(run), "--steps", "1", timeout=240)
    assert first.returncode == 0, first.stderr[-2000:]
    own = (run / "plan.json").read_bytes()
    p = run_zplan("launch", "--plan", str(other), "--run-dir", str(run), "--steps", "2", "--resume", timeout=240)
    assert p.returncode == 2 and "is of model 'tiny' but the plan trains 'tiny2'" in p.stderr, p.stderr[-2000:]
    assert "is the run's plan again" in p.stderr
    assert (run / "plan.json").read_bytes() == own and not (run / "plan.prev.json").exists()


def test_gpu_auto_on_a_part_without_a_preset_names_the_way(monkeypatch):
    """A GH200 (96 GB) was planned as an H200 (141 GB) by --gpu auto: its name now maps to no
    preset, and --gpu auto says how to get one (a file, or zplan calibrate on it)."""
    from zplan import hardware
    from zplan.scenario_options import ScenarioOptions, build

    name = "NVIDIA GH200 480GB"
    gpu = hardware.GPUInfo(index=0, name=name, memory_bytes=96 * 10**9, preset=preset_for(name))
    monkeypatch.setattr(hardware, "detect", lambda: hardware.Detected(gpus=[gpu]))
    with pytest.raises(UsageError, match="GH200 480GB, which has no preset; pass --gpu FILE.toml .*calibrate"):
        build(ScenarioOptions(gpu="auto", params="7e9"))


def test_nohup_keeps_the_run_going():
    """Under `nohup zplan launch` (SIGHUP ignored when the launcher starts) a hang-up must not end
    the run: the launcher forwarded SIGHUP to torchrun and the ranks whatever its disposition.
    The child sends SIGHUP to the launcher and lives on: exit 0, not 129."""
    code = ("import signal, sys\n"
            "signal.signal(signal.SIGHUP, signal.SIG_IGN)\n"
            "from zplan.launch.runner import run\n"
            "child = 'import os, signal, time; os.kill(os.getppid(), signal.SIGHUP); time.sleep(1)'\n"
            "sys.exit(run([sys.executable, '-c', child], {}))\n")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, (p.returncode, p.stderr)


USER_SCRIPT = """
import os, sys, torch
from zplan.trainer import api

ctx = api.init()
width = int(os.environ.get("WIDTH", "16"))
with torch.device("meta"):
    model = torch.nn.Sequential(torch.nn.Linear(8, width), torch.nn.Linear(width, 4))
model = ctx.apply(model, units=[model[0], model[1]])
optim = ctx.optimizer(model)
start = ctx.resume(model, optim)
if os.environ.get("FAIL") == "own":
    raise ValueError("the script's own bug")
loss = model(torch.randn(2, 8)).square().mean()
loss.backward()
optim.step()
ctx.save(model, optim, start + 1)
ctx.close(leave=True)
"""


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_a_users_script_errors_and_notes(run_zplan, tmp_path):
    """A user's script under zplan launch (2 CPU ranks, zero3, a plan priced with full
    checkpointing): ctx.apply says the script applies the checkpointing (it was silent, and a
    plan chosen for fitting with it would not fit); the script's own error keeps its traceback,
    exit 1; zplan's own refusal inside the script (the script's model changed width: a checkpoint
    of another size, which read as damage) is one line, exit 2, no traceback wall; a relaunch
    with another --plan keeps the run's plan as plan.prev.json; a launch option after the script
    is said to go to the script."""
    script = tmp_path / "train.py"
    script.write_text(USER_SCRIPT)
    run = tmp_path / "run"
    plans = {}
    for name, ckpt_mode in (("full", "full"), ("none", "none")):
        plans[name] = tmp_path / f"{name}.json"
        p = run_zplan("recommend", "--model", "tiny", "--gpu", "cpu", "--cluster", "cpu-local", "--gpus", "2",
                      "--seq-len", "32", "--global-batch", "2", "--strategy", "zero3", "--checkpointing", ckpt_mode,
                      "--write", str(plans[name]))
        assert p.returncode == 0, p.stderr
    ok = run_zplan("launch", "--plan", str(plans["full"]), "--run-dir", str(run), str(script), timeout=200)
    assert ok.returncode == 0, ok.stderr[-3000:]
    assert "the plan was priced with activation checkpointing (full)" in ok.stderr
    own = run_zplan("launch", "--plan", str(plans["full"]), "--run-dir", str(run), str(script),
                    env={"FAIL": "own"}, timeout=200)
    assert own.returncode == 1 and "ValueError: the script's own bug" in own.stderr and "Traceback" in own.stderr
    wider = run_zplan("launch", "--plan", str(plans["none"]), "--run-dir", str(run), str(script), "--plan", "x",
                      env={"WIDTH": "32"}, timeout=200)
    assert wider.returncode == 2, wider.stderr[-3000:]
    assert "with 212 parameters but the model resumed has 420" in wider.stderr, wider.stderr[-3000:]
    assert "Traceback" not in wider.stderr
    assert "--plan after" in wider.stderr and "go to your script" not in wider.stderr.split("--plan after")[0]
    assert "under another plan" in wider.stderr  # the run's plan kept, and put back: nothing was saved
    from zplan.plan import load

    assert load(str(run / "plan.json")).train.checkpointing == "full" and not (run / "plan.prev.json").exists()


def test_a_plan_the_api_refuses_is_refused_before_any_rank(tmp_path, capsys):
    """api.init refuses a plan the trainer cannot apply to any model (--compile: it runs eager
    linears) in every rank after the rendezvous, a traceback each (the QA pass); zplan launch
    says it once, before starting anything."""
    from tests.helpers import cli

    plan, script = tmp_path / "p.json", tmp_path / "train.py"
    script.write_text("print('never')\n")
    r = cli(capsys, "recommend", "--model", "tiny", "--gpu", "cpu", "--cluster", "cpu-local", "--gpus", "2",
            "--seq-len", "64", "--strategy", "zero3", "--compile", "--write", str(plan))
    assert r.returncode == 0, r.stderr
    r = cli(capsys, "launch", "--dry-run", "--plan", str(plan), "--run-dir", str(tmp_path / "run"), str(script))
    assert r.returncode == 1 and "cannot run" in r.stderr and "compile" in r.stderr and r.stdout == "", r.stderr


def test_launch_without_torch_says_so_in_one_line_before_writing_anything(capsys, tmp_path, monkeypatch):
    """README's install (`pip install -e .`) has no torch: zplan launch wrote the run's plan,
    then died in a ModuleNotFoundError traceback with exit 1 (a plan that cannot work). It is a
    usage error like every other command that needs torch, said before anything is written;
    a dry run, which runs nothing here, still prints its command."""
    import sys

    monkeypatch.setitem(sys.modules, "torch", None)  # `import torch` raises ImportError
    run = tmp_path / "run"
    p = cli(capsys, "launch", "--steps", "2", "--run-dir", str(run))
    assert p.returncode == 2 and "needs torch: pip install 'zplan[train]'" in p.stderr, p.stderr
    assert len(p.stderr.strip().splitlines()) == 1 and not run.exists()
    p = cli(capsys, "launch", "--steps", "2", "--run-dir", str(run), "--dry-run")
    assert p.returncode == 0 and "zplan.trainer" in p.stdout, p.stderr
