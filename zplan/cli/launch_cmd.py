"""zplan detect and zplan launch."""

from __future__ import annotations

import json
import os
import shlex
import signal
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Annotated, Optional

import typer

from ..errors import UsageError
from .app import app
from .json_out import emit_json
from ..parse import check_range

CPU_RANKS = 2
CPU_MODEL = "tiny"


@app.command()
def detect(as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object")] = False) -> None:
    """What this machine has: GPUs (NVML), host RAM (cgroup-clamped), usable CPUs, bf16 instructions."""
    from ..hardware import detect as run_detect

    d = run_detect()
    if as_json:
        emit_json({"gpus": [g.__dict__ for g in d.gpus], "gpu_reason": d.gpu_reason,
                   "gpu_preset": d.gpu_preset, "host_ram_bytes": d.host_ram_bytes,
                   "host_ram_source": d.host_ram_source, "cpus": d.cpus, "cpu_bf16": d.cpu_bf16})
        return
    if d.gpus:
        for g in d.gpus:
            print(f"GPU {g.index}: {g.name}, {g.memory_bytes / 2**30:.1f} GiB (preset: {g.preset or 'none'})")
    else:
        print(f"No GPU: {d.gpu_reason}. zplan launch will run {CPU_RANKS} CPU ranks over gloo"
              f"{'' if d.cpu_bf16 is not False else ', in fp32: ' + NO_BF16}.")
    bf16 = {True: "yes", False: "no (bf16 matmuls emulated, some 40-50x slower than fp32)",
            None: "unknown (no /proc/cpuinfo flags read)"}[d.cpu_bf16]
    print(f"Host RAM: {d.host_ram_bytes / 2**30:.1f} GiB ({d.host_ram_source}); usable CPUs: {d.cpus}; "
          f"CPU bf16 matrix instructions: {bf16}")


NO_BF16 = ("this CPU has no bf16 matrix instructions (avx512_bf16 or amx_bf16 on x86, bf16 on Arm, "
           "in /proc/cpuinfo), where a bf16 matmul runs some 40-50x slower than fp32")


def _fresh_plan(model: str, nproc: int | None, nnodes: int, found, global_batch: int | None,
                strategy: list[str] | None, seq_len: int | None, here: bool = True):
    """A recommendation for this machine (or CPU ranks), as the plan to run: in bf16 on GPUs
    and on CPUs with bf16 instructions, in fp32 on CPUs without (hardware.cpu_has_bf16) where
    the ranks run `here` (not under --slurm, whose nodes are not this one)."""
    gpus_found, gpu_preset = len(found.gpus), found.gpu_preset
    from ..plan import make_plan
    from ..recommend import search
    from ..scenario_options import ScenarioOptions, build, cpu_ranks

    if gpus_found:
        per_node = nproc or gpus_found
        opts = ScenarioOptions(model=model, gpu=gpu_preset, gpus=str(per_node * nnodes),
                               gpus_per_node=per_node, layout="torch", seq_len=seq_len)
    else:
        per_node = nproc or CPU_RANKS
        dtype = "fp32" if here and found.cpu_bf16 is False else "bf16"
        if dtype == "fp32":
            print(f"zplan: CPU ranks train in fp32: {NO_BF16}", file=sys.stderr)
        opts = cpu_ranks(model=model, gpus=str(per_node * nnodes), gpus_per_node=per_node,
                         seq_len=seq_len, param_dtype=dtype)
    sc = build(opts)
    batch = global_batch or 4 * sc.n
    rec = search(sc, batch, families=strategy or None, alternatives=False)  # its flags go unshown
    return make_plan(rec.winner.sc, rec.winner.family, batch, rec.winner.result), per_node


FRESH_PLAN_FLAGS = ("model", "strategy", "global_batch", "seq_len")
TRAINER_FLAGS = ("steps", "save_every", "checkpoints", "keep", "resume", "data", "log_every")
FLAG_NAMES = {"checkpoints": "--save/--no-save"}  # where a parameter's flag is not its name


def _check_syntax(script: str) -> None:
    """A Python script that does not parse fails in every rank, one traceback each, after torchrun
    and the rendezvous start (a QA pass): compiled here (compile() runs nothing) and said in one
    line. A script that is not Python (torchrun --no-python) or cannot be read is left to torchrun."""
    if not script.endswith(".py"):
        return
    try:
        source = Path(script).read_bytes()
    except OSError:
        return
    try:
        compile(source, script, "exec", dont_inherit=True)
    except SyntaxError as e:  # IndentationError, TabError too
        where = f"{script}, line {e.lineno}" if e.lineno else script
        raise UsageError(f"{where}: {type(e).__name__}: {e.msg}; fix the script (no rank was started)") from None
    except ValueError as e:  # null bytes in the source
        raise UsageError(f"{script} is not Python source ({e}); pass your training script") from None


RUN_SETTINGS = "launch.json"  # in the run folder: the built-in trainer's length and checkpoint cadence


def _run_settings(run: Path, ctx: typer.Context, steps: int, save_every: int, keep: int) -> tuple[int, int, int]:
    """--resume keeps the run's --steps, --save-every and --keep (RUN_SETTINGS, written by its
    launch) where they are not given again: a run saving every step, killed and resumed with
    --steps alone, saved only at its end; a run of 300 steps stopped by a signal and resumed as
    its hint says trained to the default 20 (QA passes). The file is data: a value not an
    integer in range is ignored."""
    try:
        stored = json.loads((run / RUN_SETTINGS).read_text())
    except (OSError, ValueError):
        return steps, save_every, keep
    out, said = {"steps": steps, "save_every": save_every, "keep": keep}, []
    for name, low, top in (("steps", 1, 10**9), ("save_every", 0, 10**9), ("keep", 0, 10**6)):
        v = stored.get(name) if isinstance(stored, dict) else None
        if not _given(ctx, name) and type(v) is int and low <= v <= top and v != out[name]:
            out[name] = v
            said.append(f"--{name.replace('_', '-')} {v}")
    if said:
        print(f"zplan: --resume keeps the run's {' '.join(said)} (pass them to change)", file=sys.stderr)
    return out["steps"], out["save_every"], out["keep"]


def _given(ctx: typer.Context, name: str) -> bool:
    source = ctx.get_parameter_source(name)  # click's ParameterSource (typer vendors click)
    return source is not None and source.name != "DEFAULT"


def _split_args(ctx: typer.Context, script: str | None) -> tuple[str | None, list[str]]:
    """zplan's options come before the script; everything after the script is the script's.
    Options for the built-in trainer follow `--`."""
    extra = list(ctx.args)
    if script is not None and script.startswith("-"):
        return None, [script] + extra  # `zplan launch [options] -- --trainer-option ...`
    return script, extra


def _check_ranges(strategy, global_batch, seq_len, nproc, nnodes, node_rank,
                  max_restarts, data) -> None:
    """Nonsense refused in one line before anything runs (issue 10)."""
    from ..parse import check_choice
    from ..strategies import STRATEGIES

    check_range(nproc, "--nproc", 1, 1024)
    check_range(global_batch, "--global-batch", 1, 10**9)
    check_range(seq_len, "--seq-len", 1, 10**7)
    check_range(node_rank, "--node-rank", 0, nnodes - 1)
    check_range(max_restarts, "--max-restarts", 0, 1000)
    for s in strategy or ():
        check_choice(s, "--strategy", tuple(STRATEGIES))
    if data is not None and not Path(data).is_file():
        raise UsageError(f"--data {data!r} is not a file; pass a local text file, or drop --data for synthetic data")


@app.command(context_settings={"allow_extra_args": True, "allow_interspersed_args": False})
def launch(
    ctx: typer.Context,
    script: Annotated[Optional[str], typer.Argument(help="Your training script (default: zplan's trainer); "
                                                   "everything after it is passed to it")] = None,
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
    max_restarts: Annotated[int, typer.Option(help="Restart a failed run this many times; each restart "
                                                   "resumes from the newest complete checkpoint")] = 0,
    run_dir: Annotated[Optional[str], typer.Option(help="Where the plan, checkpoints and report go (with "
                                                        "several nodes: required, on a shared filesystem)")] = None,
    steps: Annotated[int, typer.Option(help="Built-in trainer: optimizer steps")] = 20,
    save_every: Annotated[int, typer.Option(help="Built-in trainer: checkpoint every N steps (0: only at the end)")] = 0,
    keep: Annotated[int, typer.Option(help="Built-in trainer: keep the newest K checkpoints (0: all)")] = 0,
    checkpoints: Annotated[bool, typer.Option("--save/--no-save", help="Built-in trainer: write checkpoints "
                                              "(--no-save: none, not even at the end; a benchmark run)")] = True,
    resume: Annotated[bool, typer.Option(help="Built-in trainer: resume from the newest checkpoint in --run-dir")] = False,
    data: Annotated[Optional[str], typer.Option(help="Built-in trainer: a local text file (default synthetic)")] = None,
    log_every: Annotated[Optional[int], typer.Option(help="Built-in trainer: a step line every N steps (default: 10 without a terminal; 0: none)")] = None,
    log_dir: Annotated[Optional[str], typer.Option(help="torchrun --log-dir")] = None,
    redirects: Annotated[Optional[str], typer.Option(help="torchrun --redirects")] = None,
    local_ranks_filter: Annotated[Optional[str], typer.Option(help="torchrun --local-ranks-filter")] = None,
    dry_run: Annotated[bool, typer.Option(help="Write the plan, print exactly what would run, and stop")] = False,
    slurm: Annotated[Optional[str], typer.Option(help="Write an sbatch script here (the plan beside it) instead of running")] = None,
    cpus_per_task: Annotated[Optional[int], typer.Option(help="--slurm: CPUs per task (default 4 per rank)")] = None,
) -> None:
    """Run a plan with torchrun on this machine's GPUs (or CPU ranks over gloo).

    zplan's options come before SCRIPT; everything after SCRIPT is the script's. Options for the
    built-in trainer that zplan does not know follow `--`: zplan launch --strategy zero3 --steps 5 -- --deterministic
    """
    from ..hardware import detect as run_detect
    from ..launch.command import (LaunchSpec, check_torchrun_options, rank_env, shell_line, slurm_script,
                                  torchrun_argv)
    from ..launch.run_dir import check_run_dir
    from ..plan import load, save, write_atomic

    check_range(nnodes, "--nnodes", 1, 100000)
    check_range(steps, "--steps", 1, 10**9)
    check_range(save_every, "--save-every", 0, 10**9)
    _check_ranges(strategy, global_batch, seq_len, nproc, nnodes, node_rank, max_restarts, data)
    check_range(keep, "--keep", 0, 10**6)
    check_torchrun_options(rdzv_endpoint, rdzv_id, log_dir, redirects, local_ranks_filter)
    if not dry_run and not slurm:  # torchrun and the ranks run here: before anything is written
        from .verify_cmd import _need_torch

        _need_torch("zplan launch", load=False)
    if log_every is not None:
        check_range(log_every, "--log-every", 0, 10**9)
    script, extra = _split_args(ctx, script)
    # zplan launch's own options put after the script by mistake (they reach the script), read
    # from the command's declared options; the built-in trainer's (--steps, --data, ...) left out,
    # which a script's own options often share
    own = {o for param in ctx.command.params if param.name not in TRAINER_FLAGS
           for o in getattr(param, "opts", ()) if o.startswith("--")}
    mine = [a.split("=")[0] for a in extra if a.split("=")[0] in own] if script is not None else []
    if mine:  # everything after the script is the script's: a launch option there is not zplan's
        print(f"zplan: note: {', '.join(dict.fromkeys(mine))} after {script} go{'es' if len(set(mine)) == 1 else ''} "
              f"to your script, not to zplan launch; zplan's options come before the script", file=sys.stderr)
    if script is not None:
        if not Path(script).is_file():
            what = "is a folder, not a script" if Path(script).is_dir() else "does not exist"
            raise UsageError(f"{script} {what}; pass a path to your train.py, or none for zplan's trainer")
        _check_syntax(script)
        for name in TRAINER_FLAGS:
            if _given(ctx, name):
                shown = FLAG_NAMES.get(name, f"--{name.replace('_', '-')}")
                raise UsageError(f"{shown} is an option of zplan's trainer; pass your "
                                 f"script's own options after {script}")
    if plan is not None:
        for name in FRESH_PLAN_FLAGS:
            if _given(ctx, name):
                raise UsageError(f"--{name.replace('_', '-')} applies to a fresh plan, and --plan {plan} fixes it; "
                                 f"drop one of them")
    if resume and plan is None and run_dir is not None and Path(run_dir).is_dir():
        # a resume continues the run's own plan: a fresh one (another strategy, sequence, batch)
        # would change the run under its checkpoints, and replace the plan its report was made for
        own = Path(run_dir) / "plan.json"
        if not own.is_file():
            raise UsageError(f"--resume: {own} is not there (a --slurm run's plan sits beside its script); pass "
                             f"the run's plan with --plan")
        try:
            kept = load(str(own))
        except UsageError as e:
            raise UsageError(f"--resume: the run's plan cannot be read ({e}); pass it with --plan, or move "
                             f"{own} away") from None
        planned = {"model": kept.model.name, "strategy": kept.strategy, "global_batch": kept.global_batch,
                   "seq_len": kept.train.seq_len}
        given = {"model": model, "strategy": strategy, "global_batch": global_batch, "seq_len": seq_len}
        for name in FRESH_PLAN_FLAGS:
            value = given[name]
            if name == "model" and _given(ctx, name):  # a preset name in any case, or its file
                from ..presets import model as model_preset

                value = model_preset(value).name
            same = value == [planned[name]] if name == "strategy" else value == planned[name]
            if _given(ctx, name) and not same:
                raise UsageError(f"--resume continues the run's plan, {own} ({name.replace('_', ' ')} "
                                 f"{planned[name]}); --{name.replace('_', '-')} {value} would change it: drop it, "
                                 f"or pass a new plan with --plan (the run's shards reload at another world size)")
        plan = str(own)
    if script is None and "--no-save" in extra:  # the trainer's flag after `--`: the same run
        checkpoints = False
    if resume and script is None and checkpoints and run_dir is not None:
        steps, save_every, keep = _run_settings(Path(run_dir), ctx, steps, save_every, keep)
    if not checkpoints and (save_every or keep):
        what = f"--save-every {save_every}" if save_every else f"--keep {keep}"
        raise UsageError(f"{what} with --no-save: drop one of them")
    if not checkpoints and max_restarts:
        raise UsageError(f"--max-restarts {max_restarts} resumes from checkpoints, which --no-save "
                         f"does not write: drop one of them")
    if run_dir == "":
        raise UsageError("--run-dir '' is empty; name a folder (or drop it for runs/<time>)")
    if resume and run_dir is None:
        raise UsageError("--resume needs --run-dir: the folder of the run to resume")
    if slurm is not None:
        from ..files import check_user_output

        check_user_output(slurm, "--slurm", "sbatch script", reads=(plan,) if plan else (), replaces="not-plan")
    if (nnodes > 1 or slurm) and run_dir is None:
        what = "a --slurm job" if slurm and nnodes == 1 else "several nodes"
        raise UsageError(f"{what} need{'s' if what.startswith('a ') else ''} --run-dir, a folder on a filesystem "
                         f"every node shares (each node writes its shards there)")
    found = run_detect()
    run = Path(run_dir or f"runs/{time.strftime('%Y%m%d-%H%M%S')}")
    if plan is not None:
        p = load(plan)
        if slurm:
            per_node = nproc or min(p.cluster.gpus_per_node, p.num_gpus)
            nnodes = -(-p.num_gpus // per_node)
        else:
            per_node = nproc or (p.num_gpus // nnodes)
        if per_node * nnodes != p.num_gpus:
            raise UsageError(f"the plan is for {p.num_gpus} ranks; --nproc {per_node} x --nnodes {nnodes} "
                             f"gives {per_node * nnodes}: drop --nproc, or pass a plan for {per_node * nnodes} "
                             f"(zplan recommend --gpus {per_node * nnodes} --write P, then --plan P)")
    else:
        p, per_node = _fresh_plan(model, nproc, nnodes, found, global_batch, strategy, seq_len,
                                  here=not slurm)
    from ..plan import trainer_refusal

    if data and script is None:  # what the trainer's TokenSource would refuse inside the ranks, said here
        size = os.path.getsize(data)
        if size <= p.train.seq_len + 1:
            shorter = ", or a shorter --seq-len" if plan is None else ""  # a plan fixes the sequence
            raise UsageError(f"--data {data} has {size} bytes; the trainer needs more than seq_len + 1 = "
                             f"{p.train.seq_len + 1} (a longer text file{shorter})")
    # a script's api.init refuses what the trainer cannot apply to any model (its own): said here,
    # once, before a rank starts, not by every rank after the rendezvous
    why = trainer_refusal(p, builtin_model=script is None)
    if why:
        from ..errors import PlanError

        raise PlanError(f"zplan's trainer cannot run {plan or 'this plan'}: {why}")
    if plan is not None:
        from ..plan import fit_note, fresh_prediction

        p, stale = fresh_prediction(p, plan)  # the run's copy of the plan carries the fresh figures
        for note in (stale, fit_note(p, plan)):
            if note:
                print(f"zplan: note: {note}", file=sys.stderr)
    planned = min(p.cluster.gpus_per_node, p.num_gpus)
    if plan is not None and per_node != planned:
        nodes, last = -(-p.num_gpus // planned), p.num_gpus % planned
        shape = f"{nodes} node(s) of {planned}" + (f", the last with {last}" if last else "")
        how = (f"--nnodes {nodes} --nproc {planned} on each node" if not last else
               f"zplan launch runs equal nodes: plan again with a multiple of {planned} GPUs")
        print(f"zplan: note: {plan} was priced for {shape} ({p.cluster.name}'s links); this launch runs "
              f"{nnodes} node(s) of {per_node} ranks, so its communication is not the plan's ({how}, "
              f"or zplan export --plan {plan} --to torchrun)", file=sys.stderr)
    if found.gpus and not slurm and per_node > len(found.gpus):
        raise UsageError(f"{per_node} ranks per node but this node has {len(found.gpus)} GPUs: run on "
                         f"{-(-per_node * nnodes // len(found.gpus))} nodes (--nnodes), or pass a plan for "
                         f"{len(found.gpus) * nnodes} (zplan recommend --gpus {len(found.gpus) * nnodes} --write P, "
                         f"then --plan P)")
    if not slurm and not dry_run:  # a GPU plan where there is none, a CPU plan on a GPU node: before
        # any rank starts (a dry run starts none: it prints the command for the node it is meant for)
        from ..plan import node_problem

        problem = node_problem(p, per_node, len(found.gpus))
        if problem and not (p.gpu.device == "cpu" and os.environ.get("ZPLAN_ALLOW_GPU_MISMATCH")):
            raise UsageError(problem)
    if not found.gpus and not slurm and found.cpus and per_node > found.cpus and p.gpu.device == "cpu":
        print(f"zplan: note: {per_node} CPU ranks on {found.cpus} usable CPUs share them: each rank gets "
              f"under one core, so steps run slower than the plan's CPU preset assumes", file=sys.stderr)
    from .. import arch
    from ..launch.run_dir import checkpoint_bytes

    fresh = script is None and not resume  # a new run of zplan's trainer: never in a run's folder
    if slurm:  # the run directory lives on the cluster: refuse only what is wrong from here
        check_run_dir(run, resume=False, create=False, fresh=fresh)
    else:
        from ..errors import PlanError

        try:
            check_run_dir(run, resume=resume, need_bytes=checkpoint_bytes(arch.param_count(p.model)) if checkpoints else 0,
                          fresh=fresh)
        except PlanError as e:  # disk space: the real launch refuses it; a dry run prints the command
            if not dry_run:
                raise
            print(f"zplan: note: {e} (the launch itself would stop here)", file=sys.stderr)
            check_run_dir(run, resume=resume, fresh=fresh)
        if resume and script is None:
            from ..launch.run_dir import resumed_data_note

            note = resumed_data_note(run, data)
            if note:
                print(f"zplan: note: {note}", file=sys.stderr)
    if plan is not None and not found.gpus and not slurm and found.cpu_bf16 is False \
            and p.train.precision.param == "bf16":
        print(f"zplan: note: {plan} computes in bf16 on CPU ranks, but {NO_BF16}; a plan with "
              f"--param-dtype fp32 runs faster here", file=sys.stderr)
    plan_path = str((run / "plan.json").resolve())
    if script is None:
        extra = ["--ckpt-dir", str(run.resolve()), "--steps", str(steps), "--save-every", str(save_every),
                 "--keep", str(keep)] + (["--resume"] if resume else []) + (["--data", data] if data else []) + \
                (["--no-save"] if not checkpoints and "--no-save" not in extra else []) + \
                (["--log-every", str(log_every)] if log_every is not None else []) + extra
    opts = tuple(f"--{k}={v}" for k, v in (("log-dir", log_dir), ("redirects", redirects),
                                            ("local-ranks-filter", local_ranks_filter)) if v is not None)
    # the allocator the plan's reserved memory assumes (Assumptions.expandable_segments)
    env_for_plan = rank_env(p.assumptions.expandable_segments, dict(os.environ))
    if slurm:
        plan_path = str(Path(slurm).resolve().with_suffix(".plan.json"))
        if len(os.fsencode(Path(plan_path).name)) > 255:
            raise UsageError(f"--slurm {slurm}: the plan written beside it, {Path(plan_path).name}, "
                             f"would be a file name over 255 bytes; choose a shorter name")
        from ..files import check_user_output

        check_user_output(plan_path, "--slurm", "plan beside the script", reads=(plan,) if plan else (),
                          replaces="plan")
        spec = LaunchSpec(plan_path, per_node, nnodes, None, rdzv_endpoint, rdzv_id, max_restarts, script,
                          tuple(extra), torchrun_opts=opts, env=env_for_plan)
        save(p, plan_path)
        gpus = per_node if (found.gpus or p.gpu.device != "cpu") else 0
        write_atomic(slurm, slurm_script(spec, gpus, cpus_per_task or 4 * per_node))
        print(f"zplan: wrote {slurm} (sbatch {slurm}); plan {plan_path}", file=sys.stderr)
        return
    spec = LaunchSpec(plan_path, per_node, nnodes, node_rank, rdzv_endpoint, rdzv_id, 0, script,
                      tuple(extra), torchrun_opts=opts, env=env_for_plan)
    if dry_run and resume and plan is not None and (run / "plan.json").is_file() \
            and Path(plan).resolve() != (run / "plan.json").resolve():
        # a dry run leaves the run's own plan alone: the command it prints reads the plan given
        spec = replace(spec, plan_path=str(Path(plan).resolve()))
    argv, env = torchrun_argv(spec)
    from ..launch.run_dir import hold_run_dir, step_folders

    # the launch on the first node holds the run folder until it ends: a one-node launch, or node 0
    # of several (the others share the folder, each running zplan launch; a rendezvous that ranks
    # the nodes itself names none of them first); a dry run starts nothing
    lock = hold_run_dir(run) if (nnodes == 1 or node_rank == 0) and not dry_run else None  # noqa: F841
    kept = None
    # a dry run writes the plan its command reads, but never rewrites a run's own plan on
    # --resume (the real launch does, with the fresh figures)
    if not dry_run or (spec.plan_path == plan_path and not (resume and Path(plan_path).is_file())):
        if resume or script is not None:  # a script resumes by itself in its folder (api.init)
            kept = _keep_replaced_plan(Path(plan_path), p)
        save(p, plan_path)
    if lock is not None and script is None and checkpoints:  # what a --resume keeps (_run_settings)
        write_atomic(str(run / RUN_SETTINGS), json.dumps({"steps": steps, "save_every": save_every, "keep": keep}) + "\n")
    steps_before = step_folders(run)
    if dry_run:
        print(shell_line(argv, env))
        if max_restarts:
            print(f"zplan: on failure zplan runs it again, up to {max_restarts} times", file=sys.stderr)
        return
    print(f"zplan: {p.strategy} on {per_node * nnodes} {'GPU' if found.gpus else 'CPU'} ranks; plan {plan_path}",
          file=sys.stderr)
    from ..launch.runner import run_with_restarts

    # zplan's trainer ends at a step boundary with a checkpoint when signalled (trainer/stop.py)
    report_before = _report_stamp(run)
    rc = run_with_restarts(argv, env, max_restarts, (lock.fileno(),) if lock is not None else (),
                           stops_at_step=script is None)
    if rc and kept is not None and nnodes == 1 and step_folders(run) <= steps_before:
        # the ranks refused the new plan (or failed) before a checkpoint under it: the run's
        # folder names the plan its checkpoints were made under again, so a plain --resume works
        save(load(str(kept)), plan_path)
        kept.unlink()
        print(f"zplan: note: no checkpoint was written under the new plan; {plan_path} is the run's "
              f"plan again", file=sys.stderr)
    if script is None:
        rc = _outcome(rc, _fresh_report(run, report_before), steps)
    if rc in INTERRUPTED:  # a signal the launcher forwarded (runner.FORWARDED), or the ranks got
        if not step_folders(run):
            how = "no checkpoint was written in its run folder"
        elif script is None:
            how = f"`zplan launch --resume --run-dir {shlex.quote(str(run))}` continues from its newest checkpoint"
        else:  # --resume is the built-in trainer's; a script resumes by itself (ctx.resume)
            how = (f"the same launch with `--run-dir {shlex.quote(str(run))} --plan "
                   f"{shlex.quote(str(run / 'plan.json'))}` continues from its newest checkpoint where your "
                   f"script calls ctx.resume")
        print(f"zplan: interrupted ({signal.Signals(rc - 128).name}); {how}", file=sys.stderr)
    if rc:
        raise typer.Exit(rc)


INTERRUPTED = {128 + s for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1)}


def _report_stamp(run: Path) -> tuple | None:
    """What tells one run_report.json from another (written atomically: a new inode each time)."""
    try:
        st = (run / "run_report.json").stat()
    except OSError:
        return None
    return st.st_ino, st.st_mtime_ns, st.st_size


def _fresh_report(run: Path, before: tuple | None) -> dict | None:
    """The run report this launch's ranks wrote (its stamp changed), else None: no clock is
    compared, so a shared folder's skew between nodes cannot make an old report look new."""
    stamp = _report_stamp(run)
    if stamp is None or stamp == before:
        return None
    try:
        report = json.loads((run / "run_report.json").read_text())
    except (OSError, ValueError):
        return None
    return report if isinstance(report, dict) else None


def _outcome(rc: int, report: dict | None, steps: int) -> int:
    """The launch's exit code from torchrun's and this launch's run report: 128 + the signal
    that stopped the run at a step boundary where the ranks got it from outside the launcher
    (Slurm signals every task; torchrun exits 0), and 0 where the launcher was signalled but the
    run had finished its last step already (it is not interrupted)."""
    if report is None:
        return rc
    name = report.get("stopped_by")
    if rc == 0 and name in signal.Signals.__members__:
        return 128 + signal.Signals[name]
    if rc in INTERRUPTED and name is None and report.get("end_step") == steps:
        print(f"zplan: the run had finished step {steps}, its last, when {signal.Signals(rc - 128).name} "
              f"came; nothing was cut short", file=sys.stderr)
        return 0
    return rc


def _keep_replaced_plan(path: Path, new) -> Path | None:
    """A resume under another plan than the run's (--plan): the run's own is kept beside it as
    plan.prev.json and what changes is said (the run's shards reload at another world size; a
    new sequence length or batch changes the data from here on)."""
    from ..plan import load, save

    if not path.is_file():
        return None
    try:
        old = load(str(path))
    except UsageError:
        return None
    if old.model_copy(update={"predicted": None}) == new.model_copy(update={"predicted": None}):
        return None  # the same settings (a fresh estimate may have replaced the figures)
    pairs = (("strategy", old.strategy, new.strategy), ("ranks", old.num_gpus, new.num_gpus),
             ("seq_len", old.train.seq_len, new.train.seq_len), ("global batch", old.global_batch, new.global_batch),
             ("model", old.model.name, new.model.name))
    changed = ", ".join(f"{k} {a} -> {b}" for k, a, b in pairs if a != b) or "other fields"
    kept = path.with_name("plan.prev.json")
    n = 2
    while kept.exists():  # each replaced plan kept: plan.prev.json, plan.prev2.json, ...
        kept, n = path.with_name(f"plan.prev{n}.json"), n + 1
    save(old, kept)
    print(f"zplan: note: resuming {path.parent} under another plan ({changed}); the run's plan so far is "
          f"kept as {kept}", file=sys.stderr)
    return kept


@app.command()
def consolidate(
    checkpoint: Annotated[str, typer.Argument(help="A checkpoint folder (step_N) or a run folder (newest)")],
    output: Annotated[str, typer.Argument(help="OUT.safetensors (streamed) or OUT.pt")],
) -> None:
    """One weights file from a sharded checkpoint, without gathering the whole model at once.
    The checkpoint is read as data: its metadata goes through an unpickler that admits only
    DCP's own metadata types, so a crafted folder cannot run code."""
    try:
        from ..trainer.checkpoint import MANIFEST, is_checkpoint_folder, newest
        from ..trainer.consolidate import consolidate as run_consolidate
        from torch.distributed.checkpoint.api import CheckpointException
    except ImportError:
        raise UsageError("consolidate needs torch: pip install 'zplan[train]'") from None
    from ..launch.run_dir import writable_report

    if not output.endswith((".safetensors", ".pt")):
        raise UsageError(f"output {output!r} must end in .safetensors or .pt")
    writable_report(output, "name another output file")
    for folder in Path(output).resolve().parents:  # a checkpoint's own files (zero1_optim_rankR.pt)
        if is_checkpoint_folder(folder):
            raise UsageError(f"output {output!r} is inside checkpoint {folder}: writing there would replace or "
                             f"add to the checkpoint's files; name a file outside it")
    src = Path(checkpoint)
    if not src.is_dir():
        what = "is not a folder" if src.exists() else "does not exist"
        raise UsageError(f"checkpoint {checkpoint} {what}; pass a step_N folder or a run folder")
    if not (src / ".metadata").exists():
        found = newest(src, lambda line: print(f"zplan: warning: {line}", file=sys.stderr))
        if found is None:
            if (src / MANIFEST).exists() or src.name.startswith(("step_", ".tmp-step_")):
                raise UsageError(f"checkpoint {checkpoint} has no .metadata file (an interrupted save, or not a "
                                 f"DCP checkpoint); pass an earlier step_N folder or the run folder")
            raise UsageError(f"no complete checkpoint in {checkpoint}; pass a step_N folder or a run folder")
        src = found
    try:
        n = run_consolidate(src, output)
    except CheckpointException as e:  # a BaseException: the boundary would not catch it
        from ..trainer.rank_errors import dcp_failures

        first = next(iter(dcp_failures(e)), e)
        from ..trainer.checkpoint import first_sentence

        raise UsageError(f"checkpoint {src} cannot be read ({type(first).__name__}: "
                         f"{first_sentence(str(first))}); pass another step_N folder") from None
    except OSError as e:
        raise UsageError(f"{e.filename or output}: {e.strerror}; check the checkpoint and the output path") from None
    print(f"zplan: wrote {output} ({n / 2**20:.1f} MiB) from {src}", file=sys.stderr)
