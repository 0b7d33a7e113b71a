"""The training loop: apply the plan, train, checkpoint, measure, and report measured against
predicted. Runs under torchrun (one process per rank); see zplan/trainer/__main__.py."""

from __future__ import annotations

import contextlib
import signal
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from ..arch import param_count
from ..plan import Plan
from . import checkpoint as ckpt
from .data import Prefetcher, TokenSource
from .distributed import started_backend
from .measure import CommCounter, StepClock, ddp_counting_hook, device_peak_memory, outside_allocator_bytes
from .model import Transformer, init_weights_
from .run_setup import inject_fault
from .stop import StopRequests
from .micro_batch import forward_loss
from .parallel import Parallelized, build_optimizer, device_for, parallelize
from .report import MIN_TRACKED_STEPS, build_report, compare_lines, progress_bar, step_log_line, write_report

__all__ = ["RunConfig", "Trainer", "compare_lines", "write_report"]


@dataclass
class RunConfig:
    steps: int = 20
    lr: float = 3e-3
    seed: int = 0
    clip: float = 1.0
    save_every: int = 0
    save: bool = True  # False: no checkpoint at all (a benchmark run)
    ckpt_dir: str = "runs/zplan"
    resume: bool = False
    data: str | None = None
    measure_memory: bool = True
    stop_after: int | None = None  # end the run after this step, as if killed (tests)
    progress: bool = True
    deterministic: bool = False  # FSDP2: rank-ordered reduce-scatter (bit for bit at any N)
    log_every: int | None = None  # a step line on stdout every k steps; None: 10 without a progress bar, else none
    keep: int = 0  # keep the newest k checkpoints (0: all)

    @property
    def log_interval(self) -> int:
        if self.log_every is not None:
            return max(0, self.log_every)
        return 0 if self.progress else 10


def _memory_tracker(p: Parallelized, optim, device):
    if device.type == "cuda":
        return None
    if p.fsdp:
        try:  # grouped units (norm + head) keep FSDP2's group hooks under the tracker (fake_tracker.py)
            from .fake_tracker import tracker_class

            tracker = tracker_class()(p.model, optim)
            tracker.settle_backend_buffers = True  # gloo's clones, timed as the plan does (fake_tracker.py)
            return tracker
        except (ImportError, AttributeError):  # another torch's private names: the tracker as it is
            from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker

            return FSDPMemTracker(p.model, optim)
    from torch.distributed._tools.mem_tracker import MemTracker

    mt = MemTracker()
    mt.track_external(p.model, optim)
    return mt


def _ready_loss(loss: torch.Tensor, on_the_way: list) -> float | None:
    """For the progress bar: start copying this step's loss to pinned host memory without
    waiting, behind a CUDA event, and return the newest loss whose copy has finished (None
    while none has). On a CPU rank the loss is there already."""
    if loss.device.type != "cuda":
        return float(loss)
    host = torch.empty((), dtype=loss.dtype, pin_memory=True)
    host.copy_(loss.detach(), non_blocking=True)
    done = torch.cuda.Event()
    done.record()
    on_the_way.append((host, done))
    ready = None
    while on_the_way and on_the_way[0][1].query():
        ready = float(on_the_way.pop(0)[0])
    return ready


class Trainer:
    def __init__(self, plan: Plan, cfg: RunConfig, backend: str):
        self.plan, self.cfg = plan, cfg
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.device = device_for(backend)
        torch.manual_seed(cfg.seed)
        with torch.device("meta"):
            model = Transformer(plan.model)
        model.return_cache(plan.train.kv_cache)
        model.expand_kv(plan.train.attention_expands_kv)
        model.attention_kernel(plan.train.attention_kernel)
        if cfg.deterministic and plan.strategy in ("ddp", "zero1"):
            from ..errors import UsageError

            raise UsageError(f"--deterministic applies to the FSDP2 strategies, not {plan.strategy}")
        self.par = parallelize(model, plan, self.device, cfg.deterministic)
        init_weights_(self.par.inner, cfg.seed)
        self.optim = build_optimizer(self.par, plan, cfg.lr)
        self.counter: CommCounter | None = None
        self.stopped_by: str | None = None  # the signal that ended the run early (stop.py)
        self._tracking = None  # the memory tracker while it is active
        self.memory_by_category: dict[str, int] = {}
        self._counter_ref: list = [None]
        if not self.par.fsdp and self.par.model is not self.par.inner:  # DDP (one rank: unwrapped)
            self.par.model.register_comm_hook(None, ddp_counting_hook(self._counter_ref))
        t = plan.train
        self.data = TokenSource(plan.model.vocab_size, t.seq_len, cfg.seed, cfg.data)
        self.batches = Prefetcher(self.data, self.rank, self.world, plan.global_batch, t.micro_batch,
                                  t.grad_accum, self.device)
        self.step = 0
        self._held = None  # TrainSpec.outputs_until_next_forward: the last output, until the next forward returns
        self.clock = StepClock(self.device)
        self.backend = started_backend()

    # ------------------------------------------------------------------ one step
    def _forward_backward(self) -> torch.Tensor:
        t, A = self.plan.train, self.plan.train.grad_accum
        total = torch.zeros((), device=self.device)
        for micro in range(A):
            x, y = self.batches.get(self.step, micro)
            loss, kept = forward_loss(self.par, t, x, y, sync=micro == A - 1 or t.reduce_every_microbatch)
            # the previous output is released only now, after this forward returned
            self._held = kept if t.outputs_until_next_forward else None
            loss.backward()
            del kept  # carried into the next forward only where the plan holds it (self._held)
            total += loss.detach()
            if self._tracking is not None and micro < A - 1:
                self._tracking.reset_mod_stats()  # the tracker refuses a second forward otherwise
        return total

    def _clip(self) -> torch.Tensor:
        """The global gradient norm, left where it is (the device; the host under offload-all,
        whose gradients are CPU DTensors: the group's CPU backend reduces it). A plan without
        clipping (grad_clip False, priced as no work) computes no norm: NaN in the report."""
        if not self.plan.train.grad_clip:
            return torch.full((), float("nan"), device=self.device)
        # foreach where the device has it (CUDA; None lets torch choose), per tensor under single
        single = self.plan.train.optimizer_kernels == "single"
        norm = torch.nn.utils.clip_grad_norm_(self.par.model.parameters(), self.cfg.clip,
                                              foreach=False if single else None)
        if hasattr(norm, "full_tensor"):
            norm = norm.full_tensor()  # a collective: every rank calls it
        return norm.detach()

    def train_step(self, count: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """One optimizer step; returns this rank's loss and the global gradient norm as tensors,
        unread: reading them (float()) would wait for the device every step."""
        counter = self.counter if count else None
        self._counter_ref[0] = counter
        with counter if counter is not None else contextlib.nullcontext():
            loss = self._forward_backward()
        self._counter_ref[0] = None
        grad_norm = self._clip()
        with counter if counter is not None else contextlib.nullcontext():
            self.optim.step()
        self.optim.zero_grad(set_to_none=True)
        return loss, grad_norm

    def _mean_over_ranks(self, local: list[torch.Tensor]) -> list[float]:
        """The rank-mean of each per-step loss (a collective: every rank calls it), summed in
        rank order: an all-reduce's order of addition depends on the vector's length (gloo on 4
        ranks), so a run stopped and resumed reported losses a last bit away from the same steps
        of an uninterrupted run (a QA pass) although its weights were equal."""
        if not local:
            return []
        t = torch.stack(local)
        parts = [torch.empty_like(t) for _ in range(self.world)]
        dist.all_gather(parts, t)
        total = parts[0].clone()
        for p in parts[1:]:
            total += p
        return (total / self.world).tolist()

    # ------------------------------------------------------------------ the run
    def resume(self) -> int:
        """Load the newest checkpoint that loads (falling back past damaged ones); its step."""
        state = ckpt.resume_newest(self.cfg.ckpt_dir, self.par.model, self.optim, self.world,
                                   zero1=self.plan.strategy == "zero1", model_name=self.plan.model.name,
                                   model_params=param_count(self.plan.model))
        if state is None:
            if self.rank == 0:
                print(f"zplan: no checkpoint in {self.cfg.ckpt_dir}; starting at step 0", flush=True)
            return 0
        if int(state.get("data_seed", self.cfg.seed)) != self.cfg.seed:
            from ..errors import UsageError

            raise UsageError(f"the checkpoint at step {state['step']} was trained with --seed {state['data_seed']}, "
                             f"which orders the data; resume with --seed {state['data_seed']}, or start a new --run-dir")
        self.step = int(state["step"])
        return self.step

    def save(self) -> Path:
        meta = {"world_size": self.world, "strategy": self.plan.strategy, "model": self.plan.model.name,
                "model_params": param_count(self.plan.model)}
        return ckpt.save(self.cfg.ckpt_dir, self.step, self.par.model, self.optim,
                         {"step": self.step, "data_seed": self.cfg.seed}, meta,
                         zero1=self.plan.strategy == "zero1", keep=self.cfg.keep)

    def run(self, stops: StopRequests | None = None) -> dict | None:
        """Train to cfg.steps and return the report; None if a resumed run had already finished.
        A signal from the first step to the last checkpoint stops the run after a step; before
        it, `stops` (entered by the rank's start, unarmed) ends the rank (stop.py)."""
        if stops is not None:
            return self._run(stops)
        with StopRequests(armed=False) as own:
            return self._run(own)

    def _run(self, stops: StopRequests) -> dict | None:
        cfg = self.cfg
        if self.rank == 0:
            ckpt.clean_stale(cfg.ckpt_dir)  # a killed save's .tmp-step_N
        start = self.resume() if cfg.resume else 0
        if start >= cfg.steps:
            return None
        last = cfg.steps - 1 if cfg.stop_after is None else min(cfg.steps, cfg.stop_after) - 1
        # traffic is counted on step 3 when there is one (DDP rebuilds its buckets after step 1,
        # with broadcasts); the memory tracker takes the last two steps, after that one
        at = min(start + 2, last)
        track = cfg.measure_memory and last - start + 1 >= MIN_TRACKED_STEPS  # i.e. last - 1 > at
        tracker = _memory_tracker(self.par, self.optim, self.device) if track else None
        losses, norms, marks, timed = [], [], [], []
        # one buffer per figure, filled in place: a 0-dim CUDA tensor kept per step is a
        # 512-byte allocator block each (1 KiB per step with the norm, for the whole run, and
        # counted in the measured peak); views into the buffers cost no device memory
        slots = cfg.steps - start
        loss_buf = torch.empty(slots, device=self.device)
        norm_buf = None  # on the norm's device: the host under offload-all
        on_the_way: list = []  # the progress bar's losses being copied to the host (CUDA)
        shown = None
        self.counter = CommCounter(self.world)
        counted = 0
        stack_open = False
        logged = start  # steps before this one are in an earlier log line
        # every rank takes rank 0's interval: a log step is a collective, and whether stderr
        # is a terminal may differ between ranks (torchrun --redirects / --tee)
        every_t = torch.tensor([cfg.log_interval], dtype=torch.int64, device=self.device)
        dist.broadcast(every_t, 0)
        every = int(every_t)
        progress = progress_bar(self.rank == 0 and cfg.progress, cfg.steps - start)
        if self.device.type == "cuda":
            if start:  # a resumed run: the checkpoint load's cached blocks are not the steps' peak
                torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(self.device)
        stops.armed = True  # from here a signal stops the run after a step, with a checkpoint
        with progress as bar, contextlib.ExitStack() as stack:
            stack.callback(self.batches.close)
            task = bar.add_task("training", total=cfg.steps - start) if bar else None
            while self.step < cfg.steps:
                # Memory is tracked on the last two steps (FSDPMemTracker's hooks outlive its
                # context on torch 2.13, so nothing may run after it); traffic on the second step.
                measure_mem = tracker is not None and self.step >= last - 1
                count = self.step == at
                if measure_mem and not stack_open:
                    stack.enter_context(tracker)
                    stack_open = True
                self._tracking = tracker if measure_mem else None
                t0 = self.clock.mark()
                loss, gnorm = self.train_step(count)
                t1 = self.clock.mark()
                if self._tracking is not None:
                    self._tracking.reset_mod_stats()
                self._tracking = None
                counted += int(count)
                i = self.step - start
                loss_buf[i].copy_(loss)
                if norm_buf is None:
                    norm_buf = torch.empty(slots, dtype=gnorm.dtype, device=gnorm.device)
                norm_buf[i].copy_(gnorm)
                losses.append(loss_buf[i])
                norms.append(norm_buf[i])
                marks.append((t0, t1))
                # the first step warms up; the counted step runs under a dispatch mode (host
                # overhead per op), timed only where no other step is
                timed.append(0 if measure_mem or self.step == start else 1 if count else 2)
                self.step += 1
                if bar:  # the newest loss already on the host: reading one still on the GPU
                    # would wait for everything queued, this step included, every step
                    ready = _ready_loss(loss, on_the_way)
                    shown = ready if ready is not None else shown
                    text = f" loss {shown:.3f}" if shown is not None else ""
                    bar.update(task, advance=1, description=f"step {self.step}{text}")
                if every and (self.step % every == 0 or self.step == cfg.steps):
                    self._log(losses[-1], marks[logged - start:], cfg.steps)
                    logged = self.step
                if cfg.save and cfg.save_every and self.step % cfg.save_every == 0:
                    self.save()
                inject_fault(self.step, self.rank)
                if cfg.stop_after is not None and self.step >= cfg.stop_after:
                    break
                # a stop asked for by a signal on any rank: every rank ends after this step
                # (zplan/trainer/stop.py), with the checkpoint below
                if self.step < cfg.steps and (signum := stops.agreed()):
                    self.stopped_by = signal.Signals(signum).name
                    break
        best = 2 if 2 in timed else 1
        times = [self.clock.seconds(a, b) for (a, b), kind in zip(marks, timed) if kind == best]
        # a run stopped before the tracker's steps measured nothing (not 0 bytes)
        peak = self._peak_memory(tracker if stack_open else None)
        ended = self.step == cfg.steps or self.stopped_by is not None
        if cfg.save and ended and not (cfg.save_every and self.step % cfg.save_every == 0):
            self.save()  # a checkpoint at the end (or where a signal stopped the run), unless none is wanted
        mean_losses = self._mean_over_ranks(losses)
        grad_norms = torch.stack(norms).tolist() if norms else []
        return build_report(self, start, mean_losses, grad_norms, times, peak, counted)

    def _log(self, loss: torch.Tensor, marks: list, steps: int) -> None:
        """A step line on rank 0's stdout: the rank-mean loss (a collective: every rank calls it)
        and the median step time of the steps since the last line."""
        mean = loss.clone()
        dist.all_reduce(mean)
        if self.rank != 0:
            return
        step_s = statistics.median(self.clock.seconds(a, b) for a, b in marks)
        memory = device_peak_memory(self.device) if self.device.type == "cuda" else None
        print(step_log_line(self, self.step, steps, float(mean) / self.world, step_s, memory),
              file=sys.stdout, flush=True)

    def _peak_memory(self, tracker) -> dict[str, int | None]:
        """Peak bytes over ranks (the maximum): allocated, and on a GPU reserved (the caching
        allocator's segments, which is what the device lends) and the device memory outside the
        allocator at the end (the context and NCCL's buffers: outside_allocator_bytes). A CPU rank's figure is the
        tracker's, which counts tensors (no allocator, no context); where no tracker ran (a run
        too short to track: every rank decides alike) nothing was measured: None, not 0."""
        reserved = outside = None
        if self.device.type == "cuda":
            local, reserved = device_peak_memory(self.device)
            outside = outside_allocator_bytes(self.device)
        elif tracker is not None:
            snap = tracker.get_tracker_snapshot("peak")
            local = max((v.get("Total", 0) for v in snap.values()), default=0)
            for v in snap.values():
                self.memory_by_category = {str(getattr(k, "value", k)): int(b) for k, b in v.items()}
        else:
            return {"allocated": None, "reserved": None, "outside": None}
        t = torch.tensor([local, reserved or 0, outside or 0], dtype=torch.int64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return {"allocated": int(t[0]), "reserved": int(t[1]) if reserved is not None else None,
                "outside": int(t[2]) if outside is not None else None}
