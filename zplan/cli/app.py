"""The Typer application object; commands register on it from their own modules."""

from __future__ import annotations

import typer

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    help="Plan, launch and verify sharded data-parallel training (ZeRO, FSDP2, HSDP, offload).",
)


@app.callback()
def _root() -> None:
    """zplan: does it fit, which strategy, how fast; then launch it and measure."""

