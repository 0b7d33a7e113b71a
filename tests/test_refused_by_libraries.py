"""Plans the libraries that would run them refuse: each refusal held against the library itself
(a one-rank process group where it needs one), so that the planner neither prices a run that
cannot start nor refuses one that can."""

import pytest

from tests.helpers import scenario


def test_compiled_ddp_first_bucket_is_one_mib_at_any_cap_and_asserts_under_it():
    """torch.compile under DDP builds DDPOptimizer with the module's cap and no first cap
    (torch/_dynamo/convert_frame.py): its first graph bucket is 1 MiB whatever the cap, and a
    cap under 1 MiB fails its assertion. zplan splits the graphs so and refuses the cap."""
    from torch._dynamo.backends.distributed import DDPOptimizer

    from zplan import comm, memory
    from zplan.estimate import estimate_one

    MiB = 2**20
    assert DDPOptimizer(bucket_bytes_cap=4 * MiB, backend_compile_fn=lambda *a: None).first_bucket_cap == MiB
    with pytest.raises(AssertionError):
        DDPOptimizer(bucket_bytes_cap=MiB // 2, backend_compile_fn=lambda *a: None)
    DDPOptimizer(bucket_bytes_cap=MiB, backend_compile_fn=lambda *a: None)  # the smallest cap it takes

    sc = scenario(model="tiny", gpus=8, layout="torch", compile=True, bucket_mib=4.0)
    graphs = memory.ddp_graph_buckets(sc, 4)
    assert graphs == comm.gradient_buckets(sc, 4, 4 * MiB, MiB)
    assert graphs != comm.gradient_buckets(sc, 4, 4 * MiB, comm.ddp_first_bucket_bytes(4 * MiB))  # the Reducer's rule
    for strategy in ("ddp", "zero1"):
        est = estimate_one(scenario(model="tiny", gpus=2, layout="torch", compile=True, bucket_mib=0.5), strategy)
        assert est.unavailable and "--bucket-mib 1" in est.unavailable
        assert estimate_one(scenario(model="tiny", gpus=2, layout="torch", compile=True, bucket_mib=1.0),
                            strategy).unavailable is None
    # sharded strategies have no DDP bucket; eager DDP takes any cap
    assert estimate_one(scenario(model="tiny", gpus=2, layout="torch", compile=True, bucket_mib=0.5), "zero3").unavailable is None
    assert estimate_one(scenario(model="tiny", gpus=2, layout="torch", bucket_mib=0.5), "ddp").unavailable is None


def test_bitsandbytes_cannot_step_an_fsdp2_shard(tmp_path):
    """bitsandbytes' AdamW8bit on a Shard(0) DTensor parameter (what FSDP2 hands the optimizer)
    fails in its update op, on one rank as on many: zplan refuses adam8bit for FSDP2's
    strategies and keeps it where the parameter is a plain tensor (DDP, DeepSpeed's layout)."""
    bnb = pytest.importorskip("bitsandbytes")
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from zplan.estimate import estimate_one

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        p = torch.nn.Parameter(distribute_tensor(torch.randn(8192, 2), mesh, [Shard(0)]))
        p.grad = distribute_tensor(torch.randn(8192, 2), mesh, [Shard(0)])
        with pytest.raises(Exception, match="DTensor"):
            bnb.optim.AdamW8bit([p]).step()
        plain = torch.nn.Parameter(torch.randn(8192, 2))
        plain.grad = torch.randn(8192, 2)
        bnb.optim.AdamW8bit([plain]).step()  # the same step on a plain tensor runs
    finally:
        dist.destroy_process_group()

    for strategy in ("zero2", "zero3", "hsdp", "offload-all"):
        why = estimate_one(scenario(model="tiny", gpus=2, layout="torch", optimizer="adam8bit"), strategy).unavailable
        assert why and "DTensor" in why
    for strategy, layout in (("ddp", "torch"), ("zero1", "torch"), ("zero3", "zero")):
        assert estimate_one(scenario(model="tiny", gpus=2, layout=layout, optimizer="adam8bit"), strategy).unavailable is None
