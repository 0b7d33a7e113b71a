"""The command table behind the CLI's lazy start-up: complete, in help order, and lazy."""

import importlib
import os
import subprocess
import sys
from pathlib import Path

CLI = Path(__file__).resolve().parent.parent / "zplan" / "cli"


def test_the_table_names_every_registered_command_and_its_module():
    from zplan.cli import main
    from zplan.cli.app import app

    for path in sorted(CLI.glob("*_cmd.py")):  # every command module, listed in the table or not
        importlib.import_module(f"zplan.cli.{path.stem}")
    registered = {main.command_name(c): c.callback.__module__ for c in app.registered_commands}
    assert registered == {name: f"zplan.cli.{mod}" for name, mod in main.COMMANDS.items()}


def test_help_lists_every_command_in_the_table_order():
    """In a fresh process, a one-command group built first (recommend's module imported before
    estimate's) leaves the full help in the table's order."""
    code = ("import io, contextlib\n"
            "from zplan.cli.main import run\n"
            "with contextlib.redirect_stdout(io.StringIO()):\n"
            "    assert run(['recommend', '--help']) == 0\n"
            "assert run(['--help']) == 0\n")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                       env={**os.environ, "COLUMNS": "100"})
    assert p.returncode == 0, p.stderr
    from zplan.cli.main import COMMANDS

    listed = p.stdout[p.stdout.index("Commands"):]
    at = [listed.index(f"│ {name} ") for name in COMMANDS]
    assert at == sorted(at), at


def imported_by(argv: list[str]) -> tuple[int, list[str]]:
    """zplan.cli.main.run(argv)'s exit code in a fresh process, and the zplan.cli, typer and
    click modules it imported."""
    code = ("import sys, io, contextlib\n"
            "from zplan.cli.main import run\n"
            "with contextlib.redirect_stdout(io.StringIO()):\n"
            f"    rc = run({argv!r})\n"
            "print(rc, *sorted(m for m in sys.modules if m.startswith(('zplan.cli.', 'typer', 'click'))))\n")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    rc, *mods = p.stdout.split()
    assert rc.isdigit(), p.stderr
    return int(rc), mods


def test_one_command_imports_only_its_own_module():
    rc, mods = imported_by(["detect", "--json"])
    assert rc == 0 and "zplan.cli.launch_cmd" in mods
    for other in ("estimate_cmd", "recommend_cmd", "verify_cmd"):
        assert f"zplan.cli.{other}" not in mods, mods


def test_a_plain_recommend_never_imports_typer():
    rc, mods = imported_by(["recommend", "--model", "tiny", "--gpus", "2", "--top", "1"])
    assert rc == 0 and "zplan.cli.recommend_body" in mods
    assert not [m for m in mods if m.split(".")[0] in ("typer", "click")], mods
    rc, mods = imported_by(["recommend", "--model", "tiny", "--gpus", "2", "--top", "01"])  # Typer's
    assert rc == 0 and "typer" in mods and "zplan.cli.recommend_cmd" in mods


def test_a_plain_estimate_never_imports_typer():
    rc, mods = imported_by(["estimate", "--model", "tiny", "--gpus", "2", "--strategy", "zero3"])
    assert rc == 0 and "zplan.cli.estimate_fast" in mods
    assert not [m for m in mods if m.split(".")[0] in ("typer", "click")], mods
    rc, mods = imported_by(["estimate", "--model", "tiny", "--seq-len", "0512"])  # not plain: Typer's
    assert rc == 0 and "typer" in mods and "zplan.cli.estimate_cmd" in mods
