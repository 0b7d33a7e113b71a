"""What a run measures: bytes moved per collective, peak memory, step time.

Collectives are counted by a TorchDispatchMode that records the c10d ops the process issues
(FSDP2's all-gather and reduce-scatter, HSDP's all-reduce) and by a DDP communication hook for
DDP's bucketed all-reduce (the reducer calls the backend from C++). Sizes are recorded as the
full tensor each op works on, the planner's convention (docs/formulas.md section 5).
"""

from __future__ import annotations

import time
from collections import defaultdict

import torch
from torch.utils._python_dispatch import TorchDispatchMode

# op name -> (kind, which argument holds the full-size tensor: "out" or "in")
_OPS = {
    "_allgather_base_": ("all_gather", 0),  # (output, input, ...)
    "allgather_into_tensor_coalesced_": ("all_gather", 0),
    "_reduce_scatter_base_": ("reduce_scatter", 1),  # (output, input, ...)
    "reduce_scatter_tensor_coalesced_": ("reduce_scatter", 1),
    "allreduce_": ("all_reduce", 0),
    "allgather_": ("all_gather", 0),
    "reduce_scatter_": ("reduce_scatter", 1),
    "broadcast_": ("broadcast", 0),
    "alltoall_base_": ("all_to_all", 1),
}


def _numel(x) -> int:
    if isinstance(x, torch.Tensor):
        return x.numel()
    if isinstance(x, (list, tuple)):
        return sum(_numel(y) for y in x)
    return 0


def _elem_bytes(x) -> int:
    if isinstance(x, torch.Tensor):
        return x.element_size()
    if isinstance(x, (list, tuple)) and x:
        return _elem_bytes(x[0])
    return 0


class CommCounter(TorchDispatchMode):
    """Counts elements and bytes per collective kind while active."""

    def __init__(self, world: int = 2):
        super().__init__()
        self.world = world  # a collective over one rank moves nothing: not recorded
        self.elements: dict[str, int] = defaultdict(int)
        self.bytes: dict[str, int] = defaultdict(int)
        self.calls: dict[str, int] = defaultdict(int)
        self.pause = False

    def record(self, kind: str, elements: int, nbytes: int) -> None:
        if self.world <= 1:
            return
        self.elements[kind] += elements
        self.bytes[kind] += nbytes
        self.calls[kind] += 1

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        from torch.distributed.tensor import DTensor

        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented  # let DTensor decompose; its collectives come back through here
        kwargs = kwargs or {}
        if func.namespace == "c10d" and not self.pause:
            name = func._schema.name.split("::")[-1]
            if name in _OPS:
                kind, idx = _OPS[name]
                t = args[idx]
                self.record(kind, _numel(t), _numel(t) * _elem_bytes(t))
        return func(*args, **kwargs)

    def summary(self, steps: int = 1) -> dict:
        vol = {k: (2 if k == "all_reduce" else 1) * v for k, v in self.elements.items()}
        return {
            "elements_per_step": sum(vol.values()) // max(1, steps),
            "bytes_per_step": sum((2 if k == "all_reduce" else 1) * v for k, v in self.bytes.items()) // max(1, steps),
            "per_collective": {k: {"elements": self.elements[k] // max(1, steps),
                                   "bytes": self.bytes[k] // max(1, steps),
                                   "calls": self.calls[k] // max(1, steps)} for k in self.elements},
        }


def ddp_counting_hook(counter_ref: list):
    """A DDP comm hook: all-reduce each bucket (mean) and record its size in the active counter."""
    import torch.distributed as dist

    def hook(state, bucket):
        t = bucket.buffer()
        c = counter_ref[0] if counter_ref else None
        if c is not None:
            c.record("all_reduce", t.numel(), t.numel() * t.element_size())
            c.pause = True  # the all_reduce below is this bucket: not counted again
        t.div_(dist.get_world_size())
        try:
            fut = dist.all_reduce(t, async_op=True).get_future()
        finally:
            if c is not None:
                c.pause = False
        return fut.then(lambda f: f.value()[0])

    return hook


class StepClock:
    """Step times without a host synchronisation per step: on a GPU a pair of CUDA events
    around each step, read (waiting for the second) only when a figure is asked for; on a CPU
    the clock itself (CPU ops run synchronously)."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def mark(self):
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            return ev
        return time.perf_counter()

    def seconds(self, start, end) -> float:
        if self.cuda:
            end.synchronize()
            return start.elapsed_time(end) / 1e3  # elapsed_time is in milliseconds
        return end - start


def device_peak_memory(device: torch.device) -> tuple[int, int]:
    """(allocated, reserved) peak bytes of the caching allocator since the last reset. The CUDA
    context and NCCL's buffers are in neither; cuBLAS's workspaces are in both (PyTorch takes
    them from the caching allocator: aten/src/ATen/cuda/CublasHandlePool.cpp getNewWorkspace,
    32 MiB a handle and stream on Hopper and Blackwell), where the plan books them with the
    context (its cuda_context_bytes): a few tens of MiB over the prediction."""
    return torch.cuda.max_memory_allocated(device), torch.cuda.max_memory_reserved(device)


def outside_allocator_bytes(device: torch.device) -> int:
    """Device memory in use that is not the caching allocator's: the CUDA context, NCCL's
    communicator buffers, the libraries' own (torch.cuda.mem_get_info's used memory less
    memory_reserved, both in 2.11 and 2.13). Device-wide: the figure is this process's where it
    owns the GPU (torchrun, one rank per GPU); the plan's cuda_context_bytes is what it tests."""
    free, total = torch.cuda.mem_get_info(device)
    return max(0, int(total) - int(free) - int(torch.cuda.memory_reserved(device)))


def host_rss_bytes() -> int:
    """This process's resident memory (a CPU rank's step log; includes the libraries)."""
    import psutil

    return int(psutil.Process().memory_info().rss)
