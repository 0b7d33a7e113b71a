"""estimate.fits, the memory-only check fit_hints and smallest_n use, against the full estimate."""

from dataclasses import replace

import pytest

from zplan.estimate import estimate_one, fits, smallest_n
from zplan.scenario_options import ScenarioOptions, build
from zplan.strategies import STRATEGIES


@pytest.mark.parametrize("opts", [
    dict(model="llama-3.1-70b", gpus="64"),
    dict(model="llama-3.1-70b", gpus="64", checkpointing="full"),
    dict(model="llama-3.1-405b", gpus="16", layout="torch"),
    dict(model="mixtral-8x7b", gpus="12", micro_batch=4, seq_len=8192),
    dict(params="1e12", gpus="512", checkpointing="full", cluster="dgx-a100"),
])
def test_fits_agrees_with_the_full_estimate(opts):
    sc = build(ScenarioOptions(**opts))
    answers = {name: fits(sc, name) for name in STRATEGIES}
    assert answers == {name: estimate_one(sc, name).fits for name in STRATEGIES}


def test_smallest_n_is_the_first_doubling_at_which_zero3_fits():
    sc = build(ScenarioOptions(model="llama-3.1-405b", gpus="8", checkpointing="full"))
    n = smallest_n(sc, sc.train)
    assert n is not None and n > 8 and n & (n - 1) == 0
    at = lambda k: estimate_one(replace(sc, hw=sc.hw.model_copy(update={"num_gpus": k})), "zero3")  # noqa: E731
    assert at(n).fits and not at(n // 2).fits


@pytest.mark.parametrize("opts", [
    dict(params="70e9", gpus="64"),  # fits at 64 with full checkpointing: no --gpus hint for it
    dict(model="llama-3.1-405b", gpus="8"),  # needs more GPUs even with full checkpointing
])
def test_fit_hints_name_the_smallest_gpu_count(opts):
    import re

    from zplan.estimate import estimate, fit_hints

    sc = build(ScenarioOptions(**opts))
    hints = fit_hints(sc, estimate(sc))
    full = sc.train.model_copy(update={"checkpointing": "full"})
    at = lambda k, t: fits(replace(sc, hw=sc.hw.model_copy(update={"num_gpus": k}), train=t), "zero3")  # noqa: E731
    m = re.search(r"zero3 fits on --gpus (\d+)( --checkpointing full)?", hints)
    if at(sc.n, full):
        assert "--checkpointing full makes it fit" in hints and not (m and m.group(2)), hints
        return
    assert m, hints
    n, train = int(m.group(1)), full if m.group(2) else sc.train
    assert at(n, train) and (n // 2 == sc.n or not at(n // 2, train)), hints


def test_fit_hint_counts_n_itself_when_the_strategies_left_zero3_out():
    """--strategy ddp on 16 A100-40GB: nothing fits, but zero3 fits at 16 already; the hint said 32."""
    from zplan.estimate import estimate, fit_hints

    sc = build(ScenarioOptions(model="llama-3.1-8b", gpus="16", gpu="a100-40gb", cluster="dgx-a100"))
    assert fits(sc, "zero3") and not fits(sc, "ddp")
    hints = fit_hints(sc, estimate(sc, ["ddp"]))
    assert "zero3 fits on --gpus 32" not in hints and "zero3 fits on these GPUs (--strategy zero3)" in hints
