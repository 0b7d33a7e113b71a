"""zplan's command line: thin commands over the planning library, one error boundary."""

from __future__ import annotations

import json
import os
import sys
from typing import Annotated, Optional

import typer

from ..errors import PlanError, UsageError, ZplanError
from .options import ScenarioOptions, build, scenario_options

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    help="Plan, launch and verify sharded data-parallel training (ZeRO, FSDP2, HSDP, offload).",
)


@app.callback()
def _root() -> None:
    """zplan: does it fit, which strategy, how fast; then launch it and measure."""


def _emit_json(obj: dict) -> None:
    sys.stdout.write(json.dumps(obj, indent=2) + "\n")


@app.command()
@scenario_options
def estimate(
    opts: ScenarioOptions,
    strategy: Annotated[Optional[list[str]], typer.Option(help="Strategy to show (repeatable; default all)")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object")] = False,
    unit: Annotated[str, typer.Option(help="GB (10^9 bytes) or GiB (2^30)")] = "GB",
) -> None:
    """Per-GPU memory, traffic, overlap and step time of every strategy."""
    from ..estimate import estimate as run_estimate, fit_hints, to_json
    from ..strategies import STRATEGIES
    from .parse import check_choice

    check_choice(unit, "--unit", ("GB", "GiB"))
    names = strategy or list(STRATEGIES)
    for s in names:
        check_choice(s, "--strategy", tuple(STRATEGIES))
    sc = build(opts)
    results = run_estimate(sc, names)
    if as_json:
        _emit_json(to_json(sc, results))
    else:
        from ..estimate import assumptions
        from .render import print_estimate

        print_estimate(sc, results, assumptions(sc), unit)
    if not any(r.fits for r in results):
        raise PlanError(f"no strategy fits {sc.hw.gpu.name} with {sc.n} GPUs: {fit_hints(sc, results)}")


def _kind(e: BaseException) -> str:
    """Classify click's exceptions by name: Typer vendors click, so its classes move between
    versions (click.UsageError or typer._click.exceptions.UsageError)."""
    names = {c.__name__ for c in type(e).__mro__}
    for kind in ("NoArgsIsHelpError", "UsageError", "ClickException", "Abort", "Exit"):
        if kind in names:
            return kind
    return ""


def run(argv: list[str] | None = None) -> int:
    """Entry point: the one place that turns errors into one line and an exit code."""
    debug = os.environ.get("ZPLAN_DEBUG") == "1"
    try:
        app(args=argv, standalone_mode=False, prog_name="zplan")
        return 0
    except ZplanError as e:
        if debug:
            raise
        sys.stdout.flush()
        print(f"zplan: error: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        return 0
    except Exception as e:  # the boundary: never a traceback unless ZPLAN_DEBUG=1
        kind = _kind(e)
        if kind == "NoArgsIsHelpError":
            return 0
        if kind == "Exit":
            return int(getattr(e, "exit_code", 0) or 0)
        if kind == "Abort":
            print("zplan: aborted", file=sys.stderr)
            return 130
        if debug:
            raise
        if kind in ("UsageError", "ClickException"):
            ctx = getattr(e, "ctx", None)
            cmd = f"zplan {ctx.info_name}" if ctx is not None and ctx.info_name != "zplan" else "zplan"
            msg = " ".join(e.format_message().split())
            print(f"zplan: error: {msg} (see {cmd} --help)", file=sys.stderr)
            return int(getattr(e, "exit_code", 2))
        print(f"zplan: internal error: {type(e).__name__}: {e} (rerun with ZPLAN_DEBUG=1 and report it)",
              file=sys.stderr)
        return 1


def main() -> None:
    sys.exit(run())


if __name__ == "__main__":
    main()
