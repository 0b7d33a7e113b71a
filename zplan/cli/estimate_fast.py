"""zplan estimate without Typer: the command's body, and a parser for plain command lines.

`run` is the body the Typer command (estimate_cmd.py) calls. `parse` reads the command lines
that need nothing of Typer (known long options, each with a plain value) into the same call
Typer would make, or answers None, and Typer reads the line instead: help, unknown flags, odd
values and every error stay Typer's. Importing Typer and building the command costs
~40 ms of estimate's 0.3 s budget (issue 8). tests/test_estimate_fast.py holds the parser
against Typer's own reading of many command lines.
"""

from __future__ import annotations

import inspect
import re
import typing
from dataclasses import fields

from ..errors import PlanError, UsageError
from ..scenario_options import FIELDS, ScenarioOptions, build
from .json_out import emit_json
from .options import OPTION_ARGS

# estimate's own options as its Typer signature declares them: flag -> (parameter, reader)
# (their defaults: run's signature)
OWN = {"--strategy": ("strategy", "many"), "--json": ("as_json", True), "--unit": ("unit", str),
       "--plan": ("plan", str), "--wide": ("wide", True), "--no-wide": ("wide", False)}

# Values read here only where every reader agrees on them (Typer's click types, then the specs'
# lax validation): plain decimal integers, plain decimal floats; anything else is left to Typer.
_INT = re.compile(r"0|-?[1-9][0-9]{0,17}")
_FLOAT = re.compile(r"-?(0|[1-9][0-9]{0,17})(\.[0-9]{1,18})?([eE][-+]?[0-9]{1,3})?")


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
        sc, names = p.scenario(), strategy or [p.strategy]
    else:
        sc, names = build(opts), strategy or list(STRATEGIES)
    results = run_estimate(sc, names)
    if as_json:
        emit_json(to_json(sc, results))
    else:
        from ..estimate import assumptions
        from .render import print_estimate

        print_estimate(sc, results, assumptions(sc, tuple(r.name for r in results)), unit, wide)
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
        flag = _flag(f.name)
        out.append(f"--no-{flag[2:]}" if v is False else flag)
    return out


def _flag(name: str) -> str:
    """A scenario option's flag as Typer declares it (options.OPTION_ARGS)."""
    return (OPTION_ARGS[name][0] or (f"--{name.replace('_', '-')}",))[0]


def flags() -> dict[str, tuple[str, object]]:
    """Every flag of estimate -> (parameter, reader): str, int or float, which reads the value
    that follows, "many" (a repeatable string), the constant a flag without a value sets, or
    None (a type this module does not read: a line with that flag goes to Typer)."""
    out = dict(OWN)
    hints = typing.get_type_hints(ScenarioOptions)
    for name in FIELDS:
        kind = [a for a in typing.get_args(hints[name]) if a is not type(None)] or [hints[name]]
        flag = _flag(name)
        if kind[0] is bool:
            out[flag] = (name, True)
            out[f"--no-{flag[2:]}"] = (name, False)
        elif kind[0] in (str, int, float):
            out[flag] = (name, kind[0])
        else:
            out[flag] = (name, "many" if kind[0] == list[str] else None)
    return out


def parse(args: list[str]) -> tuple[ScenarioOptions, dict] | None:
    """The options and keywords Typer would call `run` with for `zplan estimate ARGS`, or None
    where the line needs Typer: --help, a positional word, an unknown flag, a missing value, a
    value on a flag, a value that is not plain. A flag given twice: the last wins, as in click;
    --strategy and --presets collect every value."""
    table = flags()
    values: dict = {}
    i = 0
    while i < len(args):
        flag, eq, value = args[i].partition("=")
        name, reader = table.get(flag, (None, None))
        if reader is None:
            return None
        if not isinstance(reader, type) and reader != "many":  # a flag without a value
            if eq:
                return None
            values[name] = reader
            i += 1
            continue
        if not eq:
            if i + 1 >= len(args):
                return None
            value = args[i + 1]
        i += 1 if eq else 2
        got = _read(value, reader)
        if got is None:
            return None
        values[name] = values.get(name, []) + [got] if reader == "many" else got
    opts = ScenarioOptions(**{k: v for k, v in values.items() if k in FIELDS})
    own = {k: p.default for k, p in inspect.signature(run).parameters.items() if k != "opts"}
    return opts, {**own, **{k: v for k, v in values.items() if k not in FIELDS}}


def _read(value: str, reader: object):
    """`value` as `reader` reads it, where that reading is beyond doubt; else None."""
    if reader is int:
        return int(value) if _INT.fullmatch(value) else None
    if reader is float:
        x = float(value) if _FLOAT.fullmatch(value) else None
        return x if x is not None and abs(x) < float("inf") else None
    if value.startswith("-") or not value.isprintable():  # a flag's name, or control characters
        return None
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:  # undecodable bytes in argv (surrogate escapes)
        return None
    return value
