"""zplan detect and zplan launch."""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Annotated, Optional

import typer

from ..errors import UsageError
from .app import app, emit_json
from ..parse import check_range

CPU_RANKS = 2
CPU_MODEL = "tiny"


@app.command()
def detect(as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object")] = False) -> None:
    """What this machine has: GPUs (NVML), host RAM (cgroup-clamped), usable CPUs."""
    from ..hardware import detect as run_detect

    d = run_detect()
    if as_json:
        emit_json({"gpus": [g.__dict__ for g in d.gpus], "gpu_reason": d.gpu_reason,
                   "gpu_preset": d.gpu_preset, "host_ram_bytes": d.host_ram_bytes,
                   "host_ram_source": d.host_ram_source, "cpus": d.cpus})
        return
    if d.gpus:
        for g in d.gpus:
            print(f"GPU {g.index}: {g.name}, {g.memory_bytes / 2**30:.1f} GiB (preset: {g.preset or 'none'})")
    else:
        print(f"No GPU: {d.gpu_reason}. zplan launch will run {CPU_RANKS} CPU ranks over gloo.")
    print(f"Host RAM: {d.host_ram_bytes / 2**30:.1f} GiB ({d.host_ram_source}); usable CPUs: {d.cpus}")


def _fresh_plan(model: str, nproc: int | None, nnodes: int, gpus_found: int, gpu_preset: str | None,
                global_batch: int | None, strategy: list[str] | None, seq_len: int | None):
    """A recommendation for this machine (or CPU ranks), as the plan to run."""
    from ..plan import make_plan
    from ..recommend import search
    from ..scenario_options import ScenarioOptions, build, cpu_ranks

    if gpus_found:
        per_node = nproc or gpus_found
        opts = ScenarioOptions(model=model, gpu=gpu_preset, gpus=str(per_node * nnodes),
                               gpus_per_node=per_node, layout="torch", seq_len=seq_len)
    else:
        per_node = nproc or CPU_RANKS
        opts = cpu_ranks(model=model, gpus=str(per_node * nnodes), gpus_per_node=per_node,
                         seq_len=seq_len)
    sc = build(opts)
    batch = global_batch or 4 * sc.n
    rec = search(sc, batch, families=strategy or None)
    return make_plan(rec.winner.sc, rec.winner.family, batch, rec.winner.result), per_node


def _check_flags(plan, model, strategy, global_batch, seq_len, nproc, nnodes, node_rank,
                 max_restarts, save_every, data) -> None:
    """Validation only (issue 10): nonsense refused, and no flag given next to --plan ignored."""
    from ..parse import check_choice
    from ..strategies import STRATEGIES

    check_range(nproc, "--nproc", 1, 1024)
    check_range(global_batch, "--global-batch", 1, 10**9)
    check_range(seq_len, "--seq-len", 1, 10**7)
    check_range(node_rank, "--node-rank", 0, nnodes - 1)
    check_range(max_restarts, "--max-restarts", 0, 1000)
    check_range(save_every, "--save-every", 0, 10**9)
    for s in strategy or ():
        check_choice(s, "--strategy", tuple(STRATEGIES))
    if data is not None and not Path(data).is_file():
        raise UsageError(f"--data {data!r} is not a file; pass a local text file, or drop --data for synthetic data")
    given = [f for f, v in (("--model", model != CPU_MODEL), ("--strategy", strategy),
                             ("--global-batch", global_batch is not None),
                             ("--seq-len", seq_len is not None)) if v]
    if plan is not None and given:
        raise UsageError(f"{', '.join(given)} shape a fresh recommendation, but --plan {plan} fixes "
                         f"them; drop {given[0]} or plan again with zplan recommend --write")


@app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def launch(
    ctx: typer.Context,
    script: Annotated[Optional[str], typer.Argument(help="Your training script (default: zplan's trainer)")] = None,
    plan: Annotated[Optional[str], typer.Option(help="Plan file to run (default: a fresh recommendation)")] = None,
    model: Annotated[str, typer.Option(help="Model for a fresh recommendation")] = CPU_MODEL,
    strategy: Annotated[Optional[list[str]], typer.Option(help="Restrict a fresh recommendation to these strategies")] = None,
    global_batch: Annotated[Optional[int], typer.Option(help="Sequences per step for a fresh plan")] = None,
    seq_len: Annotated[Optional[int], typer.Option(help="Sequence length for a fresh plan")] = None,
    nproc: Annotated[Optional[int], typer.Option(help="Processes per node (default: GPUs found, or 2 CPU ranks)")] = None,
    nnodes: Annotated[int, typer.Option(help="Nodes")] = 1,
    node_rank: Annotated[Optional[int], typer.Option(help="This node's rank (multi-node)")] = None,
    rdzv_endpoint: Annotated[Optional[str], typer.Option(help="HOST:PORT of the rendezvous (multi-node)")] = None,
    rdzv_id: Annotated[str, typer.Option(help="Rendezvous id")] = "zplan",
    max_restarts: Annotated[int, typer.Option(help="torchrun restarts on failure")] = 0,
    run_dir: Annotated[Optional[str], typer.Option(help="Where the plan, checkpoints and report go")] = None,
    steps: Annotated[int, typer.Option(help="Built-in trainer: optimizer steps")] = 20,
    save_every: Annotated[int, typer.Option(help="Built-in trainer: checkpoint every N steps (0: never)")] = 0,
    resume: Annotated[bool, typer.Option(help="Built-in trainer: resume from the newest checkpoint")] = False,
    data: Annotated[Optional[str], typer.Option(help="Built-in trainer: a local text file (default synthetic)")] = None,
    dry_run: Annotated[bool, typer.Option(help="Print exactly what would run, and stop")] = False,
    slurm: Annotated[Optional[str], typer.Option(help="Write an sbatch script here instead of running")] = None,
) -> None:
    """Run a plan with torchrun on this machine's GPUs (or CPU ranks over gloo)."""
    from ..hardware import detect as run_detect
    from ..launch.command import LaunchSpec, shell_line, slurm_script, torchrun_argv
    from ..plan import load, save, write_atomic

    check_range(nnodes, "--nnodes", 1, 100000)
    check_range(steps, "--steps", 1, 10**9)
    _check_flags(plan, model, strategy, global_batch, seq_len, nproc, nnodes, node_rank,
                 max_restarts, save_every, data)
    extra = list(ctx.args)
    if script is not None and script.startswith("-"):
        extra, script = [script] + extra, None  # arguments for the built-in trainer, after --
    if extra and extra[0] == "--":
        extra = extra[1:]
    if script is not None and not Path(script).is_file():
        raise UsageError(f"no such script: {script}; pass a path to your train.py, or none for zplan's trainer")
    found = run_detect()
    run = Path(run_dir or f"runs/{time.strftime('%Y%m%d-%H%M%S')}")
    if plan is not None:
        p = load(plan)
        per_node = nproc or (p.num_gpus // nnodes)
        if per_node * nnodes != p.num_gpus:
            raise UsageError(f"the plan is for {p.num_gpus} ranks; --nproc {per_node} x --nnodes {nnodes} "
                             f"gives {per_node * nnodes}: drop --nproc or plan again with --gpus {per_node * nnodes}")
    else:
        p, per_node = _fresh_plan(model, nproc, nnodes, len(found.gpus), found.gpu_preset,
                                  global_batch, strategy, seq_len)
    from ..plan import trainer_refusal

    why = trainer_refusal(p) if script is None else None
    if why:
        from ..errors import PlanError

        raise PlanError(f"zplan's trainer cannot run {plan or 'this plan'}: {why}")
    plan_path = str((run / "plan.json").resolve())
    if script is None:
        extra = ["--ckpt-dir", str(run.resolve()), "--steps", str(steps),
                 "--save-every", str(save_every)] + (["--resume"] if resume else []) + \
                (["--data", data] if data else []) + extra
    spec = LaunchSpec(plan_path, per_node, nnodes, node_rank, rdzv_endpoint, rdzv_id, max_restarts,
                      script, tuple(extra))
    if slurm:
        if not dry_run:
            save(p, plan_path)
        write_atomic(slurm, slurm_script(spec, per_node if found.gpus or p.gpu.name != "cpu" else 0))
        print(f"zplan: wrote {slurm} (sbatch {slurm}); plan {plan_path}", file=sys.stderr)
        return
    argv, env = torchrun_argv(spec)
    if dry_run:
        print(shell_line(argv, env))
        return
    save(p, plan_path)
    print(f"zplan: {p.strategy} on {per_node * nnodes} {'GPU' if found.gpus else 'CPU'} ranks; plan {plan_path}",
          file=sys.stderr)
    from ..launch.runner import run as run_process

    rc = run_process(argv, env)
    if rc:
        raise typer.Exit(rc)


@app.command()
def consolidate(
    checkpoint: Annotated[str, typer.Argument(help="A checkpoint folder (step_N) or a run folder (newest)")],
    output: Annotated[str, typer.Argument(help="OUT.safetensors (streamed) or OUT.pt")],
) -> None:
    """One weights file from a sharded checkpoint, without gathering the whole model at once."""
    from ..errors import UsageError as _U

    try:
        from ..trainer.checkpoint import newest
        from ..trainer.consolidate import consolidate as run_consolidate
    except ImportError:
        raise _U("consolidate needs torch: pip install 'zplan[train]'") from None
    src = Path(checkpoint)
    if not (src / ".metadata").is_file():
        found = newest(src)
        if found is None:
            raise _U(f"no complete checkpoint in {checkpoint}; pass a step_N folder or a run folder")
        src = found
    if not output.endswith((".safetensors", ".pt")):
        raise _U(f"output {output!r} must end in .safetensors or .pt")
    n = run_consolidate(src, output)
    print(f"zplan: wrote {output} ({n / 2**20:.1f} MiB) from {src}", file=sys.stderr)
