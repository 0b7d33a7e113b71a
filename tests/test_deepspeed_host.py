"""DeepSpeed ZeRO-3's hooks pace the host (compute._host_paced): each module of the coordinator's
trace costs the host a fixed time per pass, and a unit takes the longer of its kernels and its
hooks. The module count is worked by hand from the model's layout; the premise (the host at most
two fetch events ahead) is read from DeepSpeed itself."""

import inspect

import pytest

from zplan.compute import unit_seconds
from zplan.strategies import effective
from tests.helpers import cli, est, scenario

# a Llama block as DeepSpeed's coordinator traces it: the decoder layer's own module, q, k, v, o,
# gate, up, down and the two RMSNorms (the rotary embedding and the activation hold no parameter)
LLAMA_BLOCK_MODULES = 1 + 7 + 2
TINY = dict(model="llama-3.1-70b", gpus="32", seq_len=512, micro_batch=1, layout="zero")


def _blocks(sc, name):
    fwd, bwd, kinds, _ = unit_seconds(sc, effective(name, sc.train.layout))
    i = next(i for i, u in enumerate(sc.units) if u.blocks)
    return fwd[i], bwd[i], kinds


@pytest.mark.parametrize("ckpt, again", [("none", 0), ("full", 1)])
def test_a_block_takes_the_longer_of_its_kernels_and_its_hooks(ckpt, again):
    off = scenario(**TINY, checkpointing=ckpt, deepspeed_hook_forward_ms=0, deepspeed_hook_backward_ms=0)
    f0, b0, k0 = _blocks(off, "zero3")
    assert "host" not in k0
    fwd_ms, bwd_ms = 0.5, 1.5  # each alone more than the block's kernels at 512 tokens
    on = scenario(**TINY, checkpointing=ckpt, deepspeed_hook_forward_ms=fwd_ms, deepspeed_hook_backward_ms=bwd_ms)
    f, b, k = _blocks(on, "zero3")
    host_f = LLAMA_BLOCK_MODULES * fwd_ms / 1e3
    host_b = LLAMA_BLOCK_MODULES * (bwd_ms + again * fwd_ms) / 1e3
    assert host_f > f0 and host_b > b0  # the case is host-bound, as meant
    assert f == pytest.approx(host_f) and b == pytest.approx(host_b)
    # the kernels' own kinds are unchanged; the wait is a kind of its own
    assert {n: v for n, v in k.items() if n != "host"} == pytest.approx(k0)
    assert k["host"] > 0


def test_kernels_longer_than_the_hooks_hide_them():
    """At 8192 tokens a 70B block's kernels outlast its hooks: nothing changes."""
    kw = dict(TINY, seq_len=8192, checkpointing="full")
    off = est("zero3", **kw, deepspeed_hook_forward_ms=0, deepspeed_hook_backward_ms=0)
    on = est("zero3", **kw)
    assert on.timing.step_s == off.timing.step_s
    assert "host" not in on.timing.breakdown_s


@pytest.mark.parametrize("name, layout", [("zero3", "torch"), ("zero2", "zero"), ("zero1", "zero"), ("ddp", "torch")])
def test_only_deepspeed_zero3_is_paced_by_module_hooks(name, layout):
    kw = dict(TINY, layout=layout, checkpointing="full")
    slow = est(name, **kw, deepspeed_hook_forward_ms=50, deepspeed_hook_backward_ms=50)
    assert slow.timing.step_s == est(name, **kw).timing.step_s


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
    the oldest fetch event once more than two are outstanding."""
    pytest.importorskip("deepspeed")
    from deepspeed.runtime.zero import partitioned_param_coordinator as ppc

    source = inspect.getsource(ppc)  # fetch_sub_module is wrapped (instrument_w_nvtx): the module's text
    assert "self.__max_ongoing_fetch_events: int = 2" in source
    fetch = source[source.index("def fetch_sub_module"):source.index("def release_sub_module")]
    assert "if len(self.__ongoing_fetch_events) > self.__max_ongoing_fetch_events:" in fetch
    assert "self.__ongoing_fetch_events.popleft().synchronize()" in fetch
