"""Builders for scenarios in tests, through the same path as the CLI."""

from zplan.scenario_options import ScenarioOptions, build
from zplan.estimate import estimate_one


def scenario(**kw):
    return build(ScenarioOptions(**kw))


def est(name: str, **kw):
    return estimate_one(scenario(**kw), name)


def cli(capsys, *args: str):
    """zplan's CLI in this process, through the same error boundary as the console script."""
    from types import SimpleNamespace

    from zplan.cli.main import run

    capsys.readouterr()
    rc = run(list(args))
    out = capsys.readouterr()
    return SimpleNamespace(returncode=rc, stdout=out.out, stderr=out.err)
