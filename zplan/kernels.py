"""Time from kernels: each unit's forward, backward and recompute as the kernels eager PyTorch
(or torch.compile) runs for it, each timed from the GPU preset's measured constants.

- GEMM (M, N, K): max(2MNK / (achieved GEMM rate x wave efficiency), bytes / achieved HBM
  bandwidth) + the GPU's fixed time per GEMM kernel, never under the kernel floor. The rate is a
  MAMF measurement (the best large GEMM); the wave efficiency is tiles / (waves x SMs) for the
  output tiles of one thread block (NVIDIA, "Matrix Multiplication Background User's Guide",
  wave quantization); skinny GEMMs turn memory-bound. The fixed time (pipeline fill, the last
  wave's drain and epilogue: what a kernel takes beyond its FLOPs and bytes) is a preset
  constant where a per-shape measurement exists (Hopper and Blackwell: XLA's measured matmul
  table), else 0.
  Backward of a linear is two GEMMs: dX (M, K, N) and dW (N, K, M).
- Flash attention: forward 2·s·h FLOPs per token with the causal half skipped (4·s·h halved),
  backward 2.5x forward (FlashAttention-2: five matmuls to two), at the preset's FlashAttention
  rates x s/(s + s_half) (the measured ramp with sequence length); FlashAttention in Triton
  (llm-foundry's attn_impl: triton) at the FA2 paper's measured fraction of those rates.
- Memory-bound work (norms, RoPE, activation functions, residual adds, gradient sums, the loss
  over the vocabulary, the embedding, FSDP2's copy-out and reduce-scatter copy-in) at achieved
  HBM bandwidth, bytes read + written as the eager kernels move them; never less than one
  kernel floor per kernel. torch.compile fuses each chain into one pass.
- Beside a collective (contended_s): NCCL holds one SM per channel while it runs (the preset's
  nccl_sm_fraction of the SMs), so a GEMM's tiles run in waves over the SMs left, each wave as
  long as before (wave quantization with fewer SMs: a GEMM of exactly one full wave takes two;
  NVIDIA developer forum, "Compute-Communication Overlap Causes Severe GEMM Performance
  Degradation because of Tail Effect", an H100 GEMM of 132 blocks beside a 24-block
  ncclAllGather, ~2x), and every other kernel at (SMs - taken) / SMs of its speed; a kernel at
  its launch floor is not slowed. Where the preset has a kernel-level measurement of compute
  beside a collective (collective_slowdown: NCCL's SMs, its HBM traffic and the power it draws
  together), a kernel's time beside it is at least that factor x its time alone (a GEMM's fixed
  time and the launch floor excepted): a large GEMM beside an all-gather, 1.39x on H100 (inferred
  from pytorch/pytorch PR 172714's measured sequential and overlapped times with zplan's own
  times alone, which add up to the sequential within 0.9%; other splits of it give 1.3-1.6),
  1.76x on A100 (NVIDIA/nccl issue 1428's kernel durations), where the SMs' share alone says
  1.125 and 1.17.
Byte counts are derived in docs/formulas.md, section 6.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

from .specs import GPUSpec, KernelSpec
from .units import DTYPE_BITS


@dataclass(frozen=True)
class Op:
    name: str
    kind: str  # gemm | attention | memory
    kernels: int
    flop: int
    bytes: int
    seconds: float
    contended_s: float  # the same beside a collective: its SMs taken, or the measured slowdown


def taken_sms(k: KernelSpec) -> int:
    """SMs a running collective holds: one per NCCL channel (the preset's fraction)."""
    return min(k.sm_count - 1, round(k.nccl_sm_fraction * k.sm_count))


def _slower(k: KernelSpec) -> float:
    """How much longer work that scales with the SMs takes on those a collective leaves."""
    return k.sm_count / (k.sm_count - taken_sms(k))


def _measured(k: KernelSpec) -> float:
    """How much longer compute takes beside a collective by a kernel-level measurement (its SMs,
    HBM traffic and power together: collective_slowdown); 1 where the preset has none."""
    return k.collective_slowdown or 1.0


def gemm_rate(gpu: GPUSpec, k: KernelSpec, dtype: str) -> float:
    """Achieved FLOP/s of a large GEMM in dtype: the measured figure, else the dtype's peak
    scaled by the bf16 measurement's fraction of the bf16 peak."""
    if dtype in k.gemm_flops:
        return k.gemm_flops[dtype]  # type: ignore[index]
    frac = k.gemm_flops.get("bf16", gpu.flops("bf16")) / gpu.flops("bf16")
    return gpu.flops(dtype) * frac


def waves(k: KernelSpec, M: int, N: int, taken: int = 0) -> int:
    """Waves of output tiles over the SMs not taken: ceil(tiles / free SMs); one where the GEMM
    has fewer tiles than the GPU has SMs (it fills the SMs it has: wave_efficiency)."""
    tiles = math.ceil(M / k.gemm_tile_m) * math.ceil(N / k.gemm_tile_n)
    return 1 if tiles < k.sm_count else math.ceil(tiles / (k.sm_count - taken))


def wave_efficiency(k: KernelSpec, M: int, N: int, taken: int = 0) -> float:
    """tiles / (waves x SMs): the output tiles run in waves over the SMs not taken (by a
    collective's kernels), each wave as long as on the whole GPU. A GEMM of fewer tiles than
    the GPU has SMs fills the SMs it has instead (the library picks smaller tiles or splits K:
    XLA's measured table, where such shapes of 8 us and more run within 13% rms of the full
    rate and the tile rule says up to 4x slower; docs/formulas.md section 6)."""
    tm, tn = k.gemm_tile_m, k.gemm_tile_n
    tiles = math.ceil(M / tm) * math.ceil(N / tn)
    free = k.sm_count - taken
    if tiles < k.sm_count:
        return free / k.sm_count
    waves = math.ceil(tiles / free)
    return tiles / (waves * k.sm_count)


def aligned(dtype: str, *widths: int) -> bool:
    """Whether rows of these widths start on 16-byte boundaries in this dtype (a multiple of 8
    elements in 16-bit): what cuBLAS's fast kernels need of every leading dimension (NVIDIA,
    Matrix Multiplication Background User's Guide, Tensor Core requirements)."""
    per = max(1, 16 * 8 // DTYPE_BITS[dtype])
    return all(w % per == 0 for w in widths)


def gemm(gpu: GPUSpec, name: str, M: int, N: int, K: int, dtype: str, out_dtype: str,
         accumulate: bool = False, groups: int = 1, grouped_out: bool = False,
         widths_aligned: bool | None = None) -> Op:
    """accumulate: C += A·B (beta = 1), which reads the output as well as writing it.
    groups: a grouped GEMM (torch._grouped_mm over `groups` experts, the rows of the reduction
    or of A split among them) reads every group's B (K x N), or with `grouped_out` (a weight
    gradient, M x N the weight) writes every group's output: `groups` times that operand.
    widths_aligned: whether the widths it reads and writes (the leading dimensions: a linear's
    in and out features, never its token count) are 16-byte aligned (`aligned`; None: all three
    dimensions are taken as widths). Where not, and the preset has a measured
    unaligned_gemm_slowdown, the GEMM's FLOP- and byte-bound time is that many times longer."""
    k = gpu.kernels
    assert k is not None
    flop = 2 * M * N * K
    b_in, b_out = DTYPE_BITS[dtype] // 8, DTYPE_BITS[out_dtype] // 8
    b_groups, out_groups = (1, groups) if grouped_out else (groups, 1)
    nbytes = (M * K + b_groups * K * N) * b_in + out_groups * M * N * b_out * (2 if accumulate else 1)
    rate, hbm = gemm_rate(gpu, k, dtype), k.hbm_achieved_bytes_per_s
    fixed, per_wave = k.gemm_fixed_s or 0.0, k.gemm_wave_s or 0.0
    Mt = M * groups if grouped_out else M  # a grouped weight gradient: every group's output tiles
    ok = aligned(dtype, M, N, K) if widths_aligned is None else widths_aligned
    slow = k.unaligned_gemm_slowdown if (k.unaligned_gemm_slowdown and not ok) else 1.0
    rate, hbm = rate / slow, hbm / slow
    core = max(flop / (rate * wave_efficiency(k, Mt, N)), nbytes / hbm)
    t = max(core + fixed + per_wave * waves(k, Mt, N), k.kernel_floor_s)
    taken = taken_sms(k)
    beside = max(max(flop / (rate * wave_efficiency(k, Mt, N, taken)),
                     nbytes / hbm * _slower(k), core * _measured(k))
                 + fixed + per_wave * waves(k, Mt, N, taken), k.kernel_floor_s)
    return Op(name, "gemm", 1, flop, nbytes, t, beside)


def linear(gpu: GPUSpec, name: str, T: int, n_out: int, n_in: int, dtype: str, act: str,
           backward: bool, groups: int = 1) -> list[Op]:
    """A linear layer y = x Wᵀ over T tokens: one GEMM forward, dX and dW backward. groups:
    `groups` experts' weights (n_out x n_in each) over the T rows between them, as one grouped
    GEMM each way (gemm's `groups`)."""
    ok = aligned(dtype, n_out, n_in)  # the token count is no leading dimension of these...
    # ...but for a float8 dW, whose operands _scaled_mm takes contiguous along the tokens
    ok_dw = aligned(dtype, n_out, n_in, T) if dtype == "fp8" else ok
    if not backward:
        return [gemm(gpu, name, T, n_out, n_in, dtype, act, groups=groups, widths_aligned=ok)]
    return [gemm(gpu, f"{name} dX", T, n_in, n_out, dtype, act, groups=groups, widths_aligned=ok),
            gemm(gpu, f"{name} dW", n_out, n_in, T, dtype, "fp32" if dtype == "fp8" else act,
                 groups=groups, grouped_out=True, widths_aligned=ok_dw)]


def eager_norm(gpu: GPUSpec) -> float:
    """The share of the copy rate PyTorch's native fused norm kernels reach (KernelSpec
    eager_norm_efficiency; 1 where not measured). Source: Liger-Kernel's benchmark data,
    benchmarks/published/kernels/liger-norms.csv; docs/formulas.md section 6."""
    k = gpu.kernels
    return (k.eager_norm_efficiency if k is not None and k.eager_norm_efficiency else 1.0)


# torch.compile's generated row-reduction kernels on H100 80GB HBM3 (PyTorch 2.7.1, default mode,
# bf16): model bytes (each input read once, each output written once) / time, by the reduction
# width N, at 32K rows (16K at 131K, 8K at 262K). Dao-AILab/quack media/
# bf16_kernel_benchmarks_single_row.svg at c8ec317 (the figure of its blog post "Getting
# memory-bound kernels to speed-of-light", media/2025-07-10-membound-sol.md), the
# torch.compile series read from the figure's own vector coordinates against its y axis (0 to
# 3350 GB/s): benchmarks/published/kernels/quack-torch-compile-h100.csv. As shares of H100's
# copy rate (the h100-sxm preset's 2903 GB/s), applied to every GPU's copy rate (an assumption off
# H100; a calibrated preset's measured copy rate too), never above it.
COMPILED_ROW_BW_H100: dict[str, tuple[tuple[int, float], ...]] = {
    "norm": ((256, 1278e9), (512, 1576e9), (1024, 1948e9), (2048, 2185e9), (4096, 2303e9),
             (8192, 1947e9), (16384, 1814e9), (32768, 1776e9), (65536, 1534e9),
             (131072, 1503e9), (262144, 1498e9)),
    "cross-entropy": ((256, 340e9), (512, 585e9), (1024, 875e9), (2048, 1163e9), (4096, 1396e9),
                      (8192, 1553e9), (16384, 1648e9), (32768, 1700e9), (65536, 1479e9),
                      (131072, 1226e9), (262144, 1226e9)),
}
H100_COPY_BYTES_PER_S = 2.903e12  # h100-sxm's hbm_achieved_bytes_per_s, the rates' reference


def compiled_row_pace(gpu: GPUSpec, kind: str, width: int) -> float:
    """The share of the copy rate a torch.compile-generated row reduction (a norm, with the
    residual add it fuses; the cross-entropy over the vocabulary) reaches at this reduction
    width: COMPILED_ROW_BW_H100 interpolated in log2(width), clamped at its ends, as a share of
    H100's copy rate; at most 1. docs/formulas.md section 6."""
    pts = COMPILED_ROW_BW_H100[kind]
    x = math.log2(max(pts[0][0], min(pts[-1][0], width)))
    for (w0, b0), (w1, b1) in zip(pts, pts[1:]):
        if x <= math.log2(w1):
            f = (x - math.log2(w0)) / (math.log2(w1) - math.log2(w0))
            bw = b0 + f * (b1 - b0)
            break
    return min(1.0, bw / H100_COPY_BYTES_PER_S)


def repeat(op: Op, n: int) -> Op:
    """One kernel run n times (a loop over chunks)."""
    return Op(op.name if n == 1 else f"{op.name} x{n}", op.kind, op.kernels * n, op.flop * n,
              op.bytes * n, op.seconds * n, op.contended_s * n)


def memory(gpu: GPUSpec, name: str, nbytes: int, kernels: int, efficiency: float = 1.0) -> Op:
    """A memory-bound op: its bytes at the copy rate x `efficiency` (eager_norm above), at
    least the launch floor per kernel."""
    k = gpu.kernels
    assert k is not None
    work, floor = nbytes / (k.hbm_achieved_bytes_per_s * efficiency), kernels * k.kernel_floor_s
    beside = max(work * max(_slower(k), _measured(k)), floor)  # a launch is no slower
    return Op(name, "memory", kernels, 0, int(nbytes), max(work, floor), beside)


def attention_flop(seq: int, hidden: int, tokens: int, causal: bool = True) -> int:
    """Forward FLOPs of QKᵀ and AV: 4·s·h per token, half of it for causal attention."""
    f = 4 * seq * hidden * tokens
    return f // 2 if causal else f


# Speed of a flash kernel relative to FlashAttention-2 (forward, backward). Dao 2023
# (FlashAttention-2, arXiv 2307.08691) section 4.1, A100 80GB SXM4, the same benchmark for both:
# "FlashAttention-2 is around 1.3-1.5x faster than FlashAttention in Triton in the forward pass
# and around 2x faster in the backward pass" (1.4 taken, the middle). Measured on A100 only;
# applied to every GPU (no other kernel-level comparison of the two is published).
# FlashAttention-3 (Shah et al. 2024, arXiv 2407.08608, Figures 5 and 6, H100 80GB SXM5, bf16,
# head dim 128, sequence 16k, the same benchmark for both kernels): causal forward 616 against
# FlashAttention-2's 335 TFLOP/s (the FA2 bar the presets' forward rates come from). Backward is
# charted without the causal mask, 561 against 322; the presets' FA2 backward rate is 322 x FA2's
# causal/non-causal forward ratio (335/370), so FA3's is 561 x its own (616/648). Hopper only.
# FlashAttention-4 (flash-attn-4 4.0.0b22, the released beta) against FlashAttention-3 (3.0.0),
# B200 against H200, one micro-benchmark at Llama 3 8B's attention shape (32 / 8 heads, head dim
# 128, causal, bf16), forward + backward timed together: 1.88x at 8k, 1.95x at 32k
# (stas00/ml-engineering insights/when-to-upgrade-gpus/README.md and bench_flash_attn.py at
# 2943345). With FA3 on H200 priced as above (536 and 550 TFLOP/s forward + backward at 8k and
# 32k) and the Blackwell presets' rates, SDPA's FlashAttention-2 on B200 (326 and 355), FA4 runs
# 3.09x and 3.02x those: 3.06 both ways. The same source's in-step attention kernel time at 8k
# (973 TFLOP/s on B200, 521 on H200, backward counted 2.5x forward) is within 3% of both. (A
# development FA4 with a 2-CTA backward, flash-attn PR 2280, measures 1418 / 1209 at 8k, 3.77x /
# 3.91x SDPA's FA2 at that shape in cudnn-frontend's B200 results.) Blackwell only.
ATTENTION_KERNEL_SPEED: dict[str, tuple[float, float]] = {
    "flash2": (1.0, 1.0),
    "flash-triton": (1 / 1.4, 1 / 2.0),
    "flash3": (616 / 335, (561 * 616 / 648) / (322 * 335 / 370)),
    "flash4": (3.06, 3.06),
}
FLASH3_HEAD_DIMS = (64, 96, 128, 192, 256)  # flash-attn hopper/: the head dims it compiles


# FlexAttention's Triton kernels (torch.nn.attention.flex_attention, compiled; torchtitan's default
# attention for Llama 3 and Qwen3 in 2026) relative to the preset's FlashAttention-2 rates, causal,
# by GPU family (name prefix): no one benchmark covers every GPU.
# A100: "FlexAttention achieves 90% of FlashAttention2's performance in the forward pass and 85% in
# the backward pass" (PyTorch blog "FlexAttention: The Flexibility of PyTorch with the Performance
# of FlashAttention", 2024-08, its causal benchmark on A100, benchmarks/transformer/score_mod.py).
# Hopper: tritonbench's FlexAttention operator against flash_v2, causal, 16 heads, head dim 128,
# batch x sequence 16,384, stated latencies at s = 16k (the presets' FA2 reference length):
# forward 3.347 / 3.024 ms, backward 8.947 / 8.245 ms (pytorch/benchmark PR 2443, c0409aaf,
# 2024-08-28; H100 by FA2's 330 TFLOP/s). NVIDIA's GTC 2025 session on FlexAttention states
# averages of 1.25x and 1.03x FA2 on H100 over its own configurations.
# Blackwell: FlexAttention's Triton backend on GB200, causal, bf16, 16 heads, head dim 128, batch 4
# (drisspg/flex-flash-blog 84b90fa, gb200_triton_vs_cudnn_causal_d128_hkv16.png, read off the plot:
# about 535 forward, 522 backward TFLOP/s at 16k) over the b200 preset's SDPA FlashAttention-2 at
# 16k (397 and 331, cudnn-frontend's B200 results, b200.toml): a ratio across two benchmarks.
AMPERE_PRESETS = ("a100",)
HOPPER_PRESETS = ("h100", "h200", "gh200")  # GPU presets FlashAttention-3 runs on (by name)
BLACKWELL_PRESETS = ("b200", "gb200")  # GPU presets FlashAttention-4 runs on (by name)
FLEX_SPEED: tuple[tuple[tuple[str, ...], tuple[float, float]], ...] = (
    (AMPERE_PRESETS, (0.90, 0.85)),
    (HOPPER_PRESETS, (3.347 / 3.024, 8.947 / 8.245)),
    (BLACKWELL_PRESETS, (535 / 397, 522 / 331)),
)
# cuDNN's fused attention, as PyTorch's SDPA runs it (SDPBackend.CUDNN_ATTENTION). Torch runs it
# first on Hopper and Blackwell where its runtime cuDNN is newer than 9.15 (sdp_utils.cpp
# check_prefer_cudnn_attention, from 2.10; off for CUDA < 12.9 builds, pytorch PR 171627: the 2.11
# cu130 wheels bundle cuDNN 9.19), as 2.9 did, and 2.5.0 on H100 (opt-in from 2.5.1, pytorch PR
# 138522); torchtitan names it first on Blackwell from 3b85aa3 (2025-05) and on every GPU from
# 6a3a9da (2025-10). By GPU family: (forward, backward) at long sequences relative to the preset's
# FlashAttention-2 rates, the half length of its own ramp (None: FlashAttention-2's, the
# preset's), and its measured peak as a share of those long-sequence rates (None: no fall).
# Hopper: the FA3 paper's cuDNN bars (Shah et al. 2024, arXiv 2407.08608, Figures 5-6, H100 SXM5,
# bf16, head dim 128, 16k; the benchmark the FA2 rates come from): causal forward 539 against
# FA2's 335; backward (charted without the mask) 516 against 322, each kernel's causal penalty
# from its own forward bars (cuDNN 539/595, FA2 335/370). The ratio holds within 3% from 512 to
# 16k (315/191 ... 539/335), so the ramp is FA2's. Head dim 64 (the same figures, 16k): causal
# forward 388 against head dim 128's 539, backward (no mask) 433 against 516.
# Blackwell: cudnn-frontend's SDPA training benchmark on B200 (NVIDIA/cudnn-frontend bb37575,
# benchmark/sdpa_benchmark_training/artifacts/sdpa_bf16_benchmark_results_NVIDIA_B200.csv,
# backend pyt_cudnn: Llama 3 shapes, 128 query / 8 kv heads, head dim 128, causal): forward 1171
# and 1332 TFLOP/s at 8k and 16k, backward 943 and 1075, which s/(s + 2640) with asymptotes 1544
# and 1250 follows; the rates peak at 32k (1419, 1109) and fall after (64k 1382 / 1073, 128k 1355
# / 1048), so the fit is held to the peak (4k: +10% / +8%; 32k: +0% / +0%; 64k: +3% / +3%; 128k:
# +5% / +6%; 2k: +42%, where cuDNN ramps later than the fit); over the b200 preset's FA2
# asymptotes (422, 347, the same benchmark's FA2 rows at f937055). Head dims other than 128 not
# measured there (priced as 128's).
CUDNN_SPEED: tuple[tuple[tuple[str, ...], tuple[float, float, int | None, tuple[float, float] | None]], ...] = (
    (HOPPER_PRESETS, (539 / 335, (516 * 539 / 595) / (322 * 335 / 370), None, None)),
    (BLACKWELL_PRESETS, (1544 / 422, 1250 / 347, 2640, (1419 / 1544, 1109 / 1250))),
)
CUDNN_HEAD_DIM_64: tuple[tuple[tuple[str, ...], tuple[float, float]], ...] = ((HOPPER_PRESETS, (388 / 539, 433 / 516)),)


def cudnn_speed(gpu: GPUSpec) -> tuple[float, float, int | None, tuple[float, float] | None] | None:
    """cuDNN attention's (forward, backward) speed relative to the preset's FlashAttention-2 at
    long sequences, its own ramp's half length and its peak as a share of those long-sequence
    rates: the preset's own measurement (zplan calibrate: the ratio at s = 4096, on FA2's ramp)
    where it has one, else the family's published figures (CUDNN_SPEED), or None."""
    k = gpu.kernels
    if k is not None and k.cudnn_attention_speed is not None:
        return (*k.cudnn_attention_speed, None, None)
    return next((speed for names, speed in CUDNN_SPEED if gpu.family.startswith(names)), None)


def cudnn_head_dim_speed(gpu_name: str, head_dim: int) -> tuple[float, float]:
    """cuDNN attention's (forward, backward) speed at this head dim relative to head dim 128
    (CUDNN_HEAD_DIM_64; between 64 and 128 linear, an assumption; 1 at 128 and above, and
    where not measured)."""
    at64 = next((r for names, r in CUDNN_HEAD_DIM_64 if gpu_name.startswith(names)), (1.0, 1.0))
    if head_dim >= 128:
        return 1.0, 1.0
    w = max(0, head_dim - 64) / 64
    return tuple(a + (1.0 - a) * w for a in at64)  # type: ignore[return-value]


# FlashAttention-2 at head dim 64 against head dim 128, causal, forward + backward, the same hidden
# width (2048: 32 heads against 16), sequence 512-16k: the mean of the six ratios of the
# flash-attn repository's own benchmark charts (Dao-AILab/flash-attention assets/
# flash2_a100_fwd_bwd_benchmark.png and flash2_h100_fwd_bwd_benchmark.png at 4f285b3, panels (c)
# and (d); the FA2 paper's Figure 4): A100 88/99, 119/133, 140/155, 156/173, 165/182, 171/189 =
# 0.90; H100 141/163, 192/221, 232/265, 257/294, 273/308, 284/328 = 0.87. The presets' FA2 rates
# are head dim 128's. Between 64 and 128 linear in the head dim (an assumption); 128 and above,
# and other GPU families, as the preset (no measurement).
FA2_HEAD_DIM_64: tuple[tuple[tuple[str, ...], float], ...] = (
    (AMPERE_PRESETS, 0.90),
    (HOPPER_PRESETS, 0.87),
)

# Head dims 64 and 256 against 128 on Hopper, from the FA3 paper's own bars (Shah et al. 2024,
# arXiv 2407.08608, Figures 5-6, H100 SXM5, bf16, 16k tokens, hidden 2048; its head dim 128 bars
# are the ones FA3's and cuDNN's speeds above come from). FlashAttention-3: head dim 64 forward
# 497 against 648 (the panels without the mask; the causal head dim 64 panel was not read, so the
# ratio is applied to causal attention, an assumption), backward (charted without the mask) 474
# against 561; head dim 256 causal forward 642 against 616 (without the mask 756 against 648);
# the backward is not charted at 256 (priced as 128's). FlashAttention-2 at head dim 256, the same
# figures: causal forward 298 against 335 (without the mask 326 against 370); backward not charted
# at 256 (as 128's). Between the charted head dims linear in the padded head dim (an assumption).
FLASH3_HEAD_DIM_SPEED: dict[int, tuple[float, float]] = {64: (497 / 648, 474 / 561), 128: (1.0, 1.0),
                                                         256: (642 / 616, 1.0)}
FA2_HEAD_DIM_256_FORWARD: tuple[tuple[tuple[str, ...], float], ...] = ((HOPPER_PRESETS, 298 / 335),)


# FlashAttention v1 (flash-attn 1.x, and PyTorch 2.0-2.1's SDPA flash backend: FlashAttention-2 from
# 2.2, "FlashAttention-v2 integration", the 2.2 release notes) and xformers' cutlass kernel under an
# explicit mask (SDPA's memory-efficient backend, "from xformers", which SDPA runs where a mask is
# passed from 2.1 to 2.8, and later where cuDNN's is not first: Hugging Face's padded batches)
# against FlashAttention-2, per FLOP counted causal, by head dim (128, 64), from the flash-attn
# repository's forward + backward benchmark charts (the FA2 paper's Figures 4 and 7: Dao-AILab/
# flash-attention assets/flash2_a100_fwd_bwd_benchmark.png and flash2_h100_fwd_bwd_benchmark.png at
# 4f285b3, bf16/fp16, hidden 2048, 16k tokens, 16k sequence). FA1, causal panels: A100 83 and 97
# against FA2's 189 and 171; H100 (FA2's Ampere code, as the presets' FA2 rates) 137 and 156
# against 328 and 284. xformers under a mask: the mask is not causal to the kernel (HF passes
# is_causal=False with it: custom_mask_type NoCustomMask), so it computes the whole s x s square,
# twice the causal count, at its non-causal rate: 98 and 75 (head dim 128, 64) against FA2's causal
# 189 and 171, per causal FLOP 98 / (2 x 189) and 75 / (2 x 171); the mask's reads beside it are not
# priced. xformers is not charted on H100: A100's ratio is applied to every GPU (an assumption) but
# where zplan calibrate measured the GPU's own (KernelSpec.masked_attention_speed: SDPA's
# efficient kernel under a boolean causal mask, its conversion to an additive mask included).
# Forward and backward are charted together only: one ratio for both. The ratios hold within 4%
# from 2k to 16k (FA1 at 512 is nearer FA2: 55/99); the ramp is FA2's.
OLDER_KERNEL_SPEED: dict[str, tuple[tuple[tuple[str, ...], tuple[float, float]], ...]] = {
    "flash1": ((AMPERE_PRESETS, (83 / 189, 97 / 171)), (HOPPER_PRESETS, (137 / 328, 156 / 284))),
    "efficient": (((), (98 / (2 * 189), 75 / (2 * 171))),),  # A100's, on every GPU
}
FLASH1_HEAD_DIMS = (32, 64, 128)  # flash-attn 1.x's run_fmha_fwd: d <= 32, <= 64, <= 128


def older_kernel_speed(kernel: str, gpu_name: str, padded_head_dim: int) -> float:
    """FlashAttention v1's or masked xformers' speed per counted FLOP relative to FlashAttention-2
    at the same head dim (OLDER_KERNEL_SPEED: head dims 128 and 64 measured, linear between, 64's
    below and 128's above: an assumption, cutlass runs head dims over 128 on a generic, slower
    kernel), on this GPU's family or the first listed where its family is not."""
    rows = OLDER_KERNEL_SPEED[kernel]
    at128, at64 = next((r for names, r in rows if gpu_name.startswith(names)), rows[0][1])
    d = min(max(padded_head_dim, 64), 128)
    return at64 + (at128 - at64) * (d - 64) / 64


def fa2_head_dim_speed(gpu_name: str, padded_head_dim: int) -> float:
    """FlashAttention-2's speed at this (padded) head dimension relative to head dim 128
    (FA2_HEAD_DIM_64, by GPU family); 1 where not measured."""
    at64 = next((r for names, r in FA2_HEAD_DIM_64 if gpu_name.startswith(names)), 1.0)
    if padded_head_dim >= 128:
        return 1.0
    return at64 + (1.0 - at64) * max(0, padded_head_dim - 64) / 64


def flash3_head_dim_speed(padded_head_dim: int) -> tuple[float, float]:
    """FlashAttention-3's (forward, backward) speed at this padded head dim relative to head dim
    128 (FLASH3_HEAD_DIM_SPEED: 64, 128 and 256 charted, linear between, the nearest beyond)."""
    dims = sorted(FLASH3_HEAD_DIM_SPEED)
    d = min(max(padded_head_dim, dims[0]), dims[-1])
    lo = max(x for x in dims if x <= d)
    hi = min(x for x in dims if x >= d)
    if lo == hi:
        return FLASH3_HEAD_DIM_SPEED[lo]
    w = (d - lo) / (hi - lo)
    a, b = FLASH3_HEAD_DIM_SPEED[lo], FLASH3_HEAD_DIM_SPEED[hi]
    return a[0] + (b[0] - a[0]) * w, a[1] + (b[1] - a[1]) * w


def fa2_wide_head_forward_speed(gpu_name: str, padded_head_dim: int) -> float:
    """FlashAttention-2's forward speed at a padded head dim over 128 relative to 128's
    (FA2_HEAD_DIM_256_FORWARD, by GPU family; linear from 128 to 256): 1 at 128 and below, and
    where not measured (A100: no chart at 256)."""
    at256 = next((r for names, r in FA2_HEAD_DIM_256_FORWARD if gpu_name.startswith(names)), 1.0)
    if padded_head_dim <= 128:
        return 1.0
    return 1.0 + (at256 - 1.0) * (min(padded_head_dim, 256) - 128) / 128


def flex_speed(gpu_name: str) -> tuple[float, float] | None:
    """FlexAttention's (forward, backward) speed relative to FlashAttention-2 on this GPU preset
    (FLEX_SPEED, by the preset name's family), or None where no kernel benchmark gives one."""
    return next((speed for names, speed in FLEX_SPEED if gpu_name.startswith(names)), None)


def padded_head_dim(head_dim: int, kernel: str) -> int:
    """The head dimension the kernel computes on: FlashAttention-2 rounds it up to a multiple of
    32 (flash-attn csrc/flash_attn/flash_api.cpp, head_size_rounded); the Triton kernels (and
    FlexAttention's) to a power of two (flash_attn_triton.py, BLOCK_HEADDIM = next_power_of_2(d));
    cuDNN's is not padded (it takes multiples of 8 up to 128; scenario_options refuses others)."""
    if kernel in ("flash-triton", "flex"):  # Triton's tl.arange: a power of two
        return max(16, 1 << (head_dim - 1).bit_length())
    if kernel == "flash3":
        return next((d for d in FLASH3_HEAD_DIMS if d >= head_dim), head_dim)
    if kernel == "flash1":  # scenario_options refuses head dims over 128
        return next((d for d in FLASH1_HEAD_DIMS if d >= head_dim), head_dim)
    if kernel == "efficient":  # cutlass tiles the head dim with predication: not padded (assumed)
        return head_dim
    if kernel == "cudnn":  # computed as it is: scenario_options refuses what cuDNN's SDPA does not take
        return head_dim
    return -(-head_dim // 32) * 32


def attention_rates(gpu: GPUSpec, kernel: str = "flash2", head_dim: int = 128,
                    dtype: str = "bf16") -> tuple[float, float]:
    """Counted FLOP/s (forward, backward) of the flash kernel at long sequences: the preset's
    FlashAttention-2 rates (head dim 128) x the kernel's speed relative to it (FlashAttention-2
    itself at a head dim under 128: fa2_head_dim_speed, and its forward over 128 on Hopper:
    fa2_wide_head_forward_speed; FlashAttention-3 at its own head dims: flash3_head_dim_speed)
    x head_dim / the padded head dimension (the padding is computed, not counted;
    FlashAttention-3 compiles head dims 64, 96, 128, 192 and 256 and runs a smaller one on the
    next). The rates are bf16/fp16 tensor-core
    figures; fp32 attention runs PyTorch's memory-efficient kernel on CUDA (flash takes bf16/fp16
    only), priced as the same fraction of the fp32 peak (gemm_rate's rule; an assumption)."""
    k = gpu.kernels
    assert k is not None
    padded = padded_head_dim(head_dim, kernel)
    pad = head_dim / padded
    if kernel == "flex":  # refused where no benchmark gives its speed (scenario_options)
        f, b = flex_speed(gpu.family) or (1.0, 1.0)
    elif kernel == "cudnn":  # likewise
        f, b = (cudnn_speed(gpu) or (1.0, 1.0))[:2]
        hf, hb = cudnn_head_dim_speed(gpu.family, padded)
        f, b = f * hf, b * hb
    elif kernel in OLDER_KERNEL_SPEED:  # against FA2 at the same head dim, which itself slows below 128
        r = older_kernel_speed(kernel, gpu.family, padded)
        f = b = r
        if kernel == "efficient" and k.masked_attention_speed is not None:  # measured (calibrate) at
            # head dim 128: the preset's own, the chart's head-dim shape kept
            f, b = (x * r / older_kernel_speed(kernel, gpu.family, 128) for x in k.masked_attention_speed)
        f, b = (x * fa2_head_dim_speed(gpu.family, padded) for x in (f, b))
    else:
        f, b = ATTENTION_KERNEL_SPEED[kernel]
    if kernel == "flash2":  # small heads run FA2's tiles at lower intensity (measured)
        f, b = (x * fa2_head_dim_speed(gpu.family, padded) for x in (f, b))
        f *= fa2_wide_head_forward_speed(gpu.family, padded)
    if kernel == "flash3":
        hf, hb = flash3_head_dim_speed(padded)
        f, b = f * hf, b * hb
    scale = gpu.flops(dtype) / gpu.flops("bf16") if dtype not in ("bf16", "fp16", "fp8") else 1.0
    return (k.attention_forward_flops * f * pad * scale, k.attention_backward_flops * b * pad * scale)


def attention_half_seq(gpu: GPUSpec, kernel: str) -> float:
    """The sequence length at which the kernel runs at half its long-sequence rate: the preset's
    (FlashAttention-2's ramp), or cuDNN's own where measured (CUDNN_SPEED)."""
    k = gpu.kernels
    assert k is not None
    if kernel == "cudnn":
        return (cudnn_speed(gpu) or (0, 0, None, None))[2] or k.attention_half_seq
    return k.attention_half_seq


def attention(gpu: GPUSpec, seq: int, hidden: int, tokens: int, backward: bool,
              kernel: str = "flash2", head_dim: int = 128, dtype: str = "bf16") -> Op:
    """One fused attention kernel over `tokens` tokens in sequences of `seq`: its FLOPs as
    FlashAttention's benchmark counts them (attention_flop: 4 s h a token, causal halved;
    backward 2.5x the forward, Dao 2023, FlashAttention-2 section 4.1), at the kernel's measured
    long-sequence rate for this GPU, head dim and dtype (attention_rates: the preset's
    FlashAttention-2 bars, the other kernels by their published ratios) times s / (s + s_half),
    the ramp the forward bars follow from 512 to 16k tokens (the backward assumed to ramp
    alike); cuDNN's measured rates held at their peak past it (CUDNN_SPEED); at least the
    preset's kernel floor; beside a collective, slower by the preset's measured slowdown or
    NCCL's share of the SMs (docs/formulas.md section 6)."""
    k = gpu.kernels
    assert k is not None
    fwd = attention_flop(seq, hidden, tokens)
    flop = int(2.5 * fwd) if backward else fwd
    long_rate = attention_rates(gpu, kernel, head_dim, dtype)[1 if backward else 0]
    rate = long_rate * seq / (seq + attention_half_seq(gpu, kernel))
    peak = (cudnn_speed(gpu) or (0, 0, None, None))[3] if kernel == "cudnn" else None
    if peak:  # cuDNN's measured rates fall past their peak (CUDNN_SPEED)
        rate = min(rate, long_rate * peak[1 if backward else 0])
    t = max(flop / rate, k.kernel_floor_s)
    beside = max(flop / rate * max(_slower(k), _measured(k)), k.kernel_floor_s)
    name = {"cudnn": "cuDNN attention", "efficient": "efficient attention (masked)",
            "flash1": "flash attention (v1)"}.get(kernel, "flash attention")
    return Op(name + (" backward" if backward else ""), "attention", 1, flop, 0, t, beside)


# torch's multi_tensor_apply (aten/src/ATen/native/cuda/MultiTensorApply.cuh): each thread block
# takes one kChunkSize-element chunk of one tensor; a launch carries at most
# depth_to_max_tensors[depth - 1] tensors and depth_to_max_blocks[depth - 1] blocks. The values
# are torch 2.13's for CUDA 12 builds (4 KB kernel arguments); its CUDA 13 builds take 32 KB
# (252 tensors, 2240 blocks at depth 4), which the plan cannot know: same bytes, fewer launches.
# DeepSpeed's FusedAdam (csrc/adam/multi_tensor_apply.cuh, from apex) uses the same chunk
# (2048 x 32) and the 4 KB limits.
MTA_CHUNK_ELEMS = 65536
MTA_MAX_TENSORS = (110, 64, 48, 36, 30)
MTA_MAX_TENSORS_SCALARLIST = (96, 64, 48, 36, 30)  # ops taking a list of scalars (one per tensor)
MTA_MAX_BLOCKS = (320, 320, 320, 320, 320)


def multi_tensor_launches(sizes: list[int], depth: int, scalar_list: bool = False) -> int:
    """_multi_tensor_launches, remembered by the sizes (an MoE model's optimizer steps tens of
    thousands of tensors, the same list for every configuration recommend tries)."""
    return _multi_tensor_launches(tuple(sizes), depth, scalar_list)


@lru_cache(maxsize=256)
def _multi_tensor_launches(sizes: tuple[int, ...], depth: int, scalar_list: bool = False) -> int:
    """Kernel launches of one multi_tensor_apply over tensors of these element counts, with
    `depth` tensor lists (fused Adam: param, grad, exp_avg, exp_avg_sq = 4): torch's loop, which
    launches when the blocks fill, or the tensors fill on a tensor's last chunk, and once more for
    what is left. Empty tensors are skipped. `scalar_list`: the op takes one scalar per tensor
    (depth_to_max_tensors_scalarlist: fewer tensors per launch at depth 1)."""
    max_t = (MTA_MAX_TENSORS_SCALARLIST if scalar_list else MTA_MAX_TENSORS)[depth - 1]
    max_b = MTA_MAX_BLOCKS[depth - 1]
    launches = blocks = loaded = 0
    for n in sizes:
        if n == 0:
            continue
        loaded += 1
        left = -(-n // MTA_CHUNK_ELEMS)  # this tensor's chunks not yet placed
        while left > max_b - blocks:  # the blocks fill before its last chunk: it carries over
            left -= max_b - blocks
            launches, blocks, loaded = launches + 1, 0, 1
        blocks += left
        if blocks == max_b or loaded == max_t:
            launches, blocks, loaded = launches + 1, 0, 0
    return launches + (1 if blocks else 0)


def total(ops: list[Op]) -> float:
    return sum(o.seconds for o in ops)


def total_contended(ops: list[Op]) -> float:
    return sum(o.contended_s for o in ops)


def by_kind(ops: list[Op]) -> dict[str, float]:
    out: dict[str, float] = {}
    for o in ops:
        out[o.kind] = out.get(o.kind, 0.0) + o.seconds
    return out


@lru_cache(maxsize=256)
def expected_max_normal(n: int) -> float:
    """E[max of n independent standard normal draws]: the integral of x n φ(x) Φ(x)^(n-1) over
    x, by the midpoint rule on [-9, 9] in steps of 1/32: for a smooth integrand that vanishes at
    both ends the rule converges geometrically (within 1e-10 of steps of 1/256 for n up to 10^6,
    tests/test_kernels.py; n = 2: 1/√π = 0.5642, n = 8: 1.4236, textbook order-statistics
    values), in 0.5 ms where 1/256 took 11 of the estimate's 300. 0 for one draw."""
    if n <= 1:
        return 0.0
    h, total = 1 / 32, 0.0
    for i in range(-9 * 32, 9 * 32):
        x = (i + 0.5) * h
        cdf = 0.5 * (1 + math.erf(x / math.sqrt(2)))
        total += x * n * math.exp(-x * x / 2) / math.sqrt(2 * math.pi) * cdf ** (n - 1) * h
    return total


def slowest_rank_factor(k: KernelSpec | None, ranks: int) -> float:
    """How much longer the slowest of `ranks` GPUs takes over the median GPU's compute, which
    the kernel model prices: 1 + σ E[max of n standard normals], σ the preset's
    rank_speed_spread. A synchronous step (every FSDP unit's collective, every DDP bucket) waits
    for its slowest rank, and a GPU's speed is a lasting property of the device (the same GPU
    measured in two jobs correlates at r = 0.95 on Perlmutter's A100s:
    benchmarks/published/kernels/README.md), so the slowest rank paces every step. 1 where the
    preset has no spread or the run has one rank (docs/formulas.md section 6)."""
    if k is None or not k.rank_speed_spread or ranks <= 1:
        return 1.0
    return 1 + k.rank_speed_spread * expected_max_normal(ranks)
