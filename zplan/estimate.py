"""One estimate: every requested strategy's memory, traffic and time for one scenario."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from . import activation_memory, public_accuracy
from .comm import DDP_FIRST_BUCKET_BYTES, Collective, collectives
from .compute import Timing, timing
from .memory import Memory, allocated_bytes, memory
from .scenario import Scenario, SegmentFreeMemo
from .strategies import STRATEGIES, Strategy, effective
from .units import GB

SCHEMA_VERSION = 2


# A run that fits with less than this share of the GPU left is "tight" (estimate's fits column,
# JSON `tight`). Near the limit PyTorch's caching allocator, when cudaMalloc fails, frees every
# cached block it can (a device synchronisation) and retries (torch.cuda.memory_stats()
# num_alloc_retries; c10/cuda/CUDACachingAllocator.cpp), which slows steps by an amount no
# kernel-level source gives; and 10% is the error the memory model is held to per row (issue 8),
# so a prediction within it of the limit is not a promise. recommend keeps the same share free
# (its default --headroom). On the public set some runs near the limit measured 16-37% slower than
# predicted, others not (docs/accuracy-notes.md, findings 9 and 9ah): the flag says the model's
# margin is gone, it does not predict the slowdown; an observation, not a fitted figure.
TIGHT_FREE_FRACTION = 0.10


@dataclass(frozen=True)
class StrategyEstimate:
    name: str
    strategy: Strategy
    memory: Memory | None
    collectives: list[Collective] = field(default_factory=list)
    timing: Timing | None = None
    fits: bool = False
    headroom_bytes: int = 0
    host_fits: bool | None = None
    unavailable: str | None = None  # why this strategy cannot run here at all

    @property
    def tight(self) -> bool:
        """Fits, with less than TIGHT_FREE_FRACTION of the GPU left."""
        cap = self.headroom_bytes + (self.memory.steady_bytes if self.memory else 0)
        return self.fits and self.headroom_bytes < TIGHT_FREE_FRACTION * cap

    @property
    def elements_per_step(self) -> int:
        return sum(c.elements_per_step for c in self.collectives)

    @property
    def bytes_per_step(self) -> int:
        return sum(c.bytes_per_step for c in self.collectives if c.op not in ("h2d", "d2h"))

    def as_dict(self) -> dict:
        d: dict = {
            "name": self.name,
            "pytorch": self.strategy.torch,
            "deepspeed": self.strategy.deepspeed,
            "available": self.unavailable is None,
        }
        if self.unavailable is not None:
            d["reason"] = self.unavailable
            return d
        assert self.memory is not None and self.timing is not None
        d["per_gpu"] = self.memory.as_dict()
        d["peak"] = {"phase": self.memory.peak_phase, "event": self.memory.peak_event}
        d["fits"] = self.fits
        d["tight"] = self.tight
        d["headroom_bytes"] = self.headroom_bytes
        d["host_fits"] = self.host_fits
        d["comm"] = {
            "elements_per_step": self.elements_per_step,
            "bytes_per_step": self.bytes_per_step,
            "collectives": [c.as_dict() for c in self.collectives],
        }
        tm = self.timing.as_dict()
        d["overlap"] = tm.pop("units")
        d["time"] = tm
        return d


def unavailable_reason(sc: Scenario, name: str) -> str | None:
    if name in ("offload-opt", "offload-all") and sc.train.optimizer == "muon":
        return ("Muon's step is Newton-Schulz GEMMs, which the CPU optimizers offload runs (DeepSpeed's "
                "CPU-Adam, torch's CPU AdamW) do not run: offload with --optimizer adamw")
    if name == "offload-opt" and sc.train.layout == "torch":
        return "FSDP2 offloads parameters and optimizer together (CPUOffloadPolicy); optimizer-only offload is DeepSpeed's (plan with --for deepspeed, or estimate with --layout zero)"
    if sc.train.layout == "zero" and sc.train.deepspeed_defaults and name in ("zero3-noreshard", "hsdp"):
        return (f"{name} needs stage-3 settings DeepSpeed's defaults do not have (they reshard after "
                "forward and shard over every rank): drop --deepspeed-defaults")
    t = sc.train
    replicated = not effective(name, t.layout).fsdp
    if t.layout == "torch" and t.optimizer == "adam8bit" and not replicated:
        # bitsandbytes 0.50.2: "got mixed torch.Tensor and DTensor"; its blocks and its fp32
        # threshold would also read the whole tensor's size, not the shard's
        return ("bitsandbytes' 8-bit AdamW cannot step FSDP2's DTensor shards: adam8bit under DDP or "
                "zero1, or DeepSpeed ZeRO with the optimizer passed in your script (--layout zero)")
    if t.layout == "torch" and not replicated and sc.model.num_experts:
        D = sc.shard_degree(name == "hsdp")
        E = sc.model.num_experts
        # placed by the whole data-parallel mesh (sc.n: torchtitan's dp_mesh.size()), split over D
        uneven = sorted({d for u in sc.units for s in u.shapes if len(s) == 3 and E < sc.n for d in (s[1],) if d % D})
        if uneven:  # torchtitan shards experts on dim 1 past E ranks; FSDP2 splits dim > 0 only evenly
            return (f"with {sc.n} data-parallel ranks for {E} experts, torchtitan shards them on dim 1 (width "
                    f"{', '.join(map(str, uneven))}), which FSDP2 splits only evenly (_fsdp_param.py: "
                    f"'does not support uneven sharding on dim 1') over {D} ranks: a shard degree dividing it")
    if t.layout == "torch" and t.compile and replicated and sc.assume.ddp_bucket_bytes < DDP_FIRST_BUCKET_BYTES:
        return (f"torch.compile under DDP splits graphs with a first bucket of 1 MiB, which must not "
                f"exceed DDP's cap (torch/_dynamo/backends/distributed.py asserts it): the cap of "
                f"{sc.assume.ddp_bucket_bytes / 2**20:g} MiB is under it: --bucket-mib 1 or more")
    if name == "hsdp":
        S = sc.hsdp_shard
        if sc.n % S:
            node = sc.hw.cluster.gpus_per_node
            fits = [d for d in range(min(node, sc.n), 1, -1) if sc.n % d == 0]
            inside = [d for d in fits if node % d == 0]  # shard groups that stay inside a node
            fix = (f": --shard-size {(inside or fits)[0]} divides them" if fits else
                   f": no shard size from 2 to {node} divides {sc.n} GPUs")
            return f"shard size {S} (a node) does not divide {sc.n} GPUs{fix}"
    return None


def estimate_one(sc: Scenario, name: str) -> StrategyEstimate:
    st = effective(name, sc.train.layout)
    why = unavailable_reason(sc, name)
    if why:
        return StrategyEstimate(name, st, None, unavailable=why)
    mem = memory(sc, st)
    colls, tm = _traffic_and_time(sc, st, mem)
    fits, host_fits = _fits(sc, mem)
    # headroom: what is left beside the reserve less what it releases once and never makes again
    # (DeepSpeed's cached parameter blocks, Memory.released_once_bytes)
    return StrategyEstimate(name, st, mem, colls, tm, fits,
                            sc.hw.gpu.memory_bytes - mem.steady_bytes,
                            host_fits)


_TIMES = SegmentFreeMemo()


def _traffic_and_time(sc: Scenario, st: Strategy, mem: Memory) -> tuple[list[Collective], Timing]:
    """collectives and timing, made once per scenario and strategy (SegmentFreeMemo): neither
    depends on the allocator's segment kind (timing reads only the model state of `mem`)."""
    def make() -> tuple[list[Collective], Timing]:
        colls = collectives(sc, st)
        return colls, timing(sc, st, mem, colls)
    return _TIMES.get(sc, st, make)


def _fits(sc: Scenario, mem: Memory, usable_bytes: int | None = None) -> tuple[bool, bool | None]:
    """Whether `mem` fits one GPU (or `usable_bytes` of it: recommend's headroom) and the host
    (None: nothing on the host), and the host part. Whether it runs at all (the whole GPU) is
    judged on the reserve less its segments wholly free at the peak (Memory.releasable_bytes): on
    a failed cudaMalloc PyTorch's caching allocator releases its free cached segments and retries
    (release_cached_blocks), so those cost time near the limit, not the run, and such a fit is
    tight (headroom below zero). Within recommend's headroom the whole reserve must fit, less
    what is released once and never made again (Memory.released_once_bytes: DeepSpeed's cached
    parameter blocks): a run that releases and re-reserves segments every step is slower than
    planned."""
    host_fits = None
    if mem.host_bytes_per_node:
        host_fits = mem.host_bytes_per_node <= sc.hw.cluster.host_ram_bytes
    if usable_bytes is None:
        need, cap = mem.total_bytes - mem.releasable_bytes, sc.hw.gpu.memory_bytes
    else:
        need, cap = mem.steady_bytes, usable_bytes
    return need <= cap and host_fits is not False, host_fits


def fits(sc: Scenario, name: str, usable_bytes: int | None = None) -> bool:
    """estimate_one(sc, name).fits from the memory model alone: no traffic, no timing; within
    `usable_bytes` of GPU memory where given. The one fit test of estimate and recommend."""
    return fit_margin(sc, name, usable_bytes)[0]


def fit_margin(sc: Scenario, name: str, usable_bytes: int | None = None) -> tuple[bool, int | None]:
    """`fits`, and by how many bytes the GPU's need is over its limit (negative: under), for a
    search to aim its next probe with (recommend's least first-k); None where the strategy
    cannot run here. Where the allocated peak alone is over `usable_bytes` (the reserve is
    never below it) the margin is the allocated peak's, a lower bound, and the reserve is not
    worked out. The margin is the GPU's alone: where the host's memory is what does not fit
    (offload), the answer is no and the margin may be under zero."""
    if unavailable_reason(sc, name):
        return False, None
    st = effective(name, sc.train.layout)
    if usable_bytes is not None:
        over = allocated_bytes(sc, st) + sc.assume.cuda_context_bytes - usable_bytes
        if over > 0:
            return False, over  # the whole reserve must fit, and it is never below the allocated peak
    mem = memory(sc, st)
    ok = _fits(sc, mem, usable_bytes)[0]
    if usable_bytes is None:
        return ok, mem.total_bytes - mem.releasable_bytes - sc.hw.gpu.memory_bytes
    return ok, mem.steady_bytes - usable_bytes


def estimate(sc: Scenario, names: list[str] | None = None) -> list[StrategyEstimate]:
    return [estimate_one(sc, n) for n in (names or list(STRATEGIES))]


ATTENTION_KERNEL_NAMES = {
    "flash2": "FlashAttention-2, as PyTorch's SDPA runs it (its flash backend)",
    "flash-triton": "FlashAttention in Triton (llm-foundry's attn_impl: triton)",
    "flash3": "FlashAttention-3 (flash-attn's Hopper kernels)",
    "flash4": "FlashAttention-4 (flash-attn's Blackwell kernels)",
    "flex": "FlexAttention's compiled Triton kernels",
    "cudnn": "cuDNN's fused attention (SDPA's cudnn backend)",
    "flash1": "FlashAttention v1 (flash-attn 1.x; SDPA's flash backend in PyTorch 2.0 and 2.1)",
    "efficient": "xformers' memory-efficient kernel under an explicit mask (SDPA's efficient backend: the whole square)",
}


def assumptions(sc: Scenario, strategies: tuple[str, ...] = ()) -> dict:
    """Every figure that is assumed rather than derived, with the flag that changes it."""
    a = sc.assume
    out = {
        "compute_efficiency": {"value": a.compute_efficiency if a.compute_efficiency is not None
                               else "per-op kernel model (GPU preset)", "flag": "--efficiency",
                               "meaning": "achieved fraction of dense peak FLOP/s"},
        "cuda_context_bytes": {"value": a.cuda_context_bytes, "flag": "--context-gib",
                               "meaning": "CUDA context, NCCL's buffers: device memory outside PyTorch's allocator, per GPU"},
        "fragmentation": {"value": a.fragmentation if a.fragmentation is not None else "allocator model",
                          "flag": "--fragmentation",
                          "meaning": "reserved over allocated: the CUDA caching allocator, each stream's "
                                     "peak packed, the all-gather stream simulated, the holes the loss and "
                                     "the head leave and what a checkpointed forward leaves, simulated "
                                     "tensor by tensor (against the allocator replayed over traced steps: "
                                     "from -0.9% to +0.6% with classic segments, mean -0.2%; "
                                     "from -0.0% to +1.5% with expandable ones, mean +0.4%: "
                                     "docs/reserved-matrix.md), or a flat fraction if given"},
        "expandable_segments": {"value": a.expandable_segments, "flag": "--expandable-segments",
                                "meaning": "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True in the run"},
        "ddp_bucket_bytes": {"value": a.ddp_bucket_bytes, "flag": "--bucket-mib",
                             "meaning": "gradient bucket of DDP-style reduction"},
        "overlap": {"value": a.overlap, "flag": "--no-overlap",
                    "meaning": "communication runs concurrently with compute"},
        "cpu_adam_params_per_s": {"value": sc.hw.cluster.cpu_adam_params_per_s, "flag": "cluster preset",
                                  "meaning": "CPU optimizer throughput per node (offload), at fp32 master weights and states; other dtypes by the bytes the step moves (bf16: twice as fast)"},
    }
    if sc.train.layout == "zero" and any(effective(n, "zero").params_sharded for n in strategies or STRATEGIES):
        out["deepspeed_hooks"] = {
            "value": f"{a.deepspeed_hook_forward_s * 1e3:g} ms forward, {a.deepspeed_hook_backward_s * 1e3:g} ms "
                     f"backward a module",
            "flag": "--deepspeed-hook-forward-ms, --deepspeed-hook-backward-ms",
            "meaning": "DeepSpeed ZeRO-3's hooks on the host per module, beyond the model's own work "
                       "(benchmarks/deepspeed_host.py, measured on a CPU): a unit whose kernels take "
                       "less waits on them (docs/formulas.md section 6)"}
    from .presets import home_cluster

    g = sc.hw.gpu
    if g.device == "gpu" and home_cluster(g) is None:  # resolve_hardware's fallback
        out["node_links"] = {
            "value": sc.hw.cluster.name, "flag": "--cluster NAME or FILE.toml",
            "meaning": f"{g.name} names no node of its own (the GPU preset's `cluster`): its links, "
                       f"GPUs per node and network are {sc.hw.cluster.name}'s"}
    elif g.device == "gpu" and sc.hw.cluster.gpu not in (None, g.name) and home_cluster(g) != sc.hw.cluster.name:
        out["node_links"] = {
            "value": sc.hw.cluster.name, "flag": "--cluster NAME or FILE.toml",
            "meaning": f"{sc.hw.cluster.name}'s node holds {sc.hw.cluster.gpu}; {g.name} is planned on its "
                       f"links, GPUs per node and network as they are"}
    if sc.model.position == "learned":
        out["position_table"] = {
            "value": f"{sc.model.max_seq_len:,} rows", "flag": "--seq-len, or max_seq_len in a model file",
            "meaning": "learned positions: one row per position, at least --seq-len (a run at a longer "
                       "sequence than the preset's table builds one that long)"}
    k = sc.hw.gpu.kernels
    if k is not None and a.compute_efficiency is None:  # the kernel model prices contention
        from .kernels import taken_sms
        measured = k.collective_slowdown is not None
        out["compute_beside_collective"] = {
            "value": k.collective_slowdown if measured else
            f"NCCL's {taken_sms(k)} of {k.sm_count} SMs",
            "flag": "GPU preset [kernels] collective_slowdown (zplan calibrate measures it)",
            "meaning": ("how many times longer compute runs while a collective runs beside it, "
                        "measured (docs/formulas.md section 6)" if measured else
                        "compute beside a collective runs on the SMs NCCL leaves; this GPU's preset "
                        "has no measurement of its whole slowdown (docs/formulas.md section 6)")
            + "; the step loses that share of the communication it hides"}
        if k.rank_speed_spread and sc.n > 1:
            from .kernels import slowest_rank_factor
            out["slowest_rank"] = {
                "value": k.rank_speed_spread, "flag": "GPU preset [kernels] rank_speed_spread",
                "meaning": f"GPU speeds spread this much (one standard deviation) around the median; the "
                           f"slowest of {sc.n} ranks paces every step: "
                           f"{slowest_rank_factor(k, sc.n) - 1:+.1%} (the GPU preset's comment names its "
                           "source; docs/formulas.md section 6)"}
    t = sc.train
    if k is not None and a.compute_efficiency is None and t.flash_attention:
        from .kernels import CUDNN_SPEED, cudnn_speed
        # torch prefers cuDNN's attention on Hopper and Blackwell only (check_prefer_cudnn_attention:
        # compute capability 9 or 10), the families CUDNN_SPEED has figures for
        preferred = any(sc.hw.gpu.family.startswith(names) for names, _ in CUDNN_SPEED)
        cudnn = cudnn_speed(sc.hw.gpu)
        measured = sc.hw.gpu.kernels.cudnn_attention_speed is not None
        out["attention_kernel"] = {
            "value": t.attention_kernel, "flag": "--attention-kernel",
            "meaning": f"the attention kernel priced: {ATTENTION_KERNEL_NAMES[t.attention_kernel]}"
            + (f"; PyTorch's SDPA runs cuDNN's attention first on this GPU where its cuDNN is newer than 9.15 "
               f"(CUDA 12.9+ builds: 2.11's cu130 wheels), as 2.9 did, {cudnn[0]:.2g}x as fast "
               + ("at s=4096 (calibrated)" if measured else "at long sequences")
               + ": --attention-kernel cudnn (zplan's trainer runs the plan's kernel)"
               if preferred and cudnn and cudnn[0] > 1 and t.attention_kernel == "flash2" else "")}
    if t.checkpointing == "attention" and t.flash_attention:
        from .activation_memory import block_saved_bytes

        saved = block_saved_bytes(sc.model, t, "none") - block_saved_bytes(sc.model, t, "attention")
        out["attention_checkpointing"] = {
            "value": f"{saved * sc.model.num_layers:,} bytes saved", "flag": "--checkpointing selective or full",
            "meaning": "a flash kernel keeps no s x s tensor: recomputing the attention core saves only what "
                       "the block keeps anyway (its output is the next projection's saved input) and reruns "
                       "its forward in backward; it pays without a flash kernel (--no-flash)"}
    if sc.hw.gpu.caveat:
        out["gpu_figures"] = {"value": sc.hw.gpu.name, "flag": "zplan calibrate",
                              "meaning": sc.hw.gpu.caveat}
    c = sc.hw.cluster
    if sc.n > c.gpus_per_node:  # groups span nodes: the network's figures price them
        out["inter_node_network"] = {
            "value": f"{c.name}: {c.inter_node_busbw_bytes_per_s / 1e9:g} GB/s per GPU, "
                     f"{c.inter_node_latency_s * 1e6:g} us per network step"
                     + (f", tree at {c.tree_busbw_fraction:g} of the ring's bandwidth"
                        if c.tree_busbw_fraction is not None else ""),
            "flag": "--cluster with your network's preset (aws-p5: AWS EFA) or a FILE.toml of the "
                    "preset's fields with your own nccl-tests figures",
            "meaning": "what rings and trees across nodes sustain, read from the cluster preset's "
                       "nccl-tests figures (zplan/nccl.py); networks of the same GPUs differ: AWS p5 "
                       "over EFA measured 32 MiB all-reduces over 16-32 nodes at 56-60% of what "
                       "dgx-h100's figures give, and a data-parallel grid there ran up to 52% slower "
                       "than dgx-h100 predicts, within 6% on aws-p5, one outlier run aside (docs/accuracy-notes.md "
                       "9bk, 9bl)"}
    zero3 = sc.train.layout == "zero" and any(effective(n, "zero").params_sharded for n in strategies)
    if zero3 and a.overlap and sc.n > 1:
        out["overlap"]["meaning"] += (
            "; eager ZeRO-3 under HF's reentrant checkpointing overlaps less: DeepSpeed's published "
            "runs on 32 H100 measured 11-31% slower than overlap predicts, though DeepSpeed gathers "
            "what zplan prices (held against its own ZeRO-3 on gloo ranks): the time is not the traffic "
            "(docs/accuracy-notes.md 9aa, 9af, 9cf)")
    if zero3:
        out["zero_init"] = {
            "value": sc.train.zero_init, "flag": "--no-zero-init" if sc.train.zero_init else "--zero-init",
            "meaning": ("the model is built under deepspeed.zero.Init (HF Trainer, accelerate's "
                        "zero3_init_flag): no GPU ever holds it whole" if sc.train.zero_init else
                        "the model is built outside deepspeed.zero.Init: deepspeed.initialize "
                        "first moves it whole to each GPU, a peak of its own (memory 'setup')")}
    if sc.train.layout == "zero" and any(effective(n, "zero").optim_sharded and not effective(n, "zero").params_sharded
                                         for n in strategies):
        from .memory_reserve import param_block_cache_priced
        one = sc.train.deepspeed_param_groups == "one"
        why_not = param_block_cache_priced(sc)
        out["deepspeed_param_groups"] = {
            "value": sc.train.deepspeed_param_groups,
            "flag": "--deepspeed-param-groups " + ("split" if one else "one"),
            "meaning": ("DeepSpeed's optimizer holds the parameters in one group (a config with an "
                        "optimizer block under HF Trainer or accelerate): DeepSpeed 0.19+ ZeRO-1/2 "
                        "leaves every parameter's own block cached, reserved and free through "
                        "training; the step's tensors reuse what they fit (docs/formulas.md section 3)"
                        + (f"; not priced here: {why_not}" if why_not else "") if one else
                        "decay/no-decay groups, or DeepSpeed before 0.19: the parameters' own blocks "
                        "do not stay cached")}
        on = sc.train.deepspeed_bucket_allreduce
        out["deepspeed_bucket_allreduce"] = {
            "value": on, "flag": "--no-deepspeed-bucket-allreduce" if on else "--deepspeed-bucket-allreduce",
            "meaning": ("DeepSpeed's ZeRO-1/2 all-reduce each gradient bucket and every rank keeps its "
                        "partition (use_multi_rank_bucket_allreduce, DeepSpeed's default since 0.12.4): "
                        "twice the reduce-scatter the ZeRO paper counts" if on else
                        "one reduce per owning rank (use_multi_rank_bucket_allreduce false, or "
                        "DeepSpeed before 0.12.4): the ZeRO paper's volume")}
    unaligned = unaligned_gemm_dims(sc.model, sc.train.precision.param)
    if unaligned and sc.hw.gpu.kernels is not None:
        slow = sc.hw.gpu.kernels.unaligned_gemm_slowdown
        out["unaligned_gemms"] = {
            "value": ", ".join(f"{name} {n:,}" for name, n in unaligned),
            "flag": "pad the model (GPT-2's vocabulary: 50304, a multiple of 64); zplan calibrate "
                    "measures the slowdown on your GPU",
            "meaning": "GEMM widths whose rows are not 16-byte aligned (in 16-bit: not a multiple of 8) "
                       "cuBLAS runs on slower kernels (NVIDIA, Matrix Multiplication "
                       "Background User's Guide, Tensor Core requirements); "
                       + (f"priced at this GPU's measured {slow:g}x (GPU preset [kernels] "
                          "unaligned_gemm_slowdown). " if slow else
                          "priced as if aligned: this GPU preset has no measurement of it, and no "
                          "kernel-level one at such shapes was found (published H100 bf16 GEMMs with "
                          "an odd width: from no slowdown to 3.5x by shape, docs/accuracy-notes.md "
                          "9bi). ")
                       + "End to end, padding GPT-2's "
                       "vocabulary 50257 -> 50304 measured 13.7% more tokens/s on one A100; the "
                       "public set's GPT-2 124M runs on H100 reach 9-47% fewer tokens/s than zplan "
                       "predicts with 50257, within 11% of it with 50304 (docs/accuracy-notes.md 9bc)"}
    if sc.model.num_experts:
        m = sc.model
        out["experts"] = {
            "value": f"{m.experts_per_token} of {m.num_experts} per token",
            "flag": "none (a stated limit)",
            "meaning": "each token's experts are priced as that many GEMMs over every token, at the "
                       "rate one grouped GEMM reaches: routing balanced, the tokens' permutation to "
                       "and from the experts and a per-expert loop's small GEMMs not priced; the "
                       "activations are torchtitan's MoE's (grouped GEMMs: selective checkpointing "
                       "keeps no expert tensor). One measured MoE run is in the public set "
                       "(docs/accuracy.md: Qwen3-30B-A3B on 8 B200)"}
    if sc.model.total_params is not None:
        m = sc.model
        out["architecture"] = {
            "value": f"{m.num_layers} layers, hidden {m.hidden}, vocab {m.vocab_size}, GELU MLP 4h",
            "flag": "--model", "meaning": "synthesized from --params; activations and units follow it",
        }
    return out


def to_json(sc: Scenario, results: list[StrategyEstimate]) -> dict:
    m, t, hw = sc.model, sc.train, sc.hw
    return {
        "schema_version": SCHEMA_VERSION,
        "inputs": {
            "model": m.name,
            "qkv_fused": m.qkv_fused,
            "params": sc.params,
            "units": [{"name": u.name, "params": u.numel} for u in sc.units],
            "gpu": hw.gpu.name,
            "gpu_memory_bytes": hw.gpu.memory_bytes,
            "cluster": hw.cluster.name,
            "num_gpus": hw.num_gpus,
            "gpus_per_node": hw.cluster.gpus_per_node,
            "hsdp_shard_size": sc.hsdp_shard,
            "train": t.model_dump(),
            "activation_bytes": dict(activation_memory.activation_breakdown(m, t, sc.assume.loss_fp32)),
        },
        "assumptions": assumptions(sc, tuple(r.name for r in results)),
        "public_accuracy": measured_error(sc),
        "strategies": [r.as_dict() for r in results],
    }


def unaligned_gemm_dims(m, dtype: str = "bf16") -> list[tuple[str, int]]:
    """The model's GEMM widths (the vocabulary, the widths of the block's linears) whose rows are
    not 16-byte aligned in the GEMMs' dtype (`kernels.aligned`: 8 elements in 16-bit, 4 in
    fp32): each is a leading dimension of some GEMM of a training step (a weight's rows or
    columns, or its output's). Float8 linears (16 elements) and the attention math path's
    sequence are priced by `kernels.gemm` but not named here."""
    from .kernels import aligned

    if m.total_params is not None:
        return []
    dims = [("vocab", m.vocab_size), ("hidden", m.hidden), ("ffn_hidden", m.ffn_hidden),
            ("q width", m.q_hidden), ("kv width", m.kv_hidden)]
    seen: set = set()
    out = []
    for name, n in dims:
        if not aligned(dtype, n) and (name, n) not in seen:
            seen.add((name, n))
            out.append((name, n))
    return out


def measured_error(sc: Scenario) -> dict | None:
    """How far the public set's predictions were from its measurements on this scenario's GPU
    preset (over all its runs where none used it; zplan/public_accuracy.py); None for CPU ranks,
    which the set has no runs of."""
    if sc.hw.gpu.device != "gpu":
        return None
    return public_accuracy.for_gpu(sc.hw.gpu.name)


def fit_hints(sc: Scenario, results: list[StrategyEstimate], unit: str = "GB") -> str:
    """What would make a model that fits nowhere fit: more GPUs, checkpointing, a smaller batch;
    sizes in `unit` (GB = 1e9 bytes or GiB = 2^30, as the tables printed them)."""
    def needs(r: StrategyEstimate) -> int:  # what _fits holds against the whole GPU
        return r.memory.total_bytes - r.memory.releasable_bytes

    best = min((r for r in results if r.memory), key=needs, default=None)
    hints = []
    if best is not None:
        need = needs(best) - sc.hw.gpu.memory_bytes
        hints.append(f"{best.name} needs {need / (2**30 if unit == 'GiB' else GB):.1f} {unit} more per GPU")
    full = sc.train.model_copy(update={"checkpointing": "full"})
    ckpt_fits = sc.train.checkpointing != "full" and any(
        fits(replace(sc, train=full), r.name) for r in results if r.memory)
    if ckpt_fits:
        hints.append("--checkpointing full makes it fit")
    searched = {r.name for r in results}  # --strategy may have left zero3 out at N itself
    for train, extra in ((sc.train, ""), (full, " --checkpointing full")):
        n = smallest_n(sc, train, include_current=bool(extra) or "zero3" not in searched)
        if n is not None:
            if n != sc.n:
                hints.append(f"zero3 fits on --gpus {n}{extra}")
            elif not extra:  # --strategy left it out
                hints.append("zero3 fits on these GPUs (--strategy zero3)")
            # at N with full checkpointing "--checkpointing full makes it fit" said it already
            break
    if sc.train.micro_batch > 1:
        tr = sc.train.model_copy(update={"micro_batch": 1})
        if any(fits(replace(sc, train=tr), r.name) for r in results if r.memory):
            hints.append("--micro-batch 1 makes it fit")
    return "; ".join(hints) or "no change zplan tried makes it fit"


def smallest_n(sc: Scenario, train, include_current: bool = False,
               usable_fraction: float | None = None) -> int | None:
    """The smallest power-of-two multiple of N (N itself with `include_current`, for a `train`
    that differs from the scenario's) at which zero3 fits as estimate judges it, up to 2^20
    GPUs; within `usable_fraction` of GPU memory (recommend's headroom, its stricter test: the
    whole reserve) where given."""
    n = sc.n if include_current else 2 * sc.n
    while n <= 2**20:
        hw = sc.hw.model_copy(update={"num_gpus": n})
        usable = None if usable_fraction is None else int(usable_fraction * hw.gpu.memory_bytes)
        if fits(replace(sc, hw=hw, train=train), "zero3", usable):
            return n
        n *= 2
    return None
