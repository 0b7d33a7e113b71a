"""Apply a plan to a model: FSDP2 for the sharded strategies, DDP (+ ZeroRedundancyOptimizer)
for ddp and zero1. Follows torchtitan: embeddings, each unit of blocks, norm + head, then the
root, one MixedPrecisionPolicy for all, explicit forward and backward prefetch.

Strategy -> torch calls (docs/trainer.md):
  ddp              DistributedDataParallel(gradient_as_bucket_view=True) + autocast (one rank: unwrapped)
  zero1            DDP + ZeroRedundancyOptimizer(AdamW)
  zero2            fully_shard(reshard_after_forward=False)  (weights sharded between steps)
  zero3            fully_shard(reshard_after_forward=True)
  zero3-noreshard  fully_shard(reshard_after_forward=False)
  hsdp             fully_shard(mesh=init_device_mesh(dev, (R, S), ("replicate", "shard")))
  offload-all      fully_shard(offload_policy=CPUOffloadPolicy())
  offload-opt      refused: FSDP2 has no optimizer-only offload
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from functools import partial

import torch
import torch.distributed as dist
from torch import nn

from .. import policy
from ..comm import ddp_bucket_cap_mb
from ..plan import Plan

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
FSDP_STRATEGIES = ("zero2", "zero3", "zero3-noreshard", "hsdp", "offload-all")


@dataclass
class Parallelized:
    model: nn.Module  # what forward is called on (FSDP root, or the DDP wrapper)
    inner: nn.Module  # the Transformer itself
    fsdp: bool
    units: list[nn.Module]
    autocast_dtype: torch.dtype | None  # DDP's mixed precision
    deterministic: bool = False  # rank-ordered reductions; the optimizer keeps the reference's bits


def device_for(backend: str) -> torch.device:
    if backend == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def apply_checkpointing(model: nn.Module, mode: str, every: int, saves_attention: bool = True,
                        first: int = 1) -> None:
    """Wrap blocks for activation checkpointing (before fully_shard, as torchtitan does); which
    blocks and which ops come from zplan/policy.py, as the planner prices them; selective keeps
    the attention kernel's outputs where `saves_attention` (TrainSpec.sac_saves_attention)."""
    if mode == "none":
        return
    if mode == "attention":
        for block in model.layers:
            block.attention.checkpoint_core = True
        return
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    wrapped = policy.checkpointed_blocks(len(model.layers), mode, every, first)
    for i, block in enumerate(model.layers):
        if not wrapped[i]:
            continue
        kw = {}
        if mode == "selective":
            kw["context_fn"] = partial(selective_context, policy.selective_saved_positions(model.spec.mlp),
                                       saves_attention)
        model.layers[i] = checkpoint_wrapper(block, preserve_rng_state=False, **kw)


def _attention_ops() -> set:
    ops = {torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default}
    for name in ("_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
                 "_scaled_dot_product_cudnn_attention"):
        op = getattr(torch.ops.aten, name, None)
        if op is not None:
            ops.add(op.default)
    return ops


def selective_context(saved_positions: frozenset[int], saves_attention: bool = True):
    """torchtitan's op-level SAC: the block's matmuls at `saved_positions` (in the order they
    run) and the attention kernel are kept; everything else is recomputed."""
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    return create_selective_checkpoint_contexts(selective_policy(saved_positions, saves_attention))


def selective_policy(saved_positions: frozenset[int], saves_attention: bool = True):
    """The policy function of selective_context, fresh per checkpointed call. Matmuls are
    counted apart in the forward and in the recompute: torch 2.11 also asks the policy during
    recomputation (`ctx.is_recompute` True) and must get the forward's answers back in the same
    order; torch 2.13 asks in the forward only."""
    from torch.utils.checkpoint import CheckpointPolicy

    count = {"forward": 0, "recompute": 0}
    matmuls = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default}
    attention = _attention_ops() if saves_attention else set()

    def choose(ctx, func, *args, **kwargs):
        if func in matmuls:
            mode = "recompute" if ctx.is_recompute else "forward"
            i = count[mode]
            count[mode] += 1
            return CheckpointPolicy.MUST_SAVE if i in saved_positions else CheckpointPolicy.PREFER_RECOMPUTE
        return CheckpointPolicy.MUST_SAVE if func in attention else CheckpointPolicy.PREFER_RECOMPUTE

    return choose


def build_mesh(plan: Plan, device: torch.device):
    from torch.distributed.device_mesh import init_device_mesh

    if plan.strategy == "hsdp":
        r, s = plan.mesh.shape
        if r > 1:  # one replica is plain FSDP: no all-reduce over one rank, nor its held input
            return init_device_mesh(device.type, (r, s), mesh_dim_names=("replicate", "shard"))
    return init_device_mesh(device.type, (dist.get_world_size(),), mesh_dim_names=("shard",))


def parallelize(model: nn.Module, plan: Plan, device: torch.device,
                deterministic: bool = False, mesh=None) -> Parallelized:
    """Shard (or replicate) the meta-device model as the plan says; parameters stay empty, in
    the plan's master dtype (FSDP2 and DDP keep the weights the optimizer updates)."""
    from ..plan import trainer_refusal

    why = trainer_refusal(plan)
    if why:
        raise ValueError(why)
    t = plan.train
    to_master_dtype(model, plan)
    apply_checkpointing(model, t.checkpointing, t.checkpoint_every, t.sac_saves_attention, t.checkpoint_first)
    if plan.strategy in ("ddp", "zero1"):
        return replicate(model, plan, device)
    groups = unit_groups(model, t)
    return shard_units(model, groups, plan, device, deterministic, mesh, kept_last_block_group(model, groups, t))


def kept_last_block_group(model: nn.Module, groups: list[list[nn.Module]], t) -> int | None:
    """The index in `groups` of the unit the plan keeps gathered after forward for holding the
    last block (policy.holds_kept_last_block, which the planner asks too), or None."""
    index = {id(b): k for k, b in enumerate(model.layers)}
    for i, group in enumerate(groups):
        blocks = [index[id(m)] for m in group if id(m) in index]
        if blocks and policy.holds_kept_last_block(t, min(blocks), len(blocks), len(model.layers)):
            return i
    return None


def unit_groups(model: nn.Module, t) -> list[list[nn.Module]]:
    """The modules fully_shard takes together, in forward order, as arch.units prices them:
    embeddings and norm + head on their own unless tied or left to the root
    (policy.embed_unit, policy.head_unit), the blocks `blocks_per_unit` at a time; the root, sharded
    last, holds whatever is left."""
    groups: list[list[nn.Module]] = []
    tied = model.spec.tied_embeddings
    if policy.embed_unit(tied, t.embed_head_unit):
        groups.append([model.tok_embeddings])
    blocks = list(model.layers)
    groups += [[blocks[i] for i in g] for g in policy.block_groups(len(blocks), t.blocks_per_unit)]
    if policy.head_unit(tied, t.embed_head_unit):
        groups.append([model.norm, model.output])
    return groups


def to_master_dtype(model: nn.Module, plan: Plan) -> None:
    """Store the model's floating-point parameters and buffers in the plan's master dtype, the
    weights the optimizer updates (MixedPrecisionPolicy or autocast makes the param dtype):
    the rule for the built-in model and a user's model under api.Context.apply alike."""
    model.to(dtype=DTYPES[plan.train.precision.master])


def replicate(model: nn.Module, plan: Plan, device: torch.device) -> Parallelized:
    """ddp and zero1: DistributedDataParallel with the gradients as its buckets (unless the plan
    says `ddp_bucket_view` False: PyTorch's default, `.grad` apart from them), autocast for
    mixed precision (the optimizer of zero1 is sharded by build_optimizer)."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    t = plan.train
    materialise(model, False, device)
    cast = policy.autocast_dtype(False, t.layout, t.precision.param, t.precision.master)
    cast = DTYPES[cast] if cast else None
    if not dist.is_initialized() or dist.get_world_size() == 1:
        # one rank has nothing to reduce: no wrapper, so no buckets, and `.grad` is made by
        # backward and accumulated in place (the planner's one-rank model, memory.timeline)
        return Parallelized(model, model, False, [], cast)
    ddp = DDP(model, device_ids=[device.index] if device.type == "cuda" else None,
              gradient_as_bucket_view=t.ddp_bucket_view,
              bucket_cap_mb=ddp_bucket_cap_mb(plan.assumptions.ddp_bucket_bytes))  # the plan's buckets
    return Parallelized(ddp, model, False, [], cast)


def shard_units(model: nn.Module, groups: list[list[nn.Module]], plan: Plan,
                device: torch.device, deterministic: bool = False, mesh=None,
                kept_last: int | None = None) -> Parallelized:
    """fully_shard each group of modules (one all-gather each), then the root; one
    MixedPrecisionPolicy; explicit prefetch along the order given; parameters left empty.
    `kept_last`: the group holding the last block, kept gathered after forward where the plan
    says so (`TrainSpec.last_block_kept`; required then)."""
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    t = plan.train
    if plan.strategy not in FSDP_STRATEGIES:
        raise ValueError(f"strategy {plan.strategy} cannot run under FSDP2 (optimizer-only offload is DeepSpeed's)")
    mesh = mesh if mesh is not None else build_mesh(plan, device)
    mp = MixedPrecisionPolicy(param_dtype=DTYPES[t.precision.param], reduce_dtype=DTYPES[t.precision.reduce])
    offload = CPUOffloadPolicy(pin_memory=device.type == "cuda") if plan.strategy == "offload-all" else OffloadPolicy()
    shard = partial(fully_shard, mesh=mesh, mp_policy=mp, offload_policy=offload,
                    reshard_after_forward=t.reshard_after_forward)
    units: list[nn.Module] = []
    # torchtitan's default (head-kept): norm + head, sharded last of the groups, kept after forward
    head_kept = (t.reshard_after_forward and not policy.head_unit_reshards(t.embed_head_unit)
                 and bool(groups) and groups[-1][-1] is getattr(model, "output", None))
    if t.last_block_kept and t.reshard_after_forward and kept_last is None:
        raise ValueError("the plan keeps the last block gathered after forward (last_block_kept), "
                         "and which of these units holds it is not known: plan again without "
                         "--last-block-kept, or run the built-in model")
    for i, group in enumerate(groups):
        keep = (head_kept and i == len(groups) - 1) or (t.last_block_kept and i == kept_last)
        kw = {"reshard_after_forward": False} if keep else {}
        shard(group if len(group) > 1 else group[0], **kw)
        units.append(group[0])  # the FSDP state lives on the first module of a group
    # the root: whatever is left (tied embeddings and head, or the plan's embed_head_unit root);
    # FSDP1's kept root (root-kept) is FSDP2's root told not to reshard after forward
    root_reshard = t.reshard_after_forward and policy.root_reshards(t.embed_head_unit)
    if root_reshard and _torch_before((2, 8)):
        in_units = {id(q) for grp in groups for mod in grp for q in mod.parameters()}
        if any(id(q) not in in_units for q in model.parameters()):
            raise ValueError(f"PyTorch {torch.__version__} keeps FSDP2's root gathered after forward "
                             "(it honours reshard_after_forward on the root from 2.8), where the plan "
                             "reshards it: plan again with --embed-head-unit root-kept, or use torch >= 2.8")
    shard(model, reshard_after_forward=root_reshard)
    if deterministic:
        if plan.strategy == "hsdp":
            raise ValueError("--deterministic covers 1-D meshes; HSDP's replica all-reduce is not ordered")
        from .deterministic import make_deterministic

        make_deterministic(units + [model])
    if t.prefetch and len(units) > 1:
        for a, b in zip(units, units[1:]):
            a.set_modules_to_forward_prefetch([b])
            b.set_modules_to_backward_prefetch([a])
    materialise(model, plan.strategy == "offload-all", device)
    return Parallelized(model, model, True, units, None, deterministic)


def materialise(model: nn.Module, host_params: bool, device: torch.device) -> None:
    """Give a sharded model's meta tensors storage: the parameters on `device`, or on the host
    under offload-all (CPUOffloadPolicy keeps the shards there), and the buffers on `device`
    always, as forward reads them beside the inputs. fully_shard moves a module's parameters
    and buffers to the mesh's device once, skipping meta tensors
    (torch/distributed/fsdp/_fully_shard/_fsdp_init.py `_move_states_to_device`), and nothing
    moves them later: a model built on the meta device and materialised on the host under
    offload-all would keep its buffers (rotary tables, for one) there and fail on a GPU at its
    first forward. A model built with storage was placed by fully_shard already.

    Tied parameters stay tied: Module._apply gives each module a new Parameter of a meta
    tensor it converts (torch/nn/modules/module.py, where swap_tensors is not used: plain
    tensors, DDP's and ZeRO-1's path), so after to_empty a tied head would own a weight of its
    own and DDP would train an untied model (the real-run survey: a tied model's run measured
    byte for byte the untied one's). FSDP2's DTensor parameters are swapped in place and keep
    their ties; re-tying them changes nothing."""
    if any(p.is_meta for p in model.parameters()):
        shared = _shared_parameters(model)
        model.to_empty(device=torch.device("cpu") if host_params else device)
        for aliases in shared:
            first_mod, first_name = aliases[0]
            kept = first_mod._parameters[first_name]
            for mod, name in aliases[1:]:
                mod._parameters[name] = kept
        if host_params:
            for mod in model.modules():
                for name, buf in list(mod._buffers.items()):
                    if buf is not None and buf.device != device:
                        mod._buffers[name] = buf.to(device)
    elif not host_params:
        model.to(device)


def _shared_parameters(model: nn.Module) -> list[list[tuple[nn.Module, str]]]:
    """Each parameter registered under more than one (module, name), those places in order."""
    places: dict[int, list[tuple[nn.Module, str]]] = {}
    seen: set[tuple[int, str]] = set()
    for mod in model.modules():
        for name, p in mod._parameters.items():
            if p is not None and (id(mod), name) not in seen:
                seen.add((id(mod), name))
                places.setdefault(id(p), []).append((mod, name))
    return [v for v in places.values() if len(v) > 1]


def _torch_before(version: tuple[int, int]) -> bool:
    """Whether the running torch is older than (major, minor)."""
    major, minor = (int(x) for x in torch.__version__.split(".")[:2])
    return (major, minor) < version


def set_sync(p: Parallelized, sync: bool):
    """Whether this micro-batch reduces gradients (False: accumulate locally, no collective)."""
    if p.fsdp:
        p.model.set_requires_gradient_sync(sync)
        return contextlib.nullcontext()
    return contextlib.nullcontext() if sync or p.model is p.inner else p.model.no_sync()


def build_optimizer(p: Parallelized, plan: Plan, lr: float, weight_decay: float = 0.1):
    """AdamW over this rank's parameters, its state in their dtype (the plan's master dtype, =
    its optimizer dtype: trainer_refusal checks), run as the plan's `optimizer_kernels` says
    (the time and memory models price the same): fused (one pass, no full-size temporaries),
    foreach (torch's multi-tensor ops) or single (one parameter at a time: fake-tensor traces,
    whose multi-tensor peak is inflated). Under --deterministic a fused plan runs single, the
    per-parameter AdamW its reference runs (fused rounds differently), whose temporaries (two of
    the largest parameter) are the nearest to fused's none."""
    if plan.train.optimizer != "adamw":
        raise ValueError(f"the trainer runs AdamW; the plan asks for {plan.train.optimizer}")
    params = [q for q in p.model.parameters() if q.requires_grad]
    kernels = plan.train.optimizer_kernels
    if kernels == "fused" and p.deterministic:
        kernels = "single"
    flags = {"fused": {"fused": True}, "foreach": {"foreach": True}, "single": {"foreach": False}}[kernels]
    kw = dict(lr=lr, betas=(0.9, 0.95), weight_decay=weight_decay, eps=1e-8, **flags)
    if plan.strategy == "zero1":
        from torch.distributed.optim import ZeroRedundancyOptimizer

        return ZeroRedundancyOptimizer(params, optimizer_class=torch.optim.AdamW, **kw)
    return torch.optim.AdamW(params, **kw)
