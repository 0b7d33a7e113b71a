"""zplan estimate without Typer: the command's body and its own flags.

`run` is the body the Typer command (estimate_cmd.py) calls; plain_line.parse(args, OWN, run)
reads a plain command line into the same call without Typer, or answers None and Typer reads it.
"""

from __future__ import annotations

from dataclasses import fields

from ..errors import PlanError, UsageError
from ..scenario_options import ScenarioOptions, build, check_flag_pairs
from . import plain_line
from .json_out import emit_json

# estimate's own options as its Typer signature declares them: flag -> (parameter, reader)
# (their defaults: run's signature)
OWN = {"--strategy": ("strategy", "many"), "--json": ("as_json", True), "--unit": ("unit", str),
       "--plan": ("plan", str), "--wide": ("wide", True), "--no-wide": ("wide", False)}


def run(opts: ScenarioOptions, strategy: list[str] | None = None, as_json: bool = False,
        unit: str = "GB", plan: str | None = None, wide: bool = False) -> None:
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
        sc, names = p.scenario(), list(dict.fromkeys(strategy)) if strategy else [p.strategy]
    else:
        check_flag_pairs(opts, strategy)
        sc, names = build(opts), list(dict.fromkeys(strategy)) if strategy else list(STRATEGIES)
    results = run_estimate(sc, names)
    if not any(r.memory for r in results):  # every strategy asked for was refused, not priced
        raise UsageError("; ".join(f"--strategy {r.name}: {r.unavailable}" for r in results))
    if as_json:
        emit_json(to_json(sc, results))
    else:
        from ..estimate import assumptions
        from .render import print_estimate

        print_estimate(sc, results, assumptions(sc, tuple(r.name for r in results)), unit, wide)
    if not any(r.fits for r in results):
        raise PlanError(f"no strategy fits {sc.hw.gpu.name} with {sc.n} GPUs: {fit_hints(sc, results, unit)}")


def _given_flags(opts: ScenarioOptions) -> list[str]:
    """The scenario flags typed (both readers say which: `given`, a flag equal to its default
    included) or set to something other than their default, as typed."""
    default = ScenarioOptions()
    out = []
    for f in fields(ScenarioOptions):
        v = getattr(opts, f.name)
        if v == getattr(default, f.name) and f.name not in opts.given:
            continue
        flag = plain_line.flag_of(f.name)
        out.append(f"--no-{flag[2:]}" if v is False else flag)
    return out
