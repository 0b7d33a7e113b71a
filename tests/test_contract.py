"""The plan is the contract between planning and running: what runs it, validation on load,
what zplan's trainer refuses, and the modelling decisions both sides take from zplan/policy.py."""

import json

import pytest

from zplan.errors import UsageError
from zplan.plan import Plan, load, make_plan, node_problem, save, trainer_refusal
from tests.helpers import est, scenario

CPU = dict(model="tiny", gpu="cpu", cluster="cpu-local", seq_len=64)


def plan_for(strategy, layout="torch", **kw):
    kw = {**CPU, "gpus": 2, **kw}
    sc = scenario(layout=layout, **kw)
    batch = sc.n * sc.train.micro_batch * sc.train.grad_accum
    return make_plan(sc, strategy, batch, est(strategy, layout=layout, **kw))


def written(tmp_path, plan, **changes):
    """The plan's JSON with some fields changed, as a file (what a hand-edited plan looks like)."""
    data = json.loads(plan.model_dump_json())
    for dotted, value in changes.items():
        *path, last = dotted.split("__")
        d = data
        for k in path:
            d = d[k]
        if value is None and last in d and last != "shard_size":
            del d[last]
        else:
            d[last] = value
    f = tmp_path / "plan.json"
    f.write_text(json.dumps(data))
    return f


# ----------------------------------------------------------------- validation on load

def test_a_consistent_plan_loads(tmp_path):
    p = plan_for("zero3", micro_batch=2, grad_accum=3)
    assert p.runner == "zplan" and p.train.layout == "torch" and p.global_batch == 12
    assert load(written(tmp_path, p)) == p


@pytest.mark.parametrize("changes,needle", [
    # a 2-rank mesh for a 3-rank plan (issue 9: a 3-rank launch of a 2-rank mesh ran)
    (dict(num_gpus=3, global_batch=3), "mesh [2] ['shard'] does not match zero3 on 3 ranks ([3]"),
    # global batch 7 on 2 ranks: ranks would read overlapping samples
    (dict(global_batch=7), "global_batch 7 is not micro_batch 1 x grad_accum 1 x 2 data-parallel ranks = 2"),
    (dict(shard_size=2), "shard_size 2 is for hsdp"),
    (dict(train__layout="zero"), "runner 'zplan' keeps the torch memory layout but train.layout is 'zero'"),
    (dict(train__reshard_after_forward=False), "reshard_after_forward False contradicts strategy zero3"),
    # the model has 4 blocks: checkpointing the first 5 names a block it does not have
    (dict(train__checkpointing="first-k", train__checkpoint_first=5), "checkpoint_first 5 exceeds the model's 4 layers"),
    # only what is out of range is named (a walkthrough: checkpoint_every 2 was named beside it)
    (dict(train__blocks_per_unit=9), "blocks_per_unit 9 exceeds the model's 4 layers"),
    (dict(train__checkpointing="every-k", train__checkpoint_every=6, train__blocks_per_unit=5),
     "blocks_per_unit 5 and checkpoint_every 6 exceed the model's 4 layers"),
])
def test_contradictions_are_refused_on_load(tmp_path, changes, needle):
    with pytest.raises(UsageError) as e:
        load(written(tmp_path, plan_for("zero3"), **changes))
    msg = str(e.value)
    assert needle in msg and "\n" not in msg and "zplan recommend" in msg


def test_hsdp_mesh_must_match_the_shard_size(tmp_path):
    p = plan_for("hsdp", gpus=4, shard_size=2)
    assert p.mesh.shape == [2, 2] and load(written(tmp_path, p)) == p
    with pytest.raises(UsageError, match="needs a shard_size that divides num_gpus 4, not 3"):
        load(written(tmp_path, p, shard_size=3))
    with pytest.raises(UsageError, match=r"mesh \[2, 2\].*\(\[4, 1\]"):
        load(written(tmp_path, p, shard_size=1))


def test_a_plan_without_runner_is_for_what_its_layout_says(tmp_path):
    zero = load(written(tmp_path, plan_for("zero3", layout="zero"), runner=None))
    torch_ = load(written(tmp_path, plan_for("zero3"), runner=None))
    assert (zero.runner, torch_.runner) == ("deepspeed", "zplan")


def test_node_problem_for_the_launcher():
    gpu = plan_for("zero3", gpus=16, gpu="h100-sxm", cluster="dgx-h100", model="llama-3.2-1b")
    assert node_problem(gpu, 8, 8) is None
    assert "--nnodes 2" in node_problem(gpu, 16, 8)  # 16 processes on an 8-GPU node (issue 9)
    assert "has none" in node_problem(gpu, 8, 0)
    assert node_problem(plan_for("zero3"), 2, 0) is None
    assert "CPU ranks but this node has 8 GPUs" in node_problem(plan_for("zero3"), 2, 8)


# ----------------------------------------------------------------- what the trainer runs

@pytest.mark.parametrize("kw,needle", [
    (dict(layout="zero"), "run it with zplan export --to deepspeed"),
    (dict(optimizer="adam8bit"), "the trainer runs AdamW; the plan asks for adam8bit"),
    (dict(param_dtype="fp16"), "param dtype fp16"),
    (dict(master_dtype="bf16", optimizer_dtype="fp32"), "optimizer dtype fp32 differs from master dtype bf16"),
    (dict(flash=False), "--flash"),
    (dict(gpu="h100-sxm", cluster="dgx-h100", float8=True), "without --float8"),
    (dict(gpu="h100-sxm", cluster="dgx-h100", compile=True), "without --compile"),
    (dict(loss_fp32=False), "without --no-loss-fp32"),
    (dict(fused_loss=True), "without --fused-loss"),
    (dict(norm_output_fp32=False), "without --no-norm-output-fp32"),
    (dict(checkpointing="full", checkpoint_early_stop=False), "without --no-checkpoint-early-stop"),
    (dict(checkpointing="full", layout="torch", checkpoint_wraps_unit=True), "without --checkpoint-wraps-unit"),
    (dict(params="1e7", model=None), "bare parameter count"),
    (dict(qkv_fused=True), "with --no-qkv-fused"),
    (dict(attention_heads_first=True), "without --attention-heads-first"),
])
def test_trainer_refuses_what_it_cannot_apply(kw, needle):
    why = trainer_refusal(plan_for("zero3", **kw))
    assert why is not None and needle in why


def test_fp32_grouped_query_attention_is_refused_on_gpus_only():
    """torch's SDPA runs GQA in the flash and math kernels alone on CUDA, flash in fp16/bf16
    alone: fp32 GQA would run math (s x s scores kept), not the flash the plan prices. On CPU
    ranks the CPU's flash kernel takes fp32 with GQA; an MHA model runs the efficient kernel."""
    gqa = dict(model="llama-3.1-8b", param_dtype="fp32")
    why = trainer_refusal(plan_for("zero3", gpu="h100-sxm", cluster="dgx-h100", **gqa))
    assert why is not None and "grouped KV heads (8 of 32)" in why and "--param-dtype bf16" in why
    assert trainer_refusal(plan_for("zero3", gpu="cpu", cluster="cpu-local", **gqa)) is None
    assert trainer_refusal(plan_for("zero3", gpu="h100-sxm", cluster="dgx-h100", **dict(gqa, param_dtype="bf16"))) is None
    assert trainer_refusal(plan_for("zero3", gpu="h100-sxm", cluster="dgx-h100", model="llama-2-7b",
                                    param_dtype="fp32")) is None


def test_a_plan_written_before_compile_loss_keeps_its_meaning():
    """Plan files from before compile_loss existed priced the loss as compiled under compile."""
    from zplan.specs import TrainSpec

    assert TrainSpec.model_validate({"compile": True}).compile_loss is True
    assert TrainSpec.model_validate({}).compile_loss is False
    assert TrainSpec.model_validate({"compile": True, "compile_loss": False}).compile_loss is False


def test_trainer_accepts_the_dtypes_it_applies():
    assert trainer_refusal(plan_for("zero3", master_dtype="bf16", optimizer_dtype="bf16",
                                    reduce_dtype="bf16")) is None
    assert "reduces gradients in the weights' dtype" in trainer_refusal(plan_for("ddp", reduce_dtype="bf16"))
    assert trainer_refusal(plan_for("ddp", param_dtype="bf16")) is None
    # a user's script computes its own loss: planning it in bf16 is the user's to say
    assert trainer_refusal(plan_for("zero3", loss_fp32=False), builtin_model=False) is None
    # the built-in model knows its last block; a script's units do not say which holds it
    kept = plan_for("zero3", last_block_kept=True)
    assert trainer_refusal(kept) is None
    assert "--last-block-kept" in trainer_refusal(kept, builtin_model=False)
    assert trainer_refusal(plan_for("zero3-noreshard", last_block_kept=True), builtin_model=False) is None


def _recommend(run_zplan, tmp_path, *args, name="plan.json"):
    plan = tmp_path / name
    p = run_zplan("recommend", "--model", "tiny", "--gpu", "cpu", "--cluster", "cpu-local",
                  "--gpus", "2", "--seq-len", "64", "--write", str(plan), *args)
    assert p.returncode == 0, p.stderr
    return plan, json.loads(plan.read_text())


def test_recommend_plans_for_launch_unless_asked(run_zplan, tmp_path):
    _, default = _recommend(run_zplan, tmp_path)
    assert default["runner"] == "zplan" and default["train"]["layout"] == "torch"
    # a CPU rank carries no CUDA context and no allocator fragmentation (issue 9)
    assert default["assumptions"]["cuda_context_bytes"] == 0 and default["assumptions"]["fragmentation"] == 0
    assert default["predicted"]["per_gpu"]["overhead_bytes"] == 0
    _, ds = _recommend(run_zplan, tmp_path, "--for", "deepspeed", name="ds.json")
    assert ds["runner"] == "deepspeed" and ds["train"]["layout"] == "zero"
    p = run_zplan("recommend", "--model", "tiny", "--for", "zplan", "--layout", "zero")
    assert p.returncode == 2 and "drop --layout" in p.stderr and len(p.stderr.strip().splitlines()) == 1
    # offload-opt cannot run under zplan's trainer: said as such, not as "nothing fits"
    p = run_zplan("recommend", "--model", "tiny", "--gpu", "cpu", "--cluster", "cpu-local",
                  "--strategy", "offload-opt")
    assert p.returncode == 2 and "--for deepspeed" in p.stderr.splitlines()[-1]


@pytest.mark.parametrize("strategy,kw,needle", [
    ("offload-opt", dict(layout="zero"), "this plan is for deepspeed"),
    ("zero3", dict(optimizer="adam8bit"), "the plan asks for adam8bit"),
])
@pytest.mark.slow  # over a second each: the fast loop leaves it to CI
def test_launch_refuses_in_one_line(run_zplan, tmp_path, strategy, kw, needle):
    """Issue 9: an offload-opt plan printed 81 lines with 3 tracebacks; a zero-layout plan ran."""
    plan = tmp_path / "plan.json"
    save(plan_for(strategy, **kw), plan)
    p = run_zplan("launch", "--plan", str(plan), "--run-dir", str(tmp_path / "run"))
    assert p.returncode == 1, p.stderr
    assert len(p.stderr.strip().splitlines()) == 1 and "Traceback" not in p.stderr
    assert needle in p.stderr and not (tmp_path / "run").exists()


def test_round_trip_keeps_every_field(tmp_path):
    p = plan_for("hsdp", gpus=4, shard_size=2, checkpointing="first-k", checkpoint_first=3,
                 checkpoint_every=3, master_dtype="bf16", optimizer_dtype="bf16", micro_batch=2)
    save(p, tmp_path / "a.json")
    again = load(tmp_path / "a.json")
    assert again == p and isinstance(again, Plan)
    data = json.loads((tmp_path / "a.json").read_text())
    # against values typed here, not recomputed by the code under test
    assert data["mesh"] == {"shape": [2, 2], "dim_names": ["replicate", "shard"]}
    assert data["global_batch"] == 8 and data["train"]["checkpoint_every"] == 3
    assert data["train"]["checkpointing"] == "first-k" and data["train"]["checkpoint_first"] == 3
    assert data["train"]["precision"] == {"param": "bf16", "reduce": "fp32", "master": "bf16", "optimizer": "bf16"}


INIT_PROBE = '''
import sys, torch, torch.distributed as dist
from zplan.plan import load
from zplan.trainer.model import Transformer, canonical_name, init_weights_
from zplan.trainer.parallel import device_for, parallelize

dist.init_process_group("gloo")
out = {}
for path in sys.argv[2:]:
    plan = load(path)
    with torch.device("meta"):
        model = Transformer(plan.model)
    par = parallelize(model, plan, device_for("gloo"))
    init_weights_(par.inner, 0)
    full = {canonical_name(k): (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone()
            for k, v in par.inner.state_dict().items()}
    out[path] = full
if dist.get_rank() == 0:
    torch.save(out, sys.argv[1])
dist.barrier()
dist.destroy_process_group()
from zplan.trainer.rank_errors import leave
leave(0)  # at once, as api.close(leave=True): gloo cannot abort the rank in interpreter teardown
'''


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_initial_weights_are_the_same_for_every_strategy_and_world_size(tmp_path):
    """Step-0 weights of 2-rank FSDP2 / DDP / ZeRO-1 runs, gathered, against one process."""
    import subprocess
    import sys

    import torch

    from zplan.presets import model as preset
    from zplan.trainer.model import Transformer, init_weights_

    cases = [("zero3", dict(checkpointing="full")), ("zero2", dict(checkpointing="every-k", blocks_per_unit=2)),
             ("offload-all", dict(checkpointing="selective")), ("ddp", dict()), ("zero1", dict()),
             ("zero3-noreshard", dict(master_dtype="bf16", optimizer_dtype="bf16"))]
    paths = []
    for i, (strategy, kw) in enumerate(cases):
        paths.append(str(tmp_path / f"{i}-{strategy}.json"))
        save(plan_for(strategy, **kw), paths[-1])
    script = tmp_path / "probe.py"
    script.write_text(INIT_PROBE)
    out = tmp_path / "init.pt"
    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                        str(script), str(out), *paths], capture_output=True, text=True, timeout=220)
    assert p.returncode == 0, p.stderr[-3000:]
    got = torch.load(out)
    with torch.device("meta"):
        ref_model = Transformer(preset("tiny"))
    ref_model.to_empty(device="cpu")
    init_weights_(ref_model, 0)
    ref = ref_model.state_dict()
    assert got[paths[-1]]["tok_embeddings.weight"].dtype == torch.bfloat16  # the plan's master dtype
    assert got[paths[0]]["tok_embeddings.weight"].dtype == torch.float32
    for path in paths:
        w = got[path]
        assert w.keys() == ref.keys(), path
        for k in ref:
            assert torch.equal(w[k], ref[k].to(w[k].dtype)), (path, k)


# ----------------------------------------------------------------- recommend, then launch

@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("strategy,ranks", [("ddp", 2), ("zero1", 2), ("zero2", 2), ("zero3", 2),
                                            ("zero3-noreshard", 2), ("offload-all", 2), ("hsdp", 4)])
def test_recommend_then_launch_keeps_the_plans_promises(run_zplan, tmp_path, strategy, ranks):
    """The plan recommend writes, run by launch on CPU ranks: peak memory from 1% below the
    prediction to 10% above it, traffic exact in elements and in bytes (issue 9: -95% with a
    zero-layout plan). Every strategy measures within 0.003% on an idle machine (21 runs); a late
    release only adds, so below is tight. Above: gloo's worker thread can hold a buffer of FSDP2's
    own (a unit's all-gather input or output) a few ops past FSDP2's release, which the tracker
    counts until then (+4.1% once under CI's load). Gloo's clone of a reduce-scatter input, which
    it released late one run in four (+10.2%, a CI failure), is timed as the plan times it
    (tests/test_tracker_backend_buffers.py)."""
    plan, data = _recommend(run_zplan, tmp_path, "--strategy", strategy, "--gpus", str(ranks),
                            "--global-batch", str(2 * ranks))
    assert data["runner"] == "zplan" and data["strategy"] == strategy
    p = run_zplan("launch", "--plan", str(plan), "--run-dir", str(tmp_path / "run"), "--steps", "5",
                  timeout=280)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    rep = json.loads((tmp_path / "run" / "run_report.json").read_text())
    m, pred = rep["measured"], rep["predicted"]
    assert m["elements_per_step"] == pred["elements_per_step"]
    assert m["bytes_per_step"] == pred["bytes_per_step"]
    assert -0.01 <= m["peak_memory_bytes"] / pred["peak_memory_bytes"] - 1 <= 0.10, (m["peak_memory_bytes"],
                                                                                  pred["peak_memory_bytes"])


def test_a_ranks_rows_are_the_full_initial_values_rows():
    """init_rows draws block by block from per-block seeds: any row range, however it falls
    across blocks, equals those rows of the whole tensor, so a shard drawn alone is the full
    initialisation's shard at every world size."""
    torch = pytest.importorskip("torch")
    from zplan.trainer.model import INIT_BLOCK_ROWS, full_init, init_rows

    shape = torch.Size((3 * INIT_BLOCK_ROWS + 17, 5))
    full = full_init("layers.0.attention.wq.weight", shape, 7, 4)
    for a, b in ((0, shape[0]), (1, 2), (INIT_BLOCK_ROWS - 3, 2 * INIT_BLOCK_ROWS + 4), (shape[0] - 1, shape[0])):
        assert torch.equal(init_rows("layers.0.attention.wq.weight", shape, 7, 4, a, b), full[a:b])
    assert full.std().item() == pytest.approx(0.02, rel=0.05)  # INIT_STD, blocks alike
    assert not torch.equal(full[:INIT_BLOCK_ROWS], full[INIT_BLOCK_ROWS:2 * INIT_BLOCK_ROWS])
