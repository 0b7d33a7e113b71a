"""zplan's command line: thin commands over the planning library, one error boundary."""

from __future__ import annotations

import copy
import errno
import functools
import importlib
import os
import re
import sys

from ..errors import UsageError, ZplanError

# Every command and the module that registers it on the app, in `zplan --help`'s order. A run of
# one command imports and builds only that one (start-up time: estimate answers in < 0.3 s).
COMMANDS = {
    "estimate": "estimate_cmd", "detect": "launch_cmd", "launch": "launch_cmd",
    "consolidate": "launch_cmd", "recommend": "recommend_cmd", "export": "recommend_cmd",
    "explain": "recommend_cmd", "selfcheck": "verify_cmd", "verify": "verify_cmd",
    "calibrate": "verify_cmd",
}
# commands whose plain command lines are read without Typer (plain_line.py): their body's module
PLAIN = {"estimate": "estimate_fast", "recommend": "recommend_body", "explain": "explain_body"}


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


def command_name(info) -> str:
    """The name a registered command answers to (Typer's rule: the function's, with dashes)."""
    return info.name or info.callback.__name__.lower().replace("_", "-")


@functools.lru_cache(maxsize=None)
def _command(name: str | None = None):
    """The click group behind the Typer app, built once per `name` (Typer rebuilds it on every
    call: it matters to in-process callers such as the fuzz test). With a command's name, the
    group holds that command alone: only its module is imported and only it is built (the
    others cost ~40 ms); with None, every command, for help, no arguments and unknown names."""
    import typer.main

    from .app import app

    wanted = [name] if name is not None else list(COMMANDS)
    for module in dict.fromkeys(COMMANDS[n] for n in wanted):
        importlib.import_module(f"{__package__}.{module}")
    order = {n: i for i, n in enumerate(COMMANDS)}
    group = copy.copy(app)
    group.registered_commands = sorted(
        (c for c in app.registered_commands if name is None or command_name(c) == name),
        key=lambda c: order.get(command_name(c), len(order)))
    return typer.main.get_command(group)


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


_BAD_NUMBER = re.compile(r"Invalid value for '(--[\w-]+)': Input should be a valid (integer|number)")


def _bad_number(msg: str, args: list[str]) -> str:
    """Typer's "Input should be a valid integer" for a flag, with the value typed and what to
    type instead (the value from the command line: the last occurrence, as the parser takes)."""
    m = _BAD_NUMBER.match(msg)
    if not m:
        return msg
    flag, kind = m.groups()
    values = []
    for i, a in enumerate(args):
        if a == "--":
            break
        if a == flag and i + 1 < len(args):
            values.append(args[i + 1])
        elif a.startswith(flag + "="):
            values.append(a[len(flag) + 1:])

    def parses(v: str, as_type) -> bool:
        try:
            as_type(v)
            return True
        except ValueError:
            return False

    value = next((v for v in values if not parses(v, int if kind == "integer" else float)), None)
    if value is None:
        return msg
    if kind == "number":
        return f"{flag} {value!r} is not a number"
    written = " (write it out: 8192, not 8e3)" if "e" in value.lower() and parses(value, float) else ""
    return f"{flag} {value!r} is not a whole number{written}"


def _stdout_is_devnull() -> bool:
    """Whether fd 1 is /dev/null (rich's broken-pipe handler puts it there)."""
    try:
        a, b = os.fstat(1), os.stat(os.devnull)
    except OSError:
        return False
    return (a.st_dev, a.st_ino, a.st_rdev) == (b.st_dev, b.st_ino, b.st_rdev)


def run(argv: list[str] | None = None) -> int:
    """Entry point: the one place that turns errors into one line and an exit code."""
    debug = os.environ.get("ZPLAN_DEBUG") == "1"
    if sys.stdout is None:
        # fd 1 closed (`>&-`, some daemons; Python then sets sys.stdout to None): every command
        # prints its result there, so refuse before any work, not after a plan, an export or a
        # run folder was written (nor a traceback, nor a silent exit 0)
        print("zplan: error: standard output is closed, and every zplan command prints its result there; "
              "redirect it (> FILE, or > /dev/null) instead of closing it", file=sys.stderr)
        return 2
    on_devnull = _stdout_is_devnull()
    try:
        args = sys.argv[1:] if argv is None else argv
        first = next(iter(args), None)
        if first in PLAIN and not os.environ.get("_ZPLAN_COMPLETE"):  # Typer's completion
            from .plain_line import parse

            body = importlib.import_module(f"{__package__}.{PLAIN[first]}")
            plain = parse(args[1:], body.OWN, body.run)
            if plain is not None:  # a plain command line: no Typer to import and build
                body.run(plain[0], **plain[1])
                return 0
        rv = _command(first if first in COMMANDS else None)(args=argv, standalone_mode=False,
                                                           prog_name="zplan")
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
    except SystemExit as e:
        # rich's Console.on_broken_pipe (the help Typer prints through rich, `zplan --help | head`)
        # points stdout at /dev/null and exits 1; zplan's own output exits 0 on a closed pipe
        if e.code == 1 and not on_devnull and _stdout_is_devnull():
            return 0
        raise
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
            msg = _bad_number(one_line(e.format_message()), sys.argv[1:] if argv is None else argv)
            print(f"zplan: error: {msg} (see {cmd} --help)", file=sys.stderr)
            return int(getattr(e, "exit_code", 2))
        print(f"zplan: internal error: {type(e).__name__}: {one_line(str(e))} (rerun with ZPLAN_DEBUG=1 and report it)",
              file=sys.stderr)
        return 1


def main() -> None:
    sys.exit(run())


if __name__ == "__main__":
    main()
