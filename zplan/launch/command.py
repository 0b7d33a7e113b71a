"""The torchrun command as data: argv and environment, built from a plan and the options.

Nothing here starts a process (zplan/launch/runner.py does), so every command is testable.
"""

from __future__ import annotations

import shlex
import sys
from dataclasses import dataclass, field

from ..errors import UsageError


@dataclass(frozen=True)
class LaunchSpec:
    plan_path: str
    nproc_per_node: int
    nnodes: int = 1
    node_rank: int | None = None
    rdzv_endpoint: str | None = None
    rdzv_id: str = "zplan"
    max_restarts: int = 0
    script: str | None = None  # None: the built-in trainer
    script_args: tuple[str, ...] = ()
    python: str = field(default_factory=lambda: sys.executable)

    def validate(self) -> None:
        if self.nproc_per_node < 1:
            raise UsageError(f"--nproc {self.nproc_per_node} must be at least 1")
        if self.nnodes < 1:
            raise UsageError(f"--nnodes {self.nnodes} must be at least 1")
        if self.nnodes > 1 and not self.rdzv_endpoint:
            raise UsageError("--nnodes > 1 needs --rdzv-endpoint HOST:PORT (the head node)")
        if self.node_rank is not None and not 0 <= self.node_rank < self.nnodes:
            raise UsageError(f"--node-rank {self.node_rank} must be in 0..{self.nnodes - 1}")
        if self.max_restarts < 0:
            raise UsageError(f"--max-restarts {self.max_restarts} must be 0 or more")


def torchrun_argv(spec: LaunchSpec) -> tuple[list[str], dict[str, str]]:
    """[python, -m, torch.distributed.run, ...] and the environment the ranks need."""
    spec.validate()
    argv = [spec.python, "-m", "torch.distributed.run"]
    if spec.nnodes == 1 and not spec.rdzv_endpoint:
        argv += ["--standalone", "--nnodes=1"]
    else:
        argv += [f"--nnodes={spec.nnodes}", "--rdzv-backend=c10d",
                 f"--rdzv-endpoint={spec.rdzv_endpoint}", f"--rdzv-id={spec.rdzv_id}"]
        if spec.node_rank is not None:
            argv.append(f"--node-rank={spec.node_rank}")
    argv += [f"--nproc-per-node={spec.nproc_per_node}", f"--max-restarts={spec.max_restarts}"]
    if spec.script is None:
        argv += ["-m", "zplan.trainer"]
    else:
        argv.append(spec.script)
    argv += list(spec.script_args)
    return argv, {"ZPLAN_PLAN": spec.plan_path}


def shell_line(argv: list[str], env: dict[str, str]) -> str:
    pre = " ".join(f"{k}={shlex.quote(v)}" for k, v in sorted(env.items()))
    return f"{pre} {shlex.join(argv)}"


def slurm_script(spec: LaunchSpec, gpus_per_node: int, cpus_per_task: int = 0, job: str = "zplan") -> str:
    """An sbatch script: one task per node, each running torchrun with c10d rendezvous at the
    first node of the allocation."""
    spec.validate()
    target = "-m zplan.trainer" if spec.script is None else shlex.quote(spec.script)
    args = " ".join(shlex.quote(a) for a in spec.script_args)
    lines = [
        "#!/bin/bash",
        f"#SBATCH --job-name={job}",
        f"#SBATCH --nodes={spec.nnodes}",
        "#SBATCH --ntasks-per-node=1",
    ]
    if gpus_per_node:
        lines.append(f"#SBATCH --gpus-per-node={gpus_per_node}")
    if cpus_per_task:
        lines.append(f"#SBATCH --cpus-per-task={cpus_per_task}")
    lines += [
        f"#SBATCH --output={job}-%j.out",
        "set -euo pipefail",
        'head_node=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
        f"export ZPLAN_PLAN={shlex.quote(spec.plan_path)}",
        "srun --kill-on-bad-exit=1 python -m torch.distributed.run \\",
        f"    --nnodes={spec.nnodes} --nproc-per-node={spec.nproc_per_node} \\",
        '    --rdzv-backend=c10d --rdzv-endpoint="$head_node:29500" --rdzv-id="$SLURM_JOB_ID" \\',
        f"    --max-restarts={spec.max_restarts} \\",
        f"    {target}{' ' + args if args else ''}",
    ]
    return "\n".join(lines) + "\n"
