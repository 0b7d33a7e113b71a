"""What only a GPU can show (skipped without one): the NCCL run's group with its CPU backend,
pinned prefetched batches, allocated against reserved, no host synchronisation in a step, the
built-in trainer on one GPU under offload-all, and the chunked loss's bytes by the allocator's count. benchmarks/gpu_check.sh runs these on the first
GPU it meets; tests/test_gpu_path.py catches on CPU what can be caught there."""

import json
import os
from pathlib import Path

import pytest
import torch

from zplan.trainer.distributed import STAND_IN_ENV

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def _gpu_rank(rank: int, port: int, out: str) -> None:
    """One rank on GPU 0 under the trainer's own group: pinned batches copied to the device,
    allocated <= reserved, a CPU collective in the NCCL run's group, device placement."""
    import torch.distributed as dist

    from zplan.trainer.data import Prefetcher, TokenSource
    from zplan.trainer.distributed import init_process_group_for
    from zplan.trainer.measure import StepClock, device_peak_memory

    os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    os.environ.pop(STAND_IN_ENV, None)
    torch.cuda.set_device(0)
    dev = torch.device("cuda", 0)
    res = {"backend": init_process_group_for(dev)}
    src = TokenSource(1000, 128, seed=3)
    pre = Prefetcher(src, 0, 1, 4, 2, 2, dev)
    x, y = pre.get(0, 0)
    nxt = pre._next[1].result()[0]
    res["pinned"] = bool(nxt.is_pinned()) and nxt.is_contiguous()  # one DMA, no pageable staging
    res["device"] = str(x.device)
    res["same"] = bool(torch.equal(x.cpu(), src.batch(0, 0, 0, 1, 4, 2)[0]))
    pre.close()
    clock = StepClock(dev)
    torch.cuda.reset_peak_memory_stats(dev)
    a = clock.mark()
    big = torch.empty(256 * 2**20, dtype=torch.uint8, device=dev)
    b = clock.mark()
    res["seconds"] = clock.seconds(a, b)
    alloc, reserved = device_peak_memory(dev)
    res["alloc"], res["reserved"] = alloc, reserved
    del big
    host = torch.ones(1)
    dist.all_reduce(host)  # the CPU backend of the NCCL run's group
    res["host_sum"] = float(host)
    dist.destroy_process_group()
    Path(out).write_text(json.dumps(res))


@pytest.mark.timeout(90)
def test_cuda_group_pinned_prefetch_and_memory(tmp_path):
    import torch.multiprocessing as mp

    from zplan.netutil import free_port

    out = tmp_path / "gpu.json"
    mp.start_processes(_gpu_rank, args=(free_port(), str(out)), nprocs=1, join=True, start_method="spawn")
    res = json.loads(out.read_text())
    assert res["backend"] == "cpu:gloo,cuda:nccl" and res["host_sum"] == 1.0
    assert res["pinned"] and res["device"] == "cuda:0" and res["same"]
    assert res["alloc"] >= 256 * 2**20 and res["reserved"] >= res["alloc"]
    assert res["seconds"] >= 0


def _sync_rank(rank: int, port: int, plan: str, out: str) -> None:
    """Steps of the built-in trainer under torch.cuda.set_sync_debug_mode: no synchronising
    CUDA call between a step's start and its end (the loss and norm stay on the device)."""
    import warnings

    from zplan.plan import load
    from zplan.trainer.distributed import init_process_group_for
    from zplan.trainer.loop import RunConfig, Trainer

    os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    os.environ.pop(STAND_IN_ENV, None)
    torch.cuda.set_device(0)
    init_process_group_for("cuda")
    tr = Trainer(load(plan), RunConfig(steps=6, measure_memory=False, progress=False), "nccl")
    for _ in range(2):  # lazy initialisation and allocator warm-up
        tr.train_step(False)
        tr.step += 1
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            for _ in range(2):
                tr.train_step(False)
                tr.step += 1
        finally:
            torch.cuda.set_sync_debug_mode(0)
    tr.batches.close()
    torch.distributed.destroy_process_group()
    Path(out).write_text(json.dumps([f"{w.filename}:{w.lineno}: {w.message}" for w in caught
                                     if "synchroniz" in str(w.message)]))


@pytest.mark.timeout(90)
def test_cuda_steps_do_not_synchronise_the_host(run_zplan, tmp_path):
    import torch.multiprocessing as mp

    from zplan.netutil import free_port

    p = run_zplan("recommend", "--model", "tiny", "--gpu", "auto", "--gpus", "1", "--layout", "torch",
                  "--global-batch", "4", "--seq-len", "64", "--strategy", "zero3",
                  "--write", str(tmp_path / "plan.json"), "--json")
    assert p.returncode == 0, p.stderr
    out = tmp_path / "sync.json"
    mp.start_processes(_sync_rank, args=(free_port(), str(tmp_path / "plan.json"), str(out)), nprocs=1,
                       join=True, start_method="spawn")
    assert json.loads(out.read_text()) == []


@pytest.mark.timeout(90)
def test_cuda_trainer_offload_all_one_gpu(run_zplan, tmp_path):
    """The built-in trainer on one GPU under offload-all: CPU DTensor gradients clipped in the
    NCCL run's group; allocated and reserved measured and compared."""
    p = run_zplan("recommend", "--model", "tiny", "--gpu", "auto", "--gpus", "1", "--layout", "torch",
                  "--global-batch", "4", "--seq-len", "64", "--strategy", "offload-all",
                  "--write", str(tmp_path / "plan.json"), "--json")
    assert p.returncode == 0, p.stderr
    p = run_zplan("launch", "--plan", str(tmp_path / "plan.json"), "--run-dir", str(tmp_path / "run"),
                  "--steps", "5", timeout=80)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    rep = json.loads((tmp_path / "run" / "run_report.json").read_text())
    assert rep["device"] == "cuda" and rep["backend"] == "cpu:gloo,cuda:nccl"
    m = rep["measured"]
    assert 0 < m["peak_memory_bytes"] <= m["peak_reserved_bytes"]



@pytest.mark.timeout(90)
def test_cuda_chunked_loss_holds_what_the_planner_counts():
    """The trainer's chunked linear loss on a GPU in bf16: the caching allocator's own peak over
    its forward equals activation_memory.linear_loss_bytes (MemTracker sees op outputs only; this
    also sees an op's internal temporaries, such as the one torch.logsumexp would allocate), to
    the 512-byte block rounding; the loss equals F.cross_entropy's over fp32 logits."""
    import torch.nn.functional as F

    from zplan import activation_memory
    from zplan.specs import ModelSpec, Precision, TrainSpec
    from zplan.policy import loss_chunk_tokens as chunk_tokens
    from zplan.trainer.linear_loss import chunked_linear_cross_entropy

    dev = torch.device("cuda", 0)
    seq, mb, H, V = 2048, 2, 256, 32000
    T = seq * mb
    g = torch.Generator(device=dev).manual_seed(0)
    x = torch.randn(T, H, device=dev, generator=g).bfloat16().requires_grad_()
    w = (torch.randn(V, H, device=dev, generator=g) * 0.05).bfloat16().requires_grad_()
    y = torch.randint(0, V, (T,), device=dev, generator=g)
    (x[:64] @ w[:64].t()).float().sum()  # cuBLAS's workspace, outside the measured window
    torch.cuda.synchronize(dev)
    torch.cuda.reset_peak_memory_stats(dev)
    base = torch.cuda.memory_allocated(dev)
    loss = chunked_linear_cross_entropy(x, w, y)
    torch.cuda.synchronize(dev)
    peak = torch.cuda.max_memory_allocated(dev) - base
    m = ModelSpec(name="t", num_layers=1, hidden=H, ffn_hidden=4 * H, num_heads=2, num_kv_heads=1,
                  vocab_size=V)
    t = TrainSpec(seq_len=seq, micro_batch=mb, linear_loss="chunked", precision=Precision(param="bf16"))
    planned = activation_memory.linear_loss_bytes(m, t)["forward"]
    assert chunk_tokens(T, V, H) < T
    assert abs(peak - planned) <= 8 * 512, (peak, planned)
    ref = F.cross_entropy(x.detach().float() @ w.detach().float().t(), y)
    assert float(loss) == pytest.approx(float(ref), rel=2e-3)


def test_the_progress_bar_reads_losses_without_waiting_for_the_gpu():
    """The bar's loss is copied to pinned host memory behind an event and read once the event
    has passed: under set_sync_debug_mode no synchronising call, and the value arrives."""
    import warnings

    from zplan.trainer.loop import _ready_loss

    torch.cuda.set_device(0)
    big = torch.randn(4096, 4096, device="cuda")
    on_the_way: list = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            for _ in range(3):
                loss = (big @ big).mean()  # work queued before the copy
                _ready_loss(loss, on_the_way)
        finally:
            torch.cuda.set_sync_debug_mode(0)
    assert not [w for w in caught if "synchroniz" in str(w.message)]
    torch.cuda.synchronize()
    assert _ready_loss(torch.zeros((), device="cuda") + 1.5, on_the_way) is not None
