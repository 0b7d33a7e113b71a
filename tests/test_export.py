"""Exports use only the keys DeepSpeed, accelerate and torchrun document."""

import json

import pytest

from zplan.export import accelerate_config, deepspeed_config, torchrun_command
from zplan.plan import make_plan
from tests.helpers import est, scenario

# deepspeed.ai/docs/config-json and deepspeed/runtime/zero/config.py (DeepSpeedZeroConfig fields)
DS_TOP = {"train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps",
          "optimizer", "scheduler", "communication_data_type", "fp16", "bf16", "gradient_clipping",
          "zero_optimization", "activation_checkpointing", "steps_per_print"}
DS_ZERO = {"stage", "contiguous_gradients", "reduce_scatter", "reduce_bucket_size",
           "allgather_partitions", "allgather_bucket_size", "overlap_comm", "offload_param",
           "offload_optimizer", "sub_group_size", "stage3_prefetch_bucket_size",
           "stage3_param_persistence_threshold", "stage3_max_live_parameters",
           "stage3_max_reuse_distance", "stage3_gather_16bit_weights_on_model_save",
           "zero_hpz_partition_size", "zero_quantized_weights", "zero_quantized_gradients",
           "mics_shard_size", "mics_hierarchical_params_gather", "round_robin_gradients"}
DS_OFFLOAD = {"device", "nvme_path", "pin_memory", "buffer_count", "ratio", "fast_init"}
DS_AC = {"partition_activations", "cpu_checkpointing", "contiguous_memory_optimization",
         "number_checkpoints", "synchronize_checkpoint_boundary", "profile"}
# accelerate's `accelerate config` YAML (FSDP2 fields as `accelerate config` writes them)
ACC_TOP = {"compute_environment", "debug", "distributed_type", "downcast_bf16", "fsdp_config",
           "machine_rank", "main_training_function", "mixed_precision", "num_machines",
           "num_processes", "rdzv_backend", "same_network", "use_cpu"}
ACC_FSDP = {"fsdp_activation_checkpointing", "fsdp_auto_wrap_policy", "fsdp_cpu_ram_efficient_loading",
            "fsdp_offload_params", "fsdp_reshard_after_forward", "fsdp_state_dict_type",
            "fsdp_version", "fsdp_transformer_layer_cls_to_wrap"}


def plan_for(strategy, **kw):
    sc = scenario(**kw)
    return make_plan(sc, strategy, sc.n * sc.train.micro_batch, est(strategy, **kw))


@pytest.mark.parametrize("strategy,stage", [("ddp", 0), ("zero1", 1), ("zero2", 2), ("zero3", 3),
                                            ("hsdp", 3), ("offload-opt", 3), ("offload-all", 3)])
def test_deepspeed_keys_and_values(strategy, stage):
    p = plan_for(strategy, model="llama-3.1-8b", gpus=16, micro_batch=2, grad_accum=4,
                 checkpointing="full")
    cfg = deepspeed_config(p)
    assert set(cfg) <= DS_TOP
    assert set(cfg["zero_optimization"]) <= DS_ZERO
    assert cfg["zero_optimization"]["stage"] == stage
    assert cfg["train_batch_size"] == 2 * 4 * 16
    assert cfg["train_micro_batch_size_per_gpu"] == 2 and cfg["gradient_accumulation_steps"] == 4
    assert cfg["bf16"] == {"enabled": True}
    assert set(cfg["activation_checkpointing"]) <= DS_AC
    zo = cfg["zero_optimization"]
    for k in ("offload_optimizer", "offload_param"):
        if k in zo:
            assert set(zo[k]) <= DS_OFFLOAD
    assert ("offload_optimizer" in zo) == strategy.startswith("offload")
    assert ("offload_param" in zo) == (strategy == "offload-all")
    if strategy == "hsdp":
        assert zo["mics_shard_size"] == 8


def test_zeropp_keys():
    cfg = deepspeed_config(plan_for("zero3", model="llama-3.1-8b", gpus=16), zeropp=True)
    zo = cfg["zero_optimization"]
    assert zo["zero_hpz_partition_size"] == 8
    assert zo["zero_quantized_weights"] is True and zo["zero_quantized_gradients"] is True


def _yaml(text):
    """The subset of YAML accelerate writes: 'key: value' and one nested mapping."""
    out, cur = {}, None
    for line in text.splitlines():
        key, _, val = line.strip().partition(":")
        if line.startswith("  "):
            out[cur][key] = val.strip()
        elif val.strip() == "":
            cur = key
            out[key] = {}
        else:
            out[key] = val.strip()
    return out


@pytest.mark.parametrize("strategy", ["zero3", "zero2", "offload-all", "ddp"])
def test_accelerate_keys(strategy):
    y = _yaml(accelerate_config(plan_for(strategy, model="llama-3.1-8b", gpus=16)))
    assert set(y) <= ACC_TOP
    assert y["num_processes"] == "16" and y["num_machines"] == "2"
    if strategy == "ddp":
        assert y["distributed_type"] == "MULTI_GPU" and "fsdp_config" not in y
        return
    assert y["distributed_type"] == "FSDP"
    f = y["fsdp_config"]
    assert set(f) <= ACC_FSDP and f["fsdp_version"] == "2"
    assert f["fsdp_reshard_after_forward"] == ("false" if strategy == "zero2" else "true")
    assert f["fsdp_offload_params"] == ("true" if strategy == "offload-all" else "false")


def test_torchrun_line():
    one = torchrun_command(plan_for("zero3", model="tiny", gpus=8), "plan.json")
    assert one == "ZPLAN_PLAN=plan.json torchrun --standalone --nnodes=1 --nproc-per-node=8 -m zplan.trainer"
    multi = torchrun_command(plan_for("zero3", model="tiny", gpus=32), "p.json")
    assert "--nnodes=4" in multi and "--rdzv-backend=c10d" in multi and "--standalone" not in multi


def test_export_cli(run_zplan, tmp_path):
    plan = tmp_path / "plan.json"
    assert run_zplan("recommend", "--model", "llama-3.1-8b", "--gpus", "16", "--global-batch", "64",
                     "--write", str(plan)).returncode == 0
    out = tmp_path / "ds.json"
    p = run_zplan("export", "--plan", str(plan), "--to", "deepspeed", "-o", str(out))
    assert p.returncode == 0, p.stderr
    assert set(json.loads(out.read_text())) <= DS_TOP
    p = run_zplan("export", "--plan", str(plan), "--to", "nemo")
    assert p.returncode == 2 and "--to 'nemo' is not one of" in p.stderr
