"""The plain path of estimate, recommend and explain (zplan/cli/plain_line.py) against Typer's own
reading of the line."""

from unittest import mock

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.fuzzing import HOSTILE_TEXT
from zplan.cli import estimate_fast, explain_body, plain_line, recommend_body

BODIES = {"estimate": estimate_fast, "recommend": recommend_body, "explain": explain_body}


def read(command: str, argv: list[str]):
    """The plain path's reading of `zplan COMMAND ARGV`, as main.run makes it."""
    body = BODIES[command]
    return plain_line.parse(argv, body.OWN, body.run)


def typer_reading(command: str, argv: list[str]):
    """(opts, keywords) Typer calls the command's body with, or the exception it raises first."""
    from zplan.cli.main import _command

    seen = []
    with mock.patch.object(BODIES[command], "run", lambda opts, **kw: seen.append((opts, kw))):
        try:
            _command(command)(args=[command, *argv], standalone_mode=False, prog_name="zplan")
        except Exception as e:  # noqa: BLE001  (Typer's usage errors and the like)
            return e
    return seen[0]


@pytest.mark.parametrize("command", BODIES)
def test_the_flag_table_is_the_typer_commands(command):
    from zplan.cli.main import _command

    click_cmd = _command(command).commands[command]
    want = {}
    for p in click_cmd.params:
        if p.name == "help":
            continue
        for opt in p.opts:
            want[opt] = (p.name, True if p.is_flag else "many" if p.multiple else
                         _plain(p.type_descriptor.annotation))
        for opt in p.secondary_opts:
            want[opt] = (p.name, False)
    assert plain_line.flags(BODIES[command].OWN) == want


def test_main_reads_plain_lines_of_these_commands_only():
    from zplan.cli.main import PLAIN

    assert {k: f"zplan.cli.{v}" for k, v in PLAIN.items()} == {k: m.__name__ for k, m in BODIES.items()}


def _plain(annotation):
    """int for Optional[int], and so on."""
    import typing

    return next(a for a in typing.get_args(annotation) or [annotation] if a is not type(None))


EXAMPLES = [
    [],
    ["--params", "70e9", "--gpus", "64", "--json"],
    ["--model", "llama-3.1-70b", "--gpus=64", "--checkpointing", "full", "--wide", "--no-wide"],
    ["--unit", "GB", "--unit", "GiB", "--json", "--json"],
    ["--strategy", "zero3", "--strategy", "hsdp", "--unit", "GiB"],
    ["--presets", "a", "--presets", "b", "--flash", "--no-flash", "--fused-norm"],
    ["--no-fused-norm", "--seq-len", "8192", "--micro-batch", "-3", "--efficiency", "1e-3"],
    ["--bucket-mib", "0.5", "--context-gib", "-0", "--fragmentation", "0", "--shard-size", "8"],
    ["--unit=", "--plan=p.json", "--gpus", ""],
]


RECOMMEND_EXAMPLES = [
    [],
    ["--model", "llama-3.1-70b", "--gpus", "64", "--json", "--top", "3"],
    ["--global-batch", "512", "--objective", "memory", "--headroom", "0.2", "--write", "p.json"],
    ["--global-batch-tokens", "4M", "--for", "deepspeed", "--strategy", "zero3", "--strategy=zero2"],
    ["--plot", "x.png", "--wide", "--no-wide", "--seq-len", "8192", "--for=zplan", "--top=0"],
]


EXPLAIN_EXAMPLES = [[], ["--strategy", "hsdp", "--shard-size", "8", "--gpus", "16", "--json"],
                    ["--strategy=zero1", "--model", "llama-3.1-70b", "--strategy", "ddp"]]


@pytest.mark.parametrize("command,argv", [("estimate", a) for a in EXAMPLES] +
                         [("recommend", a) for a in RECOMMEND_EXAMPLES] +
                         [("explain", a) for a in EXPLAIN_EXAMPLES])
def test_plain_lines_are_read_as_typer_reads_them(command, argv):
    got = read(command, argv)
    assert got is not None, argv
    assert got == typer_reading(command, argv), argv


@pytest.mark.parametrize("command", BODIES)
def test_lines_that_need_typer_are_left_to_it(command):
    def parse(argv):
        return read(command, argv)

    for argv in (["--help"], ["--gpus"], ["--json=1"], ["--seq-len", "08"], ["--seq-len", "1_000"],
                 ["--seq-len", "2.5"], ["--efficiency", "1e999"], ["--efficiency", "nan"],
                 ["--gpus", "-3"], ["--model", "--json"],
                 ["--no-such-flag"], ["word"], ["--", "--json"], ["--model", "a\nb"],
                 ["--model", "\udcff"], ["--no-json"]):
        assert parse(argv) is None, argv
    if command == "recommend":
        for argv in (["--top", "2.5"], ["--headroom", "inf"], ["--for", "-x"], ["--unit", "GB"]):
            assert parse(argv) is None, argv


values = (st.sampled_from(HOSTILE_TEXT) | st.integers(-10**20, 10**20).map(str)
          | st.floats().map(repr) | st.text(max_size=6)
          | st.sampled_from(["8", "08", "1.5", "2e3", "zero3", "GiB", "llama-3.1-8b", "full", "bf16"]))
ODD = ["--help", "--", "-x", "--json=1", "word", "--no-json", "--gpu"]


@st.composite
def lines(draw, command):
    """Mostly well-formed lines of the command's flags, with hostile values and stray words."""
    table = plain_line.flags(BODIES[command].OWN)
    out: list[str] = []
    for _ in range(draw(st.integers(0, 6))):
        flag = draw(st.sampled_from(sorted(table)))
        if table[flag][1] in (True, False):
            out.append(flag)
        else:
            value = draw(values)
            out += [f"{flag}={value}"] if draw(st.booleans()) else [flag, value]
        if draw(st.integers(0, 9)) == 0:
            out.append(draw(st.sampled_from(ODD)))
    return out


@pytest.mark.slow  # over a second each: the fast loop leaves it to CI
@pytest.mark.parametrize("command", BODIES)
def test_whatever_the_plain_path_reads_typer_reads_the_same(command):
    @settings(max_examples=300, deadline=None, database=None)
    @given(lines(command))
    def check(argv):
        got = read(command, argv)
        if got is not None:
            assert got == typer_reading(command, argv), argv
    check()
