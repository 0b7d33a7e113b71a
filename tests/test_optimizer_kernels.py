"""The optimizer step's bytes and kernels, held against the aten ops PyTorch itself runs.

Oracle: a TorchDispatchMode that sees every aten op of one real AdamW step (and of
clip_grad_norm_) on CPU and adds up the bytes each op reads (its tensor arguments, a tensor
passed twice counted once) and writes (arguments the op's schema marks as written, and new
outputs). Scalars and per-tensor norms (the step counters, the norms and their stack) are left
out: the model prices the per-element traffic. The dispatcher sees one op per foreach call, so the op count is the model's kernel count
per parameter (single) or its foreach op list (foreach), whose tensor lists are the launches'
depth.
"""

from __future__ import annotations

import pytest

from tests.helpers import scenario
from zplan import unit_ops

torch = pytest.importorskip("torch")
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

SIZES = [(512, 64), (256, 64), (1000,)]  # three parameters of different sizes
SMALL = 64  # tensors below this many elements (step counters, norms, their stack) are not counted
FLAGS = {"single": {"foreach": False}, "foreach": {"foreach": True}, "fused": {"fused": True}}


def _tensors(v) -> list:
    if isinstance(v, torch.Tensor):
        return [v]
    if isinstance(v, (list, tuple)):
        return [t for t in v if isinstance(t, torch.Tensor)]
    return []


def _key(t) -> tuple:
    return (t.untyped_storage().data_ptr(), t.storage_offset(), t.numel())


def _read_only(func, arg, kwargs) -> bool:
    """_fused_adamw_'s and _fused_sgd_'s schemas mark `grads` written (they unscale them under a
    GradScaler), but without grad_scale the kernels store no gradient (aten/src/ATen/native/cuda/
    fused_adam_utils.cuh: `if (i != kGradIdx || grad_scale_ptr) load_store(...)`; FusedSgdKernel.cu
    stores its gradient slot under grad_scale_ptr alone, the same rule)."""
    return (func.__name__.startswith(("_fused_adam", "_fused_sgd")) and arg.name == "grads"
            and kwargs.get("grad_scale") is None)


class ByteCounter(TorchDispatchMode):
    """HBM bytes and the tensor lists of every op that touches a non-scalar tensor."""

    def __init__(self):
        super().__init__()
        self.bytes = 0
        self.ops: list[tuple[str, int]] = []  # (op name, tensor lists incl. a new output list)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        schema = func._schema
        values = list(args) + [kwargs.get(a.name) for a in schema.arguments[len(args):]]
        read: dict = {}
        written: dict = {}
        lists = 0
        for a, v in zip(schema.arguments, values):
            ts = [t for t in _tensors(v) if t.numel() >= SMALL]
            lists += bool(ts)
            for t in ts:
                read[_key(t)] = t.numel() * t.element_size()
                if a.alias_info is not None and a.alias_info.is_write and not _read_only(func, a, kwargs):
                    written[_key(t)] = t.numel() * t.element_size()
        new = [t for t in _tensors(out if isinstance(out, (list, tuple)) else [out])
               if t.numel() >= SMALL and _key(t) not in read]
        lists += bool(new)
        for t in new:
            written[_key(t)] = t.numel() * t.element_size()
        if read or written:
            self.bytes += sum(read.values()) + sum(written.values())
            self.ops.append((func.__name__, lists))
        return out


def _params(dtype=torch.float32) -> list:
    ps = [torch.nn.Parameter(torch.randn(*s, dtype=dtype)) for s in SIZES]
    for p in ps:
        p.grad = torch.randn_like(p)
    return ps


def _adamw_step(kernels: str, dtype=torch.float32) -> tuple[ByteCounter, list]:
    ps = _params(dtype)
    opt = torch.optim.AdamW(ps, lr=1e-3, weight_decay=0.1, **FLAGS[kernels])
    opt.step()  # the states exist from here on
    with ByteCounter() as c:
        opt.step()
    return c, ps


def _sizes(ps) -> list[int]:
    return [p.numel() for p in ps]


@pytest.mark.parametrize("kernels", ["single", "foreach", "fused"])
def test_adamw_bytes_are_the_ops_pytorch_runs(kernels):
    c, ps = _adamw_step(kernels)
    sc = scenario(model="llama-3.1-8b", gpus=8, layout="torch", optimizer_kernels=kernels,
                  grad_clip=False)
    [op] = unit_ops.optimizer_ops(sc, _sizes(ps))
    assert op.bytes == c.bytes
    if kernels == "single":
        assert op.kernels == len(c.ops) == 8 * len(ps)
    if kernels == "fused":
        assert [name for name, _ in c.ops] == ["_fused_adamw_.default"]


def test_foreach_adamw_ops_and_their_tensor_lists():
    """The model's eight foreach ops, in order, with the tensor lists each carries (the depth its
    multi_tensor_apply launches at) and whether it takes a list of scalars (a smaller launch)."""
    c, _ = _adamw_step("foreach")
    seen = [(name.split(".")[0].removeprefix("_foreach_"), lists, name.endswith(".ScalarList"))
            for name, lists in c.ops]
    model = [(name.split(" ")[0], depth, scalars) for name, _, depth, scalars in unit_ops.ADAMW_FOREACH_OPS]
    assert seen == model


def test_unfused_adamw_in_bf16_state_moves_the_state_bytes_at_half_width():
    """bf16 weights, gradients and states: 40 bytes per element, as 4P + 2G + 14S with 2s."""
    c, ps = _adamw_step("foreach", torch.bfloat16)
    sc = scenario(model="llama-3.1-8b", gpus=8, layout="torch", optimizer_kernels="foreach",
                  master_dtype="bf16", optimizer_dtype="bf16", grad_clip=False)
    [op] = unit_ops.optimizer_ops(sc, _sizes(ps))
    assert op.bytes == c.bytes == 40 * sum(_sizes(ps))


@pytest.mark.parametrize("foreach", [True, False])
def test_grad_clipping_reads_and_scales_every_gradient(foreach):
    """clip_grad_norm_ (the trainer's and torchtitan's): the norm reads each gradient, the scale
    reads and writes it, applied even when the norm is below the threshold."""
    ps = _params()
    with ByteCounter() as c:
        torch.nn.utils.clip_grad_norm_(ps, max_norm=1e9, foreach=foreach)
    sc = scenario(model="llama-3.1-8b", gpus=8, layout="torch")
    clip, _adam = unit_ops.optimizer_ops(sc, _sizes(ps))
    assert clip.name.startswith("gradient clipping")
    assert clip.bytes == c.bytes == 12 * sum(_sizes(ps))


def test_no_clipping_prices_no_clipping():
    sc = scenario(model="llama-3.1-8b", gpus=8, layout="torch", grad_clip=False)
    assert [o.name for o in unit_ops.optimizer_ops(sc, [10**6])] == ["AdamW (fused)"]


def test_zero_layout_refuses_torch_optimizer_kernels():
    from zplan.errors import UsageError

    with pytest.raises(UsageError, match="--optimizer-kernels foreach .* --layout torch"):
        scenario(model="llama-3.1-8b", gpus=8, layout="zero", optimizer_kernels="foreach")


@pytest.mark.parametrize("kernels,deterministic,flags", [
    ("fused", False, {"fused": True}), ("fused", True, {"foreach": False}),
    ("foreach", False, {"foreach": True}), ("single", False, {"foreach": False})])
def test_trainer_runs_the_plans_adamw(kernels, deterministic, flags):
    """The trainer builds the AdamW the plan priced (a fused plan under --deterministic runs the
    per-parameter AdamW, its reference's)."""
    from types import SimpleNamespace

    from tests.test_contract import plan_for
    from zplan.trainer.parallel import build_optimizer

    plan = plan_for("zero3", model="llama-3.1-8b", gpus="8", optimizer_kernels=kernels)
    p = SimpleNamespace(model=torch.nn.Linear(4, 4), deterministic=deterministic)
    opt = build_optimizer(p, plan, lr=1e-3)
    for k, v in flags.items():
        assert opt.defaults[k] is v
    assert not (opt.defaults["fused"] and opt.defaults["foreach"])


def test_trainer_without_clipping_computes_no_norm():
    """A plan without clipping is priced with no clipping work: the trainer computes no norm (NaN,
    written as null in the report) and leaves the gradients as they are."""
    from types import SimpleNamespace

    from tests.test_contract import plan_for
    from zplan.trainer.loop import Trainer

    model = torch.nn.Linear(4, 4)
    model.weight.grad = torch.full_like(model.weight, 100.0)
    me = SimpleNamespace(plan=plan_for("zero3", grad_clip=False), device=torch.device("cpu"),
                         par=SimpleNamespace(model=model), cfg=SimpleNamespace(clip=1.0))
    assert torch.isnan(Trainer._clip(me))
    assert torch.all(model.weight.grad == 100.0)
    me.plan = plan_for("zero3")
    assert float(Trainer._clip(me)) == pytest.approx(400.0)  # the norm before clipping
    assert float(model.weight.grad.norm()) == pytest.approx(1.0, rel=1e-4)


def test_unfused_bytes_put_each_dtype_in_its_place():
    """fp32 weights and gradients with bf16 states (P = G = 4, S = 2): 4P + 2G + 14S = 52; the
    foreach temporaries are the state's width (sqrt of exp_avg_sq)."""
    from zplan.memory_timeline import optimizer_temp_bytes
    from zplan.specs import Precision, TrainSpec

    assert unit_ops.adamw_unfused_bytes(4, 4, 2) == 52
    assert unit_ops.adamw_fused_bytes(4, 2) == 20
    spec = TrainSpec(layout="torch", optimizer_kernels="foreach", precision=Precision(optimizer="bf16"))
    assert optimizer_temp_bytes(10, 1000, spec, "torch") == 2 * 1000
    single = spec.model_copy(update={"optimizer_kernels": "single"})
    assert optimizer_temp_bytes(10, 1000, single, "torch") == 2 * 2 * 10


def test_foreach_launches_follow_each_ops_tensor_limit():
    """200 small tensors: one launch per 110 at depth 1 (2), per 96 with a scalar list (3), 64 at
    depth 2 (4), 48 at depth 3 (5), for the eight ops: 2 + 4 + 2 + 5 + 4 + 3 + 2 + 5 = 27."""
    sc = scenario(model="llama-3.1-8b", gpus=8, layout="torch", optimizer_kernels="foreach",
                  grad_clip=False)
    [op] = unit_ops.optimizer_ops(sc, [1000] * 200)
    assert op.kernels == 27


def test_clipping_covers_the_gradients_each_rank_holds():
    """ddp and zero1 (DDP's whole gradients) clip every gradient on every rank; zero2 and zero3
    clip their shards. zero1's AdamW steps the whole parameters ZeroRedundancyOptimizer gives
    the fullest rank."""
    from zplan.compute import optimizer_ops
    from zplan.memory import zero1_torch_partition
    from zplan.strategies import STRATEGIES

    sc = scenario(model="llama-3.1-8b", gpus=8, layout="torch", optimizer_kernels="single")
    clip = {s: optimizer_ops(sc, STRATEGIES[s])[0] for s in ("ddp", "zero1", "zero2", "zero3")}
    full = 12 * sc.params
    assert clip["ddp"].bytes == clip["zero1"].bytes == full
    assert clip["zero2"].bytes == clip["zero3"].bytes < full / 7
    held = zero1_torch_partition(sc)
    adam = optimizer_ops(sc, STRATEGIES["zero1"])[1]
    assert adam.bytes == 80 * sum(held) and adam.kernels == 8 * len(held)
    assert sum(held) >= sc.params / 8


@pytest.mark.parametrize("kernels", ["single", "foreach", "fused"])
def test_sgd_bytes_are_the_ops_pytorch_runs(kernels):
    """SGD with momentum, as torch.optim.SGD runs it: its ops' bytes and launches (SGD's step
    was priced as an unsourced 24 bytes in two launches a tensor; an audit)."""
    ps = _params()
    opt = torch.optim.SGD(ps, lr=1e-3, momentum=0.9, **FLAGS[kernels])
    opt.step()  # the momentum buffers exist from here on
    with ByteCounter() as c:
        opt.step()
    sc = scenario(model="llama-3.1-8b", gpus=8, layout="torch", optimizer="sgd", optimizer_kernels=kernels,
                  grad_clip=False)
    [op] = unit_ops.optimizer_ops(sc, _sizes(ps))
    assert op.bytes == c.bytes
    if kernels == "single":
        assert op.kernels == len(c.ops) == 3 * len(ps)
    if kernels == "foreach":
        assert [lists for _, lists in c.ops] == list(unit_ops.SGD_FOREACH_DEPTHS)
