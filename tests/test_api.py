"""A user's own model under zplan.trainer.api: stored in the plan's master dtype, as the built-in
trainer's is (zplan/trainer/parallel.py to_master_dtype). One rank, a real gloo group."""

import os

import pytest

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.slow  # a real process group: ~5 s a case on 2 cores

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
    for k, v in (("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "29533"), ("RANK", "0"),
                 ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0")):
        monkeypatch.setenv(k, v)
    ctx = api.init(ckpt_dir=str(tmp_path))
    try:
        with torch.device("meta"):
            model = UserModel().to(torch.bfloat16)
        model = ctx.apply(model, units=[model.a, model.b])
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
