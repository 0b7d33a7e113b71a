"""estimate's plain path (zplan/cli/estimate_fast.py) against Typer's own reading of the line."""

from unittest import mock

from hypothesis import given, settings
from hypothesis import strategies as st

from tests.fuzzing import HOSTILE_TEXT
from zplan.cli import estimate_fast
from zplan.cli.estimate_fast import flags, parse


def typer_reading(argv: list[str]):
    """(opts, keywords) Typer calls estimate's body with, or the exception it raises first."""
    from zplan.cli.main import _command

    seen = []
    with mock.patch.object(estimate_fast, "run", lambda opts, **kw: seen.append((opts, kw))):
        try:
            _command("estimate")(args=["estimate", *argv], standalone_mode=False, prog_name="zplan")
        except Exception as e:  # noqa: BLE001  (Typer's usage errors and the like)
            return e
    return seen[0]


def test_the_flag_table_is_the_typer_commands():
    from zplan.cli.main import _command

    click_cmd = _command("estimate").commands["estimate"]
    want = {}
    for p in click_cmd.params:
        if p.name == "help":
            continue
        for opt in p.opts:
            want[opt] = (p.name, True if p.is_flag else "many" if p.multiple else
                         _plain(p.type_descriptor.annotation))
        for opt in p.secondary_opts:
            want[opt] = (p.name, False)
    assert flags() == want


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


def test_plain_lines_are_read_as_typer_reads_them():
    for argv in EXAMPLES:
        got = parse(argv)
        assert got is not None, argv
        assert got == typer_reading(argv), argv


def test_lines_that_need_typer_are_left_to_it():
    for argv in (["--help"], ["--gpus"], ["--json=1"], ["--seq-len", "08"], ["--seq-len", "1_000"],
                 ["--seq-len", "2.5"], ["--efficiency", "1e999"], ["--efficiency", "nan"],
                 ["--gpus", "-3"], ["--model", "--json"],
                 ["--no-such-flag"], ["word"], ["--", "--json"], ["--model", "a\nb"],
                 ["--model", "\udcff"], ["--no-json"]):
        assert parse(argv) is None, argv


values = (st.sampled_from(HOSTILE_TEXT) | st.integers(-10**20, 10**20).map(str)
          | st.floats().map(repr) | st.text(max_size=6)
          | st.sampled_from(["8", "08", "1.5", "2e3", "zero3", "GiB", "llama-3.1-8b", "full", "bf16"]))
ODD = ["--help", "--", "-x", "--json=1", "word", "--no-json", "--gpu"]


@st.composite
def lines(draw):
    """Mostly well-formed lines of estimate's flags, with hostile values and stray words."""
    table = flags()
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


@settings(max_examples=400, deadline=None, database=None)
@given(lines())
def test_whatever_the_plain_path_reads_typer_reads_the_same(argv):
    got = parse(argv)
    if got is not None:
        assert got == typer_reading(argv), argv
