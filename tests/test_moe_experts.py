"""An MoE block's routed experts as the runners store them: fused 3-D tensors, the experts on
dim 0 (arch.expert_shapes), held against the libraries themselves: transformers 5.x's decoder
layers built on the meta device (the zero layout's shapes), FSDP2's own sharding of them on a
fake process group (arch.fsdp_shard_elems, with torchtitan's shard_placement_fn rule) and DDP's
bucket assignment over them."""

from __future__ import annotations

import math

import pytest

from tests.helpers import scenario
from tests.test_hf_configs import MIXTRAL_8X7B, QWEN3_30B_A3B, READ, _write

# (config, transformers module, decoder layer class)
HF_LAYERS = {
    "mixtral-8x7b": (MIXTRAL_8X7B, "mixtral", "MixtralDecoderLayer"),
    "qwen3-30b-a3b": (QWEN3_30B_A3B, "qwen3_moe", "Qwen3MoeDecoderLayer"),
    "granitemoe-3b": (READ["granitemoe-3b"], "granitemoe", "GraniteMoeDecoderLayer"),
}


@pytest.mark.parametrize("name", sorted(HF_LAYERS))
def test_the_zero_layouts_block_is_transformers_decoder_layer(tmp_path, name):
    """transformers 5.x keeps an MoE layer's experts as one module of 3-D weights
    (Qwen3MoeExperts / MixtralExperts: gate_up_proj (E, 2F, H), down_proj (E, H, F); GraniteMoe's
    ParallelExperts alike): the block zplan prices in the zero layout has its parameters, shape
    for shape."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    import importlib

    from zplan import arch, presets

    cfg, module, layer = HF_LAYERS[name]
    m = presets.model(str(_write(tmp_path, cfg)))
    config = transformers.AutoConfig.for_model(**cfg)
    cls = getattr(importlib.import_module(f"transformers.models.{module}.modeling_{module}"), layer)
    with torch.device("meta"):
        block = cls(config, 0)
    built = sorted(tuple(p.shape) for p in block.parameters())
    assert built == sorted(arch.block_shapes(m, "zero"))
    assert any(len(s) == 3 for s in built)  # the experts are fused, not E separate Linears


@pytest.mark.parametrize("name", ["mixtral-8x7b", "qwen3-30b-a3b"])
def test_both_layouts_hold_the_published_parameters(name):
    """torchtitan's GroupedExperts (w1, w2, w3) and transformers' gate_up / down hold the same
    elements: the count is the layout's choice of tensors, not of parameters."""
    from zplan import arch, presets

    m = presets.model(name)
    zero, torch_ = arch.block_shapes(m, "zero"), arch.block_shapes(m, "torch")
    assert sum(map(math.prod, zero)) == sum(map(math.prod, torch_))
    E, H, F = m.num_experts, m.hidden, m.ffn_hidden
    assert [s for s in torch_ if len(s) == 3] == [(E, F, H), (E, H, F), (E, F, H)]


@pytest.fixture
def fake_world():
    """A fake process group of `n` ranks (torch's own FakeStore backend), replaced per call."""
    torch = pytest.importorskip("torch")
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    def make(n: int):
        if dist.is_initialized():
            dist.destroy_process_group()
        dist.init_process_group("fake", rank=0, world_size=n, store=FakeStore())
        from torch.distributed.device_mesh import init_device_mesh

        return init_device_mesh("cpu", (n,))

    yield make
    if dist.is_initialized():
        dist.destroy_process_group()


@pytest.mark.parametrize("degree", [4, 6, 8, 16, 64])
def test_fsdp2_shards_the_experts_as_zplan_counts(fake_world, degree):
    """FSDP2 (fully_shard on meta parameters over a fake group of `degree` ranks) holds, per
    rank, each parameter's padded shard (FSDPParam.padded_sharded_param_size: torch.chunk's first
    chunk). With torchtitan's rule (torchtitan/distributed/fsdp.py at b36e4b6: Shard(1) for the
    experts where the FSDP degree exceeds num_experts, else Shard(0)) that is what
    arch.fsdp_shard_elems and Scenario.shard_elems count: Mixtral's 8 experts at 6 ranks pad dim 0
    to 12, at 16 and 64 ranks they split on dim 1 with no padding."""
    import torch
    from torch import nn
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard

    from zplan import arch, presets

    m = presets.model("mixtral-8x7b").model_copy(update={"hidden": 256, "ffn_hidden": 512, "num_heads": 4,
                                                          "num_kv_heads": 2})
    shapes = arch.block_shapes(m, "torch")
    block = nn.Module()
    block.params = nn.ParameterList(nn.Parameter(torch.empty(s, device="meta")) for s in shapes)
    experts = {p for p in block.parameters() if p.ndim == 3}
    placement = Shard(1) if degree > m.num_experts else Shard(0)
    fully_shard(block, mesh=fake_world(degree), shard_placement_fn=lambda p: placement if p in experts else None)
    held = [math.prod(fp.padded_sharded_param_size) for fp in block._get_fsdp_state()._fsdp_param_group.fsdp_params]
    assert held == [arch.fsdp_shard_elems(s, degree) for s in shapes]
    unit = arch.Unit("blocks.0", tuple(shapes), 1, 0, 0)
    sc = scenario(model="mixtral-8x7b", gpus=degree, layout="torch")
    assert sc.shard_elems(unit, degree) == sum(held)
    experts_held = [(h, s) for h, s in zip(held, shapes) if len(s) == 3]
    if degree > m.num_experts:  # no padding: each rank a 1/degree of every expert weight
        assert all(h * degree == math.prod(s) for h, s in experts_held)
    elif degree == 6:  # dim 0 padded from 8 experts to 12
        assert all(h * degree == math.prod(s) * 12 // 8 for h, s in experts_held)


def test_ddp_buckets_hold_each_fused_expert_weight_alone():
    """DDP's bucket assignment (torch's compute_bucket_assignment_by_size on meta tensors, limits
    [1 MiB, 25 MiB]) over Qwen3-30B-A3B's parameters in the torch layout is the calls zplan
    times: a 3-D expert weight (128 x 768 x 2048 fp32, 768 MiB) closes its bucket; w2 and w1 go
    alone, w3 (the first to be ready) ends the bucket the block after it left open."""
    import torch
    import torch.distributed as dist

    from zplan import comm

    sc = scenario(model="qwen3-30b-a3b", gpus=16, layout="torch")
    rev = [torch.empty(s, device="meta") for u in reversed(sc.units) for s in reversed(u.shapes)]
    groups, _ = dist._compute_bucket_assignment_by_size(rev, [2**20, 25 * 2**20], [False] * len(rev))
    oracle = [4 * sum(rev[i].numel() for i in g) for g in groups]
    total = 4 * sum(p.numel() for p in rev)
    assert comm.bucket_calls(sc, "fp32", total, 25 * 2**20, comm.DDP_FIRST_BUCKET_BYTES) == oracle
    expert_b = 4 * 128 * 768 * 2048
    assert sum(1 for b in oracle if b == expert_b) == 2 * sc.model.num_layers


@pytest.mark.parametrize("degree", [12, 24, 16])
def test_an_uneven_dim1_shard_fsdp2_refuses_is_refused(fake_world, degree):
    """Past E ranks torchtitan shards the experts on dim 1, which FSDP2 splits only evenly: its
    own fully_shard raises at 12 and 24 ranks for Mixtral's widths (4096, 14336) and takes 16.
    zplan refused nothing and priced the padding; it now refuses what FSDP2 refuses, and only that."""
    import torch
    from torch import nn
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard

    from zplan import arch, presets
    from zplan.estimate import estimate_one

    m = presets.model("mixtral-8x7b")
    block = nn.Module()
    block.params = nn.ParameterList(nn.Parameter(torch.empty(s, device="meta"))
                                    for s in arch.block_shapes(m, "torch") if len(s) == 3)
    mesh = fake_world(degree)
    try:
        fully_shard(block, mesh=mesh, shard_placement_fn=lambda p: Shard(1))
        refused_by_fsdp2 = False
    except NotImplementedError as e:
        assert "uneven sharding on dim 1" in str(e)
        refused_by_fsdp2 = True
    assert refused_by_fsdp2 is (degree != 16)
    why = estimate_one(scenario(model="mixtral-8x7b", gpus=degree, layout="torch"), "zero3").unavailable
    assert (why is not None and "dim 1" in why) is refused_by_fsdp2, why


def test_muon_on_an_moe_model_is_refused():
    """torch.optim.Muon takes 2-D parameters only (its own check is the oracle), and the experts
    are 3-D: --optimizer muon with an MoE model is a usage error, said in one line."""
    torch = pytest.importorskip("torch")
    if not hasattr(torch.optim, "Muon"):
        pytest.skip("this torch has no torch.optim.Muon")
    with pytest.raises(ValueError):
        torch.optim.Muon([torch.nn.Parameter(torch.zeros(2, 3, 4))])
    torch.optim.Muon([torch.nn.Parameter(torch.zeros(3, 4))])  # 2-D: taken
    from zplan.errors import UsageError

    with pytest.raises(UsageError, match="takes 2-D parameters only"):
        scenario(model="qwen3-30b-a3b", gpus=8, optimizer="muon")


def test_under_hsdp_the_whole_mesh_decides_the_experts_placement(fake_world, tmp_path):
    """torchtitan picks Shard(1) for the experts where its data-parallel mesh (under HSDP
    replicas x shard) exceeds the expert count, and FSDP2 then splits over the shard group:
    granitemoe's 40 experts on 64 ranks with a shard size of 32 hold E x F/32 x H each, which
    zplan counted as Shard(0) at 32 ranks (ceil(40/32) = 2 experts: 1.6x). fully_shard on a
    (2, 32) fake mesh is the oracle."""
    import torch
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard

    from zplan import arch, presets

    path = str(_write(tmp_path, READ["granitemoe-3b"]))
    m = presets.model(path)
    fake_world(64)
    mesh = init_device_mesh("cpu", (2, 32), mesh_dim_names=("replicate", "shard"))
    shapes = [s for s in arch.block_shapes(m, "torch") if len(s) == 3]
    block = nn.Module()
    block.params = nn.ParameterList(nn.Parameter(torch.empty(s, device="meta")) for s in shapes)
    placement = Shard(1) if 64 > m.num_experts else Shard(0)  # torchtitan: dp_mesh.size() > num_experts
    fully_shard(block, mesh=mesh, shard_placement_fn=lambda p: placement)
    held = [math.prod(fp.padded_sharded_param_size) for fp in block._get_fsdp_state()._fsdp_param_group.fsdp_params]
    sc = scenario(model=path, gpus=64, layout="torch", shard_size=32)
    unit = arch.Unit("experts", tuple(shapes), 1, 0, 0)
    assert sc.shard_elems(unit, 32) == sum(held)
    assert sum(held) < sum(arch.fsdp_shard_elems(s, 32) for s in shapes)  # the shard size alone: Shard(0)


@pytest.mark.slow  # three recommend runs of Mixtral
@pytest.mark.parametrize("degree", [8, 16, 32])
def test_accelerates_dim0_split_of_the_experts_is_refused_where_it_costs_memory(fake_world, tmp_path, run_zplan,
                                                                                degree):
    """accelerate's FSDP2 passes fully_shard no shard_placement_fn, so a Hugging Face MoE model's
    fused experts split on dim 0 (fully_shard on meta over a fake group, no placement: FSDP2 itself
    is the oracle). A plan priced on torchtitan's placement exports to accelerate only where the two
    hold the same; else the refusal gives FSDP2's own ratio (Mixtral's 8 experts: 2x at 16 ranks,
    4x at 32)."""
    import torch
    from torch import nn
    from torch.distributed.fsdp import fully_shard

    from zplan import arch, presets

    m = presets.model("mixtral-8x7b")
    shapes = [s for s in arch.expert_shapes(m, "torch") if len(s) == 3]
    block = nn.Module()
    block.params = nn.ParameterList(nn.Parameter(torch.empty(s, device="meta")) for s in shapes)
    fully_shard(block, mesh=fake_world(degree))
    held = sum(math.prod(fp.padded_sharded_param_size)
               for fp in block._get_fsdp_state()._fsdp_param_group.fsdp_params)
    ratio = held / sum(arch.fsdp_shard_elems(s, degree) for s in shapes)
    plan = tmp_path / "plan.json"
    p = run_zplan("recommend", "--model", "mixtral-8x7b", "--gpu", "h200", "--gpus", str(degree), "--layout",
                  "torch", "--strategy", "zero3", "--reduce-dtype", "bf16", "--embed-head-unit", "head-kept",
                  "--blocks-per-unit", "1", "--checkpointing", "full", "--write", str(plan))
    assert p.returncode == 0, p.stderr
    p = run_zplan("export", "--plan", str(plan), "--to", "accelerate")
    if ratio == 1:
        assert degree == m.num_experts and p.returncode == 0, p.stderr
    else:
        assert p.returncode == 2 and f"hold {ratio:.1f}x the expert memory" in p.stderr, p.stderr
        assert ratio == degree / m.num_experts and "Traceback" not in p.stderr
