"""zplan launch: the torchrun command as data, the Slurm script, detection through a fake NVML."""

import types

import pytest

from zplan.errors import UsageError
from zplan.hardware import detect, preset_for, visible_indices
from zplan.launch.command import LaunchSpec, shell_line, slurm_script, torchrun_argv


def test_one_node_argv():
    argv, env = torchrun_argv(LaunchSpec("/r/plan.json", 8, python="python"))
    assert argv == ["python", "-m", "torch.distributed.run", "--standalone", "--nnodes=1",
                    "--nproc-per-node=8", "--max-restarts=0", "-m", "zplan.trainer"]
    assert env == {"ZPLAN_PLAN": "/r/plan.json"}


def test_multi_node_argv_with_script():
    spec = LaunchSpec("p.json", 8, nnodes=4, node_rank=2, rdzv_endpoint="head:29500", rdzv_id="job7",
                      max_restarts=3, script="train.py", script_args=("--lr", "1e-4"), python="python")
    argv, _ = torchrun_argv(spec)
    assert argv == ["python", "-m", "torch.distributed.run", "--nnodes=4", "--rdzv-backend=c10d",
                    "--rdzv-endpoint=head:29500", "--rdzv-id=job7", "--node-rank=2",
                    "--nproc-per-node=8", "--max-restarts=3", "train.py", "--lr", "1e-4"]
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
#SBATCH --gpus-per-node=8
#SBATCH --output=zplan-%j.out
set -euo pipefail
head_node=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
export ZPLAN_PLAN=/shared/run/plan.json
srun --kill-on-bad-exit=1 python -m torch.distributed.run \\
    --nnodes=4 --nproc-per-node=8 \\
    --rdzv-backend=c10d --rdzv-endpoint="$head_node:29500" --rdzv-id="$SLURM_JOB_ID" \\
    --max-restarts=1 \\
    -m zplan.trainer --steps 100
"""


def test_slurm_script_golden():
    spec = LaunchSpec("/shared/run/plan.json", 8, nnodes=4, rdzv_endpoint="x:1", max_restarts=1,
                      script_args=("--steps", "100"))
    assert slurm_script(spec, 8) == SLURM_GOLDEN


def test_slurm_one_node_cpu():
    text = slurm_script(LaunchSpec("p.json", 2), 0)
    assert "--gpus-per-node" not in text and "--nnodes=1 --nproc-per-node=2" in text


def _fake_nvml(names, mem=80 * 2**30, fail=False):
    m = types.SimpleNamespace()
    def init():
        if fail:
            raise RuntimeError("Driver Not Loaded")
    m.nvmlInit = init
    m.nvmlShutdown = lambda: None
    m.nvmlDeviceGetCount = lambda: len(names)
    m.nvmlDeviceGetHandleByIndex = lambda i: i
    m.nvmlDeviceGetName = lambda h: names[h].encode()
    m.nvmlDeviceGetMemoryInfo = lambda h: types.SimpleNamespace(total=mem)
    return m


def test_detect_with_a_fake_nvml(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    d = detect(_fake_nvml(["NVIDIA H100 80GB HBM3"] * 8))
    assert len(d.gpus) == 8 and d.gpu_preset == "h100-sxm"
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,5")
    d = detect(_fake_nvml(["NVIDIA H100 80GB HBM3"] * 8))
    assert [g.index for g in d.gpus] == [2, 5] and "2 of 8" in d.gpu_reason
    d = detect(_fake_nvml([], fail=True))
    assert d.gpus == [] and "Driver Not Loaded" in d.gpu_reason
    assert d.host_ram_bytes > 0 and d.cpus >= 1


def test_visible_devices_rules():
    assert visible_indices(4, None) == [0, 1, 2, 3]
    assert visible_indices(4, "") == []
    assert visible_indices(4, "1,7,2") == [1]  # CUDA stops at the first invalid ordinal
    assert visible_indices(4, "3,1") == [3, 1]


def test_preset_names():
    assert preset_for("NVIDIA H100 PCIe") == "h100-pcie"
    assert preset_for("NVIDIA A100-SXM4-80GB") == "a100-80gb"
    assert preset_for("NVIDIA H200") == "h200"
    assert preset_for("Tesla T4") is None


def test_cgroup_limit(tmp_path):
    from zplan.hardware import cgroup_memory_limit
    (tmp_path / "memory.max").write_text("1073741824\n")
    assert cgroup_memory_limit(tmp_path) == 2**30
    (tmp_path / "memory.max").write_text("max\n")
    assert cgroup_memory_limit(tmp_path) is None


def test_launch_dry_run_cli(run_zplan, tmp_path):
    p = run_zplan("launch", "--dry-run", "--run-dir", str(tmp_path / "r"), "--steps", "5")
    assert p.returncode == 0, p.stderr
    line = p.stdout.strip()
    assert line.startswith(f"ZPLAN_PLAN={tmp_path}/r/plan.json ")
    assert "--standalone --nnodes=1 --nproc-per-node=2 --max-restarts=0 -m zplan.trainer" in line
    assert "--steps 5" in line
    assert not (tmp_path / "r" / "plan.json").exists()  # a dry run writes nothing


def test_detect_cli(run_zplan):
    p = run_zplan("detect", "--json")
    assert p.returncode == 0
    import json
    d = json.loads(p.stdout)
    assert d["cpus"] >= 1 and d["host_ram_bytes"] > 0


@pytest.mark.slow
def test_sigterm_ends_every_rank(tmp_path):
    """Ctrl-C or SIGTERM to zplan launch ends torchrun and every rank; nothing is left behind."""
    import os
    import signal
    import subprocess
    import sys
    import time

    marker = f"zplan-sleeper-{os.getpid()}"
    script = tmp_path / f"{marker}.py"
    script.write_text("import time\ntime.sleep(120)\n")
    p = subprocess.Popen([sys.executable, "-m", "zplan", "launch", str(script), "--run-dir",
                          str(tmp_path / "r")], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def ranks():
        out = subprocess.run(["pgrep", "-f", marker], capture_output=True, text=True).stdout
        return [int(x) for x in out.split() if int(x) != p.pid]

    deadline = time.time() + 60
    while time.time() < deadline and len(ranks()) < 2:
        time.sleep(0.5)
    assert len(ranks()) >= 2, "the two ranks never started"
    p.send_signal(signal.SIGTERM)
    rc = p.wait(timeout=60)
    assert rc != 0
    time.sleep(1)
    assert ranks() == [], "ranks outlived the launcher"
