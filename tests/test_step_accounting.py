"""How the step's communication is charged: what is exposed, what hides, what the hidden part
costs compute (contention), per strategy and layout. The oracles are the runtimes' own
behaviour, read in their code: DeepSpeed's engine (stage 0 reduces after backward, once per
step), DDP's and DeepSpeed's buckets (the last holds the embedding's gradient), PyTorch's
ZeroRedundancyOptimizer (whole parameters), and NCCL's SMs (copy engines take none)."""

import pytest

from zplan.comm import WHOLE_MATRIX, call_seconds
from zplan.units import nbytes
from tests.helpers import est, scenario

# Llama 3.2 1B (Hugging Face config): vocab 128256, hidden 2048, embeddings tied
EMBED_ELEMS = 128256 * 2048


def _reductions(r):
    return [c for c in r.collectives if c.op in ("all_reduce", "reduce_scatter")]


@pytest.mark.parametrize("accum", [1, 8])
def test_deepspeed_stage0_reduces_once_after_backward(accum):
    """engine.py _backward_epilogue -> allreduce_gradients: at the accumulation boundary only,
    after backward has returned (buffered_allreduce_fallback), so nothing hides it."""
    r = est("ddp", model="llama-3.2-1b", gpus=16, layout="zero", grad_accum=accum)
    (red,) = _reductions(r)
    assert red.calls_per_step == 1
    assert r.timing.exposed_comm_s == pytest.approx(red.seconds_per_call, rel=1e-12)
    assert r.timing.contention_s == 0.0
    torch_ddp = est("ddp", model="llama-3.2-1b", gpus=16, layout="torch", grad_accum=accum)
    (tred,) = _reductions(torch_ddp)  # DDP's buckets reduce beside backward, all but the last
    assert torch_ddp.timing.exposed_comm_s < 0.5 * tred.calls_per_step * tred.seconds_per_call


@pytest.mark.parametrize("strategy,layout,kw", [
    ("ddp", "torch", {}),
    ("zero2", "zero", {}),
    ("zero2", "zero", {"deepspeed_defaults": True}),
    ("zero1", "zero", {}),
])
def test_the_last_bucket_holds_the_embedding_gradient(strategy, layout, kw):
    """Backward's end waits for the bucket filled last, which holds the embedding's gradient
    (DDP and DeepSpeed put a parameter over the cap in a bucket of its own): exposed is at least
    one reduction of the embedding's gradient, and less than the whole reduction."""
    sc = scenario(model="llama-3.2-1b", gpus=16, layout=layout, **kw)
    r = est(strategy, model="llama-3.2-1b", gpus=16, layout=layout, **kw)
    (red,) = _reductions(r)
    embed = call_seconds(sc, red.op, nbytes(EMBED_ELEMS, red.dtype), red.group_size,
                         sc.hw.cluster.gpus_per_node)
    assert red.last_bucket_s >= embed * (1 - 1e-9)
    assert red.last_bucket_s < red.seconds_per_call
    ag = sum(c.seconds_per_call * c.calls_per_step for c in r.collectives if c.op == "all_gather")
    assert r.timing.exposed_comm_s >= ag + red.calls_per_step * embed * (1 - 1e-9)


def test_muon_gathers_where_shards_split_matrices():
    """ZeroRedundancyOptimizer (zero1, torch layout) owns whole parameters: Muon needs no
    gather; DeepSpeed's flat partitions and FSDP2's dim-0 shards split them: it does, over the
    group that shards the state (HSDP: the shard group, here one node)."""
    kw = dict(model="llama-3.1-8b", gpus=16, optimizer="muon")
    names = lambda r: {c.name for c in r.collectives}  # noqa: E731
    assert WHOLE_MATRIX not in names(est("zero1", layout="torch", **kw))
    assert WHOLE_MATRIX in names(est("zero1", layout="zero", **kw))
    hsdp = est("hsdp", layout="torch", shard_size=8, **kw)
    (whole,) = [c for c in hsdp.collectives if c.name == WHOLE_MATRIX]
    assert (whole.group_size, whole.scope) == (8, "intra-node")


def test_muons_gather_is_communication_not_less_contention():
    """Muon's gathers add communication; they must not shrink the hidden part (they were
    counted exposed but not as communication, so contention fell)."""
    kw = dict(model="llama-3.1-8b", gpus=16, layout="torch")
    adamw, muon = est("zero3", **kw), est("zero3", optimizer="muon", **kw)
    assert muon.timing.contention_s == pytest.approx(adamw.timing.contention_s, rel=1e-9)


def test_host_copies_take_no_sms():
    """offload-all's host->GPU copies run on copy engines: with every NCCL collective hidden
    in both, offload-all's contention equals zero3's (the same collectives)."""
    kw = dict(model="llama-3.1-8b", gpus=16, layout="torch", checkpointing="full")
    z3, off = est("zero3", **kw), est("offload-all", **kw)
    nccl = lambda r: [(c.name, c.seconds_per_call) for c in r.collectives if c.op not in ("h2d", "d2h")]  # noqa: E731
    assert nccl(z3) == nccl(off)
    assert off.timing.contention_s <= z3.timing.contention_s * (1 + 1e-9)
    assert off.timing.contention_s == pytest.approx(z3.timing.contention_s, rel=0.05)


@pytest.mark.parametrize("strategy", ["zero3", "ddp", "zero2", "hsdp"])
def test_without_overlap_nothing_hides_and_nothing_contends(strategy):
    r = est(strategy, model="llama-3.2-1b", gpus=16, layout="torch", overlap=False)
    assert r.timing.contention_s == 0.0


def test_a_root_holding_the_head_runs_it_at_the_other_end():
    """FSDP2's root holding embeddings and head (tied, or --embed-head-unit root/root-kept):
    forward runs the embedding lookup first and the head last, backward the head first (after
    the root's re-gather where it reshards) and the embedding's gradient last. So the first
    block's gather has only the lookup beside it, the last block's re-gather hides behind the
    head's backward, and root and root-kept differ by exactly the root's one re-gather."""
    kw = dict(model="llama-3.1-8b", gpus=64, cluster="dgx-a100", gpu="a100-80gb", layout="torch")
    root, kept = (est("zero3", embed_head_unit=e, **kw) for e in ("root", "root-kept"))
    r0, r1, rl = root.timing.units[0], root.timing.units[1], root.timing.units[-1]
    assert r1.forward_exposed_s == pytest.approx(r1.all_gather_s, rel=1e-12)
    assert rl.backward_exposed_s == 0.0  # its own re-gather is in the root's, hidden by the head
    assert r0.backward_exposed_s >= r0.all_gather_s + r0.reduce_s + r1.reduce_s - 1e-12
    delta = root.timing.exposed_comm_s - kept.timing.exposed_comm_s
    assert delta == pytest.approx(r0.all_gather_s, rel=1e-9)


@pytest.mark.parametrize("strategy", ["offload-opt", "offload-all"])
@pytest.mark.parametrize("efficiency", [None, 0.5])
def test_an_offloaded_optimizer_costs_the_gpu_nothing(strategy, efficiency):
    """The CPU runs the step (offload_s); with --efficiency the GPU's share was still charged."""
    kw = {} if efficiency is None else {"efficiency": efficiency}
    r = est(strategy, model="llama-3.2-1b", gpus=8, layout="zero", **kw)
    assert r.timing.optimizer_s == 0.0 and r.timing.offload_s > 0


def test_the_cpu_optimizer_step_scales_with_the_bytes_it_moves():
    """The CPU AdamW step is memory-bound: one pass reading the master weight, its gradient, m and
    v and writing the weight, m and v (DeepSpeed's Adam_Optimizer::Step_*, torch's fused CPU
    AdamW). fp32 everywhere moves 4 x 4 + 3 x 4 = 28 B a parameter; bf16 master, gradient and
    states 14: the step takes half as long (the copies over the host link aside)."""
    def cpu_step(**kw):
        r = est("offload-opt", model="llama-3.2-1b", gpus=8, layout="zero", **kw)
        copies = sum(c.seconds_per_step for c in r.collectives if c.op in ("d2h", "h2d"))
        return r.timing.offload_s - copies

    fp32 = cpu_step()
    sc = scenario(model="llama-3.2-1b", gpus=8, layout="zero")
    shard = sum(sc.shard_elems(u, 8) for u in sc.units)  # DeepSpeed's flat partition of one rank
    assert fp32 == pytest.approx(shard / (sc.hw.cluster.cpu_adam_params_per_s / 8), rel=1e-9)  # the preset's rate
    bf16 = cpu_step(master_dtype="bf16", optimizer_dtype="bf16")
    assert bf16 / fp32 == pytest.approx(14 / 28, rel=1e-9)
    mixed = cpu_step(optimizer_dtype="bf16")  # fp32 master and gradient (12 B), bf16 m and v (8)
    assert mixed / fp32 == pytest.approx(20 / 28, rel=1e-9)
    sgd = cpu_step(optimizer="sgd")  # one state, momentum: 12 + 8
    assert sgd / fp32 == pytest.approx(20 / 28, rel=1e-9)
    from zplan.explain import explain_lines  # and explain shows the bytes it priced
    lines = explain_lines(scenario(model="llama-3.2-1b", gpus=8, layout="zero", master_dtype="bf16",
                                   optimizer_dtype="bf16"), "offload-opt")
    assert [x for x in lines if x.startswith("CPU optimizer (adamw): 14 B a parameter")]


def test_deepspeeds_last_bucket_is_the_embedding_alone():
    """DeepSpeed's IPG bucket closes before the parameter that would overflow it, and a gradient
    larger than the bucket is reduced on its own (stage_1_and_2.py): backward's end waits for
    the embedding's gradient alone, where DDP's last bucket also holds what came before it."""
    sc = scenario(model="llama-3.2-1b", gpus=16, layout="zero")
    r = est("zero2", model="llama-3.2-1b", gpus=16, layout="zero")
    (red,) = _reductions(r)
    alone = call_seconds(sc, red.op, nbytes(EMBED_ELEMS, red.dtype), red.group_size, sc.hw.cluster.gpus_per_node)
    assert red.last_bucket_s == pytest.approx(alone, rel=1e-12)


def test_the_cpu_steps_time_by_hand():
    """ZeRO-Offload's CPU step (offload-opt, zero layout, fp32 master and AdamW states) of Llama
    3.1 8B on one dgx-h100 node, by hand: each rank's eighth of the parameters at the node's
    CPU-Adam rate (3.9e9 parameters a second, ZeRO-Offload's Table 4) shared by its 8 ranks,
    plus the fp32 gradient shard down and the bf16 weight shard up over PCIe Gen5 (50 GB/s)."""
    from tests.helpers import est

    r = est("offload-opt", model="llama-3.1-8b", gpus=8, layout="zero")
    shard = 8_030_261_248 / 8
    want = shard / (3.9e9 / 8) + shard * 4 / 50e9 + shard * 2 / 50e9
    assert r.timing.offload_s == pytest.approx(want, rel=1e-4)
    bf16 = est("offload-opt", model="llama-3.1-8b", gpus=8, layout="zero", master_dtype="bf16",
               optimizer_dtype="bf16")  # the step moves 3x2 + 2x4 = 14 bytes a parameter of AdamW's 28;
    # the gradient still comes down in the reduce dtype (fp32)
    assert bf16.timing.offload_s == pytest.approx(shard / (3.9e9 / 8) * 14 / 28 + shard * 4 / 50e9 + shard * 2 / 50e9,
                                                  rel=1e-4)


@pytest.mark.parametrize("kw,again", [
    # DeepSpeed ZeRO-3 (zero layout) at its defaults and as zplan exports it: each fetch copies
    # the shards it gathers from host memory first (partition_parameters.py _all_gather_dtype:
    # ds_tensor.to(device)), so backward copies what its coordinator gathers again
    ({"layout": "zero", "deepspeed_defaults": True}, "all-gather (backward)"),
    ({"layout": "zero", "checkpointing": "full"}, "all-gather (backward)"),
    # FSDP (torch layout): every unit resharded after forward is copied again for backward, and
    # under FSDP1's reentrant checkpoint around the unit once more for its recompute
    ({"layout": "torch"}, "all-gather (backward)"),
    ({"layout": "torch", "embed_head_unit": "root-kept"}, "all-gather (backward)"),
    ({"layout": "torch", "checkpointing": "full", "checkpoint_wraps_unit": True, "checkpoint_early_stop": False},
     "all-gather (backward, again after the recompute: checkpoint around the unit)"),
])
def test_offloaded_weights_are_copied_in_for_every_gather(kw, again):
    """offload-all: the host->GPU copies in backward are the shards of what backward gathers
    again, element for element (the gathers themselves are held against DeepSpeed and FSDP in
    tests/test_deepspeed_release.py and tests/test_trainer.py), in the weights' stored dtype.
    On one GPU a gather takes no time but the copies remain, and the step charges them (a
    review: the backward copies had dropped out of the overlap there)."""
    from zplan.comm import unit_comm
    from zplan.strategies import effective

    one = scenario(model="llama-3.2-1b", gpus=1, **kw)
    st = effective("offload-all", kw["layout"])
    gathered_again = [c for c in unit_comm(one.for_strategy(True), st) if c.backward_h2d_s > 0]
    assert gathered_again and all(c.gathers_in_backward for c in gathered_again)
    r = est("offload-all", model="llama-3.2-1b", gpus=16, **kw)
    sc = scenario(model="llama-3.2-1b", gpus=16, **kw)
    D = 16
    copies = {c.name: c for c in r.collectives if c.op == "h2d"}
    fwd = copies["host->GPU (sharded weights)"]
    assert fwd.calls_per_step == 1 and fwd.elements == sum(sc.padded_elems(u, D) for u in sc.units) // D
    gathered = sum(c.elements for c in r.collectives if c.op == "all_gather" and c.name.startswith("all-gather (backward"))
    assert gathered > 0 and any(c.name == again for c in r.collectives)
    back = copies["host->GPU (sharded weights, gathered again in backward)"]
    assert back.elements * D == gathered
    store = "fp32" if kw["layout"] == "torch" else "bf16"
    assert back.dtype == store and back.seconds_per_call == pytest.approx(
        nbytes(back.elements, store) / sc.hw.gpu.host_link_bytes_per_s, rel=1e-12)
    if kw.get("embed_head_unit") == "root-kept":  # the kept root is not gathered, nor copied, again
        assert back.elements == fwd.elements - sc.padded_elems(sc.units[0], D) // D
