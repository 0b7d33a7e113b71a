"""FlashAttention v1 (--attention-kernel flash1: flash-attn 1.x, PyTorch 2.0-2.1's SDPA flash
backend) and xformers' memory-efficient kernel under an explicit mask (--attention-kernel
efficient: SDPA's efficient backend over Hugging Face's padded batches), held against the chart
their rates come from: the flash-attn repository's forward + backward benchmark (the FA2 paper's
Figures 4 and 7, 16k tokens, hidden 2048), whose labelled bars are typed here."""

import pytest

from zplan import kernels as K
from zplan import presets
from zplan.plan import make_plan, trainer_refusal
from tests.helpers import cli, fake_attention_rates, gemma_head_dim_256_config, scenario

A100, H100 = presets.gpu("a100-80gb"), presets.gpu("h100-sxm")

# (GPU, head dim) -> labelled TFLOP/s at 16k, forward + backward: FA2 causal, FA1 causal,
# xformers without the causal mask (a mask passed as a tensor is not causal to the kernel)
CHART = {
    ("a100", 128): (189, 83, 98), ("a100", 64): (171, 97, 75),
    ("h100", 128): (328, 137, None), ("h100", 64): (284, 156, None),
}


def _fwd_bwd_rate(gpu, kernel, head_dim, seq=16384, hidden=2048):
    """Counted FLOP/s of one forward + backward, as the chart counts them (backward 2.5 x)."""
    f = K.attention(gpu, seq, hidden, seq, False, kernel=kernel, head_dim=head_dim)
    b = K.attention(gpu, seq, hidden, seq, True, kernel=kernel, head_dim=head_dim)
    return (f.flop + b.flop) / (f.seconds + b.seconds)


@pytest.mark.parametrize("gpu,name", [(A100, "a100"), (H100, "h100")])
@pytest.mark.parametrize("head_dim", [128, 64])
def test_flash1_and_xformers_run_at_the_charts_ratio_to_fa2(gpu, name, head_dim):
    """FA1 at its causal bar's ratio to FA2's; masked xformers computes the whole square (twice
    the causal count) at its non-causal bar: per counted FLOP, half that bar over FA2's causal."""
    fa2, fa1, xformers = CHART[(name, head_dim)]
    flash2 = _fwd_bwd_rate(gpu, "flash2", head_dim)
    assert _fwd_bwd_rate(gpu, "flash1", head_dim) / flash2 == pytest.approx(fa1 / fa2, rel=1e-9)
    if xformers is None:  # not charted on H100: A100's ratio is applied
        fa2, _, xformers = CHART[("a100", head_dim)]
    assert _fwd_bwd_rate(gpu, "efficient", head_dim) / flash2 == pytest.approx(xformers / 2 / fa2, rel=1e-9)


def test_between_the_charted_head_dims_the_ratio_is_linear_and_flash1_pads():
    """Head dim 96: FlashAttention v1 runs it on its 128 kernel (flash-attn 1.x's run_fmha_fwd:
    d <= 32, 64, 128), the padding computed but not counted; xformers' cutlass kernel is not padded."""
    assert K.padded_head_dim(96, "flash1") == 128 and K.padded_head_dim(96, "efficient") == 96
    assert K.padded_head_dim(16, "flash1") == 32
    mid = (98 / 378 + 75 / 342) / 2
    assert K.older_kernel_speed("efficient", "a100-80gb", 96) == pytest.approx(mid)
    assert K.older_kernel_speed("flash1", "a100-80gb", 128) == pytest.approx(83 / 189)


def test_flash1_is_refused_over_head_dim_128_and_off_its_gpus(capsys, tmp_path):
    args = ("estimate", "--model", gemma_head_dim_256_config(tmp_path), "--gpus", "8", "--gpu", "a100-80gb")
    r = cli(capsys, *args, "--attention-kernel", "flash1")
    assert r.returncode == 2 and "--attention-kernel flash1" in r.stderr and "256" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.stderr
    assert cli(capsys, *args, "--attention-kernel", "efficient").returncode == 0  # 16 kv heads of 16
    b200 = cli(capsys, "estimate", "--model", "llama-2-7b", "--gpus", "8", "--gpu", "b200",
               "--attention-kernel", "flash1")
    assert b200.returncode == 2 and "b200" in b200.stderr and len(b200.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize("kernel", ["flash1", "efficient"])
def test_grouped_kv_heads_need_the_copies_these_kernels_run_on(capsys, kernel):
    """SDPA's efficient kernel takes no grouped key/value heads and flash-attn 1.x has none: a
    run copies them to the query heads first, which --attention-expands-kv prices; without it
    the plan is refused in one line naming the flag."""
    args = ("estimate", "--model", "llama-3.1-8b", "--gpus", "8", "--gpu", "a100-80gb", "--attention-kernel", kernel)
    r = cli(capsys, *args)
    assert r.returncode == 2 and "--attention-expands-kv" in r.stderr and "32 query heads over 8" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1
    assert cli(capsys, *args, "--attention-expands-kv").returncode == 0


def test_an_older_kernel_makes_the_step_slower_by_its_attention_alone():
    """Only the attention kernels change: every other op of a block is the same."""
    from zplan import unit_ops

    kw = dict(model="llama-2-7b", gpus=8, gpu="a100-80gb", seq_len=8192)
    base = scenario(**kw)
    for kernel in ("flash1", "efficient"):
        other = scenario(**kw, attention_kernel=kernel)
        for backward in (False, True):
            a = unit_ops.unit_ops(base, base.units[1], backward)
            b = unit_ops.unit_ops(other, other.units[1], backward)
            assert len(a) == len(b)
            for x, y in zip(a, b):
                if x.kind == "attention":
                    assert y.kind == "attention" and y.seconds > x.seconds and y.flop == x.flop
                else:
                    assert (y.name, y.seconds) == (x.name, x.seconds)


def test_the_trainer_refuses_both():
    """The trainer's attention is causal SDPA with FlashAttention-2 or cuDNN first: it runs no
    FlashAttention v1 (PyTorch >= 2.2 has none) and passes no mask."""
    kw = dict(model="llama-2-7b", gpus=8, gpu="a100-80gb", layout="torch")
    for kernel in ("flash1", "efficient"):
        why = trainer_refusal(make_plan(scenario(**kw, attention_kernel=kernel), "zero3", global_batch=8),
                              builtin_model=True)
        assert why and kernel in why and "flash2 or cudnn" in why


def test_a_calibrated_masked_speed_is_the_presets_own():
    """A preset that zplan calibrate measured (masked_attention_speed, at head dim 128) prices the
    masked kernel at its own ratio over its FlashAttention-2 rates, the chart's head-dim shape
    kept; flash1 is untouched by it."""
    mine = H100.model_copy(update={"kernels": H100.kernels.model_copy(update={"masked_attention_speed": (0.3, 0.25)})})
    for backward, ratio in ((False, 0.3), (True, 0.25)):
        op = lambda g, kern: K.attention(g, 8192, 4096, 8192, backward, kernel=kern)  # noqa: E731
        assert (op(mine, "efficient").seconds and
                op(mine, "flash2").seconds / op(mine, "efficient").seconds == pytest.approx(ratio, rel=1e-9))
        assert op(mine, "flash1").seconds == op(H100, "flash1").seconds
    at64 = K.attention(mine, 8192, 4096, 8192, False, kernel="efficient", head_dim=64)
    fa2_64 = K.attention(mine, 8192, 4096, 8192, False, kernel="flash2", head_dim=64)
    assert fa2_64.seconds / at64.seconds == pytest.approx(0.3 * (75 / 342) / (98 / 378), rel=1e-9)


def test_calibrate_measures_the_masked_kernel_over_flash(monkeypatch):
    """The ratio of the two rates calibrate times (the masked kernel, then FlashAttention-2);
    None on a CPU and where SDPA has no memory-efficient kernel; an out-of-memory error raised.
    On a CPU the masked timing itself runs (a boolean causal mask tensor, is_causal off)."""
    from types import SimpleNamespace

    import torch

    from zplan import calibrate

    import torch.nn.functional as F

    seen = []
    real = F.scaled_dot_product_attention

    def spy(q, k, v, **kw):
        seen.append(kw)
        return real(q, k, v, **kw)

    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    f, b = calibrate.attention_rates(torch.device("cpu"), seq=64, heads=2, head_dim=16, reps=1, masked=True)
    monkeypatch.setattr(F, "scaled_dot_product_attention", real)
    assert f > 0 and b > 0 and seen
    for kw in seen:  # a boolean lower-triangular mask over (1, 1, s, s), not is_causal
        mask = kw["attn_mask"]
        assert "is_causal" not in kw and mask.dtype == torch.bool and tuple(mask.shape) == (1, 1, 64, 64)
        assert torch.equal(mask[0, 0], torch.ones(64, 64, dtype=torch.bool).tril())
    gpu = SimpleNamespace(type="cuda")
    calls = fake_attention_rates(monkeypatch, calibrate, "masked", (90e12, 60e12), (300e12, 250e12))
    assert calibrate.masked_attention_speed(gpu) == (0.3, 0.24) and calls == [True, False]
    assert calibrate.masked_attention_speed(torch.device("cpu")) is None

    def none(device, masked=False, **kw):
        raise RuntimeError("No available kernel. Aborting execution.")

    monkeypatch.setattr(calibrate, "attention_rates", none)
    assert calibrate.masked_attention_speed(gpu) is None

    def no_flash(device, masked=False, **kw):  # a build with the efficient kernel and no flash one
        if masked:
            return (90e12, 60e12)
        raise RuntimeError("No available kernel. Aborting execution.")

    monkeypatch.setattr(calibrate, "attention_rates", no_flash)
    assert calibrate.masked_attention_speed(gpu) is None

    def oom(device, masked=False, **kw):
        raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")

    monkeypatch.setattr(calibrate, "attention_rates", oom)
    with pytest.raises(RuntimeError, match="out of memory"):
        calibrate.masked_attention_speed(gpu)
