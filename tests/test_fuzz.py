"""Hypothesis fuzzing of every planner command and every input file type, in this process.

600 cases (ZPLAN_FUZZ_CASES to change) of estimate, recommend, explain, export, launch
--dry-run and detect, with hostile flag values, presets, config.json, plans and zplan.toml
(tests/fuzzing.py), each judged by tests/fuzz_oracle.py: exit 0/1/2, one clean error line that
names what was given, strict finite JSON, no hang. The long run is benchmarks/fuzz_cli.py.
"""

import itertools
import os

import pytest
from hypothesis import HealthCheck, given, settings

from tests.fuzz_oracle import problems, run_case
from tests.fuzzing import cases

pytestmark = pytest.mark.slow
CASES = int(os.environ.get("ZPLAN_FUZZ_CASES", "600"))


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("fuzz")
    return (root / str(i) for i in itertools.count())


@settings(max_examples=CASES, deadline=None, database=None, derandomize=True,  # CI: a fixed set; benchmarks/fuzz_cli.py explores
          suppress_health_check=list(HealthCheck))
@given(case=cases())
def test_every_command_answers_cleanly(case, folders):
    rc, out, err, _ = run_case(case, next(folders))
    assert not problems(case, rc, out, err), (case, rc, err[-2000:], out[-500:])
