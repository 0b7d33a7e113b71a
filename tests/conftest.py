import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def zplan(*args: str, env: dict | None = None, timeout: float = 60, cwd: str | None = None):
    """Run the real console entry point in a subprocess."""
    e = dict(os.environ)
    e.pop("ZPLAN_DEBUG", None)
    if env:
        e.update(env)
    return subprocess.run(
        [sys.executable, "-m", "zplan", *args], capture_output=True, text=True, env=e,
        timeout=timeout, cwd=cwd,
    )


@pytest.fixture
def run_zplan():
    return zplan
