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


@pytest.mark.parametrize("layout, fragmentation", [("torch", None), ("zero", None), ("torch", 0.0)])
def test_within_a_usable_size_fits_answers_what_the_whole_memory_model_does(layout, fragmentation):
    """recommend's fit test (a usable size given) answers no from the allocated peak alone where
    that is over: the same answer as the full model (reserve, allocator, context) on a grid of
    micro-batches, checkpointing and strategies, at usable sizes around each one's own allocated
    peak and total (a flat --fragmentation of 0 makes them meet)."""
    from zplan.estimate import _fits, unavailable_reason
    from zplan.memory import memory
    from zplan.strategies import effective

    base = build(ScenarioOptions(model="llama-3.1-8b", gpus="16", seq_len=4096, layout=layout,
                                 fragmentation=fragmentation))
    seen = set()
    for mb in (1, 2, 4, 8):
        for ckpt in ("none", "selective", "full"):
            sc = replace(base, train=base.train.model_copy(update={"micro_batch": mb, "checkpointing": ckpt}))
            for name in STRATEGIES:
                m = memory(sc, effective(name, layout))
                context = sc.assume.cuda_context_bytes
                between = (m.allocated_bytes + context + m.total_bytes) // 2  # reserve over, allocated not
                for usable in (m.allocated_bytes, m.allocated_bytes + context - 1, m.allocated_bytes + context,
                               between, m.total_bytes - 1, m.total_bytes, 2 * m.total_bytes):
                    got = fits(sc, name, usable)
                    assert got == (not unavailable_reason(sc, name) and _fits(sc, m, usable)[0]), (mb, ckpt, name, usable)
                    seen.add(got)
    assert seen == {True, False}


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
    """--strategy ddp on 32 A100-40GB: nothing fits, but zero3 fits at 32 already; the hint said 64."""
    from zplan.estimate import estimate, fit_hints

    sc = build(ScenarioOptions(model="llama-3.1-8b", gpus="32", gpu="a100-40gb", cluster="dgx-a100"))
    assert fits(sc, "zero3") and not fits(sc, "ddp")
    hints = fit_hints(sc, estimate(sc, ["ddp"]))
    assert "zero3 fits on --gpus 64" not in hints and "zero3 fits on these GPUs (--strategy zero3)" in hints


def test_tight_is_a_fit_within_recommends_headroom_of_the_limit(run_zplan):
    """Llama 3.1 8B on 8 H100 at seq 4096: micro-batch 1 leaves ~40% free, micro-batch 2 fits with
    ~6% free (tight: inside the memory model's 10% error, where the allocator's retries start),
    micro-batch 3 does not fit. `tight` is exactly "fits, but not within recommend's headroom"."""
    import json

    from zplan.estimate import TIGHT_FREE_FRACTION, fits as fits_in

    verdicts = {}
    for mb in (1, 2, 3):
        sc = build(ScenarioOptions(model="llama-3.1-8b", gpus="8", seq_len=4096, micro_batch=mb))
        r = estimate_one(sc, "zero3")
        cap = sc.hw.gpu.memory_bytes
        usable = int(cap * (1 - TIGHT_FREE_FRACTION))
        assert r.tight == (r.fits and not fits_in(sc, "zero3", usable))
        assert r.tight == (r.fits and r.memory.total_bytes > cap - TIGHT_FREE_FRACTION * cap)
        verdicts[mb] = "tight" if r.tight else ("yes" if r.fits else "no")
    assert verdicts == {1: "yes", 2: "tight", 3: "no"}
    args = ("estimate", "--model", "llama-3.1-8b", "--seq-len", "4096", "--strategy", "zero3")
    p = run_zplan(*args, "--micro-batch", "2", env={"COLUMNS": "100"})  # the narrow table's width
    assert p.returncode == 0, p.stderr
    row = [x for x in p.stdout.splitlines() if x.startswith("zero3 ")][0]
    assert row.split()[-3] == "tight"  # ... total, fits, headroom ("5.25 GB")
    assert "tight: zero3 fits with under 10% of the GPU free" in " ".join(p.stdout.split())
    j = json.loads(run_zplan(*args, "--micro-batch", "2", "--json").stdout)
    assert [s["tight"] for s in j["strategies"]] == [True]
    j = json.loads(run_zplan(*args, "--micro-batch", "1", "--json").stdout)
    assert [(s["fits"], s["tight"]) for s in j["strategies"]] == [(True, False)]


def test_explain_says_tight(run_zplan):
    p = run_zplan("explain", "--model", "llama-3.1-8b", "--seq-len", "4096", "--micro-batch", "2",
                  "--strategy", "zero3")
    assert p.returncode == 0, p.stderr
    assert ": fits (tight: under 10% free" in p.stdout
    p = run_zplan("explain", "--model", "llama-3.1-8b", "--seq-len", "4096", "--strategy", "zero3")
    assert ": fits\n" in p.stdout


def test_recommends_default_headroom_is_the_tight_fraction():
    """One figure: what estimate calls tight is what recommend keeps free by default (the CLI's
    defaults are literals so that `zplan --help` does not import the planner)."""
    import inspect

    from zplan import recommend
    from zplan.cli import recommend_body, recommend_cmd
    from zplan.estimate import TIGHT_FREE_FRACTION

    assert inspect.signature(recommend.search).parameters["headroom"].default == TIGHT_FREE_FRACTION
    assert inspect.signature(recommend_body.run).parameters["headroom"].default == TIGHT_FREE_FRACTION
    assert inspect.signature(recommend_cmd.recommend).parameters["headroom"].default == TIGHT_FREE_FRACTION


@pytest.mark.parametrize("opts", [
    dict(model="llama-3.1-8b", gpus="8", seq_len=4096, micro_batch=2, layout="torch"),
    dict(model="llama-3.1-70b", gpus="16", seq_len=4096, checkpointing="full"),
    dict(params="1e12", gpus="64", checkpointing="full", cluster="dgx-a100"),
])
def test_tight_only_where_it_fits_and_with_under_a_tenth_free(opts):
    """Every strategy, unavailable ones (offload-opt under the torch layout) and those whose host
    memory does not fit included: tight implies fits, and is the headroom under 10% of the GPU."""
    from zplan.estimate import TIGHT_FREE_FRACTION

    sc = build(ScenarioOptions(**opts))
    cap = sc.hw.gpu.memory_bytes
    for name in STRATEGIES:
        r = estimate_one(sc, name)
        if r.memory is None:
            assert not r.tight and "tight" not in r.as_dict()
            continue
        assert r.tight == (r.fits and cap - r.memory.total_bytes < TIGHT_FREE_FRACTION * cap)
        assert r.as_dict()["tight"] == r.tight


@pytest.mark.slow  # over a second each: the fast loop leaves it to CI
def test_recommend_under_a_smaller_headroom_says_its_pick_is_tight(run_zplan):
    """--headroom 0.02 lets recommend pick a configuration estimate would call tight: it says so,
    in the text and in the JSON's winner; at the default headroom the winner never is."""
    import json

    args = ("recommend", "--model", "llama-3.1-8b", "--gpus", "8")
    p = run_zplan(*args, "--headroom", "0.02", "--json")
    w = json.loads(p.stdout)["winner"]
    assert w["tight"] and w["fits"]
    text = " ".join(run_zplan(*args, "--headroom", "0.02").stdout.split())  # however it wraps
    assert "tight (under 10% free, by --headroom" in text
    w = json.loads(run_zplan(*args, "--json").stdout)["winner"]
    assert w["fits"] and not w["tight"]


def test_a_fit_that_needs_the_allocator_to_release_free_segments_is_tight_and_not_recommended():
    """Llama 3.1 405B at seq 8192 on 1024 H100 (zero3, torch layout, full checkpointing): the
    reserve (98.9 GB with the CUDA context) exceeds the GPU, but 15.7 GB of it are segments wholly
    free at the peak (the last checkpointed block's freed working set and its unit's freed
    weights, all-gather segments beyond the stream's packed peak), which the allocator releases
    and retries before failing. estimate:
    fits, tight, headroom below zero; within recommend's capacity (even the whole GPU as usable)
    the whole reserve must fit: not."""
    sc = build(ScenarioOptions(model="llama-3.1-405b", gpus="1024", seq_len=8192, checkpointing="full",
                               layout="torch"))
    r = estimate_one(sc, "zero3")
    gpu = sc.hw.gpu.memory_bytes
    m = r.memory
    assert m.total_bytes > gpu >= m.total_bytes - m.releasable_bytes and m.releasable_bytes > 0
    assert r.fits and r.tight and r.headroom_bytes == gpu - m.total_bytes < 0
    assert fits(sc, "zero3") and not fits(sc, "zero3", gpu)
    # expandable segments: the forward's freed blocks are the one segment's, which the loss extends
    exp = build(ScenarioOptions(model="llama-3.1-405b", gpus="1024", seq_len=8192, checkpointing="full",
                                layout="torch", expandable_segments=True))
    assert estimate_one(exp, "zero3").memory.releasable_bytes < m.releasable_bytes


def test_fit_margin_is_the_need_over_the_limit_and_agrees_with_fits():
    """estimate.fit_margin, which recommend's least first-k aims with: its answer is fits', its
    margin the steady need (Memory.steady_bytes, the full model) less the usable size, so it
    moves byte for byte with the limit; where the allocated peak alone is over (no allocator
    model run) the allocated peak and context less the limit, never above the full margin; on
    the whole GPU (no usable size) the need less the reserve a failed cudaMalloc releases
    against its memory."""
    from zplan.estimate import fit_margin
    from zplan.memory import memory
    from zplan.strategies import effective

    base = build(ScenarioOptions(model="llama-3.1-8b", gpus="8", seq_len=8192, layout="torch"))
    for ckpt in ("none", "full"):
        sc = replace(base, train=base.train.model_copy(update={"checkpointing": ckpt}))
        for name in ("zero2", "zero3"):
            m = memory(sc, effective(name, "torch"))
            context = sc.assume.cuda_context_bytes
            for usable in (m.allocated_bytes // 2, m.allocated_bytes + context, m.steady_bytes - 1,
                           m.steady_bytes, m.steady_bytes + 10**9):
                ok, over = fit_margin(sc, name, usable)
                assert ok == fits(sc, name, usable) == (over <= 0)
                if m.allocated_bytes + context > usable:
                    assert over == m.allocated_bytes + context - usable <= m.steady_bytes - usable
                else:
                    assert over == m.steady_bytes - usable
            ok, over = fit_margin(sc, name)
            assert ok == fits(sc, name) and over == m.total_bytes - m.releasable_bytes - sc.hw.gpu.memory_bytes
    # FSDP2 offloads parameters and optimizer together: optimizer-only offload cannot run, no margin
    assert fit_margin(base, "offload-opt", 10**12) == (False, None)
