"""zplan recommend, export and explain: the Typer commands (recommend's and explain's bodies,
with a plain path that skips Typer, are in recommend_body.py and explain_body.py)."""

from __future__ import annotations

import sys
from typing import Annotated, Optional

import typer

from ..errors import PlanError, UsageError
from ..parse import check_choice
from ..recommend import PINNABLE
from ..scenario_options import ScenarioOptions
from . import explain_body, recommend_body
from .app import app
from .options import scenario_options


@app.command()
@scenario_options(searched=PINNABLE | {"shard_size"})  # HSDP's shard size: every one is searched too
def recommend(
    opts: ScenarioOptions,
    global_batch: Annotated[Optional[str], typer.Option(help="Sequences per optimizer step, all GPUs (default 8 per GPU)")] = None,
    global_batch_tokens: Annotated[Optional[str], typer.Option(help="Tokens per optimizer step, all GPUs")] = None,
    objective: Annotated[str, typer.Option(help="throughput (fastest step) or memory (least per GPU)")] = "throughput",
    headroom: Annotated[float, typer.Option(help="Fraction of GPU memory kept free")] = 0.1,
    write: Annotated[Optional[str], typer.Option(help="Write the winning plan to this file (JSON)")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object")] = False,
    plot: Annotated[Optional[str], typer.Option(help="Draw memory and step time against N to this PNG")] = None,
    top: Annotated[int, typer.Option(help="Runners-up to list")] = 8,
    strategy: Annotated[Optional[list[str]], typer.Option(help="Search only these strategies (repeatable)")] = None,
    wide: Annotated[bool, typer.Option(help="Every column of the runners-up (default: the ones that fit 100 columns)")] = False,
    runner: Annotated[Optional[str], typer.Option("--for", help="What will run the plan: zplan (launch, FSDP2; torch layout, the default) or deepspeed (export; zero layout)")] = None,
) -> None:
    """The fastest configuration that fits, and why every other one lost."""
    # the defaults above are recommend_body.run's (the plain path reads them there);
    # tests/test_plain_line.py holds the two readings of a bare `zplan recommend` equal
    recommend_body.run(opts, global_batch=global_batch, global_batch_tokens=global_batch_tokens,
                       objective=objective, headroom=headroom, write=write, as_json=as_json,
                       plot=plot, top=top, strategy=strategy, wide=wide, runner=runner)


@app.command()
def export(
    plan: Annotated[str, typer.Option(help="Plan file written by recommend --write")],
    to: Annotated[str, typer.Option(help="deepspeed | accelerate | torchrun")],
    output: Annotated[Optional[str], typer.Option("--output", "-o", help="Write here instead of stdout")] = None,
    zeropp: Annotated[bool, typer.Option(help="DeepSpeed: add ZeRO++ (hpZ, int8 weights, int4 grads)")] = False,
) -> None:
    """Write a plan as a DeepSpeed config, an accelerate config, or a torchrun command."""
    from ..export import (ZEROPP_NOTE, accelerate_batch_note, accelerate_nodes_note, bucket_view_note,
                          checkpointing_note, code_note, deepspeed_reduce_note, layout_note, optimizer_note)
    from ..export import export as do_export
    from ..plan import load, write_atomic

    check_choice(to, "--to", ("deepspeed", "accelerate", "torchrun"))
    if zeropp and to != "deepspeed":
        raise UsageError(f"--zeropp is DeepSpeed's ZeRO++ and goes with --to deepspeed, not --to {to}: drop it")
    if output is not None:
        from ..files import check_user_output

        check_user_output(output, "--output", "export", reads=(plan,), replaces="not-plan")
    loaded = load(plan)
    if to == "torchrun":  # the command runs zplan's trainer: a plan it refuses is refused here, as launch does
        from ..plan import trainer_refusal

        why = trainer_refusal(loaded)
        if why:
            raise PlanError(f"zplan's trainer cannot run {plan}: {why}")
    text = do_export(loaded, to, plan, zeropp)
    from ..plan import fit_note

    for note in ((fit_note(loaded, plan),) + ((layout_note(loaded), checkpointing_note(loaded), deepspeed_reduce_note(loaded),
                                               optimizer_note(loaded)) if to == "deepspeed" else ())
                 + ((bucket_view_note(loaded), accelerate_nodes_note(loaded), accelerate_batch_note(loaded))
                    if to == "accelerate" else ())
                 + ((ZEROPP_NOTE,) if zeropp else ())
                 + ((code_note(loaded, to),) if to != "torchrun" else ())):
        if note:
            print(f"zplan: note: {note}", file=sys.stderr)
    if output is not None:
        write_atomic(output, text)
    else:
        sys.stdout.write(text)


@app.command()
@scenario_options
def explain(
    opts: ScenarioOptions,
    strategy: Annotated[str, typer.Option(help="The strategy to derive")] = "zero3",
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object: the figures and the derivation's lines")] = False,
) -> None:
    """The derivation of one strategy's figures, with your numbers substituted."""
    explain_body.run(opts, strategy=strategy, as_json=as_json)  # the defaults above are run's
