"""zplan estimate: the Typer command; its body (and a plain path that skips Typer) is in
estimate_fast.py."""

from __future__ import annotations

from typing import Annotated, Optional

import typer

from ..scenario_options import ScenarioOptions
from . import estimate_fast
from .app import app
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
    estimate_fast.run(opts, strategy=strategy, as_json=as_json, unit=unit, plan=plan, wide=wide)
