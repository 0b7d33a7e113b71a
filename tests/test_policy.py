"""One source for the modelling decisions the planner and the trainer both make (zplan/policy.py):
the planner's bytes, FLOPs and checkpointed blocks against the trainer's own modules, measured
with torch's MemTracker and FlopCounterMode."""

import pytest

from tests.helpers import replace_linears


def _tiny_blocks(mlp, mode, layers=2, linear=None, head_dim=None, math=False, saves_attention=True, first=3):
    import torch
    from torch import nn

    from zplan.presets import model as preset
    from zplan.trainer.model import Block, sdpa_backends
    from zplan.trainer.parallel import apply_checkpointing

    m = preset("tiny").model_copy(update={"mlp": mlp, "num_layers": layers, "attention_head_dim": head_dim})

    class Blocks(nn.Module):  # what apply_checkpointing needs of the trainer's Transformer
        def __init__(self):
            super().__init__()
            self.spec, self.layers = m, nn.ModuleList(Block(m) for _ in range(layers))

    torch.manual_seed(0)
    net = Blocks().to(torch.bfloat16)
    for blk in net.layers:  # SDPA's math kernel alone (inside the blocks' own sdpa_kernel), whose
        if math:  # matmuls FlopCounterMode counts: it has no formula for the CPU flash kernel
            blk.attention.backends = sdpa_backends("math")
    if linear is not None:  # before checkpointing wraps the blocks
        replace_linears(net, linear)
    apply_checkpointing(net, mode, 2, saves_attention, first)
    return m, net


def _backward_flop(mlp, mode, layers, seq, mb, early_stop, linear=None, head_dim=None):
    """FlopCounterMode over the backward of `layers` tiny blocks (SDPA's math backend, so that the
    attention matmuls are counted: the CPU flash kernel has no FLOP formula)."""
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.checkpoint import set_checkpoint_early_stop
    from torch.utils.flop_counter import FlopCounterMode

    m, net = _tiny_blocks(mlp, mode, layers=layers, linear=linear, head_dim=head_dim, math=True)
    x = torch.randn(mb, seq, m.hidden, dtype=torch.bfloat16, requires_grad=True)
    with sdpa_kernel(SDPBackend.MATH), set_checkpoint_early_stop(early_stop):
        y = x
        for blk in net.layers:
            y = blk(y)
        with FlopCounterMode(display=False) as fc:
            y.sum().backward()
    return m, fc.get_total_flops()


def _function_linear():
    """A linear as an autograd.Function, as TransformerEngine's is: its tensors are saved with
    ctx.save_for_backward once its forward (the GEMM included) has run."""
    import torch

    class Fn(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, w):
            ctx.save_for_backward(x, w)
            return x @ w.t()

        @staticmethod
        def backward(ctx, g):
            x, w = ctx.saved_tensors
            return g @ w, (g.reshape(-1, g.shape[-1]).t() @ x.reshape(-1, x.shape[-1]))

    from tests.helpers import function_linear

    return function_linear(Fn)


def _kept_after_forward(blk, x) -> int:
    """Bytes a block keeps after its forward for backward (torch's MemTracker: live tensors after
    forward, less its output, plus its input, which the caller holds)."""
    import torch
    from torch.distributed._tools.mem_tracker import MemTracker

    cpu = torch.device("cpu")
    mt = MemTracker()
    mt.track_external(blk, x)
    with mt:
        before = mt.get_tracker_snapshot("current")[cpu]["Total"]
        y = blk(x)
        after = mt.get_tracker_snapshot("current")[cpu]["Total"]
    return after - before - y.numel() * y.element_size() + x.numel() * x.element_size()


@pytest.mark.parametrize("mlp", ["swiglu", "gelu"])
def test_selective_checkpointing_without_the_attention_kernel_in_its_save_list(mlp):
    """--no-sac-saves-attention (torchtitan's SAC before b39377f under cuDNN's attention): the
    block keeps neither the attention output nor its logsumexp (MemTracker), and backward reruns
    the attention forward (FlopCounterMode, torch's own SDPA formula mapped onto the CPU flash
    kernel): the planner's bytes and FLOPs for both settings."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    from zplan import activation_memory, arch
    from zplan.specs import Precision, TrainSpec

    seq, mb = 64, 2

    def kept(saves):
        m, net = _tiny_blocks(mlp, "selective", saves_attention=saves)
        x = torch.randn(mb, seq, m.hidden, dtype=torch.bfloat16, requires_grad=True)
        return m, _kept_after_forward(net.layers[0], x)

    def cpu_flash_forward(q, k, v, *args, out_shape=None, **kwargs):
        # torch's own SDPA forward formula (flop_counter.sdpa_flop_count: q kᵀ and p v, 2 FLOPs a
        # multiply-add each, over the query heads), for the CPU flash kernel that FlopCounterMode
        # has none for; its backward stays uncounted in every run. Written out: torch 2.11's
        # sdpa_flop_count asserts equal query and key/value heads (grouped-query attention here)
        b, h, s_q, d = q  # FlopCounterMode hands its mappings the shapes
        return 4 * b * h * s_q * k[-2] * d

    def backward_flop(mode, saves):
        # forward and backward under one counter (SDPA picks its kernel under the mode: the
        # recompute must see the forward's ops), less a forward counted alone
        m, net = _tiny_blocks(mlp, mode, layers=1, saves_attention=saves)
        x = torch.randn(mb, seq, m.hidden, dtype=torch.bfloat16, requires_grad=True)
        mapping = {torch.ops.aten._scaled_dot_product_flash_attention_for_cpu: cpu_flash_forward}
        with FlopCounterMode(display=False, custom_mapping=mapping) as fwd:
            net.layers[0](x)
        with FlopCounterMode(display=False, custom_mapping=mapping) as both:
            net.layers[0](x).sum().backward()
        return both.get_total_flops() - fwd.get_total_flops()

    train = {s: TrainSpec(seq_len=seq, micro_batch=mb, checkpointing="selective", fused_norm=False,
                          precision=Precision(param="bf16"), sac_saves_attention=s) for s in (True, False)}
    m, without = kept(False)
    _, with_ = kept(True)
    assert activation_memory.block_saved_bytes(m, train[False], "selective") == without < with_
    assert activation_memory.block_saved_bytes(m, train[True], "selective") == with_
    unit = [u for u in arch.units(m, 1) if u.blocks][0]
    none = backward_flop("none", True)
    for saves in (True, False):
        assert arch.unit_recompute_flop(m, unit, train[saves]) == backward_flop("selective", saves) - none
    assert arch.unit_recompute_flop(m, unit, train[False]) - arch.unit_recompute_flop(m, unit, train[True]) \
        == 4 * seq * m.q_hidden * seq * mb


@pytest.mark.parametrize("mlp", ["swiglu", "gelu"])
def test_selective_checkpointing_saves_and_recomputes_what_the_planner_prices(mlp):
    """The planner's bytes and FLOPs for one selectively checkpointed block against the trainer's
    block, measured by torch's MemTracker (live tensors after forward) and FlopCounterMode. Before
    the policy had one source the planner counted GELU's w2 output, which the trainer drops."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    from zplan import activation_memory, arch
    from zplan.specs import Precision, TrainSpec

    seq, mb = 64, 2

    def measure(mode):
        m, net = _tiny_blocks(mlp, mode)
        blk = net.layers[0]
        x = torch.randn(mb, seq, m.hidden, dtype=torch.bfloat16, requires_grad=True)
        kept = _kept_after_forward(blk, x)
        with FlopCounterMode(display=False) as fc:
            blk(x).sum().backward()
        return m, kept, fc.get_total_flops()

    m, kept, flop = measure("selective")
    _, _, flop_none = measure("none")
    train = TrainSpec(seq_len=seq, micro_batch=mb, checkpointing="selective", fused_norm=False,
                      precision=Precision(param="bf16"))
    assert activation_memory.block_saved_bytes(m, train, "selective") == kept
    unit = [u for u in arch.units(m, 1) if u.blocks][0]
    assert arch.unit_recompute_flop(m, unit, train) == flop - flop_none


@pytest.mark.parametrize("mode,every,first,wrapped", [("every-k", 2, 1, [1, 3]), ("every-k", 3, 1, [2]),
                                                      ("first-k", 2, 1, [0]), ("first-k", 2, 3, [0, 1, 2]),
                                                      ("first-k", 2, 4, [0, 1, 2, 3]),
                                                      ("full", 2, 1, [0, 1, 2, 3]), ("none", 2, 1, [])])
def test_trainer_wraps_the_blocks_the_planner_prices(mode, every, first, wrapped):
    import torch
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

    from zplan import arch
    from zplan.presets import model as preset
    from zplan.specs import TrainSpec
    from zplan.trainer.model import Transformer
    from zplan.trainer.parallel import apply_checkpointing

    m = preset("tiny")
    with torch.device("meta"):
        net = Transformer(m)
    apply_checkpointing(net, mode, every, first=first)
    assert [i for i, b in enumerate(net.layers) if isinstance(b, CheckpointWrapper)] == wrapped
    t = TrainSpec(seq_len=64, checkpointing=mode, checkpoint_every=every, checkpoint_first=first)
    units = arch.units(m, 1)
    recomputing = [u.first_block for u in units if u.blocks and arch.unit_recompute_flop(m, u, t)]
    assert recomputing == wrapped


@pytest.mark.slow  # over a second in all: the fast loop leaves it to CI
@pytest.mark.parametrize("mlp", ["swiglu", "gelu"])
@pytest.mark.parametrize("mode", ["full", "every-k", "first-k"])
@pytest.mark.parametrize("early_stop", [True, False])
def test_full_recompute_flops_against_flopcounter(mlp, mode, early_stop):
    """What full, every-k and first-k checkpointing rerun in backward, against FlopCounterMode on the
    trainer's blocks. With early stop (non-reentrant checkpoint's default since PyTorch 2.1) the
    block's last matmul is not rerun: nothing saves its output. SDPA's math backend, so that the
    attention matmuls are counted (the CPU flash kernel has no FLOP formula)."""
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.checkpoint import set_checkpoint_early_stop
    from torch.utils.flop_counter import FlopCounterMode

    from zplan import arch
    from zplan.specs import TrainSpec

    seq, mb = 64, 2

    m, flop = _backward_flop(mlp, mode, 4, seq, mb, early_stop)
    _, flop_none = _backward_flop(mlp, "none", 4, seq, mb, early_stop)
    train = TrainSpec(seq_len=seq, micro_batch=mb, checkpointing=mode, checkpoint_every=2,
                      checkpoint_first=3, checkpoint_early_stop=early_stop)
    units = [u for u in arch.units(m, 1) if u.blocks]
    assert len(units) == 4
    assert sum(arch.unit_recompute_flop(m, u, train) for u in units) == flop - flop_none
    # and the time model reruns the same matmuls
    from zplan import unit_ops
    from zplan.scenario import Scenario
    from zplan.scenario_options import ScenarioOptions, build

    sc = build(ScenarioOptions(model="tiny", gpu="h100-sxm", gpus="1", seq_len=seq, micro_batch=mb,
                               checkpointing=mode, checkpoint_first=3, checkpoint_early_stop=early_stop))
    sc = Scenario(m, sc.hw, sc.train, sc.assume, None)
    ops, _ = unit_ops.recompute_ops(sc, units[1])  # every-k (k = 2) and first-k (3) wrap the second block
    linears = [o.name for o in ops if o.name.split()[0] in ("wq", "wk", "wv", "wo", "w1", "w2", "w3")]
    assert ("w2" in {n.split()[0] for n in linears}) is (not early_stop)


@pytest.mark.parametrize("params", ["7e9", "1e7"])
def test_bare_parameter_count_reruns_its_own_forward(params):
    """A --params model's units carry the count's share of matmul weights, not the stand-in
    decoder's widths: without early stop full checkpointing reruns exactly the unit's forward,
    with it less (the last matmul's share)."""
    from zplan import arch
    from zplan.scenario_options import ScenarioOptions, build

    for early_stop in (False, True):
        sc = build(ScenarioOptions(params=params, checkpointing="full", checkpoint_early_stop=early_stop))
        for u in (u for u in sc.units if u.blocks):
            fwd, rerun = arch.unit_forward_flop(sc.model, u, sc.train), arch.unit_recompute_flop(sc.model, u, sc.train)
            assert rerun == fwd if not early_stop else 0.5 * fwd < rerun < fwd


@pytest.mark.parametrize("mlp", ["swiglu", "gelu"])
def test_early_stop_reruns_a_function_linear_to_its_end(mlp):
    """Linears that are autograd.Functions (TransformerEngine's) save their tensors only when
    their forward returns, so early stop cannot skip the last one: the block reruns in full.
    FlopCounterMode against zplan's te-delayed recompute FLOPs (early stop on)."""
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode

    from zplan import arch
    from zplan.specs import TrainSpec

    seq, mb = 64, 2
    m, flop = _backward_flop(mlp, "full", 2, seq, mb, True, _function_linear())
    _, flop_none = _backward_flop(mlp, "none", 2, seq, mb, True, _function_linear())
    te = TrainSpec(seq_len=seq, micro_batch=mb, checkpointing="full", float8=True, float8_recipe="te-delayed")
    plain = TrainSpec(seq_len=seq, micro_batch=mb, checkpointing="full")
    units = [u for u in arch.units(m, 1) if u.blocks]
    assert sum(arch.unit_recompute_flop(m, u, te) for u in units) == flop - flop_none
    assert sum(arch.unit_recompute_flop(m, u, plain) for u in units) < flop - flop_none


@pytest.mark.parametrize("unit", ["separate", "head-kept", "root", "root-kept", "head-root-kept"])
@pytest.mark.parametrize("tied", [False, True])
def test_trainer_shards_the_units_the_planner_prices(unit, tied):
    """The trainer's fully_shard groups hold exactly the parameters of arch.units' moving units,
    in order, and the root what the held unit holds (embeddings and head when tied or left to
    the root)."""
    import torch

    from zplan import arch
    from zplan.presets import model as preset
    from zplan.specs import TrainSpec
    from zplan.trainer.model import Transformer
    from zplan.trainer.parallel import unit_groups

    m = preset("tiny").model_copy(update={"tied_embeddings": tied})
    with torch.device("meta"):
        net = Transformer(m)
    t = TrainSpec(seq_len=64, layout="torch", embed_head_unit=unit, blocks_per_unit=2)
    groups = unit_groups(net, t)
    sizes = [sum(p.numel() for g in grp for p in g.parameters()) for grp in groups]
    units = arch.units(m, 2, unit)
    assert sizes == [u.numel for u in units if not u.held]
    held = [u for u in units if u.held]
    in_groups = {id(p) for grp in groups for g in grp for p in g.parameters()}
    root = sum(p.numel() for p in net.parameters() if id(p) not in in_groups)
    assert root == sum(u.numel for u in held)
    assert bool(held) == (tied or "root" in unit)


def test_the_root_is_gathered_again_for_backward_only_where_it_reshards():
    """FSDP1's root (root-kept) stays gathered from forward to backward; FSDP2's reshards
    after forward when told to (PyTorch >= 2.8) and is gathered again: the backward all-gather
    differs by exactly the root's elements, Llama 3.1 8B's embedding, head and final norm
    (2 x 128256 x 4096 + 4096)."""
    from zplan.comm import collectives
    from zplan.strategies import effective
    from tests.helpers import scenario

    def backward_gather(unit):
        sc = scenario(model="llama-3.1-8b", gpus="8", layout="torch", embed_head_unit=unit)
        cs = collectives(sc, effective("zero3", "torch"))
        return next(c.elements for c in cs if c.name == "all-gather (backward)")

    assert backward_gather("root") - backward_gather("root-kept") == 2 * 128256 * 4096 + 4096
    assert backward_gather("separate") == backward_gather("root")


@pytest.mark.parametrize("mlp", ["swiglu", "gelu"])
def test_selective_policy_answers_the_recompute_as_the_forward(mlp):
    """torch 2.11 asks the checkpoint policy in the forward and again in the recomputation
    (`ctx.is_recompute`), reading saved outputs back in order; 2.13 asks in the forward only. The
    trainer's policy gives the recompute the forward's answers, matmul by matmul, and saves the
    matmuls policy.selective_saved_matmuls names (an independent list: the block's matmul order)."""
    torch = pytest.importorskip("torch")
    from types import SimpleNamespace

    from torch.utils.checkpoint import CheckpointPolicy

    from zplan import policy
    from zplan.trainer.parallel import selective_policy

    mm = torch.ops.aten.mm.default
    names = policy.BLOCK_MATMULS[mlp]
    choose = selective_policy(policy.selective_saved_positions(mlp))
    forward = [choose(SimpleNamespace(is_recompute=False), mm) for _ in names]
    recompute = [choose(SimpleNamespace(is_recompute=True), mm) for _ in names]
    assert forward == recompute
    saved = [n for n, c in zip(names, forward) if c == CheckpointPolicy.MUST_SAVE]
    assert saved == [n for n in names if n in set(policy.selective_saved_matmuls(mlp))]
    assert 0 < len(saved) < len(names)
    assert choose(SimpleNamespace(is_recompute=False), torch.ops.aten.add.Tensor) == CheckpointPolicy.PREFER_RECOMPUTE


def test_the_kept_last_block_is_the_unit_holding_the_models_last_block():
    """`last_block_kept` keeps the unit that holds the model's last block, whatever the
    grouping, and nothing where the plan does not ask (torchtitan's 2024 rule,
    `int(layer_id) < len(model.layers) - 1`)."""
    from zplan import policy
    from zplan.specs import TrainSpec

    t = TrainSpec(layout="torch", last_block_kept=True)
    assert policy.holds_kept_last_block(t, 31, 1, 32)
    assert not policy.holds_kept_last_block(t, 30, 1, 32)
    assert policy.holds_kept_last_block(t, 28, 4, 32)  # blocks 28-31 in one unit
    assert not policy.holds_kept_last_block(t, 0, 0, 32)  # embeddings, head: no blocks
    assert not policy.holds_kept_last_block(TrainSpec(layout="torch"), 31, 1, 32)
    assert policy.stays_gathered(False, False, "separate", kept_last_block=True)
    assert not policy.stays_gathered(False, False, "separate")
    with pytest.raises(ValueError, match="gathers module by module"):
        TrainSpec(layout="zero", last_block_kept=True)


@pytest.mark.parametrize("mode", ["full", "none"])
def test_heads_wider_than_hidden_over_heads_flops_against_flopcountermode(mode):
    """Heads set wider than hidden / heads (ModelSpec.attention_head_dim; Qwen3-32B, Mistral
    NeMo): the planner's forward FLOPs of a block (q and o projections num_heads x head_dim
    wide, attention 4·s·q per token) and its recompute FLOPs under full checkpointing, against
    FlopCounterMode over the trainer's blocks (SDPA's math backend)."""
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode

    from zplan import arch
    from zplan.specs import TrainSpec

    seq, mb, wide = 64, 2, 3 * preset_head_dim()
    m, net = _tiny_blocks("swiglu", mode, layers=1, head_dim=wide, math=True)
    assert m.q_hidden != m.hidden
    x = torch.randn(mb, seq, m.hidden, dtype=torch.bfloat16, requires_grad=True)
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as fc:
        net.layers[0](x)
    train = TrainSpec(seq_len=seq, micro_batch=mb, checkpointing=mode)
    unit = [u for u in arch.units(m, 1) if u.blocks][0]
    assert arch.unit_forward_flop(m, unit, train) == fc.get_total_flops()
    if mode == "full":
        _, flop = _backward_flop("swiglu", "full", 2, seq, mb, True, head_dim=wide)
        _, flop_none = _backward_flop("swiglu", "none", 2, seq, mb, True, head_dim=wide)
        units = [u for u in arch.units(m.model_copy(update={"num_layers": 2}), 1) if u.blocks]
        assert sum(arch.unit_recompute_flop(m, u, train) for u in units) == flop - flop_none


def preset_head_dim() -> int:
    from zplan.presets import model as preset

    return preset("tiny").head_dim
