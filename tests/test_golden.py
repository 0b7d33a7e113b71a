"""The figures of shared/design.md and of the cited papers, out of the code."""

import math

import pytest

from zplan import activation_memory, arch, presets
from zplan.specs import TrainSpec
from tests.helpers import est, scenario

GB = 1e9


@pytest.mark.parametrize("name,expected_gb", [("ddp", 120), ("zero1", 31.4), ("zero2", 16.6), ("zero3", 1.9)])
def test_zero_paper_7_5b_on_64(name, expected_gb):
    """Rajbhandari et al. 2020, figure 1: 7.5B params, N = 64, K = 12. The paper's P_os keeps
    whole gradients: DeepSpeed's ZeRO-1 does so while it accumulates (with one micro-batch per
    step and overlap_comm it keeps only its partition, as ZeRO-2: test_memory.py)."""
    r = est(name, params="7.5e9", gpus=64, grad_accum=2)
    assert round(r.memory.model_state_bytes / GB, 1) == expected_gb


def test_70b_model_state_total_and_zero3_share():
    r = est("ddp", params="70e9", gpus=64)
    assert r.memory.model_state_bytes == 16 * 70 * 10**9  # 1.12 TB
    z3 = est("zero3", params="70e9", gpus=64)
    assert z3.memory.model_state_bytes == pytest.approx(17.5e9, rel=1e-6)


def test_70b_block_all_gather_times():
    """A 70B block of ~0.87e9 params, ~1.75 GB in bf16: ~4.2 ms at NVLink4's 361 GB/s all-gather
    busbw (all_gather_perf at 16 GiB on 8 H200, stas00/ml-engineering); over 8 full nodes every NIC carries the rings, so at least the
    265 GB/s that nccl-tests measures at 1 GB on 10 x 8 H100 (issue 8): ~6.4 ms, not the 35 ms
    that one NIC's 50 GB/s would give."""
    m = presets.model("llama-3.1-70b")
    block = arch.units(m)[1]
    assert block.numel == pytest.approx(0.87e9, rel=0.02)
    assert 2 * block.numel == pytest.approx(1.75e9, rel=0.03)
    intra = est("zero3", model="llama-3.1-70b", gpus=8).timing.units[1].all_gather_s
    inter = est("zero3", model="llama-3.1-70b", gpus=64).timing.units[1].all_gather_s
    S = 2 * block.numel
    assert intra == pytest.approx(S * 7 / 8 / 361e9, rel=0.03)
    assert inter == pytest.approx(S * 63 / 64 / 265e9, rel=0.10)
    assert inter < S * 63 / 64 / 265e9  # a larger message than 1 GB: no slower


def test_70b_block_compute():
    """6 x 0.87e9 x 8k tokens ~ 42 TFLOP, ~60 ms at 70% of an H100's 989 TFLOP/s (--efficiency
    0.7: one assumed efficiency instead of the kernel model)."""
    r = est("zero3", model="llama-3.1-70b", gpus=64, seq_len=8192, efficiency=0.7)
    u = r.timing.units[1]
    matmul_flop = 6 * arch.units(presets.model("llama-3.1-70b"))[1].matmul_params * 8192
    assert matmul_flop == pytest.approx(42e12, rel=0.03)
    rate = 989.4e12 * 0.7
    assert matmul_flop / rate == pytest.approx(60e-3, rel=0.03)
    attention_flop = 12 * 8192 * 8192 * 8192  # QK^T and AV, forward and backward
    assert u.forward_s + u.backward_s == pytest.approx((matmul_flop + attention_flop) / rate, rel=1e-9)


def test_zero3_peak_extra_is_two_units_of_bf16_weights():
    """FSDP2 (the torch layout): the unit running and the one prefetched, in bf16 (the design
    note's figure); one without prefetch. DeepSpeed at zplan's export settings (the zero layout)
    holds more: its prefetcher fills the live limit (the largest pair of units, the embedding's
    with a block) in the middle blocks too and passes it by a parameter: 3.4 blocks here, 1.70 x
    FSDP2's two (DeepSpeed's own runs hold the same peak:
    tests/test_deepspeed_release.py)."""
    block = arch.units(presets.model("llama-3.1-70b"))[1].numel
    r = est("zero3", model="llama-3.1-70b", gpus=64, layout="torch")
    assert r.memory.gather_buffer_bytes == 2 * 2 * block
    no_pf = est("zero3", model="llama-3.1-70b", gpus=64, layout="torch", prefetch=False)
    assert no_pf.memory.gather_buffer_bytes == 2 * block
    from zplan.memory import ds_coordination
    from zplan.strategies import effective

    ds = scenario(model="llama-3.1-70b", gpus=64)  # the window's largest (the loss holds less: the head)
    held = ds_coordination(ds, effective("zero3", "zero")).peak_held * 2
    assert held > 1.5 * r.memory.gather_buffer_bytes


@pytest.mark.parametrize("name,factor", [("ddp", 2), ("zero1", 2), ("zero2", 2), ("zero3", 3),
                                         ("zero3-noreshard", 2)])
def test_traffic_volumes(name, factor):
    # 64 ranks and a unit size divisible by 64: no padding, so the ZeRO paper's volumes exactly
    # (ZeRO-1/2 reducing to each owner, as the paper's reduce-scatter; ZeRO-3 as FSDP2 runs it,
    # which gathers every unit again in backward, as the paper's: DeepSpeed's own coordinator
    # gathers parameter by parameter, each padded, and keeps some: below)
    kw = dict(layout="torch") if name.startswith("zero3") else dict(deepspeed_bucket_allreduce=False)
    r = est(name, params="6.4e9", gpus=64, **kw)
    assert r.elements_per_step == factor * 6_400_000_000


def test_deepspeeds_prefetcher_keeps_the_last_units_for_their_backward():
    """DeepSpeed ZeRO-3 at the settings zplan's export writes (each parameter released after use,
    a unit's elements prefetched): at the end of forward its prefetcher scans on into backward's
    trace and marks the parameters of the last units, whose backward is next, fetched for it; a
    marked parameter is not released (partitioned_param_coordinator.py). The 6.4e9 model's 32
    units of 2e8 are decoder blocks to DeepSpeed (comm._ds_parameters: four matrices of a
    twelfth, two of a third): the last unit is not gathered again, nor the one before but for
    one of its attention matrices; every other unit is, each matrix padded to the 64 ranks.
    Not the paper's 3 Psi."""
    r = est("zero3", params="6.4e9", gpus=64)
    quarter = 200_000_000 // 12  # 16,666,666
    padded = lambda n: -(-n // 64) * 64  # noqa: E731
    block = sum(padded(n) for n in (quarter, quarter, quarter, quarter, 200_000_000 // 3,
                                    200_000_000 - 4 * quarter - 200_000_000 // 3))
    assert r.elements_per_step == 2 * 6_400_000_000 + 30 * block + padded(quarter)


@pytest.mark.parametrize("name", ["zero1", "zero2"])
def test_deepspeeds_zero12_all_reduce_moves_half_again_the_papers_volume(name):
    """DeepSpeed since 0.12.4 all-reduces each gradient bucket (use_multi_rank_bucket_allreduce):
    2 Psi for the gradients and Psi for the updated weights, against the paper's 2 Psi."""
    r = est(name, params="6.4e9", gpus=64)
    assert r.elements_per_step == 3 * 6_400_000_000


def test_torch_zero1_is_all_reduce_plus_gather():
    r = est("zero1", params="6.4e9", gpus=64, layout="torch")
    assert r.elements_per_step == 3 * 6_400_000_000


def test_hsdp_adds_replica_all_reduce_of_the_shard():
    r = est("hsdp", params="6.4e9", gpus=64, layout="torch")  # shard over 8, replicate over 8
    assert r.elements_per_step == 3 * 6_400_000_000 + 2 * 6_400_000_000 // 8


def test_nccl_tests_ring_formula():
    # t = S (n-1) / (n busbw): 1 GB over 8 ranks at 100 GB/s, no latency (nccl-tests' busbw
    # definition), through the model the planner prices every call with (zplan/nccl.py)
    from zplan.nccl import collective_time
    from zplan.specs import ClusterSpec

    c = ClusterSpec(name="t", gpus_per_node=8, intra_node_busbw_bytes_per_s=100e9,
                    inter_node_busbw_bytes_per_s=10e9, intra_node_latency_s=0, inter_node_latency_s=0,
                    link="loopback", host_ram_bytes=10**12, source="test")
    assert collective_time(c, "all_gather", 10**9, 8, 8).seconds == pytest.approx(8.75e-3)
    assert collective_time(c, "all_reduce", 10**9, 8, 8).seconds == pytest.approx(17.5e-3)
    assert collective_time(c, "all_gather", 10**9, 1, 1).seconds == 0


def _gpt_block():
    m = presets.model("gpt3-175b")
    return m, TrainSpec(seq_len=2048, micro_batch=1, flash_attention=False)


def test_korthikanti_eq1_no_recompute():
    """sbh(34 + 5as/h) bytes per layer, 16-bit, GPT-3 block (Korthikanti et al. 2022, eq. 1)."""
    m, t = _gpt_block()
    s, b, h, a = 2048, 1, m.hidden, m.num_heads
    expect = s * b * h * (34 + 5 * a * s / h)
    got = activation_memory.block_saved_bytes(m, t, "none")
    assert got == pytest.approx(expect, rel=1e-3)  # + the norms' fp32 statistics (8sb each)


def test_korthikanti_selective_recompute():
    """34·sbh per layer when the attention core is recomputed (section 5)."""
    m, t = _gpt_block()
    got = activation_memory.block_saved_bytes(m, t, "attention")
    assert got == pytest.approx(2048 * m.hidden * 34, rel=1e-3)


def test_full_checkpointing_keeps_block_inputs():
    m, t = _gpt_block()
    assert activation_memory.block_saved_bytes(m, t, "full") == 2 * 2048 * m.hidden


def test_flash_attention_drops_the_quadratic_term():
    m = presets.model("llama-3.1-8b")
    flash = activation_memory.block_saved_bytes(m, TrainSpec(seq_len=8192), "none")
    plain = activation_memory.block_saved_bytes(m, TrainSpec(seq_len=8192, flash_attention=False), "none")
    # flash keeps its logsumexp, its own output (which the output projection reads as a view)
    # and RoPE's cos/sin tables instead of the s x s scores; the math path keeps the scores and
    # a contiguous copy of its output for the projection
    extra = 4 * m.num_heads * 8192 + 2 * 8192 * m.head_dim
    assert plain - flash == 2 * m.num_heads * 8192 * 8192 - extra


def test_every_k_checkpoints_l_over_k_blocks():
    m = presets.model("llama-3.1-8b")
    t = TrainSpec(seq_len=4096, checkpointing="every-k", checkpoint_every=4)
    none_b = activation_memory.block_saved_bytes(m, t, "none")
    full_b = activation_memory.block_saved_bytes(m, t, "full")
    saved = activation_memory.activation_breakdown(m, t)["blocks_saved"]
    assert saved == 8 * full_b + 24 * none_b


def test_ordering_of_checkpointing_modes():
    m = presets.model("llama-3.1-8b")
    acts = {mode: activation_memory.activation_breakdown(m, TrainSpec(seq_len=4096, checkpointing=mode))["total"]
            for mode in ("none", "attention", "selective", "every-k", "full")}
    assert acts["full"] < acts["selective"] < acts["none"]
    assert acts["full"] < acts["every-k"] < acts["none"]


def test_mfu_formula_palm():
    m = presets.model("llama-3.1-8b")
    per_token = arch.model_flop_per_token(m, 4096)
    mm = arch.param_count(m) - m.vocab_size * m.hidden - 65 * m.hidden  # embedding & norms excluded
    assert per_token == 6 * mm + 12 * 32 * 4096 * 4096


def test_adam8bit_and_sgd_state():
    from zplan.memory import optimizer_state_bytes
    # bitsandbytes >= 0.46: an fp32 absmax per 256 elements for each uint8 state (2048 before);
    # under 4096 elements both states fp32 (optim/optimizer.py Optimizer2State.init_state)
    assert optimizer_state_bytes(2048 * 10, "adam8bit", "fp32") == 2 * (2048 * 10 + 4 * 80)
    assert optimizer_state_bytes(1000, "adam8bit", "fp32") == 8000
    assert optimizer_state_bytes(1000, "sgd", "fp32") == 4000
    assert optimizer_state_bytes(1000, "adamw", "bf16") == 4000


def test_adam8bit_state_is_bitsandbytes_own():
    """bitsandbytes' AdamW8bit itself (its CPU path) over the tiny model's parameters, as a
    one-rank DDP plan's optimizer steps them: the bytes of every state tensor it makes (the two
    256-entry quantization maps, shared by all, left out) are zplan's optimizer bytes."""
    bnb = pytest.importorskip("bitsandbytes")
    import torch

    from tests.helpers import scenario
    from zplan.memory import adam8bit_state_bytes, optimizer_tensor_sizes

    sc = scenario(model="tiny", gpus=1, layout="torch", optimizer="adam8bit")
    params = [torch.nn.Parameter(torch.zeros(n)) for n in optimizer_tensor_sizes(sc, 1)]
    opt = bnb.optim.AdamW8bit(params, lr=1e-3)
    for p in params:
        p.grad = torch.ones_like(p)
    opt.step()
    state = sum(v.numel() * v.element_size() for p in params for k, v in opt.state[p].items()
                if torch.is_tensor(v) and not k.startswith("qmap"))
    assert adam8bit_state_bytes(optimizer_tensor_sizes(sc, 1)) == state
    assert est("ddp", model="tiny", gpus=1, layout="torch", optimizer="adam8bit").memory.optimizer_bytes == state


def test_adam8bit_step_bytes_are_its_kernels_loads_and_stores():
    """csrc/kernels.cu: the blockwise 8-bit kernel loads g, p, two uint8 states and each
    block's absmax and stores p, the states and the absmax: fp32 weights 16 bytes an element
    and 16 bytes a 256-element block; the 32-bit kernel under 4096 elements 28 (AdamW's)."""
    from zplan.unit_ops import adam8bit_bytes

    assert adam8bit_bytes(2**20, 4) == 16 * 2**20 + 16 * 2**12
    assert adam8bit_bytes(1000, 4) == 28 * 1000
    assert adam8bit_bytes(2**20, 2) == 10 * 2**20 + 16 * 2**12


def test_fsdp2_layout_keeps_fp32_shards_as_master():
    r = est("zero3", params="6.4e9", gpus=64, layout="torch")
    m = r.memory
    assert m.master_bytes == 0
    assert m.params_bytes == 4 * 6_400_000_000 // 64 and m.grads_bytes == m.params_bytes
    assert m.model_state_bytes == 16 * 6_400_000_000 // 64


def test_zero1_torch_partition_is_greedy_per_parameter():
    from zplan.memory import zero1_torch_max_rank
    sc = scenario(model="tiny", gpus=3, layout="torch")
    biggest = max(math.prod(s) for u in sc.units for s in u.shapes)
    total = sc.params
    got = zero1_torch_max_rank(sc)
    assert total / 3 <= got <= total / 3 + biggest


def test_unit_size_given_with_params():
    r = est("zero3", params="70e9", gpus=64, unit_params="0.875e9", layout="torch")
    sc = scenario(params="70e9", gpus=64, unit_params="0.875e9")
    assert len(sc.units) == 80 and all(u.numel == 875_000_000 for u in sc.units)
    # two units of bf16 weights gathered at the peak (FSDP2): the design's ~2 x 1.75 GB
    assert r.memory.gather_buffer_bytes == 2 * 2 * 875_000_000


def test_the_json_and_plan_file_docs_name_every_train_field():
    """docs/json.md and docs/plan-file.md list TrainSpec's fields (a QA pass found two DeepSpeed
    fields in every written plan and in neither doc); `autocast` is never written to a plan."""
    import re
    from pathlib import Path

    from zplan.specs import TrainSpec

    root = Path(__file__).resolve().parents[1] / "docs"
    for doc, left_out in (("json.md", set()), ("plan-file.md", {"autocast"})):
        text = (root / doc).read_text()
        missing = [f for f in TrainSpec.model_fields if f not in left_out and not re.search(rf"\b{f}\b", text)]
        assert missing == [], (doc, missing)
