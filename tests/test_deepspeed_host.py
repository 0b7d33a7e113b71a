"""DeepSpeed ZeRO-3's hooks pace the host (compute.host_seconds, applied in compute.timing): each
module of the coordinator's trace costs the host a fixed time per pass, and a unit takes the
longer of its kernels and its hooks. The module count is worked by hand from the model's layout;
the premise (the host a few fetch events ahead at most) is read from DeepSpeed itself."""

import inspect
import re

import pytest

from zplan.compute import host_seconds
from zplan.strategies import effective
from tests.helpers import cli, est, scenario

# a Llama block as DeepSpeed's coordinator traces it: the decoder layer's own module, q, k, v, o,
# gate, up, down and the two RMSNorms; DeepSpeed hooks Hugging Face's parameterless modules too
# (self_attn, mlp, act_fn), which zplan does not count (docs/formulas.md section 6)
LLAMA_BLOCK_MODULES = 1 + 7 + 2
TINY = dict(model="llama-3.1-70b", gpus="32", seq_len=512, micro_batch=1, layout="zero")


def _hooks(ms_f, ms_b, **kw):
    return dict(TINY, **kw, deepspeed_hook_forward_ms=ms_f, deepspeed_hook_backward_ms=ms_b)


@pytest.mark.parametrize("ckpt, extra, again", [("none", {}, 0), ("full", {}, 10),
                                                 # two blocks a unit, one of them checkpointed
                                                 ("every-k", {"checkpoint_every": 2, "blocks_per_unit": 2}, 10)])
def test_a_units_hooks_by_hand(ckpt, extra, again):
    """Per unit, modules x the figures: a block unit's blocks and their modules with parameters
    (10 a Llama block), the recompute's forward hooks for its checkpointed blocks alone."""
    sc = scenario(**_hooks(0.5, 1.5, checkpointing=ckpt, **extra))
    fwd, bwd = host_seconds(sc, effective("zero3", "zero"))
    i = next(i for i, u in enumerate(sc.units) if u.blocks)
    blocks = sc.units[i].blocks
    assert fwd[i] == pytest.approx(blocks * LLAMA_BLOCK_MODULES * 0.5e-3)
    assert bwd[i] == pytest.approx(blocks * LLAMA_BLOCK_MODULES * 1.5e-3 + again * 0.5e-3)


@pytest.mark.parametrize("ckpt, efficiency", [("none", None), ("full", None), ("full", 0.5)])
def test_hooks_far_longer_than_the_kernels_are_the_step(ckpt, efficiency):
    """With hooks of 50 ms a module every unit waits on them, whatever prices the kernels (the
    kernel model or one efficiency): the step's compute is the hooks' sum, counted here by hand
    (the embedding 1 module, 80 blocks of 10, the final norm and head 2). On one GPU, where no
    slowest rank of several paces the kernels (timing's slowest_rank_s, kept apart)."""
    kw = _hooks(50, 50, checkpointing=ckpt, gpus="1")
    if efficiency:
        kw["efficiency"] = efficiency
    t = est("zero3", **kw).timing
    modules = 1 + 80 * LLAMA_BLOCK_MODULES + 2
    recomputed = 80 * LLAMA_BLOCK_MODULES if ckpt == "full" else 0
    assert t.compute_s == pytest.approx((2 * modules + recomputed) * 50e-3)
    assert t.breakdown_s["host"] > 0.9 * t.compute_s


def test_the_wait_is_the_hooks_beyond_the_kernels():
    """At 512 tokens a 70B block's hooks at 0.4 and 0.8 ms a module outlast its kernels: the
    step's compute grows by exactly the wait explain reports, the kernels' own kinds unchanged."""
    off = est("zero3", **_hooks(0, 0, checkpointing="full")).timing
    on = est("zero3", **_hooks(0.4, 0.8, checkpointing="full")).timing
    assert "host" not in off.breakdown_s and on.breakdown_s["host"] > 0
    assert on.compute_s == pytest.approx(off.compute_s + on.breakdown_s["host"])
    kinds = {k: v for k, v in on.breakdown_s.items() if k not in ("host", "contention", "slowest_rank")}
    assert kinds == pytest.approx({k: v for k, v in off.breakdown_s.items()
                                   if k not in ("contention", "slowest_rank")})


def test_kernels_longer_than_the_hooks_hide_them():
    """At 8192 tokens a 70B block's kernels outlast its hooks: nothing changes."""
    kw = dict(TINY, seq_len=8192, checkpointing="full")
    off = est("zero3", **kw, deepspeed_hook_forward_ms=0, deepspeed_hook_backward_ms=0)
    on = est("zero3", **kw)
    assert on.timing.step_s == off.timing.step_s
    assert "host" not in on.timing.breakdown_s


@pytest.mark.parametrize("name, layout, paced", [
    ("zero3", "torch", False), ("hsdp", "torch", False), ("ddp", "torch", False), ("zero2", "zero", False),
    ("zero1", "zero", False), ("zero3", "zero", True), ("zero3-noreshard", "zero", True), ("hsdp", "zero", True),
    ("offload-opt", "zero", True)])
def test_only_deepspeed_zero3_is_paced_by_module_hooks(name, layout, paced):
    """DeepSpeed's ZeRO-3 in every form (its MiCS and offload too) fetches module by module;
    FSDP (the torch layout), DDP and ZeRO-1/2 do not."""
    kw = dict(TINY, layout=layout, checkpointing="full")
    slow = est(name, **kw, deepspeed_hook_forward_ms=50, deepspeed_hook_backward_ms=50)
    assert (slow.timing.step_s > est(name, **kw).timing.step_s) == paced


def test_the_hooks_are_flags_and_a_bad_value_is_one_line(capsys):
    base = est("zero3", **TINY, checkpointing="full")
    slower = est("zero3", **TINY, checkpointing="full", deepspeed_hook_forward_ms=2, deepspeed_hook_backward_ms=4)
    assert slower.timing.step_s > base.timing.step_s
    r = cli(capsys, "estimate", "--model", "llama-3.1-8b", "--gpus", "8", "--layout", "zero",
            "--deepspeed-hook-forward-ms", "-1")
    assert r.returncode == 2 and "--deepspeed-hook-forward-ms" in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    r = cli(capsys, "explain", "--model", "llama-3.1-70b", "--gpus", "32", "--seq-len", "512",
            "--layout", "zero", "--strategy", "zero3", "--checkpointing", "full")
    assert r.returncode == 0 and "DeepSpeed ZeRO-3's hooks on the host: unit blocks.0's 10 modules" in r.stdout


def test_deepspeed_lets_the_host_run_two_fetch_events_ahead():
    """The premise, read from the installed DeepSpeed: the coordinator synchronizes the host on
    the oldest fetch event once more than two are outstanding (three ahead at most)."""
    pytest.importorskip("deepspeed")
    from deepspeed.runtime.zero import partitioned_param_coordinator as ppc

    source = inspect.getsource(ppc)  # fetch_sub_module is wrapped (instrument_w_nvtx): the module's text
    assert re.search(r"self\.__max_ongoing_fetch_events(: int)? = 2\b", source)
    fetch = source[source.index("def fetch_sub_module"):source.index("def release_sub_module")]
    assert re.search(r"len\(self\.__ongoing_fetch_events\) > self\.__max_ongoing_fetch_events", fetch)
    assert "self.__ongoing_fetch_events.popleft().synchronize()" in fetch
