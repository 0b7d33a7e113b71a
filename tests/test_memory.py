"""The memory model's pieces, each against an oracle of its own: model state by hand, the loss and
the saved activations against PyTorch's MemTracker on real CPU tensors, the allocator against
the constants of CUDACachingAllocator.cpp, the step's peak against FSDPMemTracker at scale."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from zplan import activation_memory, allocator, arch
from zplan.errors import UsageError
from zplan.memory import memory, model_state, timeline
from zplan.memory_timeline import KINDS, Event, peak
from zplan.scenario_options import ScenarioOptions, build
from zplan.specs import Assumptions, ModelSpec, Precision, TrainSpec
from zplan.strategies import effective
from zplan.units import MiB


def _sc(**kw):
    base = dict(model="llama-3.1-8b", gpus="8", layout="torch", seq_len=4096)
    base.update(kw)
    return build(ScenarioOptions(**base))


# ------------------------------------------------------------------ model state

def test_model_state_fsdp2_is_16_bytes_per_param_over_n():
    # every Llama 3.1 8B dim-0 (4096, 1024, 14336, 128256) divides by 8: no padding
    sc = _sc()
    psi = arch.param_count(sc.model)
    ms = model_state(sc, effective("zero3", "torch"))
    assert (ms.params_bytes, ms.grads_bytes, ms.optimizer_bytes) == (4 * psi // 8, 4 * psi // 8, 8 * psi // 8)
    assert ms.padding_bytes == 0 and ms.total_bytes == 16 * psi // 8



@pytest.mark.parametrize("strategy", ["zero3", "zero2"])
def test_deepspeed_optimizer_offload_keeps_no_gradient_shard_on_the_gpu(strategy):
    """DeepSpeed under offload_optimizer: ZeRO-1/2's copy_grads_in_partition returns before
    allocating grads_in_partition and an fp32 gradient partition waits on the host
    (stage_1_and_2.py initialize_optimizer_states); ZeRO-3 allocates its 16-bit
    grad_partitions_flat_buffer on the CPU (stage3.py, self.device) and an fp32 gradient buffer
    per subgroup beside it (initialize_optimizer_states). Only the bf16 weight shard stays on
    the GPU. Without offload the bf16 gradient shard is on the GPU. FSDP2 (torch layout) copies
    the reduced gradient out in the parameters' fp32 (_fsdp_collectives.py _to_dtype_if_needed)."""
    sc = _sc(layout="zero")
    psi = arch.param_count(sc.model)
    off = model_state(sc, effective("offload-opt", "zero"))
    assert (off.params_bytes, off.grads_bytes, off.master_bytes, off.optimizer_bytes) == (2 * psi // 8, 0, 0, 0)
    # ZeRO-3: fp32 master, Adam m and v, fp32 and 16-bit gradients; offload-all: + the weights
    assert off.host_bytes == (4 + 8 + 4 + 2) * psi // 8
    all3 = model_state(sc, effective("offload-all", "zero"))
    assert all3.host_bytes == pytest.approx((4 + 8 + 4 + 2 + 2) * psi / 8, rel=1e-3)
    fsdp = model_state(_sc(layout="torch", reduce_dtype="bf16"), effective("offload-all", "torch"))
    assert fsdp.host_bytes == pytest.approx((4 + 8 + 4) * psi / 8, rel=1e-3)  # fp32 weights, m, v, grads
    on = model_state(sc, effective(strategy, "zero"))
    assert on.grads_bytes == 2 * psi // 8


def test_deepspeed_zero1_keeps_only_its_gradient_partition_at_one_micro_batch():
    """DeepSpeed's ZeRO-1 with overlap_comm (the export writes it) reduces at the accumulation
    boundary from backward's hooks, moving each gradient into the reduce bucket and freeing it
    after (stage_1_and_2.py reduce_ready_partitions_and_remove_grads): with one micro-batch per
    step only its partition stays, as under ZeRO-2; accumulating, or without overlap_comm (no
    hooks for stage 1: reduce_gradients after backward), the gradients are held whole."""
    psi = arch.param_count(_sc().model)
    z1 = lambda **kw: model_state(_sc(layout="zero", **kw), effective("zero1", "zero")).grads_bytes  # noqa: E731
    z2 = model_state(_sc(layout="zero"), effective("zero2", "zero")).grads_bytes
    assert z1() == z2 == pytest.approx(2 * psi / 8, rel=1e-3)
    assert z1(grad_accum=2) == z1(overlap=False) == 2 * psi


@pytest.mark.parametrize("strategy", ["zero1", "zero2", "zero3"])
def test_deepspeed_keeps_a_master_copy_even_in_the_weights_dtype(strategy):
    """DeepSpeed's bf16_master_weights_and_grads (with bf16_optimizer_states) holds 2 + 2 + 2 + 4
    = 10 bytes a sharded parameter, not 8: stage_1_and_2.py clones each partition as the master,
    and stage3.py's deduplication shares the weights' partition only where `tensor.device ==
    self.device`, a torch.device against a string (current_device_name(), 'cuda:N'), which torch
    never calls equal (held below; the condition since PR 7700, v0.18.3). DeepSpeedExamples'
    bf16_master_weight run (4 H100, ZeRO-3, 6.86B) ends at 16.17 GiB allocated: 10.1 bytes a
    local parameter. Stage 0 with fp32 weights steps them in place: no copy."""
    psi = arch.param_count(_sc().model)
    sc = _sc(layout="zero", master_dtype="bf16", optimizer_dtype="bf16")
    ms = model_state(sc, effective(strategy, "zero"))
    assert ms.master_bytes == pytest.approx(2 * psi / 8, rel=1e-3)
    fp32 = _sc(layout="zero", param_dtype="fp32", reduce_dtype="fp32")
    assert model_state(fp32, effective(strategy, "zero")).master_bytes == pytest.approx(4 * psi / 8, rel=1e-3)
    assert model_state(fp32, effective("ddp", "zero")).master_bytes == 0


def test_a_torch_device_never_equals_its_name():
    """The premise of the rule above: DeepSpeed's ZeRO-3 compares `tensor.device` with the
    string current_device_name() returns; torch calls a device and a string unequal (if a
    release changes that, DeepSpeed's deduplication would start to fire: revisit the rule)."""
    torch = pytest.importorskip("torch")
    assert not (torch.zeros(1).device == "cpu")
    assert not (torch.device("cuda", 0) == "cuda:0")


LLAMA31_8B_PARAMS = 8_030_261_248  # the safetensors total of meta-llama/Llama-3.1-8B (HF model card)


@pytest.mark.parametrize("strategy", ["zero3", "offload-opt", "offload-all"])
def test_deepspeed_without_zero_init_holds_the_whole_model_at_initialize(strategy):
    """deepspeed.initialize moves a model built outside deepspeed.zero.Init whole to the GPU
    before ZeRO-3 partitions it (runtime/engine.py _configure_distributed_model): an event before
    the step holding every parameter in the param dtype, the run's peak where the step needs
    less (8B at seq 2048 with full checkpointing on 8 GPUs and the optimizer offloaded: about
    6 GB of step; without offload the 16 B/param state over 8 GPUs is as large)."""
    sc = _sc(layout="zero", zero_init=False, seq_len=2048, checkpointing="full")
    ev = timeline(sc, effective(strategy, "zero"))
    assert (ev[0].phase, ev[0].total_bytes) == ("setup", 2 * LLAMA31_8B_PARAMS)
    assert all(e.phase != "setup" for e in ev[1:])
    if strategy == "zero3":
        return
    assert peak(ev) is ev[0] and peak(ev[1:]).total_bytes < 2 * LLAMA31_8B_PARAMS
    from zplan.memory import memory
    m = memory(sc, effective(strategy, "zero"))
    assert (m.peak_phase, m.allocated_bytes) == ("setup", 2 * LLAMA31_8B_PARAMS)
    assert m.reserved_bytes >= m.allocated_bytes


@pytest.mark.parametrize("layout,strategy,zero_init", [
    ("zero", "zero3", True),  # built under zero.Init: never whole on one GPU
    ("zero", "zero2", False),  # ZeRO-1/2 keep the whole model on the GPU through the step anyway
    ("zero", "zero1", False),
    ("torch", "zero3", True),  # FSDP2: not DeepSpeed's initialize
])
def test_no_setup_event_where_deepspeed_does_not_move_the_model_whole(layout, strategy, zero_init):
    sc = _sc(layout=layout, zero_init=zero_init)
    assert all(e.phase != "setup" for e in timeline(sc, effective(strategy, layout)))


@pytest.mark.parametrize("kw,needle", [
    (dict(layout="torch", zero_init=False), "--no-zero-init is about deepspeed.initialize"),
    (dict(layout="torch", deepspeed_defaults=True), "--deepspeed-defaults is about DeepSpeed's config"),
    (dict(linear_loss="chunked", logits_kept=False), "--no-logits-kept: --linear-loss chunked"),
    (dict(layout="zero", embed_head_unit="root"), "--embed-head-unit root is how FSDP groups"),
    (dict(layout="torch", embed_head_unit="rooted"), "'rooted' is not one of: separate, head-kept, root, root-kept, head-root-kept"),
])
def test_options_that_belong_to_the_other_layout_are_refused(kw, needle):
    with pytest.raises(UsageError, match=needle):
        _sc(**kw)


# ------------------------------------------------------------------ buffers

def test_deepspeed_default_buckets_hold_modules_not_units():
    """DeepSpeed ZeRO-3 at its default stage-3 settings: every module's hook prefetches until
    stage3_max_live_parameters (1e9) are available and can overshoot by one parameter, so Llama
    3.1 70B (Psi far above 1e9) holds between 1e9 and 1e9 + its 128256 x 8192 embedding (the
    simulated coordinator's peak, which DeepSpeed's own runs hold: tests/test_deepspeed_release.py);
    a model whose whole trace lies within the reuse distance (1e9), all of itself, never
    released. The persistent 5e8-element reduce bucket in the reduce dtype and one
    embedding-sized gradient on its way."""
    from zplan.memory import static_buffers

    from zplan.comm import ds_coordination

    sc = _sc(model="llama-3.1-70b", gpus="32", layout="zero", deepspeed_defaults=True, reduce_dtype="bf16")
    padded = [sc.padded_elems(u, 32) for u in sc.units]
    gather, reduce = static_buffers(sc, effective("zero3", "zero"), padded, 2, 2)
    emb = 128256 * 8192
    c = ds_coordination(sc, effective("zero3", "zero"))
    assert 10**9 <= c.peak_gathered <= 10**9 + emb and reduce == 500_000_000 * 2 + emb * 2
    # what it holds: a prefetch of several keeps its flat buffer beside them (peak_held)
    assert gather == c.peak_held * 2 and c.peak_gathered <= c.peak_held <= c.peak_gathered + emb
    small = _sc(model="tiny", gpus="8", layout="zero", deepspeed_defaults=True)
    psi = sum(math.prod(s) for u in small.units for s in u.shapes)
    sim = ds_coordination(small, effective("zero3", "zero"))
    # all of itself, and beside it a prefetched call's flat buffer, filled at its first wait
    # after the last gather (DeepSpeed holds it: the harness's last configuration)
    largest = max(sum(n for _, n, _ in call) for call in sim.calls)
    assert sim.peak_gathered == psi and psi < sim.peak_held <= psi + largest
    assert static_buffers(small, effective("zero3", "zero"), [0], 2, 4)[0] == sim.peak_held * 2


def test_deepspeed_default_gathers_are_its_coordinators_calls():
    """At DeepSpeed's defaults a block's all-gather is the calls its coordinator issues (each
    module's own fetch, one Linear weight; each prefetch, one call of what it gathers: the calls
    DeepSpeed's own runs issue, in order, tests/test_deepspeed_release.py), each timed by
    zplan.nccl and shared among its parameters by their elements; its norms, under
    stage3_param_persistence_threshold, stay whole. On Llama 3.1 70B's blocks the 5e7-element
    prefetch bucket takes one 67M weight at a time, so a block takes several calls, not one."""
    from zplan.comm import ds_coordination, unit_comm
    from zplan.nccl import collective_time

    kw = dict(model="llama-3.1-70b", gpus="32", layout="zero")
    st = effective("zero3", "zero")
    sc = _sc(deepspeed_defaults=True, **kw)
    i = next(k for k, u in enumerate(sc.units) if u.name == "blocks.3")
    block = unit_comm(sc, st)[i]
    t = lambda n: collective_time(sc.hw.cluster, "all_gather", 2 * n, 32, 8).seconds  # noqa: E731
    calls = [c for c in ds_coordination(sc, st).calls if any(u == i and not b for u, _, b in c)]
    by_hand = sum(t(sum(-(-n // 32) * 32 for _, n, _ in c)) * sum(n for u, n, b in c if u == i and not b)
                  / sum(n for _, n, _ in c) for c in calls)
    assert block.all_gather_s == pytest.approx(by_hand, rel=1e-12)
    assert sum(n for c in calls for u, n, b in c if u == i and not b) == sum(
        n for n in (8192 * 8192, 1024 * 8192, 1024 * 8192, 8192 * 8192, 28672 * 8192, 28672 * 8192, 28672 * 8192))
    assert 3 <= len(calls) <= 7  # k, v and o may go together; each MLP weight is a call
    whole = unit_comm(_sc(**kw), st)[i]  # zplan's export: a unit's prefetch bucket
    assert block.all_gather_s > whole.all_gather_s


def test_static_buffers_by_hand():
    """Buffers held through the step where they are not modelled unit by unit, against counts
    made here from the model's shapes: DeepSpeed ZeRO-3 at zplan's export settings, without
    prefetch, gathers a module's parameters as it runs and releases them after it (reuse distance
    0): the largest parameter in the param dtype; with prefetch more than the two units the live
    limit names (the prefetcher passes it: DeepSpeed's own runs, tests/test_deepspeed_release.py);
    it keeps one unit's unsharded gradient and reduce input; ZeRO-1/2 keep two reduce buckets; DDP under autocast and
    torch.compile keeps a bf16 copy of the fp32 weights (eager, the copies are followed event by
    event: memory.autocast_copies), its gradients being the buckets (gradient_as_bucket_view)."""
    from zplan.memory import static_buffers

    sc = _sc(layout="zero")
    D = 8
    sizes = [u.numel for u in arch.units(sc.model)]
    padded = [-(-n // D) * D for n in sizes]
    moving = [n for n, u in zip(padded, arch.units(sc.model)) if not u.held]
    held = sum(padded) - sum(moving)
    pair = max(a + b for a, b in zip(moving, moving[1:]))
    largest = max(math.prod(s) for u in arch.units(sc.model) for s in u.shapes)
    no_prefetch = _sc(layout="zero", prefetch=False).for_strategy(True)
    assert static_buffers(no_prefetch, effective("zero3", "zero"), padded, 2, 4) == (largest * 2, max(moving) * 6)
    gather, reduce = static_buffers(sc.for_strategy(True), effective("zero3", "zero"), padded, 2, 4)
    assert gather > (held + pair) * 2 and reduce == max(moving) * 6
    assert static_buffers(sc, effective("zero2", "zero"), padded, 2, 4) == (0, 2 * 25 * MiB)
    ddp = _sc(layout="torch", master_dtype="fp32", compile=True).for_strategy(False)
    assert static_buffers(ddp, effective("ddp", "torch"), padded, 2, 4) == (2 * arch.param_count(ddp.model), 0)
    eager = _sc(layout="torch", master_dtype="fp32").for_strategy(False)
    assert static_buffers(eager, effective("ddp", "torch"), padded, 2, 4) == (0, 0)


# ------------------------------------------------------------------ timeline

def test_peak_is_the_largest_event_not_a_sum_of_maxima():
    sc = _sc(checkpointing="full")
    events = timeline(sc, effective("zero3", "torch"))
    top = peak(events)
    assert top.total_bytes == max(e.total_bytes for e in events)
    summed = sum(max(e.live.get(k, 0) for e in events) for k in KINDS)
    assert top.total_bytes < summed  # gradients, loss and recomputation do not all peak at once
    phases = [e.phase for e in events]
    assert phases.index("forward") < phases.index("loss") < phases.index("backward") < phases.index("optimizer")


def test_loss_backward_holds_fourteen_bytes_per_bf16_logit():
    t = TrainSpec()
    assert activation_memory.loss_bytes_per_logit(t) == {"forward": 10, "backward": 14}
    fp32 = TrainSpec(precision={"param": "fp32"})
    assert activation_memory.loss_bytes_per_logit(fp32) == {"forward": 8, "backward": 16}  # .float() is a no-op


def test_fp32_logits_from_the_model_hold_two_bytes_more_where_kept():
    """The model's own upcast (`logits_fp32`): the loss gets fp32 logits, so its forward holds
    them and log_softmax's output (8 B; the head's bf16 output, 2 B, is freed once cast) and a
    loop that keeps them keeps 4 B where it kept 2; dropped, backward is unchanged (12 B). A
    fused or compiled loss saves the fp32 logits and writes their fp32 gradient, which the
    model's copy casts back (4 + 4 + 2 B; 8 B dropped, the saved logits freed as the kernel's
    backward returns: a custom autograd Function under MemTracker shows it). The order itself is held against MemTracker in
    tests/test_caching_allocator.py, the step's peak in tests/test_fake_trace.py."""
    t = TrainSpec(logits_fp32=True)
    assert activation_memory.loss_bytes_per_logit(t) == {"forward": 8, "backward": 16}
    dropped = t.model_copy(update={"logits_kept": False})
    assert activation_memory.loss_bytes_per_logit(dropped) == {"forward": 8, "backward": 12}
    assert activation_memory.loss_bytes_per_logit(dropped.model_copy(update={"logits_fp32": False})) == \
        {"forward": 10, "backward": 12}
    fused = t.model_copy(update={"fused_loss": True})
    assert activation_memory.loss_bytes_per_logit(fused) == {"forward": 6, "backward": 10}
    # dropped: the kernel frees its saved fp32 logits before the cast back (max(4 + 4, 4 + 2))
    fused_dropped = fused.model_copy(update={"logits_kept": False})
    assert activation_memory.loss_bytes_per_logit(fused_dropped) == {"forward": 6, "backward": 8}
    assert activation_memory.kept_logit_bytes(t) == 4 and activation_memory.kept_logit_bytes(TrainSpec()) == 2
    fp32_params = TrainSpec(logits_fp32=True, precision={"param": "fp32"})  # nothing to upcast
    assert activation_memory.loss_steps(fp32_params) == activation_memory.loss_steps(
        fp32_params.model_copy(update={"logits_fp32": False}))
    with pytest.raises(ValueError, match="never makes the logits whole"):
        TrainSpec(logits_fp32=True, linear_loss="chunked")


def _traced_loss_peak_bytes(T: int, V: int, upcast: bool, keep: bool = True) -> int:
    """PyTorch's MemTracker's peak over the loss and its backward, bf16 logits of (T, V)."""
    torch = pytest.importorskip("torch")
    import torch.nn.functional as F
    from torch.distributed._tools.mem_tracker import MemTracker

    x = torch.randn(T, V, dtype=torch.bfloat16, requires_grad=True)
    y = torch.randint(0, V, (T,))
    mt = MemTracker()
    mt.track_external(x)
    with mt:
        logits = x * 1.0  # the head's bf16 output, referenced through the backward as in the loop
        loss = F.cross_entropy((logits.float() if upcast else logits).view(-1, V), y)
        if not keep:
            del logits  # torchtitan's `del pred`
        loss.backward()
    return next(iter(mt.get_tracker_snapshot("peak").values()))["Total"]


@pytest.mark.parametrize("upcast,keep,per_logit", [(True, True, {"forward": 10, "backward": 14}),
                                                   (False, True, {"forward": 4, "backward": 8}),
                                                   (True, False, {"forward": 10, "backward": 12}),
                                                   (False, False, {"forward": 4, "backward": 6})])
def test_loss_peak_against_pytorch_memtracker(upcast, keep, per_logit):
    """fp32 upcast (the trainer, torchtitan): 14 B per bf16 logit; in the logits' dtype (no
    .float(): KempnerForge, fms-fsdp): 8 B. A loop that drops the logits before backward
    (torchtitan's `del pred`, logits_kept false): 2 B less, the eager loss keeping none."""
    T, V = 256, 1000
    total = _traced_loss_peak_bytes(T, V, upcast, keep)
    per = activation_memory.loss_bytes_per_logit(TrainSpec(logits_kept=keep), loss_fp32=upcast)
    assert per == per_logit
    expected = T * V * (2 + per["backward"])  # + the leaf x
    assert abs(total - expected) <= 0.01 * expected, (total, expected)


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("keep", [True, False])
def test_fp32_logits_from_the_model_against_pytorch_memtracker(fused, keep):
    """The model's own upcast (`logits_fp32`) under MemTracker on real CPU tensors: the head's
    bf16 output cast by `.float()` (whose backward saves nothing), then the eager cross-entropy,
    or a fused kernel (an autograd Function that saves its fp32 input and writes a new gradient
    of it, as flash-attn's xentropy does) -- kept by the loop or dropped before backward. The
    backward peak is loss_bytes_per_logit's: eager 16 / 12 B, fused 10 / 8 B per logit (where
    dropped, autograd frees the kernel's saved logits before the copy casts the gradient back)."""
    torch = pytest.importorskip("torch")
    import torch.nn.functional as F
    from torch.distributed._tools.mem_tracker import MemTracker

    class Fused(torch.autograd.Function):
        @staticmethod
        def forward(ctx, logits):
            ctx.save_for_backward(logits)
            return logits.new_zeros(())

        @staticmethod
        def backward(ctx, g):
            (logits,) = ctx.saved_tensors
            return torch.empty_like(logits)

    T, V = 256, 1000
    x = torch.randn(T, V, dtype=torch.bfloat16, requires_grad=True)
    y = torch.randint(0, V, (T,))
    mt = MemTracker()
    mt.track_external(x)
    with mt:
        logits = (x * 1.0).float()  # the head's bf16 output, upcast by the model
        loss = Fused.apply(logits) if fused else F.cross_entropy(logits, y)
        if not keep:
            del logits
        loss.backward()
    total = next(iter(mt.get_tracker_snapshot("peak").values()))["Total"]
    per = activation_memory.loss_bytes_per_logit(TrainSpec(logits_fp32=True, logits_kept=keep, fused_loss=fused))
    expected = T * V * (2 + max(per.values()))  # + the leaf x and its gradient's
    assert abs(total - expected) <= 0.01 * expected, (total, expected, per)


@pytest.mark.slow  # torch.compile of the loss: ~20 s of inductor codegen on CPU
def test_fused_cross_entropy_kernel_holds_the_logits_and_their_gradient():
    """flash-attn's xentropy (llm-foundry's default loss): the forward keeps the logits and fp32
    per-row statistics, the backward writes a new gradient in the logits' dtype
    (csrc/xentropy/xentropy_kernel.cu, v1.0.9: `gI = inplace ? logits_ : at::empty_like(logits_)`),
    whatever loss_fp32 says; and its time is one kernel each way, as a compiled loss's."""
    from zplan import unit_ops

    for param, B in (("bf16", 2), ("fp32", 4)):
        t = TrainSpec(fused_loss=True, precision=Precision(param=param))
        for upcast in (True, False):
            assert activation_memory.loss_bytes_per_logit(t, upcast) == {"forward": B, "backward": 2 * B}
    fused, eager = _sc(fused_loss=True), _sc()
    head = [u for u in fused.units if "head" in u.name][0]
    ce = lambda sc: [o for o in unit_ops.unit_ops(sc, head, True) if o.name.startswith("cross")][0]  # noqa: E731
    assert ce(fused).seconds < ce(eager).seconds


@pytest.mark.slow  # compiles with Inductor: about 12 s of the fast loop
def test_compiled_loss_buffers_against_inductors_generated_code():
    """What inductor allocates for `F.cross_entropy(pred.float(), y)` (torchtitan's compiled
    loss), read from the code it generates: the forward allocates no vocabulary-sized buffer and
    keeps the bf16 logits for backward; the backward allocates one, the logits' gradient in bf16.
    The model's compiled figures are those: B forward (the kept logits), 2B backward."""
    torch = pytest.importorskip("torch")
    import re

    import torch.nn.functional as F
    from torch._inductor.utils import run_and_get_code

    N, V = 64, 4096
    pred = torch.randn(1, N, V, dtype=torch.bfloat16, requires_grad=True)
    y = torch.randint(0, V, (1, N))

    def step():
        loss = torch.compile(lambda p, t: F.cross_entropy(p.flatten(0, 1).float(), t.flatten(0, 1)))(pred, y)
        loss.backward()

    torch._dynamo.reset()
    _, codes = run_and_get_code(step)
    sizes = {"torch.bfloat16": 2, "torch.float32": 4}
    per_graph = []
    for code in codes:  # forward graph, then backward graph
        big = re.findall(r"empty_strided_\w+\(\((\d+), (\d+)\), \([^)]*\), (torch\.\w+)\)", code)
        per_graph.append(sum(sizes[dt] for n, v, dt in big if int(n) * int(v) == N * V))
    assert len(per_graph) == 2, codes
    fwd_alloc, bwd_alloc = per_graph
    compiled = activation_memory.loss_bytes_per_logit(TrainSpec(compile=True, compile_loss=True))
    assert fwd_alloc == 0
    assert compiled["forward"] == 2 + fwd_alloc  # the kept bf16 logits
    assert compiled["backward"] == 2 + bwd_alloc  # the kept logits + what backward allocates


@pytest.mark.parametrize("mode,mlp,head_dim", [
    ("none", "swiglu", None), ("selective", "swiglu", None), ("full", "swiglu", None),
    ("none", "gelu", None), ("selective", "gelu", None),
    ("none", "swiglu", 96), ("selective", "swiglu", 96), ("selective", "gelu", 48),
    ("none", "swiglu", "qk"), ("selective", "swiglu", "qk"), ("full", "swiglu", "qk")])
def test_saved_activations_of_a_block_against_pytorch_memtracker(mode, mlp, head_dim):
    """head_dim: 4 heads of 96 (or 48) on a hidden of 256, q and the attention output 384
    (192) wide (Qwen3-32B's and Mistral NeMo's shape of block); "qk": heads of 96 with Qwen3's
    q and k norms."""
    qk = head_dim == "qk"
    m, kept = _block_kept_bytes(mode, mlp, head_dim=96 if qk else head_dim, qk_norm=qk)
    t = TrainSpec(seq_len=128, fused_norm=False)  # CPU: the composite RMSNorm
    assert kept == activation_memory.block_saved_bytes(m, t, mode)


@pytest.mark.parametrize("mode,mlp", [("full", "swiglu"), ("full", "gelu"), ("selective", "swiglu"),
                                      ("selective", "gelu")])
def test_a_checkpointed_blocks_first_forward_against_pytorch_memtracker(mode, mlp):
    """What a checkpointed block's forward frees by its end, at most: PyTorch's MemTracker's peak
    over it less what is left after it (the block's output and what it keeps for backward) is
    forward_transient_bytes."""
    torch = pytest.importorskip("torch")
    from torch.distributed._tools.mem_tracker import MemTracker

    from zplan.trainer.model import Transformer
    from zplan.trainer.parallel import apply_checkpointing

    m = ModelSpec(name="t", num_layers=1, hidden=256, ffn_hidden=704, num_heads=4, num_kv_heads=2,
                  vocab_size=64, mlp=mlp)
    model = Transformer(m).to(torch.bfloat16)
    apply_checkpointing(model, mode, 2)
    block = model.layers[0]
    s, b = 128, 2
    x = torch.randn(b, s, m.hidden, dtype=torch.bfloat16, requires_grad=True)
    mt = MemTracker()
    mt.track_external(block, x)
    with mt:
        mt.reset_mod_stats()
        out = block(x)  # held: the block's output is the next block's input
        peak = next(iter(mt.get_tracker_snapshot("peak").values()))["Total"]
        after = next(iter(mt.get_tracker_snapshot("current").values()))["Total"]
    del out
    t = TrainSpec(seq_len=s, micro_batch=b, fused_norm=False, checkpointing=mode)
    freed, largest = activation_memory.forward_transient_bytes(m, t)
    assert peak - after == freed
    assert largest == 2 * s * b * m.ffn_hidden  # the MLP's hidden in bf16
    # kept for backward, not freed, where no block is checkpointed
    assert activation_memory.forward_transient_bytes(m, t.model_copy(update={"checkpointing": "none"})) == (0, 0)
    if mode == "selective" and mlp == "swiglu":  # Liger's fused SwiGLU never makes silu(w1)
        fused = t.model_copy(update={"fused_swiglu": True})
        assert activation_memory.forward_transient_bytes(m, fused)[0] == freed - largest


def test_ligers_loss_tensors_fit_none_of_the_forwards_freed_blocks_below_64k():
    """Liger's fused linear cross-entropy on Llama 3.1 8B, one sequence, full checkpointing. Its
    tensors at 8k, as Liger-Kernel v0.8.0's ops/fused_linear_cross_entropy.py allocates them
    (grad_input b·s·h, grad_weight V·h in the weight's bf16, a 256-token chunk's logits, the
    weight gradient's product and its fp32 copy): 64, 1002, 62.625, 1002 and 2004 MiB. At 32k
    its weight-sized ones exceed every block a checkpointed block's forward frees (SwiGLU's
    three s x 14336 tensors, 896 MiB, and the normed input), while the input gradient and a
    chunk's logits take two of them; at 64k the 1002 MiB ones fit the 1792 MiB blocks too. Either
    way the replay (CachingAllocator, classic segments: the forward's tensors made and freed,
    then Liger's in order) reserves exactly forward_residue_bytes beside the live bytes, which
    memory_reserve.forward_residue adds to the default stream's reserve at the loss, on top of the
    head's and the end of backward's (allocator.default_stream_floor: either reserve alone
    raises the floor)."""
    from zplan import activation_memory as am, presets
    from zplan.caching_allocator import CachingAllocator

    m = presets.model("llama-3.1-8b")
    mib = 1 << 20
    t8 = TrainSpec(seq_len=8192, micro_batch=1, checkpointing="full", linear_loss="liger")
    assert [b / mib for b in am.liger_loss_tensors(m, t8)] == [64, 1002, 62.625, 1002, 2004]
    for s in (32768, 65536):
        t = TrainSpec(seq_len=s, micro_batch=1, checkpointing="full", linear_loss="liger")
        transient, largest = am.forward_transient_bytes(m, t)
        tensors = am.liger_loss_tensors(m, t)
        sim = CachingAllocator()
        freed = [s * 14336 * 2] * 3 + [s * 4096 * 2]  # the block's working set (bf16)
        assert sum(freed) == transient and max(freed) == largest
        for i, b in enumerate(freed):
            sim.malloc(("fwd", i), b)
        for i in range(len(freed)):
            sim.free(("fwd", i))
        for i, b in enumerate(tensors):
            sim.malloc(("loss", i), b)
        cached_beside = sim.reserved_bytes - sim.allocated_bytes
        assert cached_beside == allocator.forward_residue_bytes(transient, largest, list(tensors), False), s
    start = Event("loss", "loss forward", {"activations": 100 * mib, "all_gather": 7 * mib})
    assert allocator.default_stream_floor(start, 0, 0, 5 * mib) == 105 * mib  # the residue alone
    assert allocator.default_stream_floor(start, 0, 3 * mib, 0) == 103 * mib  # the loss's reserve alone
    assert allocator.default_stream_floor(start, 0, 3 * mib, 5 * mib) == 108 * mib
    assert allocator.default_stream_floor(start, 0, 0, 0) == 0 == allocator.default_stream_floor(None, 0, 3, 5)


def test_the_forwards_freed_blocks_the_loss_cannot_use():
    """forward_residue_bytes: with classic segments the forward's freed blocks stay reserved
    beside a loss whose tensors are all larger; a loss tensor that fits one takes it; with
    expandable segments the same over the holes inside the one segment (forward_holes leaves
    out its free end, which the loss grows)."""
    from zplan import allocator

    mib = 1 << 20
    assert allocator.forward_residue_bytes(1000 * mib, 344 * mib, [2000 * mib, 1000 * mib], False) == 1000 * mib
    assert allocator.forward_residue_bytes(1000 * mib, 344 * mib, [2000 * mib, 128 * mib], False) == 872 * mib
    assert allocator.forward_residue_bytes(1000 * mib, 344 * mib, [2000 * mib, 128 * mib], True) == 872 * mib
    assert allocator.forward_residue_bytes(0, 0, [2000 * mib], False) == 0
    # tensors under 10 MiB share 20 MiB segments, which later requests reuse: none kept aside
    assert allocator.forward_residue_bytes(30 * mib, 9 * mib, [2000 * mib], False) == 0


def _block_kept_bytes(mode: str, mlp: str, linear=None, head_dim=None, qk_norm=False):
    """What one block of the trainer's model keeps after forward (MemTracker on CPU), with its
    input counted as the block keeps it (`block_saved_bytes`' convention); `linear` replaces each
    nn.Linear (a module class built from the Linear); `head_dim` sets heads wider than hidden /
    heads (ModelSpec.attention_head_dim)."""
    torch = pytest.importorskip("torch")
    from torch.distributed._tools.mem_tracker import MemTracker

    from zplan.trainer.model import Transformer
    from zplan.trainer.parallel import apply_checkpointing

    m = ModelSpec(name="t", num_layers=1, hidden=256, ffn_hidden=704, num_heads=4, num_kv_heads=2,
                  vocab_size=64, mlp=mlp, attention_head_dim=head_dim, qk_norm=qk_norm)
    model = Transformer(m).to(torch.bfloat16)
    if linear is not None:
        from tests.helpers import replace_linears

        replace_linears(model.layers[0], linear)
    apply_checkpointing(model, mode, 2)
    block = model.layers[0]
    s = 128
    x = torch.randn(1, s, m.hidden, dtype=torch.bfloat16, requires_grad=True)
    mt = MemTracker()
    mt.track_external(block, x)
    with mt:
        before = next(iter(mt.get_tracker_snapshot("current").values()))["Total"]
        out = block(x)
        after = next(iter(mt.get_tracker_snapshot("current").values()))["Total"]
    # the block's input x is counted before; "full" keeps nothing else than it
    return m, after - before - out.numel() * 2 + (2 * s * m.hidden if mode != "none" else 0)


def _te_float8_linear(torch):
    """A stand-in for TransformerEngine v0.10's float8 Linear (no CUDA here): the same tensors
    saved for backward (transformer_engine/pytorch/module/linear.py, `ctx.save_for_backward(
    inputmat_no_fp8 if not fp8_wgrad else None, inputmat_t, weight, weight_t_fp8, scale_inv)`):
    the float8 transpose of the input and of the weight; the output in the input's dtype."""
    from tests.helpers import function_linear

    class Fn(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, weight):
            f8 = torch.float8_e4m3fn
            x_t = x.reshape(-1, x.shape[-1]).t().contiguous().to(f8)
            w_t = weight.t().contiguous().to(f8)
            ctx.save_for_backward(x_t, weight, w_t)
            return x @ weight.t()

        @staticmethod
        def backward(ctx, g):  # not run: the test measures what forward keeps
            raise NotImplementedError

    return function_linear(Fn)


@pytest.mark.parametrize("mode,mlp", [("none", "swiglu"), ("none", "gelu"), ("full", "swiglu")])
def test_te_float8_block_keeps_float8_inputs_and_weight_transposes(mode, mlp):
    """The trainer's block with every linear replaced by TransformerEngine's saving contract:
    MemTracker's kept bytes equal zplan's te-delayed terms (the linear inputs nothing else keeps
    at 1 byte, the weights' float8 transposes)."""
    torch = pytest.importorskip("torch")
    m, kept = _block_kept_bytes(mode, mlp, _te_float8_linear(torch))
    t = TrainSpec(seq_len=128, fused_norm=False, float8=True, float8_recipe="te-delayed")
    assert kept == activation_memory.block_saved_bytes(m, t, mode)
    if mode == "none":  # and it is not the bf16 block's figure
        assert kept != activation_memory.block_saved_bytes(m, TrainSpec(seq_len=128, fused_norm=False), mode)


# ------------------------------------------------------------------ allocator

def test_allocator_rounding_follows_cuda_caching_allocator():
    assert allocator.block_bytes(1) == 512 and allocator.block_bytes(513) == 1024
    assert allocator.segment_bytes(MiB) == 2 * MiB  # small pool
    assert allocator.segment_bytes(MiB + 1) == 20 * MiB  # large pool, shared 20 MiB segment
    assert allocator.segment_bytes(10 * MiB + 1) == 12 * MiB  # own segment, rounded to 2 MiB


def test_reserved_is_the_sum_of_each_streams_peak():
    z = {k: 0 for k in KINDS}
    a = Event("forward", "a", dict(z, activations=100 * MiB, all_gather=5 * MiB))
    b = Event("backward", "b", dict(z, activations=20 * MiB, grads=60 * MiB))
    # allocated peaks at 105 MiB; the reduce-scatter stream's 60 MiB (sharded gradients) cannot
    # reuse the default stream's cache, nor can the all-gather stream's 5 MiB (a 20 MiB segment)
    assert allocator.reserved_bytes([a, b], Assumptions()) == 100 * MiB + 20 * MiB + 60 * MiB
    # the reduce-scatter input is the default stream's (PyTorch >= 2.5): it reuses its cache
    c = Event("backward", "c", dict(z, activations=20 * MiB, reduce_scatter=60 * MiB))
    assert allocator.reserved_bytes([a, c], Assumptions()) == 100 * MiB + 20 * MiB
    # expandable segments map each stream's pool in 20 MiB pages
    assert allocator.reserved_bytes([a, b], Assumptions(expandable_segments=True)) == 100 * MiB + 20 * MiB + 60 * MiB
    d = Event("backward", "d", dict(z, activations=101 * MiB, grads=61 * MiB))
    assert allocator.reserved_bytes([d], Assumptions()) == 102 * MiB + 62 * MiB
    assert allocator.reserved_bytes([d], Assumptions(expandable_segments=True)) == 120 * MiB + 80 * MiB
    assert allocator.reserved_bytes([a, b], Assumptions(fragmentation=0.1)) == int(105 * MiB * 1.1)


def test_fits_is_judged_on_reserved_plus_context():
    from zplan.estimate import estimate_one

    sc = _sc()
    r = estimate_one(sc, "zero3")
    m = r.memory
    assert m.reserved_bytes >= m.allocated_bytes
    assert m.total_bytes == m.reserved_bytes + Assumptions().cuda_context_bytes
    assert r.headroom_bytes == sc.hw.gpu.memory_bytes - m.total_bytes


# ------------------------------------------------------------------ dtypes

@pytest.mark.parametrize("flag,value", [("param_dtype", "int4"), ("param_dtype", "int8"),
                                         ("reduce_dtype", "fp8"), ("master_dtype", "int8")])
def test_dtypes_that_cannot_hold_a_slot_are_refused(flag, value):
    with pytest.raises(UsageError, match=f"--{flag.replace('_', '-')} {value}"):
        _sc(**{flag: value})


# ------------------------------------------------------------------ against the tracer

SMALL = """name = "small-llama"
num_layers = 2
hidden = 512
ffn_hidden = 1792
num_heads = 8
num_kv_heads = 2
vocab_size = 32000
max_seq_len = 2048
source = "test: Llama-shaped, small"
"""


@pytest.mark.slow
@pytest.mark.parametrize("mode,strategy,tied", [("none", "zero3", False), ("full", "zero2", False),
                                               ("none", "zero3", True)])
def test_fake_trace_small_model_within_three_percent(tmp_path, mode, strategy, tied):
    """Tied embeddings make FSDP2's root hold parameters: gathered through forward and backward,
    resharded at the loss."""
    pytest.importorskip("torch")
    from zplan.trainer.fake_trace import fake_cell

    path = tmp_path / "small.toml"
    path.write_text(SMALL + ("tied_embeddings = true\n" if tied else ""))
    c = fake_cell(str(path), 16, 1024, 1, mode, strategy)
    assert abs(c.error) <= 0.03, c
    assert c.predicted_phase == c.traced_phase, c


V_H = 128256 * 4096  # Llama 3.1 8B's embedding, and its head, in elements
MLP_W = 14336 * 4096  # its largest block weight


@pytest.mark.parametrize("reduce,held", [("fp32", True), ("bf16", False)])
def test_the_roots_head_gradient_beside_accumulated_gradients(reduce, held):
    """Accumulating without reducing (reduce_last_only), FSDP2 adds a unit's new gradients into
    its accumulated ones in its post-backward, converting them when the reduce dtype differs
    (to_accumulated_grad_if_needed): the root's new bf16 head gradient waits beside them until
    the end of backward. In the reduce dtype autograd accumulates into .grad in place: a block's
    new gradient is gone before its recompute's peak (the head's is not: test_linear_loss.py)."""
    sc = _sc(embed_head_unit="root", grad_accum=4, reduce_last_only=True, reduce_dtype=reduce,
             checkpointing="full")
    ev = {e.label: e for e in timeline(sc, effective("zero3", "torch"))}
    rb = {"fp32": 4, "bf16": 2}[reduce]
    hold = 2 * V_H if held else 0
    # a micro-batch before the last (every unit's accumulated gradients there): in the reduce
    # dtype the new weight gradient goes into .grad in place, in another it is a new tensor
    new = 2 * MLP_W if held else 0
    before = ev["backward blocks.1, a micro-batch before the last"].live["unsharded_grads"]
    assert before == rb * LLAMA31_8B_PARAMS + new + hold
    # the last micro-batch: blocks.2 onwards are reduced, their accumulated gradients freed; the
    # root's (embedding, norm, head), blocks.0's and blocks.1's remain
    block = (LLAMA31_8B_PARAMS - 2 * V_H - 4096) // 32
    last = ev["backward blocks.1"].live["unsharded_grads"]
    assert last == rb * (2 * V_H + 4096 + 2 * block) + new + hold
    # the head's own backward: its new weight gradient beside the accumulated ones
    assert ev["backward head (in embed+head)"].live["unsharded_grads"] == rb * LLAMA31_8B_PARAMS + 2 * V_H


def test_later_micro_batches_find_every_sharded_gradient():
    """With accumulation and a reduce every micro-batch, FSDP2 adds each reduce-scatter output
    into the sharded gradient already there: from the second micro-batch on, all of them are
    allocated at every backward event (fp32, Psi / 8 each on 8 ranks)."""
    sc = _sc(grad_accum=4, checkpointing="full")
    ev = {e.label: e for e in timeline(sc, effective("zero3", "torch"))}
    assert ev["backward blocks.31"].live["grads"] == 4 * LLAMA31_8B_PARAMS // 8
    one = {e.label: e for e in timeline(_sc(checkpointing="full"), effective("zero3", "torch"))}
    assert one["backward blocks.31"].live["grads"] == 4 * (V_H + 4096) // 8  # norm + head only


@pytest.mark.slow
@pytest.mark.parametrize("unit,loss", [("root", "chunked"), ("root", "none"), ("root-kept", "none"),
                                       ("head-kept", "none")])
def test_fake_trace_embed_and_head_left_to_the_root(unit, loss):
    """Llama 3.1 8B with embeddings, norm and head in FSDP2's root (HF Trainer / accelerate /
    torchtitan before 2025-07), or norm + head a unit of its own kept after forward (head-kept:
    torchtitan since 2025-07): with the trainer's chunked loss and full checkpointing the peak
    is in backward (the root gathered through it, the head's weight gradient held unsharded until
    the root's reduce-scatter); with the logits' loss and no checkpointing it is at the loss,
    where a kept root is still gathered and a resharding one is not (the trainer passes
    reshard_after_forward to the root as policy.root_reshards says). Within 1% of the tracer,
    where the other mode's prediction for the same run is more than 1.5% off."""
    pytest.importorskip("torch")
    from zplan.trainer.fake_trace import fake_cell, planned_cell

    ckpt = "full" if loss == "chunked" else "none"  # none: the peak at the loss
    c = fake_cell("llama-3.1-8b", 16, 2048, 1, ckpt, "zero3", loss, unit)
    assert abs(c.error) <= 0.01, c
    other = {"root": "root-kept", "root-kept": "root", "head-kept": "separate"}[unit]
    if loss == "chunked":  # the loss's backward gathers the root either way: against separate
        other = "separate"
    wrong = planned_cell("llama-3.1-8b", 16, 2048, 1, ckpt, "zero3", loss, other)[1].memory.allocated_bytes
    assert abs(wrong - c.traced_bytes) / c.traced_bytes > 0.015, (wrong, c)


@pytest.mark.slow
def test_fake_trace_norm_and_head_left_to_a_kept_root_beside_the_embeddings_unit():
    """Llama 3.1 8B with the embeddings a unit of their own and norm + head left to the kept root
    (head-root-kept: FSDP1 auto-wrapping the embedding module too; the trainer's FSDP2 root told
    not to reshard), full checkpointing: the peak is in backward, the root gathered through it
    and the head's weight gradient held to the root's reduce-scatter at its end. Within 1% of
    FSDPMemTracker, where pricing norm + head as a kept unit of their own (head-kept, which
    reshards and reduces them after their backward) is more than 10% short."""
    pytest.importorskip("torch")
    from zplan.trainer.fake_trace import fake_cell, planned_cell

    c = fake_cell("llama-3.1-8b", 16, 2048, 1, "full", "zero3", "none", "head-root-kept")
    assert abs(c.error) <= 0.01 and c.traced_phase == c.predicted_phase == "backward", c
    wrong = planned_cell("llama-3.1-8b", 16, 2048, 1, "full", "zero3", "none", "head-kept")[1].memory.allocated_bytes
    assert (c.traced_bytes - wrong) / c.traced_bytes > 0.10, (wrong, c)


# A tied weight's two gradients, measured on real CPU tensors: the process's peak resident memory
# (VmHWM, reset just before backward) over what it held before, in units of the weight W (128
# MiB in fp32). The plain head's gradient is the transpose of its matmul's, a view whose base
# keeps the storage shared, so autograd's input buffer adds the embedding's out of place (head
# gradient, embedding gradient and their sum: 3 W); the chunked loss's is a plain tensor made
# in forward, and takes the embedding's in place (1 W new); under any Python dispatch mode --
# as PyTorch's MemTracker and FSDPMemTracker are -- nothing is stolen, and it is out of place
# again (2 W and more): there the tracers count a tensor a run does not hold.
_TIED_BACKWARD = """
import sys, torch
from torch.utils._python_dispatch import TorchDispatchMode
from zplan.trainer.linear_loss import chunked_linear_cross_entropy
torch.set_num_threads(1)
def status(key):
    return next(int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith(key))
class Passthrough(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))
V, H = 8192, 4096
w = torch.nn.Parameter(torch.full((V, H), 1e-3))
idx = torch.randint(0, V, (1, 8))
y = torch.nn.functional.embedding(idx, w)
if sys.argv[1] == "plain":
    loss = torch.nn.functional.cross_entropy(torch.nn.functional.linear(y, w).view(-1, V), idx.view(-1))
else:
    loss = chunked_linear_cross_entropy(y, w, idx)
before = status("VmRSS")
open("/proc/self/clear_refs", "w").write("5")
if sys.argv[2] == "mode":
    with Passthrough():
        loss.backward()
else:
    loss.backward()
print((status("VmHWM") - before) / (V * H * 4))
"""


@pytest.mark.slow  # three subprocesses, each with 128 MiB weights
@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux's /proc peak RSS")
def test_a_tied_weights_gradients_meet_out_of_place_under_a_plain_head():
    """The measurement behind memory_timeline's tied_sum and HeadTail.tied_out_of_place: a plain
    head's tied gradient takes a third weight-sized tensor at the embedding's backward, a linear
    loss's does not (torch/csrc/autograd/input_buffer.cpp, can_accumulate_inplace)."""
    pytest.importorskip("torch")
    import subprocess
    import sys

    def peak_w(head, mode):
        out = subprocess.run([sys.executable, "-c", _TIED_BACKWARD, head, mode], capture_output=True,
                             text=True, check=True)
        return float(out.stdout.split()[-1])

    assert 2.8 < peak_w("plain", "none") < 3.3
    assert 0.9 < peak_w("chunked", "none") < 1.3
    assert peak_w("chunked", "mode") > 1.8  # (with what the mode itself holds: 2.6)


@pytest.mark.parametrize("loss,sums", [("none", 1), ("chunked", 1)])
def test_a_tied_roots_embedding_backward_holds_the_out_of_place_sum(loss, sums):
    """Llama 3.2 1B (tied) at seq 512 with full checkpointing: at the embedding's backward the
    root holds the head's gradient (waiting in autograd's buffer since the head's backward), the
    embedding's, and their sum: under FSDP2 out of place for a linear loss's gradient too (a
    real run measures it: tests/test_linear_loss.py). Accumulating in the reduce dtype does not
    let the head's go early: a tied weight's AccumulateGrad runs once, after the embedding's
    backward."""
    VH2 = 128256 * 2048 * 2
    for accum in ({}, dict(grad_accum=2, reduce_last_only=True, reduce_dtype="bf16")):
        sc = _sc(model="llama-3.2-1b", seq_len=512, checkpointing="full", linear_loss=loss, **accum)
        ev = {e.label: e for e in timeline(sc, effective("zero3", "torch"))}
        # accumulating, in the last micro-batch every other unit is reduced (its accumulated
        # gradients freed) by the embedding's backward: the root's own remain, in bf16
        root = VH2 + 2 * 2048  # the tied embedding and the final norm, in bf16
        accum_b = root if accum else 0
        assert ev["backward embed+head"].live["unsharded_grads"] - accum_b == (2 + sums) * VH2, accum
        if accum:  # the first micro-batch: the other units' accumulated gradients, not the root's
            before = ev["backward embed+head, a micro-batch before the last"].live["unsharded_grads"]
            assert before - (2 * arch.param_count(sc.model) - root) == (2 + sums) * VH2


@pytest.mark.slow
def test_fake_trace_tied_embeddings_at_the_end_of_backward():
    """Where the embedding's backward is the peak (short sequence, full checkpointing), the
    planner held two tied-weight gradients and read 10.6% under FSDPMemTracker; the tracer sees
    the third (a plain head's sum is out of place on a GPU too)."""
    pytest.importorskip("torch")
    from zplan.trainer.fake_trace import fake_cell

    c = fake_cell("llama-3.2-1b", 8, 512, 1, "full", "zero3")
    assert abs(c.error) <= 0.01 and c.predicted_phase == c.traced_phase == "backward", c


@pytest.mark.parametrize("compile_loss", [False, True])
def test_dropped_logits_are_not_held_through_the_blocks_backward(compile_loss):
    """A loop that drops its logits (torchtitan's `del pred`): no block's backward holds them,
    whether the loss is eager (it keeps none) or compiled (it frees its saved logits when its
    backward ends); the difference is exactly the bf16 logits, 4096 x 128256 x 2 bytes."""
    kw = dict(checkpointing="full", compile=compile_loss, eager_loss=False)
    if not compile_loss:
        kw.pop("compile"), kw.pop("eager_loss")
    ev = lambda **k: {e.label: e for e in timeline(_sc(**kw, **k), effective("zero3", "torch"))}  # noqa: E731
    kept, dropped = ev(), ev(logits_kept=False)
    diff = kept["backward blocks.1"].live["activations"] - dropped["backward blocks.1"].live["activations"]
    assert diff == 4096 * 128256 * 2


@pytest.mark.slow
def test_fake_trace_loop_that_drops_its_logits():
    """The trace's loop drops its logits when the plan says so, as torchtitan's and the
    trainer's do: within 1% of the tracer, where the kept-logits prediction is >1.5% off
    (Llama 3.1 8B, no checkpointing, seq 2048)."""
    pytest.importorskip("torch")
    from zplan.trainer.fake_trace import fake_cell, planned_cell

    c = fake_cell("llama-3.1-8b", 16, 2048, 1, "none", "zero3", logits_kept=False)
    assert abs(c.error) <= 0.01, c
    kept = planned_cell("llama-3.1-8b", 16, 2048, 1, "none", "zero3")[1].memory.allocated_bytes
    assert (kept - c.traced_bytes) / c.traced_bytes > 0.015, (kept, c)


@pytest.mark.parametrize("kernels", ["single", "foreach", "fused"])
def test_optimizer_temporaries_against_pytorch_memtracker(kernels):
    """PyTorch's MemTracker over one AdamW step on three parameters of different sizes: single
    builds two temporaries of the largest, foreach a sqrt of every exp_avg_sq at once, fused
    none."""
    torch = pytest.importorskip("torch")
    from torch.distributed._tools.mem_tracker import MemTracker

    from zplan.memory_timeline import optimizer_temp_bytes

    ps = [torch.nn.Parameter(torch.randn(n, 64)) for n in (4096, 1024, 512)]
    for p in ps:
        p.grad = torch.randn_like(p)
    flags = {"single": {"foreach": False}, "foreach": {"foreach": True}, "fused": {"fused": True}}
    opt = torch.optim.AdamW(ps, **flags[kernels])
    opt.step()  # the states exist from here on
    mt = MemTracker()
    mt.track_external(*ps, opt)
    with mt:
        before = next(iter(mt.get_tracker_snapshot("current").values()))["Total"]
        opt.step()
        peak = next(iter(mt.get_tracker_snapshot("peak").values()))["Total"]
    spec = TrainSpec(layout="torch", optimizer_kernels=kernels)
    largest, local = 4096 * 64, sum(p.numel() for p in ps)
    assert peak - before == optimizer_temp_bytes(largest, local, spec, "torch")
    assert (peak - before > 0) == (kernels != "fused")  # the oracle sees what is claimed


def _fused_qkv_attention(torch, m):
    """The trainer's attention with q, k and v as one linear split into views (litgpt's
    CausalSelfAttention.attn, torchtitan's FusedQKVLinear), RoPE on q and k as the trainer's."""
    from torch import nn

    from zplan.trainer import model as tm

    class FusedQKV(tm.Attention):
        def __init__(self):
            super().__init__(m)
            del self.wq, self.wk, self.wv
            self.wqkv = nn.Linear(m.hidden, m.q_hidden + 2 * m.kv_hidden, bias=False)

        def forward(self, x):
            b, s, _ = x.shape
            q, k, v = self.wqkv(x).split((m.q_hidden, m.kv_hidden, m.kv_hidden), dim=-1)
            q, k = q.reshape(b, s, self.n_heads, self.head_dim), k.reshape(b, s, self.n_kv, self.head_dim)
            if self.q_norm is not None:  # Qwen3's q/k norms, on views of the fused output
                q, k = self.q_norm(q).to(q.dtype), self.k_norm(k).to(k.dtype)
            v = v.reshape(b, s, self.n_kv, self.head_dim).transpose(1, 2)
            cos, sin = tm._rope(s, self.head_dim, x.device, q.dtype)
            q, k = tm.apply_rope(q, cos, sin).transpose(1, 2), tm.apply_rope(k, cos, sin).transpose(1, 2)
            return self.wo(self.core(q, k, v).transpose(1, 2).reshape(b, s, -1))
    return FusedQKV()


def _compiled_block_saved(mlp: str, recipe: str | None, checkpointing: str, s: int = 64,
                          qkv_fused: bool = False, compiled: bool = True, qk_norm: bool = False,
                          expand_kv: bool = False):
    """(model, bytes): what the trainer's block (one layer, bf16) saves for backward under
    torch.compile's partitioner (inductor's, without its code generation; eager where not
    `compiled`), with torchao's float8 linears (`recipe`, converted as torchtitan converts them),
    the trainer's checkpointing and, with `qkv_fused`, one q/k/v linear (`qk_norm`: Qwen3's
    q/k norms; `expand_kv`: keys and values copied to the query heads, TrainSpec.attention_expands_kv)."""
    torch = pytest.importorskip("torch")

    from tests.helpers import saved_storages
    from zplan.trainer.model import Transformer
    from zplan.trainer.parallel import apply_checkpointing

    m = ModelSpec(name="t", num_layers=1, hidden=256, ffn_hidden=704, num_heads=4, num_kv_heads=2,
                  vocab_size=64, mlp=mlp, qkv_fused=qkv_fused, qk_norm=qk_norm)
    model = Transformer(m)
    if qkv_fused:
        model.layers[0].attention = _fused_qkv_attention(torch, m)
    model.layers[0].attention.expand_kv = expand_kv
    model = model.to(torch.bfloat16)
    if recipe is not None:
        pytest.importorskip("torchao")
        from tests.helpers import cpu_scaled_mm_takes_row_scales
        if recipe.startswith("rowwise") and not cpu_scaled_mm_takes_row_scales():
            pytest.skip(f"torch {torch.__version__}'s CPU _scaled_mm takes per-tensor scales only")
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training

        convert_to_float8_training(model.layers[0], config=Float8LinearConfig.from_recipe_name(
            {"rowwise-gw-hp": "rowwise_with_gw_hp"}.get(recipe, recipe)))
    apply_checkpointing(model, checkpointing, 2)
    block = model.layers[0]
    x = torch.randn(1, s, m.hidden, dtype=torch.bfloat16, requires_grad=True)
    saved, pack = saved_storages(block)
    # dynamo caches compiled frames per code object: after its recompile limit (the same Block
    # and Attention code compiled for many modules in one worker) it would run the block eager,
    # silently; start each trace from an empty cache
    torch._dynamo.reset()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        (torch.compile(block, backend="aot_eager_decomp_partition") if compiled else block)(x)
    return m, sum(saved.values())


@pytest.mark.slow  # compiling takes about a minute on 2 cores
@pytest.mark.parametrize("mlp, recipe", [("swiglu", None), ("gelu", None), ("swiglu", "tensorwise"),
                                         ("gelu", "tensorwise"), ("swiglu", "rowwise"),
                                         ("swiglu", "rowwise-gw-hp")])
def test_compiled_block_saves_what_the_min_cut_partitioner_keeps(mlp, recipe):
    """torch.compile's partitioner, with torchao's float8 linears (`recipe`). Under the recipes
    whose weight gradient is a float8 GEMM the partitioner casts the norms' outputs and the down
    projection's input again in backward instead of keeping them, and keeps the attention
    output's float8 cast (activation_memory._compiled_float8_saves); the scales (a few bytes, a
    row vector under rowwise) are all the trace holds beyond the plan."""
    s = 64
    m, traced = _compiled_block_saved(mlp, recipe, "none", s)
    t = TrainSpec(seq_len=s, fused_norm=False, compile=True, float8=recipe is not None,
                  float8_recipe=recipe or "tensorwise")
    planned = activation_memory.block_saved_bytes(m, t, "none")
    assert 0 <= traced - planned < 1024, (traced, planned)
    if recipe in ("tensorwise", "rowwise"):  # the oracle sees fewer 16-bit inputs than without float8
        bf16 = activation_memory.block_saved_bytes(m, TrainSpec(seq_len=s, fused_norm=False, compile=True), "none")
        assert bf16 - planned == 2 * 2 * s * m.hidden + 2 * s * m.ffn_hidden - s * m.q_hidden


@pytest.mark.slow  # compiling takes about half a minute on 2 cores
@pytest.mark.parametrize("compiled, recipe, qk_norm", [(False, None, False), (True, None, False),
                                                       (True, "tensorwise", False), (False, None, True),
                                                       (True, None, True)])
def test_a_fused_qkv_projection_with_rope_keeps_its_whole_output(compiled, recipe, qk_norm):
    """q, k and v as views of one linear's output, RoPE making q and k new tensors: the attention
    kernel saves RoPE's q and k and the view v, which keeps the whole fused output; eager and
    compiled the block keeps that output and RoPE's q and k (B·sb(q + kv) beyond q, k and v:
    activation_memory.fused_qkv_rope_extra_bytes; litgpt's Llama 2 7B at seq 4096, 2 GB). With
    q/k norms that keep their inputs (compiled), those inputs are q's and k's part of the fused
    output, counted once."""
    s = 64
    m, traced = _compiled_block_saved("swiglu", recipe, "none", s, qkv_fused=True, compiled=compiled,
                                      qk_norm=qk_norm)
    t = TrainSpec(seq_len=s, fused_norm=False, compile=compiled, float8=recipe is not None)
    planned = activation_memory.block_saved_bytes(m, t, "none")
    assert 0 <= traced - planned < 1024, (traced, planned)
    extra = 0 if qk_norm and compiled else 2 * s * (m.q_hidden + m.kv_hidden)
    assert activation_memory.fused_qkv_rope_extra_bytes(m, t) == extra


@pytest.mark.slow  # compiling takes about half a minute on 2 cores
@pytest.mark.parametrize("recipe", [None, "tensorwise"])
def test_compiled_attention_keeps_the_copied_keys_and_values(recipe):
    """Keys and values copied to the query heads before the kernel (Hugging Face's repeat_kv;
    litgpt's expand and reshape) under torch.compile: the partitioner keeps the copies, as eager
    autograd does (--attention-expands-kv was refused with --compile until 2026-12-04, on the
    guess that the partitioner would make them again in backward)."""
    s = 64
    m, traced = _compiled_block_saved("swiglu", recipe, "none", s, expand_kv=True)
    t = TrainSpec(seq_len=s, fused_norm=False, compile=True, float8=recipe is not None,
                  attention_expands_kv=True)
    planned = activation_memory.block_saved_bytes(m, t, "none")
    assert 0 <= traced - planned < 1024, (traced, planned)
    plain = activation_memory.block_saved_bytes(m, t.model_copy(update={"attention_expands_kv": False}), "none")
    assert planned - plain == 2 * 2 * s * (m.q_hidden - m.kv_hidden)  # the copies, q-wide, for k and v


@pytest.mark.slow  # compiling takes about half a minute on 2 cores
@pytest.mark.parametrize("mlp, recipe", [("swiglu", None), ("gelu", None), ("swiglu", "tensorwise")])
def test_compiled_selective_block_keeps_what_backward_reads(mlp, recipe):
    """The trainer's selective policy under torch.compile: the partitioner keeps a saved
    matmul's output only where backward reads it, so SwiGLU's w2 output (which flows into the
    residual add alone) is dropped; eager keeps it. torchao's float8 linears change nothing
    here: the policy sees their matmuls as it sees bf16 ones, and every cast is recomputed."""
    s = 64
    m, traced = _compiled_block_saved(mlp, recipe, "selective", s)
    t = TrainSpec(seq_len=s, fused_norm=False, compile=True, checkpointing="selective",
                  float8=recipe is not None)
    planned = activation_memory.block_saved_bytes(m, t, "selective")
    assert 0 <= traced - planned < 1024, (traced, planned)
    eager = activation_memory.block_saved_bytes(m, TrainSpec(seq_len=s, fused_norm=False,
                                                             checkpointing="selective"), "selective")
    assert eager - planned == (2 * s * m.hidden if mlp == "swiglu" else 0)  # eager keeps w2's output


@pytest.mark.parametrize("impl", ["functional", "torchtitan-module"])
def test_composite_norm_saves_against_pytorch_memtracker(impl):
    """What an unfused RMSNorm keeps for backward beside its per-row rstd: F.rms_norm's CPU
    fallback (the trainer on CPU ranks) keeps the fp32 input and fp32 normalized output (8 B per
    element); torchtitan's module (torchtitan/models/norms.py, 2024: `self._norm(x.float())
    .type_as(x) * self.weight`) casts back first and keeps 4 + 2 B (norm_output_fp32 = False)."""
    torch = pytest.importorskip("torch")
    from torch import nn
    from torch.distributed._tools.mem_tracker import MemTracker

    class TorchtitanRMSNorm(nn.Module):  # the source's module, as published
        def __init__(self, dim):
            super().__init__()
            self.weight, self.eps = nn.Parameter(torch.ones(dim)), 1e-6

        def _norm(self, x):
            return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)

        def forward(self, x):
            return self._norm(x.float()).type_as(x) * self.weight

    class Functional(nn.Module):
        def __init__(self, dim):
            super().__init__()
            self.weight = nn.Parameter(torch.ones(dim))

        def forward(self, x):
            return torch.nn.functional.rms_norm(x, (x.shape[-1],), self.weight, 1e-6)

    rows, dim = 4 * 256, 1024
    norm = (Functional if impl == "functional" else TorchtitanRMSNorm)(dim).to(torch.bfloat16)
    x = torch.randn(4, 256, dim, dtype=torch.bfloat16, requires_grad=True)
    mt = MemTracker()
    mt.track_external(norm, x)
    cpu = torch.device("cpu")
    with mt:
        before = mt.get_tracker_snapshot("current")[cpu]["Total"]
        y = norm(x)
        after = mt.get_tracker_snapshot("current")[cpu]["Total"]
    kept = after - before - y.numel() * y.element_size() - 4 * rows  # less the output and fp32 rstd
    t = TrainSpec(fused_norm=False, norm_output_fp32=impl == "functional")
    assert kept == activation_memory.norm_saved_per_token(t, 2) * rows * dim


def test_accumulated_gradients_are_reported_once():
    """Skipping the reduce, the accumulated gradients are live in the unsharded-gradient kind at
    every event; they are reported as accum_grad_bytes alone, not inside reduce_buffer_bytes too
    (the components summed to 32 GB more than the allocated peak at 8B)."""
    sc = _sc(grad_accum=4, reduce_last_only=True, gpus="16")
    m = memory(sc, effective("zero3", "torch"))
    assert m.accum_grad_bytes == 4 * arch.param_count(sc.model)  # fp32 (the reduce dtype)
    parts = m.params_bytes + m.gather_buffer_bytes + m.reduce_buffer_bytes + m.accum_grad_bytes + m.activation_bytes
    assert parts <= m.allocated_bytes
    assert m.reduce_buffer_bytes < m.accum_grad_bytes


@pytest.mark.parametrize("strategy", ["zero1", "zero2", "zero3"])
def test_deepspeed_step_makes_an_fp32_gradient_partition(strategy):
    """DeepSpeed's step turns the 16-bit gradient partition into fp32 through a flat copy:
    `flatten(averaged_gradients).to(fp32)` (stage_1_and_2.py step; stage3.py
    _prepare_fp32_grad_for_sub_group, a sub-group of 1e9 elements or a little more at a time): 2 + 4 bytes
    per local element alive at the optimizer step (FusedAdam itself works in place)."""
    sc = _sc(layout="zero", checkpointing="full", seq_len=2048)
    psi = arch.param_count(sc.model)
    step = next(e for e in timeline(sc, effective(strategy, "zero")) if e.phase == "optimizer")
    local = psi / 8  # 1.004e9 on each of 8 GPUs: ZeRO-3 takes a sub-group at a time, closed once it
    # holds 1e9 elements or more (stage3.py _create_fp16_sub_groups): 1e9 up to one partition more
    if strategy == "zero3":
        largest = max(math.prod(s) for u in sc.units for s in u.shapes) / 8
        assert 6 * 10**9 <= step.live.get("step_temps", 0) <= 6 * min(10**9 + largest, local + 8)
    else:
        assert step.live.get("step_temps", 0) == pytest.approx(6 * local, rel=1e-3)
    if strategy == "zero3":  # step() begins with _partition_all_parameters: nothing gathered
        back = [e for e in timeline(sc, effective(strategy, "zero")) if e.phase == "backward"]
        assert step.live.get("gathered", 0) == 0 < min(e.live.get("gathered", 0) for e in back)


def _ddp_step_against_memtracker(ddp, train, x, y, snap: list | None = None) -> dict:
    """The trainer's DDP micro-batch (trainer/micro_batch.py; one rank, the wrapper left out) run
    once and stepped, so that gradients and AdamW's state exist as DDP keeps them, then again
    under PyTorch's MemTracker: the bytes it holds at the start (the state), at its peak, and at
    each moment a function appended to `snap` (called by the caller's hooks) records."""
    import torch
    from torch.distributed._tools.mem_tracker import MemTracker

    from zplan.trainer.micro_batch import forward_loss

    model = ddp.inner
    opt = torch.optim.AdamW(model.parameters(), foreach=False)

    def micro_batch():
        out, _ = forward_loss(ddp, train, x, y, sync=True)
        out.backward()

    micro_batch()
    opt.step()
    opt.zero_grad(set_to_none=False)  # the gradients stay allocated, as DDP's bucket views
    mt = MemTracker()
    mt.track_external(model, opt)
    seen = {}
    total = lambda kind: next(iter(mt.get_tracker_snapshot(kind).values()))["Total"]  # noqa: E731
    with mt:
        seen["state"] = total("current")
        if snap is not None:
            snap.append(lambda: seen.setdefault("forward", total("current")))
        micro_batch()
        seen["peak"] = total("peak")
    return seen


AUTOCAST_MODEL = """name = "autocast-test"
num_layers = 3
hidden = 256
ffn_hidden = 704
num_heads = 4
num_kv_heads = 2
vocab_size = 512
max_seq_len = 256
source = "test: Llama-shaped, small"
"""


WIDE = dict(num_layers=2, ffn=4096)  # a wide MLP: a block's backward, not the loss, peaks


@pytest.mark.slow  # over a second each: the fast loop leaves it to CI
@pytest.mark.parametrize("mode,mlp,tied,loss,units,shape", [("none", "swiglu", False, "none", 1, {}),
                                                            ("full", "swiglu", False, "none", 1, {}),
                                                            ("selective", "swiglu", False, "none", 1, {}),
                                                            ("none", "gelu", False, "none", 1, {}),
                                                            ("every-k", "swiglu", True, "none", 1, {}),
                                                            ("first-k", "swiglu", False, "none", 1, {}),
                                                            ("every-k", "swiglu", False, "none", 2, {}),
                                                            ("first-k", "swiglu", False, "none", 1, WIDE),
                                                            ("first-k", "swiglu", False, "none", 2, WIDE),
                                                            ("none", "swiglu", False, "chunked", 1, {})])
def test_ddp_under_autocast_against_pytorch_memtracker(tmp_path, mode, mlp, tied, loss, units, shape):
    """DDP's step under autocast (fp32 weights, bf16 compute) as the trainer runs one micro-batch
    (trainer/micro_batch.py: forward and loss under torch.autocast), against PyTorch's MemTracker
    on the real model on CPU: what forward ends with (autocast's cached weight copies, the fp32
    residual stream, one 16-bit input copy per linear) and the peak of forward and backward (the
    copies freed at autocast's exit unless a matmul saved them, made again by recomputation).
    zplan counted every weight copy at every event and the stream in bf16: -2.2% and +4.6%.
    Held on what the step adds to the model state (the state is most of the total here). Units
    of two blocks put a checkpointed block and one that keeps everything in one unit (every-2;
    first-1 of two wide blocks: the kept block's weight copies and the checkpointed block's copies
    made again are never alive together). DDP has no units: the same run, its backward included,
    is predicted in units of one or two."""
    torch = pytest.importorskip("torch")

    from zplan import policy, presets
    from zplan.scenario_options import cpu_ranks
    from zplan.trainer.model import Transformer
    from zplan.trainer.parallel import DTYPES, Parallelized, apply_checkpointing

    path = tmp_path / "m.toml"
    text = AUTOCAST_MODEL
    if shape:
        text = text.replace("num_layers = 3", f"num_layers = {shape['num_layers']}").replace(
            "ffn_hidden = 704", f"ffn_hidden = {shape['ffn']}")
    path.write_text(text + f'mlp = "{mlp}"\n' + ("tied_embeddings = true\n" if tied else ""))
    first = 1 if shape else 2
    def planned(units):
        return build(cpu_ranks(model=str(path), gpus="1", gpus_per_node=2, seq_len=128, micro_batch=2,
                               param_dtype="bf16", checkpointing=mode, checkpoint_every=2,
                               checkpoint_first=first, blocks_per_unit=units, linear_loss=loss))

    sc = planned(units)
    events = timeline(sc, effective("ddp", "torch"))
    step = lambda e: e.total_bytes - e.live["state"]  # noqa: E731
    predicted_peak = max(step(e) for e in events if e.phase != "optimizer")
    if units > 1:  # DDP has no units: the run is the same in units of one, its backward too
        alone = timeline(planned(1), effective("ddp", "torch"))
        assert predicted_peak == max(step(e) for e in alone if e.phase != "optimizer")
        assert max(step(e) for e in events if e.phase == "backward") == \
            max(step(e) for e in alone if e.phase == "backward")
    predicted_forward = step(next(e for e in events if e.label == "forward end"))

    m = presets.model(str(path))
    torch.manual_seed(0)
    model = Transformer(m)
    apply_checkpointing(model, mode, 2, first=first)
    x, y = torch.randint(0, 512, (2, 128)), torch.randint(0, 512, (2, 128))
    # the trainer's micro-batch (the DDP wrapper left out: one rank, no reduction) under the
    # autocast the trainer's DDP path chooses
    p = sc.train.precision
    cast = DTYPES[policy.autocast_dtype(False, sc.train.layout, p.param, p.master)]
    ddp = Parallelized(model, model, False, [], cast)
    snap = []  # what forward ends with, before the loss (the chunked loss ends inside the head)

    def at_forward_end(*_):  # returns None: the output is kept
        for f in snap:
            f()

    model.register_forward_hook(at_forward_end)
    seen = _ddp_step_against_memtracker(ddp, sc.train, x, y, snap)
    state, measured_peak = seen["state"], seen["peak"]
    if loss == "none":  # the chunked loss ends its forward inside the head
        assert predicted_forward == pytest.approx(seen["forward"] - state, rel=0.005)
    assert predicted_peak == pytest.approx(measured_peak - state, rel=0.005)


def test_explain_prices_ddp_activations_under_autocast():
    """explain shows what each strategy is priced on: under DDP's autocast q, k and v each keep
    a bf16 copy of the norm's fp32 output (3 x 2 bytes per element), under FSDP2 they share the
    bf16 output (2 bytes)."""
    from zplan.explain import explain_lines

    sc = _sc(model="llama-3.2-1b", seq_len=2048)
    T_h = 2048 * 2048  # tokens x hidden of one micro-batch
    for name, copies in (("ddp", 3), ("zero3", 1)):
        line = next(x for x in explain_lines(sc, name) if "per block, qkv_input" in x)
        assert line.split()[-2] == f"{copies * 2 * T_h / 1e9:,.3f}", (name, line)


def test_explain_names_both_kinds_of_block_under_partial_checkpointing():
    """first-k and every-k keep two kinds of block: explain gives each its count and what one
    keeps (Llama 3.2 1B, 16 blocks: first-5 is 5 and 11, every-4 is 4 and 12), the checkpointed
    ones their input alone (s x h x 2 bytes), and the header names the k."""
    from zplan.explain import explain_lines

    T_h = 2048 * 2048
    for kw, wrapped, label in ((dict(checkpointing="first-k", checkpoint_first=5), 5, "first-5"),
                               (dict(checkpointing="every-k", checkpoint_every=4), 4, "every-4")):
        lines = explain_lines(_sc(model="llama-3.2-1b", seq_len=2048, **kw), "zero3")
        assert any(f"{label} checkpointing)" in x for x in lines)
        full = next(x for x in lines if f"kept per block, the {wrapped} checkpointed:" in x)
        assert full.split()[-2] == f"{2 * T_h / 1e9:,.3f}", full
        assert any(f"kept per block, the {16 - wrapped} not checkpointed:" in x for x in lines)


W1_MODEL = """name = "w1-test"
num_layers = 4
hidden = 1024
ffn_hidden = 3584
num_heads = 8
num_kv_heads = 2
vocab_size = 512
max_seq_len = 2048
source = "test: small vocabulary, so the peak is in a block's backward"
"""


@pytest.mark.slow  # over a second each: the fast loop leaves it to CI
@pytest.mark.parametrize("mode", ["none", "full"])
def test_block_backward_peak_on_one_rank_against_fsdpmemtracker(tmp_path, mode):
    """FSDPMemTracker under FakeTensorMode, one rank: FSDP2 issues no all-gather for a group of
    one (it copies each shard into its unsharded parameter), and a block's backward peaks once
    the down projection's saved input is released, with the MLP's branch gradients made. zplan
    counted a gather buffer and that input: +3.4% without checkpointing."""
    pytest.importorskip("torch")
    from zplan.trainer.fake_trace import fake_cell

    path = tmp_path / "w1.toml"
    path.write_text(W1_MODEL)
    c = fake_cell(str(path), 1, 2048, 2, mode, "zero3")
    assert c.predicted_phase == c.traced_phase == "backward", c
    assert abs(c.error) <= 0.0075, c


def test_one_partition_gathers_nothing_in_either_layout():
    """A shard group of one gathers nothing: DeepSpeed points each parameter at its partition
    (the installed DeepSpeed's partition_parameters.py returns `_no_gather_coalesced` when
    num_partitions == 1, or in newer releases when every parameter's partition group has one
    rank), FSDP2 copies each shard into its unsharded parameter (one rank:
    test_block_backward_peak_on_one_rank_against_fsdpmemtracker). Two ranks gather."""
    import importlib.util
    import re
    from pathlib import Path

    spec = importlib.util.find_spec("deepspeed")
    if spec is None or spec.origin is None:
        pytest.skip("deepspeed is not installed")
    src = (Path(spec.origin).parent / "runtime" / "zero" / "partition_parameters.py").read_text()
    one_rank = r"if (self\.num_partitions == 1|all\(self\._partition_world_size\(param\) == 1 for param in params\)):"
    assert re.search(one_rank + r"\s*return _no_gather_coalesced\(params\)", src)
    # DeepSpeed's gathered weights; FSDP2's all-gather outputs (its unsharded parameters are
    # there either way)
    # (a block's forward: its largest weight is 8192 x 2048, its weights 60.8M elements)
    for layout, kind in (("zero", "gathered"), ("torch", "all_gather")):
        one, two = (max(e.live.get(kind, 0) for e in timeline(
            _sc(model="llama-3.2-1b", gpus=str(n), layout=layout, seq_len=2048), effective("zero3", layout))
            if e.label.startswith(("forward blocks", "forward end"))) for n in (1, 2))
        assert one <= 2 * 8192 * 2048, layout  # at most its largest weight's bf16 copy
        assert two >= 2 * 60_000_000, layout  # a block's weights in bf16


def test_one_partition_under_param_offload_copies_its_weights_to_the_gpu():
    """DeepSpeed's one-partition path under offload_param: the partition is in host memory and
    NoGatherHandle copies it to the GPU (`param.ds_tensor.data.to(device=...)` in the installed
    partition_parameters.py), so one GPU holds the fetched weights as two do (was 0 bytes: a
    one-GPU offload-all plan 1.5-5.8 GB light, fitting where two GPUs would not)."""
    import importlib.util
    import re
    from pathlib import Path

    spec = importlib.util.find_spec("deepspeed")
    if spec is None or spec.origin is None:
        pytest.skip("deepspeed is not installed")
    src = (Path(spec.origin).parent / "runtime" / "zero" / "partition_parameters.py").read_text()
    handle = src[src.index("class NoGatherHandle"):src.index("class NoGatherCoalescedHandle")]
    assert re.search(r"param\.data = param\.ds_tensor\.data\.to\(device=get_accelerator\(\)\.current_device_name\(\)", handle)
    st = effective("offload-all", "zero")
    one, two = (max(e.live.get("gathered", 0) for e in timeline(
        _sc(model="llama-3.2-1b", gpus=str(n), layout="zero", seq_len=2048), st)) for n in (1, 2))
    assert two >= 2 * 60_000_000  # a block's weights in bf16 (60.8M elements), gathered
    assert abs(one - two) <= 2 * 2 * 64  # the same set; padding to 2 ranks, a few elements a unit


def test_one_rank_copies_are_priced_as_fsdp2_makes_them():
    """FSDP2 on a shard group of one (the installed torch's _fsdp_param_group.py and
    _fsdp_collectives.py): each shard copied into its unsharded parameter (a cast only where the
    gather dtype differs), the reduce-scatter input copied into its output; with two ranks one
    copy-in and one copy-out per unit."""
    import importlib.util
    from pathlib import Path

    from zplan.comm import gather_dtype
    from zplan.unit_ops import fsdp_copies

    spec = importlib.util.find_spec("torch")
    if spec is None or spec.origin is None:
        pytest.skip("torch is not installed")
    fsdp = Path(spec.origin).parent / "distributed" / "fsdp" / "_fully_shard"
    assert "tensor.copy_(all_gather_input)" in (fsdp / "_fsdp_param_group.py").read_text()
    assert "reduce_output.copy_(reduce_scatter_input" in (fsdp / "_fsdp_collectives.py").read_text()
    for param_dtype, cast in (("fp32", False), ("bf16", True)):
        sc = _sc(model="llama-3.2-1b", gpus="1", seq_len=2048, param_dtype=param_dtype)
        st = effective("zero3", "torch")
        u = next(u for u in sc.units if u.blocks)
        fwd, bwd = fsdp_copies(sc, st, u, 1, gather_dtype(sc, u))
        names = [op.name for op in fwd]
        assert ("all-gather copy-in" in names) == cast, param_dtype
        assert all(op.kernels == len(u.shapes) for op in fwd)
        out = next(op for op in bwd if op.name.startswith("reduce-scatter output copy"))
        assert out.bytes == 2 * 4 * u.numel  # fp32 reduce, read and written
        fwd2, bwd2 = fsdp_copies(sc, st, u, 2, gather_dtype(sc, u))
        assert [op.kernels for op in fwd2] == [1, 1]
        assert not any(op.name.startswith("reduce-scatter output copy") for op in bwd2)


def test_deepspeed_copies_what_it_gathers_in_calls_of_several_parameters():
    """DeepSpeed's ZeRO-3 (the installed partition_parameters.py): a call of several parameters
    copies their shards into the send buffer (torch.cat into the rank's partition) and each
    parameter out of the gathered partitions (torch.cat per parameter); a call of one sends the
    shard and makes the parameter a view of the buffer. So a unit's copies are those of the
    parameters its coordinator gathers in calls of several (held against DeepSpeed's own calls
    in tests/test_deepspeed_release.py), forward and backward apart; at DeepSpeed's defaults
    on 70B's blocks most prefetches are one weight and copy nothing."""
    import importlib.util
    from pathlib import Path

    from zplan.comm import ds_coordination, gather_dtype
    from zplan.unit_ops import fsdp_copies

    spec = importlib.util.find_spec("deepspeed")
    if spec is None or spec.origin is None:
        pytest.skip("deepspeed is not installed")
    src = (Path(spec.origin).parent / "runtime" / "zero" / "partition_parameters.py").read_text()
    coalesced = src[src.index("def _all_gather_dtype"):src.index("def _all_gather_coalesced")]
    assert "torch.cat)(" in coalesced and "out=partitions[rank_in_group]" in coalesced
    assert "param.data = instrument_w_nvtx(torch.cat)(partitions)" in src
    sequential = src[src.index("def _all_gather_sequential"):]
    assert "param.data = param_buffer.narrow(0, 0, param.ds_numel).view(param.ds_shape)" in sequential
    assert "if self.allgather_sequential or len(params) == 1:" in src
    share = {}
    for defaults in (True, False):
        sc = _sc(model="llama-3.1-70b", gpus="32", layout="zero", checkpointing="full", seq_len=2048,
                 deepspeed_defaults=defaults)
        st = effective("zero3", "zero")
        ds = ds_coordination(sc, st)
        i = 5
        u = sc.units[i]
        fwd, bwd = fsdp_copies(sc, st, u, 32, gather_dtype(sc, u), (ds.coalesced[i], ds.coalesced_calls[i]))
        for ops, params in ((fwd, ds.coalesced[i][0]), ([o for o in bwd if o.name.startswith("all-gather")],
                                                       ds.coalesced[i][1])):
            m = sum(-(-n // 32) * 32 for n in params)
            assert sum(o.bytes for o in ops) == (2 + 2) * m // 32 + 2 * 2 * m  # bf16 in, bf16 out
            assert sum(o.kernels for o in ops if o.name.endswith("copy-out")) == len(params)
        share[defaults] = sum(ds.coalesced[i][0]) / u.numel
    # the defaults' prefetcher takes one 67M weight at a time (only k, v and o go together);
    # zplan's export prefetches up to a unit, within two units live
    assert 0 < share[True] < 0.2 < share[False] < 1


@pytest.mark.parametrize("model", ["llama-3.2-1b", "mixtral-8x7b"])
def test_autocast_casts_every_matmul_weight_once_per_forward(model):
    """Under DDP's autocast a block's forward casts each matmul weight once (all experts of an
    MoE layer, whatever a token uses; not its router, which torchtitan runs under an inner fp32
    autocast on fp32 weights and the norm's fp32 output: nothing to cast) and the norms' fp32
    outputs at each linear that reads them; counted against the block's parameter shapes
    (arch.block_shapes, whose counts equal the published ones) less its two norms."""
    from zplan.unit_ops import unit_ops

    sc = _sc(model=model, seq_len=2048).for_strategy(False)
    assert sc.train.autocast
    m, u = sc.model, next(u for u in sc.units if u.blocks == 1)
    T, h = 2048, m.hidden
    weights = u.numel - 2 * h - m.num_experts * h  # two RMSNorm weights (and the router's)
    inputs = (3 + 2) * T * h  # q, k, v, w1, w3
    if m.num_experts:  # the k routed copies feed w1 and w3 of each active expert
        inputs += 2 * (m.experts_per_token - 1) * T * h
    cast = next(op for op in unit_ops(sc, u, backward=False) if op.name == "autocast casts")
    assert cast.bytes == (2 + 4) * (weights + inputs)


TIED_MODEL = """name = "tied-ddp-test"
num_layers = 2
hidden = 256
ffn_hidden = 704
num_heads = 4
num_kv_heads = 2
vocab_size = 8192
max_seq_len = 256
tied_embeddings = true
source = "test: Llama-shaped, a vocabulary-sized weight larger than a step's activations"
"""


def _tied_bf16_scenario(tmp_path, **kw):
    """TIED_MODEL on one CPU rank in bf16 throughout (no autocast), seq 32; `kw` more options."""
    from zplan.scenario_options import cpu_ranks

    path = tmp_path / "m.toml"
    path.write_text(TIED_MODEL)
    return build(cpu_ranks(model=str(path), gpus="1", gpus_per_node=2, seq_len=32, micro_batch=1,
                           param_dtype="bf16", master_dtype="bf16", optimizer_dtype="bf16",
                           checkpointing="none", **kw)), path


def test_a_tied_heads_gradient_waits_for_the_embeddings_under_ddp(tmp_path):
    """DDP's step in bf16 (no autocast) on a model whose tied weight outweighs its activations,
    against PyTorch's MemTracker on the real model on CPU: the head's gradient waits in
    autograd's input buffer through every block's backward, and at the embedding's backward it
    meets the embedding's gradient and their out-of-place sum (3 weights, the peak). zplan
    counted none of them (-65% of what the step adds here: its peak was the loss's backward).
    Dispatch modes never accumulate in place, so only the plain head in bf16 -- out of place in
    a real run too -- is held here."""
    torch = pytest.importorskip("torch")

    from zplan import presets
    from zplan.memory_timeline import tied_head_grad_wait
    from zplan.trainer.model import Transformer
    from zplan.trainer.parallel import Parallelized

    sc, path = _tied_bf16_scenario(tmp_path)
    events = timeline(sc, effective("ddp", "torch"))
    step = lambda e: e.total_bytes - e.live["state"]  # noqa: E731
    top = max((e for e in events if e.phase != "optimizer"), key=step)
    w = 8192 * 256 * 2  # the tied weight in bf16
    assert tied_head_grad_wait(sc.for_strategy(False)) == (w, 3 * w)
    assert top.label == "backward embed+head"

    torch.manual_seed(0)
    model = Transformer(presets.model(str(path))).to(torch.bfloat16)
    x, y = torch.randint(0, 8192, (1, 32)), torch.randint(0, 8192, (1, 32))
    seen = _ddp_step_against_memtracker(Parallelized(model, model, False, [], None), sc.train, x, y)
    measured = seen["peak"] - seen["state"]
    assert step(top) == pytest.approx(measured, rel=0.01)
    # without them the peak was the loss's backward, far below (-65%)
    assert step(next(e for e in events if e.label == "loss backward")) < 0.5 * measured


@pytest.mark.parametrize("scope", ["block", "model"])
def test_a_tied_weights_wait_under_compile_follows_where_embedding_and_head_run(tmp_path, scope):
    """Per-block compile leaves embedding and head eager: the head's gradient waits as without
    compile, through every block's backward and each block graph's return (1 weight), and the
    embedding's backward holds three (the sum out of place in bf16). Whole-model compile puts
    both in one graph, whose gradients the graph's own events price: the head's, in the
    computation dtype, from its backward to the graph's last kernel (CompiledGraphs.tied_head),
    no eager wait beside it."""
    sc, _ = _tied_bf16_scenario(tmp_path, compile=True, compile_scope=scope)
    w = 8192 * 256 * 2
    back = [e for e in timeline(sc, effective("ddp", "torch")) if e.phase == "backward"]
    held = {e.label: e.live.get("unsharded_grads", 0) for e in back}
    if scope == "block":
        assert held["backward embed+head"] == 3 * w
        blocks = [v for k, v in held.items() if "blocks." in k]
        assert len(blocks) == 4 and min(blocks) >= w  # two blocks, each with its graph's return
    else:
        assert held["backward embed+head"] == w and held["backward blocks.1"] == w


@pytest.mark.parametrize("model,gpus,extra", [("llama-3.1-8b", 8, {"micro_batch": 2}),
                                               ("llama-3.1-8b", 16, {"layout": "torch"}),
                                               ("gpt2-124m", 8, {"seq_len": 1024}),
                                               ("tiny", 4, {"seq_len": 256})])
def test_partial_modes_that_wrap_every_block_are_full_checkpointing(model, gpus, extra):
    """every-1 and first-L wrap the blocks full wraps (the trainer's one reading,
    policy.wrapped_blocks) and are priced as full, to the byte and the second, every strategy:
    the QA pass found ZeRO-1/2's cached parameter blocks and the forward's holes priced only
    under the name "full" (8B ZeRO-1: 61.1 against 48.4 GB reserved)."""
    from zplan.estimate import estimate_one
    from zplan.policy import wrapped_blocks
    from zplan.presets import model as model_preset

    L = model_preset(model).num_layers
    scs = [build(ScenarioOptions(model=model, gpus=str(gpus), checkpointing=mode, checkpoint_every=1,
                                 checkpoint_first=L, **extra)) for mode in ("full", "every-k", "first-k")]
    assert len({wrapped_blocks(sc.train, L) for sc in scs}) == 1
    for name in ("ddp", "zero1", "zero2", "zero3", "hsdp"):
        rs = [estimate_one(sc, name) for sc in scs]
        if rs[0].memory is None:
            continue
        for r in rs[1:]:
            assert r.memory == rs[0].memory, name
            assert r.timing == rs[0].timing, name


@pytest.mark.parametrize("model,gpus,loss", [("qwen3-8b", "16", "chunked"), ("llama-3.1-8b", "64", "chunked"),
                                             ("llama-3.1-8b", "8", "none")])
def test_offload_all_components_add_up_to_the_allocated_peak(model, gpus, loss):
    """Under offload-all the model state is on the host, yet at the head's reduce-scatter a
    sharded gradient sits on the GPU on its way there: no component held it, and allocated
    exceeded the components' sum by one head shard (155,583,488 bytes for qwen3-8b on 16 GPUs,
    the consistency sweep). It is reported with the reduce buffers."""
    from tests.helpers import est

    m = est("offload-all", model=model, gpus=gpus, layout="torch", linear_loss=loss).memory
    parts = (m.params_bytes + m.grads_bytes + m.master_bytes + m.optimizer_bytes + m.gather_buffer_bytes
             + m.reduce_buffer_bytes + m.accum_grad_bytes + m.activation_bytes + m.step_temp_bytes)
    assert parts == m.allocated_bytes
