"""Builders for scenarios in tests, through the same path as the CLI."""

from zplan.scenario_options import ScenarioOptions, build
from zplan.estimate import estimate_one


def scenario(**kw):
    return build(ScenarioOptions(**kw))


def est(name: str, **kw):
    return estimate_one(scenario(**kw), name)
