"""zplan recommend without Typer: the command's body and its own flags.

`run` is the body the Typer command (recommend_cmd.py) calls; plain_line.parse(args, OWN, run)
reads a plain command line into the same call without Typer, or answers None and Typer reads it.
"""

from __future__ import annotations

import os
import sys

from ..errors import PlanError, UsageError
from ..parse import check_choice, check_range, parse_count
from ..scenario_options import (DEFAULT_CLUSTER, ScenarioOptions, apply_project_file, build, check_flag_pairs,
                                project_file_named)
from . import plain_line
from .json_out import emit_json

# recommend's own options as its Typer signature declares them: flag -> (parameter, reader)
# (their defaults: run's signature)
OWN = {"--global-batch": ("global_batch", str), "--global-batch-tokens": ("global_batch_tokens", str),
       "--objective": ("objective", str), "--headroom": ("headroom", float), "--write": ("write", str),
       "--json": ("as_json", True), "--plot": ("plot", str), "--top": ("top", int),
       "--strategy": ("strategy", "many"), "--wide": ("wide", True), "--no-wide": ("wide", False),
       "--for": ("runner", str)}

DEFAULT_MODEL = "llama-3.1-8b"
DEFAULT_PER_GPU = 8  # sequences per GPU per step when no global batch is given


def _defaults(opts: ScenarioOptions, extra: dict) -> list[str]:
    """Bare `zplan recommend`: zplan.toml, then this machine's GPUs, then stated defaults."""
    used = [f"zplan.toml: {', '.join(t)}" for t in [apply_project_file(opts, extra)] if t]
    if opts.model is None and opts.params is None:
        opts.model = DEFAULT_MODEL
        used.append(f"model {DEFAULT_MODEL} (default; --model to change)")
    if opts.gpu is None and opts.gpus is None:
        from ..hardware import detect

        found = detect()
        if found.gpus and found.gpu_preset:
            opts.gpu, opts.gpus = found.gpu_preset, str(len(found.gpus))
            used.append(f"{len(found.gpus)} x {found.gpu_preset} detected on this machine")
        else:
            used.append(f"no usable GPU here ({found.gpu_reason}): planning for one node of "
                        f"{opts.cluster or DEFAULT_CLUSTER} (--gpu, --gpus, --cluster to change)")
    return used


def run(opts: ScenarioOptions, global_batch: str | None = None, global_batch_tokens: str | None = None,
        objective: str = "throughput", headroom: float = 0.1, write: str | None = None,
        as_json: bool = False, plot: str | None = None, top: int = 8,
        strategy: list[str] | None = None, wide: bool = False, runner: str | None = None) -> None:
    """The fastest configuration that fits, and why every other one lost."""
    from ..plan import make_plan, save
    from ..recommend import PINNABLE, default_per_gpu, given_text, plan_for_runner, search

    extra = {"global_batch": global_batch, "global_batch_tokens": global_batch_tokens,
             "objective": None, "headroom": None}
    used = _defaults(opts, extra)
    used += plan_for_runner(opts, runner)
    objective = extra["objective"] or objective
    headroom = extra["headroom"] if extra["headroom"] is not None else headroom
    with project_file_named(used):  # a bad value from zplan.toml names the file, not only the flag
        check_choice(objective, "--objective", ("throughput", "memory"))
        check_range(headroom, "--headroom", 0.0, 0.9)
    check_range(top, "--top", 0, 1000)
    from ..strategies import STRATEGIES

    for name in strategy or ():
        check_choice(name, "--strategy", tuple(STRATEGIES))
    asked = list(strategy or ())  # the user's list, before DeepSpeed's default below
    if opts.layout == "zero" and not strategy:  # a plan for DeepSpeed
        strategy = [s for s in STRATEGIES if s != "hsdp"]
        used.append("no hsdp: DeepSpeed removed MiCS, its HSDP (--strategy hsdp compares it)")
    ds_hsdp = ("--write with --for deepspeed --strategy hsdp: DeepSpeed removed MiCS, its HSDP, so no runner "
               "takes that plan; --for zplan plans FSDP2's HSDP, or drop --write to compare it")
    if opts.layout == "zero" and asked == ["hsdp"] and write is not None:
        raise UsageError(ds_hsdp)
    from ..files import check_user_output

    for path, flag, what, kind in ((write, "--write", "output", "plan"), (plot, "--plot", "plot", "not-plan")):
        if path is not None:
            check_user_output(path, flag, what, replaces=kind)  # before the search, not after it
    if write and plot and os.path.abspath(write) == os.path.abspath(plot):
        raise UsageError(f"--write and --plot name the same file, {write}: the plot would replace the "
                         f"plan; give them two names")
    if plot is not None and not plot.lower().endswith(".png"):  # the plot is written as PNG data
        raise UsageError(f"--plot {plot!r}: the plot is a PNG image; name a file ending in .png")
    with project_file_named(used):
        check_flag_pairs(opts, asked)
        sc = build(opts)
    pinned = opts.given & PINNABLE  # what the user set is kept, not searched
    gb, gbt = extra["global_batch"], extra["global_batch_tokens"]
    if gb is not None and gbt is not None:
        raise UsageError("give --global-batch or --global-batch-tokens, not both")
    if gbt is not None:
        with project_file_named(used):
            tokens = parse_count(str(gbt), "--global-batch-tokens", integer=True,
                                 example=f"{1024 * sc.train.seq_len} (1024 sequences of {sc.train.seq_len})")
            step = sc.n * sc.train.seq_len
            if tokens % sc.train.seq_len:
                raise UsageError(f"--global-batch-tokens {tokens} is not a multiple of --seq-len {sc.train.seq_len}; "
                                 f"use a multiple of {step} ({sc.n} GPUs x {sc.train.seq_len} tokens), e.g. "
                                 f"{max(1, round(tokens / step)) * step}")
            batch = tokens // sc.train.seq_len
            if batch % sc.n:
                raise UsageError(f"--global-batch-tokens {tokens} is {batch} sequences of {sc.train.seq_len} "
                                 f"tokens, not a multiple of {sc.n} GPUs; use a multiple of {step}")
    elif gb is not None:
        with project_file_named(used):
            batch = parse_count(str(gb), "--global-batch", integer=True, example="256")
    else:
        per_gpu = default_per_gpu(sc, pinned, DEFAULT_PER_GPU)
        batch = per_gpu * sc.n
        used.append(f"global batch {batch} sequences ({per_gpu} per GPU; --global-batch to change)")
    kept = ([given_text(sc, pinned)] if pinned else []) + (
        [f"--shard-size {sc.shard_size} (HSDP)"] if sc.shard_size is not None else [])
    if kept:
        used.append("as given, not searched: " + ", ".join(kept))
    for line in used:
        print(f"zplan: using {line}", file=sys.stderr)
    try:
        rec = search(sc, batch, objective, headroom, families=strategy or None, pinned=pinned)
    except PlanError as e:  # nothing fits: a script reading --json still gets one object
        if as_json:
            from ..estimate import SCHEMA_VERSION

            emit_json({"schema_version": SCHEMA_VERSION, "global_batch": batch, "winner": None,
                       "error": str(e)})
        raise
    plan = make_plan(rec.winner.sc, rec.winner.family, batch, rec.winner.result)
    if write and opts.layout == "zero" and rec.winner.family == "hsdp":  # hsdp won among those asked
        raise UsageError(ds_hsdp + f" (hsdp won here; --strategy without hsdp writes the best of the others)")
    if write:
        save(plan, write)
    if plot:
        from ..plot import plot_scaling

        plot_scaling(rec.winner.sc, plot)
    if as_json:
        emit_json(_json(rec, plan, top))
    else:
        from .render_recommend import print_recommendation

        print_recommendation(rec, top, write, plot, wide, _launch_note(plan, write) if write else "")


def _launch_note(plan, written: str) -> str:
    """What runs the written plan: DeepSpeed's export, zplan launch, or (where zplan's trainer
    refuses a field, plan.trainer_refusal) a script of the user's own, or neither."""
    from ..plan import trainer_refusal

    if plan.train.layout == "zero":
        from ..export import deepspeed_config
        from ..strategies import effective

        try:
            deepspeed_config(plan)
        except UsageError as e:  # what export would refuse, said now
            return f"zplan export --to deepspeed cannot write it: {e}"
        note = f"zplan export --plan {written} --to deepspeed turns it into DeepSpeed's config"
        if effective(plan.strategy, "zero").params_sharded and plan.train.zero_init:
            note += ("; it assumes your script builds the model under deepspeed.zero.Init (HF "
                     "Trainer and accelerate's zero3_init_flag do; plan again with --no-zero-init "
                     "if it does not)")
        from ..export import checkpointing_note

        ckpt = checkpointing_note(plan)
        return note + (f"; {ckpt}" if ckpt else "")
    builtin, script = trainer_refusal(plan, builtin_model=True), trainer_refusal(plan, builtin_model=False)
    if builtin is None:
        return f"zplan launch --plan {written} runs it"
    if script is None:
        return (f"zplan launch --plan {written} YOUR_SCRIPT.py runs it with your own script; the "
                f"built-in trainer cannot: {builtin}")
    return f"zplan's trainer cannot run it: {script}"


def _json(rec, plan, top: int) -> dict:
    from ..estimate import SCHEMA_VERSION, measured_error

    from ..plan import planned_train

    def cand(c, rank):
        d = c.result.as_dict()
        train = planned_train(c.sc.train, c.family)  # as the plan file records them
        d.update(rank=rank, family=c.family, label=c.label(),
                 hsdp_shard_size=c.sc.hsdp_shard if c.family == "hsdp" else None,
                 train=train.model_dump(), usable_bytes=c.usable_bytes)
        return d

    return {
        "schema_version": SCHEMA_VERSION,
        "global_batch": rec.global_batch,
        "evaluated": rec.evaluated,
        "winner": cand(rec.winner, 1),
        "candidates": [cand(c, i + 1) for i, c in enumerate(rec.ranked[: max(1, top + 1)])],
        "best_by_family": {f: cand(c, rec.ranked.index(c) + 1) for f, c in rec.best_by_family.items()},
        "lost": rec.lost,
        "rejected": [{"family": f, "reason": r} for f, r in rec.rejected.items()],
        "flags": rec.flags,
        "public_accuracy": measured_error(rec.winner.sc),
        "plan": plan.model_dump(),
    }
