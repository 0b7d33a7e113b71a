"""A reduce-scatter whose sum has a fixed order, for FSDP2's `set_custom_reduce_scatter`.

gloo's and NCCL's reduce-scatter add the ranks' contributions in ring order, which rounds
differently from a sum in rank order (docs/reference.md). The sum here is zplan/ordered_reduce.py
(the one the from-scratch reference uses), so the result is bit for bit the rank-ordered mean
gradient on a 1-D mesh, at any N. It moves the same bytes as a reduce-scatter, in N-1 messages.

`set_custom_reduce_scatter` and the `ReduceScatter` interface are private FSDP2 extension points
(torch.distributed.fsdp._fully_shard); tests/test_trainer.py pins the behaviour.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..ordered_reduce import ordered_reduce_scatter


def ordered_reduce_scatter_class():
    try:
        from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter
    except ImportError as e:  # older torch
        raise RuntimeError(f"--deterministic needs FSDP2's set_custom_reduce_scatter ({e})") from None

    class OrderedReduceScatter(ReduceScatter):
        def allocate(self, size, *, dtype, device):
            return torch.empty(*size, dtype=dtype, device=device)

        def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
            if op not in (dist.ReduceOp.AVG, dist.ReduceOp.SUM):
                raise RuntimeError(f"ordered reduce-scatter supports SUM and AVG, not {op}")
            out = ordered_reduce_scatter(input_tensor.reshape(-1), group, mean=op == dist.ReduceOp.AVG)
            output_tensor.copy_(out.view_as(output_tensor))
            return None

    return OrderedReduceScatter


def make_deterministic(units) -> None:
    cls = ordered_reduce_scatter_class()
    for u in units:
        u.set_custom_reduce_scatter(cls())
