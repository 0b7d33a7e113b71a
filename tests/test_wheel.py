"""A non-editable install of the wheel still finds every preset."""

import os
import subprocess
import sys

import pytest
from pathlib import Path

pytestmark = pytest.mark.slow  # multi-process: torchrun, spawn or a pip build

ROOT = Path(__file__).resolve().parent.parent


def test_wheel_ships_the_presets(tmp_path):
    wheel_dir = tmp_path / "wheel"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                    "-q", "-w", str(wheel_dir), str(ROOT)], check=True, timeout=300,
                   capture_output=True)
    wheel = next(wheel_dir.glob("zplan-*.whl"))
    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target",
                    str(target), str(wheel)], check=True, timeout=300, capture_output=True)
    code = ("import zplan, zplan.presets as p\n"
            "print(zplan.__file__)\n"
            "print(len(p.names('gpus')), len(p.names('clusters')), len(p.names('models')))\n"
            "print(p.model('llama-3.1-8b').name)\n"
            "from zplan import public_accuracy as a\n"
            "print(a.for_gpu('h100-sxm')['scope'])\n")
    env = dict(os.environ, PYTHONPATH=str(target))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                         cwd=tmp_path, timeout=60)
    assert out.returncode == 0, out.stderr
    path, counts, name, scope = out.stdout.strip().splitlines()
    assert scope == "h100-sxm"  # the public set's summary ships beside the presets
    assert path.startswith(str(target)), path  # the installed copy, not the source tree
    gpus, clusters, models = map(int, counts.split())
    assert gpus >= 9 and clusters >= 5 and models >= 12
    assert name == "llama-3.1-8b"
