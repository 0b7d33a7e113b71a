"""Gradient reductions issued in buckets, held against the libraries that issue them: DDP's
bucket assignment (torch's own, on meta tensors) and DeepSpeed's ZeRO-1/2 calls (a real
two-rank run on its CPU accelerator, its c10d calls recorded)."""

import json
import math
import os
import subprocess
import sys
from dataclasses import replace

import pytest

from tests.helpers import scenario


def test_ddp_buckets_are_the_reducers():
    """DDP rebuilds its buckets after the first step in the order gradients became ready (the
    parameters reversed) with limits [1 MiB, 25 MiB] (reducer.cpp rebuild_buckets ->
    compute_bucket_assignment_by_size): torch's own assignment on meta tensors is the oracle for
    the calls zplan times, here Llama 3.2 1B's fp32 gradients (a weight over 25 MiB alone)."""
    import torch
    import torch.distributed as dist

    from zplan import comm

    sc = scenario(model="llama-3.2-1b", gpus=16, layout="torch")
    params = [torch.empty(s, device="meta") for u in sc.units for s in u.shapes]
    rev = list(reversed(params))
    groups, _ = dist._compute_bucket_assignment_by_size(rev, [2**20, 25 * 2**20], [False] * len(rev))
    oracle = [4 * sum(rev[i].numel() for i in g) for g in groups]
    total = 4 * sum(p.numel() for p in params)
    assert comm.bucket_calls(sc, "fp32", total, 25 * 2**20, comm.DDP_FIRST_BUCKET_BYTES) == oracle
    assert len(oracle) < total // (25 * 2**20)  # fewer calls than equal 25 MiB pieces (the old pricing)
    (ar,) = [c for c in comm.collectives(sc, __import__("zplan.strategies", fromlist=["x"]).STRATEGIES["ddp"])
             if c.op == "all_reduce"]
    g = sc.hw.cluster.gpus_per_node
    assert ar.seconds_per_call == pytest.approx(sum(comm.call_seconds(sc, "all_reduce", b, 16, g) for b in oracle),
                                                rel=1e-12)
    assert ar.call_bytes == max(oracle)


def test_ddp_at_a_zero_bucket_cap_reduces_each_gradient_alone():
    """bucket_cap_mb=0 is DDP's one bucket per parameter (_BucketCapacityConfig: both caps 0),
    not one all-reduce of the whole model as zplan priced it: torch's assignment at limits
    [0, 0] on meta tensors is the oracle for the calls, each timed as NCCL runs it."""
    import torch
    import torch.distributed as dist

    from zplan import comm
    from zplan.strategies import STRATEGIES

    sc = scenario(model="llama-3.2-1b", gpus=16, layout="torch", bucket_mib=0.0)
    rev = [torch.empty(s, device="meta") for u in reversed(sc.units) for s in reversed(u.shapes)]
    groups, _ = dist._compute_bucket_assignment_by_size(rev, [0, 0], [False] * len(rev))
    oracle = [4 * sum(rev[i].numel() for i in g) for g in groups]
    assert len(oracle) == len(rev)
    (ar,) = [c for c in comm.collectives(sc, STRATEGIES["ddp"]) if c.op == "all_reduce"]
    g = sc.hw.cluster.gpus_per_node
    assert ar.seconds_per_call == pytest.approx(sum(comm.call_seconds(sc, "all_reduce", b, 16, g) for b in oracle),
                                                rel=1e-12)
    assert ar.last_bucket_s == pytest.approx(comm.call_seconds(sc, "all_reduce", oracle[-1], 16, g), rel=1e-12)


def test_a_reduce_moves_the_whole_tensor_at_the_bus_bandwidth():
    """ncclReduce runs the ring alone with nsteps = n, so its algbw is the busbw (tuning.cc:
    ratio = nRanks / nsteps): S / busbw plus NCCL's base latency and one hop, where a
    reduce-scatter of S moves S(n-1)/n; nccl-tests prints a reduce's algbw as its busbw."""
    from zplan import nccl, presets

    c = presets.cluster("dgx-h100")
    S = 2**30
    t = nccl.collective_time(c, "reduce", S, 8, 8)
    assert t.seconds == pytest.approx(c.base_latency_s + c.intra_node_latency_s + S / c.intra_node_busbw_bytes_per_s,
                                      rel=1e-12)
    rs = nccl.collective_time(c, "reduce_scatter", S, 8, 8).seconds
    assert t.seconds / rs == pytest.approx(8 / 7, rel=0.02)  # less the reduce-scatter's ring latency
    assert nccl.busbw_at(c, "reduce", S, 8, 8) == pytest.approx(S / t.seconds)
    across = nccl.collective_time(c, "reduce", S, 16, 8)  # two nodes: the ring through 8 NICs
    assert across.seconds == pytest.approx(c.base_latency_s + c.inter_node_latency_s
                                           + S / min(c.intra_node_busbw_bytes_per_s, 8 * c.inter_node_busbw_bytes_per_s),
                                           rel=1e-12)


_DS_RUN = r"""
import json, os, sys
rank, port, multi, world = int(sys.argv[1]), sys.argv[2], sys.argv[3] == "1", sys.argv[4]
os.environ.update(DS_ACCELERATOR="cpu", MASTER_ADDR="127.0.0.1", MASTER_PORT=port, RANK=str(rank),
                  WORLD_SIZE=world, LOCAL_RANK=str(rank))
import torch, deepspeed
from torch.utils._python_dispatch import TorchDispatchMode
# not the CPU accelerator's shared-memory all-reduce (its inference path, JIT-built here: half a
# minute of C++ on a fresh machine): the engine's gradient reductions are torch.distributed's
sys.modules["deepspeed.comm.torch"].build_shm_op = lambda: None
deepspeed.init_distributed(dist_backend="gloo")

class Calls(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.calls = []
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "c10d":
            t = args[0]
            n = sum(x.numel() for x in t) if isinstance(t, (list, tuple)) else t.numel()
            self.calls.append((func._schema.name.split("::")[-1], n))
        return func(*args, **(kwargs or {}))

cfg = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "train_batch_size": int(world),
       "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
       "zero_optimization": {"stage": 2, "reduce_bucket_size": 3000, "allgather_bucket_size": 100000,
                             "use_multi_rank_bucket_allreduce": multi, "overlap_comm": False}}
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Linear(64, 48), torch.nn.Linear(48, 16))
engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
x = torch.randn(4, 32)
for step in range(2):  # the second step: buckets as they run every step
    with Calls() as rec:
        engine.backward(engine(x).pow(2).mean())
        engine.step()
if rank == 0:
    print("CALLS", json.dumps(rec.calls), flush=True)
# both ranks done before either leaves, then no interpreter teardown: gloo's threads destroyed in
# whatever order it frees them once aborted a rank ("terminate called without an active
# exception", SIGABRT after the calls were printed; once in a CI run)
torch.distributed.barrier()
sys.stdout.flush()
os._exit(0)
"""

LINEARS = ((32, 64), (64, 48), (48, 16))


def _deepspeed_calls(tmp_path, multi: bool, world: int) -> list:
    from zplan.netutil import free_port

    script = tmp_path / "ds_run.py"
    script.write_text(_DS_RUN)
    port = str(free_port())
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    procs = [subprocess.Popen([sys.executable, str(script), str(r), port, "1" if multi else "0", str(world)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
             for r in range(world)]
    outs = [p.communicate(timeout=240) for p in procs]
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, err[-3000:]
    (line,) = [x for x in outs[0][0].splitlines() if x.startswith("CALLS ")]
    return json.loads(line[len("CALLS "):])


def _zplan_scenario(world: int = 2):
    """The test model as zplan's units: one per Linear, its weight and bias, fp32 throughout,
    on `world` ranks, DeepSpeed's reduce_bucket_size of 3000 elements as the bucket assumption."""
    from zplan import arch, presets
    from zplan.scenario import Scenario
    from zplan.specs import Hardware, TrainSpec

    units = tuple(arch.Unit(f"linear{i}", ((o, i_), (o,)), 1, i, o * i_ + o) for i, (i_, o) in enumerate(LINEARS))
    hw = Hardware(gpu=presets.gpu("cpu"), cluster=presets.cluster("cpu-local"), num_gpus=world)
    sc = Scenario(arch.synthetic(sum(u.numel for u in units)), hw,
                  TrainSpec(precision={"param": "fp32", "reduce": "fp32"}), custom_units=units)
    return replace(sc, assume=sc.assume.model_copy(update={"ddp_bucket_bytes": 3000 * 4}))


@pytest.mark.slow  # two processes importing deepspeed: seconds each
@pytest.mark.timeout(300)
@pytest.mark.parametrize("multi,world", [(True, 2), (False, 2), (False, 3)])
def test_deepspeed_zero2_reduces_the_buckets_zplan_prices(tmp_path, multi, world):
    """DeepSpeed's own ZeRO-2 (stage_1_and_2.py, gloo ranks) is the oracle: by default
    (use_multi_rank_bucket_allreduce) one all-reduce per IPG bucket, each bucket closed before
    the gradient that would overflow reduce_bucket_size; with it off, one reduce per owning
    rank's slice of each bucket, the partitions those of the flat buffer padded at its end (3
    ranks: 6016 elements padded to 6018, the padding never reduced; a review found zplan's
    slices shifted by it). zplan's calls (comm.bucket_calls, owner_reduce_calls) are
    DeepSpeed's, op and elements (a bucket's reduces in any order); its collectives name the op."""
    pytest.importorskip("deepspeed")
    from zplan import comm
    from zplan.strategies import effective

    calls = _deepspeed_calls(tmp_path, multi, world)
    psi = sum(o * i + o for i, o in LINEARS)
    grads = [(op, n) for op, n in calls if op in ("allreduce_", "reduce_") and n > 1]  # not the overflow flag
    assert sum(n for op, n in calls if op == "_allgather_base_") >= psi  # the updated weights
    sc = _zplan_scenario(world)
    buckets = [b // 4 for b in comm.bucket_calls(sc, "fp32", psi * 4, 3000 * 4, deepspeed=True)]
    if multi:
        assert grads == [("allreduce_", b) for b in buckets]
    else:
        owners = comm.owner_reduce_calls(buckets, world)
        assert {op for op, _ in grads} == {"reduce_"}
        assert sorted(n for _, n in grads) == sorted(b for bs in owners for b in bs)
        assert len(grads) == sum(map(len, owners)) and sum(n for _, n in grads) == psi
    colls = comm.collectives(replace(sc, train=sc.train.model_copy(update={"layout": "zero",
                                                                            "deepspeed_bucket_allreduce": multi})),
                             effective("zero2", "zero"))
    (g,) = [c for c in colls if "gradients" in c.name]
    assert g.op == ("all_reduce" if multi else "reduce") and psi <= g.elements < psi + world * len(LINEARS)
    assert math.isclose(sum(n for _, n in grads), psi)


def test_explain_splits_a_reduce_into_latency_and_its_whole_tensor():
    """explain's line for one call split a reduce's time as a reduce-scatter's ((n-1)/n of S on
    the wire), which left it 0.5 ms of "latency"; a reduce moves the whole S at the busbw."""
    from zplan import presets
    from zplan.explain import _nccl_call

    c = presets.cluster("dgx-h100")
    line = _nccl_call(c, "x", "reduce", 2 * 10**9, 16, 8)
    transfer = 2e9 / min(c.intra_node_busbw_bytes_per_s, 8 * c.inter_node_busbw_bytes_per_s)
    assert f"transfer {transfer * 1e3:.1f} ms" in line and "latency 0.0 ms" in line, line


def test_owner_reduces_cover_each_bucket_once_within_the_partitions():
    """Property: whatever the buckets and ranks, each bucket's reduces add up to the bucket, none
    is empty or wider than a partition, and together they are the parameters' elements (the
    review found sums lost and a slice for rank -1 when the arithmetic was in floats)."""
    from hypothesis import given, settings, strategies as hs

    from zplan.comm import owner_reduce_calls

    @settings(max_examples=300, deadline=None)
    @given(hs.lists(hs.integers(0, 10**6), min_size=1, max_size=40), hs.integers(1, 64))
    def check(buckets, n):
        out = owner_reduce_calls(buckets, n)
        total = sum(buckets)
        part = 2 * -(-total // (2 * n)) if total else 1
        assert [sum(bs) for bs in out] == buckets
        assert all(0 < x <= part for bs in out for x in bs)
        # a bucket meets at most one owner more than its width in partitions (it starts mid-partition)
        assert all(len(bs) <= -(-b // part) + 1 for b, bs in zip(buckets, out))

    check()


def test_per_owner_reduces_after_a_buckets_first_are_exposed():
    """DeepSpeed synchronises the device before every per-owner reduce under overlap_comm (its
    source is the oracle: allreduce_and_copy), so within a bucket each reduce after the first
    waits for the one before with nothing issued beside it: zplan's exposed floor for the
    reduction (last_bucket_s) is the final bucket's reduces and those, not the final bucket's
    alone; the all-reduce path (no synchronisation there) keeps the final bucket only."""
    deepspeed = pytest.importorskip("deepspeed")
    import inspect

    from deepspeed.runtime.zero import stage_1_and_2

    src = inspect.getsource(stage_1_and_2.DeepSpeedZeroOptimizer.allreduce_and_copy)
    assert "if self.overlap_comm:" in src and ".synchronize()" in src.split("if self.overlap_comm:")[1].split("else:")[0]
    assert "synchronize()" not in inspect.getsource(
        stage_1_and_2.DeepSpeedZeroOptimizer.allreduce_and_copy_with_multiple_ranks), deepspeed.__version__
    from zplan import comm

    sc = _zplan_scenario(3)
    psi = sum(o * i + o for i, o in LINEARS)
    buckets = [b // 4 for b in comm.bucket_calls(sc, "fp32", psi * 4, 3000 * 4, deepspeed=True)]
    per_bucket = [[e * 4 for e in bs] for bs in comm.owner_reduce_calls(buckets, 3)]
    waits = [b for bs in per_bucket[:-1] for b in bs[:-1]]
    assert waits  # some bucket meets two owners
    red = comm._owner_reduces(sc, psi, "fp32", 3, 3, 1, 3000 * 4)
    one = lambda b: comm.call_seconds(sc, "reduce", b, 3, 3)  # noqa: E731
    assert red.last_bucket_s == pytest.approx(sum(map(one, per_bucket[-1] + waits)), rel=1e-12)
    assert red.last_bucket_s > sum(map(one, per_bucket[-1]))
    assert red.seconds_per_call == pytest.approx(sum(one(b) for bs in per_bucket for b in bs), rel=1e-12)


@pytest.mark.slow  # a real two-rank run of zplan's trainer
@pytest.mark.timeout(300)
@pytest.mark.parametrize("bucket_mib", ["0", "0.25", "25"])
def test_a_real_ddp_run_issues_the_all_reduces_the_plan_prices(run_zplan, tmp_path, bucket_mib):
    """DDP only keeps a 1 MiB first bucket when bucket_cap_mb is left at its default
    (torch/nn/parallel/distributed.py); zplan's trainer passed the plan's 25 always (no 1 MiB
    bucket) and the planner priced one whatever the cap. A real 2-rank run of the trainer's
    DDP (gloo), its bucket all-reduces counted by a comm hook each step, is the oracle for the
    number of calls the plan prices."""
    from tests.test_trainer import launch, make_plan
    from zplan import comm
    from zplan.plan import load

    plan = tmp_path / "p.json"
    make_plan(run_zplan, plan, "ddp", 2, 4, "fp32", "--bucket-mib", bucket_mib)
    report, _ = launch(run_zplan, plan, tmp_path / "run", 3)
    measured = report["measured"]["per_collective"]["all_reduce"]["calls"]
    p = load(str(plan))
    sc = scenario(model="tiny", gpus=2, gpu="cpu", cluster="cpu-local", layout="torch", seq_len=p.train.seq_len,
                  bucket_mib=float(bucket_mib))
    cap = p.assumptions.ddp_bucket_bytes
    priced = comm.bucket_calls(sc, "fp32", sc.params * 4, cap, comm.ddp_first_bucket_bytes(cap))
    assert measured == len(priced), (measured, len(priced))
