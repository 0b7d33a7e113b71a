"""The training loop: apply the plan, train, checkpoint, measure, and report measured against
predicted. Runs under torchrun (one process per rank); see zplan/trainer/__main__.py."""

from __future__ import annotations

import contextlib
import json
import math
import statistics
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ..plan import Plan, write_atomic
from ..units import relative_error
from . import checkpoint as ckpt
from .data import TokenSource
from .measure import CommCounter, Timer, ddp_counting_hook
from .model import Transformer, init_weights_
from .parallel import Parallelized, build_optimizer, device_for, parallelize, set_sync


@dataclass
class RunConfig:
    steps: int = 20
    lr: float = 3e-3
    seed: int = 0
    clip: float = 1.0
    save_every: int = 0
    ckpt_dir: str = "runs/zplan"
    resume: bool = False
    data: str | None = None
    measure_memory: bool = True
    stop_after: int | None = None  # end the run after this step, as if killed (tests)
    progress: bool = True
    deterministic: bool = False  # FSDP2: rank-ordered reduce-scatter (bit for bit at any N)


def _memory_tracker(p: Parallelized, optim, device):
    if device.type == "cuda":
        return None
    if p.fsdp:
        from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker

        return FSDPMemTracker(p.model, optim)
    from torch.distributed._tools.mem_tracker import MemTracker

    mt = MemTracker()
    mt.track_external(p.model, optim)
    return mt


class Trainer:
    def __init__(self, plan: Plan, cfg: RunConfig, backend: str):
        self.plan, self.cfg = plan, cfg
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.device = device_for(backend)
        torch.manual_seed(cfg.seed)
        with torch.device("meta"):
            model = Transformer(plan.model)
        if cfg.deterministic and plan.strategy in ("ddp", "zero1"):
            raise ValueError("--deterministic applies to the FSDP2 strategies")
        self.par = parallelize(model, plan, self.device, cfg.deterministic)
        init_weights_(self.par.inner, cfg.seed)
        self.optim = build_optimizer(self.par, plan, cfg.lr)
        self.counter: CommCounter | None = None
        self._tracking = None  # the memory tracker while it is active
        self.memory_by_category: dict[str, int] = {}
        self._counter_ref: list = [None]
        if not self.par.fsdp:
            self.par.model.register_comm_hook(None, ddp_counting_hook(self._counter_ref))
        t = plan.train
        self.data = TokenSource(plan.model.vocab_size, t.seq_len, cfg.seed, cfg.data)
        self.step = 0
        self.timer = Timer(self.device)

    # ------------------------------------------------------------------ one step
    def _forward_backward(self) -> torch.Tensor:
        t, A = self.plan.train, self.plan.train.grad_accum
        total = torch.zeros((), device=self.device)
        for micro in range(A):
            x, y = self.data.batch(self.step, micro, self.rank, self.world, self.plan.global_batch,
                                   t.micro_batch)
            x, y = x.to(self.device), y.to(self.device)
            sync = micro == A - 1 or t.reduce_every_microbatch
            cast = (torch.autocast(self.device.type, dtype=self.par.autocast_dtype)
                    if self.par.autocast_dtype is not None else contextlib.nullcontext())
            with set_sync(self.par, sync), cast:
                logits = self.par.model(x)
                loss = F.cross_entropy(logits.float().view(-1, logits.shape[-1]), y.reshape(-1)) / A
            loss.backward()
            total += loss.detach()
            if self._tracking is not None and micro < A - 1:
                self._tracking.reset_mod_stats()  # the tracker refuses a second forward otherwise
        return total

    def _clip(self) -> float:
        norm = torch.nn.utils.clip_grad_norm_(self.par.model.parameters(), self.cfg.clip)
        if hasattr(norm, "full_tensor"):
            norm = norm.full_tensor()  # a collective: every rank calls it
        return float(norm)

    def train_step(self, count: bool) -> tuple[float, float]:
        counter = self.counter if count else None
        self._counter_ref[0] = counter
        with counter if counter is not None else contextlib.nullcontext():
            loss = self._forward_backward()
        self._counter_ref[0] = None
        grad_norm = self._clip()
        with counter if counter is not None else contextlib.nullcontext():
            self.optim.step()
        self.optim.zero_grad(set_to_none=True)
        dist.all_reduce(loss)  # for the log only, outside the counter
        return float(loss) / self.world, grad_norm

    # ------------------------------------------------------------------ the run
    def resume(self) -> int:
        path = ckpt.newest(self.cfg.ckpt_dir)
        if path is None:
            return 0
        state = ckpt.load(path, self.par.model, self.optim, self.world, zero1=self.plan.strategy == "zero1")
        self.step = int(state["step"])
        return self.step

    def save(self) -> Path:
        meta = {"world_size": self.world, "strategy": self.plan.strategy, "model": self.plan.model.name}
        return ckpt.save(self.cfg.ckpt_dir, self.step, self.par.model, self.optim,
                         {"step": self.step, "data_seed": self.cfg.seed}, meta,
                         zero1=self.plan.strategy == "zero1")

    def run(self) -> dict:
        cfg = self.cfg
        start = self.resume() if cfg.resume else 0
        last = cfg.steps - 1 if cfg.stop_after is None else min(cfg.steps, cfg.stop_after) - 1
        # traffic is counted on step 3 when there is one (DDP rebuilds its buckets after step 1,
        # with broadcasts); the memory tracker takes the last two steps, after that one
        at = min(start + 2, last)
        track = cfg.measure_memory and last - 1 > at
        tracker = _memory_tracker(self.par, self.optim, self.device) if track else None
        losses, times, norms = [], [], []
        self.counter = CommCounter(self.world)
        counted = 0
        stack_open = False
        progress = _progress(self.rank == 0 and cfg.progress, cfg.steps - start)
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        with progress as bar, contextlib.ExitStack() as stack:
            task = bar.add_task("training", total=cfg.steps - start) if bar else None
            while self.step < cfg.steps:
                # Memory is tracked on the last two steps (FSDPMemTracker's hooks outlive its
                # context on torch 2.13, so nothing may run after it); traffic on the second step.
                measure_mem = tracker is not None and self.step >= last - 1
                count = self.step == at
                t0 = self.timer.now()
                if measure_mem and not stack_open:
                    stack.enter_context(tracker)
                    stack_open = True
                self._tracking = tracker if measure_mem else None
                loss, gnorm = self.train_step(count)
                if self._tracking is not None:
                    self._tracking.reset_mod_stats()
                self._tracking = None
                dt = self.timer.now() - t0
                counted += int(count)
                losses.append(loss)
                norms.append(gnorm)
                if not measure_mem and self.step > start:
                    times.append(dt)  # the first step warms up
                self.step += 1
                if bar:
                    bar.update(task, advance=1, description=f"step {self.step} loss {loss:.3f}")
                if cfg.save_every and self.step % cfg.save_every == 0:
                    self.save()
                if cfg.stop_after is not None and self.step >= cfg.stop_after:
                    break
        peak = self._peak_memory(tracker)
        return self._report(start, losses, norms, times, peak, counted)

    def _peak_memory(self, tracker) -> int:
        if self.device.type == "cuda":
            local = torch.cuda.max_memory_allocated(self.device)
        elif tracker is not None:
            snap = tracker.get_tracker_snapshot("peak")
            local = max((v.get("Total", 0) for v in snap.values()), default=0)
            for v in snap.values():
                self.memory_by_category = {str(getattr(k, "value", k)): int(b) for k, b in v.items()}
        else:
            local = 0
        t = torch.tensor([local], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return int(t.item())

    def _report(self, start, losses, norms, times, peak, counted) -> dict:
        t, plan = self.plan.train, self.plan
        tokens = t.micro_batch * t.seq_len * t.grad_accum
        step_s = statistics.median(times) if times else float("nan")
        from .. import arch

        flop = arch.model_flop_per_token(plan.model, t.seq_len) * tokens
        peak_flops = plan.gpu.flops(t.precision.param)
        comm = self.counter.summary(max(1, counted)) if self.counter else {}
        measured = {
            "peak_memory_bytes": peak,
            "step_s": step_s,
            "tokens_per_s_per_gpu": tokens / step_s if times else None,
            "mfu": flop / (step_s * peak_flops) if times else None,
            "elements_per_step": comm.get("elements_per_step"),
            "bytes_per_step": comm.get("bytes_per_step"),
            "per_collective": comm.get("per_collective"),
            "memory_by_category_rank0": self.memory_by_category,
        }
        pred = plan.predicted
        pred_mem = None if pred is None else pred.per_gpu["total_bytes"]
        if pred is not None and self.device.type == "cpu" and plan.strategy == "offload-all":
            # a CPU rank has no device memory to offload from: offload-all holds what zero3 does
            from ..estimate import estimate_one

            pred_mem = estimate_one(plan.scenario(), "zero3").memory.total_bytes
        predicted = None if pred is None else {
            "peak_memory_bytes": pred_mem, "step_s": pred.step_s,
            "tokens_per_s_per_gpu": pred.tokens_per_s_per_gpu, "mfu": pred.mfu,
            "elements_per_step": pred.elements_per_step, "bytes_per_step": pred.bytes_per_step,
        }
        return {
            "strategy": plan.strategy, "world_size": self.world, "device": self.device.type,
            "model": plan.model.name, "start_step": start, "end_step": self.step,
            "losses": losses, "grad_norms": norms, "config": asdict(self.cfg),
            "measured": measured, "predicted": predicted,
        }


class _NoBar:
    def __enter__(self):
        return None

    def __exit__(self, *a):
        return False


def _progress(enabled: bool, total: int):
    if not enabled:
        return _NoBar()
    from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

    return Progress(TextColumn("{task.description}"), BarColumn(), TimeRemainingColumn(),
                    transient=True)


def compare_lines(report: dict) -> list[str]:
    """Predicted against measured, one line per figure (rank 0 prints them)."""
    m, p = report["measured"], report["predicted"] or {}
    rows = [("peak memory per rank", "peak_memory_bytes", lambda v: f"{v / 2**20:,.1f} MiB"),
            ("communication per step", "elements_per_step", lambda v: f"{v:,} elements"),
            ("bytes per step", "bytes_per_step", lambda v: f"{v / 2**20:,.2f} MiB"),
            ("step time", "step_s", lambda v: f"{v * 1e3:,.1f} ms"),
            ("tokens/s per rank", "tokens_per_s_per_gpu", lambda v: f"{v:,.0f}"),
            ("MFU", "mfu", lambda v: f"{v:.1%}")]
    out = [f"{'figure':24s} {'predicted':>20s} {'measured':>20s} {'error':>8s}",
           "(error = (predicted - measured) / measured)"]
    for label, key, fmt in rows:
        mv, pv = m.get(key), p.get(key)
        ms = fmt(mv) if mv is not None and not (isinstance(mv, float) and math.isnan(mv)) else "-"
        ps = fmt(pv) if pv is not None else "-"
        err = f"{relative_error(pv, mv):+.1%}" if (mv and pv) else ""  # (predicted - measured) / measured
        out.append(f"{label:24s} {ps:>20s} {ms:>20s} {err:>8s}")
    return out


def write_report(report: dict, ckpt_dir: str) -> Path:
    path = Path(ckpt_dir) / "run_report.json"
    write_atomic(path, json.dumps(report, indent=2, default=str) + "\n")
    return path
