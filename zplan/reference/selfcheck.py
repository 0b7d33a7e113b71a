"""`zplan selfcheck`: run the from-scratch ZeRO on N local processes and hold it against
unsharded AdamW on the mean gradient (bit for bit) and against the planner (traffic).

The model is a small MLP whose layers have sizes that do not divide by N (11->37->29->23->5),
so padding is exercised; each Linear layer is a sharding unit.
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

from ..netutil import free_port

SIZES = (11, 37, 29, 23, 5)
PER_RANK = 3  # samples per rank per step
STEPS = 3
LR, WD, CLIP = 1e-2, 0.1, 0.5  # a small clip so clipping is active


def build_model():
    import torch
    from torch import nn

    torch.manual_seed(1234)
    layers = []
    for a, b in zip(SIZES, SIZES[1:]):
        layers += [nn.Linear(a, b), nn.GELU()]
    model = nn.Sequential(*layers[:-1])
    units = [m for m in model if isinstance(m, nn.Linear)]
    return model, units


def batch(step: int, rank: int):
    import torch

    g = torch.Generator().manual_seed(10_000 * step + rank)
    return torch.randn(PER_RANK, SIZES[0], generator=g), torch.randn(PER_RANK, SIZES[-1], generator=g)


def _worker(rank: int, world: int, stages: tuple[int, ...], init: str, out: str, ring: bool) -> None:
    import warnings

    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    from .zero import ZeRO

    warnings.filterwarnings("ignore", category=FutureWarning)  # all_gather_into_tensor, 2.13
    warnings.filterwarnings("ignore", message="Full backward hook is firing")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        results = {}
        for stage in stages:
            model, units = build_model()
            z = ZeRO(model, units, stage, lr=LR, weight_decay=WD, clip=CLIP, ring=ring)
            per_step = []
            for step in range(STEPS):
                before = z.traffic.total
                x, y = batch(step, rank)
                F.mse_loss(model(x), y).backward()
                z.step()
                per_step.append(z.traffic.total - before)
            results[stage] = {"weights": z.full_weights(), "per_step": per_step,
                              "moment_floats": z.moment_floats(), "master_floats": z.master_floats()}
        if rank == 0:
            torch.save(results, out)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    # gloo's threads can abort the interpreter's teardown ("terminate called without an active
    # exception"); the work is done and saved, so leave without running destructors
    os._exit(0)


def unsharded(world: int):
    """The oracle, written apart from zplan/reference/zero.py and zplan/ordered_reduce.py (it
    imports neither): plain AdamW on one process, on the mean of the N ranks' gradients, clipped
    by the global norm. Float addition is not associative, so to be comparable bit for bit the
    oracle fixes the same order of additions the sharded run promises: the mean adds the ranks in
    order 0..N-1 then divides by N; ||g||^2 adds, for each rank's slice of the padded flat
    gradients, the units' sums of squares in unit order, then the ranks in order; the clip
    coefficient is min(1, CLIP / (||g|| + 1e-6)) (torch.nn.utils.clip_grad_norm_'s formula)."""
    import math

    import torch
    import torch.nn.functional as F

    torch.set_num_threads(1)
    model, units = build_model()
    params = [p for u in units for p in u.parameters()]
    opt = torch.optim.AdamW(params, lr=LR, weight_decay=WD, foreach=False)
    for step in range(STEPS):
        per_rank = []
        for r in range(world):
            for p in params:
                p.grad = None
            x, y = batch(step, r)
            F.mse_loss(model(x), y).backward()
            per_rank.append([torch.cat([p.grad.reshape(-1) for p in u.parameters()]) for u in units])
        means = []  # per unit, padded to a multiple of N with zeros
        for i in range(len(units)):
            n = per_rank[0][i].numel()
            total = torch.zeros(math.ceil(n / world) * world)
            total[:n] = per_rank[0][i]
            for r in range(1, world):
                total[:n] += per_rank[r][i]
            means.append(total / world)
        sq = torch.zeros(())
        for r in range(world):
            own = torch.zeros(())
            for m in means:
                c = m.numel() // world
                own = own + m[r * c: (r + 1) * c].pow(2).sum()
            sq = sq + own
        coef = torch.minimum(CLIP / (sq.sqrt() + 1e-6), torch.ones(()))
        for i, u in enumerate(units):
            off = 0
            for p in u.parameters():
                p.grad = means[i][off: off + p.numel()].view(p.shape) * coef
                off += p.numel()
        opt.step()
    return [torch.cat([p.detach().reshape(-1) for p in u.parameters()]) for u in units], \
        sum(2 * p.numel() for p in params)


def planned_elements(world: int, stage: int) -> int:
    """What zplan's communication model predicts for this model and stage (zero layout, with
    DeepSpeed's ZeRO-1/2 reducing to each owning rank: the paper's reduce-scatter volume, which
    the reference runs; DeepSpeed's default all-reduce moves twice it; and no prefetch, as the
    reference's ZeRO-3 gathers each unit in forward and again in backward: with its prefetcher
    DeepSpeed keeps the last unit for its backward)."""
    from .. import arch
    from ..comm import collectives
    from ..scenario import Scenario
    from ..specs import Hardware, TrainSpec
    from ..strategies import effective
    from .. import presets

    sizes = [(b * a + b) for a, b in zip(SIZES, SIZES[1:])]
    units = tuple(arch.Unit(f"linear{i}", ((n,),), 1, i, n) for i, n in enumerate(sizes))
    model = arch.synthetic(sum(sizes))
    hw = Hardware(gpu=presets.gpu("cpu"), cluster=presets.cluster("cpu-local"), num_gpus=world)
    sc = Scenario(model, hw, TrainSpec(precision={"param": "fp32"}, deepspeed_bucket_allreduce=False, prefetch=False), custom_units=units)
    return sum(c.elements_per_step for c in collectives(sc, effective(f"zero{stage}", "zero")))


@dataclass
class StageResult:
    stage: int
    world: int
    bitwise: bool
    first_difference: str | None
    moment_floats: int  # AdamW's m and v on this rank
    master_floats: int  # the fp32 master slice kept beside replicated weights (zero1, zero2)
    unsharded_moment_floats: int
    measured_elements: list[int]
    predicted_elements: int

    @property
    def traffic_ok(self) -> bool:
        return all(m == self.predicted_elements for m in self.measured_elements)

    @property
    def ok(self) -> bool:
        return self.bitwise and self.traffic_ok


def run(world: int, stages: tuple[int, ...] = (1, 2, 3), ring: bool = False) -> list[StageResult]:
    """All stages on `world` spawned processes (one process group), each against the reference."""
    import torch
    import torch.multiprocessing as mp

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    with tempfile.TemporaryDirectory() as d:
        out = str(Path(d) / "rank0.pt")
        init = f"tcp://127.0.0.1:{free_port()}"
        mp.start_processes(_worker, args=(world, stages, init, out, ring), nprocs=world, join=True,
                           start_method="spawn")
        got = torch.load(out)
    ref, ref_floats = unsharded(world)
    results = []
    for stage in stages:
        g = got[stage]
        first = None
        for i, (a, b) in enumerate(zip(g["weights"], ref)):
            if not torch.equal(a, b):
                j = int((a != b).nonzero()[0])
                first = f"unit {i} element {j}: {a[j].item()!r} vs {b[j].item()!r}"
                break
        results.append(StageResult(stage, world, first is None, first, g["moment_floats"],
                                   g["master_floats"], ref_floats, g["per_step"],
                                   planned_elements(world, stage)))
    return results
