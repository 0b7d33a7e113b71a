"""The torchrun command as data: argv and environment, built from a plan and the options.

Nothing here starts a process (zplan/launch/runner.py does), so every command is testable.
Locally zplan runs `python -m zplan.launch.elastic`, which is torchrun's own main with failures
reported in one line, the ranks' exit code passed on and SIGUSR1 passed to the ranks
(zplan/launch/elastic.py); so does the Slurm script, on every node.
"""

from __future__ import annotations

import re
import shlex
import sys
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import UsageError

ELASTIC = "zplan.launch.elastic"
SLURM_RDZV_PORT = 29500
SLURM_STOP_WARNING_S = 300  # as zplan launch's STOP_GRACE_S: a step and a checkpoint


@dataclass(frozen=True)
class LaunchSpec:
    plan_path: str
    nproc_per_node: int
    nnodes: int = 1
    node_rank: int | None = None
    rdzv_endpoint: str | None = None
    rdzv_id: str = "zplan"
    max_restarts: int = 0  # torchrun's own restarts (the Slurm script); zplan launch restarts itself
    script: str | None = None  # None: the built-in trainer
    script_args: tuple[str, ...] = ()
    python: str = field(default_factory=lambda: sys.executable)
    torchrun_opts: tuple[str, ...] = ()  # passed through: --log-dir, --redirects, --local-ranks-filter
    env: tuple[tuple[str, str], ...] = ()  # the ranks' environment besides ZPLAN_PLAN (rank_env)

    def validate(self) -> None:
        if self.nproc_per_node < 1:
            raise UsageError(f"--nproc {self.nproc_per_node} must be at least 1")
        if self.nnodes < 1:
            raise UsageError(f"--nnodes {self.nnodes} must be at least 1")
        if self.node_rank is not None and not 0 <= self.node_rank < self.nnodes:
            raise UsageError(f"--node-rank {self.node_rank} must be in 0..{self.nnodes - 1}")
        if self.max_restarts < 0:
            raise UsageError(f"--max-restarts {self.max_restarts} must be 0 or more")

    def target(self) -> list[str]:
        return (["-m", "zplan.trainer"] if self.script is None else [self.script]) + list(self.script_args)


_REDIRECTS = re.compile(r"[0-3]|(\d:[0-3],)*\d:[0-3]")  # torchrun's Std.from_str: one, or rank:value pairs (one-digit ranks)


def check_torchrun_options(rdzv_endpoint: str | None, rdzv_id: str, log_dir: str | None,
                           redirects: str | None, local_ranks_filter: str | None) -> None:
    """Refuse, in one line, the values zplan passes to torchrun that torchrun would answer with a
    traceback (torch/distributed/run.py, elastic/multiprocessing/api.py Std.from_str,
    elastic/rendezvous/utils.py parse_rendezvous_endpoint), before a run directory is made."""
    if redirects is not None and not _REDIRECTS.fullmatch(redirects):
        raise UsageError(f"--redirects {redirects!r} is not one of 0-3 (none, stdout, stderr, both) nor rank:value "
                         f"pairs like 0:3,1:0")
    if local_ranks_filter is not None and not re.fullmatch(r"\d+(,\d+)*", local_ranks_filter):
        raise UsageError(f"--local-ranks-filter {local_ranks_filter!r} is not a comma-separated list of local "
                         f"ranks; write it like 0,1")
    if not rdzv_id.strip() or not rdzv_id.isprintable():
        raise UsageError(f"--rdzv-id {rdzv_id!r} is empty or not printable; name the job, e.g. --rdzv-id myrun")
    if rdzv_endpoint is not None:
        host, port = rdzv_endpoint, ""
        if rdzv_endpoint.startswith("["):  # an IPv6 address: [::1]:29400
            host, _, rest = rdzv_endpoint[1:].partition("]")
            port = rest[1:] if rest.startswith(":") else ("?" if rest else "")
        elif ":" in rdzv_endpoint:
            host, _, port = rdzv_endpoint.rpartition(":")
        if not host or any(c.isspace() for c in host) or not host.isprintable() or \
                (port and not (port.isdigit() and 0 < int(port) < 65536)):
            raise UsageError(f"--rdzv-endpoint {rdzv_endpoint!r} is not HOST:PORT with a port in 1..65535; "
                             f"write it like node0:29500")
    if log_dir is not None and (not log_dir or Path(log_dir).exists() and not Path(log_dir).is_dir()):
        raise UsageError(f"--log-dir {log_dir!r} is not a folder; name a folder (it is made if missing)")


def torchrun_argv(spec: LaunchSpec, module: str = ELASTIC) -> tuple[list[str], dict[str, str]]:
    """[python, -m, zplan.launch.elastic, torchrun options..., target] and the ranks' environment."""
    spec.validate()
    if spec.nnodes > 1 and not spec.rdzv_endpoint:
        raise UsageError("--nnodes > 1 needs --rdzv-endpoint HOST:PORT (the head node), or --slurm")
    argv = [spec.python, "-m", module]
    if spec.nnodes == 1 and not spec.rdzv_endpoint:
        argv += ["--standalone", "--nnodes=1"]
    else:
        argv += [f"--nnodes={spec.nnodes}", "--rdzv-backend=c10d",
                 f"--rdzv-endpoint={spec.rdzv_endpoint}", f"--rdzv-id={spec.rdzv_id}"]
        if spec.node_rank is not None:
            argv.append(f"--node-rank={spec.node_rank}")
    argv += [f"--nproc-per-node={spec.nproc_per_node}", f"--max-restarts={spec.max_restarts}"]
    argv += list(spec.torchrun_opts)
    return argv + spec.target(), {"ZPLAN_PLAN": spec.plan_path, **dict(spec.env)}


ALLOC_CONFS = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")  # the older name, and PyTorch's newer


def rank_env(expandable_segments: bool, environ: dict[str, str]) -> tuple[tuple[str, str], ...]:
    """What the ranks' environment must add for the plan's allocator assumption: with
    `expandable_segments` (planned with --expandable-segments), expandable_segments:True added to
    every allocator setting the user has (PyTorch reads one of the two names, which one depends
    on its version, once, at the allocator's first use: so before the ranks start), or
    PYTORCH_CUDA_ALLOC_CONF alone where there is none. A setting that turns them off, or
    cudaMallocAsync (another allocator), contradicts the plan: one line naming both fixes."""
    if not expandable_segments:
        return ()
    out = []
    for name in (n for n in ALLOC_CONFS if n in environ):
        current = environ[name].strip().strip(",")
        options = {k.strip(): v.strip() for k, _, v in (o.partition(":") for o in current.split(",")) if k.strip()}
        value = options.get("expandable_segments", "")
        if value.lower() == "true":
            continue
        if value or options.get("backend", "native").lower() != "native":
            what = f"expandable_segments:{value}" if value else f"backend:{options['backend']}"
            raise UsageError(f"{name}={current} sets {what}, but the plan assumes PyTorch's native "
                             f"allocator with expandable segments (--expandable-segments): drop it "
                             f"from {name}, or plan without --expandable-segments")
        out.append((name, f"{current},expandable_segments:True" if current else "expandable_segments:True"))
    if not any(n in environ for n in ALLOC_CONFS):
        out.append((ALLOC_CONFS[0], "expandable_segments:True"))
    return tuple(out)


def shell_line(argv: list[str], env: dict[str, str]) -> str:
    pre = " ".join(f"{k}={shlex.quote(v)}" for k, v in sorted(env.items()))
    return f"{pre} {shlex.join(argv)}"


def slurm_script(spec: LaunchSpec, gpus_per_node: int, cpus_per_task: int = 0, job: str = "zplan") -> str:
    """An sbatch script: one task per node, each running zplan's torchrun (zplan.launch.elastic,
    with the same Python as this zplan) with c10d rendezvous at the first node of the allocation."""
    spec.validate()
    lines = [
        "#!/bin/bash",
        f"#SBATCH --job-name={job}",
        f"#SBATCH --nodes={spec.nnodes}",
        "#SBATCH --ntasks-per-node=1",
    ]
    if gpus_per_node:
        lines.append(f"#SBATCH --gpus-per-task={gpus_per_node}")
    if cpus_per_task:
        lines.append(f"#SBATCH --cpus-per-task={cpus_per_task}")
    if spec.script is None:  # a script of one's own may not handle SIGUSR1, which would end it
        lines += [f"# {SLURM_STOP_WARNING_S} s before the time limit: the trainer stops after its step, "
                  "with a checkpoint (at the limit Slurm's SIGTERM gives 30 s, its KillWait)",
                  f"#SBATCH --signal=USR1@{SLURM_STOP_WARNING_S}"]
    opts = " ".join(shlex.quote(o) for o in spec.torchrun_opts)
    endpoint = spec.rdzv_endpoint or f"$head_node:{SLURM_RDZV_PORT}"  # default: the allocation's first node
    lines += [
        f"#SBATCH --output={job}-%j.out",
        "set -euo pipefail",
        '# sed reads every line: `head -n 1` would end the pipe early, and pipefail turns that into an exit',
        'head_node=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | sed -n 1p)',
        f"export ZPLAN_PLAN={shlex.quote(spec.plan_path)}",
        *(f"export {k}={shlex.quote(v)}" for k, v in spec.env),
        f"srun --kill-on-bad-exit=1 {shlex.quote(spec.python)} -m {ELASTIC} \\",
        f"    --nnodes={spec.nnodes} --nproc-per-node={spec.nproc_per_node} \\",
        f'    --rdzv-backend=c10d --rdzv-endpoint="{endpoint}" --rdzv-id="$SLURM_JOB_ID" \\',
        f"    --max-restarts={spec.max_restarts}{' ' + opts if opts else ''} \\",
        f"    {shlex.join(spec.target())}",
    ]
    return "\n".join(lines) + "\n"
