"""A reduce-scatter whose sum has a fixed order, for FSDP2's `set_custom_reduce_scatter`.

gloo's and NCCL's reduce-scatter add the ranks' contributions in ring order, which rounds
differently from a sum in rank order (docs/reference.md). Here each rank receives every rank's
chunk with all_to_all and adds them in rank order, so the result is bit for bit the rank-ordered
mean gradient, at any N. It moves the same bytes as a reduce-scatter, in N-1 messages.

`set_custom_reduce_scatter` and the `ReduceScatter` interface are private FSDP2 extension points
(torch.distributed.fsdp._fully_shard); tests/test_trainer.py pins the behaviour.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def ordered_reduce_scatter_class():
    try:
        from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter
    except ImportError as e:  # older torch
        raise RuntimeError(f"--deterministic needs FSDP2's set_custom_reduce_scatter ({e})") from None

    class OrderedReduceScatter(ReduceScatter):
        def allocate(self, size, *, dtype, device):
            return torch.empty(*size, dtype=dtype, device=device)

        def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
            world = dist.get_world_size(group)
            received = torch.empty_like(input_tensor)
            dist.all_to_all_single(received, input_tensor, group=group)
            rows = received.view(world, -1)
            out = rows[0].clone()
            for j in range(1, world):
                out += rows[j]
            if op == dist.ReduceOp.AVG:
                out /= world
            elif op != dist.ReduceOp.SUM:
                raise RuntimeError(f"ordered reduce-scatter supports SUM and AVG, not {op}")
            output_tensor.copy_(out.view_as(output_tensor))
            return None

    return OrderedReduceScatter


def make_deterministic(units) -> None:
    cls = ordered_reduce_scatter_class()
    for u in units:
        u.set_custom_reduce_scatter(cls())
