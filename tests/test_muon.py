"""Muon as zplan prices it (zplan/muon.py), held against torch.optim.Muon itself: the FLOPs its
Newton-Schulz runs (FlopCounterMode), the state it keeps beside AdamW's for the rest (one real
step over the trainer's model), and which rank orthogonalises what under each strategy."""

import math

import pytest

from tests.helpers import est, scenario
from zplan import muon
from zplan.compute import optimizer_ops
from zplan.memory import model_state, optimizer_tensor_sizes
from zplan.strategies import get as strategy


@pytest.mark.parametrize("shape", [(96, 64), (64, 160), (48, 48), (24, 72)])
def test_newton_schulz_flops_are_what_torch_muon_runs(shape):
    torch = pytest.importorskip("torch")
    from torch.utils.flop_counter import FlopCounterMode

    p = torch.nn.Parameter(torch.randn(*shape))
    p.grad = torch.randn(*shape)
    opt = torch.optim.Muon([p])
    with FlopCounterMode(display=False) as counter:
        opt.step()
    assert counter.get_total_flops() == sum(2 * M * N * K for M, N, K, _ in muon.newton_schulz_gemms(*shape))


def _block_matrix(name: str, p) -> bool:
    return name.startswith("layers.") and p.ndim >= 2


def test_state_is_muon_momentum_for_block_matrices_and_adamw_for_the_rest():
    """One real step of torch.optim.Muon over the blocks' matrices and AdamW over the rest
    (embedding, head, norms: every recipe's split) keeps exactly the bytes zplan counts."""
    torch = pytest.importorskip("torch")
    from zplan.trainer.model import Transformer

    sc = scenario(model="tiny", gpus=1, optimizer="muon", param_dtype="fp32",
                  optimizer_dtype="fp32", layout="torch")
    model = Transformer(sc.model)
    named = list(model.named_parameters())
    matrices = [p for n, p in named if _block_matrix(n, p)]
    rest = [p for n, p in named if not _block_matrix(n, p)]
    assert matrices and rest
    opts = [torch.optim.Muon(matrices), torch.optim.AdamW(rest)]
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    for o in opts:
        o.step()
    state_bytes = sum(t.numel() * t.element_size() for o in opts for s in o.state.values()
                      for t in s.values() if torch.is_tensor(t) and t.ndim > 0)
    assert model_state(sc, strategy("ddp")).optimizer_bytes == state_bytes
    # and the split is the model's: every 2-D block weight is Muon's
    assert muon.matrix_elements(sc) == sum(p.numel() for p in matrices)
    assert sorted(muon.matrices(sc)) == sorted(tuple(p.shape) for p in matrices)


@pytest.mark.parametrize("D", [2, 3, 8])
def test_sharded_state_splits_each_parameters_dim0_shard(D):
    """FSDP2's dim-0 shards: a rank holds ceil(rows / D) rows of every parameter, Muon's
    momentum for the blocks' matrices, AdamW's two states for the rest."""
    torch = pytest.importorskip("torch")
    from zplan.trainer.model import Transformer

    sc = scenario(model="tiny", gpus=D, optimizer="muon", param_dtype="fp32",
                  optimizer_dtype="fp32", layout="torch")
    rows = lambda p: -(-p.shape[0] // D) * math.prod(p.shape[1:])  # noqa: E731
    named = list(Transformer(sc.model).named_parameters())
    muon_elems = sum(rows(p) for n, p in named if _block_matrix(n, p))
    adamw_elems = sum(rows(p) for n, p in named if not _block_matrix(n, p))
    assert model_state(sc, strategy("zero3")).optimizer_bytes == 4 * muon_elems + 8 * adamw_elems
    ops = optimizer_ops(sc.for_strategy(True), strategy("zero3"))
    assert sum(o.flop for o in ops if o.kind == "gemm") == sum(
        2 * M * N * K for n, p in named if _block_matrix(n, p)
        for M, N, K, _ in muon.newton_schulz_gemms(*p.shape))  # every matrix, gathered whole


def test_who_orthogonalises_what():
    """DDP: every rank runs every matrix; ZeroRedundancyOptimizer: only those it owns (fewer on
    the fullest rank, and its owned state adds up to the partition memory counts); FSDP2 gathers
    them whole and runs all of them."""
    kw = dict(model="llama-3.2-1b", gpus=8, optimizer="muon", layout="torch")
    sc = scenario(**kw)
    ns = lambda name: sum(o.flop for o in optimizer_ops(sc.for_strategy(strategy(name).fsdp),  # noqa: E731
                                                       strategy(name)) if o.kind == "gemm")
    every = sum(2 * M * N * K for s in muon.matrices(sc) for M, N, K, _ in muon.newton_schulz_gemms(*s))
    assert ns("ddp") == every == ns("zero3")
    assert 0 < ns("zero1") < every / 4
    # every matrix is some rank's, once
    assert sorted(x for r in muon.zero1_ranks(sc) for _, mats in r for x in mats) == sorted(muon.matrices(sc))


def test_zero1_ranks_are_zero_redundancy_optimizers_partition():
    """One ZeroRedundancyOptimizer over two groups, Muon's matrices first (MuonWithAuxAdam):
    torch's own _partition_parameters (run on the trainer's model built on the meta device)
    gives the fullest rank the state zplan counts, and the slowest rank the Newton-Schulz FLOPs
    zplan charges."""
    torch = pytest.importorskip("torch")
    from torch.distributed.optim import ZeroRedundancyOptimizer

    from zplan.trainer.model import Transformer

    sc = scenario(model="llama-3.2-1b", gpus=8, optimizer="muon", param_dtype="fp32",
                  optimizer_dtype="fp32", layout="torch")
    with torch.device("meta"):
        named = list(Transformer(sc.model).named_parameters())
    z = ZeroRedundancyOptimizer.__new__(ZeroRedundancyOptimizer)
    z.world_size, z._partition_parameters_cache = 8, []
    z.param_groups = [{"params": [p for n, p in named if _block_matrix(n, p)]},
                      {"params": [p for n, p in named if not _block_matrix(n, p)]}]
    ranks = z._partition_parameters()
    state = [sum(4 * p.numel() for p in r[0]["params"]) + sum(8 * p.numel() for p in r[1]["params"])
             for r in ranks]
    ns = [sum(5 * (4 * min(p.shape) ** 2 * max(p.shape) + 2 * min(p.shape) ** 3) for p in r[0]["params"])
          for r in ranks]
    assert model_state(sc, strategy("zero1")).optimizer_bytes == max(state)
    ops = optimizer_ops(sc.for_strategy(False), strategy("zero1"))
    assert sum(o.flop for o in ops if o.kind == "gemm") == max(ns)


def test_muon_step_time_grows_with_the_matrices_not_the_tokens():
    """Newton-Schulz is per step, whatever the batch: the optimizer's seconds do not change with
    the micro-batch, and on Llama 3.1 8B under FSDP it is most of a second on H100 (every rank
    runs every matrix: 32 blocks of ~21 TFLOP, torch's three GEMMs per step x 5)."""
    small = est("zero3", model="llama-3.1-8b", gpus=8, optimizer="muon", micro_batch=1)
    large = est("zero3", model="llama-3.1-8b", gpus=8, optimizer="muon", micro_batch=4)
    adam = est("zero3", model="llama-3.1-8b", gpus=8, micro_batch=1)
    assert small.timing.optimizer_s == pytest.approx(large.timing.optimizer_s)
    assert 0.5 < small.timing.optimizer_s < 2.0
    assert adam.timing.optimizer_s < 0.05


def test_elementwise_bytes_are_what_torch_muon_moves():
    """The bytes of every non-GEMM op of one torch.optim.Muon step (tests/test_optimizer_kernels'
    dispatch-mode counter; views and the Newton-Schulz GEMMs left out) are the model's
    4G + 3S + 4P + 10 per element: 54 in fp32."""
    torch = pytest.importorskip("torch")
    from tests.test_optimizer_kernels import ByteCounter
    from zplan.unit_ops import muon_elementwise_bytes

    class Elementwise(ByteCounter):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            ret = func._schema.returns
            if func.__name__.split(".")[0] in ("mm", "addmm") or (
                    ret and ret[0].alias_info is not None and not ret[0].alias_info.is_write):
                return func(*args, **(kwargs or {}))
            return super().__torch_dispatch__(func, types, args, kwargs)

    p = torch.nn.Parameter(torch.randn(96, 64))
    p.grad = torch.randn(96, 64)
    opt = torch.optim.Muon([p])
    opt.step()  # the momentum buffer is made on the first step
    counter = Elementwise()
    with counter:
        opt.step()
    assert counter.bytes == muon_elementwise_bytes(4, 4, 4) * p.numel()


@pytest.mark.parametrize("shape", [(96, 64), (64, 160), (256, 256)])
def test_step_temporaries_are_what_memtracker_sees(shape):
    """PyTorch's MemTracker over one torch.optim.Muon step: the peak beyond the gradient and the
    momentum (what lives before the step) is the model's temporaries for that matrix."""
    torch = pytest.importorskip("torch")
    from torch.distributed._tools.mem_tracker import MemTracker

    p = torch.nn.Parameter(torch.randn(*shape))
    p.grad = torch.randn(*shape)
    opt = torch.optim.Muon([p])
    opt.step()  # the momentum buffer exists before the measured step
    tracker = MemTracker()
    tracker.track_external(p, opt)
    with tracker:
        opt.step()
    peak = tracker.get_tracker_snapshot("peak")
    (dev,) = peak.keys()
    before = 2 * p.numel() * 4  # gradient and momentum, fp32
    assert peak[dev]["Total"] - before == muon.step_temp_bytes(muon.counted([shape]), 4, 0)


def test_muon_is_not_offered_with_cpu_offload():
    """The CPU optimizers offload runs are AdamW's: Muon's Newton-Schulz has no CPU step priced, so
    both offload strategies say why instead of a step without it; the rest are estimated."""
    for name in ("offload-opt", "offload-all"):
        e = est(name, model="llama-3.2-1b", gpus=8, optimizer="muon")
        assert e.memory is None and "Newton-Schulz" in e.unavailable
    assert est("zero2", model="llama-3.2-1b", gpus=8, optimizer="muon").timing is not None


def test_an_efficiency_prices_newton_schulz_at_its_flop_rate():
    """With --efficiency (no kernel model) the step still carries Newton-Schulz's FLOPs at the
    efficiency's rate: Llama 3.1 8B's ~0.7 PFLOP on an H100 at half of 989 TFLOP/s, over a second."""
    e = est("zero3", model="llama-3.1-8b", gpus=8, optimizer="muon", efficiency=0.5)
    flop = sum(5 * (4 * min(s) ** 2 * max(s) + 2 * min(s) ** 3) for s in muon.matrices(scenario(model="llama-3.1-8b")))
    assert e.timing.optimizer_s == pytest.approx(flop / (0.5 * 989e12), rel=0.02)
