"""zplan's command line: thin commands over the planning library, one error boundary."""

from __future__ import annotations

import os
import sys

from ..errors import ZplanError
from . import estimate_cmd, launch_cmd, recommend_cmd, verify_cmd  # noqa: F401  (commands register on the app)
from .app import app

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
        rv = app(args=argv, standalone_mode=False, prog_name="zplan")
        return rv if isinstance(rv, int) else 0  # click returns an Exit's code in this mode
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
