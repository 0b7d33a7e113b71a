"""zplan explain without Typer: the command's body and its own flags.

`run` is the body the Typer command (recommend_cmd.py) calls; plain_line.parse(args, OWN, run)
reads a plain command line into the same call without Typer, or answers None and Typer reads it.
"""

from __future__ import annotations

from ..parse import check_choice
from ..scenario_options import ScenarioOptions, build, check_flag_pairs
from . import plain_line
from .json_out import emit_json

# explain's own options as its Typer signature declares them: flag -> (parameter, reader)
# (their defaults: run's signature)
OWN = {"--strategy": ("strategy", str), "--json": ("as_json", True)}


def run(opts: ScenarioOptions, strategy: str = "zero3", as_json: bool = False) -> None:
    """The derivation of one strategy's figures, with your numbers substituted."""
    from ..explain import explain_lines
    from ..strategies import STRATEGIES

    check_choice(strategy, "--strategy", tuple(STRATEGIES))
    check_flag_pairs(opts, [strategy])
    sc = build(opts)
    lines = explain_lines(sc, strategy)
    if as_json:
        from ..estimate import SCHEMA_VERSION, estimate_one

        emit_json({"schema_version": SCHEMA_VERSION, "strategy": strategy,
                   "figures": estimate_one(sc, strategy).as_dict(), "derivation": lines})
        return
    for line in lines:
        print(line)
