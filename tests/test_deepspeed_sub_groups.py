"""DeepSpeed ZeRO-3's optimizer sub-groups (--deepspeed-sub-group, its config's sub_group_size):
the step makes one sub-group's fp32 gradient at a time, so the largest sub-group sizes the step's
temporaries. Held against DeepSpeed's own grouping function."""

from types import SimpleNamespace

import pytest

from tests.helpers import cli, scenario
from zplan.memory import deepspeed_sub_groups_largest


@pytest.mark.parametrize("parts, group", [
    ([5, 5, 5, 5], 7), ([5, 5, 5, 5], 10), ([5, 5, 5, 5], 100), ([3, 9, 1, 1, 1, 8], 4),
    ([100, 1, 1, 1], 2), ([1] * 50, 7), ([32_800_000] + [7_340_032] * 40 + [32_800_000], 100_000_000)])
def test_the_largest_sub_group_is_deepspeeds(parts, group):
    """DeepSpeed's _create_fp16_sub_groups (stage3.py, the installed release) over parameters of
    these partition sizes: its largest sub-group's elements are zplan's."""
    stage3 = pytest.importorskip("deepspeed.runtime.zero.stage3")
    params = [SimpleNamespace(partition_numel=lambda n=n: n) for n in parts]
    groups = stage3.DeepSpeedZeroOptimizer_Stage3._create_fp16_sub_groups(SimpleNamespace(sub_group_size=group), params)
    assert deepspeed_sub_groups_largest(parts, group) == max(sum(p.partition_numel() for p in g) for g in groups)


def test_the_step_makes_one_sub_groups_fp32_gradient():
    """Llama 3.1 70B on 32 ranks, ZeRO-3: the rank's 2.2e9 elements in sub-groups of about 1e8
    (the DeepCompile artifact's setting) make 6 B an element of the largest (bf16 flat and its fp32
    copy) at the step, where DeepSpeed's default 1e9 makes about ten times that."""
    import math

    from zplan.memory import timeline
    from zplan.strategies import effective

    kw = dict(model="llama-3.1-70b", gpus=32, seq_len=512, checkpointing="full", deepspeed_defaults=True)

    def at_step(**extra) -> int:
        events = timeline(scenario(**kw, **extra), effective("zero3", "zero"))
        return next(e for e in events if e.label == "optimizer step").live["step_temps"]

    small, default = at_step(deepspeed_sub_group=100_000_000), at_step()
    parts = [-(-math.prod(s) // 32) for u in scenario(**kw).units for s in u.shapes]
    assert small == 6 * deepspeed_sub_groups_largest(parts, 100_000_000)
    assert 100_000_000 <= small / 6 < 100_000_000 + max(parts)
    assert default > 9 * small


def test_export_writes_it_and_the_torch_layout_refuses_it(capsys, tmp_path):
    plan = tmp_path / "p.json"
    r = cli(capsys, "recommend", "--model", "llama-3.1-8b", "--gpus", "8", "--for", "deepspeed", "--strategy",
            "zero3", "--deepspeed-sub-group", "100000000", "--write", str(plan))
    assert r.returncode == 0, r.stderr
    r = cli(capsys, "export", "--plan", str(plan), "--to", "deepspeed")
    import json

    assert json.loads(r.stdout)["zero_optimization"]["sub_group_size"] == 100_000_000
    r = cli(capsys, "estimate", "--model", "llama-3.1-8b", "--gpus", "8", "--layout", "torch",
            "--deepspeed-sub-group", "100000000")
    assert r.returncode == 2 and "--deepspeed-sub-group" in r.stderr and len(r.stderr.strip().splitlines()) == 1
