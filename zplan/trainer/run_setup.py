"""What every rank agrees on before training: the run directory, and whether the run is done."""

from __future__ import annotations

import os
import secrets
import socket
from pathlib import Path

import torch
import torch.distributed as dist

from ..errors import UsageError

TOKEN = ".zplan-run-dir-check"


def agree_on_run_dir(run_dir: str) -> None:
    """Rank 0 writes a random token into the run directory; every rank must read it back.

    With more than one node the run directory must be on a filesystem every node shares (each
    rank writes its shard there, and rank 0 publishes the checkpoint): a node that sees another
    folder is refused here, before training, with one line naming the first such rank.
    """
    rank, world = dist.get_rank(), dist.get_world_size()
    token = [secrets.token_hex(8) if rank == 0 else None]
    path = Path(run_dir) / TOKEN
    if rank == 0:
        path.write_text(token[0])
    dist.broadcast_object_list(token, src=0)
    try:
        seen = path.read_text() == token[0]
    except OSError:
        seen = False
    ok = torch.tensor([0 if seen else rank + 1], dtype=torch.int64)
    dist.all_reduce(ok, op=dist.ReduceOp.MAX)
    bad = int(ok.item()) - 1
    dist.barrier()
    if rank == 0:
        path.unlink(missing_ok=True)
    if bad >= 0:
        host = [socket.gethostname()]
        dist.broadcast_object_list(host, src=bad)
        raise UsageError(f"rank {bad} (host {host[0]}) does not see the run directory {os.path.abspath(run_dir)} "
                         f"that rank 0 wrote: with several nodes --run-dir must be on a shared filesystem")


def finished_line(run_dir: str, reached: int, steps: int) -> str:
    """A resumed run whose newest checkpoint is at or past --steps: the step it reached (it said
    --steps, which a checkpoint past it is not)."""
    return (f"zplan: the run in {run_dir} already reached step {reached} (--steps {steps}); "
            f"nothing to do (its report is unchanged; pass --steps above {reached} to train on)")


def stopped_line(signal_name: str, reached: int, cfg) -> str:
    """A run a signal stopped at a step boundary (zplan/trainer/stop.py): where, and what it
    left to resume from."""
    kept = (f"checkpoint of step {reached} written in {cfg.ckpt_dir}; zplan launch --resume continues from it"
            if cfg.save else "no checkpoint (--no-save)")
    return f"zplan: stopped by {signal_name} after step {reached} of {cfg.steps}; {kept}"


def inject_fault(step: int, rank: int) -> None:
    """Fault injection for the restart tests: ZPLAN_FAULT_KILL_AT=STEP:RANK makes that rank
    SIGKILL itself after STEP, on the first attempt only (kill -9, as a dying node would)."""
    spec = os.environ.get("ZPLAN_FAULT_KILL_AT")
    if not spec or os.environ.get("ZPLAN_ATTEMPT", "0") != "0":
        return
    at_step, at_rank = (int(x) for x in spec.split(":"))
    if step == at_step and rank == at_rank:
        import signal

        os.kill(os.getpid(), signal.SIGKILL)


def host_threads(strategy: str, cuda: bool, local_world: int, cpus: int, omp_env: str | None) -> int | None:
    """Threads for this rank's host work, or None to keep torch's setting.

    Under offload-all on GPUs the optimizer step runs on the host, and the planner prices it at
    the node's `cpu_adam_params_per_s` shared by the node's ranks (docs/formulas.md, section 6):
    each rank takes its share of the usable CPUs. torchrun and zplan launch start ranks with
    OMP_NUM_THREADS=1, which would leave one core per rank and the step many times slower than
    planned. An OMP_NUM_THREADS other than 1 is the user's choice and is kept."""
    if strategy != "offload-all" or not cuda or (omp_env not in (None, "", "1")):
        return None
    return max(1, cpus // max(1, local_world))


def set_host_threads(strategy: str, cuda: bool) -> int | None:
    """Apply host_threads to this process (the trainer and api.init call it); the count set."""
    from ..hardware import usable_cpus

    n = host_threads(strategy, cuda, int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1), usable_cpus(),
                     os.environ.get("OMP_NUM_THREADS"))
    if n is not None:
        torch.set_num_threads(n)
    return n


def set_local_device() -> torch.device:
    """This rank's GPU, LOCAL_RANK, made current before any CUDA tensor, collective or device
    query (otherwise every rank would meet GPU 0 first). More ranks on a node than it has GPUs
    is refused with one line, not a CUDA 'invalid device ordinal'."""
    local = int(os.environ.get("LOCAL_RANK", "0") or 0)
    count = torch.cuda.device_count()
    if not 0 <= local < count:
        raise UsageError(f"this rank's LOCAL_RANK is {local} but its node shows {count} GPU(s): start at "
                         f"most {count} ranks per node (--nproc-per-node), or check CUDA_VISIBLE_DEVICES")
    torch.cuda.set_device(local)
    return torch.device("cuda", local)
