"""Flat-tensor all-gather and reduce-scatter under the names this torch has.

torch 2.13 renames `dist.all_gather_into_tensor` / `dist.reduce_scatter_tensor` to
`all_gather_single` / `reduce_scatter_single` and marks the old names deprecated (a FutureWarning
on every call, from torch/distributed/distributed_c10d.py); torch 2.11 has only the old names.
Both dispatch the same c10d ops (`_allgather_base_`, `_reduce_scatter_base_`), so what a run
measures (zplan/trainer/measure.py) is the same under either.
"""

from __future__ import annotations

import torch.distributed as dist


def all_gather(output, input_, group=None, async_op: bool = False):
    """Gather equal-sized `input_` from every rank into the flat `output` (rank order)."""
    call = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return call(output, input_, group=group, async_op=async_op)


def reduce_scatter(output, input_, op=dist.ReduceOp.SUM, group=None, async_op: bool = False):
    """Reduce the flat `input_` over ranks with `op` and keep this rank's slice in `output`."""
    call = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    return call(output, input_, op=op, group=group, async_op=async_op)
