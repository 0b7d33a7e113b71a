"""A user's own model under zplan.trainer.api: stored in the plan's master dtype, as the built-in
trainer's is (zplan/trainer/parallel.py to_master_dtype). One rank, a real gloo group."""

import os
import sys

import pytest

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.slow  # a real process group: ~5 s a case on 2 cores

from zplan.netutil import free_port  # noqa: E402
from zplan.plan import make_plan, save  # noqa: E402
from tests.helpers import est, scenario  # noqa: E402


class UserModel(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(16, 32)
        self.b = torch.nn.Linear(32, 4)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


@pytest.mark.parametrize("strategy", ["zero3", "ddp"])
def test_user_model_is_stored_in_the_plans_master_dtype(tmp_path, monkeypatch, strategy):
    """The user builds the model in bf16; the plan keeps fp32 master weights (its default), so
    after ctx.apply every parameter the optimizer updates is fp32, and a step runs."""
    import torch.distributed as dist

    from zplan.trainer import api

    kw = dict(model="llama-3.2-1b", gpus=1, micro_batch=1, grad_accum=1, layout="torch",
              gpu="cpu", cluster="cpu-local")
    plan = make_plan(scenario(**kw), strategy, 1, est(strategy, **kw))
    assert plan.train.precision.master == "fp32"
    save(plan, tmp_path / "plan.json")
    monkeypatch.setenv("ZPLAN_PLAN", str(tmp_path / "plan.json"))
    for k, v in (("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", str(free_port())), ("RANK", "0"),
                 ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0")):
        monkeypatch.setenv(k, v)
    monkeypatch.setattr(sys, "excepthook", sys.excepthook)  # api.init installs zplan's: put back after
    ctx = api.init(ckpt_dir=str(tmp_path))
    try:
        with torch.device("meta"):
            model = UserModel().to(torch.bfloat16)
        # the API's order, refused in one line where it is not kept (it was an AssertionError, DCP's
        # "Cannot copy out of meta tensor", or a second wrap failing in backward: the QA pass)
        from zplan.errors import UsageError

        for call in (lambda: ctx.optimizer(model), lambda: ctx.save(model, None, 1),
                     lambda: ctx.resume(model, None), lambda: ctx.accumulate(model, True)):
            with pytest.raises(UsageError, match=r"call ctx.apply\(model\) first"):
                call()
        model = ctx.apply(model, units=[model.a, model.b])
        with pytest.raises(UsageError, match="ctx.apply was called already"):
            ctx.apply(model)
        dtypes = {p.dtype for p in model.parameters()}
        assert dtypes == {torch.float32}
        opt = ctx.optimizer(model)
        with ctx.accumulate(model, last=True):
            loss = model(torch.randn(8, 16)).float().pow(2).mean()
        loss.backward()
        opt.step()
        assert {p.dtype for p in model.parameters()} == {torch.float32}
    finally:
        if dist.is_initialized():
            dist.barrier()
            dist.destroy_process_group()


def _applied(rank: int, port: int, plan_path: str, out: str):
    """One of two ranks: the group, and UserModel built on meta and applied, each rank seeded
    apart (as scripts often seed for their data)."""
    from zplan.trainer import api

    os.environ.update(ZPLAN_PLAN=plan_path, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                      RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank))
    ctx = api.init(ckpt_dir=out)
    torch.manual_seed(100 + rank)
    with torch.device("meta"):
        model = UserModel()
    return ctx, ctx.apply(model, units=[model.a, model.b])


def _ddp_rank(rank: int, port: int, plan_path: str, out: str) -> None:
    import torch.distributed as dist

    ctx, model = _applied(rank, port, plan_path, out)
    try:
        flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
        both = [torch.empty_like(flat) for _ in range(2)]
        dist.all_gather(both, flat)
        if rank == 0:
            torch.save({"equal": bool(torch.equal(both[0], both[1])),
                        "nonzero": bool(flat.abs().sum() > 0)}, os.path.join(out, "result.pt"))
    finally:
        ctx.close(leave=True)  # as a script's last line: gloo cannot hang the rank in teardown


@pytest.mark.timeout(180)
def test_ddp_replicas_start_equal_whatever_each_ranks_rng(tmp_path):
    """Under ddp the model is initialised before DDP wraps it: DDP's broadcast of rank 0's
    weights then makes the replicas equal. Initialised after (as before), two ranks seeded
    apart would train different replicas, which DDP never reconciles. Two real gloo ranks."""
    import torch.multiprocessing as mp

    kw = dict(model="llama-3.2-1b", gpus=2, micro_batch=1, grad_accum=1, layout="torch",
              gpu="cpu", cluster="cpu-local")
    plan = make_plan(scenario(**kw), "ddp", 2, est("ddp", **kw))
    save(plan, tmp_path / "plan.json")
    mp.start_processes(_ddp_rank, args=(free_port(), str(tmp_path / "plan.json"), str(tmp_path)), nprocs=2,
                       join=True, start_method="spawn")
    result = torch.load(tmp_path / "result.pt")
    assert result == {"equal": True, "nonzero": True}


def test_materialising_keeps_tied_weights_tied():
    """DDP's and ZeRO-1's path gives a meta model storage with to_empty, whose Module._apply makes
    each module a new Parameter: a tied head came out with a weight of its own, and the run
    trained an untied model (the real-run survey: a tied model's DDP run measured byte for byte
    the untied one's, 427,052,184 bytes). After materialise the head's weight is the embedding's
    and the model has the tied parameter count (arch.param_count, the planner's)."""
    from zplan import arch, presets
    from zplan.trainer.model import Transformer
    from zplan.trainer.parallel import materialise

    m = presets.model("llama-3.2-1b").model_copy(update={
        "num_layers": 1, "hidden": 64, "ffn_hidden": 128, "num_heads": 4, "num_kv_heads": 2, "vocab_size": 1000})
    assert m.tied_embeddings
    with torch.device("meta"):
        t = Transformer(m)
    materialise(t, False, torch.device("cpu"))
    assert t.output.weight is t.tok_embeddings.weight and not t.output.weight.is_meta
    assert sum(p.numel() for p in t.parameters()) == arch.param_count(m)


def _fsdp_rank(rank: int, port: int, plan_path: str, out: str) -> None:
    ctx, model = _applied(rank, port, plan_path, out)
    try:
        full = ctx.full_state_dict(model)
        if rank == 0:
            torch.save(full, os.path.join(out, "full.pt"))
    finally:
        ctx.close(leave=True)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("strategy", ["zero3", "offload-all"])
def test_fsdp_on_cpu_ranks_starts_from_one_whole_initialisation(tmp_path, strategy):
    """DTensor draws a shard's random values from one seeded stream only on cuda-like meshes: on
    CPU ranks ctx.apply initialised each shard from its rank's own generator, and the full weights
    were one shard repeated (rows 0-15 of a.weight equal to rows 16-31). Now the whole model is
    initialised on CPU ranks before sharding, rank 0's values broadcast: the full weights are
    exactly what rank 0's seed gives one unsharded model (the oracle: nn.Linear's own
    reset_parameters in one process). Two real gloo ranks."""
    import torch.multiprocessing as mp

    kw = dict(model="llama-3.2-1b", gpus=2, micro_batch=1, grad_accum=1, layout="torch",
              gpu="cpu", cluster="cpu-local")
    plan = make_plan(scenario(**kw), strategy, 2, est(strategy, **kw))
    plan = plan.model_copy(update={"train": plan.train.model_copy(update={"precision": plan.train.precision.model_copy(
        update={"param": "fp32", "reduce": "fp32"})})})
    save(plan, tmp_path / "plan.json")
    mp.start_processes(_fsdp_rank, args=(free_port(), str(tmp_path / "plan.json"), str(tmp_path)), nprocs=2,
                       join=True, start_method="spawn")
    full = torch.load(tmp_path / "full.pt")
    torch.manual_seed(100)
    with torch.device("meta"):
        ref = UserModel()
    ref.to_empty(device="cpu")
    with torch.no_grad():
        for m in ref.modules():
            if hasattr(m, "reset_parameters"):
                m.reset_parameters()
    assert not torch.equal(full["a.weight"][:16], full["a.weight"][16:])  # not one shard tiled
    for name, value in ref.state_dict().items():
        assert torch.equal(full[name].float(), value), name


def _host_shard_rank(rank: int, port: int, plan_path: str, out: str) -> None:
    import torch.distributed as dist

    from zplan.plan import load
    from zplan.trainer import api
    from zplan.trainer.parallel import shard_units

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2")
    dist.init_process_group("gloo")
    try:
        plan = load(plan_path)
        full = {}
        for how in ("alike", "own"):
            torch.manual_seed(0)  # the script seeds every rank alike
            with torch.device("meta"):
                model = UserModel()
            par = shard_units(model, [[model.a], [model.b]], plan, torch.device("cpu"))
            if how == "alike":
                api._initialise(par.inner, None)
            else:
                api._initialise_host_shards(par.inner, None, rank)
            full[how] = model.a.weight.full_tensor()
        if rank == 0:
            torch.save(full, os.path.join(out, "host.pt"))
    finally:
        dist.barrier()
        dist.destroy_process_group()


@pytest.mark.timeout(180)
def test_host_shards_are_drawn_apart(tmp_path):
    """Shards on the host (offload-all) are outside DTensor's RNG tracker, which drives the GPU's
    stream: initialised from each rank's CPU generator seeded alike, the full weight is one shard
    twice (shown here on CPU ranks, where no tracker runs at all); _initialise_host_shards, which
    apply uses for offload-all on a GPU, draws each rank's shard from a stream of its own."""
    import torch.multiprocessing as mp

    kw = dict(model="llama-3.2-1b", gpus=2, micro_batch=1, grad_accum=1, layout="torch",
              gpu="cpu", cluster="cpu-local")
    save(make_plan(scenario(**kw), "offload-all", 2, est("offload-all", **kw)), tmp_path / "plan.json")
    mp.start_processes(_host_shard_rank, args=(free_port(), str(tmp_path / "plan.json"), str(tmp_path)),
                       nprocs=2, join=True, start_method="spawn")
    full = torch.load(tmp_path / "host.pt")
    assert torch.equal(full["alike"][:16], full["alike"][16:])  # the bug: one shard tiled
    assert not torch.equal(full["own"][:16], full["own"][16:])
    bound = 1 / 16 ** 0.5  # nn.Linear(16, 32)'s kaiming-uniform bound: the distribution is kept
    assert full["own"].abs().max() <= bound and full["own"].std() > bound / 3
