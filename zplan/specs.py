"""Validated, frozen specs: what a GPU, a cluster, a model and a training run are.

Every spec is a record (zplan/validated.py) that refuses unknown fields and is checked once, at
the edge (CLI flags, preset files, plan files). Cost models take these and nothing else.
"""

from __future__ import annotations

import math
from typing import Annotated, Any, Literal

from .validated import Field, Record, ValidationError, model_validator

DTypeName = Literal["fp32", "tf32", "bf16", "fp16", "fp8", "int8", "int4"]
StrategyName = Literal[
    "ddp", "zero1", "zero2", "zero3", "zero3-noreshard", "hsdp", "offload-opt", "offload-all"
]
STRATEGIES: tuple[str, ...] = StrategyName.__args__  # type: ignore[attr-defined]
Checkpointing = Literal["none", "full", "selective", "attention", "every-k", "first-k"]
AttentionKernel = Literal["flash2", "flash-triton", "flash3", "flash4", "flex", "cudnn", "flash1", "efficient"]
CompileScope = Literal["block", "model"]
OptimizerKernels = Literal["fused", "foreach", "single"]
Float8Recipe = Literal["tensorwise", "rowwise", "rowwise-gw-hp", "te-delayed"]
LinearLoss = Literal["none", "chunked", "liger"]
DeepSpeedParamGroups = Literal["one", "split"]
CHECKPOINTING: tuple[str, ...] = Checkpointing.__args__  # type: ignore[attr-defined]
ATTENTION_KERNELS: tuple[str, ...] = AttentionKernel.__args__  # type: ignore[attr-defined]
COMPILE_SCOPES: tuple[str, ...] = CompileScope.__args__  # type: ignore[attr-defined]
OPTIMIZER_KERNELS: tuple[str, ...] = OptimizerKernels.__args__  # type: ignore[attr-defined]
FLOAT8_RECIPES: tuple[str, ...] = Float8Recipe.__args__  # type: ignore[attr-defined]
LINEAR_LOSSES: tuple[str, ...] = LinearLoss.__args__  # type: ignore[attr-defined]
DEEPSPEED_PARAM_GROUPS: tuple[str, ...] = DeepSpeedParamGroups.__args__  # type: ignore[attr-defined]
TE_FLOAT8_UNMODELLED = ("selective", "attention")  # checkpointing modes whose TE saves zplan does not know
OptimizerName = Literal["adamw", "sgd", "adam8bit", "muon"]
Layout = Literal["zero", "torch"]
EmbedHeadUnit = Literal["separate", "head-kept", "root", "root-kept", "head-root-kept"]


# Bounds on every number a spec holds. Generic (the base class checks every field, so fields
# added later are covered): finite, non-negative, below MAX_NUMBER, which keeps products of a
# dozen of them finite in float64. Specific bounds (Field(le=...)) say what is absurd per field.
MAX_NUMBER = 1e24
MAX_GPUS = 10**6
MAX_LAYERS = 256  # 2x the deepest published model (~130); each layer is priced: recommend ~1 s
MAX_EXPERTS = 1024  # published MoE models have up to a few hundred
MAX_BLOCK_EXPERTS = 100_000  # num_layers x experts: each expert of each block is priced
MAX_MEMORY_BYTES = 2**50  # 1 PiB: per GPU or per node
MAX_RATE = 1e18  # FLOP/s or bytes/s of one device or link
MIN_RATE = 1e6  # the least FLOP/s, bytes/s or parameters/s a preset may state: below it a step's
# times run to infinity (a typo's 1e-300 printed inf and NaN, and broke --json's finite numbers)
MAX_PARAMS = 10**13
MAX_SEQ_LEN = 10**7
DEEPSPEED_SUB_GROUP_ELEMS = 1_000_000_000  # DeepSpeed's sub_group_size default (runtime/zero/config.py)
MAX_MICRO_BATCH = 10**5
MAX_GRAD_ACCUM = 10**6
Name = Annotated[str, Field(min_length=1, max_length=128, pattern=r"^[^\x00-\x1f\x7f]+$")]
PositiveInt = Annotated[int, Field(gt=0)]


def bad_number(value: Any) -> str | None:
    """Why `value` (a number, or one inside a dict, list or tuple) is not a sane spec number."""
    stack = [value]
    while stack:
        v = stack.pop()
        if isinstance(v, bool) or v is None:
            continue
        if isinstance(v, dict):
            stack.extend(v.values())
        elif isinstance(v, (list, tuple)):
            stack.extend(v)
        elif isinstance(v, (int, float)):
            if isinstance(v, float) and not math.isfinite(v):
                return f"{v} is not a finite number"
            if v < 0:
                return f"{v} is negative"
            if v > MAX_NUMBER:
                shown = f"{v:.3g}" if isinstance(v, float) else f"about 1e{int(math.log10(v))}"
                return f"{shown} is absurdly large (limit {MAX_NUMBER:.0e})"
    return None


def validation_line(what: str, err: ValidationError) -> str:
    """The first validation error as one line: `what: field 'loc': message (got value)`."""
    e = err.errors()[0]
    field = ".".join(str(x) for x in e["loc"])
    msg = " ".join(str(e["msg"]).split()).removeprefix("Value error, ")
    got = ""
    if e.get("type") not in ("missing", "extra_forbidden") and "input" in e and \
            not isinstance(e["input"], (dict, list)):
        got = f" (got {' '.join(repr(e['input']).split())[:80]})"
    return f"{what}: field '{field}': {msg}{got}" if field else f"{what}: {msg}"


def _sane_numbers(v: Any) -> Any:
    why = bad_number(v)
    if why:
        raise ValueError(why)
    return v


class Spec(Record):
    """Frozen, unknown fields refused, and every number finite and non-negative."""

    allow_inf_nan = False
    str_max_length = 4096
    field_check = staticmethod(_sane_numbers)


class KernelSpec(Spec):
    """What kernels achieve on this GPU (zplan/kernels.py); each figure names its source."""

    gemm_flops: dict[DTypeName, Annotated[float, Field(ge=MIN_RATE, le=MAX_RATE)]] = Field(
        description="achieved FLOP/s of a large, well-shaped GEMM per dtype (a MAMF measurement)")
    gemm_tile_m: PositiveInt = Field(128, description="output tile rows of one GEMM thread block")
    gemm_tile_n: PositiveInt = Field(256, description="output tile columns (wave quantization)")
    sm_count: PositiveInt
    attention_forward_flops: float = Field(ge=MIN_RATE, le=MAX_RATE, description="flash attention forward, FLOP/s "
                                           "at long sequences (head dim 128)")
    attention_backward_flops: float = Field(ge=MIN_RATE, le=MAX_RATE, description="flash attention backward, FLOP/s")
    attention_half_seq: float = Field(
        0.0, ge=0, description="sequence length at which attention reaches half its rate")
    hbm_achieved_bytes_per_s: float = Field(ge=MIN_RATE, le=MAX_RATE, description="a large copy (STREAM-like)")
    eager_norm_efficiency: float | None = Field(
        None, gt=0, le=1, description="share of the copy rate PyTorch's native fused norm "
        "kernels reach (layer_norm, rms_norm; forward and backward): row reductions run below a "
        "copy's pace; from kernel-level measurements; None: not measured, the copy rate")
    kernel_floor_s: float = Field(ge=0, le=1e-3, description="least time of one kernel as eager "
                                  "PyTorch issues it (launch and dispatch)")
    gemm_fixed_s: float | None = Field(
        None, ge=0, le=1e-3, description="GPU time of one GEMM kernel beyond its FLOPs, bytes and "
        "waves (launch, the last wave's tail), from a per-shape measurement; None: not measured, "
        "counted as 0 (the kernel floor still bounds a GEMM from below)")
    gemm_wave_s: float | None = Field(
        None, ge=0, le=1e-4, description="GPU time a GEMM adds per wave of output tiles over the "
        "SMs (each tile's pipeline fill and epilogue), from the same per-shape measurement as "
        "gemm_fixed_s; None: not measured, counted as 0")
    unaligned_gemm_slowdown: float | None = Field(
        None, ge=1, le=20, description="how many times longer a 16-bit GEMM takes when a width it "
        "reads or writes is not a multiple of 8 elements (rows not 16-byte aligned: GPT-2's "
        "vocabulary of 50257), measured by zplan calibrate at a head-like shape against the "
        "padded one, eager (torch.compile's pad_mm may pad some such GEMMs itself); None: not "
        "measured, priced as aligned (estimate's unaligned_gemms says so)")
    nccl_sm_fraction: float = Field(
        0.0, ge=0, lt=1, description="share of the SMs NCCL's kernels hold while they run "
        "(one block per channel): compute beside a collective runs this much slower")
    collective_slowdown: float | None = Field(
        None, ge=1, le=4, description="how many times longer compute takes while an NCCL "
        "collective runs beside it (SMs, HBM traffic, power), from a kernel-level measurement "
        "of a GEMM of many waves; None: not measured, only the SMs NCCL's channels hold")
    cudnn_attention_speed: tuple[Annotated[float, Field(gt=0, le=20)], Annotated[float, Field(gt=0, le=20)]] | None = Field(
        None, description="cuDNN's fused attention (SDPA's cudnn backend), forward and backward, "
        "over this preset's FlashAttention-2 rates at the same shape (causal, s = 4096), measured "
        "by zplan calibrate; None: the GPU family's published ratio (zplan/kernels.py CUDNN_SPEED)")
    masked_attention_speed: tuple[Annotated[float, Field(gt=0, le=20)], Annotated[float, Field(gt=0, le=20)]] | None = Field(
        None, description="SDPA's memory-efficient kernel under an explicit causal mask (is_causal "
        "off, as Hugging Face's padded batches), forward and backward, per causal FLOP over this "
        "preset's FlashAttention-2 rates (s = 4096, head dim 128), measured by zplan calibrate; "
        "None: A100's published ratio (zplan/kernels.py OLDER_KERNEL_SPEED)")
    rank_speed_spread: float | None = Field(
        None, ge=0, le=0.1, description="standard deviation of one GPU's compute speed across "
        "GPUs of this model, as a fraction of the median (manufacturing and power management): "
        "a synchronous step waits for the slowest rank; None: every rank at the median")
    source: str


class GPUSpec(Spec):
    """One accelerator, from its vendor's datasheet."""

    name: Name
    memory_bytes: int = Field(gt=0, le=MAX_MEMORY_BYTES)
    peak_flops: dict[DTypeName, Annotated[float, Field(ge=MIN_RATE, le=MAX_RATE)]] = Field(
        description="dense peak FLOP/s per dtype (no sparsity)")
    hbm_bytes_per_s: float = Field(ge=MIN_RATE, le=MAX_RATE)
    host_link_bytes_per_s: float = Field(ge=MIN_RATE, le=MAX_RATE, description="GPU<->host, one direction")
    measured: bool = Field(False, description="peak_flops are achieved rates from zplan calibrate")
    base: Name | None = Field(None, description="the preset of the part a measured preset was "
                              "measured on (zplan calibrate): its family decides which kernels run "
                              "(FlashAttention-3 on Hopper, ...) and which GPUs its plans are for")
    device: Literal["gpu", "cpu"] = Field("gpu", description="cpu: a CPU rank standing in for a GPU")
    cluster: Name | None = Field(None, description="the cluster preset (node links and network) this "
                                 "GPU usually sits in: what --gpu without --cluster plans for; None: "
                                 "no shipped node has it, so --cluster must name one")
    kernels: KernelSpec | None = Field(
        None, description="the per-op kernel model's constants; None: FLOPs x efficiency")
    caveat: str = Field("", max_length=600, description="what the preset's figures are known to "
                        "miss against measured runs, with the evidence; printed with the assumptions")
    source: str

    @model_validator(mode="after")
    def _base_is_of_a_measured_preset(self) -> GPUSpec:
        if self.base is not None and not self.measured:
            raise ValueError(f"base = {self.base!r} names the part a measured preset was measured "
                             f"on (zplan calibrate writes it): it needs measured = true")
        return self

    @model_validator(mode="after")
    def _needs_bf16_and_fp32(self) -> GPUSpec:
        for k in ("bf16", "fp32"):
            if k not in self.peak_flops:
                raise ValueError(f"peak_flops needs a '{k}' entry")
        k = self.kernels
        if k is not None and not self.measured:  # a datasheet's peak bounds what kernels achieve
            for dt, rate in k.gemm_flops.items():
                if rate > self.flops(dt):
                    raise ValueError(f"kernels.gemm_flops.{dt} = {rate:.4g} exceeds the {dt} "
                                     f"peak {self.flops(dt):.4g}: achieved rates are below peak")
            if k.hbm_achieved_bytes_per_s > self.hbm_bytes_per_s:
                raise ValueError(f"kernels.hbm_achieved_bytes_per_s exceeds hbm_bytes_per_s "
                                 f"({self.hbm_bytes_per_s:.4g})")
            for f in ("attention_forward_flops", "attention_backward_flops"):
                if getattr(k, f) > self.flops("bf16"):
                    raise ValueError(f"kernels.{f} exceeds the bf16 peak {self.flops('bf16'):.4g}")
        return self

    @property
    def family(self) -> str:
        """The preset name that says which part this is: a measured preset's base, else its own."""
        return self.base or self.name

    def flops(self, dtype: str) -> float:
        """Peak FLOP/s of a dtype; where the preset has none (a calibrated one measures fp32 and
        bf16), TF32 at half the bf16 rate, as every tensor-core GPU's datasheet gives it (A100
        156 of 312, H100/H200 SXM 494.7 of 989.4, B200 1.1 of 2.25 PF dense; MI300X 653.7 of
        1307.4); a CPU has no TF32, torch runs its fp32 kernels there: the fp32 rate. fp16 and
        other dtypes at the bf16 rate."""
        if dtype in self.peak_flops:
            return self.peak_flops[dtype]  # type: ignore[index]
        if dtype == "tf32" and self.device == "cpu" and "fp32" in self.peak_flops:
            return self.peak_flops["fp32"]
        if dtype == "tf32" and "bf16" in self.peak_flops:
            return self.peak_flops["bf16"] / 2
        return self.peak_flops["fp16" if dtype == "fp16" and "fp16" in self.peak_flops else "bf16"]


class NcclTestFigure(Spec):
    """One nccl-tests measurement the cluster preset's link figures come from."""

    op: Literal["all_gather", "reduce_scatter", "all_reduce"]
    gpus: PositiveInt
    gpus_per_node: PositiveInt
    bytes: PositiveInt = Field(description="nccl-tests 'size' column: the whole tensor")
    busbw_bytes_per_s: float = Field(ge=MIN_RATE, le=MAX_RATE, description="nccl-tests 'busbw' column")
    source: str


Rate = Annotated[float, Field(ge=MIN_RATE, le=MAX_RATE)]


class ClusterSpec(Spec):
    """Nodes of GPUs and the links between them, as NCCL drives them (zplan/nccl.py).

    Bandwidths are nccl-tests bus bandwidths at large messages (NCCL's Simple protocol, ring);
    latencies are NCCL's own tuning constants (src/graph/tuning.cc) for the link type.
    """

    name: Name
    gpu: Name | None = Field(None, description="default GPU preset for this cluster")
    gpus_per_node: int = Field(gt=0, le=1024)
    intra_node_busbw_bytes_per_s: float = Field(
        ge=MIN_RATE, le=MAX_RATE, description="ring all-gather/reduce-scatter busbw inside one node, large messages")
    intra_node_allreduce_busbw_bytes_per_s: float | None = Field(
        None, ge=MIN_RATE, le=MAX_RATE, description="all-reduce busbw inside one node where NCCL picks NVLS "
        "(NVLink SHARP), measured over intra_node_allreduce_gpus GPUs; None: the ring figure")
    intra_node_allreduce_gpus: int | None = Field(
        None, gt=1, le=1024, description="how many GPUs of the node the NVLS figure was measured over "
        "(smaller groups get less: zplan/nccl.py nvls_busbw_share); None: gpus_per_node")
    inter_node_busbw_bytes_per_s: float = Field(
        ge=MIN_RATE, le=MAX_RATE, description="per GPU: what each GPU's share of the network adds to a ring that "
        "spans nodes; a group with g GPUs in each node gets g times this")
    intra_node_latency_s: float = Field(ge=0, le=1, description="per ring step inside a node")
    inter_node_latency_s: float = Field(ge=0, le=1, description="per ring step that crosses nodes")
    base_latency_s: float = Field(0.0, ge=0, le=1, description="per call (NCCL's baseLat)")
    intra_node_ring_fill_s: float = Field(
        0.0, ge=0, le=1, description="per call of a ring inside one node (twice for all-reduce): "
        "the pipeline fill a measured nccl-tests curve shows beyond NCCL's per-step latencies")
    link: Literal["nvlink", "pcie", "loopback"] = Field(
        "nvlink", description="intra-node link type: selects NCCL's LL latencies")
    net_overhead_s: float = Field(
        1.0e-6, ge=0, le=1e-3, description="NCCL's per-step overhead of a ring spanning nodes "
        "(tuning.cc getNetOverhead): 1 us on Intel x86 and other hosts, 2 us on AMD x86; "
        "tripled for the Simple protocol")
    ll_max_busbw_bytes_per_s: tuple[Rate, Rate, Rate] | None = Field(
        None, description="NCCL's cap on the LL protocol's bus bandwidth (tuning.cc llMaxBws): "
        "one node (by GPU generation), two nodes, more (by the host CPU's vendor); None: uncapped")
    tree_busbw_fraction: float | None = Field(
        None, gt=0, le=1, description="the tree all-reduce's algorithm bandwidth across nodes as a "
        "fraction of the ring's busbw, where a network's measured curves show it (tuning.cc's "
        "0.92 x 0.5 where None)")
    nccl_tests: tuple[NcclTestFigure, ...] = ()
    host_ram_bytes: int = Field(gt=0, le=MAX_MEMORY_BYTES, description="per node")
    # default: DeepSpeed CPU-Adam on 2 x Xeon Platinum 8168, ZeRO-Offload (arXiv 2101.06840) Table 4
    cpu_adam_params_per_s: float = Field(
        3.9e9, ge=MIN_RATE, le=MAX_RATE, description="CPU optimizer throughput per node, at fp32 master weights, "
        "gradients and states (28 B a parameter; other dtypes scale by bytes: compute.cpu_optimizer_bytes_per_param)")
    source: str


class ModelSpec(Spec):
    """A decoder-only transformer described by its architecture; parameter counts are derived."""

    name: Name
    num_layers: int = Field(gt=0, le=MAX_LAYERS)
    hidden: int = Field(gt=0, le=2**20)
    ffn_hidden: int = Field(gt=0, le=2**22)
    num_heads: int = Field(gt=0, le=2**14)
    num_kv_heads: int = Field(gt=0, le=2**14)
    vocab_size: int = Field(gt=0, le=2**27)
    tied_embeddings: bool = False
    mlp: Literal["gelu", "swiglu"] = "swiglu"
    norm: Literal["rmsnorm", "layernorm"] = "rmsnorm"
    position: Literal["rope", "learned"] = "rope"
    max_seq_len: int = Field(4096, gt=0, le=2**27)
    linear_bias: bool = False
    qkv_bias: bool = False
    qkv_fused: bool = Field(False, description="q, k and v are one linear (MPT's Wqkv, GPT-2's "
                            "c_attn): float8 linears cast, and TransformerEngine keeps, its input once")
    dropout: bool = False
    attention_head_dim: int | None = Field(
        None, gt=0, le=2**14, description="each head's width where it is not hidden / num_heads "
        "(config.json's head_dim: Qwen3-32B's 64 heads of 128 on a hidden of 5120); q and the "
        "attention output are num_heads x head_dim wide. None: hidden / num_heads")
    qk_norm: bool = Field(False, description="an RMSNorm over each head of q and of k after their "
                          "projections, before RoPE (Qwen3: q_norm and k_norm of head_dim each)")
    num_experts: int = Field(0, ge=0, le=MAX_EXPERTS, description="0 for a dense model")
    experts_per_token: int = Field(0, ge=0, le=MAX_EXPERTS)
    total_params: int | None = Field(
        None, gt=0, le=MAX_PARAMS, description="set only for a model synthesized from a bare --params count"
    )
    published_params: int | None = Field(None, gt=0, le=MAX_PARAMS)
    source: str = ""

    @model_validator(mode="after")
    def _check(self) -> ModelSpec:
        if self.attention_head_dim is None and self.hidden % self.num_heads:
            raise ValueError(f"hidden {self.hidden} is not a multiple of num_heads {self.num_heads}; "
                             "set attention_head_dim if the heads are not hidden / num_heads wide")
        if self.q_hidden > 2**20:
            raise ValueError(f"num_heads x attention_head_dim is {self.q_hidden:,}, over 2^20; check both")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}"
            )
        if self.qk_norm and self.norm != "rmsnorm":
            raise ValueError("qk_norm is an RMSNorm on q and k; set norm = \"rmsnorm\" or drop qk_norm")
        if self.num_experts and not 0 < self.experts_per_token <= self.num_experts:
            raise ValueError("experts_per_token must be in 1..num_experts for an MoE model")
        if self.num_layers * max(1, self.num_experts) > MAX_BLOCK_EXPERTS:
            raise ValueError(f"num_layers x num_experts is {self.num_layers * self.num_experts:,}, over "
                             f"the limit of {MAX_BLOCK_EXPERTS:,}; check both")
        if self.total_params is None:
            from .arch import param_count  # arch imports this module

            psi = param_count(self)
            if psi > MAX_PARAMS:
                raise ValueError(f"the architecture has {psi:.3g} parameters, over the limit of "
                                 f"{MAX_PARAMS:.0e}; check num_layers, hidden, ffn_hidden, vocab_size")
        return self

    @property
    def head_dim(self) -> int:
        return self.attention_head_dim or self.hidden // self.num_heads

    @property
    def q_hidden(self) -> int:
        """The width of q and of the attention output (the output projection's input)."""
        return self.head_dim * self.num_heads

    @property
    def kv_hidden(self) -> int:
        return self.head_dim * self.num_kv_heads


# The dtypes each slot can hold: weights that matmuls use and all-gathers move are floats (fp8
# for float8 training); gradients are reduced and master weights updated in 16 or 32 bits;
# optimizer states may also be 8-bit (quantized states). Integer weights are a quantization
# format for inference, not a training dtype (int4 would make a 0-byte gather buffer).
SLOT_DTYPES: dict[str, tuple[str, ...]] = {
    "param": ("fp32", "tf32", "bf16", "fp16", "fp8"),
    "reduce": ("fp32", "tf32", "bf16", "fp16"),
    "master": ("fp32", "tf32", "bf16", "fp16"),
    "optimizer": ("fp32", "tf32", "bf16", "fp16", "fp8", "int8"),
}


class Precision(Spec):
    """Dtypes of each piece of training state.

    param: the working copy used in matmuls (and gathered under ZeRO-3 / FSDP2).
    reduce: gradients as reduced across ranks. master: the optimizer's copy of the weights.
    optimizer: the optimizer's state tensors (AdamW's m and v).
    Activations are kept in the param dtype (the dtype the matmuls run in).
    """

    param: DTypeName = "bf16"
    reduce: DTypeName = "fp32"
    master: DTypeName = "fp32"
    optimizer: DTypeName = "fp32"

    @model_validator(mode="after")
    def _slots_hold_training_dtypes(self) -> Precision:
        """SLOT_DTYPES for every reader (a plan file's int4 weights priced a 0-byte gather)."""
        for slot, allowed in SLOT_DTYPES.items():
            v = getattr(self, slot)
            if v not in allowed:
                raise ValueError(f"{slot} dtype {v} cannot hold that state in training; use one of: "
                                 f"{', '.join(allowed)}")
        return self


# DeepSpeed ZeRO-3's hooks, host seconds per module of its coordinator's trace beyond the model's
# own work: `python benchmarks/deepspeed_host.py` (DeepSpeed 0.19.8, torch 2.13, one gloo rank of
# the CPU accelerator on a 2-core 2.3 GHz AMD EPYC VM; partitioned linears of 147,456 and 589,824
# elements, extrapolated to none: the per-element part, gradient copies into the buckets, is a GPU's
# kernels): forward 0.22 ms, backward 0.32 ms (at width 384 alone: 0.23, 0.71); docs/accuracy-notes.md 9cr
DEEPSPEED_HOOK_FORWARD_S = 0.22e-3
DEEPSPEED_HOOK_BACKWARD_S = 0.32e-3


class Assumptions(Spec):
    """Figures zplan cannot derive; every one is printed and can be changed."""

    compute_efficiency: float | None = Field(
        None, gt=0, le=1, description="achieved fraction of dense peak FLOP/s for all FLOPs (a "
        "user assumption); None: the per-op kernel model of the GPU preset")
    cuda_context_bytes: int = Field(
        600 * 2**20, ge=0, le=MAX_MEMORY_BYTES, description="device memory outside PyTorch's caching allocator, per GPU: the CUDA context, NCCL's buffers, the libraries' own (cuBLAS's workspaces are inside the allocator)"
    )
    fragmentation: float | None = Field(
        None, ge=0, lt=1, description="flat allocator fragmentation, fraction of allocated bytes; "
        "None: the caching-allocator model (zplan/allocator.py)"
    )
    expandable_segments: bool = Field(
        False, description="PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True (PyTorch's default: "
        "off; torchtitan's launcher sets it): each stream's pool one segment mapped in 20 MiB pages")
    ddp_bucket_bytes: int = Field(25 * 2**20, ge=0, le=MAX_MEMORY_BYTES, description="DDP gradient bucket size")
    loss_fp32: bool = Field(True, description="logits upcast to fp32 for the loss")
    overlap: bool = Field(True, description="communication runs concurrently with compute")
    deepspeed_hook_forward_s: float = Field(
        DEEPSPEED_HOOK_FORWARD_S, ge=0, le=0.1, description="DeepSpeed ZeRO-3: the host's time in "
        "its hooks per module of the coordinator's trace in forward (fetch and release), beyond the "
        "model's own work; the host runs at most three fetch events ahead of the GPU, so a module "
        "whose kernels take less is paced by it. Measured on a CPU (benchmarks/deepspeed_host.py)")
    deepspeed_hook_backward_s: float = Field(
        DEEPSPEED_HOOK_BACKWARD_S, ge=0, le=0.1, description="the same in backward (fetch, release "
        "and each parameter's gradient hook)")


class TrainSpec(Spec):
    """One training configuration on the model."""

    @model_validator(mode="before")
    @classmethod
    def _loss_follows_compile(cls, data: Any) -> Any:
        """A spec written before `compile_loss` existed (plan files) meant a compiled loss with
        `compile`, as the time model then priced it: a missing field follows `compile`."""
        if isinstance(data, dict) and "compile_loss" not in data:
            data = {**data, "compile_loss": bool(data.get("compile", False))}
        return data

    seq_len: int = Field(4096, gt=0, le=MAX_SEQ_LEN)
    micro_batch: int = Field(1, gt=0, le=MAX_MICRO_BATCH)
    grad_accum: int = Field(1, gt=0, le=MAX_GRAD_ACCUM)
    checkpointing: Checkpointing = "none"
    checkpoint_every: int = Field(2, gt=0, le=MAX_LAYERS, description="every-k: one block in k is checkpointed")
    checkpoint_first: int = Field(1, gt=0, le=MAX_LAYERS, description="first-k: the first k blocks are "
                                  "checkpointed, the others keep their activations (Megatron's "
                                  "--recompute-method block, YaFSDP's num-ckpt-layers)")
    flash_attention: bool = True
    attention_kernel: AttentionKernel = Field(
        "flash2", description="the flash kernel: flash2 (FlashAttention-2, PyTorch's SDPA flash "
        "backend), flash-triton (FlashAttention in Triton, as llm-foundry's attn_impl: triton) or "
        "flash3 (FlashAttention-3, Hopper GPUs: flash-attn's hopper kernels, HF's "
        "attn_implementation flash_attention_3), flash4 (FlashAttention-4, Blackwell GPUs: "
        "flash-attn's cute kernels, HF's attn_implementation flash_attention_4), flex "
        "(FlexAttention's Triton kernels, torchtitan's default attention in 2026) or cudnn "
        "(cuDNN's fused attention, SDPA's cudnn backend: SDPA's first choice on Hopper and Blackwell "
        "with a cuDNN newer than 9.15, as under torch 2.9, and torchtitan's from October 2025), "
        "flash1 (FlashAttention v1: flash-attn 1.x, and SDPA's flash backend in PyTorch 2.0 and "
        "2.1) or efficient (xformers' memory-efficient kernel, SDPA's efficient backend, under an "
        "explicit attention mask, as Hugging Face's padded batches: the whole s x s square)")
    optimizer: OptimizerName = "adamw"
    optimizer_kernels: OptimizerKernels = Field(
        "fused", description="how AdamW's (and SGD's) step runs: fused (one multi-tensor kernel: "
        "torch.optim.AdamW(fused=True), DeepSpeed's FusedAdam), foreach (torch's multi-tensor "
        "ops, the default on CUDA without fused=True) or single (a loop over parameters: "
        "foreach=False, Composer's DecoupledAdamW)")
    grad_clip: bool = Field(True, description="gradients clipped by their global norm every "
                            "step (clip_grad_norm_: read each gradient, then scale it)")
    precision: Precision = Precision()
    layout: Layout = Field(
        "zero", description="zero: the ZeRO paper / DeepSpeed layout; torch: DDP, ZeRO-RO and FSDP2"
    )
    ddp_bucket_view: bool = Field(
        True, description="DDP (and ZeRO-1 on it, torch layout) keeps each `.grad` as a view of its "
        "reduce bucket (gradient_as_bucket_view=True: zplan's trainer); False: PyTorch's default, "
        "and accelerate's and Lightning's: `.grad` a tensor of its own beside the buckets, made in "
        "backward and copied into them, so twice the gradients by the optimizer step")
    logits_kept: bool = Field(
        True, description="the training loop holds the logits until backward returns (zplan's "
        "trainer, a loop that keeps a Hugging Face output beside its loss); False: it drops them "
        "before backward (torchtitan's `del pred`; HF Trainer's compute_loss returns the loss alone)")
    logits_fp32: bool = Field(
        False, description="the model returns its logits in fp32, upcast after the head "
        "(torchtitan's Transformer, `self.output(h).float()` until e10cb94, October 2024): the loss "
        "gets fp32 logits and a loop that keeps them keeps them in fp32; False: the head's dtype, "
        "the loss upcasts its own copy. Hugging Face transformers' ...ForCausalLM before 4.45 "
        "upcast too but computed the loss inside the model on a shifted copy, which is not priced")
    kv_cache: bool = Field(
        False, description="the model returns every layer's keys and values with its logits (Hugging "
        "Face's use_cache, on in training unless HF's own gradient checkpointing is enabled): each "
        "layer's post-RoPE keys and its values stay referenced for as long as the loop holds the "
        "output (`logits_kept`, `outputs_until_next_forward`); False: none returned")
    attention_expands_kv: bool = Field(
        False, description="the attention copies each key/value head to every query head that shares "
        "it before the kernel (Hugging Face's repeat_kv ahead of SDPA: transformers before 4.54, or "
        "torch before 2.5, and later releases wherever a 4-D mask reaches SDPA: padded batches, "
        "sliding-window layers; an all-ones mask is dropped first; HF's eager attention always; "
        "torchtitan's repeat_kv until ff0829c, 2026-01-27; KempnerForge's repeat_interleave), so "
        "the kernel saves keys and values q heads wide; False: grouped keys and values reach the "
        "kernel (SDPA's enable_gqa, flash-attn, the trainer's default). Compiled too: torch.compile's "
        "partitioner keeps the copies (tests/test_memory.py)")
    attention_heads_first: bool = Field(
        False, description="q reaches the attention kernel (b, heads, s, d)-contiguous in memory "
        "(litgpt's CausalSelfAttention: the fused projection's heads reshaped into copies, RoPE and "
        "a cat, all heads-first, before SDPA), so the flash kernel, which allocates its output like "
        "q (torch/_meta_registrations.py, meta__scaled_dot_product_flash_attention: "
        "`empty_like(query.transpose(1, 2))`), writes it heads-first and the output projection "
        "keeps a contiguous (b, s, heads x d) copy: the attention's width in the activation dtype "
        "more a token a block; False: q (b, s, heads, d) in memory (Hugging Face, torchtitan, the "
        "trainer: RoPE before the heads move), the projection reads a view of the kernel's output. "
        "FlashAttention-2 (flash2) uncompiled only")
    loss_shifted_copy: bool = Field(
        False, description="the loss runs on a shifted contiguous copy of the model's fp32 logits "
        "(`shift_logits = logits[..., :-1, :].contiguous()`: Hugging Face transformers' causal-LM "
        "loss in the versions that shift the logits, 4.31 for one; later ones shift the labels): "
        "one more fp32 logit tensor in the loss's forward, and a zero-filled one in its backward; "
        "needs logits_fp32 (those versions upcast in the model) and an eager loss")
    outputs_until_next_forward: bool = Field(
        False, description="the loop holds a micro-batch's output (logits, and the cache with "
        "`kv_cache`) until the next forward returns: `outputs = model(**batch)` at the top of the "
        "loop, the loss computed inside the model (Hugging Face with labels), so the previous "
        "output is alive through the next forward and its loss; False: until backward returns "
        "(`logits_kept`) or not at all")
    deepspeed_defaults: bool = Field(
        False, description="zero layout, ZeRO-3: the run leaves DeepSpeed's stage-3 buckets at their "
        "defaults (each submodule's parameters gathered as it runs, 5e7 elements prefetched, "
        "gradients copied into a 5e8-element bucket); False: a unit at a time, as zplan's export "
        "writes them")
    zero_init: bool = Field(
        True, description="zero layout, ZeRO-3: the model is built under deepspeed.zero.Init (HF "
        "Trainer, accelerate's zero3_init_flag), so no GPU ever holds it whole; False: built "
        "without it, deepspeed.initialize first moves the whole model to each GPU "
        "(runtime/engine.py _configure_distributed_model) and only then partitions it")
    deepspeed_sub_group: int = Field(
        DEEPSPEED_SUB_GROUP_ELEMS, gt=0, le=10**15, description="zero layout, ZeRO-3: DeepSpeed's sub_group_size "
        "(elements, its default 1e9): the optimizer steps the rank's partition in sub-groups, each "
        "closed once it holds this many elements or more (stage3.py _create_fp16_sub_groups), and "
        "makes the fp32 gradient of one sub-group at a time")
    deepspeed_bucket_allreduce: bool = Field(
        True, description="zero layout, ZeRO-1/2: DeepSpeed reduces each gradient bucket with one "
        "all-reduce, every rank then keeping its own partition (use_multi_rank_bucket_allreduce, "
        "its default since v0.12.4, PR #4695: stage_1_and_2.py average_tensor -> "
        "allreduce_and_scatter), twice a reduce-scatter's bytes; False: one reduce per owning "
        "rank's slice of the bucket (the key false, or DeepSpeed before 0.12.4), about a "
        "reduce-scatter's bytes, as the ZeRO paper has it")
    deepspeed_param_groups: DeepSpeedParamGroups = Field(
        "one", description="zero layout, ZeRO-1/2: how DeepSpeed's optimizer holds the parameters. "
        "DeepSpeed from 0.19.0 (stage_1_and_2.py flatten_on_accelerator, PR #7828) flattens each "
        "group on the GPU where it has room and leaves the parameters' own blocks cached, but runs "
        "empty_cache before each group: one (a config with an optimizer block, as zplan's export "
        "writes, under HF Trainer or accelerate, which pass a flat parameter list; "
        "deepspeed.initialize(model_parameters=model.parameters())): every parameter's block stays "
        "cached, reserved through training; split (an optimizer built with decay/no-decay groups, "
        "HF Trainer's own when the config has none; or DeepSpeed before 0.19, which flattened on "
        "the host after an empty_cache): only the last group's norms and biases stay, not counted")
    sac_saves_attention: bool = Field(
        True, description="selective checkpointing keeps the attention kernel's output and "
        "logsumexp (torchtitan's op-level SAC, zplan's trainer); False: the run's save list misses "
        "its kernel (torchtitan before b39377f, 2025-12, with cuDNN's attention), so the block keeps "
        "neither and reruns the attention forward in backward")
    fused_norm: bool = Field(
        True, description="RMSNorm saves its input and rstd (fused kernel); False: the composite "
        "fp32 implementation (CPU) also saves the fp32 input and normalized output")
    norm_output_fp32: bool = Field(
        True, description="with fused_norm off, the composite norm keeps its normalized output in "
        "fp32 (F.rms_norm's fallback, the trainer on CPU ranks); False: in the input's dtype (a "
        "module that casts back before the weight, torchtitan's RMSNorm)")
    blocks_per_unit: int = Field(1, gt=0, le=MAX_LAYERS)
    embed_head_unit: EmbedHeadUnit = Field(
        "separate", description="FSDP: separate (embeddings, and final norm + head, are units of "
        "their own, each resharded after forward: zplan's trainer); head-kept (units of their own, "
        "norm + head kept gathered from its forward to its backward: torchtitan since 2025-07 and "
        "accelerate's FSDP2 by default); root (both left to the root unit, resharded after forward: "
        "FSDP2 on PyTorch >= 2.8 given reshard_after_forward, the loss computed outside the "
        "model); root-kept (left to the root, which stays gathered from its forward to its "
        "backward: FSDP1, e.g. HF Trainer / accelerate / Composer, and FSDP2 before PyTorch 2.8, "
        "e.g. torchtitan until 2025-07); head-root-kept (the embeddings a unit of their own, norm + "
        "head left to the kept root: FSDP1 auto-wrapping the embedding module besides the decoder "
        "layers). Tied embeddings are always in the root")
    reshard_after_forward: bool = True
    last_block_kept: bool = Field(
        False, description="FSDP: the unit of the last block stays gathered from its forward to "
        "its backward (reshard_after_forward=False on it alone, since backward would gather it "
        "again at once: torchtitan from PR #165, 2024-03, until 83e6941, 2025-07); False: it "
        "reshards like every block")
    prefetch: bool = True
    reduce_every_microbatch: bool = Field(
        True, description="reduce-scatter on every micro-batch (False: only the last; holds grads)"
    )
    checkpoint_early_stop: bool = Field(
        True, description="checkpointed blocks stop recomputing once backward's saved tensors are "
        "rebuilt (non-reentrant torch.utils.checkpoint since PyTorch 2.1): a dense block's last "
        "matmul is not rerun; False: reentrant checkpoint or older PyTorch rerun the whole block")
    checkpoint_wraps_unit: bool = Field(
        False, description="FSDP1: the checkpoint wraps each sharded unit's call from outside "
        "(Hugging Face's gradient_checkpointing_enable before transformers 4.52); with a reentrant "
        "checkpoint the recompute gathers the unit and frees it, and its backward gathers it "
        "again, neither prefetched (policy.regathers_for_recompute)")
    fsdp1: bool = Field(
        False, description="PyTorch's FullyShardedDataParallel (FSDP1: flat parameters, the "
        "parameters views of the gathered buffer, no copy-out; backward concatenates the unit's "
        "gradients, casts them to the reduce dtype and pre-divides them in place) instead of "
        "fully_shard (FSDP2, zplan's trainer): the copies around the collectives priced as FSDP1 "
        "runs them (unit_ops.fsdp_copies); its memory is priced as FSDP2's, and what it keeps "
        "gathered (its root) is --embed-head-unit's; the torch layout's FSDP strategies")
    compile: bool = Field(False, description="torch.compile: elementwise work fused")
    compile_loss: bool = Field(False, description="the loss under torch.compile: the fp32 upcast, "
                               "log-softmax and NLL fused, no vocabulary-sized fp32 buffers "
                               "(torchtitan compiles it with --training.compile since 2025-04)")
    fused_loss: bool = Field(
        False, description="the loss is one fused cross-entropy kernel without torch.compile "
        "(flash-attn's, as llm-foundry's default loss_fn fused_crossentropy): logits kept, their "
        "gradient written in their dtype, as a compiled loss")
    loss_chunks: int = Field(
        1, ge=1, le=64, description="the eager cross-entropy runs over the whole logits in this "
        "many sequence chunks in turn (torchtitan's chunked_cross_entropy_loss, PR 996, after "
        "torchtune's CEWithChunkedOutputLoss): each chunk flattened, upcast and reduced on its own, "
        "so one chunk's fp32 copy and gradients are alive at a time beside every chunk's saved "
        "log-softmax output; the logits' gradient is gathered from the chunks' at the end "
        "(torch.chunk's backward). 1: one cross-entropy over all the logits")
    linear_loss: LinearLoss = Field(
        "none", description="the output projection and the cross-entropy computed together, "
        "chunk by chunk of tokens, the gradients of the head's input and weight made in the "
        "forward: the logits are never kept whole. chunked: the trainer's (--linear-loss chunked, "
        "torch ops, an fp32 working copy of each chunk's logits); liger: Liger-Kernel's fused "
        "linear cross-entropy (Triton, the chunk's gradient written in place, the weight gradient "
        "accumulated through an fp32 copy); none: the logits are materialised")
    fused_swiglu: bool = Field(
        False, description="SwiGLU's silu and product in one kernel that saves its two inputs and "
        "recomputes silu in backward (Liger-Kernel's LigerSiLUMulFunction): three MLP-wide tensors "
        "kept per block, not four")
    compile_scope: CompileScope = Field(
        "block", description="what one torch.compile covers: block (each block compiled on its own: "
        "torchtitan) or model (torch.compile(model): one graph over a model no DDP/FSDP wraps, so "
        "its backward returns every gradient at once; KempnerForge on one GPU)")
    float8: bool = Field(False, description="float8 linears (tensorwise scaling) with float8 "
                         "all-gather of their weights (torchao)")
    float8_recipe: Float8Recipe = Field(
        "tensorwise", description="with float8: tensorwise (torchao's dynamic tensorwise scaling: "
        "an amax pass, then the cast), rowwise (torchao's rowwise recipe: a scale per row of each "
        "operand along the GEMM's reduction axis, so backward casts again; weights gathered in the "
        "param dtype), rowwise-gw-hp (torchao's rowwise_with_gw_hp: as rowwise, with the weight "
        "gradient's GEMM in 16 bits) or te-delayed (TransformerEngine's delayed scaling, the "
        "cast and its transpose in one kernel from the previous amax; its linears keep their "
        "inputs and weights in float8 for backward; FSDP gathers the weights in the param dtype)")
    float8_all_gather: bool = Field(True, description="tensorwise float8: FSDP gathers the block "
                                    "weights in float8 (torchao's enable_fsdp_float8_all_gather)")
    autocast: bool = Field(
        False, exclude=True, description="set by Scenario.for_strategy, never written: DDP and "
        "ZeRO-1 in the torch layout with a param dtype below the master dtype run under "
        "torch.autocast on weights kept in the master dtype (the trainer's parallel.py)")


    @model_validator(mode="after")
    def _options_agree(self) -> "TrainSpec":
        """optimizer_kernels names torch's AdamW implementations (DeepSpeed, the zero layout, runs
        its FusedAdam, other optimizers their own); a linear loss is not also a compiled or fused
        one; TransformerEngine's float8 only where its saved tensors are modelled."""
        if self.optimizer_kernels != "fused" and (self.layout != "torch" or self.optimizer not in ("adamw", "sgd")):
            raise ValueError(f"optimizer_kernels {self.optimizer_kernels} applies to AdamW and SGD in the torch "
                             f"layout, not {self.optimizer} in the {self.layout} layout")
        if self.layout == "zero" and self.embed_head_unit != "separate":
            raise ValueError(f"embed_head_unit {self.embed_head_unit} is how FSDP groups its units; "
                             "DeepSpeed (the zero layout) gathers module by module")
        if not self.logits_kept and self.linear_loss != "none":
            raise ValueError(f"logits_kept false: linear_loss {self.linear_loss} never makes the logits whole")
        if self.layout == "zero" and self.last_block_kept:
            raise ValueError("last_block_kept is how FSDP reshards its units; DeepSpeed (the zero "
                             "layout) gathers module by module")
        if self.logits_fp32 and self.linear_loss != "none":
            raise ValueError(f"logits_fp32: linear_loss {self.linear_loss} never makes the logits whole")
        if self.loss_chunks > 1 and (self.loss_fused or self.linear_loss != "none" or self.logits_fp32
                                     or self.loss_shifted_copy):
            raise ValueError(f"loss_chunks {self.loss_chunks} prices an eager cross-entropy over the "
                             "head's logits, chunk by chunk; not a compiled, fused or linear loss, fp32 "
                             "logits from the model or a shifted copy")
        if self.seq_len % self.loss_chunks:
            raise ValueError(f"loss_chunks {self.loss_chunks} does not divide seq_len {self.seq_len}")
        if self.attention_heads_first and (self.compile or self.attention_kernel != "flash2"
                                           or not self.flash_attention):
            raise ValueError("attention_heads_first prices an uncompiled FlashAttention-2 kernel (SDPA's "
                             "flash, which allocates its output like q), not "
                             + ("a compiled block" if self.compile else "the math path (copied anyway)"
                                if not self.flash_attention else f"attention_kernel {self.attention_kernel}"))
        if self.loss_shifted_copy and not (self.logits_fp32 and not self.loss_fused):
            raise ValueError("loss_shifted_copy prices Hugging Face's eager loss on the model's fp32 "
                             "logits: it needs logits_fp32 and no compiled or fused loss")
        if self.outputs_until_next_forward and not self.logits_kept:
            raise ValueError("outputs_until_next_forward holds the output past backward: it needs "
                             "logits_kept (drop --no-logits-kept)")
        if self.outputs_until_next_forward and self.linear_loss != "none":
            raise ValueError(f"outputs_until_next_forward: linear_loss {self.linear_loss} returns no logits")
        if self.layout == "zero" and not self.reduce_every_microbatch:
            # engine.py no_sync asserts not zero_optimization_partition_gradients(); stages 0-1
            # reduce at the accumulation boundary anyway
            raise ValueError("reduce_every_microbatch false: DeepSpeed decides (ZeRO-2/3 reduce every "
                             "micro-batch, its no_sync refuses them; stages 0-1 reduce once per step "
                             "anyway): drop --reduce-last-only for the zero layout")
        if self.layout == "torch" and self.deepspeed_defaults:
            raise ValueError("deepspeed_defaults is about DeepSpeed's config (the zero layout)")
        if self.layout == "torch" and not self.zero_init:
            raise ValueError("zero_init false is about DeepSpeed's initialize (the zero layout)")
        if self.layout == "torch" and self.deepspeed_sub_group != DEEPSPEED_SUB_GROUP_ELEMS:
            raise ValueError("deepspeed_sub_group is about DeepSpeed's ZeRO-3 optimizer (the zero layout)")
        if self.layout == "torch" and not self.deepspeed_bucket_allreduce:
            raise ValueError("deepspeed_bucket_allreduce false is about DeepSpeed's ZeRO-1/2 (the zero layout)")
        if not self.deepspeed_bucket_allreduce and self.optimizer == "muon":
            # stage_1_and_2.py average_tensor all-reduces a Muon matrix split over owners whatever the key
            raise ValueError("deepspeed_bucket_allreduce false with Muon: DeepSpeed all-reduces the matrices "
                             "its partitions split anyway, which the per-owner pricing does not count")
        if self.layout == "torch" and self.deepspeed_param_groups != "one":
            raise ValueError("deepspeed_param_groups is about DeepSpeed's ZeRO-1/2 optimizer (the zero layout)")
        if self.linear_loss != "none" and self.loss_fused:
            raise ValueError(f"linear_loss {self.linear_loss} computes the loss itself; it is "
                             f"not also {'compiled' if self.compile_loss else 'a fused cross-entropy'}")
        if self.te_float8 and (self.compile or self.checkpointing in TE_FLOAT8_UNMODELLED):
            raise ValueError("float8_recipe te-delayed: what TransformerEngine's linears keep under "
                             f"{'compile' if self.compile else self.checkpointing + ' checkpointing'} is "
                             "not modelled")
        return self

    @property
    def float8_gather(self) -> bool:
        """FSDP all-gathers block weights in float8 (torchao tensorwise with float8 all-gather)."""
        return self.float8 and self.float8_recipe == "tensorwise" and self.float8_all_gather

    @property
    def te_float8(self) -> bool:
        """TransformerEngine's delayed-scaling float8 linears."""
        return self.float8 and self.float8_recipe == "te-delayed"

    @property
    def attention_out_view(self) -> bool:
        """The attention kernel's output is (b, s, heads, d) in memory, read by the output
        projection as a view: flash-attn's and the Triton kernel's layout, and SDPA's flash
        kernel's wherever q is (b, s, h, d) in memory (it allocates its output like q:
        `empty_like(query)`, torch/_meta_registrations.py), as in HF's and torchtitan's
        attention and the trainer's (RoPE before the heads move). Without flash attention the
        math path's (b, heads, s, d) output is transposed into a contiguous copy first, as is
        the flash kernel's where q is heads-first in memory (`attention_heads_first`)."""
        return self.flash_attention and not self.attention_heads_first

    @property
    def loss_fused(self) -> bool:
        """The loss runs as fused kernels (compiled, or a fused cross-entropy kernel)."""
        return self.compile_loss or self.fused_loss

    @property
    def logits_unreferenced(self) -> bool:
        """No reference to the logits outlives the loss's backward: the loop drops its own
        (`logits_kept` False), and an eager loss keeps none while a compiled or fused one frees
        its saved logits when its backward ends."""
        return not self.logits_kept and self.linear_loss == "none"

    @property
    def logits_dropped(self) -> bool:
        """The logits are freed before the loss's backward: the loop drops its reference
        (`logits_kept` False) and an eager loss keeps none for backward (log_softmax saves its
        output; a compiled or fused loss saves the logits themselves)."""
        return not self.logits_kept and not self.loss_fused and self.linear_loss == "none"


class Hardware(Spec):
    gpu: GPUSpec
    cluster: ClusterSpec
    num_gpus: int = Field(gt=0, le=MAX_GPUS)

    @property
    def num_nodes(self) -> int:
        return -(-self.num_gpus // self.cluster.gpus_per_node)
