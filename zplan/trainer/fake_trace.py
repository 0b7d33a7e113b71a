"""Trace a training step at real scale without real memory: FakeTensorMode plus the fake
process group, in one process, with PyTorch's FSDPMemTracker counting what FSDP2 would hold on
one rank (fake_tracker.py: the tracker with what a real run would not show taken out). Llama
3.1 70B at 16 ranks traces in 15-25 s on one core.

Used by `zplan verify --fake` (and benchmarks/fake_matrix.py) to hold the planner against
PyTorch's own accounting at sizes no test machine can run. Besides the peak by category it
reports the phase of the step where the peak happened: forward, loss (the loss's forward and
backward, outside every module), backward or optimizer.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

from .fake_tracker import propagation_outside_trace, tracker_class

PHASES = ("forward", "loss", "backward", "optimizer")


def _init_optimizer_state(optim) -> None:
    """One AdamW step on zero gradients, before tracing: the state (exp_avg, exp_avg_sq, step)
    exists from then on, as in every step of a run after its first, so one traced step shows
    the steady state. (The first step's peak is never higher: it creates the same state in its
    optimizer step, with no state held before.)"""
    import torch

    for group in optim.param_groups:
        for p in group["params"]:
            p.grad = torch.zeros_like(p)
    optim.step()
    optim.zero_grad(set_to_none=True)


# FSDPMemTracker's categories allocated off the default stream, as the planner's kinds (whose
# stream memory_timeline.STREAM names): all-gather outputs, and the sharded gradients (views of
# the reduce-scatter outputs); every other category is on the default stream.
TRACKER_KIND = {"All Gather": "all_gather", "Sharded Grad": "grads"}
RESERVE_STEPS = 3  # the simulated reserve settles by the third step (Llama 3.1 8B, 8 and 128 ranks)


def simulated_reserved(allocations: list, expandable_segments: bool) -> int:
    """What PyTorch's caching allocator reserves for the recorded storages in their order
    (caching_allocator.CachingAllocator), each on the stream FSDP2 allocates its category on
    (its category as the tracker last labelled it)."""
    from ..caching_allocator import CachingAllocator
    from ..memory_timeline import STREAM

    sim = CachingAllocator(expandable_segments)
    live: dict[int, int] = {}  # storage -> its current block's key (a resize makes a new one)
    for n, (op, winfo, now) in enumerate(allocations):
        if id(winfo) in live:  # freed, or resized: the old block goes first
            sim.free(live.pop(id(winfo)))
        if op in ("ADD", "SIZE") and now > 0:
            kind = TRACKER_KIND.get(str(getattr(winfo.reftype, "value", winfo.reftype)), "activations")
            sim.malloc(n, now, STREAM[kind])
            live[id(winfo)] = n
    return sim.peak_reserved_bytes


def trace_peak(plan, steps: int = 1, reserved: bool = False) -> dict:
    """Peak bytes per category on rank 0 of plan.num_gpus fake ranks (FSDP2 strategies), with
    "phase" naming where in the step the peak was reached; with `reserved`, also what the caching
    allocator would reserve over the traced steps ("reserved": {"classic": bytes, "expandable":
    bytes})."""
    import torch
    import torch.distributed as dist
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from .micro_batch import forward_loss
    from .model import Transformer
    from .parallel import build_mesh, build_optimizer, parallelize

    if plan.strategy in ("ddp", "zero1"):
        raise ValueError("--fake traces the FSDP2 strategies; ddp and zero1 replicate the model")
    dist.init_process_group("fake", rank=0, world_size=plan.num_gpus, store=FakeStore())
    try:
        device = torch.device("cpu")
        mesh = build_mesh(plan, device)  # outside the fake mode: the mesh is real bookkeeping
        # built on the meta device outside the fake mode: parallelize casts it to the master
        # dtype first, and a fake parameter cannot be swapped (the mode holds weak references)
        with torch.device("meta"):
            model = Transformer(plan.model)
        model.return_cache(plan.train.kv_cache)
        model.expand_kv(plan.train.attention_expands_kv)
        model.attention_kernel(plan.train.attention_kernel)
        with FakeTensorMode(allow_non_fake_inputs=True), propagation_outside_trace():
            par = parallelize(model, plan, device, mesh=mesh)
            # the plan's AdamW (fake_cell plans single-tensor: a multi-tensor peak is inflated
            # under fake tensors), whose temporaries the planner prices (memory_timeline.py)
            optim = build_optimizer(par, plan, lr=1e-4)
            _init_optimizer_state(optim)
            tracker = tracker_class()(par.model, optim)
            if reserved:
                tracker.allocations = []
            t = plan.train
            held = None  # the output a loop holds into the next forward (outputs_until_next_forward)
            with tracker:
                for step in range(steps):
                    for micro in range(t.grad_accum):
                        # input ids and labels, two tensors as the loop's (Prefetcher.get)
                        x, y = (torch.randint(0, plan.model.vocab_size, (t.micro_batch, t.seq_len))
                                for _ in range(2))
                        sync = micro == t.grad_accum - 1 or t.reduce_every_microbatch
                        loss, kept = forward_loss(par, t, x, y, sync)  # the loop's own code
                        held = kept if t.outputs_until_next_forward else None
                        loss.backward()
                        del kept, loss
                        if micro < t.grad_accum - 1:
                            tracker.reset_mod_stats()
                    del x, y  # the loop's are locals of its micro-batch loop, gone at the step
                    optim.step()
                    optim.zero_grad(set_to_none=True)
                    tracker.reset_mod_stats()
            del held
            snap = tracker.get_tracker_snapshot("peak")
        per = next(iter(snap.values()))
        out: dict = {str(getattr(k, "value", k)): int(v) for k, v in per.items()}
        out["phase"] = tracker.peak_phase
        if reserved:
            out["reserved"] = {"classic": simulated_reserved(tracker.allocations, False),
                               "expandable": simulated_reserved(tracker.allocations, True)}
        return out
    finally:
        with contextlib.suppress(Exception):
            dist.destroy_process_group()


@dataclass(frozen=True)
class FakeCell:
    """One traced configuration against the planner's allocated peak (torch layout)."""

    name: str
    predicted_bytes: int
    traced_bytes: int
    predicted_phase: str
    traced_phase: str
    categories: dict
    trace_s: float
    # with `reserved`, per allocator ("classic", "expandable"): (the planner's reserved bytes, the
    # caching allocator's simulated over the traced steps' storages, simulated_reserved)
    reserved_by_allocator: dict | None = None

    @property
    def error(self) -> float:
        return (self.predicted_bytes - self.traced_bytes) / self.traced_bytes

    def ok(self, tolerance: float) -> bool:
        return abs(self.error) <= tolerance and self.predicted_phase == self.traced_phase


def planned_cell(model: str, world: int, seq_len: int, micro_batch: int, checkpointing: str,
                 strategy: str, linear_loss: str = "none", embed_head_unit: str = "separate",
                 logits_kept: bool = True, grad_accum: int = 1, **options):
    """The planner's side of a fake cell, without tracing: the scenario, planned as on a GPU (no
    CUDA context, allocated bytes) but with the CPU's composite RMSNorm and single-tensor AdamW,
    which the trace runs, and the strategy's estimate. `options` are further ScenarioOptions."""
    from ..errors import UsageError
    from ..estimate import estimate_one
    from ..scenario_options import DEFAULT_CLUSTER, build, cpu_ranks

    if strategy in ("ddp", "zero1"):
        raise UsageError(f"--fake traces the FSDP2 strategies; {strategy} replicates the model")
    if strategy.startswith("offload"):
        raise UsageError(f"--fake compares device memory, and the tracker counts {strategy}'s host-resident "
                         f"state as its own (the trace equals zero3's): trace zero3, or run verify without --fake")
    sc = build(cpu_ranks(model=model, gpu=None, cluster=DEFAULT_CLUSTER, gpus=str(world),
                         seq_len=seq_len, micro_batch=micro_batch, fused_norm=False,
                         checkpointing=checkpointing, optimizer_kernels="single",
                         linear_loss=linear_loss, embed_head_unit=embed_head_unit,
                         logits_kept=logits_kept, grad_accum=grad_accum, **options))
    from ..plan import model_refusal

    why = model_refusal(sc.model)
    if why:  # the trace runs the trainer's model: one it cannot build is refused, not crashed on
        raise UsageError(f"--fake traces zplan's trainer on {model}, and {why}: trace a model it builds "
                         f"(llama-3.1-8b, qwen3-8b, mistral-7b, ...)")
    r = estimate_one(sc, strategy)
    if r.memory is None:
        raise UsageError(f"{strategy}: {r.unavailable}")
    return sc, r


def fake_cell(model: str, world: int, seq_len: int, micro_batch: int, checkpointing: str,
              strategy: str, linear_loss: str = "none", embed_head_unit: str = "separate",
              logits_kept: bool = True, grad_accum: int = 1, reserved: bool = False,
              **options) -> FakeCell:
    """Plan one configuration (`planned_cell`, `options` further ScenarioOptions) and trace it.
    With `reserved`, also the reserved bytes, planned (the caching-allocator model) and simulated
    over RESERVE_STEPS traced steps."""
    import time

    from ..plan import make_plan

    args = (model, world, seq_len, micro_batch, checkpointing, strategy, linear_loss,
            embed_head_unit, logits_kept, grad_accum)
    sc, r = planned_cell(*args, **options)
    t0 = time.perf_counter()
    peak = trace_peak(make_plan(sc, strategy, world * micro_batch * grad_accum, r),
                      steps=RESERVE_STEPS if reserved else (2 if sc.train.outputs_until_next_forward else 1),
                      reserved=reserved)
    phase = peak.pop("phase")
    both = None
    if reserved:
        simulated = peak.pop("reserved")
        both = {name: (planned_cell(*args, **options, fragmentation=None,
                                    expandable_segments=name == "expandable")[1]
                       .memory.reserved_bytes, simulated[name])
                for name in ("classic", "expandable")}
    accum = f" A={grad_accum}" if grad_accum > 1 else ""
    return FakeCell(f"{model} W={world} s={seq_len} b={micro_batch}{accum} {checkpointing} {strategy}",
                    r.memory.allocated_bytes, peak["Total"], r.memory.peak_phase, phase or "-",
                    peak, time.perf_counter() - t0, both)
