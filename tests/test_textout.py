"""zplan/cli/textout.py against rich itself: the markup, the wrapping, the tables and the
terminal rule, on generated inputs, and the estimate and recommend output as rich prints it."""

import io
import random
import sys

import pytest
from rich import box
from rich.console import Console
from rich.markup import escape as rich_escape
from rich.table import Table
from rich.text import Text

from zplan.cli import render, textout
from zplan.cli.render_recommend import print_recommendation
from zplan.estimate import assumptions, estimate
from zplan.recommend import search
from zplan.scenario_options import ScenarioOptions, build

PIECES = ["[", "]", "\\", "[bold]", "[/]", "[red]", "[/red]", "[dim]", "\\[", "[x]", "[#f00]", "[/x]",
          "[@click]", "a", "b c", " ", "  ", "word", "[1]", "[]", "[ bold]", "·", "x:fire:", "\\\\["]


def rich_plain_console(width: int) -> Console:
    return Console(width=width, highlight=False, emoji=False, file=io.StringIO(), color_system=None)


def rich_printed(item, width: int) -> str:
    c = rich_plain_console(width)
    c.print(item)
    return c.file.getvalue()


def texts(rng: random.Random, n: int, pieces=PIECES, longest: int = 12) -> list[str]:
    return ["".join(rng.choice(pieces) for _ in range(rng.randint(0, longest))) for _ in range(n)]


def test_escape_and_plain_match_rich():
    rng = random.Random(8)
    for s in texts(rng, 4000):
        assert textout.escape(s) == rich_escape(s), s
        # an escaped string is printed as written
        assert textout.plain(textout.escape(s)) == Text.from_markup(rich_escape(s), emoji=False).plain, s
        try:
            want = Text.from_markup(s, emoji=False).plain
        except Exception:  # rich refuses unbalanced closing tags; zplan's markup never has them
            continue
        assert textout.plain(s) == want, s


WORDS = ["a", "bb", "ccc", "word", "longerword", "x" * 17, " ", "  ", "   ", "-", ",", "\n"]


def test_wrapping_matches_rich():
    rng = random.Random(3)
    checked = 0
    for s in texts(rng, 1000, WORDS, 16):
        for width in (1, 2, 5, 9, 16, 30):
            got = "".join(line + "\n" for line in textout.wrapped(s, width))
            assert got == rich_printed(s, width), (s, width)
            checked += 1
    assert checked == 6000


def random_table(rng: random.Random) -> tuple[textout.TableSpec, Table]:
    spec = textout.TableSpec(rng.choice(["", "T", "A title of several words", "x" * 50, "t [dim]d[/]",
                                         "[bold][/]"]))
    ncol = rng.randint(1, 6)
    for i in range(ncol):
        head = rng.choice(["strategy", "n", "a b", "fits", "[bold]h[/]", "headroom"])
        spec.add_column(head, justify=rng.choice(["left", "right", "right", "left", "center"]), no_wrap=True,
                        min_width=rng.choice([None, len(head), 12]))
    cells = ["", "1", "12.3 GB", "yes", "[green]yes[/]", "[red]no[/]", "hidden  ", " lead", "x" * 20,
             "a\\[b]", "[dim]n/a: why[/]"]
    for _ in range(rng.randint(0, 5)):
        spec.add_row(*[rng.choice(cells) for _ in range(ncol)])
    return spec, spec.to_rich()


def test_tables_match_rich():
    rng = random.Random(5)
    plain_cases = 0
    for _ in range(800):
        spec, table = random_table(rng)
        width = rng.choice([10, 30, 60, 100, 160])
        lines = spec.lines(width)
        if lines is None:  # wider than the console: rich prints it
            continue
        plain_cases += 1
        assert "".join(line + "\n" for line in lines) == rich_printed(table, width)
    assert plain_cases > 250


def test_the_rich_table_is_the_one_zplan_always_printed():
    spec = textout.TableSpec("t")
    spec.add_column("a", justify="right", no_wrap=True, min_width=1)
    spec.add_row("1")
    t = spec.to_rich()
    assert t.box is box.SIMPLE_HEAD and not t.pad_edge and not t.show_edge and t.title_justify == "left"


class Stdout(io.StringIO):
    def __init__(self, tty: bool, encoding: str = "utf-8"):
        super().__init__()
        self._tty, self._enc, self.flushes = tty, encoding, 0

    def isatty(self):
        return self._tty

    def flush(self):
        self.flushes += 1

    @property
    def encoding(self):
        return self._enc


@pytest.mark.parametrize("tty", [False, True])
@pytest.mark.parametrize("force", [None, "", "1"])
@pytest.mark.parametrize("compat", [None, "0", "1", "x"])
@pytest.mark.parametrize("term", [None, "dumb", "xterm-256color", "unknown"])
def test_plain_text_only_where_rich_sees_no_terminal(monkeypatch, tty, force, compat, term):
    """Where textout prints, rich writes no style and keeps the width it is given (a dumb
    terminal is one: rich prints it 80 wide, so it goes to rich)."""
    for k, v in (("FORCE_COLOR", force), ("TTY_COMPATIBLE", compat), ("TERM", term)):
        if v is None:
            monkeypatch.delenv(k, raising=False)
        else:
            monkeypatch.setenv(k, v)
    monkeypatch.delenv("COLORTERM", raising=False)
    monkeypatch.delenv("LINES", raising=False)
    monkeypatch.setattr(sys, "stdout", Stdout(tty))
    rich = Console(width=123)
    assert textout._rich_sees_a_terminal() == rich.is_terminal
    if not textout._rich_sees_a_terminal():
        assert rich.color_system is None and rich.size.width == 123


def test_a_dumb_terminal_goes_to_rich_at_its_width(monkeypatch):
    monkeypatch.setenv("FORCE_COLOR", "1")
    monkeypatch.setenv("TERM", "dumb")
    monkeypatch.delenv("LINES", raising=False)
    monkeypatch.setenv("COLUMNS", "100")
    out = Stdout(False)
    monkeypatch.setattr(sys, "stdout", out)
    text = "word " * 30
    render.make_console().print(text)
    assert out.getvalue() == rich_printed(text, 80)


def test_a_stdout_without_utf8_goes_to_rich(monkeypatch):
    monkeypatch.delenv("FORCE_COLOR", raising=False)
    monkeypatch.delenv("TTY_COMPATIBLE", raising=False)
    monkeypatch.setattr(sys, "stdout", Stdout(False, "ascii"))
    assert textout._rich_sees_a_terminal()


def test_each_print_is_flushed_and_a_closed_stdout_takes_nothing(monkeypatch):
    """rich flushes after each print (so stderr's notes follow the tables) and writes nowhere
    when standard output is closed (`>&-`: sys.stdout is None)."""
    monkeypatch.delenv("FORCE_COLOR", raising=False)
    monkeypatch.delenv("TTY_COMPATIBLE", raising=False)
    out = Stdout(False)
    monkeypatch.setattr(sys, "stdout", out)
    c = render.make_console()
    c.print("a")
    c.print("b")
    assert out.getvalue() == "a\nb\n" and out.flushes == 2
    monkeypatch.setattr(sys, "stdout", None)
    render.make_console().print("a")


def printed(monkeypatch, make, fn) -> str:
    out = Stdout(False)
    monkeypatch.setattr(sys, "stdout", out)
    monkeypatch.setattr(render, "make_console", make)
    monkeypatch.setattr("zplan.cli.render_recommend.make_console", make)
    fn()
    return out.getvalue()


class RichOnly(textout.Out):
    """The oracle: every print through rich, as before textout."""

    def print(self, item):
        self.rich().print(item.to_rich() if isinstance(item, textout.TableSpec) else item)


CASES = [dict(model="mixtral-8x7b", gpus="16", checkpointing="selective"),
         dict(model="llama-3.1-70b", gpus="64", checkpointing="full"),
         dict(params="7e9", gpus="8"),
         dict(model="llama-3.1-405b", gpus="1024", checkpointing="full")]


@pytest.mark.slow  # over a second each: the fast loop leaves it to CI
@pytest.mark.parametrize("width", [40, 80, 100, 250])
@pytest.mark.parametrize("case", range(len(CASES)))
def test_estimate_and_recommend_print_what_rich_printed(monkeypatch, width, case):
    monkeypatch.delenv("FORCE_COLOR", raising=False)
    monkeypatch.delenv("TTY_COMPATIBLE", raising=False)
    monkeypatch.setenv("COLUMNS", str(width))
    sc = build(ScenarioOptions(**CASES[case]))
    res, assumed = estimate(sc), assumptions(sc)
    for wide in (False, True):
        est = lambda: render.print_estimate(sc, res, assumed, "GiB" if wide else "GB", wide=wide)  # noqa: E731
        fast = printed(monkeypatch, render.make_console, est)
        assert fast == printed(monkeypatch, lambda: RichOnly(render.console_width()), est)
        assert "Memory per GPU" in fast and "\x1b[" not in fast
    rec = search(sc, 2 * sc.n)
    if rec.winner is None:
        return
    show = lambda: print_recommendation(rec, 3, None, None, wide=case % 2 == 0)  # noqa: E731
    assert printed(monkeypatch, render.make_console, show) == \
        printed(monkeypatch, lambda: RichOnly(render.console_width()), show)


def test_colour_goes_through_rich(monkeypatch):
    monkeypatch.setenv("FORCE_COLOR", "1")
    out = Stdout(False)
    monkeypatch.setattr(sys, "stdout", out)
    render.make_console().print("[red]no[/]")
    assert "\x1b[31mno" in out.getvalue()
