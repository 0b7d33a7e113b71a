"""cuDNN's fused attention (--attention-kernel cudnn), held against the kernel benchmarks its
rates come from (the FA3 paper's cuDNN bars on H100; cudnn-frontend's B200 CSV), and the
trainer's SDPA held to the plan's kernel: what torch's backend flags and priority order are
inside each attention call, checked on CPU (the flags are the same on a GPU)."""

import pytest
import torch

from zplan import kernels as K
from zplan import presets
from zplan.plan import make_plan, trainer_refusal
from tests.helpers import cli, fake_attention_rates, gemma_head_dim_256_config, scenario

H100, B200 = presets.gpu("h100-sxm"), presets.gpu("b200")


def _rate(gpu, seq, backward, kernel, head_dim=128, hidden=4096):
    op = K.attention(gpu, seq, hidden, seq, backward, kernel=kernel, head_dim=head_dim)
    return op.flop / op.seconds


def test_cudnn_on_hopper_runs_at_the_fa3_papers_cudnn_bars_relative_to_fa2():
    """FA3 paper, H100 SXM5, head dim 128, 16k: cuDNN causal forward 539 against FA2's 335;
    backward (no mask) 516 against 322, each with its own causal penalty (539/595, 335/370)."""
    for backward, ratio in ((False, 539 / 335), (True, (516 * 539 / 595) / (322 * 335 / 370))):
        assert _rate(H100, 16384, backward, "cudnn") / _rate(H100, 16384, backward, "flash2") == \
            pytest.approx(ratio, rel=1e-9)
    # the same figures at 2k: 484 vs 298 forward; the ramp is FA2's, the ratio within 3%
    assert _rate(H100, 2048, False, "cudnn") / _rate(H100, 2048, False, "flash2") == \
        pytest.approx(484 / 298, rel=0.03)


def test_cudnn_at_head_dim_64_on_hopper():
    """The same figures at head dim 64: causal forward 388 (against 539 at 128), backward 433
    (against 516); computed on 64, counted on 64."""
    for backward, ratio in ((False, 388 / 539), (True, 433 / 516)):
        at64 = _rate(H100, 16384, backward, "cudnn", head_dim=64, hidden=2048)
        at128 = _rate(H100, 16384, backward, "cudnn", head_dim=128, hidden=2048)
        assert at64 / at128 == pytest.approx(ratio, rel=1e-9)


@pytest.mark.parametrize("seq,fwd,bwd,tol", [(8192, 1171.3e12, 942.5e12, 0.02),
                                             (16384, 1332.4e12, 1074.8e12, 0.02),
                                             (32768, 1419.0e12, 1108.7e12, 0.01),
                                             (65536, 1382.3e12, 1073.1e12, 0.04),
                                             (131072, 1355.4e12, 1047.8e12, 0.07),
                                             (4096, 855.7e12, 701.3e12, 0.12)])
def test_cudnn_on_b200_follows_cudnn_frontends_measured_rates(seq, fwd, bwd, tol):
    """cudnn-frontend bb37575, sdpa_bf16_benchmark_results_NVIDIA_B200.csv, pyt_cudnn rows
    (Llama 3 shapes, causal, head dim 128): forward and backward TFLOP/s as measured."""
    assert _rate(B200, seq, False, "cudnn") == pytest.approx(fwd, rel=tol)
    assert _rate(B200, seq, True, "cudnn") == pytest.approx(bwd, rel=tol)


@pytest.mark.parametrize("model,head_dim", [("gpt2-124m", 64), ("qwen3-8b", 128)])
def test_cudnn_takes_the_head_dims_cudnns_sdpa_takes(model, head_dim):
    """Multiples of 8 up to 128 (PyTorch's check_cudnn_tensor_shapes): priced on the head dim as
    it is, no padding."""
    sc = scenario(model=model, gpus=8, gpu="h100-sxm", attention_kernel="cudnn")
    assert sc.model.head_dim == head_dim and K.padded_head_dim(head_dim, "cudnn") == head_dim


def test_cudnn_is_refused_at_head_dims_cudnns_sdpa_does_not_take(capsys, tmp_path):
    """Gemma's head dim 256 (its config class's default): SDPA would run another kernel than
    the one priced, so it is refused in one line; flash2 plans it."""
    args = ("estimate", "--model", gemma_head_dim_256_config(tmp_path), "--gpus", "8", "--gpu", "h100-sxm")
    r = cli(capsys, *args, "--attention-kernel", "cudnn")
    assert r.returncode == 2 and "--attention-kernel cudnn" in r.stderr and "256" in r.stderr
    assert "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1
    assert cli(capsys, *args).returncode == 0


def test_cudnn_is_refused_where_no_benchmark_gives_its_rates(capsys):
    r = cli(capsys, "estimate", "--model", "llama-3.1-8b", "--gpus", "8", "--gpu", "a100-80gb",
            "--attention-kernel", "cudnn")
    assert r.returncode == 2 and "--attention-kernel cudnn" in r.stderr and "a100-80gb" in r.stderr
    assert "Traceback" not in r.stderr
    ok = cli(capsys, "estimate", "--model", "llama-3.1-8b", "--gpus", "8", "--gpu", "h100-sxm",
             "--attention-kernel", "cudnn")
    assert ok.returncode == 0, ok.stderr


def test_cudnn_makes_an_h100_step_faster_by_the_attention_it_saves():
    """Only attention changes: the step's attention time shrinks by the kernel's ratio and
    nothing else moves."""
    from zplan import unit_ops

    kw = dict(model="llama-3.1-8b", gpus=8, seq_len=8192, layout="torch")
    flash, cudnn = scenario(**kw), scenario(**kw, attention_kernel="cudnn")
    for backward in (False, True):
        a = {o.name.replace("flash", "cuDNN"): o for o in unit_ops.unit_ops(flash, flash.units[1], backward)}
        b = {o.name: o for o in unit_ops.unit_ops(cudnn, cudnn.units[1], backward)}
        assert a.keys() == b.keys()
        for name in a:
            if a[name].kind == "attention":
                assert b[name].seconds < a[name].seconds / 1.5 and b[name].flop == a[name].flop
            else:
                assert b[name].seconds == a[name].seconds


@pytest.mark.parametrize("kernel", ["flash2", "cudnn"])
def test_the_trainer_runs_sdpa_with_the_plans_kernel_first(monkeypatch, kernel):
    """Inside every attention call of the built-in model: flash2 keeps cuDNN's attention out
    (torch 2.5.0, 2.9 and 2.11+ would otherwise run it first on Hopper and Blackwell, where
    the plan priced FlashAttention-2); cudnn puts it first. Checked through torch's own flags
    and priority order, which are what SDPA reads on a GPU; restored after the call."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend

    from zplan.trainer import model as tm

    sc = scenario(model="tiny", gpus=1, gpu="cpu", seq_len=16)
    m = tm.Transformer(sc.model)
    tm.init_weights_(m, 0)
    m.attention_kernel(kernel)
    seen = []
    real = F.scaled_dot_product_attention

    def spy(*a, **k):
        seen.append((torch.backends.cuda.cudnn_sdp_enabled(), torch.backends.cuda.flash_sdp_enabled(),
                     list(torch._C._get_sdp_priority_order())))
        return real(*a, **k)

    monkeypatch.setattr(tm.F, "scaled_dot_product_attention", spy)
    m(torch.randint(0, sc.model.vocab_size, (1, 16)))
    assert len(seen) == sc.model.num_layers
    first = {"flash2": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION}[kernel]
    for cudnn_on, flash_on, order in seen:
        assert cudnn_on == (kernel == "cudnn") and flash_on
        assert order[0] == int(first)
    assert torch.backends.cuda.cudnn_sdp_enabled()  # the context is left


def test_the_trainer_accepts_cudnn_and_refuses_kernels_it_cannot_run():
    sc = scenario(model="llama-3.1-8b", gpus=8, gpu="h100-sxm", layout="torch", attention_kernel="cudnn")
    assert trainer_refusal(make_plan(sc, "zero3", global_batch=8), builtin_model=True) is None
    sc3 = scenario(model="llama-3.1-8b", gpus=8, gpu="h100-sxm", layout="torch", attention_kernel="flash3")
    why = trainer_refusal(make_plan(sc3, "zero3", global_batch=8), builtin_model=True)
    assert why and "flash3" in why and "cudnn" in why


def test_estimate_shows_the_attention_kernel_as_an_assumption():
    """Where torch would run cuDNN's attention by default (Hopper, Blackwell), the assumption
    says so and names the flag; on A100 (no cuDNN rates, SDPA's flash kernel) it does not; a
    cudnn plan states its kernel."""
    from zplan.estimate import assumptions

    h100 = assumptions(scenario(model="llama-3.1-8b", gpus=8, gpu="h100-sxm"))["attention_kernel"]
    assert h100["value"] == "flash2" and "--attention-kernel cudnn" in h100["meaning"]
    assert "1.6x" in h100["meaning"]
    a100 = assumptions(scenario(model="llama-3.1-8b", gpus=8, gpu="a100-80gb"))["attention_kernel"]
    assert "cudnn" not in a100["meaning"]
    own = assumptions(scenario(model="llama-3.1-8b", gpus=8, gpu="b200", attention_kernel="cudnn"))
    assert own["attention_kernel"]["value"] == "cudnn" and "--attention-kernel cudnn" not in own["attention_kernel"]["meaning"]


def test_a_calibrated_cudnn_speed_is_the_presets_own():
    """A preset that zplan calibrate measured (cudnn_attention_speed) prices cuDNN's attention at
    its own ratio over its FlashAttention-2 rates, at every length (FA2's ramp, no published
    peak), and lets a GPU without published figures (A100) plan it."""
    a100 = presets.gpu("a100-80gb")
    mine = a100.model_copy(update={"kernels": a100.kernels.model_copy(update={"cudnn_attention_speed": (1.3, 1.2)})})
    assert K.cudnn_speed(a100) is None and K.cudnn_speed(mine) == (1.3, 1.2, None, None)
    for seq in (2048, 65536):
        for backward, ratio in ((False, 1.3), (True, 1.2)):
            assert _rate(mine, seq, backward, "cudnn") / _rate(mine, seq, backward, "flash2") == \
                pytest.approx(ratio, rel=1e-9)
    b200 = presets.gpu("b200")
    own = b200.model_copy(update={"kernels": b200.kernels.model_copy(update={"cudnn_attention_speed": (3.0, 3.0)})})
    assert _rate(own, 131072, False, "cudnn") / _rate(own, 131072, False, "flash2") == pytest.approx(3.0)


def test_calibrate_measures_cudnn_over_flash_where_sdpa_has_it(monkeypatch):
    """The ratio of the two rates calibrate times at one shape, each under its own backend;
    None on a CPU and where SDPA has no cuDNN kernel ('No available kernel')."""
    from types import SimpleNamespace

    from zplan import calibrate

    gpu = SimpleNamespace(type="cuda")
    calls = fake_attention_rates(monkeypatch, calibrate, "cudnn", (500e12, 400e12), (300e12, 250e12))
    assert calibrate.cudnn_attention_speed(gpu) == (round(500 / 300, 3), round(400 / 250, 3))
    assert calls == [True, False]
    assert calibrate.cudnn_attention_speed(torch.device("cpu")) is None

    def none(device, cudnn=False, **kw):
        raise RuntimeError("No available kernel. Aborting execution.")

    monkeypatch.setattr(calibrate, "attention_rates", none)
    assert calibrate.cudnn_attention_speed(gpu) is None

    def refused(device, cudnn=False, **kw):  # cuDNN's own refusal (pytorch#140930)
        raise RuntimeError("cuDNN Frontend error: [cudnn_frontend] Error: No execution plans support the graph.")

    monkeypatch.setattr(calibrate, "attention_rates", refused)
    assert calibrate.cudnn_attention_speed(gpu) is None

    def no_flash(device, cudnn=False, **kw):  # a build with cuDNN's kernel and no flash one
        if cudnn:
            return (500e12, 400e12)
        raise RuntimeError("No available kernel. Aborting execution.")

    monkeypatch.setattr(calibrate, "attention_rates", no_flash)
    assert calibrate.cudnn_attention_speed(gpu) is None

    def oom(device, cudnn=False, **kw):  # anything else is not swallowed
        raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB (cuDNN workspace)")

    monkeypatch.setattr(calibrate, "attention_rates", oom)
    with pytest.raises(RuntimeError, match="out of memory"):
        calibrate.cudnn_attention_speed(gpu)


def test_estimate_suggests_cudnn_only_where_torch_prefers_it_and_it_is_faster():
    """A calibrated A100 (torch never prefers cuDNN there) and a calibrated H100 measured slower
    get no suggestion; a calibrated H100 measured faster is said to be measured at s=4096."""
    from zplan.estimate import assumptions
    from dataclasses import replace

    def with_speed(gpu_name, speed):
        sc = scenario(model="llama-3.1-8b", gpus=8, gpu=gpu_name)
        g = sc.hw.gpu
        g = g.model_copy(update={"kernels": g.kernels.model_copy(update={"cudnn_attention_speed": speed})})
        return replace(sc, hw=sc.hw.model_copy(update={"gpu": g}))

    assert "cudnn" not in assumptions(with_speed("a100-80gb", (1.2, 1.2)))["attention_kernel"]["meaning"]
    assert "cudnn" not in assumptions(with_speed("h100-sxm", (0.9, 0.9)))["attention_kernel"]["meaning"]
    said = assumptions(with_speed("h100-sxm", (1.5, 1.4)))["attention_kernel"]["meaning"]
    assert "1.5x as fast at s=4096 (calibrated)" in said and "--attention-kernel cudnn" in said
