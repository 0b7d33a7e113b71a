"""Console output for the planner's tables without importing rich where rich would not write to
a terminal: piped or redirected output (the usual way a script or a benchmark runs
`zplan estimate`), where rich writes no colour and keeps the width it is given.

rich costs ~100 ms of `zplan estimate` (its import ~55 ms, laying out four tables ~45 ms) against
a budget of 0.3 s. Without colour its output is plain text, and for what zplan prints (ASCII
text, single-line cells, tables narrower than the console) that text follows a few rules,
restated here and held byte for byte against rich itself in tests/test_textout.py:

- markup (rich.markup's tag syntax, `[bold]...[/]`) is dropped, and `\\[` is a literal `[`;
- a printed line is word-wrapped as rich.text.Text.wrap does (rich/_wrap.py `divide_line`: a word
  carries the spaces after it; a word that does not fit starts a new line; a word longer than
  the line is folded; spaces that overhang the line's end are cut);
- a table (box SIMPLE_HEAD, no edge, cells padded by one space inside the table) is each column at
  its widest cell, the columns joined by one space, a rule of `─` under the heading, and its
  title wrapped and padded to the table's width.

Anything else goes to rich unchanged: a terminal (colour; a dumb one, which rich prints 80
columns wide), a table wider than the console, a character that is not printable ASCII (wide
characters, control codes, tabs), a cell of several lines. These are rich 15's rules (rich 13 and
14 pad a table's edge columns and read FORCE_COLOR="" otherwise): pyproject requires rich>=15.
"""

from __future__ import annotations

import os
import re
import sys
from dataclasses import dataclass, field

# rich.markup's tag: optional backslashes, then [ and a tag starting with a letter, # / or @
_TAG = re.compile(r"((\\*)\[([a-z#/@][^[]*?)])")
_ESCAPABLE = re.compile(r"(\\*)(\[[a-z#/@][^[]*?])")
_WORD = re.compile(r"\s*\S+\s*")
_TRAILING_SPACE = re.compile(r"\s+$")
_PLAIN_OK = re.compile(r"[ -~\n·─]*")  # printable ASCII, newlines, the bar's dot and the rule


def escape(text: str) -> str:
    """Text made safe to put in markup: as rich.markup.escape (a backslash before every `[` that
    would open a tag, the backslashes before it doubled; a trailing lone backslash doubled)."""
    text = _ESCAPABLE.sub(lambda m: f"{m.group(1)}{m.group(1)}\\{m.group(2)}", text)
    if text.endswith("\\") and not text.endswith("\\\\"):
        return text + "\\"
    return text


def plain(markup: str) -> str:
    """The text rich prints for markup, without its styles (rich.markup.render's .plain)."""
    if "[" not in markup:
        return markup
    out: list[str] = []
    pos = 0
    for m in _TAG.finditer(markup):
        whole, slashes = m.group(1), m.group(2)
        start, end = m.span()
        if start > pos:
            out.append(markup[pos:start].replace("\\[", "["))
        pos = end
        if slashes:
            pairs, escaped = divmod(len(slashes), 2)
            out.append("\\" * pairs)
            if escaped:  # an escaped tag is text
                out.append(whole[len(slashes):])
                continue
        # a tag: a style, which has no text
    if pos < len(markup):
        out.append(markup[pos:].replace("\\[", "["))
    return "".join(out)


def printable(text: str) -> bool:
    """Whether rich would print text character for character, one cell each."""
    return _PLAIN_OK.fullmatch(text) is not None


def wrap(text: str, width: int) -> list[str]:
    """One line of text word-wrapped to width cells, as rich does for a printed string."""
    breaks: list[int] = []
    offset = 0
    for m in _WORD.finditer(text):
        start, word = m.start(), m.group(0)
        need = len(word.rstrip())
        if width - offset >= need:
            offset += len(word)
        elif need > width:  # longer than any line: folded into pieces of width
            pieces = [word[i:i + width] for i in range(0, len(word), width)]
            for i, piece in enumerate(pieces):
                if start:
                    breaks.append(start)
                if i == len(pieces) - 1:
                    offset = len(piece)
                else:
                    start += len(piece)
        elif offset and start:
            breaks.append(start)
            offset = len(word)
    lines = [text[a:b] for a, b in zip([0] + breaks, breaks + [len(text)])]
    out = []
    for line in lines:
        if len(line) > width:
            space = _TRAILING_SPACE.search(line)
            if space is not None:
                line = line[:len(line) - min(len(space.group(0)), len(line) - width)]
        out.append(line[:width])
    return out


def wrapped(text: str, width: int) -> list[str]:
    """Every line of text (split at newlines first), wrapped."""
    return [piece for line in text.split("\n") for piece in wrap(line, width)]


@dataclass
class Column:
    header: str
    justify: str = "left"
    no_wrap: bool = False
    min_width: int | None = None


@dataclass
class TableSpec:
    """What a table holds: its title, columns and rows of markup. Printed by Out, as text or
    through rich.table.Table (box SIMPLE_HEAD, pad_edge and show_edge off)."""

    title: str = ""
    columns: list[Column] = field(default_factory=list)
    rows: list[tuple[str, ...]] = field(default_factory=list)

    def add_column(self, header: str, justify: str = "left", no_wrap: bool = False,
                   min_width: int | None = None) -> None:
        self.columns.append(Column(header, justify, no_wrap, min_width))

    def add_row(self, *cells: str) -> None:
        self.rows.append(tuple(cells))

    def to_rich(self):
        from rich import box
        from rich.table import Table

        tb = Table(title=self.title, title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False,
                   show_edge=False)
        for c in self.columns:
            tb.add_column(c.header, justify=c.justify, no_wrap=c.no_wrap, min_width=c.min_width)
        for r in self.rows:
            tb.add_row(*r)
        return tb

    def lines(self, width: int) -> list[str] | None:
        """The table as rich prints it without colour, or None where that is not this simple
        (rich then prints it)."""
        n = len(self.columns)
        if n == 0 or any(len(r) != n for r in self.rows) or not all(
                c.no_wrap and c.justify in ("left", "right") for c in self.columns):
            return None
        grid = [[plain(c.header) for c in self.columns]] + [[plain(x) for x in r] for r in self.rows]
        title = plain(self.title)
        if not all(printable(x) and "\n" not in x for row in grid for x in row) or not printable(title):
            return None
        pads = [(0 if i == 0 else 1) + (0 if i == n - 1 else 1) for i in range(n)]
        widths = []
        for i, c in enumerate(self.columns):
            w = max(len(row[i]) for row in grid) + pads[i]
            if c.min_width is not None:
                w = max(w, c.min_width + pads[i])
            widths.append(w or 1)
        table_width = sum(widths) + n - 1
        if table_width > width:
            return None
        # rich prints a title whose markup is set, even where it has no text (a blank line)
        out = [line + " " * (table_width - len(line)) for line in wrapped(title, table_width)] if self.title else []
        for k, row in enumerate(grid):
            cells = []
            for i, (c, x) in enumerate(zip(self.columns, row)):
                inner = widths[i] - pads[i]
                x = x.rstrip() if c.justify == "right" else x
                x = x.rjust(inner) if c.justify == "right" else x.ljust(inner)
                cells.append((" " if i else "") + x + (" " if i < n - 1 else ""))
            out.append(" ".join(cells))
            if k == 0:
                out.append("─" * table_width)
        return out


class Out:
    """print(markup or TableSpec) to standard output: as text where rich would not write to a
    terminal and the text is simple, else through a rich Console built as zplan always built it."""

    def __init__(self, width: int, tables_fit: bool = True):
        """tables_fit: a table wider than `width` goes to rich, which squeezes it to the width
        (numbers cut to "3.60…", columns dropped); False: piped output with no COLUMNS set, where
        a table is printed whole, as wide as its cells (a file or a script has no edge to fit)."""
        self.width = width
        self.tables_fit = tables_fit
        self._rich = None
        self.terminal = _rich_sees_a_terminal()

    def rich(self):
        if self._rich is None:
            from rich.console import Console

            console = Console(width=self.width, emoji=False)
            if console.color_system is None:  # the highlighter only adds styles
                console = Console(width=self.width, highlight=False, emoji=False)
            self._rich = console
        return self._rich

    def print(self, item) -> None:
        if not self.terminal:
            lines = self._lines(item)
            if lines is not None:
                out = sys.stdout
                if out is not None:  # closed (`>&-`): rich writes nowhere too
                    out.write("".join(line + "\n" for line in lines))
                    out.flush()  # as rich does after each print (stderr's notes come after)
                return
        self.rich().print(item.to_rich() if isinstance(item, TableSpec) else item)

    def _lines(self, item) -> list[str] | None:
        if isinstance(item, TableSpec):
            return item.lines(self.width if self.tables_fit else sys.maxsize)
        text = plain(item)
        return wrapped(text, self.width) if printable(text) else None


def _rich_sees_a_terminal() -> bool:
    """Whether rich.console.Console would take standard output for a terminal (its is_terminal
    rule, rich 15: TTY_COMPATIBLE, then FORCE_COLOR, then isatty), where it may colour or, on a
    dumb one, print 80 columns wide; or might (Windows, Jupyter, an output that cannot take
    UTF-8, whose rule rich draws in ASCII). Then rich prints."""
    env = os.environ
    if sys.platform == "win32" or "ipykernel" in sys.modules:
        return True
    out = sys.stdout
    if out is None:
        return False
    enc = (getattr(out, "encoding", None) or "utf-8").lower()
    if not enc.startswith("utf"):
        return True
    compatible = env.get("TTY_COMPATIBLE", "")
    if compatible in ("0", "1"):
        return compatible == "1"
    if env.get("FORCE_COLOR") is not None:
        return env.get("FORCE_COLOR") != ""
    try:
        return bool(out.isatty())
    except (ValueError, AttributeError):
        return False
