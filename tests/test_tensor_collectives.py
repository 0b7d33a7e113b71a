"""The flat-tensor collectives under this torch's names: right values, no deprecation warning.

torch 2.13 deprecates dist.all_gather_into_tensor / reduce_scatter_tensor (a FutureWarning on
every call); 2.11 has only those names. Two real gloo ranks, warnings raised as errors."""

import os

import pytest

torch = pytest.importorskip("torch")

from zplan.netutil import free_port  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]


def _rank(rank: int, port: int, out: str) -> None:
    import warnings

    import torch.distributed as dist

    from zplan import tensor_collectives as tc

    warnings.simplefilter("error")  # a deprecation in the call fails the rank
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        shard = torch.arange(3, dtype=torch.float32) + 10 * rank
        full = torch.empty(6)
        tc.all_gather(full, shard)
        work = tc.all_gather(torch.empty(6), shard, async_op=True)
        work.wait()
        src = torch.arange(6, dtype=torch.float32) * (rank + 1)
        part = torch.empty(3)
        tc.reduce_scatter(part, src)
        torch.save({"gathered": full.tolist(), "reduced": part.tolist()}, os.path.join(out, f"r{rank}.pt"))
    finally:
        dist.destroy_process_group()


def test_gather_and_reduce_scatter_values_without_warnings(tmp_path):
    import torch.multiprocessing as mp

    mp.start_processes(_rank, args=(free_port(), str(tmp_path)), nprocs=2, join=True, start_method="spawn")
    for rank in (0, 1):
        got = torch.load(tmp_path / f"r{rank}.pt")
        # written out: rank 0 holds 0,1,2, rank 1 holds 10,11,12
        assert got["gathered"] == [0.0, 1.0, 2.0, 10.0, 11.0, 12.0]
        # sum over ranks of arange(6) x (rank + 1) = 3 x arange(6); rank r keeps elements 3r..3r+2
        assert got["reduced"] == [3.0 * i for i in range(3 * rank, 3 * rank + 3)]
