"""Scenario commands without Typer: a parser for plain command lines (estimate, recommend,
explain).

A command's module (estimate_fast.py, recommend_body.py, explain_body.py; main.PLAIN) holds its
body, `run`, which its Typer command calls, and its own flags, `OWN`. `parse(args, OWN, run)`
reads the command lines that need nothing of Typer
(known long options, each with a plain value) into the same call Typer would make, or answers
None, and Typer reads the line instead: help, unknown flags, odd values and every error stay
Typer's. Importing Typer (0.29 imports pydantic for its parameters) and building the command
cost ~40 ms of estimate's 0.3 s budget and ~400 ms of recommend's start (issue 8).
tests/test_plain_line.py holds the parser against Typer's own reading of many command lines.
"""

from __future__ import annotations

import inspect
import re
import typing
from typing import Callable

from ..scenario_options import FIELDS, ScenarioOptions
from .options import OPTION_ARGS

# Values read here only where every reader agrees on them (Typer's click types, then the specs'
# lax validation): plain decimal integers, plain decimal floats; anything else is left to Typer.
_INT = re.compile(r"0|-?[1-9][0-9]{0,17}")
_FLOAT = re.compile(r"-?(0|[1-9][0-9]{0,17})(\.[0-9]{1,18})?([eE][-+]?[0-9]{1,3})?")


def flag_of(name: str) -> str:
    """A scenario option's flag as Typer declares it (options.OPTION_ARGS)."""
    return (OPTION_ARGS[name][0] or (f"--{name.replace('_', '-')}",))[0]


def flags(own: dict[str, tuple[str, object]]) -> dict[str, tuple[str, object]]:
    """Every flag of a scenario command whose own flags are `own` -> (parameter, reader): str,
    int or float, which reads the value that follows, "many" (a repeatable string), the constant
    a flag without a value sets, or None (a type this module does not read: a line with that
    flag goes to Typer)."""
    out = dict(own)
    hints = typing.get_type_hints(ScenarioOptions)
    for name in FIELDS:
        kind = [a for a in typing.get_args(hints[name]) if a is not type(None)] or [hints[name]]
        flag = flag_of(name)
        if kind[0] is bool:
            out[flag] = (name, True)
            out[f"--no-{flag[2:]}"] = (name, False)
        elif kind[0] in (str, int, float):
            out[flag] = (name, kind[0])
        else:
            out[flag] = (name, "many" if kind[0] == list[str] else None)
    return out


def parse(args: list[str], own: dict[str, tuple[str, object]],
          run: Callable[..., None]) -> tuple[ScenarioOptions, dict] | None:
    """The options and keywords Typer would call `run` (the command's body, whose own flags are
    `own`) with for `zplan COMMAND ARGS`, or None where the line needs Typer: --help, a
    positional word, an unknown flag, a missing value, a value on a flag, a value that is not
    plain. A flag given twice: the last wins, as in click; --strategy and --presets collect
    every value."""
    table = flags(own)
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
    opts.given = frozenset(k for k in values if k in FIELDS)
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
