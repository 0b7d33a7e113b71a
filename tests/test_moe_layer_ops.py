"""An MoE layer's memory-bound work around its experts, as torchtitan runs it: the bytes the
planner prices (unit_ops.moe_layer_ops) against the ops PyTorch itself dispatches.

The layer is test_moe_selective's, written in the structure of torchtitan's MoE at b36e4b6 (a
router in fp32, topk, tokens sorted by expert, three torch._grouped_mm, the scores applied in
fp32, scatter_add). Which aten ops run, in which order, dtypes and shapes, comes from PyTorch's
dispatcher, not from zplan. Each op's HBM bytes follow from its tensors by one rule per kind of
op (below), with the CUDA paths PyTorch takes where the CPU's differ (aten/src/ATen/native/
TensorAdvancedIndexing.cpp: scatter_add under torch.use_deterministic_algorithms, as torchtitan's
deterministic_scatter_add runs it, and index_put with accumulate both copy their input, sort the
row indices and accumulate in sorted order). The one assumption the planner and this oracle share
is a sort's cost: cub's radix sort, a pass per 8 key bits over 16-byte (key, value) pairs
(argsort: all 64 bits; index_put: the bits of the largest row index, Indexing.cu).
"""

import pytest

torch = pytest.importorskip("torch")

from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402
from torch.utils._pytree import tree_flatten  # noqa: E402

from tests.test_moe_selective import FF, MB, S, Block, E, H, K, _spec  # noqa: E402
from zplan import presets, unit_ops  # noqa: E402
from zplan.scenario import Scenario  # noqa: E402
from zplan.specs import Hardware  # noqa: E402

aten = torch.ops.aten
T, N = MB * S, MB * S * K
FREE = {aten.view.default, aten.expand.default, aten.transpose.int, aten.t.default,
        aten.detach.default, aten._unsafe_view.default}
MADE = {aten.zeros_like.default, aten.new_zeros.default, aten.ones_like.default}
GEMM = {aten.mm.default, aten._grouped_mm.default}


def _bytes(t) -> int:
    """HBM bytes of a tensor as its kernel reads it: a stride-0 (expanded) dimension once."""
    n = 1
    for size, stride in zip(t.shape, t.stride()):
        n *= size if stride else 1
    return n * t.element_size()


def _sort(n: int, passes: int) -> int:
    """cub's radix sort of n (int64, int64) pairs: each pass reads and writes 32 bytes a pair."""
    return 32 * n * passes


def _passes(rows: int) -> int:
    """index_put's sort covers the bits of the largest row index, 8 a pass (Indexing.cu)."""
    return max(1, -(-(rows - 1).bit_length() // 8))


class _Bytes(TorchDispatchMode):
    """Every dispatched op's HBM bytes (CUDA semantics), and the GEMMs' dtypes."""

    def __init__(self):
        super().__init__()
        self.ops, self.gemm_dtypes, self.swiglu, self.expert_flop = [], set(), 0, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        ins = [a for a in tree_flatten((args, kwargs))[0] if isinstance(a, torch.Tensor)]
        outs = [o for o in tree_flatten(out)[0] if isinstance(o, torch.Tensor)]
        if func in GEMM:
            self.gemm_dtypes.add((func, ins[0].dtype))
            if func == aten._grouped_mm.default:  # (m, k) x (E, k, n) forward; backward's dW (k, m) x (m, n)
                a, b = ins[0].shape, ins[1].shape
                self.expert_flop += 2 * a[0] * a[1] * b[-1]
            return out
        if func in FREE:
            return out
        o = sum(_bytes(t) for t in outs)
        if func in MADE:
            n = o
        elif func in (aten.index.Tensor, aten.gather.default):  # rows read = rows written
            n = 2 * o + sum(_bytes(i) for i in ins[1:])
        elif func in (aten.scatter_add.default, aten.index_put.default):
            self_, index, src = ins[0], ins[1], ins[2]
            # out of place: self copied into the output, then src accumulated into it (read and
            # written); index_put with accumulate, and the combine's scatter_add (torchtitan's
            # deterministic op: an index expanded over the row), sort the row indices first
            sorted_ = func == aten.index_put.default or (index.dim() == 2 and index.stride(1) == 0)
            sort = _sort(index.shape[0], _passes(self_.shape[0])) if sorted_ else 0
            n = 4 * _bytes(self_) + _bytes(src) + _bytes(index) + sort
        elif func == aten.sort.stable:  # argsort of int64 expert ids: every key bit
            n = _sort(ins[0].numel(), 8)
        else:
            n = sum(_bytes(t) for t in ins) + o
        swiglu = any(tuple(t.shape) == (N, FF) for t in outs)  # the experts' activation: priced apart
        block_sum = func == aten.add.Tensor and tuple(outs[0].shape) == (T, H)  # the block's gradient sum
        if swiglu:
            self.swiglu += n
        elif not block_sum:
            self.ops.append((str(func), n))
        return out


def _scenario():
    m, t = _spec()
    hw = Hardware(gpu=presets.gpu("h100-sxm"), cluster=presets.cluster("dgx-h100"), num_gpus=8)
    return Scenario(m, hw, t)


def _run():
    torch.manual_seed(0)
    block = Block().to(torch.bfloat16)
    x = torch.randn(T, H, dtype=torch.bfloat16, requires_grad=True)
    fwd, bwd = _Bytes(), _Bytes()
    with fwd:
        y = block.moe(x)
    g = torch.ones_like(y)
    with bwd:
        y.backward(g)
    return fwd, bwd


def test_an_moe_layer_moves_the_bytes_the_planner_prices():
    """Routing, the two sorts, dispatch, the fp32 scores product and the combine, forward and
    backward: within 1% (the planner lumps the routing's few T·E- and T·k-sized ops)."""
    fwd, bwd = _run()
    sc = _scenario()
    for backward, rec in ((False, fwd), (True, bwd)):
        planned = sum(o.bytes for o in unit_ops.moe_layer_ops(sc, backward))
        assert planned == pytest.approx(sum(n for _, n in rec.ops), rel=0.01)
    # the router's matmuls run in fp32, the experts' in 16 bits
    assert (aten.mm.default, torch.float32) in fwd.gemm_dtypes | bwd.gemm_dtypes
    assert (aten._grouped_mm.default, torch.bfloat16) in fwd.gemm_dtypes
    assert (aten.mm.default, torch.bfloat16) not in fwd.gemm_dtypes | bwd.gemm_dtypes


def test_the_experts_run_on_k_routed_copies_of_each_token():
    """The experts' GEMM FLOPs and their SwiGLU's bytes (silu, mul; backward silu_backward and
    two muls) are the block's priced ones over T·k rows, not T."""
    fwd, bwd = _run()
    sc = _scenario()
    u = next(u for u in sc.units if u.blocks)
    for backward, rec in ((False, fwd), (True, bwd)):
        ops = unit_ops.unit_ops(sc, u, backward)
        assert sum(o.flop for o in ops if "grouped" in o.name) == rec.expert_flop
        assert next(o.bytes for o in ops if o.name == "SwiGLU") == rec.swiglu
        router = [o for o in ops if o.name.startswith("router")]
        assert router and all("fp32" in o.name for o in router)


def test_a_grouped_gemm_moves_every_experts_weights():
    """torch._grouped_mm reads all E experts' weights forward and for dX, and dW writes all E
    gradients: the planner's grouped linears carry E x the weight bytes (a dense linear's once)."""
    from zplan import kernels as K

    gpu = presets.gpu("h100-sxm")
    T, o, i, E = 4096, 768, 2048, 128
    one = K.linear(gpu, "w1", T, o, i, "bf16", "bf16", True)
    grouped = K.linear(gpu, "w1", T, o, i, "bf16", "bf16", True, groups=E)
    for a, b in zip(one, grouped):
        assert a.flop == b.flop
        assert b.bytes - a.bytes == (E - 1) * o * i * 2
    fwd = K.linear(gpu, "w1", T, o, i, "bf16", "bf16", False, groups=E)[0]
    assert fwd.bytes == (T * i + E * i * o + T * o) * 2


def test_float8_is_refused_for_an_moe_model(capsys):
    """torchao's float8 converter leaves grouped experts in 16 bits: zplan refuses the mix."""
    from tests.helpers import cli

    r = cli(capsys, "estimate", "--model", "qwen3-30b-a3b", "--gpus", "8", "--float8")
    assert r.returncode == 2 and "--float8 with qwen3-30b-a3b's experts" in r.stderr
    assert "drop --float8" in r.stderr and "Traceback" not in r.stderr
