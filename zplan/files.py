"""One reader for every input file and one writer for every output file.

Reading (presets, Hugging Face config.json, plans, zplan.toml): a regular file only (a FIFO,
/dev/zero or a directory is refused before anything blocks or streams), at most MAX_INPUT_BYTES,
UTF-8, JSON or TOML nested at most MAX_DEPTH deep, JSON without NaN/Infinity. Files are data:
nothing read is ever executed. Every failure is one UsageError line naming the file.

Writing (plans, exports, sbatch scripts, reports, presets, plots): through a temporary file in
the target's folder, fsynced, then renamed over the target, so a reader sees the old file or the
new one, never half of one. The new file gets the existing file's mode, or 0666 less the umask
(what `open()` would give), not mkstemp's 0600. A target that exists and is not a regular file
(a directory, FIFO, device, socket) is refused. A symlink is written through: its target file
is replaced and the link stays a link. Guarantees and tests: docs/reliability.md.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import stat
import tempfile
import tomllib
from pathlib import Path
from typing import Any, BinaryIO, Iterator

from .errors import UsageError, ZplanError

MAX_INPUT_BYTES = 8 * 2**20  # the largest Hugging Face config.json is a few hundred KiB
MAX_DEPTH = 32  # nesting of arrays/tables/objects; zplan's own files nest 4 deep


class FileWriteError(ZplanError):
    """The disk refused a write (read-only, full, permission): exit 1, the path named."""


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                       (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return name
    return "not a regular file"


def read_bytes(path: str | Path, what: str, limit: int = MAX_INPUT_BYTES) -> bytes:
    """The bytes of a regular file of at most `limit` bytes; anything else is one UsageError."""
    p = Path(path)
    try:
        # O_NONBLOCK: opening a FIFO must not wait for a writer; fstat then refuses it
        fd = os.open(p, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError as e:
        raise UsageError(f"cannot read {what} {p}: {e.strerror or e}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise UsageError(f"{what} {p} is {_kind(st.st_mode)}; pass a regular file")
        if st.st_size > limit:
            raise UsageError(f"{what} {p} is {st.st_size:,} bytes, over the limit of {limit:,}; "
                             f"is it the right file?")
        chunks, got = [], 0
        while got <= limit:
            b = os.read(fd, min(1 << 20, limit + 1 - got))
            if not b:
                break
            chunks.append(b)
            got += len(b)
        if got > limit:
            raise UsageError(f"{what} {p} is over the limit of {limit:,} bytes; is it the right file?")
        return b"".join(chunks)
    except OSError as e:
        raise UsageError(f"cannot read {what} {p}: {e.strerror or e}") from None
    finally:
        os.close(fd)


def read_text(path: str | Path, what: str, limit: int = MAX_INPUT_BYTES) -> str:
    """A regular file's text, which must be UTF-8 (a leading byte-order mark is dropped)."""
    data = read_bytes(path, what, limit)
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise UsageError(f"{what} {path} is not UTF-8 text (byte {e.start}); "
                         f"save it as UTF-8") from None
    if "\x00" in text:
        raise UsageError(f"{what} {path} contains a NUL byte; it is not a text file")
    return text


def _scan_depth(text: str, toml: bool) -> int:
    """Deepest bracket nesting outside strings (and, for TOML, comments), without recursion,
    stopping once past MAX_DEPTH. Conservative: a TOML multi-line string is scanned as two
    empty strings around its text."""
    if text.count("[") + text.count("{") <= MAX_DEPTH:
        return 0
    depth = deepest = 0
    quote = ""
    i, n = 0, len(text)
    while i < n:
        c = text[i]
        if quote:
            if c == "\\" and quote == '"':
                i += 1
            elif c == quote:
                quote = ""
        elif c in "\"'" and (toml or c == '"'):
            quote = c
        elif c == "#" and toml:
            j = text.find("\n", i)
            i = n if j < 0 else j
            continue
        elif c in "[{":
            depth += 1
            deepest = max(deepest, depth)
            if deepest > MAX_DEPTH:
                break
        elif c in "]}":
            depth -= 1
        i += 1
    return deepest


def _value_depth(obj: Any) -> int:
    """Nesting depth of parsed data, iteratively (dotted TOML keys nest without brackets)."""
    deepest, stack = 0, [(obj, 0)]
    while stack:
        o, d = stack.pop()
        if isinstance(o, dict):
            stack.extend((v, d + 1) for v in o.values())
        elif isinstance(o, list):
            stack.extend((v, d + 1) for v in o)
        else:
            deepest = max(deepest, d)
            continue
        deepest = max(deepest, d + 1)
        if deepest > MAX_DEPTH:
            break
    return deepest


def _check_depth(depth: int, what: str, path: str | Path) -> None:
    if depth > MAX_DEPTH:
        raise UsageError(f"{what} {path} nests deeper than {MAX_DEPTH} levels; it is not a zplan file")


def _no_constant(name: str) -> float:
    raise ValueError(f"{name} is not a number JSON allows")


def _parse(path: str | Path, what: str, fmt: str) -> Any:
    """Read, check the nesting before parsing (no recursion) and after (dotted TOML keys)."""
    text = read_text(path, what)
    _check_depth(_scan_depth(text, toml=fmt == "TOML"), what, path)
    try:
        if fmt == "TOML":
            data = tomllib.loads(text)
        else:
            data = json.loads(text, parse_constant=_no_constant)
    except json.JSONDecodeError as e:
        raise UsageError(f"{what} {path} is not valid JSON (line {e.lineno}: {e.msg})") from None
    except tomllib.TOMLDecodeError as e:
        raise UsageError(f"{what} {path} is not valid TOML ({' '.join(str(e).split())}); fix the file") from None
    except (ValueError, RecursionError) as e:
        why = " ".join(str(e).split())
        if "integer string conversion" in why:  # Python's own advice (sys.set_int_max_str_digits) is not the fix
            why = "a number with thousands of digits"
        raise UsageError(f"{what} {path} is not usable {fmt} ({why[:120]}); fix the file") from None
    _check_depth(_value_depth(data), what, path)
    return data


def read_json(path: str | Path, what: str) -> Any:
    """A JSON file's value; NaN, Infinity and numbers too long to convert are refused."""
    return _parse(path, what, "JSON")


def read_toml(path: str | Path, what: str) -> dict:
    """A TOML file's table."""
    return _parse(path, what, "TOML")


def _umask() -> int:
    old = os.umask(0o022)
    os.umask(old)
    return old


def _target(path: str | Path, what: str) -> tuple[Path, int]:
    """The file to replace (a symlink's target) and the mode the new file gets."""
    p = Path(path)
    if str(path) == "" or p.name in ("", ".", ".."):
        raise UsageError(f"{what} path {str(path)!r} names no file; pass a file path")
    try:
        if p.is_symlink():
            p = Path(os.path.realpath(p))
        st = os.stat(p)
    except FileNotFoundError:
        return p, 0o666 & ~_umask()
    except OSError as e:
        raise _write_error(e, what, p) from None
    if not stat.S_ISREG(st.st_mode):
        raise UsageError(f"{what} {path} is {_kind(st.st_mode)}; pass a path to a regular file")
    return p, stat.S_IMODE(st.st_mode)


def check_target(path: str | Path, what: str = "output") -> None:
    """Refuse, before any work is done, a target that the writers below would refuse (a
    directory, FIFO, device or socket; a path that names no file)."""
    _target(path, what)


def is_plan_file(path: str | Path) -> bool:
    """Whether `path` holds a zplan plan (a JSON object with plan_version), read as data; False
    for anything else, unreadable or not JSON."""
    try:
        p = Path(path)
        if not p.is_file() or p.stat().st_size > MAX_INPUT_BYTES:
            return False
        data = json.loads(p.read_bytes())
    except (OSError, ValueError, RecursionError):
        return False
    return isinstance(data, dict) and "plan_version" in data


def check_user_output(path: str | Path, flag: str, what: str = "output", reads: tuple = (),
                      replaces: str = "any") -> None:
    """A file the user asked for by name (recommend --write, export -o, verify --markdown, launch
    --slurm), refused before any work in one line where writing it would surprise: an empty
    name, a folder that does not exist (a typo is named, not created), the very file the command
    reads (`reads`: export --plan p.json -o p.json would replace the plan with its export), or
    an existing file of the wrong kind: `replaces` "plan" (recommend --write replaces a plan,
    not a file the user wrote) or "not-plan" (an export never replaces a plan); "any": the
    target checks only (check_target)."""
    if str(path) == "":
        raise UsageError(f"{flag} '' is empty; name a file")
    p, _ = _target(path, what)  # a symlink: the file it points to
    parent = p.parent if str(p.parent) else Path(".")
    if not parent.is_dir():
        raise UsageError(f"{flag} {path}: the folder {parent} does not exist; create it first or "
                         f"write elsewhere")
    if not p.exists():
        return
    for src in reads:
        with contextlib.suppress(OSError):
            if src and os.path.samefile(p, src):
                raise UsageError(f"{flag} {path} is the file this command reads ({src}); write to "
                                 f"another file")
    if replaces == "plan" and not is_plan_file(p) and p.stat().st_size > 0:  # mktemp's empty file: fine
        raise UsageError(f"{flag} {path} exists and is not a zplan plan; remove it or write the "
                         f"plan elsewhere (nothing was replaced)")
    if replaces == "not-plan" and is_plan_file(p):
        raise UsageError(f"{flag} {path} is a zplan plan; write the {what} to another file "
                         f"(nothing was replaced)")


_USAGE_ERRNOS = {errno.EISDIR, errno.ENOTDIR, errno.ENAMETOOLONG, errno.ELOOP, errno.ENOENT,
                 errno.EINVAL}


def _write_error(e: OSError, what: str, path: Path) -> ZplanError:
    cls = UsageError if e.errno in _USAGE_ERRNOS else FileWriteError
    return cls(f"cannot write {what} {path}: {e.strerror or e}; choose another path")


@contextlib.contextmanager
def atomic_writer(path: str | Path, what: str = "output") -> Iterator[BinaryIO]:
    """A binary file to stream into; on a clean exit it is fsynced and renamed over `path`
    (keeping the old file's mode, or the umask's), on an error removed: `path` is old or new,
    never half. Special files and directories are refused as targets."""
    target, mode = _target(path, what)
    tmp = None
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name[:64]}.", suffix=".tmp")
        with os.fdopen(fd, "wb") as f:
            yield f
            f.flush()
            os.fchmod(f.fileno(), mode)
            os.fsync(f.fileno())
        os.replace(tmp, target)
        tmp = None
    except OSError as e:
        raise _write_error(e, what, target) from None
    finally:
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)


def write_bytes(path: str | Path, data: bytes, what: str = "output") -> None:
    """Write beside the target, fsync, then rename over it: the file is old or new, never half."""
    with atomic_writer(path, what) as f:
        f.write(data)


def write_text(path: str | Path, text: str, what: str = "output") -> None:
    write_bytes(path, text.encode("utf-8"), what)
