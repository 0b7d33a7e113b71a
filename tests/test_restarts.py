"""Restarts that work: kill -9 of one rank at a random step under --max-restarts; the run
restarts (a fresh torchrun, a fresh rendezvous), resumes from the newest complete checkpoint on
its own, and with --deterministic ends bit for bit where an uninterrupted run ends."""

import json
import os
import random
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.test_trainer import make_plan

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

STEPS, SAVE_EVERY = 6, 2


def _launch(run_zplan, plan, run_dir, env=None, restarts=0):
    p = run_zplan("launch", "--plan", str(plan), "--run-dir", str(run_dir), "--steps", str(STEPS),
                  "--save-every", str(SAVE_EVERY), "--max-restarts", str(restarts), "--",
                  "--deterministic", "--no-memory", env=env, timeout=400)
    return p


def _weights(run_dir, tmp):
    from zplan.trainer.consolidate import consolidate

    out = tmp / f"{Path(run_dir).name}.safetensors"
    consolidate(Path(run_dir) / f"step_{STEPS:08d}", out)
    return load_file(str(out))


def test_kill9_at_random_steps_restarts_and_ends_bit_for_bit(run_zplan, tmp_path):
    make_plan(run_zplan, tmp_path / "p.json", "zero3", 2, 4)
    p = _launch(run_zplan, tmp_path / "p.json", tmp_path / "straight")
    assert p.returncode == 0, p.stderr[-3000:]
    ref = _weights(tmp_path / "straight", tmp_path)
    seed = int.from_bytes(os.urandom(4), "little")
    rng = random.Random(seed)
    # one trial a run (CI time: each is two launches); the step and rank vary from run to run
    trials = [(rng.randrange(1, STEPS), rng.randrange(2))]
    for i, (step, rank) in enumerate(trials):
        run_dir = tmp_path / f"trial{i}"
        p = _launch(run_zplan, tmp_path / "p.json", run_dir, restarts=1,
                    env={"ZPLAN_FAULT_KILL_AT": f"{step}:{rank}"})
        why = f"seed {seed}, rank {rank} killed after step {step}: {p.stderr[-3000:]}"
        assert p.returncode == 0, why
        assert "attempt 1 failed" in p.stderr and "restarting" in p.stderr, why
        report = json.loads((run_dir / "run_report.json").read_text())
        assert report["start_step"] == step // SAVE_EVERY * SAVE_EVERY, why  # the newest complete one
        got = _weights(run_dir, tmp_path)
        assert got.keys() == ref.keys()
        diff = [k for k in ref if not torch.equal(got[k], ref[k])]
        assert not diff, f"{why}: {len(diff)} tensors differ"
