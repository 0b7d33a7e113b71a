"""FSDP's copies around its collectives (unit_ops.fsdp_copies) against PyTorch's own: FSDP2
(fully_shard) and FSDP1 (FullyShardedDataParallel, TrainSpec.fsdp1) on four gloo ranks, op for
op; and --fsdp1's checks on the CLI."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.helpers import cli

# Two linears in one unit (N elements) under a root that keeps a head of its own (64 x 40,
# gathered from forward to backward as both FSDPs keep a root), on four gloo ranks (FSDP1's pre-
# and post-division both 2), bf16 compute, gradients reduced in fp32 and in bf16; a first step
# outside the records (lazy init), then one step's forward and backward ops recorded on rank 0:
# each op's name, the sizes of the tensors it takes, the bytes it takes and makes.
WORLD = 4
N = 64 * 128 * 2
_FSDP_RUN = r"""
import json, os, sys
rank, port, world, impls = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4].split(",")
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port, RANK=str(rank), WORLD_SIZE=world)
import torch, torch.distributed as dist, torch.nn as nn
from torch.distributed.fsdp import (FullyShardedDataParallel as FSDP, MixedPrecision, MixedPrecisionPolicy,
                                    ShardingStrategy, fully_shard)
from torch.distributed.device_mesh import init_device_mesh
from torch.utils._python_dispatch import TorchDispatchMode

class Ops(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = []
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        def flat(xs):
            return [t for x in xs for t in (x if isinstance(x, (list, tuple)) else [x]) if isinstance(t, torch.Tensor)]
        ins, outs = flat(list(args) + list((kwargs or {}).values())), flat([out])
        self.ops.append((func._schema.name, [t.numel() for t in ins], sum(t.numel() * t.element_size() for t in ins),
                         sum(t.numel() * t.element_size() for t in outs)))
        return out

dist.init_process_group("gloo")
res = {}
for impl, reduce in [(i, r) for i in impls for r in ("float32", "bfloat16")]:
    torch.manual_seed(0)
    dtype = getattr(torch, reduce)
    # the unit: two linears, resharded after forward and gathered again in backward
    unit = nn.Sequential(nn.Linear(64, 128, bias=False), nn.Linear(128, 64, bias=False))
    # HSDP: shard groups of 2, replicated twice
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard")) if impl.endswith("hsdp") else None
    if impl.startswith("fsdp1"):
        kw = dict(device_id=torch.device("cpu"), use_orig_params=True,
                  mixed_precision=MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=dtype),
                  **(dict(sharding_strategy=ShardingStrategy.HYBRID_SHARD, device_mesh=mesh) if mesh else
                     dict(sharding_strategy=ShardingStrategy.FULL_SHARD)))
        f = FSDP(nn.Sequential(FSDP(unit, **kw), nn.Linear(64, 40, bias=False)), **kw)
    else:
        kw = dict(mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=dtype),
                  **(dict(mesh=mesh) if mesh else {}))
        f = nn.Sequential(unit, nn.Linear(64, 40, bias=False))
        fully_shard(unit, **kw)
        fully_shard(f, **kw)
    x = torch.randn(4, 64)
    f(x).float().sum().backward()  # a first step: lazy init outside the records
    f.zero_grad(set_to_none=True)  # a step as training runs them, nothing accumulated
    fwd, bwd = Ops(), Ops()
    with fwd:
        loss = f(x).float().sum()
    with bwd:
        loss.backward()
    res[f"{impl} {reduce}"] = {"forward": fwd.ops, "backward": bwd.ops}
if rank == 0:
    print("OPS " + json.dumps(res), flush=True)
dist.barrier()
sys.stdout.flush()
os._exit(0)
"""

# ops that move no bytes (views, allocations) or are not copies (matmuls, the loss); FSDP2's
# all_gather_copy_in wraps its _foreach_copy_, which the trace shows on its own
_NOT_COPIES = ("aten::view", "aten::_unsafe_view", "aten::expand", "aten::t", "aten::slice", "aten::split",
               "aten::split_with_sizes", "aten::detach", "aten::alias", "aten::as_strided", "aten::empty",
               "aten::empty_like", "aten::mm", "aten::ones_like", "aten::sum", "fsdp::all_gather_copy_in")
# ops whose destination is an argument: it is written, not read (their inputs are what they move)
_INTO = ("aten::copy_", "aten::_foreach_copy_", "fsdp::split_with_sizes_copy", "fsdp::chunk_cat")
# the unit's tensors: its flat parameter, shard, weights and weight shards (no activation has these sizes)
UNIT_SIZES = {N, N // WORLD, N // 2, N // 2 // WORLD}


IMPLS = ("fsdp2", "fsdp1", "fsdp2-hsdp", "fsdp1-hsdp")


@pytest.fixture(scope="module")
def fsdp_traces(tmp_path_factory) -> dict:
    """Every FSDP's trace from one launch of four ranks (the start-up is most of its time)."""
    pytest.importorskip("torch")
    return _fsdp_ops(tmp_path_factory.mktemp("fsdp"), ",".join(IMPLS))


def _fsdp_ops(tmp_path, impl: str) -> dict:
    from zplan.netutil import free_port

    script = tmp_path / "fsdp_run.py"
    script.write_text(_FSDP_RUN)
    port = str(free_port())
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    procs = [subprocess.Popen([sys.executable, str(script), str(r), port, str(WORLD), impl], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=env) for r in range(WORLD)]
    outs = [p.communicate(timeout=240) for p in procs]
    for p, (_, err) in zip(procs, outs):
        assert p.returncode == 0, err[-3000:]
    (line,) = [x for x in outs[0][0].splitlines() if x.startswith("OPS ")]
    return json.loads(line[len("OPS "):])


def _without_gloo_chunk_copies(ops: list) -> list:
    """The trace less what gloo does that NCCL does not: ProcessGroupGloo runs a reduce-scatter as
    an all-reduce of a copy of its input and copies this rank's chunk into the output when the
    caller waits (docs/formulas.md section 3: a split of the input and a copy_, right after the
    collective on the calling thread)."""
    out, after_rs = [], False
    for op in ops:
        if op[0] == "c10d::_reduce_scatter_base_":
            after_rs = True
        elif after_rs and op[0] == "aten::copy_":
            after_rs = False
            continue
        elif after_rs and op[0] not in ("aten::split", "aten::slice", "aten::view"):
            after_rs = False
        out.append(op)
    return out


def _unit_copies(ops: list) -> list[int]:
    """Bytes read and written by each copy of the trace that touches the unit's tensors (not a
    view, an allocation, a matmul or a collective)."""
    return sorted(nbytes if name in _INTO else nbytes + made
                  for name, sizes, nbytes, made in _without_gloo_chunk_copies(ops)
                  if not name.startswith("c10d::") and name not in _NOT_COPIES and UNIT_SIZES & set(sizes))


def _zplan_copies(reduce: str, impl: str):
    """The same unit as zplan prices it: the two weights, resharded after forward, on WORLD
    ranks (HSDP: shard groups of 2); the root's head a held unit beside it."""
    from zplan import arch, presets
    from zplan.comm import gather_dtype, regathered
    from zplan.scenario import Scenario
    from zplan.specs import Hardware, TrainSpec
    from zplan.strategies import effective
    from zplan.unit_ops import fsdp_copies

    unit = arch.Unit("unit", ((128, 64), (64, 128)), 1, 0, N)
    head = arch.Unit("head", ((40, 64),), 0, 1, 40 * 64, held=True)
    hw = Hardware(gpu=presets.gpu("h100-sxm"), cluster=presets.cluster("dgx-h100"), num_gpus=WORLD)
    sc = Scenario(arch.synthetic(N + 40 * 64), hw, TrainSpec(precision={"param": "bf16", "reduce": reduce},
                                                            layout="torch", fsdp1=impl.startswith("fsdp1")),
                  custom_units=(unit, head), shard_size=2 if impl.endswith("hsdp") else None)
    st = effective("hsdp" if impl.endswith("hsdp") else "zero3", "torch")
    sc = sc.for_strategy(st.fsdp)
    assert regathered(sc, st, unit)
    return fsdp_copies(sc, st, unit, sc.shard_degree(st.hsdp), gather_dtype(sc, unit))


@pytest.mark.slow  # four processes importing torch.distributed
@pytest.mark.timeout(300)
@pytest.mark.parametrize("impl", IMPLS)
def test_fsdp_copies_are_pytorchs_own(fsdp_traces, impl):
    """PyTorch's FSDP on four gloo ranks is the oracle: every copy of the unit's tensors in one
    step, forward and backward, is one of zplan's ops with the same bytes (unit_ops.fsdp_copies;
    nothing accumulates here, so no sum into a gradient).
    FSDP2 (fully_shard): the shard cast into the all-gather buffer (_foreach_copy_, N/4 elements,
    4 + 2 bytes each) and the gathered buffer split into the parameters (split_with_sizes_copy,
    2 + 2 bytes of N) in each pass; the gradients cast into the reduce-scatter input (chunk_cat)
    and, under a bf16 reduce, the shard cast back to fp32; no division (fp32 and bf16 average in
    the collective).
    FSDP1 (FullyShardedDataParallel): the shard's cast (copy_ into _mp_shard) in each pass and
    nothing copied out (the parameters are views); in backward the gradients' concatenation
    (SplitWithSizesBackward), their cast to the reduce dtype where it differs, the in-place
    pre-division, and on the shard the post-division and, under bf16, the cast back.
    HSDP (shard groups of 2, two replicas): the same copies on the larger shard; FSDP1 divides over
    the whole world (shard x replicas), before the reduce-scatter and after the all-reduce."""
    for reduce, dtype in (("fp32", "float32"), ("bf16", "bfloat16")):
        name, traced = f"{impl} {dtype}", fsdp_traces
        fwd, bwd = _zplan_copies(reduce, impl)
        assert not any("accumulate" in o.name for o in fwd + bwd)
        assert any("copy-out" in o.name for o in fwd) == impl.startswith("fsdp2")
        assert _unit_copies(traced[name]["forward"]) == sorted(o.bytes for o in fwd), (impl, reduce)
        assert _unit_copies(traced[name]["backward"]) == sorted(o.bytes for o in bwd), (impl, reduce)


@pytest.mark.parametrize("args,expect", [
    (["--fsdp1"], "--layout torch"),  # estimate plans DeepSpeed's layout by default
    (["--fsdp1", "--layout", "zero"], "--layout torch"),
    (["--fsdp1", "--layout", "torch", "--gpu", "h100-sxm", "--float8"], "--no-float8-all-gather"),
])
def test_fsdp1_refused_where_it_cannot_apply(capsys, args, expect):
    r = cli(capsys, "estimate", "--model", "llama-3.1-8b", "--gpus", "16", *args)
    assert r.returncode == 2
    assert expect in r.stderr and "--fsdp1" in r.stderr
    assert "Traceback" not in r.stderr


def test_fsdp1_changes_only_the_copies():
    """--fsdp1 moves the step's time by its copies alone (memory and traffic as FSDP2's), and
    explain lists them; zplan's trainer (FSDP2) and accelerate's FSDP2 config refuse the plan."""
    from zplan.estimate import estimate_one
    from zplan.explain import explain_lines
    from zplan.export import _accelerate_refusal
    from zplan.plan import make_plan, trainer_refusal
    from zplan.scenario_options import ScenarioOptions, build

    base = dict(model="llama-3.1-8b", gpus="16", layout="torch")
    two, one = build(ScenarioOptions(**base)), build(ScenarioOptions(**base, fsdp1=True))
    e2, e1 = estimate_one(two, "zero3"), estimate_one(one, "zero3")
    assert e1.memory.total_bytes == e2.memory.total_bytes
    assert e1.bytes_per_step == e2.bytes_per_step
    assert e1.timing.step_s != e2.timing.step_s
    assert any(x.startswith("FSDP1's copies around") for x in explain_lines(one, "zero3"))
    assert any(x.startswith("FSDP2's copies around") for x in explain_lines(two, "zero3"))
    assert trainer_refusal(make_plan(two, "zero3", 16)) is None
    assert "--fsdp1" in trainer_refusal(make_plan(one, "zero3", 16))
    fits_accelerate = dict(base, reduce_dtype="bf16", embed_head_unit="head-kept")
    assert _accelerate_refusal(make_plan(build(ScenarioOptions(**fits_accelerate)), "zero3", 16)) is None
    assert "--fsdp1" in _accelerate_refusal(make_plan(build(ScenarioOptions(**fits_accelerate, fsdp1=True)), "zero3", 16))


def test_fsdp_divides_as_torch_does():
    """gradient_divide_factors is FSDP1's own pre-division (DefaultState's, which FullyShardedDataParallel
    reads at init) over the data-parallel world, the post-division the rest of the world; and
    FSDP2's under an fp16 reduce (shard group x replicas), where fp32 and bf16 divide nothing."""
    import torch
    from torch.distributed.algorithms._comm_hooks.default_hooks import DefaultState
    from torch.distributed.fsdp._fully_shard._fsdp_collectives import _get_gradient_divide_factors

    from zplan.unit_ops import gradient_divide_factors

    class Group:  # what _get_gradient_divide_factors asks of a process group
        def __init__(self, n: int):
            self.n = n

        def size(self) -> int:
            return self.n

    for world in list(range(1, 130)) + [256, 384, 1000, 1024, 4096]:
        pre, post = gradient_divide_factors(world)
        assert pre == DefaultState._get_gradient_predivide_factor(world)
        assert post == world / pre
        for shard in {d for d in (1, 2, world) if world % d == 0}:
            replicas = Group(world // shard) if shard < world else None
            fp16 = _get_gradient_divide_factors(Group(shard), replicas, torch.float16)
            assert fp16[:2] == (pre, post)
            assert _get_gradient_divide_factors(Group(shard), replicas, torch.bfloat16)[:2] == (None, None)


def test_fsdp1_on_one_rank_shards_nothing():
    """One rank (NO_SHARD): the shard's mixed-precision cast and no copy-out, the gradients
    concatenated and, reduced in bf16 as they are made, cast back to the fp32 flat parameter's
    dtype; nothing divided, nothing reduce-scattered, no sum into a gradient."""
    from zplan.comm import gather_dtype
    from zplan.scenario_options import ScenarioOptions, build
    from zplan.strategies import effective
    from zplan.unit_ops import fsdp_copies

    sc = build(ScenarioOptions(model="llama-3.1-8b", gpus="1", layout="torch", fsdp1=True, reduce_dtype="bf16",
                               grad_accum=2))
    st = effective("zero3", "torch")
    sc = sc.for_strategy(st.fsdp)
    u = next(x for x in sc.units if x.blocks)
    fwd, bwd = fsdp_copies(sc, st, u, 1, gather_dtype(sc, u))
    names = [o.name for o in fwd + bwd]
    assert not any(x in n for n in names for x in ("copy-out", "divide", "reduce-scatter", "accumulate"))
    assert [o.name for o in fwd] == ["all-gather copy-in (mixed-precision shard)"]
    assert [o.bytes for o in bwd if "cast" in o.name] == [6 * u.numel]  # bf16 -> fp32 after the all-reduce
    assert any(x.startswith("flat gradient (SplitWithSizesBackward") for x in names)


def test_fsdp1_with_no_sharded_strategy_is_refused(capsys):
    r = cli(capsys, "estimate", "--model", "llama-3.1-8b", "--gpus", "16", "--layout", "torch",
            "--fsdp1", "--strategy", "ddp")
    assert r.returncode == 2 and "--fsdp1" in r.stderr and "--strategy zero3" in r.stderr
