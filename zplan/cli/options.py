"""The model, hardware and training options shared by estimate, recommend and explain.

`scenario_options` adds them to a command's signature (Typer reads __signature__) and hands the
command one ScenarioOptions; `build` turns that into a validated Scenario.
"""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass, fields
from typing import Annotated, Optional

import typer
from pydantic import ValidationError

from .. import arch, presets
from ..errors import UsageError
from ..scenario import Scenario
from ..specs import CHECKPOINTING, Assumptions, Hardware, Precision, TrainSpec
from ..units import DTYPE_BITS, MiB, GiB
from .parse import MAX_GPUS, check_choice, check_range, parse_count

DTYPES = tuple(DTYPE_BITS)
DEFAULT_CLUSTER = "dgx-h100"


@dataclass
class ScenarioOptions:
    params: Annotated[Optional[str], typer.Option(help="Parameter count, e.g. 70e9 or 70B (a synthetic decoder is assumed)")] = None
    unit_params: Annotated[Optional[str], typer.Option(help="With --params: parameters per sharding unit (default: a decoder of aspect ratio 128)")] = None
    model: Annotated[Optional[str], typer.Option(help="Model preset name, a .toml file, or a local Hugging Face config.json")] = None
    gpus: Annotated[Optional[str], typer.Option(help="Data-parallel GPUs N (default: one node)")] = None
    gpu: Annotated[Optional[str], typer.Option(help="GPU preset (default: the cluster's)")] = None
    cluster: Annotated[str, typer.Option(help="Cluster preset: GPUs per node and link bandwidths")] = DEFAULT_CLUSTER
    gpus_per_node: Annotated[Optional[int], typer.Option(help="Override the cluster's GPUs per node")] = None
    seq_len: Annotated[Optional[int], typer.Option(help="Sequence length (default: min(4096, model max))")] = None
    micro_batch: Annotated[int, typer.Option(help="Sequences per GPU per micro-batch")] = 1
    grad_accum: Annotated[int, typer.Option(help="Micro-batches per optimizer step")] = 1
    reduce_last_only: Annotated[bool, typer.Option(help="Reduce gradients only on the last micro-batch")] = False
    checkpointing: Annotated[str, typer.Option(help="none | full | selective | attention | every-k")] = "none"
    checkpoint_every: Annotated[int, typer.Option(help="every-k: checkpoint one block in k")] = 2
    flash: Annotated[bool, typer.Option(help="Flash attention (no s^2 scores kept)")] = True
    optimizer: Annotated[str, typer.Option(help="adamw | sgd | adam8bit | muon")] = "adamw"
    param_dtype: Annotated[str, typer.Option(help="Working/gather dtype")] = "bf16"
    reduce_dtype: Annotated[str, typer.Option(help="Gradient reduction dtype")] = "fp32"
    master_dtype: Annotated[str, typer.Option(help="Master weights dtype")] = "fp32"
    optimizer_dtype: Annotated[str, typer.Option(help="Optimizer state dtype")] = "fp32"
    layout: Annotated[str, typer.Option(help="zero (ZeRO paper / DeepSpeed) | torch (DDP, ZeRO-RO, FSDP2)")] = "zero"
    blocks_per_unit: Annotated[int, typer.Option(help="Transformer blocks per sharding unit")] = 1
    prefetch: Annotated[bool, typer.Option(help="Prefetch the next unit's all-gather")] = True
    fused_norm: Annotated[Optional[bool], typer.Option(help="RMSNorm as one fused kernel (default: yes on GPUs, no on CPU ranks)")] = None
    shard_size: Annotated[Optional[int], typer.Option(help="HSDP shard group size (default: one node)")] = None
    efficiency: Annotated[Optional[float], typer.Option(help="Assumed achieved fraction of peak FLOP/s (default 0.7; 1 for a calibrated preset)")] = None
    context_gib: Annotated[float, typer.Option(help="Assumed CUDA context per GPU, GiB")] = 600 / 1024
    fragmentation: Annotated[float, typer.Option(help="Assumed allocator fragmentation fraction")] = 0.05
    bucket_mib: Annotated[float, typer.Option(help="DDP gradient bucket, MiB")] = 25.0
    overlap: Annotated[bool, typer.Option(help="Assume communication overlaps compute")] = True
    presets_dir: Annotated[Optional[list[str]], typer.Option("--presets", help="Folder of your own presets (gpus/, clusters/, models/)")] = None


_FIELDS = [f.name for f in fields(ScenarioOptions)]


def scenario_options(func):
    """Add ScenarioOptions' fields to `func`'s CLI signature; call it with opts=ScenarioOptions."""
    import typing

    sig = inspect.signature(func)
    own_hints = typing.get_type_hints(func, include_extras=True)
    own = [p.replace(annotation=own_hints[p.name]) for p in sig.parameters.values() if p.name != "opts"]
    hints = typing_hints()
    extra = [
        inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=f.default, annotation=hints[f.name])
        for f in fields(ScenarioOptions)
    ]

    @functools.wraps(func)
    def wrapper(**kwargs):
        opts = ScenarioOptions(**{k: kwargs.pop(k) for k in _FIELDS})
        return func(opts=opts, **kwargs)

    wrapper.__signature__ = sig.replace(parameters=own + extra)  # type: ignore[attr-defined]
    return wrapper


@functools.lru_cache(maxsize=1)
def typing_hints() -> dict:
    import typing

    return typing.get_type_hints(ScenarioOptions, include_extras=True)


def build(o: ScenarioOptions, need_gpus: bool = True) -> Scenario:
    """Validate every option and assemble the Scenario; bad input raises one-line UsageErrors."""
    extra = tuple(o.presets_dir or ())
    if o.params is not None and o.model is not None:
        raise UsageError("give either --params or --model, not both")
    if o.unit_params is not None and o.params is None:
        raise UsageError("--unit-params goes with --params; a --model has its own units")
    cluster = presets.cluster(o.cluster, extra)
    if o.gpus_per_node is not None:
        check_range(o.gpus_per_node, "--gpus-per-node", 1, 1024)
        cluster = cluster.model_copy(update={"gpus_per_node": o.gpus_per_node})
    gpus_found = None
    if o.gpu == "auto":
        from ..hardware import detect

        found = detect()
        if not found.gpus:
            raise UsageError(f"--gpu auto found no GPU ({found.gpu_reason}); name one with --gpu, e.g. --gpu h100-sxm")
        if found.gpu_preset is None:
            names = ", ".join(sorted({g.name for g in found.gpus}))
            raise UsageError(f"--gpu auto found {names}, which has no preset; pass --gpu FILE.toml")
        gpu_name, gpus_found = found.gpu_preset, len(found.gpus)
    else:
        gpu_name = o.gpu or cluster.gpu or "h100-sxm"
    gpu = presets.gpu(gpu_name, extra)
    if o.gpus is None:
        n = gpus_found or cluster.gpus_per_node
    else:
        n = parse_count(o.gpus, "--gpus", MAX_GPUS, integer=True)
    if o.model is not None:
        model = presets.model(o.model, extra)
    else:
        psi = parse_count(o.params or "7e9", "--params")
        unit = parse_count(o.unit_params, "--unit-params") if o.unit_params else None
        if unit is not None and unit > psi:
            raise UsageError(f"--unit-params {o.unit_params} is larger than --params {o.params}; a unit is part of the model")
        model = arch.synthetic(psi, unit)
    seq = o.seq_len if o.seq_len is not None else min(4096, model.max_seq_len)
    check_range(seq, "--seq-len", 1, 10**7)
    check_range(o.micro_batch, "--micro-batch", 1, 10**5)
    check_range(o.grad_accum, "--grad-accum", 1, 10**6)
    check_range(o.blocks_per_unit, "--blocks-per-unit", 1, model.num_layers)
    if o.checkpointing == "every-k":
        check_range(o.checkpoint_every, "--checkpoint-every", 1, model.num_layers)
    efficiency = o.efficiency if o.efficiency is not None else (1.0 if gpu.measured else 0.7)
    check_range(efficiency, "--efficiency", 0.01, 1.0)
    check_range(o.fragmentation, "--fragmentation", 0.0, 0.9)
    check_range(o.context_gib, "--context-gib", 0.0, 1024)
    check_range(o.bucket_mib, "--bucket-mib", 0.0, 1e6)
    check_choice(o.checkpointing, "--checkpointing", CHECKPOINTING)
    check_choice(o.optimizer, "--optimizer", ("adamw", "sgd", "adam8bit", "muon"))
    check_choice(o.layout, "--layout", ("zero", "torch"))
    for flag, v in (("--param-dtype", o.param_dtype), ("--reduce-dtype", o.reduce_dtype),
                    ("--master-dtype", o.master_dtype), ("--optimizer-dtype", o.optimizer_dtype)):
        check_choice(v, flag, DTYPES)
    if o.shard_size is not None:
        check_range(o.shard_size, "--shard-size", 1, MAX_GPUS)
        if n % o.shard_size:
            raise UsageError(f"--shard-size {o.shard_size} does not divide --gpus {n}; pick a divisor of {n}")
    try:
        train = TrainSpec(
            seq_len=seq, micro_batch=o.micro_batch, grad_accum=o.grad_accum,
            checkpointing=o.checkpointing, checkpoint_every=o.checkpoint_every,
            flash_attention=o.flash, optimizer=o.optimizer,
            precision=Precision(param=o.param_dtype, reduce=o.reduce_dtype,
                                master=o.master_dtype, optimizer=o.optimizer_dtype),
            layout=o.layout, blocks_per_unit=o.blocks_per_unit, prefetch=o.prefetch,
            fused_norm=o.fused_norm if o.fused_norm is not None else gpu.device != "cpu",
            reduce_every_microbatch=not o.reduce_last_only,
        )
        assume = Assumptions(
            compute_efficiency=efficiency, cuda_context_bytes=int(o.context_gib * GiB),
            fragmentation=o.fragmentation, ddp_bucket_bytes=int(o.bucket_mib * MiB),
            overlap=o.overlap,
        )
        hw = Hardware(gpu=gpu, cluster=cluster, num_gpus=n)
    except ValidationError as e:
        err = e.errors()[0]
        raise UsageError(f"{'.'.join(map(str, err['loc']))}: {err['msg']}") from None
    return Scenario(model, hw, train, assume, o.shard_size)


PROJECT_FILE = "zplan.toml"


def apply_project_file(o: ScenarioOptions, extra: dict, path: str = PROJECT_FILE) -> list[str]:
    """Fill options the user left at their defaults from ./zplan.toml; return what was taken.

    Keys are the long option names with underscores (model, gpus, cluster, seq_len, ...), plus
    the command's own (e.g. global_batch), which land in `extra`.
    """
    import tomllib
    from pathlib import Path

    p = Path(path)
    if not p.is_file():
        return []
    try:
        data = tomllib.loads(p.read_text())
    except tomllib.TOMLDecodeError as e:
        raise UsageError(f"{p}: not valid TOML ({e}); fix the file") from None
    defaults = ScenarioOptions()
    taken = []
    for k, v in data.items():
        key = k.replace("-", "_")
        if key in _FIELDS:
            if getattr(o, key) == getattr(defaults, key):
                setattr(o, key, str(v) if key in ("params", "gpus") else v)
                taken.append(f"{key}={v}")
        elif key in extra:
            if extra[key] is None:
                extra[key] = v
                taken.append(f"{key}={v}")
        else:
            known = ", ".join(sorted(_FIELDS + list(extra)))
            raise UsageError(f"{p}: unknown key {k!r}; known keys: {known}")
    return taken
