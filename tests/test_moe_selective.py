"""An MoE block under selective checkpointing, as torchtitan runs it (and a block whose q, k and v
are one linear, as torchtitan's FusedQKVLinear): what the planner keeps and reruns, against
PyTorch's own checkpoint running torchtitan's rule.

The block below is written here in the structure of torchtitan's MoE (models/common/moe.py and
token_dispatcher.py at b36e4b6: a router in fp32, topk, tokens sorted by expert, three
torch._grouped_mm, the scores applied in fp32, scatter_add), and torchtitan's SelectiveAC rule
(distributed/activation_checkpoint.py at b36e4b6) is restated from its documentation: save the
outputs of PyTorch's compute-intensive ops (the partitioner's default op list) and of topk, except
every second mm, and recompute the router's mm. What stays alive after the checkpointed forward is
read off the storages themselves; what backward runs again is read off the dispatched ops. Neither
comes from zplan.
"""

import pytest

torch = pytest.importorskip("torch")

import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.multiprocessing.reductions import StorageWeakRef  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402
from torch.utils._pytree import tree_flatten  # noqa: E402

from zplan import activation_memory, arch, policy  # noqa: E402
from zplan.specs import ModelSpec, TrainSpec  # noqa: E402

H, HEADS, KV_HEADS, E, K, FF, S, MB = 64, 4, 2, 8, 2, 32, 128, 2
MM = (torch.ops.aten.mm.default, torch.ops.aten.linear.default)


class Block(nn.Module):
    def __init__(self, fused=False, dense=False):
        super().__init__()
        d = H // HEADS
        self.fused = fused  # q, k and v as one linear: torchtitan's FusedQKVLinear
        self.dense = dense
        if fused:
            self.wqkv = nn.Linear(H, (HEADS + 2 * KV_HEADS) * d, bias=False)
        else:
            self.wq = nn.Linear(H, HEADS * d, bias=False)
            self.wk = nn.Linear(H, KV_HEADS * d, bias=False)
            self.wv = nn.Linear(H, KV_HEADS * d, bias=False)
        self.wo = nn.Linear(HEADS * d, H, bias=False)
        self.gate = nn.Linear(H, E, bias=False)
        self.w1 = nn.Parameter(torch.randn(E, FF, H) / H ** 0.5)
        self.w3 = nn.Parameter(torch.randn(E, FF, H) / H ** 0.5)
        self.w2 = nn.Parameter(torch.randn(E, H, FF) / FF ** 0.5)
        self.register_buffer("expert_bias", torch.zeros(E))  # load balancing (load_balance_coeff set)
        self.n1 = nn.Parameter(torch.ones(H))
        self.n2 = nn.Parameter(torch.ones(H))

    def forward(self, x):
        b, s, _ = x.shape
        d = H // HEADS
        y = F.rms_norm(x, (H,), self.n1)
        if self.fused:
            q, k, v = self.wqkv(y).split([HEADS * d, KV_HEADS * d, KV_HEADS * d], dim=-1)
        else:
            q, k, v = self.wq(y), self.wk(y), self.wv(y)
        q = q.reshape(b, s, HEADS, d).transpose(1, 2)
        k = k.reshape(b, s, KV_HEADS, d).transpose(1, 2)
        v = v.reshape(b, s, KV_HEADS, d).transpose(1, 2)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        x = x + self.wo(a.transpose(1, 2).reshape(b, s, H))
        t = F.rms_norm(x, (H,), self.n2).view(b * s, H)
        if self.dense:  # a dense SwiGLU MLP of the same width (the experts' first weights)
            w1, w3, w2 = self.w1[0], self.w3[0], self.w2[0]
            return x + F.linear(F.silu(F.linear(t, w1)) * F.linear(t, w3), w2).view(b, s, H)
        return x + self.moe(t).view(b, s, H)

    def moe(self, t):
        scores = F.softmax(F.linear(t.float(), self.gate.weight.float()), dim=-1)  # the router in fp32
        _, ids = torch.topk(scores + self.expert_bias, K, dim=-1, sorted=False)
        top = scores.gather(-1, ids)
        top = top / (top.sum(-1, keepdim=True) + 1e-20)
        offs = torch.cumsum(torch.histc(ids.view(-1).float(), bins=E, min=0, max=E), 0).to(torch.int32)
        order = torch.argsort(ids.view(-1), stable=True)
        score, token = top.view(-1)[order], order // K
        routed = t[token]
        h = F.silu(torch._grouped_mm(routed, self.w1.transpose(-2, -1), offs=offs))
        h = h * torch._grouped_mm(routed, self.w3.transpose(-2, -1), offs=offs)
        o = torch._grouped_mm(h, self.w2.transpose(-2, -1), offs=offs)
        o = (o.float() * score.view(-1, 1)).to(o.dtype)
        return torch.zeros_like(t).scatter_add(0, token.view(-1, 1).expand(-1, H), o)


def _torchtitan_rule():
    """torchtitan's SelectiveAC policy, restated; the CPU flash kernel stands in for the CUDA one
    (both are SDPA's flash path, the CUDA one on PyTorch's compute-intensive list)."""
    from torch._functorch.partitioners import get_default_op_list
    from torch.utils.checkpoint import CheckpointPolicy

    save = {op.default for op in get_default_op_list().compute_intensive_ops}
    save |= {torch.ops.aten.topk.default, torch.ops.aten.linear.default,
             torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default}
    count = {False: 0, True: 0}

    def choose(ctx, func, *args, **kwargs):
        if func in MM:
            w = args[1].shape if func == torch.ops.aten.mm.default else args[1].shape[::-1]
            if tuple(w) == (H, E):  # the router's mm: forced to recompute
                return CheckpointPolicy.PREFER_RECOMPUTE
            count[ctx.is_recompute] += 1
        if func in save and not (func in MM and count[ctx.is_recompute] % 2 == 0):
            return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.PREFER_RECOMPUTE
    return choose


def _torchtitan_contexts():
    """torchtitan's SelectiveAC context_fn (a module-level function: dynamo traces it)."""
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    return create_selective_checkpoint_contexts(_torchtitan_rule())


class _Outputs(TorchDispatchMode):
    """Every op's outputs (storage, bytes) and, in backward, the matmuls run (FLOPs)."""

    def __init__(self):
        super().__init__()
        self.made, self.flop = [], 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in MM:
            (m, kk), n = args[0].shape, args[1].shape[-1 if func == MM[0] else 0]
            self.flop += 2 * m * kk * n
        elif func == torch.ops.aten._grouped_mm.default:
            self.flop += 2 * args[0].shape[0] * args[0].shape[1] * args[1].shape[-1]
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self.made.append((StorageWeakRef(t.untyped_storage()), t.untyped_storage().nbytes()))
        return out


def _spec(fused=False, dense=False):
    moe = {} if dense else {"num_experts": E, "experts_per_token": K}
    m = ModelSpec(name="moe", num_layers=1, hidden=H, ffn_hidden=FF, num_heads=HEADS, num_kv_heads=KV_HEADS,
                  vocab_size=64, qkv_fused=fused, **moe)
    return m, TrainSpec(seq_len=S, micro_batch=MB, checkpointing="selective")


def _run(fused=False, dense=False):
    from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts

    torch.manual_seed(0)
    block = Block(fused, dense).to(torch.bfloat16)
    x = torch.randn(MB, S, H, dtype=torch.bfloat16, requires_grad=True)
    params = {StorageWeakRef(p.untyped_storage()).cdata for p in block.parameters()}
    fwd = _Outputs()
    with fwd:
        y = checkpoint(block, x, use_reentrant=False,
                       context_fn=lambda: create_selective_checkpoint_contexts(_torchtitan_rule()))
    kept = {w.cdata: n for w, n in fwd.made if not w.expired() and w.cdata not in params}
    kept.pop(StorageWeakRef(y.untyped_storage()).cdata)
    bwd = _Outputs()
    with bwd:
        y.backward(torch.ones_like(y))
    return sum(kept.values()) + x.untyped_storage().nbytes(), bwd.flop


@pytest.mark.parametrize("fused", [False, True])
def test_an_moe_block_keeps_what_the_planner_counts(fused):
    """Kept through backward: the block's input, wq's and wv's outputs (q, k and v as one linear:
    its whole output), the attention output and logsumexp, and the router's topk (fp32 values,
    int64 indices); no expert tensor."""
    m, t = _spec(fused)
    kept, _ = _run(fused)
    assert kept == activation_memory.block_saved_bytes(m, t, "selective")
    assert policy.selective_saved_matmuls("swiglu", moe=True, qkv_fused=fused) == (("wqkv",) if fused else ("wq", "wv"))


@pytest.mark.parametrize("fused", [False, True])
def test_an_moe_block_reruns_what_the_planner_prices(fused):
    """Backward's matmul FLOPs less the block's backward proper (2 x its forward: dX and dW) are
    the rerun: wk (unless fused into the kept q/k/v linear), wo, the router and every expert's
    three matmuls."""
    m, t = _spec(fused)
    _, flop = _run(fused)
    unit = next(u for u in arch.units(m, 1, "separate") if u.blocks)
    T = S * MB
    forward_mm = 2 * unit.matmul_params * T
    assert flop - 2 * forward_mm == arch.unit_recompute_flop(m, unit, t)


def test_an_moe_layer_without_checkpointing_keeps_its_routing_and_experts():
    """No recomputation: the MoE layer keeps (beyond its input, the block's normed MLP input) the
    fp32 copies its router's matmul keeps, the router's fp32 scores, the routing indices and sorted scores, the routed tokens, the experts'
    SwiGLU tensors and the fp32 copy of their outputs that the scores multiply: the planner's MoE
    terms, the bytes of the storages alive after the layer's forward."""
    m, t = _spec()
    torch.manual_seed(0)
    block = Block().to(torch.bfloat16)
    x = torch.randn(MB * S, H, dtype=torch.bfloat16, requires_grad=True)
    params = {StorageWeakRef(p.untyped_storage()).cdata for p in block.parameters()}
    fwd = _Outputs()
    with fwd:
        y = block.moe(x)
    kept = {w.cdata: n for w, n in fwd.made if not w.expired() and w.cdata not in params}
    kept.pop(StorageWeakRef(y.untyped_storage()).cdata)
    terms = activation_memory.block_activation_terms(m, t)
    moe = ("router_input", "router_logits", "routing", "expert_inputs", "mlp_hidden", "expert_outputs")
    assert sum(kept.values()) == sum(terms[k] for k in moe)


def test_a_dense_block_with_one_qkv_linear_keeps_its_whole_output():
    """Dense, q/k/v as one linear: the every-other rule keeps wqkv, w1 and w2 (wo and w3 rerun)."""
    m, t = _spec(fused=True, dense=True)
    kept, _ = _run(fused=True, dense=True)
    assert kept == activation_memory.block_saved_bytes(m, t, "selective")
    assert policy.selective_saved_matmuls("swiglu", qkv_fused=True) == ("wqkv", "w1", "w2")


@pytest.mark.slow  # compiling takes about a minute on 2 cores
@pytest.mark.parametrize("mode", ["none", "selective"])
def test_a_compiled_moe_block_saves_what_the_min_cut_partitioner_keeps(mode):
    """Compiled (torch.compile per block, the partitioner inductor uses, without its code
    generation): without checkpointing the MoE layer keeps what the min-cut partitioner chooses
    (the 16-bit expert outputs, not an fp32 copy; no fp32 copy of the router's input); under
    torchtitan's rule the block keeps its input, Wq/Wv, the attention's outputs and topk's indices
    (its values are dropped: backward reads none)."""
    from torch.utils.checkpoint import checkpoint

    from tests.helpers import saved_storages

    torch.manual_seed(0)
    torch._dynamo.reset()  # past dynamo's recompile limit a worker would run the block eager
    block = Block().to(torch.bfloat16)
    saved, pack = saved_storages(block)
    m, t = _spec()
    t = t.model_copy(update={"compile": True, "checkpointing": mode})
    if mode == "none":
        x = torch.randn(MB * S, H, dtype=torch.bfloat16, requires_grad=True)
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            torch.compile(block.moe, backend="aot_eager_decomp_partition")(x)
        saved.pop(x.untyped_storage().data_ptr(), None)  # the layer's input: the block's mlp_input
        terms = activation_memory.block_activation_terms(m, t)
        moe = ("router_input", "router_logits", "routing", "expert_inputs", "mlp_hidden", "expert_outputs")
        assert sum(saved.values()) == sum(terms[k] for k in moe)
    else:
        x = torch.randn(MB, S, H, dtype=torch.bfloat16, requires_grad=True)

        def run(x):
            return checkpoint(block, x, use_reentrant=False, context_fn=_torchtitan_contexts)
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            torch.compile(run, backend="aot_eager_decomp_partition")(x)
        assert sum(saved.values()) == activation_memory.block_saved_bytes(m, t, "selective")
