"""The planner's linear loss (--linear-loss), fused SwiGLU and FlashAttention-3, held against
what their sources state: Liger-Kernel's chunk rule (its own worked example), flash-attn's
hopper head-dim rounding, the FA3 paper's bars, and FLOPs that do not change when the head's
matmuls move into the loss. The trainer's chunked loss is held against PyTorch's MemTracker and
FlopCounterMode in tests/test_linear_loss.py."""

import pytest

from zplan import activation_memory as am
from zplan import kernels as K
from zplan import policy, presets, unit_ops
from zplan.errors import UsageError
from zplan.plan import make_plan, trainer_refusal
from tests.helpers import cli, est, scenario

H100 = presets.gpu("h100-sxm")


def test_chunk_rule_reproduces_ligers_worked_example():
    """ops/fused_linear_cross_entropy.py: 'BT = 4096*4, V = 32000, H = 4096 ==> inc_factor = 8,
    chunk_size = 2048'; next_power_of_2 rounds up (16384 / 32 = 512 stays, 8192 / 32 + 1 rows
    go to the next power)."""
    assert policy.loss_chunk_tokens(4096 * 4, 32000, 4096) == 2048
    assert policy.loss_chunk_tokens(8192, 128256, 4096) == 256  # inc = ceil(31.3) = 32
    assert policy.loss_chunk_tokens(8192 + 32, 128256, 4096) == 512
    assert policy.loss_chunk_tokens(1, 10, 10) == 1
    assert policy.loss_chunk_tokens(5, 10, 100) == 5  # inc 1, next_pow2(5) = 8 > T: one chunk of T


def _head_ops(ll: str, backward: bool, **kw):
    sc = scenario(model="llama-3.1-8b", gpus=8, cluster="dgx-h100", seq_len=8192, layout="torch",
                  linear_loss=ll, **kw)
    return unit_ops.unit_ops(sc, sc.units[-1], backward)


@pytest.mark.parametrize("ll", ["chunked", "liger"])
def test_linear_loss_moves_the_heads_gemms_into_the_forward_without_changing_their_flops(ll):
    T, V, h = 8192, 128256, 4096
    plain = sum(o.flop for b in (False, True) for o in _head_ops("none", b) if o.kind == "gemm")
    fwd = sum(o.flop for o in _head_ops(ll, False) if o.kind == "gemm")
    bwd = sum(o.flop for o in _head_ops(ll, True) if o.kind == "gemm")
    assert plain == fwd == 6 * T * V * h
    assert bwd == 0
    # 32 chunks of 256 tokens: each GEMM is launched once per chunk
    assert all(o.kernels == 32 for o in _head_ops(ll, False) if o.kind == "gemm")


def test_linear_loss_backward_only_scales_when_the_loss_was_divided():
    """Liger skips a gradient of 1.0; the trainer's chunked loss always scales."""
    assert not [o for o in _head_ops("liger", True) if "linear loss" in o.name]
    assert [o for o in _head_ops("chunked", True) if "linear loss" in o.name]
    scaled = [o for o in _head_ops("liger", True, grad_accum=4) if "linear loss" in o.name]
    T, V, h = 8192, 128256, 4096
    assert scaled[0].bytes == 2 * 2 * (T * h + V * h)  # read + write both gradients, bf16


def test_linear_loss_never_keeps_the_logits():
    """The plain loss's backward holds 14 bytes per logit (bf16 logits, fp32 upcast,
    log-softmax output and two fp32 gradients); a linear loss holds the head's weight gradient
    and one chunk instead, so the activation peak falls by most of the logits' bytes."""
    kw = dict(model="llama-3.1-8b", gpus=8, cluster="dgx-h100", seq_len=8192, layout="torch",
              checkpointing="full")
    plain = est("zero3", **kw).memory.activation_bytes
    for ll in ("chunked", "liger"):
        lin = est("zero3", **kw, linear_loss=ll).memory.activation_bytes
        logits = 8192 * 128256
        assert plain - lin > 0.7 * 14 * logits
    sc = scenario(**kw, linear_loss="liger")
    b = am.linear_loss_bytes(sc.model, sc.train)
    Vh = 128256 * 4096
    assert b["kept"] == 2 * Vh and b["backward"] == 2 * Vh
    # Liger's transient: a 256-token chunk of bf16 logits, the bf16 product and its fp32 copy
    # besides the head's input (alive while its gradient fills) and the 0-d loss
    assert b["forward"] - b["kept"] - 2 * 8192 * 4096 - 4 == 2 * 256 * 128256 + 2 * Vh + 4 * Vh + 4 * 8192


def test_fused_swiglu_keeps_three_mlp_wide_tensors_not_four():
    kw = dict(model="llama-3.1-8b", gpus=8, seq_len=4096)
    m = scenario(**kw).model
    plain = am.block_activation_terms(m, scenario(**kw).train)["mlp_hidden"]
    fused = am.block_activation_terms(m, scenario(**kw, fused_swiglu=True).train)["mlp_hidden"]
    assert (plain, fused) == (4 * 2 * 4096 * m.ffn_hidden, 3 * 2 * 4096 * m.ffn_hidden)


def test_flash3_runs_at_the_fa3_papers_bars_relative_to_fa2():
    """FA3 paper, H100 SXM5, hdim 128, 16k: causal forward 616 vs FA2 335; backward (no mask) 561
    vs 322, each kernel's own causal penalty from its forward bars (FA3 616/648, FA2 335/370)."""
    s, h = 16384, 4096
    for backward, ratio in ((False, 616 / 335), (True, (561 * 616 / 648) / (322 * 335 / 370))):
        fa2 = K.attention(H100, s, h, s, backward)
        fa3 = K.attention(H100, s, h, s, backward, kernel="flash3")
        assert fa2.seconds / fa3.seconds == pytest.approx(ratio, rel=1e-9)


@pytest.mark.parametrize("d,padded", [(64, 64), (80, 96), (100, 128), (128, 128), (160, 192), (200, 256)])
def test_flash3_computes_on_flash_attns_rounded_head_dims(d, padded):
    """hopper/flash_api.cpp round_up_headdim: 64, 96, 128, 192, 256."""
    assert K.padded_head_dim(d, "flash3") == padded


def test_flash_outputs_are_read_as_a_view_and_the_math_paths_is_copied():
    """Every flash kernel's output is (b, s, h, d) in memory (SDPA's flash allocates it like q,
    which RoPE leaves (b, s, h, d)): no copy for the output projection; the math path copies."""
    kw = dict(model="llama-3.1-8b", gpus=8, seq_len=4096)
    m = scenario(**kw).model
    for kernel in ("flash2", "flash3"):
        assert am.block_activation_terms(m, scenario(**kw, attention_kernel=kernel).train)["attn_out_proj_input"] == 0
    math = scenario(**kw, flash=False)
    assert am.block_activation_terms(m, math.train)["attn_out_proj_input"] == 2 * 4096 * m.hidden
    for sc, copied in ((scenario(**kw), False), (math, True)):
        assert ("attention output copy" in {o.name for o in unit_ops.unit_ops(sc, sc.units[1], False)}) == copied


@pytest.mark.parametrize("args,needle", [
    (("--gpu", "a100-80gb", "--attention-kernel", "flash3"), "--attention-kernel flash3"),
    (("--linear-loss", "liger", "--fused-loss"), "--linear-loss liger"),
    (("--linear-loss", "chunked", "--compile"), "--eager-loss"),
    (("--linear-loss", "huge"), "--linear-loss"),
    (("--model", "mpt-7b", "--fused-swiglu"), "--fused-swiglu"),
])
def test_bad_combinations_are_one_clear_usage_error(capsys, args, needle):
    base = ["estimate", "--model", "llama-3.1-8b", "--gpus", "8"]
    if "--model" in args:
        base = ["estimate", "--gpus", "8"]
    r = cli(capsys, *base, *args)
    assert r.returncode == 2 and needle in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


def test_linear_loss_with_an_eager_loss_under_compile_is_accepted():
    sc = scenario(model="llama-3.1-8b", gpus=8, compile=True, eager_loss=True, linear_loss="chunked")
    assert sc.train.linear_loss == "chunked" and not sc.train.compile_loss
    with pytest.raises(UsageError):
        scenario(model="llama-3.1-8b", gpus=8, compile=True, linear_loss="chunked")


@pytest.mark.parametrize("kw,needle", [
    (dict(linear_loss="liger"), "--linear-loss liger"),
    (dict(fused_swiglu=True), "--fused-swiglu"),
    (dict(attention_kernel="flash3", gpu="h100-sxm"), "flash3"),
])
def test_the_trainer_refuses_what_it_does_not_run(kw, needle):
    sc = scenario(model="llama-3.1-8b", gpus=8, layout="torch", **kw)
    plan = make_plan(sc, "zero3", global_batch=8)
    assert needle in trainer_refusal(plan, builtin_model=True)
    if "attention_kernel" not in kw:  # a script of the user's computes its own loss and SwiGLU
        assert trainer_refusal(plan, builtin_model=False) is None


def test_the_trainer_accepts_its_chunked_loss():
    sc = scenario(model="llama-3.1-8b", gpus=8, layout="torch", linear_loss="chunked")
    assert trainer_refusal(make_plan(sc, "zero3", global_batch=8), builtin_model=True) is None


def test_flash4_on_b200_against_flash3_on_h200_as_one_micro_benchmark_measured():
    """flash-attn-4 4.0.0b22 on B200 against flash-attn-3 3.0.0 on H200, Llama 3 8B's attention
    shape, causal, forward + backward: 1.88x at 8k, 1.95x at 32k (ml-engineering's
    bench_flash_attn.py); the B200 preset's FA2 reproduces cudnn-frontend's SDPA figures."""
    b200, h200 = presets.gpu("b200"), presets.gpu("h200")
    h = 4096

    def fwd_bwd_rate(g, seq, kernel):
        f, b = (K.attention(g, seq, h, seq, bw, kernel=kernel) for bw in (False, True))
        return (f.flop + b.flop) / (f.seconds + b.seconds)

    for seq, measured in ((8192, 1.88), (32768, 1.95)):
        ratio = fwd_bwd_rate(b200, seq, "flash4") / fwd_bwd_rate(h200, seq, "flash3")
        assert ratio == pytest.approx(measured, rel=0.02)
    for seq, fwd, bwd in ((8192, 376.1e12, 309.2e12), (16384, 397e12, 331e12), (131072, 412e12, 347e12)):
        for backward, measured in ((False, fwd), (True, bwd)):
            op = K.attention(b200, seq, h, seq, backward)
            assert op.flop / op.seconds == pytest.approx(measured, rel=0.02)
    # the same source's in-step attention kernel time at 8k (its 'Step decomposition', backward
    # counted 2x forward there, 2.5x here): H200 FA3 447 and B200 FA4 834 TFLOP/s
    assert fwd_bwd_rate(h200, 8192, "flash3") == pytest.approx(447e12 * 3.5 / 3, rel=0.05)
    assert fwd_bwd_rate(b200, 8192, "flash4") == pytest.approx(834e12 * 3.5 / 3, rel=0.05)


def test_flash4_is_refused_off_blackwell(capsys):
    r = cli(capsys, "estimate", "--model", "llama-3.1-8b", "--gpus", "8", "--gpu", "h100-sxm",
            "--attention-kernel", "flash4")
    assert r.returncode == 2 and "--attention-kernel flash4" in r.stderr and "b200" in r.stderr
    ok = cli(capsys, "estimate", "--model", "llama-3.1-8b", "--gpus", "8", "--cluster", "dgx-b200",
             "--attention-kernel", "flash4")
    assert ok.returncode == 0, ok.stderr
