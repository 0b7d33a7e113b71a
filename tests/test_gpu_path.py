"""The GPU path, caught on CPU where it can be, on a GPU where only a GPU can show it.

A GPU group made as `init_process_group("nccl")` maps only the cuda device type to a backend,
and the trainer does meet CPU tensors in collectives (the gradient norm under offload-all, whose
gradients are CPU DTensors; bookkeeping). On this CPU-only machine the same device scoping is
made with gloo standing in for NCCL ($ZPLAN_STAND_IN_NCCL=gloo): the group a GPU run would make,
and the same failure for a CPU collective when the group lacks a CPU backend.
"""

import json
import os
import sys
from pathlib import Path

import pytest
import torch

from zplan.trainer.distributed import STAND_IN_ENV, backend_for, stand_in_for_nccl

ROOT = Path(__file__).resolve().parent.parent


def test_backend_strings():
    assert backend_for("cpu") == "gloo"
    assert backend_for(torch.device("cuda", 3)) == "cpu:gloo,cuda:nccl"
    assert stand_in_for_nccl("nccl", "gloo") == "cuda:gloo"  # NCCL's scoping: cuda only
    assert stand_in_for_nccl(backend_for("cuda"), "gloo") == "cpu:gloo,cuda:gloo"
    with pytest.raises(ValueError, match="not mps"):
        backend_for("mps")


def _chain_by_definition(perm, noise, follow):
    """The chain as docs/trainer.md defines it, one token at a time (the oracle)."""
    out = [int(noise[0])]
    for t in range(1, len(noise)):
        out.append(int(perm[out[-1]]) if follow[t] else int(noise[t]))
    return out


@pytest.mark.parametrize("vocab,n", [(7, 1), (7, 2), (7, 300), (1000, 4097), (256, 65)])
def test_vectorised_chain_equals_its_definition(vocab, n):
    from zplan.trainer.data import markov_chain, permutation_powers

    g = torch.Generator().manual_seed(vocab * n)
    perm = torch.randperm(vocab, generator=g)
    noise = torch.randint(0, vocab, (n,), generator=g)
    for follow in (torch.rand(n, generator=g) < 0.9, torch.ones(n, dtype=torch.bool),
                   torch.zeros(n, dtype=torch.bool), torch.rand(n, generator=g) < 0.999):
        got = markov_chain(permutation_powers(perm, n), noise, follow).tolist()
        assert got == _chain_by_definition(perm.tolist(), noise.tolist(), follow.tolist())


def test_prefetched_batches_are_the_contract_batches():
    """Prefetching changes when a batch is made, never which: sample i of the run is a pure
    function of (seed, i), in any order of requests."""
    from zplan.trainer.data import FOLLOW, Prefetcher, TokenSource

    src = TokenSource(97, 16, seed=5)
    g = torch.Generator().manual_seed(5 * 1_000_003 + 13)  # sample 13, by the contract's seeding
    noise = torch.randint(0, 97, (17,), generator=g)
    follow = torch.rand(17, generator=g) < FOLLOW
    assert src.sample(13).tolist() == _chain_by_definition(src.perm.tolist(), noise.tolist(), follow.tolist())
    pre = Prefetcher(src, rank=1, world=2, global_batch=8, micro_batch=2, grad_accum=2,
                     device=torch.device("cpu"))
    try:
        for step, micro in [(0, 0), (0, 1), (1, 0), (1, 1), (3, 1), (2, 0)]:  # in order, then not
            x, y = pre.get(step, micro)
            first = step * 8 + 1 * 4 + micro * 2  # rank 1's half of the global batch
            want = torch.stack([src.sample(first), src.sample(first + 1)])
            assert torch.equal(x, want[:, :-1]) and torch.equal(y, want[:, 1:])
    finally:
        pre.close()



def test_prepared_batches_are_contiguous_before_pinning():
    """Inputs and targets are views of one (B, s + 1) tensor; pin_memory keeps strides, and a
    non-contiguous pinned source makes the host-to-GPU copy stage through a pageable tensor on
    the training thread (a blocking copy). The prefetch thread hands over contiguous tensors."""
    from zplan.trainer.data import Prefetcher, TokenSource

    src = TokenSource(97, 16, seed=5)
    raw_x, raw_y = src.batch(0, 0, 0, 1, 4, 2)
    assert not raw_x.is_contiguous() and not raw_y.is_contiguous()  # what the source gives
    pre = Prefetcher(src, rank=0, world=1, global_batch=4, micro_batch=2, grad_accum=2,
                     device=torch.device("cpu"))
    try:
        x, y = pre.get(0, 0)
        nx, ny = pre._next[1].result()  # micro-batch 1, prepared on the prefetch thread
        assert x.is_contiguous() and y.is_contiguous() and nx.is_contiguous() and ny.is_contiguous()
        assert torch.equal(x, raw_x) and torch.equal(y, raw_y)
    finally:
        pre.close()


def _rank(rank: int, world: int, port: int, plan: str, out: str, api_port: int) -> None:
    import torch.distributed as dist

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), CUDA_VISIBLE_DEVICES="",
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), ZPLAN_PLAN=plan)  # CPU ranks, GPU or not
    res = {}
    # 1. the group `init_process_group("nccl")` made, with gloo in NCCL's place: a CPU
    #    collective fails as it does under NCCL on a GPU (the bug of issue 9, Why 1)
    dist.init_process_group(stand_in_for_nccl("nccl", "gloo"))
    try:
        dist.all_reduce(torch.ones(1))
        res["nccl_scoped"] = "ran"
    except RuntimeError as e:
        res["nccl_scoped"] = str(e)
    dist.destroy_process_group()
    # 2. the user API's group for a GPU run (the stand-in makes it on any machine): the
    #    reductions the trainer runs on host tensors work
    os.environ[STAND_IN_ENV] = "gloo"
    os.environ["MASTER_PORT"] = str(api_port)  # a second free port: port + 1 may be taken
    from zplan.trainer import api

    ctx = api.init(ckpt_dir=os.path.dirname(out))
    from zplan.trainer.distributed import started_backend

    res["api_backend"] = started_backend()
    t = torch.tensor([rank + 1], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    res["host_max"] = int(t)
    ctx.close()
    if rank == 0:
        Path(out).write_text(json.dumps(res))


def _plan(run_zplan, path: Path, strategy: str, gpus: int = 2, context_gib: str = "0",
          fragmentation: str = "0") -> Path:
    p = run_zplan("recommend", "--model", "tiny", "--gpu", "cpu", "--cluster", "cpu-local",
                  "--gpus", str(gpus), "--global-batch", "4", "--seq-len", "64", "--layout", "torch",
                  "--context-gib", context_gib, "--fragmentation", fragmentation, "--strategy", strategy,
                  "--write", str(path), "--json")
    assert p.returncode == 0, p.stderr
    return path


def test_allocated_is_compared_with_tensor_bytes(run_zplan, tmp_path):
    """A plan's CUDA context and fragmentation allowance are not in what an allocator or the CPU
    tracker counts: the figure compared is that of the same plan made without them."""
    from zplan.plan import load
    from zplan.trainer.report import predicted_memory

    bare = load(_plan(run_zplan, tmp_path / "bare.json", "zero3"))
    full = load(_plan(run_zplan, tmp_path / "full.json", "zero3", context_gib="1", fragmentation="0.1"))
    want = bare.predicted.per_gpu["total_bytes"]
    assert full.predicted.per_gpu["total_bytes"] > want + 2**30
    for device in ("cpu", "cuda"):
        assert predicted_memory(full, device)["allocated"] == want
    # reserved (max_memory_reserved) has no CUDA context: with --fragmentation 0.1, 1.1 x allocated
    per = full.predicted.per_gpu
    assert predicted_memory(full, "cuda")["reserved"] == per["reserved_bytes"] == int(want * 1.1)
    assert per["total_bytes"] == per["reserved_bytes"] + 2**30


def test_rate_above_the_preset_peak_is_flagged(run_zplan, tmp_path):
    import tomllib

    from zplan.plan import load
    from zplan.trainer.report import rate_warnings

    plan = load(_plan(run_zplan, tmp_path / "p.json", "zero3"))
    dtype = plan.train.precision.param
    peak = tomllib.loads((ROOT / "presets" / "gpus" / "cpu.toml").read_text())["peak_flops"][dtype]
    assert rate_warnings(plan, 0.99 * peak) == [] and rate_warnings(plan, None) == []
    (w,) = rate_warnings(plan, 1.01 * peak)
    assert "exceeds the 'cpu' preset" in w and f"{peak / 1e12:.3g} TFLOP/s" in w


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_nccl_scoping_on_cpu_and_the_api_group(run_zplan, tmp_path):
    import torch.multiprocessing as mp

    from zplan.netutil import free_port

    plan = _plan(run_zplan, tmp_path / "plan.json", "zero3")
    out = tmp_path / "res.json"
    for attempt in range(3):  # a free port can be taken before the rendezvous binds it (another
        # test's processes, or the same port handed out twice): only that is retried
        port = free_port()
        api_port = free_port()
        while api_port == port:
            api_port = free_port()
        try:
            mp.start_processes(_rank, args=(2, port, str(plan), str(out), api_port), nprocs=2, join=True,
                               start_method="spawn")
            break
        except mp.ProcessRaisedException as e:
            if "EADDRINUSE" not in str(e) or attempt == 2:
                raise
    res = json.loads(out.read_text())
    assert "No backend type associated with device type cpu" in res["nccl_scoped"]
    assert res["api_backend"] == "cpu:gloo,cuda:gloo"
    assert res["host_max"] == 2


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_trainer_runs_in_the_group_a_gpu_run_makes(run_zplan, tmp_path):
    """offload-all (host gradients: the clip norm reduces CPU DTensors), the peak-memory and
    loss reductions, the traffic counter, all in the group a GPU run makes; and the step line
    that a run without a terminal prints."""
    plan = _plan(run_zplan, tmp_path / "plan.json", "offload-all")
    run = tmp_path / "run"
    p = run_zplan("launch", "--plan", str(plan), "--run-dir", str(run), "--steps", "6",
                  env={STAND_IN_ENV: "gloo", "CUDA_VISIBLE_DEVICES": ""}, timeout=200)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    rep = json.loads((run / "run_report.json").read_text())
    assert rep["backend"] == "cpu:gloo,cuda:gloo"
    assert len(rep["losses"]) == 6 and all(x == x for x in rep["losses"])  # no NaN
    assert rep["measured"]["peak_memory_bytes"] > 0
    assert rep["measured"]["elements_per_step"] == rep["predicted"]["elements_per_step"]
    steps = [ln for ln in p.stdout.splitlines() if ln.startswith("zplan: step 6/6 loss")]
    assert steps and "tokens/s" in steps[0] and "MFU" in steps[0], p.stdout


def test_gpu_check_script_parses_and_refuses_bad_options():
    import subprocess

    script = ROOT / "benchmarks" / "gpu_check.sh"
    assert subprocess.run(["bash", "-n", str(script)]).returncode == 0
    p = subprocess.run(["bash", str(script), "--bogus"], capture_output=True, text=True, timeout=30)
    assert p.returncode == 2 and "--bogus" in p.stderr
    head = subprocess.run(["bash", str(script), "--help"], capture_output=True, text=True, timeout=30).stdout
    assert "NEEDS" in head and "--fetch" in head and "--cpu-dry" in head


def test_the_run_report_measures_the_context_the_plan_assumes(monkeypatch):
    """The plan's fit rests on cuda_context_bytes, memory outside the caching allocator (the
    context, NCCL's buffers): a GPU run measures it as the device's used memory less the
    allocator's segments, and the report sets it beside the assumption."""
    import torch

    from zplan.trainer import measure
    from zplan.trainer.report import compare_lines

    MiB = 2**20
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda d=None: (60_000 * MiB, 80_000 * MiB))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda d=None: 19_300 * MiB)
    assert measure.outside_allocator_bytes(torch.device("cuda", 0)) == 700 * MiB  # 80000 - 60000 - 19300
    report = {"device": "cuda", "strategy": "zero3",
              "measured": {"peak_memory_bytes": 10 * MiB, "outside_allocator_bytes": 700 * MiB},
              "predicted": {"peak_memory_bytes": 10 * MiB, "outside_allocator_bytes": 600 * MiB}}
    row = next(ln for ln in compare_lines(report) if ln.startswith("context, outside alloc."))
    assert "600.0 MiB" in row and "700.0 MiB" in row and "-14.3%" in row  # (600 - 700) / 700
    # the trainer's report puts the measured figure beside the plan's own assumption (a GPU run)
    from types import SimpleNamespace

    from tests.test_contract import plan_for
    from zplan.trainer.report import build_report

    plan = plan_for("zero3")
    tr = SimpleNamespace(plan=plan, device=torch.device("cuda", 0), counter=None, memory_by_category=None,
                         world=2, backend="nccl", step=3, cfg=SimpleNamespace())
    monkeypatch.setattr("zplan.trainer.report.asdict", lambda cfg: {})
    rep = build_report(tr, 0, [1.0], [], [0.1], {"allocated": 1, "reserved": 2, "outside": 700 * MiB}, 1)
    assert rep["measured"]["outside_allocator_bytes"] == 700 * MiB
    assert rep["predicted"]["outside_allocator_bytes"] == plan.assumptions.cuda_context_bytes


def test_gpu_check_summary(tmp_path):
    """The report's errors and checks, from a results folder laid out as the script leaves it."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("summarize", ROOT / "benchmarks" / "gpu_check" / "summarize.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    (tmp_path / "run").mkdir()
    (tmp_path / "steps.tsv").write_text("env\t0\t1\ntrain\t0\t50\nresume\t0\t30\n")
    pred = {"peak_memory_bytes": 1000 * 2**20, "peak_reserved_bytes": 1200 * 2**20,
            "peak_reserved_basis": "total_bytes (context included)", "step_s": 0.2,
            "tokens_per_s_per_gpu": 80000.0, "mfu": 0.5, "bytes_per_step": 10}
    meas = {"peak_memory_bytes": 1100 * 2**20, "peak_reserved_bytes": 1150 * 2**20, "step_s": 0.25,
            "tokens_per_s_per_gpu": 64000.0, "mfu": 0.4, "bytes_per_step": 10}
    report = {"strategy": "zero3", "world_size": 1, "device": "cuda", "model": "m", "backend": "b",
              "start_step": 12, "end_step": 20, "losses": [5.0, 4.0], "measured": meas, "predicted": pred}
    (tmp_path / "run" / "run_report.json").write_text(json.dumps(report))
    (tmp_path / "first.json").write_text(json.dumps(dict(report, start_step=0, end_step=12)))
    (tmp_path / "resumed.json").write_text(json.dumps(dict(report, start_step=12, end_step=24)))
    estimate = {"strategies": [{"per_gpu": {"total_bytes": 950 * 2**20, "overhead_bytes": 50 * 2**20},
                                "time": {"step_s": 0.3, "tokens_per_s_per_gpu": 1.0, "mfu": 0.1},
                                "comm": {"bytes_per_step": 10}}]}  # zplan estimate --json's shape
    (tmp_path / "estimate-calibrated.json").write_text(json.dumps(estimate))
    assert mod.main([str(tmp_path)]) == 0
    text = (tmp_path / "report.txt").read_text()
    alloc = next(ln for ln in text.splitlines() if ln.startswith("peak allocated"))
    assert "-9.1%" in alloc and "-18.2%" in alloc  # (1000 - 1100) / 1100, (900 - 1100) / 1100
    step = next(ln for ln in text.splitlines() if ln.startswith("step time"))
    assert "-20.0%" in step and "+20.0%" in step  # (0.2 - 0.25) / 0.25, (0.3 - 0.25) / 0.25
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["passed"] and summary["checks"]["resumed from the checkpoint"]
    (tmp_path / "steps.tsv").write_text("env\t0\t1\ntrain\t124\t200\n")  # a step timed out
    (tmp_path / "first.json").write_text(json.dumps(dict(report, end_step=11)))  # resumed elsewhere
    assert mod.main([str(tmp_path)]) == 1
    failed = json.loads((tmp_path / "summary.json").read_text())["checks"]
    assert failed["train"] is False and failed["resumed from the checkpoint"] is False


def test_offload_all_ranks_share_the_node_cpus():
    """The planner prices offload-all's host optimizer step at the node's CPU throughput shared
    by its ranks; torchrun's OMP_NUM_THREADS=1 would leave each GPU rank one core."""
    from zplan.trainer.run_setup import host_threads

    assert host_threads("offload-all", True, 8, 112, "1") == 14
    assert host_threads("offload-all", True, 8, 112, None) == 14
    assert host_threads("offload-all", True, 3, 16, "") == 5
    assert host_threads("offload-all", True, 8, 4, "1") == 1  # never 0
    assert host_threads("offload-all", True, 8, 112, "6") is None  # the user's own choice stays
    assert host_threads("offload-all", False, 2, 16, "1") is None  # CPU ranks: one thread each
    assert host_threads("zero3", True, 8, 112, "1") is None  # the host does no optimizer work


def test_more_ranks_than_gpus_is_one_line(monkeypatch):
    """LOCAL_RANK beyond the node's GPUs: a usage error naming the fix, not 'invalid device
    ordinal' (the GPU count is faked: this machine has none)."""
    from zplan.errors import UsageError
    from zplan.trainer.run_setup import set_local_device

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.setenv("LOCAL_RANK", "5")
    with pytest.raises(UsageError, match="LOCAL_RANK is 5 but its node shows 4 GPU"):
        set_local_device()


def test_calibrate_keeps_an_nvls_all_reduce_apart_from_the_ring():
    """On 8 H100 nccl-tests measure all-reduce at 479 GB/s busbw (NVLS) and all-gather and
    reduce-scatter at ~360 (the ring): calibrate's link figure, the median of the three, is the
    ring's, so the all-reduce is written on its own, with the GPU count it was measured over,
    and a preset built from it prices an 8-GPU all-reduce at it and a 2-GPU one on the ring."""
    from zplan import calibrate, presets
    from zplan.nccl import collective_time
    from zplan.specs import ClusterSpec

    G = 2**30
    busbw = {"all_gather": {G: 361e9}, "reduce_scatter": {G: 355e9}, "all_reduce": {G: 479e9}}
    bw, _, _ = calibrate.fit_link({op: {G: G / v} for op, v in
                                   {"all_gather": 361e9 * 8 / 7, "reduce_scatter": 355e9 * 8 / 7,
                                    "all_reduce": 479e9 * 8 / 14}.items()}, 8)
    assert bw == pytest.approx(361e9)  # the median: the ring's figure
    fields = calibrate.nvls_fields(busbw, bw, 8)
    assert fields == {"intra_node_allreduce_busbw_bytes_per_s": 479e9, "intra_node_allreduce_gpus": 8}
    c = ClusterSpec(name="m", gpus_per_node=8, intra_node_busbw_bytes_per_s=bw, inter_node_busbw_bytes_per_s=bw / 10,
                    intra_node_latency_s=0.0, inter_node_latency_s=0.0, host_ram_bytes=2**40, source="test", **fields)
    assert collective_time(c, "all_reduce", 8 * G, 8, 8).algorithm == "nvls"
    assert collective_time(c, "all_reduce", 8 * G, 2, 8).algorithm == "ring"
    ring_only = {**busbw, "all_reduce": {G: 362e9}}  # PCIe, gloo, or NVLS off: nothing apart
    assert calibrate.nvls_fields(ring_only, bw, 8) == {} and calibrate.nvls_fields(busbw, bw, 2) == {}
    # the largest message decides (a small one is latency-bound), and only beyond 5% of the ring
    sizes = {"all_reduce": {2**20: 150e9, G: 479e9}}
    assert calibrate.nvls_fields(sizes, bw, 8)["intra_node_allreduce_busbw_bytes_per_s"] == 479e9
    assert calibrate.nvls_fields({"all_reduce": {G: 1.04 * bw}}, bw, 8) == {}
    assert calibrate.nvls_fields({"all_reduce": {G: 1.06 * bw}}, bw, 8) != {}


def test_calibrate_refuses_more_nccl_ranks_than_gpus(monkeypatch):
    """calibrate's NCCL ranks each take GPU `rank`: more ranks than GPUs is one line before any
    process starts, not a CUDA error inside a spawned child (the GPU count is faked)."""
    from zplan import calibrate
    from zplan.errors import UsageError

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr("torch.multiprocessing.start_processes",
                        lambda *a, **k: pytest.fail("no rank may start"))
    with pytest.raises(UsageError, match="--ranks 4: this machine shows 2 GPU"):
        calibrate.collective_times(4, [1 << 20], backend="nccl")


def test_calibrated_cpu_adamw_uses_the_trainers_kernel_on_the_given_threads(monkeypatch):
    """The offload figure is measured with the fused AdamW the trainer builds, on the threads
    asked for (the node's CPUs), and leaves this process's thread count as it found it."""
    from zplan import calibrate

    seen = {}
    real = torch.optim.AdamW

    def spy(params, **kw):
        seen["kw"], seen["threads"] = kw, torch.get_num_threads()
        return real(params, **kw)

    monkeypatch.setattr(torch.optim, "AdamW", spy)
    before = torch.get_num_threads()
    rate = calibrate.adamw_params_per_s(n=50_000, reps=1, threads=before + 1)
    assert rate > 0 and seen["kw"].get("fused") is True and seen["threads"] == before + 1
    assert torch.get_num_threads() == before


def test_calibrated_matmul_sizes_stop_once_a_product_is_long_enough(monkeypatch):
    """Sizes grow until one product takes longer than the budget, then stop: a CPU without bf16
    matrix units runs a bf16 2048-cube product for about a minute. The clock is faked: each
    product takes n/1000 s, so with a 0.3 s budget 256 is timed, 512 stops the growth."""
    from zplan import calibrate

    clock = {"t": 0.0}
    calls = []

    class Tensor:
        def __init__(self, n):
            self.n = n

        def __matmul__(self, other):
            calls.append(self.n)
            clock["t"] += self.n / 1000

    monkeypatch.setattr(calibrate.time, "perf_counter", lambda: clock["t"])
    monkeypatch.setattr(torch, "randn", lambda n, m, **kw: Tensor(n))
    monkeypatch.setattr(torch, "ones", lambda n, m, **kw: Tensor(n))
    out = calibrate.matmul_flops(torch.device("cpu"), sizes=(256, 512, 1024), reps=3, budget_s=0.3)
    for dtype in ("fp32", "bf16"):
        assert list(out[dtype]) == [256, 512]
        assert out[dtype][256] == pytest.approx(2 * 256**3 / 0.256)
        assert out[dtype][512] == pytest.approx(2 * 512**3 / 0.512)  # the probe itself, once
    # per dtype: a 64 warm-up, 256 probed + warmed + once more to size a batch + 3 reps (a batch
    # of one: 0.256 s is past the 20 ms batch), 512 probed only
    assert calls == [64] + [256] * 6 + [512] + [64] + [256] * 6 + [512]


def test_calibrate_times_short_kernels_without_the_synchronisation():
    """A GPU synchronisation costs tens of microseconds, more than a short kernel: timed one call
    per sync, a 5 us kernel read as 35 us (calibrate's attention rate at s=512 came out a sixth of
    the truth). The clock is faked: a call costs 5 us, a device sync 30 us; the time per call must
    be the kernel's, within 2%."""
    from types import SimpleNamespace

    from zplan import calibrate

    clock = {"t": 0.0}

    def kernel():
        clock["t"] += 5e-6

    def sync(device):
        clock["t"] += 30e-6

    mp = pytest.MonkeyPatch()
    mp.setattr(calibrate.time, "perf_counter", lambda: clock["t"])
    mp.setattr(calibrate, "_sync", sync)
    try:
        t = calibrate._timeit(kernel, SimpleNamespace(type="cuda"), reps=3)
    finally:
        mp.undo()
    assert t == pytest.approx(5e-6, rel=0.02)


def test_offload_all_materialises_buffers_on_the_compute_device():
    """A model built on the meta device gets its storage after fully_shard, which moved nothing
    meta: under offload-all the parameters go to the host (CPUOffloadPolicy keeps the shards
    there), its buffers to the GPU beside the inputs; otherwise both to the GPU. Fake CUDA
    tensors stand in for the GPU this machine lacks."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from zplan.trainer.parallel import materialise

    class WithTable(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(8, 8)
            self.register_buffer("freqs", torch.empty(8), persistent=False)
            self.register_buffer("step", torch.empty(1))

    cuda = torch.device("cuda", 0)
    for host in (True, False):
        with torch.device("meta"):
            m = WithTable()
        with FakeTensorMode(allow_non_fake_inputs=True):
            materialise(m, host, cuda)
            assert [b.device for b in m.buffers()] == [cuda, cuda], host
            assert {p.device for p in m.parameters()} == {torch.device("cpu") if host else cuda}, host
        assert "step" in m.state_dict() and "freqs" not in m.state_dict()  # persistence kept


def test_the_group_waits_as_long_as_said(monkeypatch, capsys, tmp_path):
    """The group's collective timeout is given, not left to torch's default, which depends on
    the backend string (10 minutes for a bare "nccl", 30 for the mixed group zplan makes);
    $ZPLAN_COLLECTIVE_TIMEOUT_S sets it, and a bad value is one line naming it."""
    from datetime import timedelta

    import torch.distributed as dist

    from tests.helpers import cli
    from zplan.errors import UsageError
    from zplan.trainer import distributed as zd

    seen = {}
    monkeypatch.setattr(dist, "init_process_group", lambda backend, **kw: seen.update(backend=backend, **kw))
    monkeypatch.delenv(STAND_IN_ENV, raising=False)
    monkeypatch.delenv(zd.TIMEOUT_ENV, raising=False)
    started = list(zd._started)
    try:
        zd.init_process_group_for("cuda")
        assert seen == {"backend": "cpu:gloo,cuda:nccl", "timeout": timedelta(minutes=30)}
        monkeypatch.setenv(zd.TIMEOUT_ENV, "600")
        zd.init_process_group_for("cpu", world_size=2)
        assert seen["timeout"] == timedelta(minutes=10) and seen["world_size"] == 2
        zd.init_process_group_for("cpu", timeout=timedelta(seconds=5))  # a caller's own wins
        assert seen["timeout"] == timedelta(seconds=5)
        for bad in ("ten", "0", "-5", "inf", "nan", "1e-9", "1e15"):  # 1e15 s overflows torch's C int
            monkeypatch.setenv(zd.TIMEOUT_ENV, bad)
            with pytest.raises(UsageError, match=f"ZPLAN_COLLECTIVE_TIMEOUT_S='{bad}' is not a number"):
                zd.init_process_group_for("cuda")
        monkeypatch.setenv(zd.TIMEOUT_ENV, "ten")  # the CLI checks it before calibrate spawns ranks
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        p = cli(capsys, "calibrate", "--output", str(tmp_path), "--ranks", "2")
        assert p.returncode == 2 and "ZPLAN_COLLECTIVE_TIMEOUT_S='ten'" in p.stderr, p.stderr
    finally:
        zd._started[:] = started


def test_calibrated_gemms_are_timed_in_batches_not_per_sync(monkeypatch):
    """A sync every few GEMMs leaves the device idle after each batch, which a 14 us GEMM counts
    in full (and the fit of gemm_fixed_s then takes as the GEMM's own). The clock is faked: a
    GEMM takes 5 us, a device sync 30 us; the time per GEMM must be the GEMM's, within 2%."""
    from types import SimpleNamespace

    from zplan import calibrate

    clock = {"t": 0.0}

    class Operand:
        def __matmul__(self, other):
            clock["t"] += 5e-6

    monkeypatch.setattr(calibrate.time, "perf_counter", lambda: clock["t"])
    monkeypatch.setattr(calibrate, "_sync", lambda d: clock.__setitem__("t", clock["t"] + 30e-6))
    monkeypatch.setattr(torch, "randn", lambda *a, **k: Operand())
    t = calibrate._gemm_seconds(SimpleNamespace(type="cuda"), 2048, 4096, 256, 0.1)
    assert t == pytest.approx(5e-6, rel=0.02)


def test_calibrated_attention_runs_sdpas_flash_kernel(monkeypatch):
    """The presets' attention constants are FlashAttention-2's as SDPA runs it; SDPA may pick
    cuDNN's attention on Hopper, so on a GPU calibrate holds SDPA to its flash backend. The
    context is checked for what it enables (torch.backends flags: no GPU needed), and every
    timed call is made inside it."""
    import torch.nn.functional as F

    from zplan import calibrate

    with calibrate._flash_backend(torch.device("cuda", 0)):
        assert torch.backends.cuda.flash_sdp_enabled()
        assert not (torch.backends.cuda.cudnn_sdp_enabled() or torch.backends.cuda.mem_efficient_sdp_enabled()
                    or torch.backends.cuda.math_sdp_enabled())
    assert torch.backends.cuda.math_sdp_enabled()  # restored
    inside = {"now": False, "calls": []}
    real_sdpa = F.scaled_dot_product_attention

    class Held:
        def __enter__(self):
            inside["now"] = True

        def __exit__(self, *exc):
            inside["now"] = False

    monkeypatch.setattr(calibrate, "_flash_backend", lambda device: Held())
    monkeypatch.setattr(F, "scaled_dot_product_attention",
                        lambda *a, **k: inside["calls"].append(inside["now"]) or real_sdpa(*a, **k))
    calibrate.attention_rates(torch.device("cpu"), seq=64, heads=2, head_dim=16, reps=1)
    assert inside["calls"] and all(inside["calls"])


@pytest.mark.parametrize("half", [0.0, 300.0, 2000.0])
def test_calibrated_attention_ramp_reproduces_both_measurements(half):
    """calibrate measures SDPA at s=512 and 4096 and writes the long-sequence rate and the ramp's
    half length; the planner's attention op (kernels.attention), given them, must give back both
    measured rates (storing the s=4096 rate as the long-sequence one made s=4096 6% slow)."""
    from zplan import calibrate, kernels, presets

    limit = 600e12
    rate = {s: limit * s / (s + half) for s in (512, 4096)}  # what the GPU measured
    got_half, got_limit = calibrate.seq_half(512, rate[512], 4096, rate[4096])
    gpu = presets.gpu("h200")
    gpu = gpu.model_copy(update={"kernels": gpu.kernels.model_copy(update={
        "attention_forward_flops": got_limit, "attention_half_seq": got_half})})
    for s, measured in rate.items():
        op = kernels.attention(gpu, s, 2048, 8 * s, backward=False)
        assert op.flop / op.seconds == pytest.approx(measured, rel=1e-9)
    # s=512 timed far too slow (its launch, not its kernel): the long rate is held to the GEMM
    # rate given as the cap, and s=4096's measured rate is still what the planner gives back
    got_half, got_limit = calibrate.seq_half(512, 20e12, 4096, 500e12, cap=700e12)
    assert got_limit == 700e12
    gpu = gpu.model_copy(update={"kernels": gpu.kernels.model_copy(update={
        "attention_forward_flops": got_limit, "attention_half_seq": got_half})})
    op = kernels.attention(gpu, 4096, 2048, 8 * 4096, backward=False)
    assert op.flop / op.seconds == pytest.approx(500e12, rel=1e-9)


def test_calibrated_attention_backward_and_the_fallback_kernel(monkeypatch):
    """The backward rate is measured at s=4096 only; written at the long-sequence limit of the
    forward's ramp, the planner's backward op gives the measured one back. Where SDPA has no
    flash kernel for the GPU, the kernel it picks is timed and the source says so."""
    from zplan import calibrate, kernels, presets

    R, Rb, h = 600e12, 450e12, 400.0
    asked = []

    def rates(device, seq=4096, heads=16, head_dim=128, reps=10, batch=1, flash=True):
        asked.append(flash)
        if flash and device == "no-flash":
            raise RuntimeError("No available kernel. Aborting execution.")
        return R * seq / (seq + h), Rb * seq / (seq + h)

    monkeypatch.setattr(calibrate, "attention_rates", rates)
    fwd, bwd, half, note = calibrate.attention_constants("gpu", cap=800e12)
    assert (fwd, bwd, half, note) == (pytest.approx(R), pytest.approx(Rb), pytest.approx(h), "")
    gpu = presets.gpu("h200")
    gpu = gpu.model_copy(update={"kernels": gpu.kernels.model_copy(update={
        "attention_forward_flops": fwd, "attention_backward_flops": bwd, "attention_half_seq": half})})
    op = kernels.attention(gpu, 4096, 2048, 4096, backward=True)
    assert op.flop / op.seconds == pytest.approx(Rb * 4096 / (4096 + h), rel=1e-9)
    asked.clear()
    *_, note = calibrate.attention_constants("no-flash", cap=800e12)
    assert asked == [True, False, False] and "no FlashAttention kernel" in note


def _calibrated_h200(tmp_path, spread=None, part="h200", memory_bytes=150754820096):
    """A preset as calibrate writes it on an H200 (its measured figures made up; the identity and
    the float8 rate as calibrate adds them), loaded back as the planner loads it; `part`: the
    preset calibrate found for the device's name (None: one no preset describes, a GH200)."""
    from zplan import calibrate

    kernels = {"gemm_flops": {"bf16": 7.6e14}, "sm_count": 132, "attention_forward_flops": 5.9e14,
               "attention_backward_flops": 4.4e14, "attention_half_seq": 300.0,
               "hbm_achieved_bytes_per_s": 4.2e12, "kernel_floor_s": 4e-6, "nccl_sm_fraction": 0.121,
               "source": "made up"}
    gpu = {"name": "measured", "memory_bytes": memory_bytes, "peak_flops": {"fp32": 5.0e13, "bf16": 7.6e14},
           "hbm_bytes_per_s": 4.2e12, "host_link_bytes_per_s": 5.0e10, "measured": True, "source": "made up",
           "kernels": kernels}
    calibrate.record_spread(kernels, spread, 8)
    calibrate.keep_identity(gpu, part)
    cluster = {"name": "measured", "gpu": "measured", "gpus_per_node": 8,
               "intra_node_busbw_bytes_per_s": 3.6e11, "inter_node_busbw_bytes_per_s": 3.6e10,
               "intra_node_latency_s": 2e-5, "inter_node_latency_s": 8e-5, "host_ram_bytes": 2**40,
               "source": "made up"}
    calibrate.write_presets(tmp_path, "measured", gpu, cluster)
    return gpu


def test_a_calibrated_preset_stays_the_gpu_it_was_measured_on(tmp_path, monkeypatch, run_zplan):
    """A preset calibrate wrote on an H200 keeps its identity: FlashAttention-3 and float8 plan
    on it (float8 at the h200 preset's achieved fp8 GEMM rate, which calibrate does not measure),
    and its plans pass the trainer's GPU check on an H200 (the device name is faked)."""
    from types import SimpleNamespace

    from zplan import presets
    from zplan.plan import load
    from zplan.trainer.plan_check import check_plan

    gpu = _calibrated_h200(tmp_path)
    assert gpu["peak_flops"]["fp8"] == presets.gpu("h200").kernels.gemm_flops["fp8"]
    flags = ("--presets", str(tmp_path), "--gpu", "measured", "--cluster", "measured", "--model",
             "llama-3.2-1b", "--gpus", "1", "--layout", "torch", "--strategy", "zero3")
    for extra in (["--float8"], ["--attention-kernel", "flash3"], ["--attention-kernel", "flex"]):
        p = run_zplan("estimate", *flags, *extra)
        assert p.returncode == 0, (extra, p.stderr)
    p = run_zplan("recommend", *flags, "--write", str(tmp_path / "plan.json"))
    assert p.returncode == 0, p.stderr
    plan = load(str(tmp_path / "plan.json"))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA H200")
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda *a: SimpleNamespace(total_memory=presets.gpu("h200").memory_bytes))
    assert check_plan(plan, 1, True, builtin_model=True) is None
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA A100-SXM4-80GB")
    assert "the plan is for measured" in check_plan(plan, 1, True, builtin_model=True)


def test_a_gpu_with_less_memory_than_the_plan_counts_is_refused(tmp_path, monkeypatch, run_zplan):
    """The trainer's GPU check holds the device's own memory (CUDA's totalGlobalMem) against the
    plan's GPU: an H200 plan on a part of that name with 96 GB is refused in one line, before a
    step runs out of memory; CUDA's figure a little under the preset's (another driver's) passes. The
    device's name and properties are faked (no GPU here)."""
    from types import SimpleNamespace

    from zplan import presets
    from zplan.plan import load
    from zplan.trainer.plan_check import check_plan

    p = run_zplan("recommend", "--gpu", "h200", "--model", "llama-3.2-1b", "--gpus", "1", "--layout",
                  "torch", "--strategy", "zero3", "--write", str(tmp_path / "plan.json"))
    assert p.returncode == 0, p.stderr
    plan = load(str(tmp_path / "plan.json"))
    preset = presets.gpu("h200").memory_bytes
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA H200")
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    for have, ok in ((preset - 640 * 2**20, True), (preset + 2**30, True), (96 * 10**9, False)):
        monkeypatch.setattr(torch.cuda, "get_device_properties", lambda *a, m=have: SimpleNamespace(total_memory=m))
        why = check_plan(plan, 1, True, builtin_model=True)
        assert (why is None) == ok, why
        if not ok:
            assert f"{preset / 2**30:.1f} GiB" in why and "89.4 GiB" in why and "\n" not in why
    monkeypatch.setenv("ZPLAN_ALLOW_GPU_MISMATCH", "1")
    assert check_plan(plan, 1, True, builtin_model=True) is None


def test_only_a_measured_preset_names_a_base():
    """`base` says which part a measured preset was measured on; on a datasheet preset it would
    silently change the part's family (FlashAttention-3, the GPU check): refused."""
    from zplan import presets
    from zplan.validated import ValidationError

    h100 = presets.gpu("h100-sxm").model_dump()
    with pytest.raises(ValidationError, match="it needs measured = true"):
        type(presets.gpu("h100-sxm")).model_validate(dict(h100, base="h200"))
    assert type(presets.gpu("h100-sxm")).model_validate(dict(h100, base="h200", measured=True)).family == "h200"


def test_a_noisy_gpu_speed_spread_is_not_written(tmp_path):
    """A spread above the preset's 10% bound (a throttled or shared GPU) is said in the source,
    not written: the preset still loads."""
    from zplan import presets

    _calibrated_h200(tmp_path, spread=0.23)
    g = presets.gpu(str(tmp_path / "gpus" / "measured.toml"))
    assert g.kernels.rank_speed_spread is None and "23.0% over 8 GPUs" in g.kernels.source
    _calibrated_h200(tmp_path / "b", spread=0.02)  # a folder of its own: presets are cached by path
    assert presets.gpu(str(tmp_path / "b" / "gpus" / "measured.toml")).kernels.rank_speed_spread == 0.02


def test_gpu_check_fits_one_device_command():
    """The device tool runs a command for at most 600 s: every step at its limit, with timeout's
    kill grace, must end inside it; and a CUDA test's own timeout marker (which pytest-timeout
    puts before the command line's) no longer than the script's --timeout for those tests."""
    import re

    script = (ROOT / "benchmarks" / "gpu_check.sh").read_text()
    limits = [int(x) for x in re.findall(r"^\s*step [\w-]+ (\d+) ", script, re.M)]
    grace = int(re.search(r"--kill-after=(\d+)", script).group(1))
    assert len(limits) == 10 and sum(limits) + grace * len(limits) <= 540, (limits, grace)
    per_test = int(re.search(r"--timeout (\d+) tests/test_gpu_cuda.py", script).group(1))
    marks = [int(m) for m in re.findall(r"@pytest\.mark\.timeout\((\d+)\)",
                                        (ROOT / "tests" / "test_gpu_cuda.py").read_text())]
    assert marks and max(marks) <= per_test


@pytest.mark.parametrize("gpu", ["h100-sxm", "a100-80gb", "h200"])
def test_gpu_check_plan_leaves_room_for_a_miss(run_zplan, tmp_path, gpu):
    """The GPU check trains the plan recommend writes from its PLAN flags: on an 80 GB GPU the
    fullest plan (micro-batch 8, 87% of the H100) would die of an under-prediction inside the
    planner's own 90% band and lose the check's comparison; the plan keeps a fifth free."""
    import json
    import re
    import shlex

    script = (ROOT / "benchmarks" / "gpu_check.sh").read_text()
    body = re.search(r"^  PLAN=\((.*?)\)$", script.split("else\n", 1)[1], re.S | re.M).group(1)
    flags = shlex.split(body.replace("\n", " "))
    flags[flags.index("--gpu") + 1] = gpu
    out = tmp_path / "plan.json"
    r = run_zplan("recommend", *flags, "--layout", "torch", "--strategy", "zero3", "--top", "1",
                  "--write", str(out))
    assert r.returncode == 0, r.stderr
    plan = json.loads(out.read_text())
    total, memory = plan["predicted"]["per_gpu"]["total_bytes"], plan["gpu"]["memory_bytes"]
    assert total <= 0.8 * memory, (total / memory, plan["train"]["micro_batch"])


@pytest.mark.slow  # about a minute: every step of the GPU check on CPU ranks
def test_gpu_check_rehearsal_leaves_its_results_where_the_device_tool_takes_them(tmp_path):
    """`gpu_check.sh --cpu-dry` (the same steps on 2 CPU ranks and the tiny model) passes its
    checks, the resume among them, and leaves in $OUT at most the 8 files the device tool
    returns: the report, the summary, the steps and one archive of every result."""
    import subprocess
    import tarfile

    out = tmp_path / "out"
    env = {**os.environ, "OUT": str(out), "PYTHON": sys.executable, "GPU_CHECK_RESULTS": str(tmp_path / "res")}
    p = subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu_check.sh"), "--cpu-dry"], env=env,
                       capture_output=True, text=True, timeout=540)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-2000:]
    files = sorted(f.name for f in out.iterdir())
    assert files == ["gpu_check.tar.gz", "report.txt", "steps.tsv", "summary.json"]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["passed"] and summary["checks"]["resumed from the checkpoint"]
    with tarfile.open(out / "gpu_check.tar.gz") as t:
        names = t.getnames()
    assert "./calibrate.json" in names and "./run/run_report.json" in names
    assert not any("/step_" in n for n in names)  # checkpoints are not results


def test_every_gpu_with_a_cluster_preset_has_its_stock_node():
    """A one-GPU calibration (and --gpu alone) takes its links from the GPU preset's own node
    (GPUSpec.cluster): each GPU some cluster preset is for names one, and it is a cluster for that
    GPU, so a cluster preset added later (a cloud's network) cannot silently become a GPU's
    default; aws-p5's H100 keeps dgx-h100."""
    from zplan import presets

    gpus = {presets.cluster(n).gpu for n in presets.names("clusters")}
    assert all(presets.cluster(presets.gpu(g).cluster).gpu == g for g in gpus)
    assert presets.gpu("h100-sxm").cluster == "dgx-h100"


def test_one_gpus_calibrated_cluster_takes_its_nodes_links_from_the_stock_preset(tmp_path):
    """With one GPU calibrate measures no collective: the written cluster preset takes the stock
    cluster's links for the base GPU (hgx-h200 for an H200), not the GPU's copy rate as a link,
    keeps this machine's one GPU a node, and says so; the file loads back with them."""
    from zplan import calibrate, presets

    cluster = {"name": "measured", "gpu": "measured", "gpus_per_node": 1,
               "intra_node_busbw_bytes_per_s": 4.2e12, "inter_node_busbw_bytes_per_s": 4.2e11,
               "intra_node_latency_s": 0.0, "inter_node_latency_s": 0.0, "link": "nvlink",
               "host_ram_bytes": 2**40, "cpu_adam_params_per_s": 3e9, "source": "measured by zplan calibrate"}
    gpu = {"name": "measured", "memory_bytes": 150754820096, "peak_flops": {"fp32": 5e13, "bf16": 7.6e14},
           "hbm_bytes_per_s": 4.2e12, "host_link_bytes_per_s": 5e10, "measured": True, "source": "s"}
    calibrate.one_gpu_links(cluster, "h200")
    calibrate.write_presets(tmp_path, "measured", gpu, cluster)
    got, stock = presets.cluster(str(tmp_path / "clusters" / "measured.toml")), presets.cluster("hgx-h200")
    for f in calibrate.LINK_FIELDS:
        assert getattr(got, f) == getattr(stock, f), f
    assert got.gpus_per_node == 1 and stock.gpus_per_node == 8  # this machine's node shape
    assert got.intra_node_allreduce_gpus == 8  # the NVLS figure stays the 8-GPU node's (nccl.group_busbw)
    assert got.cpu_adam_params_per_s == 3e9 and "links as the hgx-h200 preset's" in got.source
    h100 = {"source": "s"}  # H100 has two cluster presets: its stock node's links, not AWS's EFA
    calibrate.one_gpu_links(h100, "h100-sxm")
    assert "links as the dgx-h100 preset's" in h100["source"] and "tree_busbw_fraction" not in h100
    bare = {"intra_node_busbw_bytes_per_s": 4.2e12, "source": "s"}  # a GPU zplan has no preset for
    calibrate.one_gpu_links(bare, None)
    assert bare == {"intra_node_busbw_bytes_per_s": 4.2e12,
                    "source": "s; one GPU: no collective measured, the link figures are its copy rate"}


@pytest.mark.slow  # over a second each: the fast loop leaves it to CI
def test_calibrate_attention_backward_times_no_gradient_accumulation():
    """calibrate's attention backward is timed without AccumulateGrad's add into q/k/v.grad (each
    call after the first added three elementwise passes to what it charged to the flash backward,
    ~5-10% of it on an H100): the timed calls run no in-place add, by PyTorch's profiler."""
    from torch.profiler import ProfilerActivity, profile

    from zplan import calibrate

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        calibrate.attention_rates(torch.device("cpu"), seq=64, heads=2, head_dim=16, reps=2)
    names = [e.key for e in prof.key_averages()]
    assert any("scaled_dot_product" in n and "backward" in n for n in names), names  # backward ran
    assert "aten::add_" not in names


def test_api_refuses_a_group_without_a_host_backend(run_zplan, tmp_path, monkeypatch):
    """A script that started its own group as init_process_group("nccl") (cuda only; gloo stands
    in, the device scoping NCCL's has) before api.init: the run's host-tensor collectives (the
    gradient norm and full_state_dict under offload-all, bookkeeping) would fail mid-run with "No
    backend type associated with device type cpu"; api.init refuses at once, in one line. A group
    with the host's backend passes."""
    import torch.distributed as dist

    from zplan.netutil import free_port
    from zplan.trainer import api

    from zplan.errors import UsageError

    plan = _plan(run_zplan, tmp_path / "plan.json", "zero3", gpus=1)
    monkeypatch.setenv("ZPLAN_PLAN", str(plan))
    monkeypatch.setattr(sys, "excepthook", sys.excepthook)  # api.init installs zplan's: put back after
    for backend, refused in ((stand_in_for_nccl("nccl", "gloo"), True), ("cpu:gloo,cuda:gloo", False)):
        monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
        monkeypatch.setenv("MASTER_PORT", str(free_port()))
        dist.init_process_group(backend, rank=0, world_size=1)
        try:
            if refused:
                with pytest.raises(UsageError) as e:  # one line, exit 2, by zplan's hook in a script
                    api.init(ckpt_dir=str(tmp_path))
                assert "no backend for cpu tensors" in str(e.value) and "'gloo'" in str(e.value)
                assert "\n" not in str(e.value)
            else:
                ctx = api.init(ckpt_dir=str(tmp_path))
                assert ctx.world == 1
        finally:
            dist.destroy_process_group()


@pytest.mark.parametrize("flags,needle", [
    (("--name", "../../stolen"), "--name '../../stolen' is not a preset name"),
    (("--name", ""), "--name '' is not a preset name"),
    (("--name", "a/b"), "is not a preset name"),
    (("--output", ""), "--output '' is empty"),
    (("--output", "FILE"), "is not a folder"),
])
def test_calibrate_refuses_a_path_for_a_name_before_measuring(capsys, tmp_path, monkeypatch, flags, needle):
    """calibrate --name ../../x wrote both presets outside --output, to the same file (the cluster
    preset over the GPU's); --output a file failed only after the measurements. Each is one line,
    exit 2, before anything is measured (the measuring functions must not be reached)."""
    from tests.helpers import cli
    from zplan import calibrate

    monkeypatch.chdir(tmp_path)
    (tmp_path / "FILE").write_text("x")
    monkeypatch.setattr(calibrate, "matmul_flops", lambda *a, **k: pytest.fail("measured before the check"))
    r = cli(capsys, "calibrate", *flags)
    assert r.returncode == 2 and needle in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["FILE"]


def test_a_gpu_no_preset_describes_runs_its_calibrated_plans(tmp_path, monkeypatch, run_zplan):
    """A GH200 maps to no preset (it was taken for an H200): a plan made with the preset zplan
    calibrate wrote on it passes the trainer's GPU check; a plan for a shipped preset is refused
    in one line naming the way (calibrate's preset, a file), not "plan again with --gpu auto",
    which refuses a GPU without a preset. The device's name and memory are faked."""
    from types import SimpleNamespace

    from zplan.plan import load
    from zplan.trainer.plan_check import check_plan

    _calibrated_h200(tmp_path, part=None, memory_bytes=96 * 10**9)
    flags = ("--model", "llama-3.2-1b", "--gpus", "1", "--layout", "torch", "--strategy", "zero3")
    for gpu, name in ((("--presets", str(tmp_path), "--gpu", "measured", "--cluster", "measured"), "mine.json"),
                      (("--gpu", "h200"), "h200.json")):
        p = run_zplan("recommend", *flags, *gpu, "--write", str(tmp_path / name))
        assert p.returncode == 0, p.stderr
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA GH200 480GB")
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda *a: SimpleNamespace(total_memory=95 * 2**30))
    assert check_plan(load(str(tmp_path / "mine.json")), 1, True, builtin_model=True) is None
    why = check_plan(load(str(tmp_path / "h200.json")), 1, True, builtin_model=True)
    assert "which no shipped preset describes" in why and "zplan calibrate" in why and "--gpu auto" not in why
