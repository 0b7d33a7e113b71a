"""A plan, written as what other tools read: a DeepSpeed config, an accelerate FSDP config, a
torchrun command line. Keys are only those the tools document (tests hold them to it)."""

from __future__ import annotations

import json
import shlex

from .errors import UsageError
from .plan import Plan

DS_STAGE = {"ddp": 0, "zero1": 1, "zero2": 2, "zero3": 3, "zero3-noreshard": 3, "hsdp": 3,
            "offload-opt": 3, "offload-all": 3}
DS_DTYPE = {"bf16": "bf16", "fp16": "fp16"}


def deepspeed_config(plan: Plan, zeropp: bool = False) -> dict:
    """DeepSpeed's config JSON (deepspeed.ai/docs/config-json)."""
    t, n = plan.train, plan.num_gpus
    stage = DS_STAGE[plan.strategy]
    zo: dict = {"stage": stage, "overlap_comm": True, "contiguous_gradients": True}
    if stage == 3:
        if plan.strategy == "zero3-noreshard":
            zo["stage3_max_reuse_distance"] = 10**12  # keep gathered weights until backward
        zo["stage3_prefetch_bucket_size"] = int(5e8) if t.prefetch else 0
    if plan.strategy in ("offload-opt", "offload-all"):
        zo["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
    if plan.strategy == "offload-all":
        zo["offload_param"] = {"device": "cpu", "pin_memory": True}
    if plan.strategy == "hsdp":
        zo["mics_shard_size"] = plan.shard_size  # MiCS: shard within a group, replicate across
        zo["mics_hierarchical_params_gather"] = True
    if zeropp:
        if stage != 3:
            raise UsageError(f"--zeropp needs a ZeRO-3 plan; this plan is {plan.strategy}")
        zo["zero_hpz_partition_size"] = plan.cluster.gpus_per_node
        zo["zero_quantized_weights"] = True
        zo["zero_quantized_gradients"] = True
    cfg: dict = {
        "train_batch_size": t.micro_batch * t.grad_accum * n,
        "train_micro_batch_size_per_gpu": t.micro_batch,
        "gradient_accumulation_steps": t.grad_accum,
        "gradient_clipping": 1.0,
        "zero_optimization": zo,
    }
    p = t.precision.param
    if p in DS_DTYPE:
        cfg[DS_DTYPE[p]] = {"enabled": True}
    if t.precision.reduce in ("bf16", "fp16", "fp32"):
        cfg["communication_data_type"] = t.precision.reduce
    opt = {"adamw": "AdamW", "sgd": "SGD", "adam8bit": "AdamW", "muon": "Muon"}[t.optimizer]
    cfg["optimizer"] = {"type": opt, "params": {"lr": 3e-4, "weight_decay": 0.1}}
    if t.checkpointing != "none":
        cfg["activation_checkpointing"] = {
            "partition_activations": False, "contiguous_memory_optimization": False,
            "cpu_checkpointing": False, "number_checkpoints": None,
            "synchronize_checkpoint_boundary": False, "profile": False,
        }
    return cfg


def accelerate_config(plan: Plan) -> str:
    """accelerate's YAML config for FSDP2 (`accelerate launch --config_file`)."""
    if plan.strategy in ("ddp", "zero1"):
        dist = "MULTI_GPU"
    elif plan.strategy == "offload-opt":
        raise UsageError("accelerate's FSDP cannot offload only the optimizer; export --to deepspeed")
    else:
        dist = "FSDP"
    nodes = max(1, plan.num_gpus // plan.cluster.gpus_per_node)
    mp = plan.train.precision.param if plan.train.precision.param in ("bf16", "fp16", "fp8") else "no"
    lines = [
        "compute_environment: LOCAL_MACHINE",
        "debug: false",
        f"distributed_type: {dist}",
        "downcast_bf16: 'no'",
    ]
    if dist == "FSDP":
        reshard = plan.strategy not in ("zero2", "zero3-noreshard")
        lines += [
            "fsdp_config:",
            f"  fsdp_activation_checkpointing: {str(plan.train.checkpointing != 'none').lower()}",
            "  fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP",
            "  fsdp_cpu_ram_efficient_loading: true",
            f"  fsdp_offload_params: {str(plan.strategy == 'offload-all').lower()}",
            f"  fsdp_reshard_after_forward: {str(reshard).lower()}",
            "  fsdp_state_dict_type: SHARDED_STATE_DICT",
            "  fsdp_version: 2",
        ]
    lines += [
        "machine_rank: 0",
        "main_training_function: main",
        f"mixed_precision: {mp}",
        f"num_machines: {nodes}",
        f"num_processes: {plan.num_gpus}",
        "rdzv_backend: static",
        "same_network: true",
        "use_cpu: false",
    ]
    return "\n".join(lines) + "\n"


def torchrun_command(plan: Plan, plan_path: str, script: str = "-m zplan.trainer") -> str:
    """The torchrun line that runs this plan (one node standalone, or c10d rendezvous)."""
    gpn = min(plan.cluster.gpus_per_node, plan.num_gpus)
    nodes = max(1, plan.num_gpus // gpn)
    argv = ["torchrun"]
    if nodes == 1:
        argv += ["--standalone", "--nnodes=1", f"--nproc-per-node={gpn}"]
    else:
        argv += [f"--nnodes={nodes}", f"--nproc-per-node={gpn}", "--rdzv-backend=c10d",
                 "--rdzv-endpoint=$HEAD_NODE:29500", "--rdzv-id=zplan"]
    prefix = f"ZPLAN_PLAN={shlex.quote(plan_path)} "
    return prefix + " ".join(argv + script.split())


def export(plan: Plan, to: str, plan_path: str, zeropp: bool = False) -> str:
    if to == "deepspeed":
        return json.dumps(deepspeed_config(plan, zeropp), indent=2) + "\n"
    if to == "accelerate":
        return accelerate_config(plan)
    if to == "torchrun":
        return torchrun_command(plan, plan_path) + "\n"
    raise UsageError(f"--to {to!r} is not one of: deepspeed, accelerate, torchrun")
