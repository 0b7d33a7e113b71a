"""Load and validate the public validation set: one TOML file per source in this folder.

A file has a [source] table (where the figures come from, exactly) and [[row]] tables, one per
measured run. Every bad row is an error naming the file, the row's number and the field: the rows
are data typed by hand from public documents, and a silent typo would become a wrong accuracy figure.
Files are read with tomllib (data, never code). No zplan import here: the loader is usable alone.
"""

from __future__ import annotations

import math
import tomllib
from dataclasses import dataclass
from pathlib import Path

FOLDER = Path(__file__).resolve().parent
SOURCE_KEYS = {"name", "org", "who", "url", "file", "date", "memory_kind", "tokens", "notes"}
SOURCE_OPTIONAL = {"repository", "commit"}
STRATEGIES = ("ddp", "zero1", "zero2", "zero3", "zero3-noreshard", "hsdp", "offload-opt", "offload-all")
CHECKPOINTING = ("none", "full", "selective", "first-k", "blocks-fraction-unstated")
ATTENTION_KERNELS = ("flash2", "flash-triton", "flash3", "flash4", "flex", "cudnn", "flash1", "efficient")  # zplan's --attention-kernel
COMPILE_SCOPES = ("block", "model")  # zplan's --compile-scope
FLOAT8 = ("none", "tensorwise", "tensorwise-fp8-allgather", "rowwise", "rowwise-gw-hp", "te-delayed")
DTYPES = ("fp32", "bf16", "fp16")
MEMORY_UNITS = {"GiB": 2**30, "GB": 10**9}
MEMORY_KINDS = ("reserved", "allocated")
GPU_KINDS = {"a100-40gb": "A100", "a100-80gb": "A100", "h100-sxm": "H100", "h100-hbm2e-500w": "H100",
             "h200": "H200", "b200": "B200", "gb200": "GB200", "mi300x": "MI300X"}


class RowError(ValueError):
    """A bad file or row: the message names the file, the row and the fix."""


@dataclass(frozen=True)
class Source:
    name: str
    org: str
    who: str
    url: str
    file: str
    date: str
    memory_kind: str
    tokens: str
    notes: str
    path: str  # the TOML file this came from
    repository: str = ""
    commit: str = ""


@dataclass(frozen=True)
class Row:
    id: str
    source: Source
    model: str
    gpu: str
    num_gpus: int
    gpus_per_node: int
    parallelism: str
    strategy: str
    micro_batch: int
    grad_accum: int
    seq_len: int
    checkpointing: str
    compile: bool
    float8: str
    param_dtype: str
    reduce_dtype: str
    table: str
    shard_size: int | None = None
    master_dtype: str = "fp32"  # the optimizer's copy of the weights (bf16: the params themselves)
    optimizer_dtype: str = "fp32"  # AdamW's m and v
    reduce_last_only: bool = False  # gradients reduced on the last micro-batch only (no_sync before)
    gpu_variant: str = ""  # where the GPU differs from its preset (memory size, HBM, power limit)
    attention_kernel: str = "flash2"  # flash-triton: FlashAttention in Triton (llm-foundry attn_impl triton)
    fused_norm: bool | None = None  # False: the norm is the composite fp32 implementation (eager); None: zplan's default
    norm_output_fp32: bool = True  # composite norm: normalized output kept in fp32 (False: in the input's dtype)
    compile_loss: bool | None = None  # with compile: was the loss compiled too (None: yes, as zplan's --compile)
    fused_loss: bool = False  # the loss is a fused cross-entropy kernel (flash-attn's xentropy)
    linear_loss: str = "none"  # head matmul + loss in chunks, logits never kept: none | chunked | liger
    fused_swiglu: bool = False  # SwiGLU in one kernel saving its two inputs (Liger's)
    qkv_fused: bool = False  # q, k and v as one linear (torchtitan's FusedQKVLinear, from 2026-06)
    optimizer_kernels: str = "fused"  # AdamW as the run launches it: fused | foreach | single
    optimizer: str = "adamw"  # adamw | muon (Muon over the blocks' matrices, AdamW the rest: zplan/muon.py)
    layout: str = "torch"  # torch: FSDP/DDP (FSDP2's per-parameter shards); zero: DeepSpeed's flat partitions
    grad_clip: bool = True  # gradients clipped by their global norm every step
    sac_saves_attention: bool = True  # selective checkpointing keeps the attention kernel's output (False: torchtitan's save list before b39377f with cuDNN attention)
    zero_init: bool = True  # zero layout, ZeRO-3: the model built under deepspeed.zero.Init
    deepspeed_defaults: bool = False  # zero layout, ZeRO-3: DeepSpeed's default stage-3 buckets
    deepspeed_sub_group: int = 1_000_000_000  # zero layout, ZeRO-3: DeepSpeed's sub_group_size (elements)
    deepspeed_param_groups: str = "one"  # zero layout, ZeRO-1/2: one | split (TrainSpec.deepspeed_param_groups)
    logits_kept: bool = True  # the loop holds the logits until backward returns (torchtitan: del pred)
    ddp_bucket_view: bool = True  # DDP's gradients are bucket views (False: PyTorch's default)
    logits_fp32: bool = False  # the model returns fp32 logits (torchtitan until e10cb94, 2024-10)
    kv_cache: bool = False  # the model returns its keys and values (Hugging Face's use_cache in training)
    attention_expands_kv: bool = False  # keys and values copied to every query head ahead of SDPA (HF repeat_kv)
    loss_chunks: int = 1  # the eager cross-entropy over this many sequence chunks (torchtitan PR 996)
    attention_heads_first: bool = False  # q heads-first in memory before SDPA (litgpt): the kernel's output copied for the projection
    loss_shifted_copy: bool = False  # the loss on a shifted copy of the fp32 logits (HF transformers 4.31)
    outputs_until_next_forward: bool = False  # the loop holds each output into the next forward
    last_block_kept: bool = False  # FSDP2 keeps the last block gathered after forward (torchtitan 2024-03..2025-07)
    embed_head_unit: str = "separate"  # FSDP: separate | head-kept | root | root-kept | head-root-kept (TrainSpec.embed_head_unit)
    checkpoint_early_stop: bool = True  # non-reentrant checkpoint on PyTorch >= 2.1 (False: the whole block reruns)
    checkpoint_wraps_unit: bool = False  # FSDP: the checkpoint wraps each unit from outside (HF's gradient_checkpointing_enable)
    fsdp1: bool = False  # PyTorch's FullyShardedDataParallel (FSDP1), not fully_shard (FSDP2)
    checkpoint_first: int | None = None  # first-k: how many leading blocks are checkpointed (required with it)
    compile_scope: str = "block"  # with compile: block (each block compiled) or model (torch.compile(model))
    loss_fp32: bool = True  # the loss upcasts the logits to fp32 (False: cross-entropy in their dtype)
    expandable_segments: bool = False  # PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True (torchtitan's launcher since 2024-10)
    cluster: str | None = None  # the cluster preset of the run's network where the source names one
    # (aws-p5: EFA); None: the GPU preset's own node (its `cluster`, as zplan's --gpu alone)
    float8_all_gather: bool | None = None  # float8 tensorwise: torchao's enable_fsdp_float8_all_gather as the run
    # states it (tensorwise-fp8-allgather says true); None: not stated, zplan's default (on)
    bucket_mib: float | None = None  # the run's gradient bucket (DeepSpeed: reduce_bucket_size x bytes); None: zplan's 25 MiB
    tp: int = 1
    pp: int = 1
    cp: int = 1
    expressible: bool = True
    why_not: str = ""
    memory: float | None = None
    memory_unit: str = ""
    memory_kind: str = ""
    tokens_per_s_per_gpu: float | None = None
    tokens_per_s_global: float | None = None
    mfu_pct: float | None = None
    published_params: int | None = None
    notes: str = ""

    @property
    def gpu_kind(self) -> str:
        return GPU_KINDS[self.gpu]

    @property
    def flags(self) -> str:
        """compile / float8 / compile+float8 / plain."""
        on = [k for k, v in (("compile", self.compile), ("float8", self.float8 != "none")) if v]
        return "+".join(on) or "plain"

    @property
    def memory_bytes(self) -> int | None:
        if self.memory is None:
            return None
        return round(self.memory * MEMORY_UNITS[self.memory_unit])


FIELD_TYPES = {
    "id": str, "model": str, "gpu": str, "num_gpus": int, "gpus_per_node": int, "parallelism": str,
    "strategy": str, "micro_batch": int, "grad_accum": int, "seq_len": int, "checkpointing": str,
    "compile": bool, "float8": str, "param_dtype": str, "reduce_dtype": str, "table": str,
    "shard_size": int, "master_dtype": str, "optimizer_dtype": str, "reduce_last_only": bool, "gpu_variant": str, "attention_kernel": str, "attention_heads_first": bool, "loss_chunks": int, "fused_norm": bool, "norm_output_fp32": bool, "compile_loss": bool, "compile_scope": str, "checkpoint_early_stop": bool, "checkpoint_wraps_unit": bool, "fsdp1": bool, "checkpoint_first": int, "fused_loss": bool, "linear_loss": str, "fused_swiglu": bool, "qkv_fused": bool, "optimizer_kernels": str, "optimizer": str, "layout": str, "grad_clip": bool, "sac_saves_attention": bool, "zero_init": bool, "deepspeed_defaults": bool, "deepspeed_param_groups": str, "deepspeed_sub_group": int, "logits_kept": bool, "ddp_bucket_view": bool, "logits_fp32": bool, "kv_cache": bool, "attention_expands_kv": bool, "loss_shifted_copy": bool, "outputs_until_next_forward": bool, "last_block_kept": bool, "embed_head_unit": str, "loss_fp32": bool, "expandable_segments": bool, "cluster": str, "float8_all_gather": bool, "bucket_mib": float, "tp": int, "pp": int, "cp": int, "expressible": bool, "why_not": str,
    "memory": float, "memory_unit": str, "memory_kind": str, "tokens_per_s_per_gpu": float,
    "tokens_per_s_global": float, "mfu_pct": float, "published_params": int, "notes": str,
}
REQUIRED = ("id", "model", "gpu", "num_gpus", "gpus_per_node", "parallelism", "strategy", "micro_batch",
            "grad_accum", "seq_len", "checkpointing", "compile", "float8", "param_dtype", "reduce_dtype", "table")
CHOICES = {"strategy": STRATEGIES, "checkpointing": CHECKPOINTING, "float8": FLOAT8, "param_dtype": DTYPES,
           "reduce_dtype": DTYPES, "master_dtype": DTYPES, "optimizer_dtype": DTYPES, "memory_unit": tuple(MEMORY_UNITS), "memory_kind": MEMORY_KINDS,
           "gpu": tuple(GPU_KINDS), "attention_kernel": ATTENTION_KERNELS,
           "compile_scope": COMPILE_SCOPES, "layout": ("torch", "zero"), "deepspeed_param_groups": ("one", "split"),
           "embed_head_unit": ("separate", "head-kept", "root", "root-kept", "head-root-kept"),
           "optimizer_kernels": ("fused", "foreach", "single"), "linear_loss": ("none", "chunked", "liger"),
           "optimizer": ("adamw", "muon")}


# cluster presets a row may name for its network (presets/clusters/; each carries nccl-tests figures)
CLUSTERS_WITH_NETWORKS = {"aws-p5": "h100-sxm"}  # name: the GPU preset it is for


def _typed(key: str, value, where: str):
    want = FIELD_TYPES[key]
    if want is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if not isinstance(value, want) or (want is int and isinstance(value, bool)):
        raise RowError(f"{where}: {key} = {value!r} is not a {want.__name__}; fix the value")
    if want is float and not (math.isfinite(value) and value > 0):
        raise RowError(f"{where}: {key} = {value!r} must be a finite number above 0")
    if want is int and value < 1:
        raise RowError(f"{where}: {key} = {value!r} must be at least 1")
    if key in CHOICES and value not in CHOICES[key]:
        raise RowError(f"{where}: {key} = {value!r} is not one of {', '.join(CHOICES[key])}")
    return value


def _row(raw: dict, source: Source, where: str) -> Row:
    unknown = set(raw) - set(FIELD_TYPES)
    if unknown:
        raise RowError(f"{where}: unknown field(s) {', '.join(sorted(unknown))}; known: {', '.join(FIELD_TYPES)}")
    missing = [k for k in REQUIRED if k not in raw]
    if missing:
        raise RowError(f"{where}: missing field(s) {', '.join(missing)}")
    kw = {k: _typed(k, v, where) for k, v in raw.items()}
    r = Row(source=source, **kw)
    if r.memory is None and r.tokens_per_s_per_gpu is None:
        raise RowError(f"{where}: a row needs a measured memory or tokens_per_s_per_gpu")
    if r.memory is not None and not (r.memory_unit and r.memory_kind):
        raise RowError(f"{where}: memory needs memory_unit (GiB or GB) and memory_kind (reserved or allocated)")
    if r.memory is None and (r.memory_unit or r.memory_kind):
        raise RowError(f"{where}: memory_unit/memory_kind given without a memory figure")
    if max(r.tp, r.pp, r.cp) > 1 and r.expressible:
        raise RowError(f"{where}: tp/pp/cp above 1 cannot be expressed in zplan; set expressible = false and why_not")
    if (r.checkpointing == "first-k") != (r.checkpoint_first is not None):
        raise RowError(f"{where}: checkpoint_first goes with checkpointing = \"first-k\" (the count of leading blocks checkpointed)")
    if r.checkpointing == "blocks-fraction-unstated" and r.expressible:
        raise RowError(f"{where}: checkpointing of an unstated fraction cannot be expressed; set expressible = false")
    if not r.expressible and not r.why_not:
        raise RowError(f"{where}: expressible = false needs why_not")
    if r.num_gpus > r.gpus_per_node and r.num_gpus % r.gpus_per_node:
        raise RowError(f"{where}: num_gpus {r.num_gpus} is not a whole number of nodes of {r.gpus_per_node}")
    if r.compile_loss is not None and not r.compile:
        raise RowError(f"{where}: compile_loss says how a compiled run treated its loss; it needs compile = true")
    if r.compile_scope != "block" and not r.compile:
        raise RowError(f"{where}: compile_scope says what a compiled run compiled; it needs compile = true")
    if r.cluster is not None and r.cluster not in CLUSTERS_WITH_NETWORKS:
        raise RowError(f"{where}: cluster = {r.cluster!r} is not one of {', '.join(CLUSTERS_WITH_NETWORKS)}")
    if r.cluster is not None and CLUSTERS_WITH_NETWORKS[r.cluster] != r.gpu:
        raise RowError(f"{where}: cluster {r.cluster!r} is a cluster of {CLUSTERS_WITH_NETWORKS[r.cluster]}, "
                       f"not of gpu {r.gpu!r}")
    if r.float8_all_gather is not None and r.float8 != "tensorwise":
        raise RowError(f"{where}: float8_all_gather states a tensorwise run's float8 all-gather; it needs float8 = "
                       f"\"tensorwise\" (tensorwise-fp8-allgather says it is on)")
    if (r.strategy == "hsdp") != (r.shard_size is not None):
        raise RowError(f"{where}: shard_size goes with strategy hsdp, and hsdp needs it")
    if r.shard_size is not None and r.num_gpus % r.shard_size:
        raise RowError(f"{where}: shard_size {r.shard_size} does not divide num_gpus {r.num_gpus}")
    return r


def load_file(path: Path) -> list[Row]:
    try:
        data = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as e:
        raise RowError(f"{path.name}: not valid TOML ({e})") from None
    src = data.get("source")
    if not isinstance(src, dict):
        raise RowError(f"{path.name}: no [source] table; every file names its source")
    missing = SOURCE_KEYS - set(src)
    unknown = set(src) - SOURCE_KEYS - SOURCE_OPTIONAL
    if missing or unknown:
        raise RowError(f"{path.name}: [source] missing {sorted(missing)} / unknown {sorted(unknown)}")
    if not all(isinstance(v, str) for v in src.values()) or not src["url"].startswith("https://"):
        raise RowError(f"{path.name}: [source] values are strings and url is an https:// address")
    source = Source(path=path.name, **src)
    raws = data.get("row")
    if not isinstance(raws, list) or not raws:
        raise RowError(f"{path.name}: no [[row]] tables")
    return [_row(raw, source, f"{path.name} row {i + 1} ({raw.get('id', 'no id')})") for i, raw in enumerate(raws)]


def load(folder: Path = FOLDER) -> list[Row]:
    """Every row of every *.toml file in `folder`; ids are unique across files."""
    rows: list[Row] = []
    for path in sorted(folder.glob("*.toml")):
        rows += load_file(path)
    seen: dict[str, str] = {}
    for r in rows:
        if r.id in seen:
            raise RowError(f"{r.source.path}: row id {r.id!r} is also in {seen[r.id]}; ids must be unique")
        seen[r.id] = r.source.path
    if not rows:
        raise RowError(f"{folder}: no *.toml files with rows")
    return rows
