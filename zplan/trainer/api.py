"""The small API a user's own train.py calls to run under a zplan plan.

    from zplan.trainer import api

    ctx = api.init()                                  # process group + the plan of $ZPLAN_PLAN
    with torch.device("meta"):
        model = MyModel()
    model = ctx.apply(model, units=list(model.blocks), init=my_init)   # shard or replicate
    opt = ctx.optimizer(model, lr=3e-4)
    for step in range(ctx.resume(model, opt), steps):
        for micro, batch in enumerate(batches):
            with ctx.accumulate(model, last=micro == ctx.grad_accum - 1):
                loss = loss_fn(model(batch)) / ctx.grad_accum
            loss.backward()
        opt.step(); opt.zero_grad()
        ctx.save(model, opt, step + 1)                # every rank writes its shard; atomic publish
        if ctx.stop_requested():                      # SIGTERM, SIGUSR1, Ctrl-C: all ranks alike
            break
    weights = ctx.full_state_dict(model)              # full tensors on rank 0 (None elsewhere)
    ctx.close()

The user never touches DTensor: `full_state_dict` gathers one parameter at a time to rank 0's
CPU memory.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist
from torch import nn

from ..errors import UsageError
from ..export import script_applies
from ..plan import Plan, load
from . import checkpoint as ckpt
from .distributed import backend_for, init_process_group_for, missing_backends
from ..launch.runner import STOP_MARKER_ENV
from .micro_batch import micro_batch_context
from .parallel import Parallelized, build_optimizer, materialise, replicate, shard_units, to_master_dtype
from .stop import StopRequests


def _initialise_host_shards(model: nn.Module, init, rank: int) -> None:
    """Initialise FSDP2 shards that sit on the host (offload-all on a GPU): DTensor's RNG
    tracker drives the GPU's stream, not the host's, so each rank drew its shard from its CPU
    generator, the same values on every rank where the script seeded them alike (the full
    weights one shard tiled). Each rank draws from a stream of its own instead: distinct shards
    of the same distribution (not the unsharded model's values). The script's generator is left
    as it was."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed((torch.initial_seed() + 1_000_003 * (rank + 1)) % 2**63)
        _initialise(model, init)


def _count(model: nn.Module) -> int:
    """The script's model's parameters, whole (a DTensor's numel is the full tensor's; a tied
    weight once): what its checkpoints record, not the plan's preset's count."""
    return sum(p.numel() for p in model.parameters())


def _initialise(model: nn.Module, init: Callable[[nn.Module], None] | None) -> None:
    with torch.no_grad():
        if init is not None:
            init(model)
        else:
            for m in model.modules():
                if hasattr(m, "reset_parameters"):
                    m.reset_parameters()


@dataclass
class Context:
    plan: Plan
    rank: int
    world: int
    device: torch.device
    ckpt_dir: str
    _par: Parallelized | None = None
    _stops: StopRequests | None = None

    @property
    def grad_accum(self) -> int:
        return self.plan.train.grad_accum

    @property
    def micro_batch(self) -> int:
        return self.plan.train.micro_batch

    def apply(self, model: nn.Module, units: list[nn.Module] | None = None,
              init: Callable[[nn.Module], None] | None = None) -> nn.Module:
        """Shard (FSDP2) or replicate (DDP) `model` as the plan says, then initialise it.

        units: the modules that each get their own all-gather (default: the model's direct
        children that hold parameters). init: called on the model after materialisation
        (default: every submodule's reset_parameters); a model built on the meta device has its
        buffers left empty too, so an `init` must fill those it needs (rotary tables, for one).
        Its parameters are stored in the plan's master dtype, as the built-in trainer's are.
        Under ddp and zero1 the model is initialised before DDP wraps it, so that DDP's
        broadcast of rank 0's weights makes the replicas equal whatever each rank's RNG; under
        FSDP2 on a GPU after sharding (DTensor draws each shard from one seeded stream), on CPU
        ranks before it, rank 0's weights broadcast (DTensor has no such stream there)."""
        if self._par is not None:
            raise UsageError("ctx.apply was called already: apply the model once (a second FSDP2 or DDP wrap "
                             "fails later, in backward or at the first step)")
        to_master_dtype(model, self.plan)
        if self.plan.strategy in ("ddp", "zero1"):
            materialise(model, False, self.device)
            _initialise(model, init)
            self._par = replicate(model, self.plan, self.device)
        else:
            groups = [[u] for u in (units if units is not None else
                                    [c for c in model.children() if any(True for _ in c.parameters())])]
            first = self.device.type != "cuda"
            if first:
                # DTensor's random ops draw a shard's values from one seeded stream only on
                # cuda-like meshes (torch/distributed/tensor/_random.py is_rng_supported_mesh,
                # 2.11 and 2.13): on CPU ranks each rank drew its shard from its own generator,
                # the same values wherever the script seeded the ranks alike (the full weights
                # one shard tiled), unrelated pieces where not. There the whole model is
                # initialised first, rank 0's values broadcast, and fully_shard keeps each rank's
                # piece of them: the unsharded model rank 0's seed gives.
                materialise(model, False, self.device)
                _initialise(model, init)
                with torch.no_grad():
                    for t in list(model.parameters()) + list(model.buffers()):
                        dist.broadcast(t.data, 0)
            self._par = shard_units(model, groups, self.plan, self.device)
            if not first and self.plan.strategy == "offload-all":
                _initialise_host_shards(self._par.inner, init, self.rank)
            elif not first:
                _initialise(self._par.inner, init)
        what = script_applies(self.plan, checkpointing=True)
        if what and self.rank == 0:  # apply shards and places; the plan's memory counted these too
            print(f"zplan: note: the plan was priced with {', '.join(what)}; ctx.apply shards and places the "
                  f"model only: your script applies them, or its memory and time are not the plan's",
                  file=sys.stderr, flush=True)
        return self._par.model

    def _applied(self, what: str) -> Parallelized:
        if self._par is None:
            raise UsageError(f"ctx.{what} needs the model ctx.apply returns: call ctx.apply(model) first")
        return self._par

    def optimizer(self, model: nn.Module, lr: float = 3e-4, weight_decay: float = 0.1):
        return build_optimizer(self._applied("optimizer"), self.plan, lr, weight_decay)

    def accumulate(self, model: nn.Module, last: bool):
        """Skip the gradient reduction on non-final micro-batches when the plan says so; under
        DDP also autocast to the plan's param dtype."""
        par = self._applied("accumulate")
        sync = last or self.plan.train.reduce_every_microbatch
        return micro_batch_context(par, sync, self.device.type)

    def save(self, model, optim, step: int) -> Path:
        self._applied("save")
        return ckpt.save(self.ckpt_dir, step, model, optim, {"step": step, "data_seed": 0},
                         {"world_size": self.world, "strategy": self.plan.strategy,
                          "model": self.plan.model.name, "model_params": _count(model)},
                         zero1=self.plan.strategy == "zero1")

    def resume(self, model, optim) -> int:
        """Load the newest complete checkpoint (at any world size, falling back past damaged
        ones); return its step (0: none). A checkpoint of a model of another size (the script's
        own model changed) is an error naming both counts, not a damaged checkpoint."""
        self._applied("resume")
        state = ckpt.resume_newest(self.ckpt_dir, model, optim, self.world,
                                   zero1=self.plan.strategy == "zero1", model_name=self.plan.model.name,
                                   model_params=_count(model))
        return 0 if state is None else int(state["step"])

    def stop_requested(self) -> signal.Signals | None:
        """The stop signal (SIGTERM, SIGINT, SIGUSR1) any rank has had since the first call, the
        same on every rank; None where there was none. A collective (a MAX all-reduce of one
        integer on the host): every rank calls it after the same step, then, where it says stop,
        saves and leaves the loop (zplan/trainer/stop.py has the why).

        The first call puts the handlers in place (until ctx.close): a signal before it ends the
        rank as it would have, losing the steps since the last save, the first among them. Once
        every rank has them (the first agreement has returned) it tells zplan launch that this
        script stops at a step: the launcher's first signal then goes to the ranks alone, with
        300 s to save, instead of ending everything after 5 s (launch/runner.py). Python runs
        signal handlers in the main thread only: called from another, it is refused."""
        if threading.current_thread() is not threading.main_thread():
            raise UsageError("ctx.stop_requested() must be called from the main thread (Python's signal "
                             "handlers run only there)")
        first = self._stops is None
        if first:
            self._stops = StopRequests().__enter__()
        signum = self._stops.agreed()
        marker = os.environ.get(STOP_MARKER_ENV)
        if marker and (first or signum):
            try:  # what the launcher reads: asked (empty), then stopped
                Path(marker).write_text(f"stopped by {signal.Signals(signum).name}\n" if signum else "")
            except OSError:  # the launcher's folder is gone: it ended; nothing to tell it
                pass
        return signal.Signals(signum) if signum else None

    def full_state_dict(self, model) -> dict[str, torch.Tensor] | None:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        sd = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        return sd if self.rank == 0 else None

    def close(self, leave: bool = False) -> None:
        """Meet the other ranks and destroy the process group. `leave=True` then ends the
        process at once, exit code 0 (rank_errors.leave): for the script's last line, so that
        gloo cannot abort the rank in interpreter teardown after its work is done. It skips the
        script's own atexit handlers (a logger's final flush, for one): close those first."""
        dist.barrier()
        dist.destroy_process_group()
        if self._stops is not None and threading.current_thread() is threading.main_thread():
            self._stops.__exit__(None, None, None)  # the handlers there before stop_requested
            self._stops = None
        if leave:
            from .rank_errors import leave as leave_now

            leave_now(0)


def _one_line_errors(group: bool) -> None:
    """Uncaught errors in a script under zplan launch, reported as the built-in trainer reports
    its own (rank_errors): zplan's (a refused plan, a checkpoint of another model), a lost peer,
    running out of memory: one line and their exit code (2 usage, 1 otherwise), each rank's echo
    of another's failure said as such; the script's own errors keep their traceback (its author
    reads it). ZPLAN_DEBUG=1: Python's own hook throughout.

    Installed twice: first (group False), so that api.init's own refusals are one line; then once
    the process group exists (group True), around the hook init_process_group installs
    (torch.distributed's _distributed_excepthook, which prints the traceback with a [rankN]
    prefix through a buffer, so a hook below it must not end the process): that outer one ends
    the process at once after the traceback, as rank_errors.leave does (gloo's teardown with a
    peer gone can abort)."""
    if os.environ.get("ZPLAN_DEBUG") == "1":
        return
    previous = sys.excepthook

    def hook(kind, value, tb):
        from .rank_errors import classify, ignore_stop_signals, leave, report

        ignore_stop_signals()  # torchrun's SIGTERM, once another rank failed, must not cut the line
        if not classify(value)[0].startswith("internal error"):
            leave(report(value))
        previous(kind, value, tb)
        if group:
            leave(1)

    sys.excepthook = hook


def init(ckpt_dir: str | None = None) -> Context:
    """Join the process group torchrun set up and read the plan named by $ZPLAN_PLAN; errors that
    escape the script are reported in one line from here on (_one_line_errors)."""
    _one_line_errors(group=False)
    path = os.environ.get("ZPLAN_PLAN")
    if not path:
        raise UsageError("$ZPLAN_PLAN is not set: start this script with zplan launch")
    plan = load(path)
    from .plan_check import check_plan
    from .run_setup import set_host_threads, set_local_device

    cuda = torch.cuda.is_available()
    if cuda:  # before anything asks the current device (check_plan reads this rank's GPU's name)
        set_local_device()
    why = check_plan(plan, int(os.environ.get("WORLD_SIZE", "1")), cuda)
    if why:
        raise UsageError(why)
    set_host_threads(plan.strategy, cuda)
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    if not dist.is_initialized():
        init_process_group_for(device)
    elif missing := missing_backends(device):
        raise UsageError(
            f"the process group this script started has no backend for {' or '.join(missing)} tensors "
            f"(backend {dist.get_backend()!r}), which the run's collectives meet (offload, bookkeeping, "
            f"checkpoints): start it as init_process_group({backend_for(device)!r}), or let zplan's api.init start it")
    _one_line_errors(group=True)
    run_dir = ckpt_dir or os.environ.get("ZPLAN_RUN_DIR") or str(Path(path).parent)
    return Context(plan, dist.get_rank(), dist.get_world_size(), device, run_dir)
