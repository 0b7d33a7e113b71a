"""Exports say what the plan assumed. Each is loaded with the target's own config code
(DeepSpeed's DeepSpeedConfig, accelerate's config loader, launch environment and FSDP plugin)
and the VALUES it ends up with are checked against figures derived here from the architecture."""

import json

import pytest

from zplan.errors import UsageError
from zplan.export import accelerate_config, deepspeed_config, torchrun_command
from zplan.plan import make_plan
from tests.helpers import est, scenario

# Llama 3.1 8B (Hugging Face config): hidden 4096, 8 KV heads of 128, FFN 14336, vocab 128256
H, KV, F, V = 4096, 1024, 14336, 128256
BLOCK = 2 * H * H + 2 * KV * H + 3 * H * F + 2 * H  # one decoder layer's parameters
HEAD = V * H + H  # final norm + output projection (the largest unit)
BUCKET = 25 * 2**20  # the plan's assumed 25 MiB buckets


def plan_for(strategy, layout="zero", **kw):
    kw = dict(dict(model="llama-3.1-8b", gpus=16, micro_batch=2, grad_accum=4, checkpointing="full"), **kw)
    sc = scenario(layout=layout, **kw)
    n = sc.n * sc.train.micro_batch * sc.train.grad_accum
    return make_plan(sc, strategy, n, est(strategy, layout=layout, **kw))


@pytest.fixture
def ds_load(monkeypatch):
    """DeepSpeed's own config class, as deepspeed.initialize builds it on 16 data-parallel ranks
    (an mpu says the world size; there is no process group here)."""
    pytest.importorskip("deepspeed")
    import deepspeed.runtime.config as dsc

    class DataParallel16:
        def get_data_parallel_world_size(self):
            return 16

    monkeypatch.setattr(dsc.dist, "get_rank", lambda *a, **k: 0)
    return lambda cfg: dsc.DeepSpeedConfig(cfg, mpu=DataParallel16())


@pytest.mark.slow  # importing deepspeed takes seconds
@pytest.mark.parametrize("strategy,stage", [("ddp", 0), ("zero1", 1), ("zero2", 2), ("zero3", 3),
                                            ("zero3-noreshard", 3), ("offload-opt", 3), ("offload-all", 3)])
def test_deepspeed_reads_the_plans_values(ds_load, strategy, stage):
    import torch

    c = ds_load(deepspeed_config(plan_for(strategy)))
    z = c.zero_config
    assert (c.world_size, c.train_batch_size, c.train_micro_batch_size_per_gpu,
            c.gradient_accumulation_steps) == (16, 128, 2, 4)
    assert z.stage == stage and z.overlap_comm is True
    assert c.bfloat16_config.enabled and not c.bfloat16_config.bf16_master_weights_and_grads
    assert c.communication_data_type == torch.float32 and c.optimizer_name == "adamw"
    if stage < 3:  # DDP-style buckets: 25 MiB of fp32 gradients, of bf16 weights
        assert (z.reduce_bucket_size, z.allgather_bucket_size) == (BUCKET // 4, BUCKET // 2)
    else:  # one unit at a time, prefetching one unit, every parameter sharded
        assert z.reduce_bucket_size == HEAD and z.prefetch_bucket_size == HEAD
        assert z.param_persistence_threshold == 0
        if strategy == "zero3-noreshard":
            assert z.max_live_parameters > 8e9 and z.max_reuse_distance > 8e9
        else:
            assert z.max_live_parameters == BLOCK + HEAD and z.max_reuse_distance == 0
    assert (z.offload_optimizer is not None) == strategy.startswith("offload")
    assert (z.offload_param is not None) == (strategy == "offload-all")
    if z.offload_optimizer is not None:
        assert z.offload_optimizer.device == "cpu"


@pytest.mark.slow
def test_deepspeed_reads_dtypes_optimizers_and_zeropp(ds_load):
    import torch

    mixed = ds_load(deepspeed_config(plan_for("offload-opt", master_dtype="bf16")))  # fp32 optimizer state: CPU Adam
    assert mixed.bfloat16_config.bf16_master_weights_and_grads and not mixed.bfloat16_config.bf16_optimizer_states
    low = ds_load(deepspeed_config(plan_for("zero3", master_dtype="bf16", optimizer_dtype="bf16",
                                            reduce_dtype="bf16", prefetch=False)))
    assert low.bfloat16_config.bf16_master_weights_and_grads and low.bfloat16_config.bf16_optimizer_states
    assert low.communication_data_type == torch.bfloat16 and low.zero_config.prefetch_bucket_size == 0
    fp32 = ds_load(deepspeed_config(plan_for("zero2", param_dtype="fp32")))
    assert not fp32.bfloat16_config.enabled and not fp32.float16_config.enabled
    sgd = ds_load(deepspeed_config(plan_for("zero1", optimizer="sgd")))
    assert sgd.optimizer_name == "SGD" and sgd.zero_allow_untested_optimizer
    # the SGD the plan prices (a momentum buffer, no weight decay: a review found momentum 0 and
    # weight decay 0.1 written, neither priced)
    assert sgd.optimizer_params == {"lr": 3e-4, "momentum": 0.9, "weight_decay": 0.0}
    pp = ds_load(deepspeed_config(plan_for("zero3"), zeropp=True)).zero_config
    assert pp.zero_hpz_partition_size == 8 and pp.zero_quantized_weights and pp.zero_quantized_gradients
    assert ds_load(deepspeed_config(plan_for("zero3"))).gradient_clipping == 1.0
    assert ds_load(deepspeed_config(plan_for("zero3", grad_clip=False))).gradient_clipping == 0.0
    foreach = deepspeed_config(plan_for("zero3", layout="torch", optimizer_kernels="foreach"))
    assert ds_load(foreach).optimizer_params["torch_adam"] is True  # torch.optim.AdamW, foreach


@pytest.mark.parametrize("strategy,kw,needle", [
    ("zero3", dict(optimizer="adam8bit"), "names no 8-bit Adam"),
    ("hsdp", dict(), "removed MiCS"),
    ("ddp", dict(master_dtype="bf16", optimizer_dtype="bf16"), "only under ZeRO 1-3"),
    ("zero3", dict(master_dtype="fp32", optimizer_dtype="bf16"), "bf16 master"),
    ("zero3", dict(layout="torch", optimizer_kernels="single"), "not a loop over parameters"),
])
def test_deepspeed_refuses_what_its_config_cannot_say(strategy, kw, needle):
    with pytest.raises(UsageError, match=needle):
        deepspeed_config(plan_for(strategy, **kw))


@pytest.mark.parametrize("kw,needle", [(dict(checkpointing="first-k", checkpoint_first=5), "the first 5 blocks (first-5)"),
                                       (dict(checkpointing="every-k", checkpoint_every=4), "blocks 4, 8, ... (counting from 1)"),
                                       (dict(checkpointing="full"), "checkpoints every block"),
                                       (dict(checkpointing="none"), None)])
def test_deepspeed_export_says_which_blocks_the_script_must_checkpoint(tmp_path, capsys, kw, needle):
    """A DeepSpeed config cannot say which blocks are checkpointed (its activation_checkpointing
    section configures only DeepSpeed's own checkpoint API, which the engine does not turn on,
    deepspeed/runtime/activation_checkpointing/checkpointing.py `configure`): the export writes
    the config on stdout and says on stderr, in one line, what the script must checkpoint, every
    block included; nothing where no block is."""
    from zplan.plan import save
    from tests.helpers import cli

    path = tmp_path / "plan.json"
    save(plan_for("zero3", **kw), path)
    r = cli(capsys, "export", "--plan", str(path), "--to", "deepspeed")
    assert r.returncode == 0 and json.loads(r.stdout)["zero_optimization"]["stage"] == 3
    # the optimizer's hyperparameters are placeholders, said in a line of their own
    lines = [ln for ln in r.stderr.strip().splitlines() if "are placeholders" not in ln]
    cfg = json.loads(r.stdout)["optimizer"]["params"]
    assert f"lr {cfg['lr']:g} and weight_decay {cfg['weight_decay']:g} are placeholders" in r.stderr
    if needle is None:
        assert lines == []
    else:
        assert len(lines) == 1 and needle in lines[0] and "gradient_checkpointing_enable" in lines[0]


def _accelerate_env(tmp_path, monkeypatch, plan):
    """accelerate launch's own path: config file -> launch arguments -> worker environment."""
    pytest.importorskip("accelerate")
    from accelerate.commands.config.config_args import load_config_from_file
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils.launch import prepare_multi_gpu_env

    path = tmp_path / "accelerate.yaml"
    path.write_text(accelerate_config(plan))
    cfg = load_config_from_file(str(path))
    args = launch_command_parser().parse_args(["--config_file", str(path), "train.py"])
    args, _, _ = _validate_launch_command(args)
    env = prepare_multi_gpu_env(args)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    return cfg, env


@pytest.mark.slow  # importing deepspeed takes seconds
def test_deepspeed_defaults_plan_leaves_the_stage3_buckets_to_deepspeed(ds_load):
    """A plan priced at DeepSpeed's default stage-3 settings exports none of them, so DeepSpeed's
    own config class fills the values zplan/deepspeed.py prices (its oracle here)."""
    from zplan import deepspeed as ds

    z = ds_load(deepspeed_config(plan_for("zero3", deepspeed_defaults=True))).zero_config
    assert (z.prefetch_bucket_size, z.reduce_bucket_size, z.param_persistence_threshold,
            z.max_live_parameters, z.max_reuse_distance) == (
        ds.PREFETCH_BUCKET_ELEMS, ds.REDUCE_BUCKET_ELEMS, ds.PERSISTENCE_THRESHOLD_ELEMS,
        ds.MAX_LIVE_ELEMS, ds.MAX_REUSE_DISTANCE_ELEMS)
    z2 = ds_load(deepspeed_config(plan_for("zero2", deepspeed_defaults=True))).zero_config
    assert (z2.reduce_bucket_size, z2.allgather_bucket_size) == (ds.REDUCE_BUCKET_ELEMS, ds.ALLGATHER_BUCKET_ELEMS)


@pytest.mark.slow  # importing accelerate takes seconds
@pytest.mark.parametrize("strategy", ["zero3", "zero2", "offload-all", "hsdp", "ddp"])
def test_accelerate_reads_the_plans_values(tmp_path, monkeypatch, strategy):
    import torch

    plan = plan_for(strategy, layout="torch", reduce_dtype="fp32" if strategy == "ddp" else "bf16",
                    embed_head_unit="head-kept")
    cfg, env = _accelerate_env(tmp_path, monkeypatch, plan)
    assert (cfg.num_processes, cfg.num_machines, cfg.mixed_precision) == (16, 2, "bf16")
    if strategy == "ddp":
        assert cfg.distributed_type.value == "MULTI_GPU" and "ACCELERATE_USE_FSDP" not in env
        return
    from accelerate.utils import FullyShardedDataParallelPlugin
    from torch.distributed.fsdp import CPUOffloadPolicy

    fsdp = FullyShardedDataParallelPlugin()  # reads the environment, as in every worker
    fsdp.set_mixed_precision(env["ACCELERATE_MIXED_PRECISION"])  # as AcceleratorState does
    assert fsdp.fsdp_version == 2 and fsdp.activation_checkpointing is True
    assert fsdp.reshard_after_forward is (strategy != "zero2")
    assert isinstance(fsdp.cpu_offload, CPUOffloadPolicy) == (strategy == "offload-all")
    mp = fsdp.mixed_precision_policy
    assert (mp.param_dtype, mp.reduce_dtype) == (torch.bfloat16, torch.bfloat16)
    if strategy == "hsdp":
        from accelerate.parallelism_config import ParallelismConfig

        pc = ParallelismConfig()
        assert (pc.dp_replicate_size, pc.dp_shard_size) == (2, 8)


@pytest.mark.parametrize("strategy,kw,needle", [
    ("zero3", dict(), "reduces gradients in bf16, the plan in fp32"),
    ("zero1", dict(), "no zero1"),
    ("zero3", dict(reduce_dtype="bf16", checkpointing="selective", embed_head_unit="head-kept"), "not selective"),
    ("zero3", dict(reduce_dtype="bf16", blocks_per_unit=2, embed_head_unit="head-kept"), "--blocks-per-unit 1"),
    ("zero3", dict(reduce_dtype="bf16"), "embed_head_unit separate: plan again with --embed-head-unit head-kept"),
    ("hsdp", dict(reduce_dtype="bf16", embed_head_unit="root"), "embed_head_unit root"),
    ("zero3", dict(reduce_dtype="bf16", embed_head_unit="head-kept", last_block_kept=True), "without --last-block-kept"),
])
def test_accelerate_refuses_what_its_config_cannot_say(strategy, kw, needle):
    with pytest.raises(UsageError, match=needle):
        accelerate_config(plan_for(strategy, layout="torch", **kw))


def test_torchrun_line(tmp_path, monkeypatch):
    """The line names the plan by its absolute path: pasted into a job script that runs in
    another folder, a relative one pointed nowhere."""
    import shlex

    monkeypatch.chdir(tmp_path)
    one = torchrun_command(plan_for("zero3", model="tiny", gpus=8), "plan.json")
    assert one == (f"ZPLAN_PLAN={shlex.quote(str(tmp_path / 'plan.json'))} torchrun --standalone --nnodes=1 "
                   "--nproc-per-node=8 -m zplan.trainer")
    multi = torchrun_command(plan_for("zero3", model="tiny", gpus=32), "p.json")
    assert "--nnodes=4" in multi and "--rdzv-backend=c10d" in multi and "--standalone" not in multi


@pytest.mark.slow  # over a second each: the fast loop leaves it to CI
def test_export_cli(run_zplan, tmp_path):
    plan = tmp_path / "plan.json"
    assert run_zplan("recommend", "--model", "llama-3.1-8b", "--gpus", "16", "--global-batch", "64",
                     "--for", "deepspeed", "--write", str(plan)).returncode == 0
    out = tmp_path / "ds.json"
    p = run_zplan("export", "--plan", str(plan), "--to", "deepspeed", "-o", str(out))
    assert p.returncode == 0, p.stderr
    cfg = json.loads(out.read_text())
    assert cfg["train_batch_size"] == 64 and cfg["zero_optimization"]["overlap_comm"] is True
    p = run_zplan("export", "--plan", str(plan), "--to", "nemo")
    assert p.returncode == 2 and "--to 'nemo' is not one of" in p.stderr
    bad = run_zplan("recommend", "--model", "llama-3.1-8b", "--gpus", "16", "--optimizer", "adam8bit",
                    "--for", "deepspeed", "--write", str(tmp_path / "a8.json"))
    assert bad.returncode == 0, bad.stderr
    p = run_zplan("export", "--plan", str(tmp_path / "a8.json"), "--to", "deepspeed")
    assert p.returncode == 2 and len(p.stderr.strip().splitlines()) == 1 and "8-bit Adam" in p.stderr


@pytest.mark.parametrize("strategy", ["zero1", "zero2"])
@pytest.mark.parametrize("allreduce", [True, False])
def test_deepspeed_collectives_are_timed_with_the_exported_buckets(strategy, allreduce):
    """The config's reduce_bucket_size (25 MiB of fp32 gradients) is the cap of the IPG buckets
    the plan's gradient calls are made of, and the config says how they are reduced, as the plan
    prices it (use_multi_rank_bucket_allreduce: an all-reduce per bucket, or a reduce per owner;
    tests/test_deepspeed_reduce.py holds the calls against DeepSpeed's own); the weights'
    all-gather splits the partition into allgather_bucket_size calls, the last the remainder."""
    from zplan import comm

    kw = dict(model="llama-3.1-8b", gpus=16, micro_batch=2, grad_accum=4, checkpointing="full",
              deepspeed_bucket_allreduce=allreduce)
    plan = plan_for(strategy, deepspeed_bucket_allreduce=allreduce)
    zo = deepspeed_config(plan)["zero_optimization"]
    assert (zo["reduce_bucket_size"], zo["allgather_bucket_size"]) == (BUCKET // 4, BUCKET // 2)
    # DeepSpeed's own default (true, from 0.12.4) is left out, so an older DeepSpeed reads the config
    assert zo.get("use_multi_rank_bucket_allreduce", "left out") == ("left out" if allreduce else False)
    from zplan.export import deepspeed_reduce_note
    assert (deepspeed_reduce_note(plan) is None) is allreduce
    sc = scenario(layout="zero", **kw)
    colls = est(strategy, layout="zero", **kw).collectives
    (grads,) = [c for c in colls if "gradients" in c.name]
    assert grads.op == ("all_reduce" if allreduce else "reduce")
    buckets = comm.bucket_calls(sc, "fp32", grads.elements * 4, BUCKET, deepspeed=True)
    assert sum(buckets) == 8_030_261_248 * 4  # the parameters' gradients: DeepSpeed reduces no padding
    # a parameter over the cap is a bucket of its own: Llama 3.1 8B's embedding and head (128256 x
    # 4096; the embedding backward's last) and each MLP matrix
    assert sorted(buckets)[-3:] == [14336 * 4096 * 4, 128256 * 4096 * 4, 128256 * 4096 * 4]
    assert buckets[-1] == 128256 * 4096 * 4 and buckets.count(14336 * 4096 * 4) == 3 * 32
    if allreduce:
        assert grads.call_bytes == max(buckets)
    else:  # the embedding's bucket spans the first owners' partitions (ceil(Psi / 16) elements each)
        part = -(-8_030_261_248 // 16) * 4
        assert grads.call_bytes == part
    (ag,) = [c for c in colls if c.name == "all-gather (updated weights)"]
    padded, bucket = ag.elements, zo["allgather_bucket_size"]
    assert 8_030_261_248 <= padded < 8_030_261_248 + 16 * len(sc.units)  # Llama 3.1 8B, padded
    calls = -(-padded // bucket)
    assert calls == 613
    rest = padded - (calls - 1) * bucket
    g = min(sc.hw.cluster.gpus_per_node, 16)
    by_hand = ((calls - 1) * comm.call_seconds(sc, "all_gather", bucket * 2, 16, g)
               + comm.call_seconds(sc, "all_gather", rest * 2, 16, g))
    assert ag.seconds_per_call == pytest.approx(by_hand, rel=1e-9)


@pytest.mark.parametrize("layout", ["torch", "zero"])
def test_deepspeed_export_of_a_plan_for_zplans_trainer_says_so(tmp_path, capsys, layout):
    """A plan priced for zplan's FSDP2 trainer (torch layout) exported to DeepSpeed: the export
    says its memory was not DeepSpeed's and how to get DeepSpeed's, and says which blocks the
    script must checkpoint as for a DeepSpeed plan (the QA pass found both silent); the other
    targets and a DeepSpeed plan get no layout note."""
    from zplan.plan import save
    from tests.helpers import cli

    path = tmp_path / "plan.json"
    save(plan_for("zero3", layout=layout, checkpointing="first-k", checkpoint_first=3), path)
    r = cli(capsys, "export", "--plan", str(path), "--to", "deepspeed")
    assert r.returncode == 0 and "the first 3 blocks (first-3)" in r.stderr
    assert ("recommend --for deepspeed" in r.stderr) == (layout == "torch")
    r = cli(capsys, "export", "--plan", str(path), "--to", "torchrun")
    if layout == "torch":
        assert r.returncode == 0 and r.stderr == ""
    else:  # zplan's trainer does not run a DeepSpeed plan: torchrun's command for it is refused
        assert r.returncode == 1 and "zplan's trainer cannot run" in r.stderr


def test_a_plan_edited_past_its_gpu_is_said_not_to_fit_where_it_is_used(tmp_path, capsys):
    """recommend writes plans that fit; one edited by hand to a 20 GB GPU: estimate --plan exits
    1, and export and launch, which run it, now say so (the QA pass found them silent)."""
    from zplan.plan import save
    from tests.helpers import cli

    path = tmp_path / "plan.json"
    save(plan_for("zero3", layout="torch"), path)
    data = json.loads(path.read_text())
    data["gpu"]["memory_bytes"] = 20 * 10**9
    path.write_text(json.dumps(data))
    assert cli(capsys, "estimate", "--plan", str(path)).returncode == 1
    r = cli(capsys, "export", "--plan", str(path), "--to", "torchrun")
    assert r.returncode == 0 and "does not fit a h100-sxm" in r.stderr and "of 20.0 GB" in r.stderr
    r = cli(capsys, "launch", "--plan", str(path), "--dry-run", "--no-save", "--run-dir", str(tmp_path / "r"),
            "--nnodes", "2", "--node-rank", "0", "--rdzv-endpoint", "h:1")
    assert r.returncode == 0 and "does not fit a h100-sxm" in r.stderr


@pytest.mark.parametrize("view", [True, False])
def test_accelerate_export_says_when_its_ddp_holds_the_gradients_apart(tmp_path, capsys, view):
    """accelerate's DDP wraps the model with its DistributedDataParallelKwargs' default (read
    from accelerate itself): where that differs from what the plan priced (zplan's trainer keeps
    the gradients as bucket views), the export says how to match it."""
    from accelerate.utils import DistributedDataParallelKwargs

    from zplan.plan import save
    from tests.helpers import cli

    path = tmp_path / "plan.json"
    save(plan_for("ddp", layout="torch", reduce_dtype="fp32", ddp_bucket_view=view), path)
    r = cli(capsys, "export", "--plan", str(path), "--to", "accelerate")
    assert r.returncode == 0, r.stderr
    differs = DistributedDataParallelKwargs().gradient_as_bucket_view != view
    assert ("gradient_as_bucket_view=True" in r.stderr) == differs, r.stderr


@pytest.mark.parametrize("args,needle", [
    (("estimate", "--no-ddp-bucket-view"), "drop it, or add --layout torch"),
    (("estimate", "--no-ddp-bucket-view", "--layout", "torch", "--strategy", "zero3"), "runs no DDP"),
])
def test_no_ddp_bucket_view_where_no_ddp_runs_is_one_line(capsys, args, needle):
    from tests.helpers import cli

    r = cli(capsys, *args, "--model", "llama-3.2-1b", "--gpus", "8")
    assert r.returncode == 2 and needle in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr


def test_torchrun_export_of_a_plan_the_trainer_refuses_is_refused(capsys, tmp_path):
    """export --to torchrun printed a command for zplan's trainer (exit 0) for plans it refuses
    (a DeepSpeed plan, fp16 parameters): now launch's refusal, exit 1; --zeropp, DeepSpeed's,
    is refused beside another target (it was ignored). A plan it runs still exports."""
    from tests.helpers import cli

    base = ("--model", "llama-3.1-8b", "--gpus", "8")
    for extra, ok in ((("--for", "deepspeed"), False), (("--param-dtype", "fp16"), False), ((), True)):
        plan = tmp_path / f"p{len(extra)}{ok}.json"
        r = cli(capsys, "recommend", *base, *extra, "--write", str(plan))
        assert r.returncode == 0, r.stderr
        r = cli(capsys, "export", "--plan", str(plan), "--to", "torchrun")
        if ok:
            assert r.returncode == 0 and "-m zplan.trainer" in r.stdout, r.stderr
            continue
        assert r.returncode == 1 and "zplan's trainer cannot run" in r.stderr and r.stdout == "", r.stderr
        assert len(r.stderr.strip().splitlines()) == 1
    r = cli(capsys, "export", "--plan", str(plan), "--to", "accelerate", "--zeropp")
    assert r.returncode == 2 and "--zeropp" in r.stderr and r.stdout == ""


@pytest.mark.parametrize("kw,fix,not_fix", [
    (dict(param_dtype="fp8", reduce_dtype="bf16"), "--param-dtype bf16", "--master-dtype"),
    (dict(master_dtype="bf16"), "--master-dtype fp32", "--param-dtype"),
    (dict(optimizer_dtype="bf16"), "--optimizer-dtype fp32", "--master-dtype"),
])
def test_accelerate_refusal_names_the_dtype_that_is_wrong(kw, fix, not_fix):
    """An fp8 (or tf32, int4) parameter dtype was told to plan again with --master-dtype fp32
    --optimizer-dtype fp32, which it already had: the fix now names the slot that is wrong."""
    with pytest.raises(UsageError) as e:
        accelerate_config(plan_for("zero3", layout="torch", **kw))
    assert fix in str(e.value) and not_fix not in str(e.value).split("plan again with")[1], str(e.value)


@pytest.mark.parametrize("optimizer", ["adam8bit", "sgd", "muon"])
def test_the_trainers_refusal_offers_deepspeed_only_where_its_export_works(optimizer):
    """For 8-bit Adam the trainer's refusal said "or --for deepspeed and export", which the
    DeepSpeed export then refused: the way it names must work."""
    from zplan.plan import trainer_refusal

    why = trainer_refusal(plan_for("zero3", layout="torch", optimizer=optimizer))
    offered = "--for deepspeed and export" in why
    try:
        deepspeed_config(plan_for("zero3", layout="zero", optimizer=optimizer))
        exports = True
    except UsageError:
        exports = False
    assert offered == exports, (why, exports)


@pytest.mark.slow  # importing accelerate takes seconds
@pytest.mark.parametrize("strategy", ["zero3", "ddp"])
def test_accelerate_launch_reads_an_fp32_plan_on_two_machines(tmp_path, monkeypatch, strategy):
    """An fp32 plan's `mixed_precision: no` was YAML's boolean false, and accelerate launch died
    (AttributeError: 'bool' object has no attribute 'lower', utils/launch.py); a plan on two
    machines named no head node, so the rendezvous went to host None. accelerate's own launch
    path now reads "no" and the head node's placeholder, which the export's note says to give."""
    plan = plan_for(strategy, layout="torch", param_dtype="fp32", reduce_dtype="fp32", embed_head_unit="head-kept")
    cfg, env = _accelerate_env(tmp_path, monkeypatch, plan)
    assert cfg.mixed_precision == "no" and env["ACCELERATE_MIXED_PRECISION"] == "no"
    assert cfg.num_machines == 2 and cfg.main_process_ip == "HEAD_NODE" and cfg.main_process_port == 29500
    from zplan.export import accelerate_nodes_note

    assert "--machine_rank I --main_process_ip HEAD" in accelerate_nodes_note(plan)


_DS_INIT = r"""
import json, os, sys
os.environ.update(DS_ACCELERATOR="cpu", MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[1], RANK="0",
                  WORLD_SIZE="1", LOCAL_RANK="0")
import torch, deepspeed
# DeepSpeed's CPU accelerator JIT-builds a shared-memory all-reduce kernel here (its inference
# path; nothing initialize checks): half a minute of C++ on a fresh machine, left out
sys.modules["deepspeed.comm.torch"].build_shm_op = lambda: None
deepspeed.init_distributed(dist_backend="gloo")
for path in sys.argv[2:]:
    cfg = json.load(open(path))
    cfg["train_batch_size"] = cfg["train_micro_batch_size_per_gpu"] * cfg["gradient_accumulation_steps"]
    if "offload_optimizer" not in cfg["zero_optimization"] and cfg["optimizer"]["type"] == "AdamW":
        cfg["optimizer"]["params"]["torch_adam"] = True  # FusedAdam is CUDA's; the checks are the same
    # Muon's 1-D parameters go to an auxiliary FusedAdam, whose C++ extension DeepSpeed builds
    # first (two minutes on a fresh machine); the config checks do not depend on them
    bias = cfg["optimizer"]["type"] != "Muon"
    model = torch.nn.Sequential(torch.nn.Linear(64, 64, bias=bias), torch.nn.Linear(64, 8, bias=bias))
    try:
        deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
        print(path, "OK", flush=True)
    except Exception as e:
        print(path, "FAILED", type(e).__name__, " ".join(str(e).split())[:200], flush=True)
"""


@pytest.mark.slow  # deepspeed.initialize on the CPU accelerator, in its own process
@pytest.mark.timeout(300)
def test_deepspeed_initialize_takes_what_the_export_writes(tmp_path):
    """DeepSpeed's own engine (deepspeed.initialize on its CPU accelerator, one gloo rank) is the
    oracle a config parser is not: bf16 master weights with fp32 optimizer state under ZeRO 1-3
    without offload, and Muon under ZeRO-3 with its reduce-scatter on, parsed but failed there
    ("Master weights feature requires ZeRO-Offload with DeepSpeedCPUAdam", "Muon and reduce
    scatter cannot be used together"). Every config the export writes now initializes, and the
    first is refused by the export in one line."""
    import subprocess
    import sys

    pytest.importorskip("deepspeed")
    from zplan.netutil import free_port

    with pytest.raises(UsageError, match="offloaded to its CPU Adam"):
        deepspeed_config(plan_for("zero2", master_dtype="bf16"))
    with pytest.raises(UsageError, match="offloaded to its CPU Adam"):
        deepspeed_config(plan_for("zero3", param_dtype="fp16", master_dtype="fp16", reduce_dtype="fp16"))
    # (offload-opt with bf16 master weights initializes too, but builds DeepSpeedCPUAdam's C++
    # extension first: a minute on this machine, left out)
    plans = {"zero3-bf16-states": plan_for("zero3", master_dtype="bf16", optimizer_dtype="bf16"),
             "zero3-muon": plan_for("zero3", optimizer="muon"),
             "zero2-muon": plan_for("zero2", optimizer="muon"),
             "zero1-fp32": plan_for("zero1", param_dtype="fp32")}
    paths = []
    for name, plan in plans.items():
        cfg = deepspeed_config(plan)
        if name == "zero3-muon":
            assert cfg["zero_optimization"]["reduce_scatter"] is False
        paths.append(tmp_path / f"{name}.json")
        paths[-1].write_text(json.dumps(cfg))
    p = subprocess.run([sys.executable, "-c", _DS_INIT, str(free_port()), *map(str, paths)],
                       capture_output=True, text=True, timeout=280)
    results = [line for line in p.stdout.splitlines() if line.startswith(str(tmp_path))]
    assert len(results) == len(paths), p.stdout + p.stderr[-2000:]
    assert all(line.split()[1] == "OK" for line in results), "\n".join(results)


def test_muon_under_deepspeeds_zero3_is_priced_as_the_all_reduce_it_runs():
    """With reduce_scatter off (Muon), DeepSpeed's ZeRO-3 all-reduces each gradient bucket
    (stage3.py __avg_scatter_contiguous_grads): the plan's gradient collective is that
    all-reduce, twice the reduce-scatter's bytes over the same elements, and slower; AdamW's
    and the torch layout's stay reduce-scatters."""
    from zplan.comm import collectives
    from zplan.strategies import STRATEGIES

    def grads(**kw):
        sc = scenario(model="llama-3.1-8b", gpus=16, **kw)
        (c,) = [c for c in collectives(sc, STRATEGIES["zero3"]) if "gradients" in c.name]
        return c

    muon, adamw = grads(layout="zero", optimizer="muon"), grads(layout="zero")
    assert (muon.op, adamw.op) == ("all_reduce", "reduce_scatter")
    assert muon.elements == adamw.elements and muon.volume_factor == 2 * adamw.volume_factor
    assert muon.seconds_per_step > 1.5 * adamw.seconds_per_step
    assert grads(layout="torch", optimizer="muon").op == "reduce_scatter"


def test_zeropp_is_said_and_refused_where_its_groups_do_not_divide(tmp_path, capsys):
    """--zeropp's hpZ group is a node's GPUs, and DeepSpeed's zero.Init asserts the world divides
    into it (utils/groups.py _ensure_divisibility: "12 is not divisible by 8"): 12 GPUs on nodes
    of 8 are refused in one line; where it is written, a note says the plan's figures do not
    count ZeRO++."""
    from zplan.plan import save
    from tests.helpers import cli

    with pytest.raises(UsageError, match="12 GPUs do not"):
        deepspeed_config(plan_for("zero3", gpus=12), zeropp=True)
    path = tmp_path / "p.json"
    save(plan_for("zero3"), path)
    r = cli(capsys, "export", "--plan", str(path), "--to", "deepspeed", "--zeropp")
    assert r.returncode == 0 and json.loads(r.stdout)["zero_optimization"]["zero_hpz_partition_size"] == 8
    assert "which the plan's memory and traffic figures do not count" in r.stderr


@pytest.mark.parametrize("to", ["deepspeed", "accelerate"])
@pytest.mark.parametrize("kw,said", [
    (dict(compile=True), "torch.compile"),
    (dict(linear_loss="chunked"), "the chunked linear loss"),
    (dict(fused_loss=True), "a fused cross-entropy kernel"),
    (dict(loss_chunks=8), "over 8 sequence chunks"),
    (dict(), None),
])
def test_exports_say_what_the_script_must_do_that_the_config_cannot(tmp_path, capsys, to, kw, said):
    """A plan priced with torch.compile, a chunked or fused loss (25.9 and 11.2 GB against 67.9
    without, Llama 3.2 1B on 8 GPUs) exported without a word: the config carries none of them,
    and a run from it alone would not fit the plan. One stderr line names each."""
    from zplan.plan import save
    from tests.helpers import cli

    path = tmp_path / "plan.json"
    base = dict(layout="torch", reduce_dtype="bf16", embed_head_unit="head-kept", checkpointing="none")
    save(plan_for("zero3", **base, **kw), path)
    r = cli(capsys, "export", "--plan", str(path), "--to", to)
    assert r.returncode == 0, r.stderr
    code_lines = [ln for ln in r.stderr.splitlines() if "which the " + to + " config does not carry" in ln]
    if said is None:
        assert code_lines == []
    else:
        assert len(code_lines) == 1 and said in code_lines[0], r.stderr


def test_accelerate_ddp_export_says_the_script_checkpoints(tmp_path, capsys):
    """accelerate's DDP (MULTI_GPU) has no checkpointing key: a DDP plan priced with full
    checkpointing (55.5 GB, 82.1 without, the QA pass) is exported with a note saying so."""
    from zplan.plan import save
    from tests.helpers import cli

    path = tmp_path / "plan.json"
    save(plan_for("ddp", layout="torch", reduce_dtype="fp32", checkpointing="full"), path)
    r = cli(capsys, "export", "--plan", str(path), "--to", "accelerate")
    assert r.returncode == 0 and "activation checkpointing (full)" in r.stderr, r.stderr
    # the YAML holds no batch: the plan's micro-batch and accumulation are named for the script
    t = json.loads(path.read_text())["train"]
    assert f"micro-batch {t['micro_batch']} and accumulation {t['grad_accum']}" in r.stderr
    assert "batch" not in r.stdout.lower()
