"""The search: every configuration, ranked by predicted step time for the same global batch.

A candidate is a strategy (HSDP once per shard size that divides N and, across nodes, a node; or
the one --shard-size gives) x activation checkpointing (none, selective, full, and the first k blocks
checkpointed at the least k that fits: `_least_first_k`) x micro-batch (the largest that fits, and the
next smaller; one micro-batch per step is tried on its own, as accumulation changes what is
held; `--objective memory`: the smallest, without prefetch) x gradient accumulation (to reach
the global batch) x blocks per unit x prefetch. It is feasible when it fits GPU memory
less the headroom and, with offload, the node's host RAM. Memory is checked first; only feasible
candidates are timed. Options the user gives (ScenarioOptions.given, PINNABLE: checkpointing
with its k, micro-batch, accumulation, blocks per unit, prefetch) are kept as given, not searched.
"""

from __future__ import annotations

import gc
import math
from contextlib import nullcontext
from dataclasses import dataclass, replace
from functools import lru_cache

from . import policy
from .errors import PlanError, UsageError
from .parse import check_choice
from .estimate import (TIGHT_FREE_FRACTION, StrategyEstimate, estimate_one, fit_margin, fits,
                       unaligned_gemm_dims, unavailable_reason)
from .memory import allocated_bytes, memory
from .memory_reserve import without_forward_holes
from .scenario import Scenario
from .specs import MAX_GRAD_ACCUM, MAX_MICRO_BATCH, TE_FLOAT8_UNMODELLED
from .strategies import STRATEGIES, effective
from .units import fmt_bytes, fmt_s, nbytes

CHECKPOINTING = ("none", "selective", "full", "first-k")  # every-k at the scenario's own k only
# the scenario options the search varies; one the user gives (ScenarioOptions.given) is kept as
# given: its checkpointing (with its k), micro-batch, accumulation, blocks per unit, prefetch
PINNABLE = frozenset({"checkpointing", "checkpoint_every", "checkpoint_first", "micro_batch", "grad_accum",
                      "blocks_per_unit", "prefetch"})
BLOCKS_PER_UNIT = (1, 2, 4)
SIMPLICITY = {n: i for i, n in enumerate(STRATEGIES)}
TIE = 0.03  # within the model's resolution, a simpler strategy within 3% of the fastest wins
# where it needs no more memory than the fastest
WHOLE_MATRIX_OPTIMIZERS = ("muon",)


@dataclass(frozen=True)
class Candidate:
    family: str
    sc: Scenario
    result: StrategyEstimate
    usable_bytes: int

    @property
    def step_s(self) -> float:
        return self.result.timing.step_s

    @property
    def total_bytes(self) -> int:
        return self.result.memory.total_bytes

    def label(self) -> str:
        t = self.sc.train
        parts = [self.family if self.family != "hsdp" else f"hsdp(S={self.sc.hsdp_shard})",
                 f"mb={t.micro_batch}", f"accum={t.grad_accum}",
                 f"ckpt={policy.checkpointing_label(t)}"]
        if t.blocks_per_unit > 1:
            parts.append(f"blocks/unit={t.blocks_per_unit}")
        if not t.prefetch:
            parts.append("no-prefetch")
        return " ".join(parts)


@dataclass(frozen=True)
class Recommendation:
    winner: Candidate
    ranked: list[Candidate]
    best_by_family: dict[str, Candidate]
    rejected: dict[str, str]  # family -> the exact reason none is feasible
    lost: dict[str, str]  # family -> why its best lost to the winner
    flags: list[str]
    evaluated: int
    global_batch: int


def plan_for_runner(opts, runner: str | None) -> list[str]:
    """Set the layout of `opts` (a ScenarioOptions) from what will run the plan: zplan's trainer
    unless `--for deepspeed` or `--layout zero` says otherwise; a contradiction is refused.
    Returns what was assumed, for the 'using' lines."""
    from .plan import LAYOUT_RUNNER, RUNNER_LAYOUT

    if runner is not None:
        check_choice(runner, "--for", tuple(RUNNER_LAYOUT))
    if opts.layout is not None:
        check_choice(opts.layout, "--layout", tuple(LAYOUT_RUNNER))
        if runner is not None and RUNNER_LAYOUT[runner] != opts.layout:
            raise UsageError(f"--for {runner} runs the {RUNNER_LAYOUT[runner]} layout, not --layout "
                             f"{opts.layout}; drop --layout (it follows --for)")
        runner = LAYOUT_RUNNER[opts.layout]
    if runner is None:
        opts.layout = RUNNER_LAYOUT["zplan"]
        return ["a plan for zplan's trainer (zplan launch, torch layout; --for deepspeed to export instead)"]
    opts.layout = RUNNER_LAYOUT[runner]
    return []


@lru_cache(maxsize=64)
def _micro_batches(per_gpu: int) -> tuple[int, ...]:
    """Divisors of the per-GPU batch, largest first (micro-batch x accumulation = per-GPU batch),
    found in O(sqrt(per_gpu)) steps; at most TrainSpec's micro-batch limit. search() bounds
    per_gpu by the accumulation limit, so micro-batch 1 is always among them."""
    small = [d for d in range(1, math.isqrt(per_gpu) + 1) if per_gpu % d == 0]
    divisors = sorted(set(small + [per_gpu // d for d in small]), reverse=True)
    return tuple(d for d in divisors if d <= MAX_MICRO_BATCH)


def _largest_fitting(mbs: tuple[int, ...], fits_at) -> tuple[int, int]:
    """Index of the largest micro-batch that fits (memory grows with it), by bisection over
    the divisors, largest first; and how many were probed. Keeps the search bounded: O(log d)
    probes instead of one per divisor of a huge per-GPU batch."""
    lo, hi, probes = 0, len(mbs), 0
    while lo < hi:
        mid = (lo + hi) // 2
        probes += 1
        if fits_at(mbs[mid]):
            hi = mid
        else:
            lo = mid + 1
    return lo, probes


def _checkpointing(base: Scenario, num_layers: int, pinned: frozenset[str] = frozenset()) -> list[tuple[str, int]]:
    """The checkpointing modes searched: none, selective, full, first-k (its k found per
    micro-batch, `_least_first_k`; only where a model has two blocks or more), and every-k where
    the scenario asks for it, at its own k. first-k at the least k that fits recomputes no more
    than every-k at any k that fits: the same blocks' activations are dropped, and the recompute
    of the first blocks runs at the end of backward, when least is held. Only the scenario's own
    mode where the user gave one (`pinned`)."""
    if "checkpointing" in pinned:
        return [(base.train.checkpointing, base.train.checkpoint_every)]
    out = [(c, base.train.checkpoint_every) for c in CHECKPOINTING if c != "first-k" or num_layers > 1]
    if base.train.checkpointing == "every-k" and base.train.checkpoint_every <= num_layers:
        out.append(("every-k", base.train.checkpoint_every))
    return out


def _least_first_k(probe, num_layers: int, none_margin: int | None = None) -> tuple[int | None, int]:
    """The least k in 1..num_layers-1 at which checkpointing the first k blocks fits (memory
    falls as k grows: each block checkpointed keeps only its input); None where even
    num_layers-1 does not fit (full checkpointing is searched on its own). And how many were
    probed. `probe(k)` is (fits, margin: bytes over the limit, negative under:
    estimate.fit_margin); `none_margin` the margin with nothing checkpointed (k = 0, which the
    caller found not to fit).
    Memory falls by about one block's kept activations per k, so the least k is aimed at where
    the line through the bracketing probes' margins crosses the limit, and the k across that
    line is probed beside it: two probes settle an aim one block off. An aim that does not
    halve the bracket is followed by two bisections, so the probes stay within twice
    bisection's 1 + log2(num_layers - 1) whatever the margins (a review's adversarial margins
    took 17 probes at 126 blocks with one bisection owed); only the fit answers decide k. The margins are the GPU's:
    where the host's memory is what does not fit, a margin can be under zero for a k that does
    not fit, and the search bisects."""
    ok, m_hi = probe(num_layers - 1)
    if not ok:
        return None, 1
    lo, hi, m_lo, probes = 0, num_layers - 1, none_margin, 1  # k = lo does not fit, k = hi does

    def step(k: int) -> bool:
        nonlocal lo, hi, m_lo, m_hi, probes
        ok, m = probe(k)
        probes += 1
        if ok:
            hi, m_hi = k, m
        else:
            lo, m_lo = k, m
        return ok

    owed = 0  # bisections owed by an aim that did not halve the bracket
    while hi - lo > 1:
        width = hi - lo
        if not owed and m_lo is not None and m_hi is not None and m_lo > 0 >= m_hi:
            k = min(max(lo + math.ceil(width * m_lo / (m_lo - m_hi)), lo + 1), hi - 1)
            j = k - 1 if step(k) else k + 1  # across the aimed line
            if lo < j < hi:
                step(j)
            if hi - lo > width // 2:
                owed = 2
        else:
            step((lo + hi) // 2)
            owed = max(0, owed - 1)
    return hi, probes


def _usable(sc: Scenario, headroom: float) -> int:
    return int(sc.hw.gpu.memory_bytes * (1 - headroom))


def _variants(base: Scenario, family: str) -> list[Scenario]:
    """HSDP once per shard size: the one --shard-size gives, else each that divides N and, where
    N spans nodes, a node (groups tiling nodes evenly; one straddling a node boundary is priced
    at its narrowest slice, nccl.contiguous_shape, and is planned with --shard-size); inside one
    node every divisor of N (6 GPUs: 2 and 3)."""
    if family != "hsdp":
        return [base]
    if base.shard_size is not None:
        return [base]
    gpn, n = base.hw.cluster.gpus_per_node, base.n
    sizes = [s for s in range(2, min(gpn, n) + 1) if n % s == 0 and (n <= gpn or gpn % s == 0) and s < n]
    return [replace(base, shard_size=s) for s in sizes]


def given_text(base: Scenario, pinned: frozenset[str]) -> str:
    """The given options of PINNABLE as flags with their values, e.g. '--micro-batch 2,
    --checkpointing selective'."""
    t = base.train
    return ", ".join(f"--{k.replace('_', '-')} {str(getattr(t, k)).lower() if isinstance(getattr(t, k), bool) else getattr(t, k)}"
                     if k != "prefetch" else ("--prefetch" if t.prefetch else "--no-prefetch")
                     for k in sorted(pinned & PINNABLE))


def pinned_micro_batches(base: Scenario, per_gpu: int, pinned: frozenset[str]) -> tuple[int, ...] | None:
    """The one micro-batch a given --micro-batch or --grad-accum leaves for this per-GPU batch
    (None where neither is given); a UsageError naming the fix where they cannot make it."""
    t = base.train
    mb_given, accum_given = "micro_batch" in pinned, "grad_accum" in pinned
    if not (mb_given or accum_given):
        return None
    mb = t.micro_batch if mb_given else per_gpu // t.grad_accum
    if mb_given and accum_given and mb * t.grad_accum != per_gpu:
        raise UsageError(f"--micro-batch {t.micro_batch} x --grad-accum {t.grad_accum} is "
                         f"{mb * t.grad_accum} sequences per GPU, the global batch {per_gpu} per GPU; "
                         f"use --global-batch {mb * t.grad_accum * base.n}, or drop one of the two")
    if mb < 1 or per_gpu % mb or (accum_given and mb * t.grad_accum != per_gpu):
        given = f"--micro-batch {t.micro_batch}" if mb_given else f"--grad-accum {t.grad_accum}"
        k = t.micro_batch if mb_given else t.grad_accum
        raise UsageError(f"the global batch's {per_gpu} sequences per GPU are not a multiple of {given}; use "
                         f"--global-batch {max(1, per_gpu // k) * k * base.n} (a multiple of {k * base.n})")
    return (mb,)


def default_per_gpu(base: Scenario, pinned: frozenset[str], fallback: int) -> int:
    """Sequences per GPU per step when no global batch is given: micro-batch x accumulation
    where both are given, else `fallback` rounded to a multiple of the one given."""
    t = base.train
    if {"micro_batch", "grad_accum"} <= pinned:
        return t.micro_batch * t.grad_accum
    k = t.micro_batch if "micro_batch" in pinned else t.grad_accum if "grad_accum" in pinned else 1
    return max(1, round(fallback / k)) * k


def search(base: Scenario, global_batch: int, objective: str = "throughput",
           headroom: float = TIGHT_FREE_FRACTION, families: list[str] | None = None,
           alternatives: bool = True, pinned: frozenset[str] = frozenset(),
           relaxed: bool = False) -> Recommendation:
    """_search with Python's cycle collector paused: the search makes hundreds of thousands of
    short-lived objects (events, allocator blocks, DeepSpeed's simulated trace) and no cycles
    worth collecting, and the collections that its allocations triggered, each walking every
    cached spec, took 15-25% of a DeepSpeed search's time (70B on 64 GPUs, --for deepspeed)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        return _search(base, global_batch, objective, headroom, families, alternatives, pinned,
                       relaxed)
    finally:
        if enabled:
            gc.enable()


def _search(base: Scenario, global_batch: int, objective: str = "throughput",
            headroom: float = TIGHT_FREE_FRACTION, families: list[str] | None = None,
            alternatives: bool = True, pinned: frozenset[str] = frozenset(),
            relaxed: bool = False) -> Recommendation:
    """Search every configuration; raise PlanError with what would help when nothing fits.
    With `alternatives`, also under expandable segments where the plan assumes classic ones
    (`_expandable_alternative`): a flag, or a hint when nothing fits, where they change the
    answer. `pinned`: the options of PINNABLE the user gave, kept at the scenario's values.
    Each checkpointing mode takes the two largest micro-batches that fit, from the largest
    that fits with prefetch off. `relaxed`: that largest one found as always, the candidates
    from it on judged without the forward's holes (memory_reserve.without_forward_holes: never
    more reserved), so each is at least as fast as the exact search's at the same micro-batch
    (first-k: no more blocks checkpointed); _expandable_alternative's gate."""
    n = base.n
    pinned = frozenset(pinned) & PINNABLE
    if global_batch % n:
        raise UsageError(f"--global-batch {global_batch} is not a multiple of {n} GPUs; "
                         f"use {max(n, global_batch // n * n)} or another multiple of {n}")
    per_gpu = global_batch // n
    if per_gpu > MAX_GRAD_ACCUM:
        raise UsageError(f"--global-batch {global_batch} is {per_gpu:,} sequences per GPU per step, "
                         f"over the limit of {MAX_GRAD_ACCUM:,}; use a smaller batch or more GPUs")
    given_mbs = pinned_micro_batches(base, per_gpu, pinned)
    families = families or list(STRATEGIES)
    feasible: list[Candidate] = []
    rejected: dict[str, str] = {}
    unavailable: set[str] = set()
    evaluated = 0
    L = base.model.num_layers
    holes_off = without_forward_holes if relaxed else nullcontext
    for family in families:
        variants = _variants(base, family)
        why = unavailable_reason(variants[0], family) if variants else None
        if why:
            rejected[family] = why
            unavailable.add(family)
            continue
        found = []
        for sc0 in variants:
            usable = _usable(sc0, headroom)
            for ckpt, every in _checkpointing(base, L, pinned):
                if base.train.te_float8 and ckpt in TE_FLOAT8_UNMODELLED:
                    continue  # TransformerEngine's saves under these modes are not modelled
                for bpu in ((base.train.blocks_per_unit,) if "blocks_per_unit" in pinned else BLOCKS_PER_UNIT):
                    if "blocks_per_unit" not in pinned and (bpu > L or (bpu > 1 and family in ("ddp", "zero1", "zero2"))):
                        continue  # units only matter where weights are gathered per unit
                    taken = 0

                    first_k = ckpt == "first-k" and "checkpoint_first" not in pinned  # k searched
                    fixed_first = base.train.checkpoint_first if not first_k else L - 1

                    def at(mb: int, prefetch: bool, first: int = fixed_first, mode: str = ckpt) -> Scenario:
                        return replace(sc0, train=base.train.model_copy(update={
                            "checkpointing": mode, "checkpoint_every": every, "checkpoint_first": first,
                            "blocks_per_unit": bpu, "micro_batch": mb, "grad_accum": per_gpu // mb,
                            "prefetch": prefetch}))

                    mbs = given_mbs or _micro_batches(per_gpu)
                    prefetches = (base.train.prefetch,) if "prefetch" in pinned else (True, False)
                    if first_k and objective == "memory":
                        continue  # full checkpointing holds the least
                    if objective == "memory":  # the least memory: the smallest micro-batch, no
                        # prefetch; and one micro-batch per step, which holds no accumulated
                        # gradients (--reduce-last-only) and may need less
                        with holes_off():  # relaxed: the forward's holes not priced
                            for mb in sorted({mbs[-1], per_gpu} & set(mbs)):
                                sc = at(mb, prefetches[-1])
                                evaluated += 1
                                if fits(sc, family, usable):
                                    found.append(Candidate(family, sc, estimate_one(sc, family), usable))
                        continue
                    # one micro-batch per step (no accumulation) holds no accumulated gradients
                    # (--reduce-last-only) and, under DeepSpeed's ZeRO-1, no whole gradients: it
                    # may fit where a smaller micro-batch with accumulation does not, so it is
                    # tried on its own; memory grows with the micro-batch among the others
                    one = 1 if (mbs and mbs[0] == per_gpu) else 0
                    evaluated += one
                    if one and fits(at(mbs[0], False), family, usable):
                        start, probes = 0, 0
                    else:
                        rest, probes = _largest_fitting(
                            mbs[one:], lambda mb: fits(at(mb, False), family, usable))
                        start = one + rest
                    evaluated += probes
                    with holes_off():  # relaxed: from the exact start on, the forward's holes not priced
                        unneeded = False  # first-k: nothing checkpointed fits already
                        for mb in mbs[start:]:
                            for prefetch in prefetches:
                                sc = at(mb, prefetch)
                                if first_k:  # the fewest blocks checkpointed that fit
                                    evaluated += 1
                                    ok, none_over = fit_margin(at(mb, prefetch, mode="none"), family, usable)
                                    if ok and not relaxed:
                                        # first-k would only recompute more, here and at every
                                        # smaller micro-batch (memory falls with it)
                                        unneeded = True
                                        break
                                    if ok:  # relaxed: a bound for the exact search's first-k here,
                                        # nothing checkpointed, and on to the next micro-batch, which
                                        # the exact search may reach
                                        sc = at(mb, prefetch, mode="none")
                                    else:
                                        k, probes = _least_first_k(
                                            lambda k: fit_margin(at(mb, prefetch, k), family, usable), L, none_over)
                                        evaluated += probes
                                        if k is None:
                                            continue
                                        sc = at(mb, prefetch, k)
                                else:
                                    evaluated += 1
                                    if not fits(sc, family, usable):
                                        continue
                                found.append(Candidate(family, sc, estimate_one(sc, family), usable))
                                taken += 1
                                break  # prefetch off only when prefetch on does not fit
                            if taken >= 2 or unneeded:
                                break
        if found:
            feasible += found
        else:
            rejected[family] = _why_not(base, family, headroom, per_gpu, pinned)
    if not feasible:
        if set(rejected) == unavailable:  # every family asked for cannot run at all: not a fit
            name, why = next(iter(rejected.items()))
            raise UsageError(f"--strategy {name} cannot be planned here: {why}")
        alt, _ = (_expandable_alternative(base, global_batch, objective, headroom, families, pinned)
                  if alternatives else (None, 0))
        if pinned and alt is None:  # what the given values cost: the search without them
            try:
                free = search(base, global_batch, objective, headroom, families, alternatives=False)
            except (PlanError, UsageError):
                free = None
            if free is not None:
                names = given_text(base, pinned)
                raise PlanError(f"nothing fits {base.n} x {base.hw.gpu.name} for global batch {global_batch} "
                                f"with {names} as given; without them {free.winner.label()} fits "
                                f"({fmt_bytes(free.winner.total_bytes)} per GPU): drop them to let "
                                f"recommend choose")
        raise PlanError(_nothing_fits(base, global_batch, headroom, rejected, alt))
    key = (lambda c: (c.step_s, c.total_bytes)) if objective == "throughput" else \
          (lambda c: (c.total_bytes, c.step_s))
    ranked = sorted(feasible, key=key)
    winner = ranked[0]
    if objective == "throughput":  # prefer the simplest strategy among near-ties that leave at
        # least the fastest's free memory (simplicity is not worth a tighter fit)
        near = [c for c in ranked if c.step_s <= winner.step_s * (1 + TIE) and c.total_bytes <= winner.total_bytes]
        winner = min(near, key=lambda c: (SIMPLICITY[c.family], c.step_s))
        ranked.remove(winner)
        ranked.insert(0, winner)
    best: dict[str, Candidate] = {}
    for c in ranked:
        best.setdefault(c.family, c)
    lost = {f: _why_lost(c, winner, objective) for f, c in best.items() if c is not winner}
    flags = _flags(base, winner)
    alt, alt_evaluated = (_expandable_alternative(base, global_batch, objective, headroom, families, pinned,
                                                  winner) if alternatives else (None, 0))
    evaluated += alt_evaluated  # the second search's configurations are searched too
    if alt is not None and _better(alt, winner, objective):
        if alt.label() == winner.label():
            what = (f"the same configuration needs {fmt_bytes(alt.total_bytes)} per GPU instead of "
                    f"{fmt_bytes(winner.total_bytes)}")
        else:
            gain = (f"{fmt_s(alt.step_s)} per step, {(alt.step_s / winner.step_s - 1) * 100:+.0f}%"
                    if objective == "throughput" else f"{fmt_bytes(alt.total_bytes)} per GPU")
            what = f"{alt.label()} fits: {gain}"
        flags.append(f"with expandable segments {what}; {_expandable_how(base)}")
    return Recommendation(winner, ranked, best, rejected, lost, flags, evaluated, global_batch)


def _expandable_how(base: Scenario) -> str:
    """How a user gets expandable segments: plan again with them (this plan assumes PyTorch's
    classic segments); zplan launch sets the allocator for such a plan, DeepSpeed's launcher
    does not."""
    return f"plan again with --expandable-segments (this plan assumes classic segments); {_expandable_run(base)}"


def _expandable_run(base: Scenario) -> str:
    if base.train.layout == "torch":
        return "zplan launch runs such a plan under PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True"
    return "set PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True in the run's environment"


def _expandable_alternative(base: Scenario, global_batch: int, objective: str, headroom: float,
                            families: list[str] | None, pinned: frozenset[str] = frozenset(),
                            winner: Candidate | None = None) -> tuple[Candidate | None, int]:
    """The winner were the run to use expandable segments, where the plan assumes PyTorch's
    classic ones (and no flat --fragmentation): one segment per stream, grown in 20 MiB pages,
    leaves fewer holes (docs/reserved-matrix.md: 1-15% less reserved than classic segments on
    the same traced steps), which can fit a larger micro-batch or less recomputation. None where
    it does not apply or nothing fits either way; with the configurations that search tried.
    Beside a classic `winner`, a relaxed search goes first (_search's `relaxed`: each mode's
    largest micro-batch found exactly, the candidates from it on judged with no forward hole
    priced, memory_reserve.without_forward_holes, never more reserved): at each micro-batch the
    exact search takes (the largest that fits and the next, memory falling with the
    micro-batch), the relaxed one has a candidate at least as fast (no more blocks
    checkpointed; where nothing checkpointed fits relaxed, that one, and on to the next
    micro-batch; prefetch on where it fits), so where its best is not _better than the winner,
    neither is the exact search's, which is skipped: pricing the forward's holes in it had
    doubled the search's time. This holds as far as a step is no slower with fewer blocks
    checkpointed or with prefetch on, which the time model gives (tests/test_recommend.py holds
    it on four scenarios and three families)."""
    a = base.assume
    if a.expandable_segments or a.fragmentation is not None:
        return None, 0
    other = replace(base, assume=a.model_copy(update={"expandable_segments": True}))
    relaxed = 0
    if winner is not None:
        try:
            r = search(other, global_batch, objective, headroom, families, alternatives=False, pinned=pinned,
                       relaxed=True)
        except (PlanError, UsageError):
            return None, 0
        key = (lambda c: c.step_s) if objective == "throughput" else (lambda c: c.total_bytes)
        if not _better(min(r.ranked, key=key), winner, objective):
            return None, r.evaluated
        relaxed = r.evaluated
    try:
        r = search(other, global_batch, objective, headroom, families, alternatives=False, pinned=pinned)
    except (PlanError, UsageError):
        return None, relaxed
    return r.winner, relaxed + r.evaluated


def _better(c: Candidate, w: Candidate, objective: str) -> bool:
    """`c` beats `w` by more than the model's resolution (TIE)."""
    if objective == "throughput":
        return c.step_s < w.step_s * (1 - TIE)
    return c.total_bytes < w.total_bytes * (1 - TIE)


SETUP_PEAK = "deepspeed.initialize moves the whole model to each GPU before ZeRO-3 partitions it"


def _why_not(base: Scenario, family: str, headroom: float, per_gpu: int = 1,
             pinned: frozenset[str] = frozenset()) -> str:
    """The exact reason no configuration of this family fits: the smallest one the search
    tried (micro-batch 1, accumulating to the per-GPU batch; what the user gave as given),
    explained."""
    variants = _variants(base, family)
    if not variants:
        top = min(base.hw.cluster.gpus_per_node, base.n)
        if top < 2 or base.n < 4:  # HSDP needs shard groups of 2 or more and 2 or more of them
            return f"HSDP needs at least 4 GPUs (two replicas of shard groups of 2 or more); {base.n} cannot"
        if base.n <= base.hw.cluster.gpus_per_node:  # inside one node: any divisor would do
            return (f"{base.n} GPUs have no divisor in 2..{base.n - 1}: HSDP needs two or more shard "
                    f"groups of equal size")
        return (f"no shard size in 2..{top} divides both "
                f"{base.n} GPUs and a node below N (--shard-size plans another)")
    least = {"checkpointing": "full", "blocks_per_unit": 1, "prefetch": False}
    base_tr = base.train.model_copy(update={k: v for k, v in least.items() if k not in pinned})
    # micro-batch 1 accumulating to the per-GPU batch, and one micro-batch per step (no
    # accumulated gradients): the smaller of the two the search tried
    mbs = pinned_micro_batches(base, per_gpu, pinned) or sorted({1, per_gpu})
    trains = [base_tr.model_copy(update={"micro_batch": mb, "grad_accum": per_gpu // mb})
              for mb in mbs if mb <= MAX_MICRO_BATCH]
    best = None
    for v in variants:
        for tr in trains:
            sc = replace(v, train=tr)
            m = memory(sc, effective(family, sc.train.layout))
            if best is None or m.steady_bytes < best[1].steady_bytes:
                best = (sc, m)
    sc, m = best
    usable = _usable(sc, headroom)
    cap = f"{fmt_bytes(usable)} usable ({fmt_bytes(sc.hw.gpu.memory_bytes)} less {headroom:.0%} headroom)"
    name = family if family != "hsdp" else f"hsdp (S={sc.hsdp_shard})"
    if m.host_bytes_per_node and m.host_bytes_per_node > sc.hw.cluster.host_ram_bytes:
        return (f"{name}: host RAM {fmt_bytes(m.host_bytes_per_node)} per node > "
                f"{fmt_bytes(sc.hw.cluster.host_ram_bytes)}")
    p = sc.train.precision
    if m.peak_phase == "setup":  # memory.setup_events: DeepSpeed moves the model whole first
        return (f"{name}: {SETUP_PEAK}, {fmt_bytes(m.allocated_bytes)} > {cap}; build the model under "
                f"deepspeed.zero.Init (HF Trainer and accelerate's zero3_init_flag do; drop --no-zero-init)")
    if not effective(family, sc.train.layout).params_sharded and m.params_bytes > usable:
        return f"{name}: replicated {p.param if sc.train.layout == 'zero' else p.master} weights alone are {fmt_bytes(m.params_bytes)} > {cap}"
    if m.model_state_bytes > usable:
        return (f"{name}: model state alone is {fmt_bytes(m.model_state_bytes)} (weights "
                f"{fmt_bytes(m.params_bytes)}, grads {fmt_bytes(m.grads_bytes)}, optimizer "
                f"{fmt_bytes(m.master_bytes + m.optimizer_bytes)}) > {cap}")
    mb = sc.train.micro_batch
    at = f"micro-batch {mb}" + (f" x {sc.train.grad_accum} accumulated" if sc.train.grad_accum > 1 else "")
    how = f"{policy.checkpointing_label(sc.train)} checkpointing"
    even = "as given, at" if pinned & {"micro_batch", "grad_accum", "checkpointing"} else "even at"
    return (f"{name}: needs {fmt_bytes(m.steady_bytes)} {even} {at} with {how} (model state "
            f"{fmt_bytes(m.model_state_bytes)}, gathered weights {fmt_bytes(m.gather_buffer_bytes)}, "
            f"activations {fmt_bytes(m.activation_bytes)}) > {cap}")


def _why_lost(c: Candidate, w: Candidate, objective: str) -> str:
    if objective == "memory":
        return f"uses {fmt_bytes(c.total_bytes)} per GPU vs {fmt_bytes(w.total_bytes)}"
    if c.step_s <= w.step_s * (1 + TIE):
        near = f"as fast ({fmt_s(c.step_s)}, {c.step_s / w.step_s - 1:+.1%}: within the model's {TIE:.0%} resolution)"
        if SIMPLICITY[w.family] < SIMPLICITY[c.family]:
            return f"{near} but {w.family} is simpler"
        # a simpler (or as simple) loser within the resolution: the tie-break keeps free memory
        return (f"{near} but needs {fmt_bytes(c.total_bytes)} per GPU against {fmt_bytes(w.total_bytes)}: "
                f"a near-tie goes to the simpler strategy only where it needs no more memory")
    a, b = c.result.timing, w.result.timing
    recompute = lambda t: t.breakdown_s.get("recompute", 0.0)  # noqa: E731  (the kernel model's; 0 at one efficiency)
    why = [r for r, applies in (("recomputation", recompute(a) > recompute(b) * (1 + TIE) + 1e-9
                                 or policy.uniform_mode(c.sc.train, c.sc.model.num_layers) != "none"
                                 and policy.uniform_mode(w.sc.train, w.sc.model.num_layers) == "none"),
                                ("smaller micro-batches", c.sc.train.micro_batch < w.sc.train.micro_batch))
           if applies] or ["its kernels: casts, copies, the layout's"]
    deltas = {
        "exposed communication": a.exposed_comm_s - b.exposed_comm_s,
        f"compute ({', '.join(why)})": a.compute_s - b.compute_s,
        "optimizer step": a.optimizer_s - b.optimizer_s,
        "offload (CPU optimizer and PCIe)": a.offload_s - b.offload_s,
        "contention (NCCL kernels holding SMs beside compute)": a.contention_s - b.contention_s,
    }
    what, d = max(deltas.items(), key=lambda kv: kv[1])
    pct = (c.step_s / w.step_s - 1) * 100
    return f"{fmt_s(c.step_s)} per step, {pct:+.0f}%: more {what} (+{fmt_s(d)}); best: {c.label()}"


def _flags(base: Scenario, w: Candidate) -> list[str]:
    flags = []
    t = base.train
    if t.optimizer in WHOLE_MATRIX_OPTIMIZERS and policy.optimizer_splits_matrices(effective(w.family, t.layout), t.layout):
        from . import muon
        from .compute import optimizer_ops
        elems = muon.matrix_elements(base)
        ns = sum(o.seconds for o in optimizer_ops(w.sc.for_strategy(w.result.strategy.fsdp), w.result.strategy)
                 if o.kind == "gemm")
        flags.append(
            f"{t.optimizer} needs whole matrices, but {w.family} shards flat buffers "
            f"(zero layout) or dim 0 (FSDP2), splitting them: each step gathers every matrix whole "
            f"(+{elems:,} elements, {fmt_bytes(nbytes(elems, t.precision.param))} in {t.precision.param}, "
            f"exposed) and every rank runs "
            f"Newton-Schulz on every matrix ({fmt_s(ns)} a step, priced); in the torch layout "
            f"zero1 (ZeroRedundancyOptimizer) owns whole parameters, each matrix run on one rank")
    unaligned = unaligned_gemm_dims(base.model, t.precision.param)
    if unaligned and base.hw.gpu.kernels is not None and not base.hw.gpu.kernels.unaligned_gemm_slowdown:
        flags.append(f"{', '.join(f'{n} {v:,}' for n, v in unaligned)}: not a multiple of 8, so cuBLAS runs "
                     f"those GEMMs on slower kernels, not priced here (unpadded GPT-2 124M runs reach 9-47% "
                     f"fewer tokens/s than zplan predicts: docs/accuracy-notes.md 9bc); pad the model (vocabulary "
                     f"50304), or measure it with zplan calibrate")
    reentrant = _reentrant_note(w)
    if reentrant:
        flags.append(reentrant)
    if base.hw.gpu.caveat:  # what the GPU preset's figures are known to miss (zplan calibrate)
        flags.append(f"{base.hw.gpu.name}: {base.hw.gpu.caveat}; measure yours with zplan calibrate")
    return flags


def _reentrant_note(w: Candidate) -> str:
    """Where the winner's checkpoint wraps its units reentrantly (each gathered again in backward,
    unhidden: policy.regathers_for_recompute), what a non-reentrant one would save per step."""
    st, t = effective(w.family, w.sc.train.layout), w.sc.train
    if not policy.regathers_for_recompute(t, st.fsdp, st.reshard_after_forward):
        return ""
    alt = estimate_one(replace(w.sc, train=t.model_copy(update={"checkpoint_early_stop": True})), w.family)
    if alt.timing is None or alt.timing.step_s >= w.step_s:
        return ""
    d = w.step_s - alt.timing.step_s
    return (f"the reentrant checkpoint around each unit gathers it twice in backward, unprefetched: a "
            f"non-reentrant one (Hugging Face: gradient_checkpointing_kwargs={{'use_reentrant': False}}) "
            f"would take {fmt_s(d)} off each step ({d / w.step_s:.0%}; the recompute also stops "
            f"before the block's last matmul)")


def _longest_fitting_seq(base: Scenario, full, usable_fraction: float) -> tuple[int, int] | None:
    """The longest power-of-two sequence under the asked one at which zero3 fits some GPU count
    (micro-batch 1, full checkpointing), with the smallest such count; None where no length
    does (the state or one layer is what does not fit, not the sequence)."""
    from .estimate import smallest_n

    s = 1 << ((base.train.seq_len - 1).bit_length() - 1) if base.train.seq_len > 1 else 0
    while s >= 1:
        n = None if s % base.train.loss_chunks else smallest_n(  # --loss-chunks must divide it
            base, full.model_copy(update={"seq_len": s}), include_current=True, usable_fraction=usable_fraction)
        if n is not None:
            return s, n
        s //= 2
    return None


def _fewest_gpus(base: Scenario, full, usable_fraction: float, families: list[str]) -> tuple[int, str, str] | None:
    """The smallest power-of-two multiple of N above it (up to 2^20) at which one of the searched
    families that shard (every one but ddp; hsdp at its largest shard size searched) fits at
    micro-batch 1 with every block checkpointed or all but the last (the allocator's reserve is
    not monotonic in k: on 405B x 512, first-125 fits where full does not), with the family and
    the checkpointing; None where none does. Only the searched families: a hint for one the user
    did not ask for would answer another question."""
    L = base.model.num_layers
    trains = [(full, "full")] + ([(full.model_copy(update={"checkpointing": "first-k", "checkpoint_first": L - 1}),
                                   f"first-{L - 1}")] if L > 1 else [])
    # every family whose per-GPU memory falls with N (ddp replicates it all)
    sharding = [f for f in STRATEGIES if f != "ddp" and f in families]
    usable = int(usable_fraction * base.hw.gpu.memory_bytes)
    live = {(f, label): t for f in sharding for t, label in trains}
    last: dict = {}  # per combination, its allocated peak at the previous count
    n = 2 * base.n
    while n <= 2**20 and live:
        sc_n = replace(base, hw=base.hw.model_copy(update={"num_gpus": n}))
        for (f, label), t in list(live.items()):
            for sc_f in (_variants(sc_n, f) if f == "hsdp" else [sc_n])[-1:]:  # hsdp: the largest shard size
                sc_t = replace(sc_f, train=t)
                if fits(sc_t, f, usable):
                    return n, f if f != "hsdp" else f"hsdp (S={sc_f.hsdp_shard})", label
                # a GPU peak over the usable memory that has stopped falling with N (activations that
                # do not shard; padding to N and per-rank buffers grow again at extreme N) fits at no
                # larger count: that combination is done (one failing on host RAM goes on)
                now = allocated_bytes(sc_t, effective(f, t.layout))
                if now >= last.get((f, label), now + 1) and now + sc_t.assume.cuda_context_bytes > usable:
                    del live[(f, label)]
                last[(f, label)] = now
        n *= 2
    return None


def _nothing_fits(base: Scenario, global_batch: int, headroom: float, rejected: dict,
                  expandable: Candidate | None = None) -> str:
    too_large = [f for f in rejected if (v := _variants(base, f)) and not unavailable_reason(v[0], f)]
    if rejected and not too_large:
        # no family was too large (hsdp with no shard size at 2 GPUs, a strategy that cannot run
        # here: search's own two refusals besides _why_not's memory): memory advice would mislead
        return (f"nothing fits {base.n} x {base.hw.gpu.name} for global batch {global_batch} ("
                + "; ".join(rejected.values()) + "); try another --strategy")
    hints = []
    if expandable is not None:
        hints.append(f"--expandable-segments ({expandable.label()} fits with them; {_expandable_run(base)})")
    full = base.train.model_copy(update={"checkpointing": "full", "micro_batch": 1})
    fewest = _fewest_gpus(base, full, 1 - headroom, list(rejected) or list(STRATEGIES))
    n = fewest[0] if fewest else None
    if fewest is not None:
        batch = "" if global_batch % n == 0 else f" --global-batch {-(-global_batch // n) * n}"  # a multiple of N
        hints.append(f"--gpus {n}{batch} ({fewest[1]} fits there, micro-batch 1, {fewest[2]} checkpointing)")
    if base.train.layout == "zero" and not base.train.zero_init:
        hints.append("--zero-init (the model built under deepspeed.zero.Init)")
    t = base.train
    if (t.linear_loss == "none" and t.layout == "torch" and not t.fused_loss and not t.logits_fp32
            and t.logits_kept and not t.outputs_until_next_forward and not (t.compile and t.compile_loss)):
        # the trainer's chunked loss never holds the whole logits and their gradients
        chunked = full.model_copy(update={"linear_loss": "chunked", "loss_chunks": 1})
        usable = int((1 - headroom) * base.hw.gpu.memory_bytes)
        searched = list(rejected) or list(STRATEGIES)  # the families asked for, as _fewest_gpus
        here = next((f for f in ("zero3", "offload-opt", "offload-all")
                     if f in searched and fits(replace(base, train=chunked), f, usable)), None)
        later = None if here else _fewest_gpus(base, chunked, 1 - headroom, searched)
        at, who = (base.n, here) if here else (later[0], later[1]) if later else (None, None)
        if at is not None and (n is None or at < n):
            where = ("this GPU" if at == 1 else f"these {at} GPUs") if here else f"it on {at} GPUs"
            hints.insert(1 if expandable is not None else 0, f"--linear-loss chunked ("
                         f"{'in place of --loss-chunks; ' if t.loss_chunks > 1 else ''}the loss in chunks, never the whole logits: "
                            f"{who} fits {where}, micro-batch 1, full checkpointing)")
    searched = list(rejected) or list(STRATEGIES)
    if n is None and "ddp" in searched and len(searched) == 1:
        hints.append("--strategy zero3 (ddp keeps the whole model on every GPU: no GPU count changes that)")
    if n is None and "zero3" in searched and not any(SETUP_PEAK in r for r in rejected.values()):
        # (zero3 is what _longest_fitting_seq tries: a hint in its name only where it was asked)
        shorter = _longest_fitting_seq(base, full, 1 - headroom)
        # a length far below the asked one is no advice: what fails is then not the sequence
        if shorter is not None and shorter[0] >= min(base.train.seq_len // 2, max(512, base.train.seq_len // 64)):
            s, at = shorter
            flags = f"--seq-len {s}" + (f" --gpus {at}" if at != base.n else "")
            hints.append(f"{flags} (zero3 fits it on {at} GPU{'s' if at > 1 else ''}, micro-batch 1, "
                         f"full checkpointing; at {base.train.seq_len}, with the whole logits, one sequence's "
                         f"activations and loss exceed the GPU at any GPU count: zplan plans no context "
                         f"parallelism)")
    order = ("offload-all", "zero3", "offload-opt", "hsdp")
    pool = {f: rejected[f] for f in too_large} or rejected  # a size that failed, not an unavailability
    tight = next((pool[f] for f in order if f in pool), next(iter(pool.values()), ""))
    return (f"nothing fits {base.n} x {base.hw.gpu.name} for global batch {global_batch} "
            f"({tight}); try " + (" or ".join(hints) if hints else "a larger GPU"))

