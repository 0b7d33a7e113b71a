"""The rank-ordered reduce-scatter: one helper for the from-scratch ZeRO (zplan/reference/zero.py)
and the trainer's --deterministic FSDP2 (zplan/trainer/deterministic.py).

gloo's and NCCL's reduce-scatter add the ranks' contributions in ring order, which rounds
differently from a sum in rank order (docs/reference.md). Here each rank receives every rank's
chunk with all_to_all_single and adds them in rank order 0, 1, ..., N-1, so the result is the
same bits at any N as the unsharded sum of the N gradients in that order. It moves the same
bytes as a reduce-scatter, in N-1 messages. Imports torch only: neither side imports the other.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def ordered_reduce_scatter(full: torch.Tensor, group=None, mean: bool = True) -> torch.Tensor:
    """This rank's slice of the sum (mean=True: the mean) of `full` over the group's ranks,
    added in rank order. `full`'s length must divide by the group's size."""
    world = dist.get_world_size(group)
    if world == 1:
        return full.clone()
    received = torch.empty_like(full)
    dist.all_to_all_single(received, full, group=group)  # chunk j of every rank arrives as row j
    rows = received.view(world, -1)
    out = rows[0].clone()
    for j in range(1, world):
        out += rows[j]
    return out / world if mean else out
