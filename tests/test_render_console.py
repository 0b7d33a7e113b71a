"""The console the tables print through: highlighting is off only where it cannot show."""

import io

from rich.console import Console

from zplan.cli import render
from zplan.estimate import assumptions, estimate
from zplan.scenario_options import ScenarioOptions, build


def printed(monkeypatch, make) -> str:
    out = io.StringIO()
    monkeypatch.setattr("sys.stdout", out)
    monkeypatch.setattr(render, "make_console", make)
    sc = build(ScenarioOptions(model="mixtral-8x7b", gpus="16", checkpointing="selective"))
    render.print_estimate(sc, estimate(sc), assumptions(sc), "GiB", wide=True)
    return out.getvalue()


def test_piped_tables_are_the_same_as_rich_prints_them(monkeypatch):
    monkeypatch.delenv("FORCE_COLOR", raising=False)
    monkeypatch.delenv("TTY_COMPATIBLE", raising=False)
    fast = printed(monkeypatch, render.make_console)
    full = printed(monkeypatch, lambda: RichFull(render.console_width()))
    assert fast == full and "Memory per GPU" in fast


class RichFull(render.Out):
    """Every print through a rich Console with its highlighter on, as before textout."""

    def print(self, item):
        c = Console(width=self.width)
        c.print(item.to_rich() if isinstance(item, render.TableSpec) else item)


def test_a_colour_console_keeps_its_highlighter(monkeypatch):
    monkeypatch.setenv("FORCE_COLOR", "1")
    made = render.make_console()
    assert made.terminal and made.rich().color_system is not None and made.rich()._highlight is True


def test_a_piped_console_through_rich_leaves_the_highlighter_off(monkeypatch):
    monkeypatch.delenv("FORCE_COLOR", raising=False)
    monkeypatch.delenv("TTY_COMPATIBLE", raising=False)
    made = render.make_console()
    assert not made.terminal and made.rich().color_system is None and made.rich()._highlight is False


def test_names_are_printed_as_written_not_as_emoji(monkeypatch, tmp_path):
    """rich would replace `:fire:` in a model's name by the emoji; the console never does."""
    f = tmp_path / "fire.toml"
    f.write_text('name = "x:fire:"\nnum_layers = 2\nhidden = 256\nffn_hidden = 704\nnum_heads = 4\n'
                 'num_kv_heads = 2\nvocab_size = 1000\n')
    out = io.StringIO()
    monkeypatch.setattr("sys.stdout", out)
    sc = build(ScenarioOptions(model=str(f), gpus="8"))
    render.print_estimate(sc, estimate(sc), assumptions(sc), "GB")
    assert "x:fire:" in out.getvalue() and "\N{FIRE}" not in out.getvalue()
