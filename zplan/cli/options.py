"""The model, hardware and training options of estimate, recommend and explain, as CLI flags.

`scenario_options` adds the fields of zplan.scenario_options.ScenarioOptions to a command's
signature (Typer reads __signature__), with the help texts below, and hands the command one
ScenarioOptions; the library's `build` turns that into a validated Scenario.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import typing
from dataclasses import fields
from typing import Annotated

from ..scenario_options import FIELDS, ScenarioOptions

OPTION_ARGS: dict[str, tuple[tuple[str, ...], str]] = {
    "params": ((), "Parameter count, e.g. 70e9 or 70B (a synthetic decoder is assumed; 7e9 where neither --params nor --model is given)"),
    "unit_params": ((), "With --params: parameters per sharding unit (default: a decoder of aspect ratio 128)"),
    "model": ((), "Model preset name, a .toml file, or a local Hugging Face config.json"),
    "gpus": ((), "Data-parallel GPUs N (default: one node)"),
    "gpu": ((), "GPU preset (default: the cluster's)"),
    "cluster": ((), "Cluster preset: GPUs per node and link bandwidths (default: the --gpu preset's own node; dgx-h100 without --gpu)"),
    "gpus_per_node": ((), "Override the cluster's GPUs per node"),
    "seq_len": ((), "Sequence length (default: min(4096, model max))"),
    "micro_batch": ((), "Sequences per GPU per micro-batch"),
    "grad_accum": ((), "Micro-batches per optimizer step"),
    "reduce_last_only": ((), "Reduce gradients only on the last micro-batch"),
    "checkpointing": ((), "none | full | selective | attention | every-k | first-k"),
    "checkpoint_every": ((), "every-k: checkpoint one block in k"),
    "checkpoint_first": ((), "first-k: checkpoint the first k blocks (Megatron's --recompute-method block)"),
    "checkpoint_early_stop": ((), "Recomputation stops once backward's tensors are rebuilt (non-reentrant checkpoint, PyTorch >= 2.1; --no-checkpoint-early-stop: reentrant or older, the whole block reruns)"),
    "checkpoint_wraps_unit": ((), "FSDP1 (HF Trainer's or accelerate's FSDP): the checkpoint wraps each sharded unit from outside, as Hugging Face's gradient_checkpointing_enable did before transformers 4.52; with a reentrant checkpoint (--no-checkpoint-early-stop, HF's default) each checkpointed block is gathered twice in backward, neither prefetched (default: the checkpoint inside the unit, as zplan's trainer and torchtitan; FSDP2 on PyTorch 2.13 gathers once either way)"),
    "fsdp1": ((), "PyTorch's FullyShardedDataParallel (FSDP1: HF Trainer's and accelerate's FSDP before FSDP2, Composer, llm-foundry) instead of fully_shard (FSDP2, zplan's trainer): no all-gather copy-out (the parameters are views of the gathered buffer), and backward concatenates each unit's gradients, casts them to the reduce dtype and pre-divides them before the reduce-scatter"),
    "flash": ((), "Flash attention (no s^2 scores kept)"),
    "attention_kernel": ((), "flash2 (FlashAttention-2: PyTorch SDPA, flash-attn 2; zplan's trainer) | flash-triton (FlashAttention in Triton, e.g. llm-foundry attn_impl: triton) | flash3 (FlashAttention-3, Hopper) | flash4 (FlashAttention-4, Blackwell) | flex (FlexAttention, compiled Triton: torchtitan's default in 2026; A100, Hopper, Blackwell) | cudnn (cuDNN's fused attention: SDPA's first choice on Hopper/Blackwell with cuDNN > 9.15, e.g. torch 2.11+ cu130, and under 2.9) | flash1 (FlashAttention v1: flash-attn 1.x, SDPA's flash kernel in torch 2.0-2.1; A100, Hopper) | efficient (SDPA's memory-efficient kernel under an explicit attention mask, as Hugging Face's padded batches: the whole square computed)"),
    "optimizer": ((), "adamw | sgd | adam8bit | muon"),
    "param_dtype": ((), "Working/gather dtype"),
    "reduce_dtype": ((), "Gradient reduction dtype"),
    "master_dtype": ((), "Master weights dtype"),
    "optimizer_dtype": ((), "Optimizer state dtype"),
    "layout": ((), "zero (ZeRO paper / DeepSpeed) | torch (DDP, ZeRO-RO, FSDP2)"),
    "ddp_bucket_view": ((), "DDP (ddp, zero1; torch layout) keeps each gradient as a view of its reduce bucket, gradient_as_bucket_view=True, as zplan's trainer does (--no-ddp-bucket-view: PyTorch's default, and accelerate's and Lightning's unless your code passes it: `.grad` apart from the buckets, twice the gradients by the optimizer step)"),
    "logits_kept": ((), "The training loop holds the logits until backward returns (zplan's trainer, a loop keeping a Hugging Face output beside its loss); --no-logits-kept: it drops them before backward (torchtitan's `del pred`, HF Trainer's compute_loss), so backward runs without them"),
    "deepspeed_defaults": ((), "Zero layout, ZeRO-3: the run leaves DeepSpeed's stage-3 buckets at their defaults (each submodule gathered as it runs, 5e7 elements prefetched, gradients copied into a 5e8-element bucket); default: a unit at a time, as zplan's export writes them"),
    "deepspeed_param_groups": ((), "Zero layout, ZeRO-1/2: one (a DeepSpeed config with an optimizer block, as zplan's export writes, under HF Trainer or accelerate: DeepSpeed 0.19+ leaves every parameter's own block cached, reserved through training) | split (an optimizer built with decay/no-decay groups, or DeepSpeed before 0.19: none stays)"),
    "deepspeed_sub_group": ((), "Zero layout, ZeRO-3: DeepSpeed's sub_group_size in elements (default 1e9): the optimizer step makes one sub-group's fp32 gradient at a time (the config's sub_group_size, which export writes)"),
    "deepspeed_bucket_allreduce": ((), "Zero layout, ZeRO-1/2: DeepSpeed all-reduces each gradient bucket and every rank keeps its partition (use_multi_rank_bucket_allreduce, its default since 0.12.4: twice a reduce-scatter's bytes); --no-deepspeed-bucket-allreduce: one reduce per owning rank (the key false, or DeepSpeed before 0.12.4), as the ZeRO paper's reduce-scatter"),
    "zero_init": ((), "Zero layout, ZeRO-3: the model is built under deepspeed.zero.Init, as HF Trainer and accelerate's zero3_init_flag do (--no-zero-init: built outside it, deepspeed.initialize first moves the whole model to each GPU)"),
    "blocks_per_unit": ((), "Transformer blocks per sharding unit"),
    "embed_head_unit": ((), "FSDP: separate (embeddings, and final norm + head, units of their own: zplan's trainer) | head-kept (the same, norm + head kept gathered from forward to backward: torchtitan since 2025-07, accelerate's FSDP2) | root (left to the root unit, resharded after forward: FSDP2 on PyTorch >= 2.8 given reshard_after_forward, the loss outside the model) | root-kept (left to the root, kept gathered from forward to backward: FSDP1 as HF Trainer / accelerate / Composer run it, FSDP2 before 2.8) | head-root-kept (embeddings a unit of their own, norm + head left to the kept root: FSDP1 auto-wrapping nn.Embedding besides the decoder layers)"),
    "prefetch": ((), "Prefetch the next unit's all-gather"),
    "fused_norm": ((), "RMSNorm as one fused kernel (default: yes on GPUs, no on CPU ranks)"),
    "norm_output_fp32": ((), "Without a fused norm, it keeps its normalized output in fp32 (F.rms_norm's fallback; --no-norm-output-fp32: in the input's dtype, as torchtitan's RMSNorm module)"),
    "compile": ((), "torch.compile the blocks and the loss: elementwise work fused (fewer HBM passes)"),
    "eager_loss": ((), "With --compile, the loss stays eager (torchtitan before 2025-04, KempnerForge)"),
    "compile_scope": ((), "With --compile: block (each block compiled on its own, as torchtitan) | model (torch.compile(model) over a model no DDP/FSDP wraps: its backward returns every gradient at once)"),
    "loss_fp32": ((), "The loss upcasts the logits to fp32 (--no-loss-fp32: in the logits' dtype)"),
    "optimizer_kernels": ((), "How AdamW's (and SGD's) step runs: fused (one kernel: AdamW(fused=True), DeepSpeed's FusedAdam) | foreach (torch's multi-tensor ops, the default on CUDA) | single (a loop over parameters: foreach=False, Composer's DecoupledAdamW)"),
    "grad_clip": ((), "Gradients are clipped by their global norm every step (--no-grad-clip: no clipping)"),
    "sac_saves_attention": ((), "Selective checkpointing keeps the attention kernel's output (--no-sac-saves-attention: its save list misses the kernel, as torchtitan's before 2025-12 with cuDNN's attention: the attention forward reruns in backward; other modes and recommend's other candidates are unaffected)"),
    "last_block_kept": ((), "FSDP: the last block's unit stays gathered from its forward to its backward, which gathers nothing (reshard_after_forward=False on it alone: torchtitan from 2024-03 until 2025-07)"),
    "attention_expands_kv": ((), "The attention copies each key/value head to the query heads sharing it before its kernel (Hugging Face's repeat_kv ahead of SDPA: transformers before 4.54, and later releases wherever a padding or sliding-window mask reaches SDPA): the kernel keeps keys and values as wide as the queries"),
    "attention_heads_first": ((), "q reaches the attention kernel heads-first in memory, (b, heads, s, d) contiguous (litgpt's attention: heads reshaped, RoPE and a cat before SDPA): the flash kernel writes its output the same way and the output projection keeps a contiguous copy, the attention's width a token a block more (FlashAttention-2, uncompiled)"),
    "kv_cache": ((), "The model returns every layer's keys and values with its logits (Hugging Face's use_cache, on in training unless HF's own gradient checkpointing is on): they stay referenced as long as the loop holds the output; under full checkpointing that is 2 x layers x tokens x kv width more"),
    "loss_shifted_copy": ((), "The loss runs on a shifted contiguous copy of the model's fp32 logits (Hugging Face transformers' causal-LM loss in the versions that shift the logits, 4.31 for one): 4 more bytes per logit in the loss's forward; needs --logits-fp32"),
    "outputs_until_next_forward": ((), "The loop holds each output until the next forward returns (`outputs = model(**batch)` with the loss inside the model): the previous logits (and cache, with --kv-cache) are alive through the next forward and its loss"),
    "logits_fp32": ((), "The model returns fp32 logits, upcast after the head (torchtitan's model until October 2024): the loop and the loss hold them in fp32 (default: the head's dtype, the loss upcasts a copy)"),
    "fused_loss": ((), "The loss is a fused cross-entropy kernel (flash-attn's, e.g. llm-foundry's default): logits kept, their gradient in their dtype"),
    "linear_loss": ((), "The head's matmul and the loss together, chunk by chunk, logits never kept whole: none | chunked (zplan's trainer, torch ops) | liger (Liger-Kernel's fused linear cross-entropy)"),
    "loss_chunks": ((), "The eager cross-entropy runs over the whole logits in this many sequence chunks in turn (torchtitan's chunked_cross_entropy_loss, 2025-03; torchtune's chunked output loss): one chunk's fp32 copy and gradients at a time beside every chunk's saved log-softmax (default 1: all at once)"),
    "fused_swiglu": ((), "SwiGLU as one kernel that saves its two inputs and recomputes silu in backward (Liger-Kernel's)"),
    "qkv_fused": ((), "q, k and v run as one linear, as torchtitan builds Llama 3 and Qwen3 since 2026-06 (FusedQKVLinear): one weight, one output that selective checkpointing keeps whole; --no-qkv-fused: three (default: the model's layout, fused for MPT, GPT-2, GPT-NeoX, Phi-3)"),
    "float8": ((), "float8 linears (tensorwise scaling) and float8 all-gather of their weights"),
    "float8_recipe": ((), "With --float8: tensorwise (torchao's dynamic scaling) | rowwise (torchao's rowwise scaling: more casts, weights gathered in the param dtype) | rowwise-gw-hp (rowwise, the weight gradient in 16 bits) | te-delayed (TransformerEngine's delayed scaling: float8 kept for backward, weights gathered in the param dtype)"),
    "float8_all_gather": ((), "With --float8 (tensorwise): FSDP gathers block weights in float8 (--no-float8-all-gather: in the param dtype)"),
    "shard_size": ((), "HSDP shard group size (default: one node)"),
    "efficiency": ((), "Assume one achieved fraction of peak FLOP/s for all work instead of the per-op kernel model (presets without kernel figures: 0.7; 1 when calibrated)"),
    "context_gib": ((), "Assumed CUDA context per GPU, GiB"),
    "fragmentation": ((), "Flat allocator reserve over allocated bytes, a fraction (default: the caching-allocator model)"),
    "expandable_segments": ((), "The run sets PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True: the allocator maps each stream's pool in 20 MiB pages (PyTorch's default is off)"),
    "bucket_mib": ((), "DDP gradient bucket, MiB"),
    "overlap": ((), "Assume communication overlaps compute"),
    "deepspeed_hook_forward_ms": ((), "DeepSpeed ZeRO-3: the host's time in its hooks per module in forward, ms (measured on a CPU by benchmarks/deepspeed_host.py); a module whose kernels take less is paced by the host"),
    "deepspeed_hook_backward_ms": ((), "DeepSpeed ZeRO-3: the same in backward (each parameter's gradient hook included), ms"),
    "presets_dir": (("--presets",), "Folder of your own presets (gpus/, clusters/, models/)"),
}


SEARCHED_HELP = " (default: searched; a value given is kept, not searched)"


@functools.lru_cache(maxsize=4)
def _annotated(searched: frozenset = frozenset()) -> dict:
    """Each field's Typer option; those in `searched` (recommend's search dimensions) say so in
    their help instead of showing a default, which typed would pin the search."""
    import typer  # here, not above: estimate's plain path reads OPTION_ARGS without Typer

    hints = typing.get_type_hints(ScenarioOptions)
    return {name: Annotated[hints[name], typer.Option(
        *OPTION_ARGS[name][0], help=OPTION_ARGS[name][1] + (SEARCHED_HELP if name in searched else ""),
        show_default=name not in searched)] for name in FIELDS}


def given_on_command_line(names) -> frozenset[str]:
    """Which of these parameters the running Typer command read from its command line (or the
    environment), not from its defaults: click's parameter sources. Typer 0.29 runs on its own
    copy of click (typer._click), whose context the standalone click does not see (before, every
    flag read as not given on this path): the context is asked of whichever click Typer runs, and
    a source is matched by its name, the same in both copies."""
    ctx = None
    for module in ("typer._click.globals", "click.globals"):
        try:
            ctx = importlib.import_module(module).get_current_context(silent=True)
        except ImportError:
            continue
        if ctx is not None:
            break
    if ctx is None:
        return frozenset()
    given = ("COMMANDLINE", "ENVIRONMENT")
    return frozenset(n for n in names if getattr(ctx.get_parameter_source(n), "name", None) in given)


def scenario_options(func=None, *, searched: frozenset = frozenset()):
    """Add ScenarioOptions' fields to `func`'s CLI signature; call it with opts=ScenarioOptions.
    `searched`: the fields the command searches where they are not given (recommend.PINNABLE)."""
    if func is None:
        return functools.partial(scenario_options, searched=searched)
    sig = inspect.signature(func)
    own_hints = typing.get_type_hints(func, include_extras=True)
    own = [p.replace(annotation=own_hints[p.name]) for p in sig.parameters.values() if p.name != "opts"]
    hints = _annotated(frozenset(searched))
    extra = [
        inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=f.default, annotation=hints[f.name])
        for f in fields(ScenarioOptions)
    ]

    @functools.wraps(func)
    def wrapper(**kwargs):
        opts = ScenarioOptions(**{k: kwargs.pop(k) for k in FIELDS})
        opts.given = given_on_command_line(FIELDS)
        return func(opts=opts, **kwargs)

    wrapper.__signature__ = sig.replace(parameters=own + extra)  # type: ignore[attr-defined]
    return wrapper
