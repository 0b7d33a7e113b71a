"""zplan's command line: thin commands over the planning library, one error boundary."""

from __future__ import annotations

import errno
import functools
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


def one_line(text: str) -> str:
    """An error message as one printable line: whitespace runs become one space, and other
    characters that are not printable (escape sequences, bidi controls) their \\x.. escapes, so
    that a value typed by anyone cannot break the line or drive the terminal."""
    text = " ".join(text.split())
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else c.encode("unicode_escape").decode("ascii") for c in text)


@functools.lru_cache(maxsize=1)
def _command():
    """The click command behind the Typer app, built once (Typer rebuilds it on every call,
    ~90 ms: it matters to in-process callers such as the fuzz test, not to one CLI run)."""
    import typer.main

    return typer.main.get_command(app)


_USAGE_ERRNOS = {errno.EISDIR, errno.ENOTDIR, errno.ENOENT, errno.ENAMETOOLONG, errno.ELOOP,
                 errno.EINVAL, errno.EEXIST}


def _environment_error(e: BaseException) -> tuple[str, int]:
    """An error the library did not turn into a ZplanError, as one line and an exit code.

    OSError names its path: exit 2 where another path is the fix (a directory, a missing
    folder, a name too long), 1 where the machine refused (permission, read-only, disk full).
    Recursion, decoding, overflow and memory errors come from absurd input: exit 2.
    """
    if isinstance(e, OSError):
        where = " ".join(str(x) for x in (e.filename, e.filename2) if x is not None)
        what = e.strerror or type(e).__name__
        code = 2 if e.errno in _USAGE_ERRNOS else 1
        return (f"{what}: {where}; check the path and its permissions" if where else
                f"{what} ({' '.join(str(e).split())[:200]})"), code
    kind = {RecursionError: "input nested too deeply", UnicodeError: "input is not valid text",
            OverflowError: "a number in the input is too large",
            MemoryError: "the input asks for more memory than this machine has"}
    what = next(v for k, v in kind.items() if isinstance(e, k))
    detail = " ".join(str(e).split())[:200]
    return f"{what} ({detail}); check the values given", 2


def run(argv: list[str] | None = None) -> int:
    """Entry point: the one place that turns errors into one line and an exit code."""
    debug = os.environ.get("ZPLAN_DEBUG") == "1"
    try:
        rv = _command()(args=argv, standalone_mode=False, prog_name="zplan")
        return rv if isinstance(rv, int) else 0  # click returns an Exit's code in this mode
    except ZplanError as e:
        if debug:
            raise
        sys.stdout.flush()
        print(f"zplan: error: {one_line(str(e))}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        return 0
    except (OSError, RecursionError, UnicodeError, OverflowError, MemoryError) as e:
        if debug:
            raise
        sys.stdout.flush()
        line, code = _environment_error(e)
        print(f"zplan: error: {one_line(line)}", file=sys.stderr)
        return code
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
            msg = one_line(e.format_message())
            print(f"zplan: error: {msg} (see {cmd} --help)", file=sys.stderr)
            return int(getattr(e, "exit_code", 2))
        print(f"zplan: internal error: {type(e).__name__}: {one_line(str(e))} (rerun with ZPLAN_DEBUG=1 and report it)",
              file=sys.stderr)
        return 1


def main() -> None:
    sys.exit(run())


if __name__ == "__main__":
    main()
