"""torchao's rowwise float8 recipes (--float8-recipe rowwise | rowwise-gw-hp), held against
torchao's own Float8Linear: its forward and backward traced under FakeTensorMode, the casts,
GEMMs and rescales it runs counted op by op, against zplan.unit_ops.torchao_float8_casts and
the linear's GEMMs."""

from __future__ import annotations

import warnings

import pytest

from zplan import unit_ops
from zplan.errors import UsageError
from tests.helpers import est, scenario

T, H, F = 8192, 4096, 14336  # Llama 3.1 8B's w1 at seq 8192, micro-batch 1
KW = dict(model="llama-3.1-8b", gpus=8, layout="torch", seq_len=T, checkpointing="selective",
          compile=True, gpu="h100-hbm2e-500w")


def _torchao_trace(recipe: str, n_in: int, n_out: int, tokens: int) -> dict:
    """torchao's float8 linear (bf16 weight, bf16 input) run forward and backward under
    FakeTensorMode; the aten ops beneath its Float8TrainingTensor counted per pass."""
    pytest.importorskip("torchao")
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    counts = {p: {"cast_elems": 0, "rescale_elems": 0, "gemms": [], "other_bytes": 0} for p in ("fwd", "bwd")}
    views = ("t", "view", "detach", "expand", "_unsafe_view", "reshape", "transpose", "alias")
    phase = ["fwd"]

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            leaves = [a for a in tree_leaves((args, kwargs)) if isinstance(a, torch.Tensor)]
            if any(type(a).__name__ == "Float8TrainingTensor" for a in leaves):
                return NotImplemented  # let the subclass run; its aten calls come back here
            out = func(*args, **(kwargs or {}))
            c, name = counts[phase[0]], func.__name__
            if name.startswith("_to_copy") and out.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
                c["cast_elems"] += out.numel()
            elif name.startswith("mul_"):
                c["rescale_elems"] += out.numel()
            if name.split(".")[0] in ("mm", "_scaled_mm"):
                a, b = args[0], args[1]
                c["gemms"].append((a.shape[0], b.shape[1], a.shape[1], a.element_size(),
                                   out.element_size()))
            elif name.split(".")[0] not in views and not str(func).startswith("prim"):
                touched = leaves + [x for x in tree_leaves(out) if isinstance(x, torch.Tensor)]
                c["other_bytes"] += sum(x.numel() * x.element_size() for x in touched)
            return out

    cfg = (Float8LinearConfig() if recipe == "tensorwise"
           else Float8LinearConfig.from_recipe_name({"rowwise-gw-hp": "rowwise_with_gw_hp"}.get(recipe, recipe)))
    with FakeTensorMode():
        lin = torch.nn.Sequential(torch.nn.Linear(n_in, n_out, bias=False, dtype=torch.bfloat16))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            convert_to_float8_training(lin, config=cfg, module_filter_fn=lambda m, n: True)
        x = torch.randn(tokens, n_in, dtype=torch.bfloat16, requires_grad=True)
        grad = torch.randn(tokens, n_out, dtype=torch.bfloat16)
        with Count():
            y = lin(x)
            phase[0] = "bwd"
            y.backward(grad)
    return counts


def _w1_ops(recipe: str, backward: bool, **kw) -> dict:
    sc = scenario(float8=True, float8_recipe=recipe, **{**KW, **kw})
    block = next(u for u in sc.units if u.blocks)
    return {o.name: o for o in unit_ops.unit_ops(sc, block, backward) if o.name.split()[0] == "w1"}


@pytest.mark.parametrize("recipe", ["rowwise", "rowwise-gw-hp"])
def test_rowwise_casts_rescales_and_gemms_are_torchaos(recipe):
    """Per pass: the elements torchao casts to float8 equal zplan's cast bytes / 5 (an amax read
    and a cast pass, 2 + 2 + 1 bytes), the elements it rescales after a backward GEMM equal the
    rescale bytes / 4, and each GEMM's shape and operand widths give zplan's GEMM bytes and FLOPs
    (dW in bf16 under rowwise-gw-hp; written in bf16, the weight's dtype, by every recipe)."""
    traced = _torchao_trace(recipe, H, F, T)
    for backward, phase in ((False, "fwd"), (True, "bwd")):
        ops, c = _w1_ops(recipe, backward), traced[phase]
        casts = [o for n, o in ops.items() if "float8" in n]
        rescales = [o for n, o in ops.items() if "rescale" in n]
        assert sum(o.bytes for o in casts) == 5 * c["cast_elems"]
        assert sum(o.bytes for o in rescales) == 4 * c["rescale_elems"]
        gemms = sorted((o.flop, o.bytes) for o in ops.values() if o.kind == "gemm")
        assert gemms == sorted((2 * M * N * K, (M * K + K * N) * b_in + M * N * b_out)
                               for M, N, K, b_in, b_out in c["gemms"])
    if recipe == "rowwise-gw-hp":
        assert any(b_in == 2 for *_, b_in, _ in traced["bwd"]["gemms"])  # dW in bf16


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise", "rowwise-gw-hp"])
def test_eager_casts_copies_and_rescales_are_the_bytes_torchao_moves(recipe):
    """Without --compile every aten op torchao runs around the GEMMs reads and writes its
    tensors: their bytes, summed over the traced forward and backward (views excepted), against
    zplan's eager casts, layout copies and rescales (tensorwise: weights gathered in bf16, as the
    traced linear's are). Within 0.5%: the scale vectors' own small ops are not charged."""
    traced = _torchao_trace(recipe, H, F, T)
    for backward, phase in ((False, "fwd"), (True, "bwd")):
        ops = _w1_ops(recipe, backward, compile=False, **({"float8_all_gather": False} if recipe == "tensorwise" else {}))
        charged = sum(o.bytes for o in ops.values() if o.kind == "memory")
        assert charged == pytest.approx(traced[phase]["other_bytes"], rel=0.005), phase


def test_tensorwise_forward_casts_are_torchaos():
    """Tensorwise, compiled: the input and the weight each cast once forward (5 bytes per element:
    the elements torchao casts, traced with the weight gathered in bf16); gathered in float8 the
    weight arrives cast (FSDP's pre-all-gather hook casts the shard, priced as the all-gather's
    copy-in) and only the input is cast."""
    traced = _torchao_trace("tensorwise", H, F, T)
    assert traced["fwd"]["cast_elems"] == T * H + F * H
    bf16_gather = _w1_ops("tensorwise", False, float8_all_gather=False)
    assert bf16_gather["w1 float8 casts"].bytes == 5 * traced["fwd"]["cast_elems"]
    assert _w1_ops("tensorwise", False)["w1 float8 casts"].bytes == 5 * T * H


def test_rowwise_gathers_in_bf16_and_orders_as_torchaos_h100_table():
    """Rowwise gathers the weights in bf16 (torchao's float8 all-gather is tensorwise's), and
    on the 500 W H100 whose fp8 GEMM rate is the rowwise CUTLASS kernel's, the recipes order as
    torchao's measured H100 table does (docs/source/workflows/training.md: bf16 6150 < rowwise
    6768 < tensorwise 7689.5 tokens/s): a test of the casts' weight, not of the rate."""
    def gather(r):
        return sum(c.bytes_per_step for c in r.collectives if c.name.startswith("all-gather (forward"))
    bf16, tw = est("zero3", **KW), est("zero3", float8=True, **KW)
    rw = est("zero3", float8=True, float8_recipe="rowwise", **KW)
    hp = est("zero3", float8=True, float8_recipe="rowwise-gw-hp", **KW)
    assert gather(rw) == gather(hp) == gather(bf16) > gather(tw)
    tps = {k: r.timing.tokens_per_s_per_gpu for k, r in (("bf16", bf16), ("tw", tw), ("rw", rw), ("hp", hp))}
    assert tps["bf16"] < tps["rw"] < tps["tw"]
    assert tps["bf16"] < tps["hp"] < tps["tw"]


@pytest.mark.parametrize("kw,needle", [
    (dict(float8=True, float8_recipe="rowwise", float8_all_gather=False), "gathers in the param dtype"),
    (dict(float8_recipe="rowwise-gw-hp"), "goes with --float8"),
])
def test_rowwise_options_are_checked(kw, needle):
    with pytest.raises(UsageError, match=needle):
        scenario(model="llama-3.1-8b", gpus=8, layout="torch", **kw)


@pytest.mark.parametrize("recipe", ["rowwise", "rowwise-gw-hp"])
def test_a_fused_qkv_linear_casts_as_one_torchao_linear(recipe):
    """MPT's fused q/k/v projection is one torchao linear (h -> q + 2 kv): zplan's wq, wk and wv
    parts together cast and rescale what that one linear does, compiled (casts / 5, rescales /
    4) and eager (every byte of its non-GEMM ops, within 0.5%)."""
    T = 2048
    for compile_ in (True, False):
        sc = scenario(model="mpt-7b", gpus=8, layout="torch", seq_len=T, checkpointing="selective",
                      compile=compile_, gpu="h100-hbm2e-500w", float8=True, float8_recipe=recipe)
        m = sc.model
        block = next(u for u in sc.units if u.blocks)
        traced = _torchao_trace(recipe, m.hidden, m.q_hidden + 2 * m.kv_hidden, T)
        for backward, phase in ((False, "fwd"), (True, "bwd")):
            ops = [o for o in unit_ops.unit_ops(sc, block, backward)
                   if o.name.split()[0] in ("wq", "wk", "wv") and o.kind == "memory"]
            if compile_:
                assert sum(o.bytes for o in ops if "float8" in o.name) == 5 * traced[phase]["cast_elems"]
                assert sum(o.bytes for o in ops if "rescale" in o.name) == 4 * traced[phase]["rescale_elems"]
            else:
                assert sum(o.bytes for o in ops) == pytest.approx(traced[phase]["other_bytes"], rel=0.005)


@pytest.mark.parametrize("gpu", ["h100-sxm", "b200", "mi300x"])
@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_mfu_of_float8_with_fp32_parameters_is_against_the_bf16_peak(gpu, recipe):
    """MFU was taken against the parameters' dtype's peak: fp32 parameters with float8 linears
    read up to 226% (the fp32 non-tensor-core peak, 67 TFLOP/s on H100, while the GEMMs run at
    float8's). Under float8 MFU is against the bf16 peak (torchtitan's get_peak_flops, "BF16
    peak flops", float8 or not): a fraction below 1, the same model FLOPs over the same step;
    bf16 parameters keep their figure."""
    from tests.helpers import est
    from zplan import arch, presets

    peak = presets.gpu(gpu).flops("bf16")
    flop = arch.model_flop_per_token(presets.model("llama-3.1-8b"), 4096) * 4096  # mb 1 x seq 4096
    for dtype in ("fp32", "bf16"):
        r = est("zero3", model="llama-3.1-8b", gpu=gpu, gpus="8", float8=True, compile=True,
                float8_recipe=recipe, param_dtype=dtype, seq_len=4096, micro_batch=1, grad_accum=1)
        assert r.timing.mfu == pytest.approx(flop / (r.timing.step_s * peak), rel=1e-9), dtype
        assert 0 < r.timing.mfu < 1
