"""ZeRO stages 1, 2 and 3 from scratch over torch.distributed collectives: a lesson in ~200 lines.

Each unit (a module) keeps its parameters as one flat fp32 buffer padded to a multiple of N;
rank r owns slice r (`shard`), on which AdamW keeps the master weights and both moments.

- zero3: the full buffer exists only while the unit runs. Before its forward the unit is
  all-gathered (the next unit's gather is started early, async, and waited on before use);
  after its forward the buffer is freed; before its backward it is gathered again (and the unit
  before it prefetched). Gradients are reduce-scattered as soon as the unit's are complete.
- zero2: weights stay replicated; gradients are reduce-scattered per unit during backward and
  the full gradients freed; after the step the updated shards are all-gathered.
- zero1: as zero2, but the full gradients live until the end of backward.

Reduce-scatter is done in a fixed order (zplan/ordered_reduce.py: all_to_all, then a sum in rank
order, then / N), so the result is bit for bit the rank-ordered mean gradient; a ring reduce-scatter sums in ring order, which for
N >= 3 rounds differently (docs/reference.md). Every collective's size is counted, in the
planner's convention, so the traffic can be held against zplan's model.
"""

from __future__ import annotations

import math
from collections import defaultdict

import torch
import torch.distributed as dist
from torch import nn

from ..ordered_reduce import ordered_reduce_scatter
from ..tensor_collectives import all_gather as gather_flat, reduce_scatter as reduce_scatter_flat


class Traffic:
    """Elements moved per kind of collective (full-tensor size; an all-reduce counts twice)."""

    def __init__(self):
        self.elements: dict[str, int] = defaultdict(int)

    def add(self, kind: str, n: int) -> None:
        self.elements[kind] += n

    @property
    def total(self) -> int:
        return sum(self.elements.values())


def reduce_scatter(full: torch.Tensor, world: int, traffic: Traffic, ring: bool = False) -> torch.Tensor:
    """Mean over ranks of `full`'s slice for this rank, summed in rank order: deterministic
    (zplan/ordered_reduce.py). ring=True uses the backend's reduce_scatter instead (sums in ring
    order: not bitwise)."""
    if world == 1:
        return full.clone()  # one rank: nothing moves
    traffic.add("reduce_scatter", full.numel())
    if ring:
        out = torch.empty(full.numel() // world)
        reduce_scatter_flat(out, full)
        return out / world
    return ordered_reduce_scatter(full)


def all_gather(out: torch.Tensor, shard: torch.Tensor, traffic: Traffic, async_op: bool = False):
    if dist.get_world_size() > 1:
        traffic.add("all_gather", out.numel())
    return gather_flat(out, shard, async_op=async_op)


class Unit:
    """One module's parameters as a flat buffer, padded to a multiple of `world`."""

    def __init__(self, module: nn.Module, rank: int, world: int):
        self.module, self.rank, self.world = module, rank, world
        self.params = [p for p in module.parameters()]
        self.numel = sum(p.numel() for p in self.params)
        self.chunk = math.ceil(self.numel / world)
        self.padded = self.chunk * world
        flat = torch.zeros(self.padded)
        torch.cat([p.detach().reshape(-1) for p in self.params], out=flat[: self.numel])
        self.shard = flat[rank * self.chunk: (rank + 1) * self.chunk].clone().requires_grad_(True)
        self.full = flat  # the gathered weights; params are views of it
        self.pending = None  # an async gather in flight
        self._bind()
        self.grads_done = 0

    def _bind(self) -> None:
        """Point each parameter's data at its place in the full buffer (a fresh version counter,
        so refilling the buffer does not trip autograd's saved-tensor checks)."""
        off = 0
        for p in self.params:
            p.data = self.full[off: off + p.numel()].view(p.shape)
            off += p.numel()

    def free(self) -> None:
        self.full.untyped_storage().resize_(0)

    def gather(self, traffic: Traffic, async_op: bool = False) -> None:
        if self.pending is not None:
            return
        if self.full.untyped_storage().size() == 0:
            self.full.untyped_storage().resize_(self.padded * self.full.element_size())
        work = all_gather(self.full, self.shard.detach(), traffic, async_op)
        self.pending = work if async_op else None

    def wait(self) -> None:
        if self.pending is not None:
            self.pending.wait()
            self.pending = None

    def flat_grad(self) -> torch.Tensor:
        g = torch.zeros(self.padded)
        off = 0
        for p in self.params:
            g[off: off + p.numel()] = p.grad.reshape(-1)
            off += p.numel()
        return g


class ZeRO:
    """Wrap `model` (whose `units` are the modules to shard) for one stage of ZeRO."""

    def __init__(self, model: nn.Module, units: list[nn.Module], stage: int, lr: float = 1e-2,
                 weight_decay: float = 0.1, clip: float | None = 1.0, ring: bool = False):
        assert stage in (1, 2, 3)
        self.model, self.stage, self.clip, self.ring = model, stage, clip, ring
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.traffic = Traffic()
        self.units = [Unit(m, self.rank, self.world) for m in units]
        self.local_grads: list[torch.Tensor | None] = [None] * len(self.units)
        self.optim = torch.optim.AdamW([u.shard for u in self.units], lr=lr,
                                       weight_decay=weight_decay, foreach=False)
        for i, u in enumerate(self.units):
            u.module.register_forward_pre_hook(lambda m, a, i=i: self._pre_forward(i))
            u.module.register_forward_hook(lambda m, a, o, i=i: self._post_forward(i))
            u.module.register_full_backward_pre_hook(lambda m, g, i=i: self._pre_backward(i))
            for p in u.params:
                p.register_post_accumulate_grad_hook(lambda p, i=i: self._grad_ready(i))
        if stage == 3:
            for u in self.units:
                u.free()

    # -- zero3: gather before use, free after, prefetch the next one
    def _pre_forward(self, i: int) -> None:
        if self.stage < 3:
            return
        u = self.units[i]
        u.gather(self.traffic)
        u.wait()
        if i + 1 < len(self.units):
            self.units[i + 1].gather(self.traffic, async_op=True)

    def _post_forward(self, i: int) -> None:
        if self.stage == 3:
            self.units[i].free()

    def _pre_backward(self, i: int) -> None:
        if self.stage < 3:
            return
        u = self.units[i]
        u.gather(self.traffic)
        u.wait()
        if i > 0:
            self.units[i - 1].gather(self.traffic, async_op=True)

    # -- gradients: reduce-scatter a unit as soon as all its gradients exist (zero2, zero3)
    def _grad_ready(self, i: int) -> None:
        u = self.units[i]
        u.grads_done += 1
        if u.grads_done < len(u.params) or self.stage == 1:
            return
        self._reduce(i)

    def _reduce(self, i: int) -> None:
        u = self.units[i]
        u.grads_done = 0
        self.local_grads[i] = reduce_scatter(u.flat_grad(), self.world, self.traffic, self.ring)
        for p in u.params:
            p.grad = None  # the full gradient is gone: only this rank's slice remains
        if self.stage == 3:
            u.free()

    def step(self) -> None:
        """After backward: (zero1) reduce-scatter; clip by the global norm; AdamW on the shards;
        (zero1, zero2) all-gather the updated weights."""
        if self.stage == 1:
            for i in range(len(self.units)):
                self._reduce(i)
        for u, g in zip(self.units, self.local_grads):
            u.shard.grad = g
        if self.clip is not None:
            coef = clip_coefficient(self.local_sq_norm(), self.world, self.clip)
            for u in self.units:
                u.shard.grad.mul_(coef)
        self.optim.step()
        self.optim.zero_grad(set_to_none=True)
        self.local_grads = [None] * len(self.units)
        if self.stage < 3:
            for u in self.units:
                u.gather(self.traffic)

    def local_sq_norm(self) -> torch.Tensor:
        return sum_in_order([u.shard.grad.pow(2).sum() for u in self.units])

    def moment_floats(self) -> int:
        """AdamW's two moments on this rank: 2 x the shard."""
        return sum(2 * u.chunk for u in self.units)

    def master_floats(self) -> int:
        """The fp32 master slice; under zero3 the shard is the only copy of the weights, so it
        is counted as the weights, not as optimizer state."""
        return 0 if self.stage == 3 else sum(u.chunk for u in self.units)

    def full_weights(self) -> list[torch.Tensor]:
        """Every parameter, gathered (a collective: all ranks call it). Not counted as traffic."""
        out = []
        for u in self.units:
            buf = torch.empty(u.padded)
            gather_flat(buf, u.shard.detach())
            out.append(buf[: u.numel].clone())
        return out


def sum_in_order(values: list[torch.Tensor]) -> torch.Tensor:
    total = torch.zeros(())
    for v in values:
        total = total + v
    return total


def clip_coefficient(local_sq: torch.Tensor, world: int, max_norm: float) -> torch.Tensor:
    """min(1, max_norm / ||g||), with ||g||² the rank-ordered sum of the ranks' local squares.

    The N partial sums are all-gathered and added in rank order (an all-reduce would add them
    in ring order). Bookkeeping of N floats: not counted as model traffic."""
    if world > 1:
        parts = torch.empty(world)
        gather_flat(parts, local_sq.reshape(1))
        total = sum_in_order(list(parts))
    else:
        total = local_sq
    norm = total.sqrt()
    return torch.clamp(max_norm / (norm + 1e-6), max=1.0)
