"""zplan estimate."""

from __future__ import annotations

from dataclasses import fields
from typing import Annotated, Optional

import typer

from ..errors import PlanError, UsageError
from .app import app, emit_json
from ..scenario_options import ScenarioOptions, build
from .options import scenario_options


@app.command()
@scenario_options
def estimate(
    opts: ScenarioOptions,
    strategy: Annotated[Optional[list[str]], typer.Option(help="Strategy to show (repeatable; default all)")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object")] = False,
    unit: Annotated[str, typer.Option(help="GB (10^9 bytes) or GiB (2^30)")] = "GB",
    plan: Annotated[Optional[str], typer.Option(help="Re-read a plan file written by recommend --write (its scenario; no other scenario flags)")] = None,
    wide: Annotated[bool, typer.Option(help="Every column (default: the ones that fit 100 columns)")] = False,
) -> None:
    """Per-GPU memory, traffic, overlap and step time of every strategy."""
    from ..estimate import estimate as run_estimate, fit_hints, to_json
    from ..strategies import STRATEGIES
    from ..parse import check_choice

    check_choice(unit, "--unit", ("GB", "GiB"))
    for s in strategy or ():
        check_choice(s, "--strategy", tuple(STRATEGIES))
    if plan is not None:
        from ..plan import load

        given = _given_flags(opts)
        if given:
            raise UsageError(f"--plan {plan} carries its own scenario; {', '.join(given)} would be "
                             "ignored: drop them, or estimate without --plan")
        p = load(plan)
        sc, names = p.scenario(), strategy or [p.strategy]
    else:
        sc, names = build(opts), strategy or list(STRATEGIES)
    results = run_estimate(sc, names)
    if as_json:
        emit_json(to_json(sc, results))
    else:
        from ..estimate import assumptions
        from .render import print_estimate

        print_estimate(sc, results, assumptions(sc), unit, wide)
    if not any(r.fits for r in results):
        raise PlanError(f"no strategy fits {sc.hw.gpu.name} with {sc.n} GPUs: {fit_hints(sc, results)}")


def _given_flags(opts: ScenarioOptions) -> list[str]:
    """The scenario flags set to something other than their default, as typed."""
    default = ScenarioOptions()
    out = []
    for f in fields(ScenarioOptions):
        v = getattr(opts, f.name)
        if v == getattr(default, f.name):
            continue
        flag = "presets" if f.name == "presets_dir" else f.name.replace("_", "-")
        out.append(f"--{'no-' if v is False else ''}{flag}")
    return out
