"""A plan, written as what other tools read: a DeepSpeed config, an accelerate FSDP config, a
torchrun command line. Each says what the plan assumed (buckets, prefetch, resharding, offload,
optimizer, dtypes), or is refused with the reason where the target's file cannot say it; tests
load each export with the target's own config code and check the values."""

from __future__ import annotations

import json
import os
import shlex

from .comm import bucket_elements
from .deepspeed import stage3_settings, unit_elements
from .errors import UsageError
from .plan import Plan
from .specs import DEEPSPEED_SUB_GROUP_ELEMS

DS_STAGE = {"ddp": 0, "zero1": 1, "zero2": 2, "zero3": 3, "zero3-noreshard": 3, "hsdp": 3,
            "offload-opt": 3, "offload-all": 3}
DS_DTYPE = {"bf16": "bf16", "fp16": "fp16"}
# DeepSpeed's optimizer "type": its own (deepspeed/runtime/config.py DEEPSPEED_OPTIMIZERS) or a
# torch.optim class name, which the engine instantiates (engine._configure_basic_optimizer)
DS_OPTIMIZER = {"adamw": "AdamW", "sgd": "SGD", "muon": "Muon"}
PLACEHOLDER_LR = 3e-4  # the DeepSpeed config's learning rate: a placeholder (optimizer_note)


def _ds_precision(plan: Plan, stage: int) -> dict:
    """bf16 / fp16 blocks and the reduction dtype, as the plan's precision says."""
    p = plan.train.precision
    cfg: dict = {}
    if p.param not in ("bf16", "fp16", "fp32"):
        raise UsageError(f"DeepSpeed computes in bf16, fp16 or fp32, not param dtype {p.param}; plan again with --param-dtype bf16")
    if p.reduce not in ("bf16", "fp16", "fp32"):
        raise UsageError(f"DeepSpeed reduces in bf16, fp16 or fp32, not {p.reduce}; plan again with --reduce-dtype fp32")
    cfg["communication_data_type"] = p.reduce
    if p.param == "fp32":
        if p.master != "fp32" or p.optimizer != "fp32":
            raise UsageError("fp32 compute keeps fp32 master weights and optimizer state in DeepSpeed; plan again with --master-dtype fp32 --optimizer-dtype fp32")
        return cfg
    block: dict = {"enabled": True}
    if p.master == p.param:
        if stage == 0:
            raise UsageError(f"DeepSpeed keeps {p.master} master weights only under ZeRO 1-3, not ddp; plan again with --master-dtype fp32")
        # 16-bit master weights need ZeRO-Offload's CPU Adam where the optimizer state is not bf16
        # (fp16 always): deepspeed.initialize asserts it (runtime/base_optimizer.py, the
        # bf16/fp16 offload validators of stage_1_and_2.py and stage3.py; v0.19)
        if (p.param == "fp16" or p.optimizer != "bf16") and plan.strategy not in ("offload-opt", "offload-all"):
            also = "--optimizer-dtype bf16, " if p.param == "bf16" else ""
            raise UsageError(f"DeepSpeed keeps {p.master} master weights with {p.optimizer} optimizer state only "
                             f"with the optimizer offloaded to its CPU Adam (deepspeed.initialize refuses "
                             f"{plan.strategy}): plan again with --strategy offload-opt, {also}or --master-dtype fp32")
        block[f"{p.param}_master_weights_and_grads"] = True
    elif p.master != "fp32":
        raise UsageError(f"DeepSpeed keeps master weights in fp32 or {p.param}, not {p.master}; plan again with --master-dtype fp32")
    if p.optimizer != "fp32":
        if p.param != "bf16" or p.optimizer != "bf16" or p.master != "bf16":
            raise UsageError(f"DeepSpeed keeps {p.optimizer} optimizer state only as bf16 with bf16 master "
                             f"weights; plan again with --optimizer-dtype fp32")
        block["bf16_optimizer_states"] = True
    cfg[DS_DTYPE[p.param]] = block
    return cfg


def deepspeed_config(plan: Plan, zeropp: bool = False) -> dict:
    """DeepSpeed's config JSON (deepspeed.ai/docs/config-json), with the plan's buckets, prefetch,
    resharding, offload, optimizer and dtypes. Bucket sizes are elements: DDP-style buckets of the
    plan's `ddp_bucket_bytes` (25 MiB) in the reduce and param dtypes for stages 0-2; for stage 3
    one unit (the plan's all-gather and reduce-scatter granularity)."""
    t, n = plan.train, plan.num_gpus
    stage = DS_STAGE[plan.strategy]
    if t.optimizer == "adam8bit":
        raise UsageError("DeepSpeed's config names no 8-bit Adam (bitsandbytes' AdamW8bit is passed as "
                         "deepspeed.initialize(optimizer=...) in your code, and ZeRO-Offload runs "
                         "only DeepSpeed's CPU Adam); export a plan made with --optimizer adamw, "
                         "or run 8-bit Adam through your own script")
    bucket = plan.assumptions.ddp_bucket_bytes
    zo: dict = {"stage": stage, "overlap_comm": plan.assumptions.overlap, "contiguous_gradients": True}
    if stage in (1, 2) and not t.deepspeed_bucket_allreduce:  # the plan prices per-owner reduces: the
        zo["use_multi_rank_bucket_allreduce"] = False  # key, written only then (DeepSpeed before 0.12.4
        # has none and refuses unknown keys; deepspeed_reduce_note says so)
    if stage == 3 and t.optimizer == "muon":  # ZeRO-3 refuses Muon beside its reduce-scatter; the plan
        zo["reduce_scatter"] = False  # prices the all-reduce it runs instead (policy.all_reduces_gradients)
    if stage == 3 and t.deepspeed_sub_group != DEEPSPEED_SUB_GROUP_ELEMS:  # the step's sub-groups, as priced
        zo["sub_group_size"] = t.deepspeed_sub_group
    if t.deepspeed_defaults:
        pass  # the run keeps DeepSpeed's own buckets, as the plan prices them
    elif stage < 3:
        zo["reduce_bucket_size"] = bucket_elements(bucket, t.precision.reduce)
        zo["allgather_bucket_size"] = bucket_elements(bucket, t.precision.param)
    else:
        # one source with the pricing: comm prices what DeepSpeed gathers at these settings
        sc = plan.scenario().for_strategy(True)  # the scenario comm prices a sharded strategy on
        s3 = stage3_settings(sc, plan.strategy == "hsdp", t.reshard_after_forward)
        zo["reduce_bucket_size"] = unit_elements(sc, plan.strategy == "hsdp")[0]
        zo["stage3_prefetch_bucket_size"] = s3.prefetch_bucket
        zo["stage3_param_persistence_threshold"] = s3.persistence_threshold  # every parameter sharded
        zo["stage3_max_live_parameters"] = s3.max_live
        zo["stage3_max_reuse_distance"] = s3.reuse_distance
    if t.optimizer == "adamw" and t.optimizer_kernels == "single":
        raise UsageError("DeepSpeed runs AdamW as FusedAdam or, with torch_adam, torch's foreach "
                         "AdamW, not a loop over parameters: export a plan made with "
                         "--optimizer-kernels fused or foreach")
    if t.float8:
        raise UsageError("DeepSpeed's config has no float8 linears (torchao's and TransformerEngine's "
                         "float8 training are applied in code): export a plan made without --float8")
    if plan.strategy == "hsdp":
        raise UsageError("DeepSpeed has no shard-within-a-group ZeRO-3 since it removed MiCS "
                         "(github.com/deepspeedai/DeepSpeed/issues/8489): export a zero3 plan, or "
                         "this plan --to accelerate")
    if plan.strategy in ("offload-opt", "offload-all"):
        zo["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
    if plan.strategy == "offload-all":
        zo["offload_param"] = {"device": "cpu", "pin_memory": True}
    if zeropp:
        if stage != 3:
            raise UsageError(f"--zeropp needs a ZeRO-3 plan; this plan is {plan.strategy}")
        gpn = plan.cluster.gpus_per_node
        if n % gpn:  # zero.Init builds the hpZ groups with _ensure_divisibility(world, hpz size)
            raise UsageError(f"--zeropp's hpZ groups are a node's {gpn} GPUs and DeepSpeed needs the world to "
                             f"divide into them; {n} GPUs do not: plan for a multiple of {gpn}")
        zo["zero_hpz_partition_size"] = gpn
        zo["zero_quantized_weights"] = True
        zo["zero_quantized_gradients"] = True
    cfg: dict = {
        "train_batch_size": t.micro_batch * t.grad_accum * n,
        "train_micro_batch_size_per_gpu": t.micro_batch,
        "gradient_accumulation_steps": t.grad_accum,
        "gradient_clipping": 1.0 if t.grad_clip else 0.0,
        "zero_optimization": zo,
    }
    cfg.update(_ds_precision(plan, stage))
    cfg["optimizer"] = {"type": DS_OPTIMIZER[t.optimizer], "params": {"lr": PLACEHOLDER_LR, "weight_decay": 0.1}}
    if t.optimizer == "sgd":  # the SGD the plan prices: a momentum buffer, no weight decay (whose
        # foreach step makes a gradient-sized temporary); DeepSpeed passes these to torch.optim.SGD
        cfg["optimizer"]["params"] = {"lr": PLACEHOLDER_LR, "momentum": 0.9, "weight_decay": 0.0}
    if t.optimizer == "adamw" and t.optimizer_kernels == "foreach":
        cfg["optimizer"]["params"]["torch_adam"] = True  # torch.optim.AdamW: foreach on CUDA
    if t.optimizer == "sgd" and stage:
        cfg["zero_allow_untested_optimizer"] = True  # torch.optim.SGD is not one of ZeRO's own
    if t.checkpointing != "none":
        cfg["activation_checkpointing"] = {
            "partition_activations": False, "contiguous_memory_optimization": False,
            "cpu_checkpointing": False, "number_checkpoints": None,
            "synchronize_checkpoint_boundary": False, "profile": False,
        }
    return cfg


def _accelerate_refusal(plan: Plan) -> str | None:
    """What accelerate's config file cannot say about this plan (it can say it in code)."""
    t, p = plan.train, plan.train.precision
    if plan.strategy in ("zero1", "offload-opt"):
        return f"accelerate's FSDP has no {plan.strategy} (optimizer-only sharding or offload); export --to deepspeed"
    if p.param not in ("bf16", "fp16", "fp32") or p.master != "fp32" or p.optimizer != "fp32":
        return (f"accelerate's mixed precision keeps fp32 weights and optimizer state and computes in "
                f"bf16/fp16/fp32; the plan has param {p.param}, master {p.master}, optimizer "
                f"{p.optimizer}: plan again with "
                + " ".join(f for f, bad in (("--param-dtype bf16", p.param not in ("bf16", "fp16", "fp32")),
                                            ("--master-dtype fp32", p.master != "fp32"),
                                            ("--optimizer-dtype fp32", p.optimizer != "fp32")) if bad))
    wanted = p.master if plan.strategy == "ddp" else p.param  # DDP reduces the fp32 gradients
    if p.reduce != wanted:
        return (f"accelerate's config reduces gradients in {wanted}, the plan in {p.reduce}: plan again "
                f"with --reduce-dtype {wanted}, or pass FullyShardedDataParallelPlugin("
                f"mixed_precision_policy=...) in code")
    if t.float8:
        return ("accelerate's config file cannot set the plan's float8 linears (torchao's, or "
                "TransformerEngine's under FSDP as the plan prices them): plan again without --float8")
    if plan.strategy != "ddp":
        if t.fsdp1:
            return ("accelerate's config is written for FSDP2 (fsdp_version: 2); the plan prices "
                    "FSDP1's copies: plan again without --fsdp1")
        if t.blocks_per_unit != 1:
            return (f"accelerate wraps one transformer block per unit, the plan {t.blocks_per_unit}: "
                    f"plan again with --blocks-per-unit 1")
        if not t.prefetch:
            return "FSDP2 under accelerate always prefetches the next unit: plan again with --prefetch"
        if t.last_block_kept:
            return ("accelerate's FSDP2 reshards every block after forward; the plan keeps the last "
                    "one gathered: plan again without --last-block-kept")
        if not plan.model.tied_embeddings and t.embed_head_unit != "head-kept":
            return (f"accelerate's FSDP2 shards the embeddings and the final norm + head as units of "
                    f"their own and keeps the head's gathered after forward (accelerate PR 4015, "
                    f"2026-04); the plan prices embed_head_unit {t.embed_head_unit}: plan again with "
                    f"--embed-head-unit head-kept")
        if t.checkpointing not in ("none", "full"):
            return (f"accelerate's fsdp_activation_checkpointing recomputes whole blocks, not "
                    f"{t.checkpointing}: plan again with --checkpointing full or none")
        why = _accelerate_experts_refusal(plan)
        if why:
            return why
    return None


def _accelerate_experts_refusal(plan: Plan) -> str | None:
    """accelerate's FSDP2 passes no shard_placement_fn: a Hugging Face MoE model's fused experts
    (E, ., .) split on dim 0 over the shard group, padded to whole chunks, where the plan prices
    torchtitan's placement (arch.fsdp_shard_elems: dim 1 past E ranks, the way FSDP2 holds no
    padding). Refused where the two differ: Mixtral's 8 experts on 16 ranks, each rank holds one
    expert's rows, 2x the expert memory the plan counts."""
    from . import arch

    m = plan.model
    if not m.num_experts:
        return None
    degree = plan.shard_size if plan.strategy == "hsdp" and plan.shard_size else plan.num_gpus
    shapes = [s for s in arch.expert_shapes(m, plan.train.layout) if len(s) == 3]
    priced = sum(arch.fsdp_shard_elems(s, degree, plan.num_gpus) for s in shapes)
    dim0 = sum(arch.ceil_div(s[0], degree) * s[1] * s[2] for s in shapes)
    if dim0 <= priced:
        return None
    return (f"accelerate's FSDP2 splits a Hugging Face MoE model's fused experts on dim 0: "
            f"{m.num_experts} experts over {degree} ranks hold {dim0 / priced:.1f}x the expert "
            f"memory the plan counts (torchtitan's placement, dim 1 past {m.num_experts} ranks): "
            f"plan at most {m.num_experts} GPUs per shard group, or export --to torchrun and pass "
            f"fully_shard a shard_placement_fn as torchtitan does")


def accelerate_config(plan: Plan) -> str:
    """accelerate's YAML config (`accelerate launch --config_file`): DDP or FSDP2, HSDP through
    its parallelism_config; refused where the file cannot carry what the plan assumed."""
    why = _accelerate_refusal(plan)
    if why:
        raise UsageError(why)
    dist = "MULTI_GPU" if plan.strategy == "ddp" else "FSDP"
    nodes = -(-plan.num_gpus // plan.cluster.gpus_per_node)
    mp = plan.train.precision.param if plan.train.precision.param in ("bf16", "fp16") else "no"
    lines = [
        "compute_environment: LOCAL_MACHINE",
        "debug: false",
        f"distributed_type: {dist}",
        "downcast_bf16: 'no'",
    ]
    if dist == "FSDP":
        lines += [
            "fsdp_config:",
            f"  fsdp_activation_checkpointing: {str(plan.train.checkpointing == 'full').lower()}",
            "  fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP",
            "  fsdp_cpu_ram_efficient_loading: true",
            f"  fsdp_offload_params: {str(plan.strategy == 'offload-all').lower()}",
            f"  fsdp_reshard_after_forward: {str(plan.train.reshard_after_forward).lower()}",
            "  fsdp_state_dict_type: SHARDED_STATE_DICT",
            "  fsdp_version: 2",
        ]
    if plan.strategy == "hsdp":
        r, s = plan.mesh.shape
        lines += ["parallelism_config:", f"  parallelism_config_dp_replicate_size: {r}",
                  f"  parallelism_config_dp_shard_size: {s}"]
    lines += ["machine_rank: 0"]
    if nodes > 1:  # accelerate's rendezvous for several machines (utils/launch.py: main_process_ip:port)
        lines += ["main_process_ip: HEAD_NODE", "main_process_port: 29500"]
    lines += [
        "main_training_function: main",
        f"mixed_precision: '{mp}'",  # quoted: YAML reads a bare no as false (accelerate then fails)
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
    nodes, last = -(-plan.num_gpus // gpn), plan.num_gpus % gpn
    argv = ["torchrun"]
    if nodes == 1:
        argv += ["--standalone", "--nnodes=1", f"--nproc-per-node={gpn}"]
    else:
        argv += [f"--nnodes={nodes}", f"--nproc-per-node={gpn}", "--rdzv-backend=c10d",
                 "--rdzv-endpoint=$HEAD_NODE:29500", "--rdzv-id=zplan"]
    # the plan's absolute path: the line runs from wherever it is pasted (a job script's folder)
    prefix = f"ZPLAN_PLAN={shlex.quote(os.path.abspath(plan_path))} "
    # a last node the ranks do not fill runs fewer (torchrun's agents may differ in local size)
    note = (f"# {plan.num_gpus} ranks: {gpn} on each node but the last, which runs {last} "
            f"(--nproc-per-node={last} there)\n") if last else ""
    return note + prefix + " ".join(argv + script.split())


def checkpointing_note(plan: Plan) -> str | None:
    """What DeepSpeed's config cannot carry about the plan's checkpointing: the script applies
    it (DeepSpeed's activation_checkpointing section configures only its own checkpoint API).
    None where nothing is checkpointed, or every block is."""
    from .policy import checkpointing_label

    t = plan.train
    if t.checkpointing == "none":
        return None
    if t.checkpointing == "full":
        return ("the plan checkpoints every block: your script applies it (model.gradient_checkpointing_enable(), "
                "or torch.utils.checkpoint per block); the config's activation_checkpointing section only "
                "configures deepspeed.checkpointing, which the engine does not turn on")
    which = {"every-k": f"blocks {t.checkpoint_every}, {2 * t.checkpoint_every}, ... (counting from 1)",
             "first-k": f"the first {t.checkpoint_first} blocks",
             "selective": "every block with torchtitan's per-op policy (every second matmul kept)",
             "attention": "each block's attention core"}.get(t.checkpointing, t.checkpointing)
    return (f"the plan checkpoints {which} ({checkpointing_label(t)}), which a DeepSpeed config does not "
            f"say: your script applies it (Hugging Face's gradient_checkpointing_enable checkpoints every "
            f"block, which zplan estimate --checkpointing full prices)")


def script_applies(plan: Plan, checkpointing: bool) -> list[str]:
    """What of the plan's pricing a training script applies itself (nothing zplan hands it
    carries it): torch.compile, float8 linears, a chunked or fused loss, and with `checkpointing`
    the plan's activation checkpointing."""
    t = plan.train
    what = (["torch.compile" + (" (the whole model)" if t.compile_scope != "block" else " (each block)")]
            if t.compile else [])
    what += ["float8 linears (torchao)"] if t.float8 else []
    what += [f"the {t.linear_loss} linear loss (the head and loss over chunks, never the whole logits)"] \
        if t.linear_loss != "none" else []
    what += ["a fused cross-entropy kernel"] if t.fused_loss else []
    what += [f"the cross-entropy over {t.loss_chunks} sequence chunks of the logits in turn (torchtitan's "
             "chunked_cross_entropy_loss)"] if t.loss_chunks > 1 else []
    if checkpointing and t.checkpointing != "none":
        what.append(f"activation checkpointing ({t.checkpointing})")
    return what


def code_note(plan: Plan, to: str) -> str | None:
    """What the plan was priced with that lives in the training script, not in a DeepSpeed or
    accelerate config, so that a run from the config alone would not have it (its memory and
    time are then not the plan's): torch.compile, float8 linears, a chunked or fused loss, and
    checkpointing under accelerate's DDP (MULTI_GPU has no checkpointing key). None where none."""
    what = script_applies(plan, checkpointing=to == "accelerate" and plan.strategy == "ddp")
    if not what:
        return None
    return (f"the plan was priced with {', '.join(what)}, which the {to} config does not carry: your script "
            f"applies it, or the run's memory and time are not the plan's")


def layout_note(plan: Plan) -> str | None:
    """A plan priced for zplan's FSDP2 trainer (the torch layout) exported as a DeepSpeed config:
    DeepSpeed's buffers, flat partitions and defaults are another memory (and time) model, which
    a plan made for DeepSpeed prices. None for a plan made for DeepSpeed."""
    if plan.train.layout == "zero":
        return None
    return ("the plan was priced for zplan's FSDP2 trainer (torch layout); DeepSpeed's buffers and "
            "partitions are another memory figure: for DeepSpeed's, plan with zplan recommend --for "
            "deepspeed (or estimate --layout zero)")


ZEROPP_NOTE = ("--zeropp adds ZeRO++ (a secondary bf16 partition of the weights per node, int8 gathers, "
               "int4 gradient reduction), which the plan's memory and traffic figures do not count")


def deepspeed_reduce_note(plan: Plan) -> str | None:
    """A ZeRO-1/2 plan priced with one reduce per owning rank writes use_multi_rank_bucket_allreduce
    false, a key DeepSpeed has from 0.12.4 (runtime/zero/config.py, PR #4695); its config refuses
    unknown keys, so an older DeepSpeed (which reduces to each owner anyway) needs it removed."""
    if DS_STAGE.get(plan.strategy) not in (1, 2) or plan.train.deepspeed_bucket_allreduce:
        return None
    return ("the config sets use_multi_rank_bucket_allreduce false (one reduce per owning rank, as the plan "
            "prices it), a key from DeepSpeed 0.12.4: on an older DeepSpeed, which reduces so anyway, remove it")


def accelerate_nodes_note(plan: Plan) -> str | None:
    """A config for several machines names the head node as HEAD_NODE and machine rank 0: each
    node's command gives its own. None on one node."""
    nodes = -(-plan.num_gpus // plan.cluster.gpus_per_node)
    if nodes == 1:
        return None
    return (f"the plan spans {nodes} machines: on each, run accelerate launch --config_file FILE "
            f"--machine_rank I --main_process_ip HEAD (I = 0..{nodes - 1}; HEAD the address of machine 0, "
            f"HEAD_NODE in the file)")


def bucket_view_note(plan: Plan) -> str | None:
    """accelerate's DDP (distributed_type MULTI_GPU) wraps the model with PyTorch's default
    gradient_as_bucket_view=False unless the script passes DistributedDataParallelKwargs; a plan
    priced with bucket views (`ddp_bucket_view`, zplan's trainer) says so. None otherwise."""
    if plan.strategy != "ddp" or not plan.train.ddp_bucket_view:
        return None
    return ("the plan prices DDP's gradients as views of its buckets; accelerate keeps `.grad` apart "
            "(twice the gradients by the optimizer step) unless your script passes "
            "Accelerator(kwargs_handlers=[DistributedDataParallelKwargs(gradient_as_bucket_view=True)]); "
            "or plan again with --no-ddp-bucket-view")


def optimizer_note(plan: Plan) -> str:
    """The DeepSpeed config's learning rate and weight decay are placeholders: a plan carries no
    hyperparameter (none changes a figure zplan predicts)."""
    wd = 0.0 if plan.train.optimizer == "sgd" else 0.1
    return (f"the config's optimizer lr {PLACEHOLDER_LR:g} and weight_decay {wd:g} are placeholders (a plan carries no "
            f"hyperparameters; none changes its figures): set your own")


def accelerate_batch_note(plan: Plan) -> str:
    """accelerate's config file has no batch: the plan's micro-batch and accumulation are the
    script's to set."""
    t = plan.train
    return (f"accelerate's config holds no batch: the plan's micro-batch {t.micro_batch} and accumulation "
            f"{t.grad_accum} are your script's DataLoader batch_size and Accelerator(gradient_accumulation_steps="
            f"{t.grad_accum})")


def export(plan: Plan, to: str, plan_path: str, zeropp: bool = False) -> str:
    if to == "deepspeed":
        return json.dumps(deepspeed_config(plan, zeropp), indent=2) + "\n"
    if to == "accelerate":
        return accelerate_config(plan)
    if to == "torchrun":
        return torchrun_command(plan, plan_path) + "\n"
    raise UsageError(f"--to {to!r} is not one of: deepspeed, accelerate, torchrun")
