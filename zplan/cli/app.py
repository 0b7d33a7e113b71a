"""The Typer application object; commands register on it from their own modules."""

from __future__ import annotations

import sys

import typer

from .json_out import dumps

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    help="Plan, launch and verify sharded data-parallel training (ZeRO, FSDP2, HSDP, offload).",
)


@app.callback()
def _root() -> None:
    """zplan: does it fit, which strategy, how fast; then launch it and measure."""


def emit_json(obj: dict) -> None:
    """One JSON object on stdout; NaN or infinity is a bug upstream, never printed as non-JSON."""
    sys.stdout.write(dumps(obj) + "\n")
