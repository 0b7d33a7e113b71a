"""The one way zplan starts a process group (trainer, user API).

`init_process_group("nccl")` maps only the cuda device type to NCCL: a collective on a CPU tensor
in such a group raises `RuntimeError: No backend type associated with device type cpu`. A GPU
run does meet CPU tensors in collectives: the gradient-norm reduction under offload-all (the
gradients are CPU DTensors), scalar bookkeeping, DCP's planning. So a GPU group carries a CPU
backend too, "cpu:gloo,cuda:nccl", as torchtitan does for CPU offload; a CPU run uses gloo.

`ZPLAN_STAND_IN_NCCL=gloo` (tests only) makes the group a GPU run would make, with gloo standing
in for NCCL, on any machine: "cpu:gloo,cuda:gloo" has the device scoping of the GPU group, so a
CPU collective that would fail under NCCL's scoping fails here too (tests/test_gpu_path.py).
"""

from __future__ import annotations

import os
from datetime import timedelta

import torch
import torch.distributed as dist

STAND_IN_ENV = "ZPLAN_STAND_IN_NCCL"
TIMEOUT_ENV = "ZPLAN_COLLECTIVE_TIMEOUT_S"
DEFAULT_TIMEOUT_S = 1800
MAX_TIMEOUT_S = 7 * 24 * 3600  # a week: a bound, not torch's limit (1e15 s overflows its count)
_started: list[str] = []  # the backend string of the group this process started, if any


def backend_for(device: torch.device | str) -> str:
    """The backend string for a group whose compute runs on `device`: every device type that
    meets a collective has a backend (cuda: NCCL, the host: gloo)."""
    kind = torch.device(device).type
    if kind == "cpu":
        return "gloo"
    if kind == "cuda":
        return "cpu:gloo,cuda:nccl"
    raise ValueError(f"zplan runs on cuda or cpu devices, not {kind}")


def init_process_group_for(device: torch.device | str, **kwargs) -> str:
    """Start the default process group for compute on `device` (torchrun's environment gives
    rank, world size and rendezvous); return the backend string it used."""
    stand_in = os.environ.get(STAND_IN_ENV)
    backend = stand_in_for_nccl(backend_for("cuda"), stand_in) if stand_in else backend_for(device)
    kwargs.setdefault("timeout", collective_timeout())
    dist.init_process_group(backend, **kwargs)
    _started[:] = [backend]
    return backend


def collective_timeout() -> timedelta:
    """How long a rank waits in one collective before its group gives up (NCCL's watchdog aborts
    the process): $ZPLAN_COLLECTIVE_TIMEOUT_S seconds, else 30 minutes. Given explicitly, as
    torch's default hangs on the backend string: 10 minutes for a bare "nccl", 30 for any other
    (torch/distributed/distributed_c10d.py `_get_default_timeout`, 2.11 and 2.13), so the mixed
    "cpu:gloo,cuda:nccl" group gets 30 without saying so. 30, not NCCL's 10: a checkpoint of a
    large model written to slow storage holds every rank at DCP's last collective until the
    slowest rank's files are written, and a rank that fails is stopped by torchrun long before
    any timeout; only a true desynchronisation waits it out."""
    from ..errors import UsageError

    raw = os.environ.get(TIMEOUT_ENV)
    if raw is None or raw == "":
        return timedelta(seconds=DEFAULT_TIMEOUT_S)
    try:
        seconds = float(raw)
    except ValueError:
        seconds = float("nan")
    if not 1 <= seconds <= MAX_TIMEOUT_S:  # NaN fails too
        raise UsageError(f"{TIMEOUT_ENV}={raw!r} is not a number of seconds in 1..{MAX_TIMEOUT_S}: "
                         f"set it to e.g. 600, or unset it for {DEFAULT_TIMEOUT_S}")
    return timedelta(seconds=seconds)


def missing_backends(device: torch.device | str) -> list[str]:
    """Device types the running default group has no backend for, of those a run on `device`
    meets in collectives (`backend_for`: the host's always, the compute device's): a group a
    user's script started as init_process_group("nccl") lacks "cpu". Read from the group's
    device types (torch 2.11 and 2.13 `ProcessGroup._device_types`); [] where this torch does not
    say."""
    kinds = getattr(dist.distributed_c10d._get_default_group(), "_device_types", None)
    if kinds is None:
        return []
    have = {torch.device(k).type for k in kinds}
    return [k for k in dict.fromkeys(("cpu", torch.device(device).type)) if k not in have]


def started_backend() -> str | None:
    """The backend string init_process_group_for gave the default group (None: this process's
    group, if any, was started elsewhere). Reported as asked: torch's own view merges a bare
    "gloo" with "cpu:gloo,cuda:gloo", which gloo also registers."""
    return _started[0] if _started else None


def stand_in_for_nccl(backend: str, name: str) -> str:
    """`backend` with `name` in NCCL's place and NCCL's device scoping: a bare "nccl" registers
    only the cuda device type, so it becomes "cuda:NAME" (a bare "gloo" would cover cpu too)."""
    if ":" not in backend:
        backend = "cuda:nccl" if backend == "nccl" else backend
    return backend.replace("nccl", name)

