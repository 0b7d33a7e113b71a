"""The scenario factory: user-level options (as typed on the command line or in zplan.toml)
validated and assembled into a Scenario. Library code: the CLI, verify, launch and the tests call
it; it never imports the CLI. Every bad value raises one UsageError line naming it and the fix.
"""

from __future__ import annotations

import typing
from contextlib import contextmanager
from dataclasses import dataclass, fields, replace
from typing import Any, ClassVar, Optional

from . import arch, presets
from . import kernels as K
from .kernels import BLACKWELL_PRESETS, HOPPER_PRESETS
from .errors import UsageError
from .files import read_toml
from .parse import MAX_GPUS, check_choice, check_range, parse_count
from .scenario import Scenario
from .strategies import effective
from .specs import (ATTENTION_KERNELS, CHECKPOINTING, COMPILE_SCOPES, DEEPSPEED_HOOK_BACKWARD_S, DEEPSPEED_HOOK_FORWARD_S, DEEPSPEED_PARAM_GROUPS, DEEPSPEED_SUB_GROUP_ELEMS, EmbedHeadUnit, FLOAT8_RECIPES, LINEAR_LOSSES, MAX_LAYERS, OPTIMIZER_KERNELS, TE_FLOAT8_UNMODELLED, SLOT_DTYPES, Assumptions, Hardware,
                    Precision, TrainSpec, validation_line)
from .units import DTYPE_BITS, MiB, GiB
from .validated import ValidationError

DTYPES = tuple(DTYPE_BITS)
DEFAULT_CLUSTER = "dgx-h100"
GPU_CONTEXT_GIB = 600 / 1024  # memory outside the caching allocator: CUDA context, NCCL (Assumptions.cuda_context_bytes)


@dataclass
class ScenarioOptions:
    """Every model, hardware and training option, with the CLI's defaults (help: zplan/cli/options.py).
    `given`: the options the user set (a flag on the command line, or zplan.toml), where the
    reader knows them; recommend searches only what is not given (recommend.PINNABLE)."""

    given: ClassVar[frozenset[str]] = frozenset()  # set per instance by the CLI's readers

    params: Optional[str] = None
    unit_params: Optional[str] = None
    model: Optional[str] = None
    gpus: Optional[str] = None
    gpu: Optional[str] = None
    cluster: Optional[str] = None  # None: the GPU preset's own node (resolve_hardware), dgx-h100 without --gpu
    gpus_per_node: Optional[int] = None
    seq_len: Optional[int] = None
    micro_batch: int = 1
    grad_accum: int = 1
    reduce_last_only: bool = False
    checkpointing: str = "none"
    checkpoint_every: int = 2
    checkpoint_first: int = 1
    checkpoint_early_stop: bool = True
    checkpoint_wraps_unit: bool = False  # the checkpoint outside the sharded unit (HF's)
    fsdp1: bool = False  # PyTorch's FullyShardedDataParallel, not fully_shard
    flash: bool = True
    attention_kernel: str = "flash2"
    optimizer: str = "adamw"
    param_dtype: str = "bf16"
    reduce_dtype: str = "fp32"
    master_dtype: str = "fp32"
    optimizer_dtype: str = "fp32"
    layout: Optional[str] = None  # None: zero for estimate; recommend plans for its runner (--for)
    blocks_per_unit: int = 1
    embed_head_unit: str = "separate"  # FSDP: separate | head-kept | root | root-kept | head-root-kept (TrainSpec)
    prefetch: bool = True
    fused_norm: Optional[bool] = None
    norm_output_fp32: bool = True
    compile: bool = False
    eager_loss: bool = False  # with compile: the loss stays eager (compile_loss False)
    compile_scope: str = "block"  # with compile: block (each block) or model (torch.compile(model))
    loss_fp32: bool = True
    fused_loss: bool = False
    linear_loss: str = "none"  # none | chunked | liger (TrainSpec.linear_loss)
    loss_chunks: int = 1  # the eager cross-entropy over this many sequence chunks (TrainSpec)
    fused_swiglu: bool = False
    qkv_fused: Optional[bool] = None  # q, k and v run as one linear (ModelSpec.qkv_fused); None: the model's layout
    optimizer_kernels: str = "fused"  # fused | foreach | single (TrainSpec.optimizer_kernels)
    grad_clip: bool = True
    sac_saves_attention: bool = True  # TrainSpec.sac_saves_attention
    zero_init: bool = True  # zero layout, ZeRO-3: the model built under deepspeed.zero.Init
    deepspeed_param_groups: str = "one"  # zero layout, ZeRO-1/2: one | split (TrainSpec)
    deepspeed_bucket_allreduce: bool = True  # zero layout, ZeRO-1/2: each gradient bucket all-reduced (TrainSpec)
    deepspeed_sub_group: int = DEEPSPEED_SUB_GROUP_ELEMS  # zero layout, ZeRO-3: sub_group_size, elements (TrainSpec)
    deepspeed_defaults: bool = False  # zero layout, ZeRO-3: DeepSpeed's default buckets
    logits_kept: bool = True  # the loop holds the logits until backward returns (TrainSpec)
    ddp_bucket_view: bool = True  # DDP's gradients are views of its buckets (TrainSpec)
    logits_fp32: bool = False  # the model returns fp32 logits (TrainSpec)
    kv_cache: bool = False  # the model returns its keys and values (TrainSpec)
    attention_expands_kv: bool = False  # keys and values copied to every query head (TrainSpec)
    attention_heads_first: bool = False  # q heads-first in memory before the kernel (TrainSpec)
    loss_shifted_copy: bool = False  # the loss on a shifted copy of the fp32 logits (TrainSpec)
    outputs_until_next_forward: bool = False  # the loop holds an output into the next forward (TrainSpec)
    last_block_kept: bool = False  # FSDP keeps the last block gathered after forward (TrainSpec)
    float8: bool = False
    float8_recipe: str = "tensorwise"  # with float8: tensorwise | rowwise | rowwise-gw-hp | te-delayed (TrainSpec)
    float8_all_gather: bool = True
    shard_size: Optional[int] = None
    efficiency: Optional[float] = None
    context_gib: Optional[float] = None  # None: 600 MiB on a GPU, 0 on a CPU rank
    fragmentation: Optional[float] = None  # None: the caching-allocator model on a GPU, 0 on a CPU rank
    expandable_segments: bool = False  # the run sets PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
    bucket_mib: float = 25.0
    overlap: bool = True
    # DeepSpeed ZeRO-3's hooks on the host, ms per module (Assumptions.deepspeed_hook_*_s)
    deepspeed_hook_forward_ms: float = DEEPSPEED_HOOK_FORWARD_S * 1e3
    deepspeed_hook_backward_ms: float = DEEPSPEED_HOOK_BACKWARD_S * 1e3
    presets_dir: Optional[list[str]] = None


FIELDS = [f.name for f in fields(ScenarioOptions)]


def check_flag_pairs(o: ScenarioOptions, strategies: list[str] | tuple[str, ...] | None = None) -> None:
    """Refuse, in one line, what the user typed that the scenario would silently not use: a k of
    every-k or first-k under another mode, an attention kernel beside --no-flash. For the
    commands' own options only (build takes any combination: a plan's TrainSpec carries both k
    whatever its mode)."""
    defaults = ScenarioOptions()
    for flag, k, mode, default in (("--checkpoint-every", o.checkpoint_every, "every-k", defaults.checkpoint_every),
                                   ("--checkpoint-first", o.checkpoint_first, "first-k", defaults.checkpoint_first)):
        if k != default and k >= 1 and o.checkpointing != mode:  # out of range: build says so
            raise UsageError(f"{flag} {k} sets the k of --checkpointing {mode}, not of "
                             f"--checkpointing {o.checkpointing}: add --checkpointing {mode} or drop it")
    if not o.flash and o.attention_kernel != defaults.attention_kernel:
        raise UsageError(f"--no-flash prices attention without a flash kernel and --attention-kernel "
                         f"{o.attention_kernel} names one: drop one of them")
    if not o.ddp_bucket_view and (o.layout or "zero") == "zero":
        raise UsageError("--no-ddp-bucket-view describes PyTorch DDP's gradients (the torch layout); "
                         "DeepSpeed keeps its own buckets: drop it, or add --layout torch")
    if strategies and not o.ddp_bucket_view and not set(strategies) & {"ddp", "zero1"}:
        raise UsageError(f"--no-ddp-bucket-view describes DDP's gradients, and --strategy "
                         f"{' '.join(strategies)} runs no DDP: add --strategy ddp (or zero1) or drop it")
    if strategies and o.fsdp1 and not any(effective(x, o.layout or "zero").fsdp for x in strategies):
        raise UsageError(f"--fsdp1 prices FSDP's copies, and --strategy {' '.join(strategies)} shards no "
                         f"weights: add --strategy zero3 (or zero2, zero3-noreshard, hsdp, offload-all) or drop --fsdp1")
    if strategies and o.shard_size is not None and "hsdp" not in strategies:
        raise UsageError(f"--shard-size {o.shard_size} sets HSDP's shard group, and --strategy "
                         f"{' '.join(strategies)} has no hsdp: add --strategy hsdp or drop --shard-size")


def resolve_hardware(cluster_name: str | None, gpu_name: str | None, extra: tuple[str, ...] = ()):
    """The cluster and GPU presets a run plans for. --cluster names the node (links, network,
    GPUs per node) and, without --gpu, its GPU; --gpu alone plans for the node that GPU usually
    sits in (GPUSpec.cluster; a calibrated preset's, its base part's), not another GPU's node: an
    L40S planned on dgx-h100's NVSwitch and 400 Gb/s NICs would come out twice as fast; a GPU
    that names none, dgx-h100's (said as an assumption). Neither: dgx-h100 and its H100 SXM."""
    if cluster_name is not None:
        cluster = presets.cluster(cluster_name, extra)
        return cluster, presets.gpu(gpu_name or cluster.gpu or "h100-sxm", extra)
    if gpu_name is None:
        cluster = presets.cluster(DEFAULT_CLUSTER, extra)
        return cluster, presets.gpu(cluster.gpu or "h100-sxm", extra)
    gpu = presets.gpu(gpu_name, extra)
    # a GPU that names no node (h100-pcie, a file of the user's): dgx-h100's links, which
    # estimate states as an assumption (`node_links`) with the flag that changes them
    return presets.cluster(presets.home_cluster(gpu, extra) or DEFAULT_CLUSTER, extra), gpu


def build(o: ScenarioOptions, need_gpus: bool = True) -> Scenario:
    """Validate every option and assemble the Scenario; bad input raises one-line UsageErrors."""
    extra = tuple(o.presets_dir or ())
    if o.params is not None and o.model is not None:
        raise UsageError("give either --params or --model, not both")
    if o.unit_params is not None and o.params is None:
        raise UsageError("--unit-params goes with --params; a --model has its own units")
    gpus_found = None
    if o.gpu == "auto":
        from .hardware import detect

        found = detect()
        if not found.gpus:
            raise UsageError(f"--gpu auto found no GPU ({found.gpu_reason}); name one with --gpu, e.g. --gpu h100-sxm")
        if found.gpu_preset is None:
            names = ", ".join(sorted({g.name for g in found.gpus}))
            raise UsageError(f"--gpu auto found {names}, which has no preset; pass --gpu FILE.toml (zplan "
                             f"calibrate measures this GPU and writes one)")
        gpu_name, gpus_found = found.gpu_preset, len(found.gpus)
    else:
        gpu_name = o.gpu
    cluster, gpu = resolve_hardware(o.cluster, gpu_name, extra)
    if o.gpus_per_node is not None:
        check_range(o.gpus_per_node, "--gpus-per-node", 1, 1024)
        update: dict = {"gpus_per_node": o.gpus_per_node}
        if cluster.intra_node_allreduce_busbw_bytes_per_s and cluster.intra_node_allreduce_gpus is None:
            update["intra_node_allreduce_gpus"] = max(2, cluster.gpus_per_node)  # the figure stays the preset node's
        cluster = cluster.model_copy(update=update)
    if o.gpus is None:
        # one node; CPU ranks share one host, whose cpu-local preset allows 64: 8 as before
        n = gpus_found or (min(8, cluster.gpus_per_node) if gpu.device == "cpu" else cluster.gpus_per_node)
    else:
        n = parse_count(o.gpus, "--gpus", MAX_GPUS, integer=True, example="64")
    if o.model is not None:
        model = presets.model(o.model, extra)
    else:
        psi = parse_count(o.params if o.params is not None else "7e9", "--params")
        if psi < arch.SYNTHETIC_MIN_PARAMS:
            raise UsageError(f"--params {o.params} is below {arch.SYNTHETIC_MIN_PARAMS:,}, what the smallest decoder "
                             f"zplan can synthesize from a count holds (one block of width 128 with a 32,000-token "
                             f"embedding and head); pass --model for a small model (zplan presets: tiny, gpt2-124m)")
        unit = parse_count(o.unit_params, "--unit-params") if o.unit_params is not None else None
        if unit is not None and unit > psi:
            raise UsageError(f"--unit-params {o.unit_params} is larger than --params {o.params}; a unit is part of the model")
        if unit is not None and -(-psi // unit) > MAX_LAYERS:
            raise UsageError(f"--unit-params {o.unit_params} makes {-(-psi // unit):,} units of "
                             f"--params {o.params}, over the limit of {MAX_LAYERS:,}; use at least "
                             f"{-(-psi // MAX_LAYERS):,} parameters per unit")
        model = arch.synthetic(psi, unit)
    if o.qkv_fused is not None and o.qkv_fused != model.qkv_fused:
        model = model.model_copy(update={"qkv_fused": o.qkv_fused})
    if o.optimizer == "muon" and model.num_experts:
        raise UsageError(f"--optimizer muon with {model.name}: torch.optim.Muon takes 2-D parameters only, and an "
                         f"MoE block's experts are 3-D tensors (transformers 5.x, torchtitan): --optimizer adamw")
    seq = o.seq_len if o.seq_len is not None else min(4096, model.max_seq_len)
    check_range(seq, "--seq-len", 1, 10**7)
    if model.position == "learned" and seq > model.max_seq_len:
        # a learned position table has a row per position: a run at this length builds that many
        # (llm-foundry sets max_seq_len = the run's; GPT-2 at 4096 needs 4096 rows, not its 1024)
        model = model.model_copy(update={"max_seq_len": seq})
    check_range(o.micro_batch, "--micro-batch", 1, 10**5)
    check_range(o.grad_accum, "--grad-accum", 1, 10**6)
    check_range(o.blocks_per_unit, "--blocks-per-unit", 1, model.num_layers)
    check_range(o.checkpoint_every, "--checkpoint-every", 1, MAX_LAYERS)
    if o.checkpointing == "every-k" and o.checkpoint_every > model.num_layers:
        raise UsageError(f"--checkpointing every-k with --checkpoint-every {o.checkpoint_every} "
                         f"checkpoints no block of this {model.num_layers}-layer model; use "
                         f"--checkpoint-every 1..{model.num_layers}")
    check_range(o.checkpoint_first, "--checkpoint-first", 1, MAX_LAYERS)
    if o.checkpointing == "first-k" and o.checkpoint_first > model.num_layers:
        raise UsageError(f"--checkpointing first-k with --checkpoint-first {o.checkpoint_first} asks for "
                         f"more blocks than this {model.num_layers}-layer model has; use --checkpoint-first "
                         f"1..{model.num_layers} (all of them is --checkpointing full)")
    efficiency = o.efficiency
    if efficiency is None and gpu.kernels is None:  # no kernel constants: one efficiency
        efficiency = 1.0 if gpu.measured else 0.7
    if efficiency is not None:
        check_range(efficiency, "--efficiency", 0.01, 1.0)
    # a CPU rank has no CUDA context and no caching allocator: those defaults are GPU-only
    on_gpu = gpu.device != "cpu"
    context_gib = o.context_gib if o.context_gib is not None else (GPU_CONTEXT_GIB if on_gpu else 0.0)
    fragmentation = o.fragmentation if o.fragmentation is not None else (None if on_gpu else 0.0)
    if fragmentation is not None:
        check_range(fragmentation, "--fragmentation", 0.0, 0.9)
    check_range(context_gib, "--context-gib", 0.0, 1024)
    check_range(o.bucket_mib, "--bucket-mib", 0.0, 1e6)
    check_range(o.deepspeed_hook_forward_ms, "--deepspeed-hook-forward-ms", 0.0, 100.0)
    check_range(o.deepspeed_hook_backward_ms, "--deepspeed-hook-backward-ms", 0.0, 100.0)
    check_choice(o.checkpointing, "--checkpointing", CHECKPOINTING)
    check_choice(o.attention_kernel, "--attention-kernel", ATTENTION_KERNELS)
    if o.attention_kernel == "flash3" and not gpu.family.startswith(HOPPER_PRESETS):
        raise UsageError(f"--attention-kernel flash3 (FlashAttention-3) runs on Hopper GPUs "
                         f"({', '.join(HOPPER_PRESETS)}), not {gpu.name}: use flash2")
    if o.attention_kernel == "flash4" and not gpu.family.startswith(BLACKWELL_PRESETS):
        raise UsageError(f"--attention-kernel flash4 (FlashAttention-4) runs on Blackwell GPUs "
                         f"({', '.join(BLACKWELL_PRESETS)}), not {gpu.name}: use flash2")
    if o.attention_kernel == "cudnn" and K.cudnn_speed(gpu) is None:
        raise UsageError(f"--attention-kernel cudnn (cuDNN's fused attention) has published kernel rates for "
                         f"Hopper and Blackwell GPUs, not {gpu.name}: use flash2, or a preset zplan calibrate "
                         f"measured it on")
    if o.attention_kernel == "cudnn" and (model.head_dim % 8 or model.head_dim > 128):
        # PyTorch's check_cudnn_tensor_shapes: SDPA would fall back to another kernel
        raise UsageError(f"--attention-kernel cudnn: cuDNN's SDPA takes head dims that are multiples of 8 up "
                         f"to 128, not {model.head_dim} ({model.name}): use flash2")
    if o.attention_kernel == "flash1" and not gpu.family.startswith(K.AMPERE_PRESETS + K.HOPPER_PRESETS):
        raise UsageError(f"--attention-kernel flash1 (FlashAttention v1) is priced on A100 and H100-class "
                         f"GPUs (its benchmark), not {gpu.name}; use another --attention-kernel")
    if o.attention_kernel == "flash1" and model.head_dim > 128:
        raise UsageError(f"--attention-kernel flash1: FlashAttention v1 takes head dims up to 128, not "
                         f"{model.head_dim}; use another --attention-kernel")
    if o.attention_kernel in ("flash1", "efficient") and model.num_kv_heads != model.num_heads \
            and not o.attention_expands_kv:
        # SDPA's efficient gate takes no grouped key/value heads (check_batch_size_and_num_heads_dense
        # <false>), flash-attn 1.x has none: such a run copies them to the query heads first
        raise UsageError(f"--attention-kernel {o.attention_kernel} takes keys and values with one head per "
                         f"query head, and {model.name} groups {model.num_heads} query heads over "
                         f"{model.num_kv_heads}: such a run copies them first (Hugging Face's repeat_kv); "
                         f"add --attention-expands-kv")
    if o.attention_heads_first and (o.compile or o.attention_kernel != "flash2" or not o.flash):
        # SDPA's flash kernel allocates its output like q; what the partitioner keeps of the
        # copy under compile is not modelled; the math path copies its output anyway
        raise UsageError("--attention-heads-first prices an uncompiled FlashAttention-2 kernel (SDPA's flash, "
                         "which allocates its output like q), not "
                         + ("--compile: drop --compile or --attention-heads-first" if o.compile else
                            "--no-flash, whose output is copied anyway: drop --attention-heads-first" if not o.flash
                            else f"--attention-kernel {o.attention_kernel}: use --attention-kernel flash2, or drop "
                            "--attention-heads-first"))
    if o.attention_kernel == "flex" and K.flex_speed(gpu.family) is None:
        raise UsageError(f"--attention-kernel flex (FlexAttention) has published kernel rates for A100, "
                         f"Hopper and Blackwell GPUs, not {gpu.name}: use flash2")
    check_choice(o.optimizer, "--optimizer", ("adamw", "sgd", "adam8bit", "muon"))
    check_choice(o.optimizer_kernels, "--optimizer-kernels", OPTIMIZER_KERNELS)
    layout = o.layout or "zero"
    check_choice(layout, "--layout", ("zero", "torch"))
    if o.optimizer_kernels != "fused" and o.optimizer not in ("adamw", "sgd"):
        raise UsageError(f"--optimizer-kernels {o.optimizer_kernels} is one of torch's AdamW and SGD "
                         f"implementations; --optimizer {o.optimizer} is priced as its own: drop --optimizer-kernels")
    check_choice(o.embed_head_unit, "--embed-head-unit", typing.get_args(EmbedHeadUnit))
    if layout == "zero" and o.embed_head_unit != "separate":
        raise UsageError(f"--embed-head-unit {o.embed_head_unit} is how FSDP groups its units; DeepSpeed "
                         "(the zero layout) gathers module by module: plan FSDP (--layout torch, or "
                         "recommend --for zplan), or drop --embed-head-unit")
    if not o.logits_kept and o.linear_loss != "none":
        raise UsageError(f"--no-logits-kept: --linear-loss {o.linear_loss} never makes the logits "
                         "whole: drop --no-logits-kept")
    if layout == "zero" and o.last_block_kept:
        raise UsageError("--last-block-kept is how FSDP reshards its units; DeepSpeed (the zero "
                         "layout) gathers module by module: plan FSDP (--layout torch), or drop "
                         "--last-block-kept")
    if o.logits_fp32 and o.linear_loss != "none":
        raise UsageError(f"--logits-fp32: --linear-loss {o.linear_loss} never makes the logits "
                         "whole: drop --logits-fp32")
    if o.loss_shifted_copy and not o.logits_fp32:
        raise UsageError("--loss-shifted-copy prices Hugging Face's loss on the model's fp32 logits: "
                         "add --logits-fp32 (those versions upcast in the model)")
    if o.loss_shifted_copy and (o.fused_loss or (o.compile and not o.eager_loss)):
        raise UsageError("--loss-shifted-copy prices an eager loss: drop --fused-loss, or add "
                         "--eager-loss with --compile")
    if o.outputs_until_next_forward and not o.logits_kept:
        raise UsageError("--outputs-until-next-forward holds the output past backward, --no-logits-kept "
                         "drops it before: drop one")
    if o.outputs_until_next_forward and o.linear_loss != "none":
        raise UsageError(f"--outputs-until-next-forward: --linear-loss {o.linear_loss} returns no logits: "
                         "drop one")
    if o.logits_fp32 and not o.loss_fp32:
        raise UsageError("--logits-fp32: a model that returns fp32 logits gives the loss fp32 "
                         "logits: drop --no-loss-fp32")
    if o.checkpoint_wraps_unit and o.checkpointing in ("none", "attention"):
        raise UsageError(f"--checkpoint-wraps-unit: --checkpointing {o.checkpointing} wraps no block: "
                         "drop --checkpoint-wraps-unit, or checkpoint blocks (--checkpointing full)")
    if layout == "zero" and o.checkpoint_wraps_unit:
        raise UsageError("--checkpoint-wraps-unit is about FSDP's unshard around a checkpoint; DeepSpeed "
                         "(the zero layout) gathers from module hooks wherever the checkpoint sits: "
                         "plan FSDP (--layout torch), or drop --checkpoint-wraps-unit")
    if layout == "zero" and o.fsdp1:
        raise UsageError("--fsdp1 is PyTorch's FullyShardedDataParallel; DeepSpeed (the zero layout) "
                         "shards otherwise: plan FSDP (--layout torch), or drop --fsdp1")
    if layout == "torch" and o.deepspeed_defaults:
        raise UsageError("--deepspeed-defaults is about DeepSpeed's config (the zero layout); FSDP "
                         "(--layout torch) has no such buckets: drop --deepspeed-defaults")
    if not o.deepspeed_bucket_allreduce and o.optimizer == "muon":
        raise UsageError("--no-deepspeed-bucket-allreduce with --optimizer muon: DeepSpeed all-reduces every Muon "
                         "matrix its partitions split whatever the key (stage_1_and_2.py average_tensor), which "
                         "zplan does not price: drop --no-deepspeed-bucket-allreduce")
    if not 1 <= o.deepspeed_sub_group <= 10**15:
        raise UsageError(f"--deepspeed-sub-group {o.deepspeed_sub_group}: DeepSpeed's sub_group_size is a "
                         "positive element count (its default 1e9)")
    if layout == "torch" and o.deepspeed_sub_group != DEEPSPEED_SUB_GROUP_ELEMS:
        raise UsageError("--deepspeed-sub-group is DeepSpeed's ZeRO-3 sub_group_size (the zero layout): "
                         "drop it, or plan DeepSpeed (--layout zero)")
    if layout == "torch" and not o.deepspeed_bucket_allreduce:
        raise UsageError("--no-deepspeed-bucket-allreduce is about DeepSpeed's ZeRO-1/2 (the zero layout); "
                         "the torch layout (DDP, FSDP2) runs PyTorch's own reductions: drop "
                         "--no-deepspeed-bucket-allreduce, or plan for DeepSpeed (--layout zero, recommend --for deepspeed)")
    if layout == "torch" and not o.zero_init:
        raise UsageError("--no-zero-init is about deepspeed.initialize (the zero layout); FSDP "
                         "(--layout torch) never holds the whole model: drop --no-zero-init")
    check_choice(o.deepspeed_param_groups, "--deepspeed-param-groups", DEEPSPEED_PARAM_GROUPS)
    if layout == "torch" and o.deepspeed_param_groups != "one":
        raise UsageError(f"--deepspeed-param-groups {o.deepspeed_param_groups} is about DeepSpeed's "
                         "ZeRO-1/2 optimizer (the zero layout); FSDP (--layout torch) flattens "
                         "nothing: drop it")
    if layout == "zero" and o.optimizer_kernels != "fused":
        raise UsageError(f"--optimizer-kernels {o.optimizer_kernels} names one of torch's implementations; the "
                         "zero layout (DeepSpeed) runs its own (FusedAdam; torch.optim.SGD as its config builds it): "
                         "add --layout torch, or drop --optimizer-kernels")
    for flag, v in (("--param-dtype", o.param_dtype), ("--reduce-dtype", o.reduce_dtype),
                    ("--master-dtype", o.master_dtype), ("--optimizer-dtype", o.optimizer_dtype)):
        check_choice(v, flag, DTYPES)
        slot = flag[2:].removesuffix("-dtype")
        if v not in SLOT_DTYPES[slot]:
            what = {"param": "the working weights (matmuls, all-gathers)", "reduce": "reduced gradients",
                    "master": "master weights", "optimizer": "optimizer state"}[slot]
            raise UsageError(f"{flag} {v} cannot hold {what} in training; use one of: "
                             f"{', '.join(SLOT_DTYPES[slot])}")
    if o.eager_loss and not o.compile:
        raise UsageError("--eager-loss goes with --compile (without it the loss is eager already): "
                         "drop --eager-loss, or add --compile")
    check_choice(o.compile_scope, "--compile-scope", COMPILE_SCOPES)
    if o.compile_scope != "block" and not o.compile:
        raise UsageError(f"--compile-scope {o.compile_scope} goes with --compile: add --compile, "
                         "or drop --compile-scope")
    check_choice(o.linear_loss, "--linear-loss", LINEAR_LOSSES)
    if o.linear_loss != "none" and (o.fused_loss or (o.compile and not o.eager_loss)):
        flag = "--fused-loss" if o.fused_loss else "--compile (which compiles the loss)"
        raise UsageError(f"--linear-loss {o.linear_loss} computes the loss itself, so it is not also "
                         f"{flag}: drop one (with --compile, add --eager-loss)")
    if o.linear_loss != "none" and not o.loss_fp32:
        raise UsageError(f"--no-loss-fp32 describes the logits' upcast; --linear-loss {o.linear_loss} "
                         "computes each chunk in fp32 itself: drop --no-loss-fp32")
    if not 1 <= o.loss_chunks <= 64:
        raise UsageError(f"--loss-chunks {o.loss_chunks}: the loss runs over 1 to 64 sequence chunks")
    if o.loss_chunks > 1:
        other = ("--linear-loss " + o.linear_loss if o.linear_loss != "none" else "--fused-loss" if o.fused_loss
                 else "--compile (which compiles the loss; add --eager-loss)" if o.compile and not o.eager_loss
                 else "--logits-fp32" if o.logits_fp32 else "--loss-shifted-copy" if o.loss_shifted_copy else None)
        if other:
            raise UsageError(f"--loss-chunks {o.loss_chunks} prices an eager cross-entropy over the head's "
                             f"logits, chunk by chunk, not {other}: drop one")
        if seq % o.loss_chunks:
            raise UsageError(f"--loss-chunks {o.loss_chunks} does not divide the sequence length {seq}: "
                             "pick a divisor")
    if o.fused_swiglu and model.mlp != "swiglu":
        raise UsageError(f"--fused-swiglu fuses SwiGLU; {model.name} has a {model.mlp} MLP: drop it")
    check_choice(o.float8_recipe, "--float8-recipe", FLOAT8_RECIPES)
    if not o.float8 and (o.float8_recipe != "tensorwise" or not o.float8_all_gather):
        flag = f"--float8-recipe {o.float8_recipe}" if o.float8_recipe != "tensorwise" else "--no-float8-all-gather"
        raise UsageError(f"{flag} goes with --float8: add --float8, or drop {flag.split()[0]}")
    if o.float8 and o.float8_recipe.startswith("rowwise") and not o.float8_all_gather:
        raise UsageError(f"--no-float8-all-gather: --float8-recipe {o.float8_recipe} gathers in the "
                         "param dtype already (torchao's float8 all-gather is tensorwise's): drop it")
    if o.float8 and model.num_experts and o.float8_recipe != "te-delayed":
        raise UsageError(f"--float8 with {model.name}'s experts: torchao's float8 converter leaves "
                         "grouped experts in 16 bits, and zplan does not price a block of float8 and "
                         "16-bit weights; drop --float8 for an MoE model")
    if o.fsdp1 and o.float8 and o.float8_recipe == "tensorwise" and o.float8_all_gather:
        raise UsageError("--fsdp1 --float8: torchao's float8 all-gather hooks fully_shard (FSDP2); "
                         "FSDP1 gathers the param dtype: add --no-float8-all-gather, or drop --fsdp1")
    if o.float8 and o.float8_recipe == "te-delayed":
        if not o.float8_all_gather:
            raise UsageError("--no-float8-all-gather is torchao's switch; TransformerEngine "
                             "(--float8-recipe te-delayed) always gathers in the param dtype: drop it")
        if model.num_experts:
            raise UsageError(f"--float8-recipe te-delayed: zplan models TransformerEngine's dense "
                             f"linears, not {model.name}'s experts; drop --float8-recipe")
        if o.compile or o.checkpointing in TE_FLOAT8_UNMODELLED:
            what = "--compile" if o.compile else f"--checkpointing {o.checkpointing}"
            raise UsageError(f"--float8-recipe te-delayed with {what}: zplan does not model what "
                             "TransformerEngine's linears keep there; use none, full, every-k or first-k "
                             "checkpointing without --compile")
    if o.float8 and "fp8" not in gpu.peak_flops:
        raise UsageError(f"--float8 needs float8 tensor cores; {gpu.name} has none "
                         "(H100, H200, B200 and MI300X do): drop --float8 or pick such a --gpu")
    if o.shard_size is not None:
        check_range(o.shard_size, "--shard-size", 1, MAX_GPUS)
        if n % o.shard_size:
            raise UsageError(f"--shard-size {o.shard_size} does not divide --gpus {n}; pick a divisor of {n}")
    try:
        train = TrainSpec(
            seq_len=seq, micro_batch=o.micro_batch, grad_accum=o.grad_accum,
            checkpointing=o.checkpointing, checkpoint_every=o.checkpoint_every,
            checkpoint_first=o.checkpoint_first,
            checkpoint_early_stop=o.checkpoint_early_stop, checkpoint_wraps_unit=o.checkpoint_wraps_unit,
            fsdp1=o.fsdp1,
            flash_attention=o.flash, attention_kernel=o.attention_kernel, optimizer=o.optimizer,
            optimizer_kernels=o.optimizer_kernels, grad_clip=o.grad_clip,
            sac_saves_attention=o.sac_saves_attention,
            precision=Precision(param=o.param_dtype, reduce=o.reduce_dtype,
                                master=o.master_dtype, optimizer=o.optimizer_dtype),
            layout=layout, zero_init=o.zero_init, deepspeed_param_groups=o.deepspeed_param_groups, deepspeed_bucket_allreduce=o.deepspeed_bucket_allreduce, deepspeed_sub_group=o.deepspeed_sub_group, deepspeed_defaults=o.deepspeed_defaults, logits_kept=o.logits_kept, ddp_bucket_view=o.ddp_bucket_view, logits_fp32=o.logits_fp32, kv_cache=o.kv_cache, attention_expands_kv=o.attention_expands_kv, attention_heads_first=o.attention_heads_first, loss_shifted_copy=o.loss_shifted_copy, outputs_until_next_forward=o.outputs_until_next_forward, last_block_kept=o.last_block_kept, blocks_per_unit=o.blocks_per_unit, embed_head_unit=o.embed_head_unit, prefetch=o.prefetch,
            fused_norm=o.fused_norm if o.fused_norm is not None else gpu.device != "cpu",
            norm_output_fp32=o.norm_output_fp32,
            reduce_every_microbatch=not o.reduce_last_only,
            compile=o.compile, compile_loss=o.compile and not o.eager_loss,
            compile_scope=o.compile_scope, fused_loss=o.fused_loss, linear_loss=o.linear_loss,
            fused_swiglu=o.fused_swiglu, loss_chunks=o.loss_chunks, float8=o.float8,
            float8_recipe=o.float8_recipe, float8_all_gather=o.float8_all_gather,
        )
        assume = Assumptions(
            compute_efficiency=efficiency, cuda_context_bytes=int(context_gib * GiB),
            fragmentation=fragmentation, ddp_bucket_bytes=int(o.bucket_mib * MiB),
            overlap=o.overlap, loss_fp32=o.loss_fp32, expandable_segments=o.expandable_segments,
            deepspeed_hook_forward_s=o.deepspeed_hook_forward_ms / 1e3,
            deepspeed_hook_backward_s=o.deepspeed_hook_backward_ms / 1e3,
        )
        hw = Hardware(gpu=gpu, cluster=cluster, num_gpus=n)
    except ValidationError as e:
        raise UsageError(validation_line("options", e)) from None
    return Scenario(model, hw, train, assume, o.shard_size)


def cpu_ranks(**kw) -> ScenarioOptions:
    """Options for CPU ranks standing in for GPUs (verify, launch without a GPU, fake traces):
    the torch layout, no CUDA context and no fragmentation; `kw` overrides any field."""
    base = ScenarioOptions(gpu="cpu", cluster="cpu-local", layout="torch", context_gib=0.0,
                           fragmentation=0.0)
    return replace(base, **kw)


PROJECT_FILE = "zplan.toml"


def _project_value(p: Any, key: str, v: Any, hint: Any) -> Any:
    """A zplan.toml value checked against the option's type (a flag would be parsed to it)."""
    args = [a for a in typing.get_args(hint) if a is not type(None)] or [hint]
    want = args[0]
    if key in ("params", "gpus", "unit_params") and not isinstance(v, bool) and isinstance(v, (int, float, str)):
        # a count, checked here as its flag would be, used or not (a flag may override it)
        if key == "gpus":
            parse_count(str(v), f"{p}: {key}", MAX_GPUS, integer=True, example="64")
        else:
            parse_count(str(v), f"{p}: {key}")
        return str(v)
    if key == "presets_dir" and isinstance(v, str):
        return [v]
    ok = {str: lambda x: isinstance(x, str),
          int: lambda x: isinstance(x, int) and not isinstance(x, bool),
          float: lambda x: isinstance(x, (int, float)) and not isinstance(x, bool),
          bool: lambda x: isinstance(x, bool)}.get(want)
    if ok is None:  # list[str]
        ok = lambda x: isinstance(x, list) and all(isinstance(i, str) for i in x)  # noqa: E731
    if not ok(v):
        shown = " ".join(repr(v).split())[:60]
        kind = {str: "a string", int: "a whole number", float: "a number", bool: "true or false"}.get(
            want, "a list of strings")
        raise UsageError(f"{p}: key {key!r} is {shown}, not {kind}; fix the file")
    return v


@contextmanager
def project_file_named(used: list[str]):
    """A UsageError raised while zplan.toml's values are in force says which it set."""
    try:
        yield
    except UsageError as e:
        toml = [u for u in used if u.startswith(PROJECT_FILE)]
        if not toml:
            raise
        raise UsageError(f"{e} ({'; '.join(toml)})") from None


def apply_project_file(o: ScenarioOptions, extra: dict, path: str = PROJECT_FILE) -> list[str]:
    """Fill options the user left at their defaults from ./zplan.toml; return what was taken.

    Keys are the long option names with underscores (model, gpus, cluster, seq_len, ...), plus
    the command's own (e.g. global_batch), which land in `extra` (a string or a number each;
    the command checks them as it checks its flags). Values of the wrong type are refused.
    """
    from pathlib import Path

    p = Path(path)
    try:
        if not p.exists():
            return []
    except OSError:
        return []
    data = read_toml(p, "project file")
    hints = typing.get_type_hints(ScenarioOptions)
    defaults = ScenarioOptions()
    taken = []
    for k, v in data.items():
        key = k.replace("-", "_")
        if key == "presets":  # --presets' long name, as its flag reads
            if "presets_dir" in data:
                raise UsageError(f"{p}: both presets and presets_dir are set: they are one option (--presets); keep one")
            key = "presets_dir"
        shown = " ".join(f"{key}={v}".split())[:80]
        if key in FIELDS:  # every value is checked, used or not: a bad file is refused whole
            v = _project_value(p, key, v, hints[key])
            if key not in o.given and getattr(o, key) == getattr(defaults, key):  # the flag wins
                setattr(o, key, v)
                o.given = o.given | {key}
                taken.append(shown)
        elif key in extra:
            v = _project_value(p, key, v, str if isinstance(v, str) else float)
            if extra[key] is None:
                extra[key] = v
                taken.append(shown)
        else:
            known = ", ".join(sorted(FIELDS + list(extra) + ["presets"]))
            raise UsageError(f"{p}: unknown key {' '.join(k.split())[:60]!r}; known keys: {known}")
    return taken
