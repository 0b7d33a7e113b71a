"""FSDP1 auto-wrapping the embedding beside the decoder layers (`--embed-head-unit
head-root-kept`, Lambda's distributed-training-guide): the final norm and the head are left to
the root, which FSDP1 gathers at its pre-forward and keeps to the end of backward, and the head's
weight gradient waits there too: autograd runs the root's view and split nodes, made at the root's
pre-forward, after every block's (the engine takes the highest sequence number first), so the
root's post-backward hook, which reshards and reduce-scatters it, fires only when backward ends."""

import pytest

from zplan.memory import timeline
from zplan.strategies import effective
from tests.helpers import scenario

V, H = 128256, 4096  # Llama 3.1 8B's vocabulary and width


def _backward_of_a_block(unit: str):
    sc = scenario(model="llama-3.1-8b", gpus="8", layout="torch", embed_head_unit=unit, checkpointing="full")
    return sc, {e.label: e for e in timeline(sc, effective("zero3", "torch"))}


def test_the_kept_root_and_the_heads_gradient_are_there_at_every_blocks_backward():
    """Against norm + head a unit of their own, kept from forward to backward (head-kept): at a
    block's backward the root's weights are still gathered (bf16, V x H + H elements), the head's
    weight gradient still unsharded (bf16, V x H) and the root's sharded gradient not yet made
    (fp32, an eighth of its elements); the root is first in forward order and last in backward."""
    sc, root = _backward_of_a_block("head-root-kept")
    _, own = _backward_of_a_block("head-kept")
    assert [u.name for u in sc.units][:3] == ["norm+head", "embed", "blocks.0"] and sc.units[0].held
    for block in ("backward blocks.30", "backward blocks.1"):
        a, b = root[block].live, own[block].live
        assert a["gathered"] - b["gathered"] == 2 * (V * H + H)
        assert a["unsharded_grads"] - b["unsharded_grads"] == 2 * V * H
        assert b["grads"] - a["grads"] == 4 * (V * H + H) // 8
    # the head's backward is priced once, at backward's start; at its end the embeddings' unit
    # runs its backward, then the root only reduces
    labels = list(root)
    assert labels[0] == "forward norm+head" and "backward head (in norm+head)" in labels
    assert "backward norm+head" not in labels and labels[-6:-1] == [
        "backward embed", "reduce-scatter embed", "reduce-scatter embed (output)",
        "reduce-scatter norm+head", "reduce-scatter norm+head (output)"]


def test_the_allocator_sees_the_embeddings_own_unit_as_separate_does():
    """What the caching-allocator model reads of the embeddings' unit (regathered for its
    backward at backward's end, its gradient made then; freed after its forward before the first
    block's) is that unit's whatever holds the head: head-root-kept against separate, where it
    is unit 0 (it was the held root's by index)."""
    from zplan import memory_reserve
    from zplan.memory import model_state

    st = effective("zero3", "torch")
    tails, holes = [], []
    for unit in ("separate", "head-root-kept"):
        sc = scenario(model="llama-3.1-8b", gpus="16", layout="torch", embed_head_unit=unit,
                      checkpointing="full", seq_len=2048).for_strategy(True)
        tails.append(memory_reserve.head_tail(sc, st, model_state(sc, st)))
        holes.append(memory_reserve.forward_holes(sc, st))
    (sep, root) = tails
    embed = (2 * V * H,)  # bf16, V = 128256 rows pad to no more on 16 ranks
    assert sep.last_weights_bytes == root.last_weights_bytes == embed
    assert sep.last_grad_bytes == root.last_grad_bytes == embed
    assert root.held_root and not sep.held_root and root.reduce_in_bytes == 0
    assert holes[0] == holes[1]


FSDP1_PROBE = r'''
import functools, weakref
import torch, torch.nn as nn, torch.nn.functional as F, torch.distributed as dist
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import apply_activation_checkpointing
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP, MixedPrecision, ShardingStrategy
from torch.distributed.fsdp.wrap import ModuleWrapPolicy
from zplan import arch, policy
from zplan.presets import model as preset
from zplan.trainer.model import Block, Transformer

dist.init_process_group("gloo")
m = preset("tiny")
units = arch.units(m, 1, "head-root-kept", "torch")
assert units[0].held and not policy.root_reshards("head-root-kept")


class Mark(torch.autograd.Function):
    # the head's weight gradient as it is made (its backward runs in the head's backward)
    @staticmethod
    def forward(ctx, w):
        return w.view_as(w)

    @staticmethod
    def backward(ctx, g):
        g = g.clone()
        MADE.append(weakref.ref(g))
        return g


# plain (Lambda's guide: use_orig_params False, no MixedPrecision, a non-reentrant checkpoint
# around each layer); Hugging Face's and accelerate's (use_orig_params True, bf16 MixedPrecision)
for orig, mixed, ckpt in ((False, False, True), (True, True, False)):
    torch.manual_seed(0)
    net = Transformer(m)
    wrap = ModuleWrapPolicy({Block, nn.Embedding})
    mp = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16) if mixed else None
    f = FSDP(net, auto_wrap_policy=wrap, device_id=torch.device("cpu"), use_orig_params=orig,
             sharding_strategy=ShardingStrategy.FULL_SHARD, mixed_precision=mp)
    if ckpt:
        apply_activation_checkpointing(f, auto_wrap_policy=ModuleWrapPolicy({Block}))
    # FSDP1's flat parameters, the root's first, against the planner's units in forward order
    handles = [s._handle for s in FSDP.fsdp_modules(f)]
    sizes = [h.flat_param._unpadded_unsharded_size.numel() for h in handles]
    assert sizes == [u.numel for u in units], (sizes, [u.numel for u in units])
    root, embed = handles[0], handles[1]
    full = root.flat_param._unpadded_unsharded_size.numel()
    MADE = []
    net.output.forward = lambda x, targets=None: F.linear(x, Mark.apply(net.output.weight))
    seen = []

    def at(name):
        def hook(module, grad_output):
            seen.append((name, root.flat_param.numel() == full, bool(MADE) and MADE[0]() is not None,
                         embed.flat_param.numel() < embed.flat_param._unpadded_unsharded_size.numel()))
        return hook
    for i, layer in enumerate(net.layers):
        layer.register_full_backward_pre_hook(at(i))
    tokens = torch.randint(0, m.vocab_size, (2, 16))
    f(tokens).float().logsumexp(-1).mean().backward()
    assert len(seen) == m.num_layers, (orig, seen)
    for name, root_gathered, head_grad_alive, embed_sharded in seen:
        assert root_gathered and head_grad_alive, (orig, name, seen)
    assert seen[0][3], (orig, seen)  # the embedding's unit resharded after its forward
    assert root.flat_param.numel() < full and MADE[0]() is None, orig  # backward ended: both gone
    if dist.get_rank() == 0:
        print("ok", orig, len(seen))
'''


@pytest.mark.slow
def test_fsdp1_keeps_its_root_and_the_heads_gradient_through_backward(tmp_path):
    """Real FSDP1 on two gloo ranks, zplan's trainer model wrapped by block and embedding, as
    Lambda's guide runs it (a non-reentrant checkpoint around each layer) and as Hugging Face's
    and accelerate's FSDP1 does (use_orig_params, bf16 MixedPrecision): its flat parameters are
    arch.units' for head-root-kept, root first; at every block's backward the root is still
    unsharded and the head's weight gradient alive; both go at backward's end."""
    pytest.importorskip("torch")
    from tests.helpers import torchrun_probe

    done = torchrun_probe(tmp_path, FSDP1_PROBE)
    assert done.stdout.count("ok") == 2, done.stdout


@pytest.mark.parametrize("unit", ["separate", "head-root-kept", "root-kept"])
def test_explain_shows_the_first_blocks_kernels_wherever_the_root_sits(capsys, unit):
    """explain's compute section takes the first block's unit, whichever units come before it
    (the embeddings' and, under head-root-kept, the root's)."""
    from tests.helpers import cli

    p = cli(capsys, "explain", "--model", "llama-3.1-8b", "--gpus", "16", "--layout", "torch",
            "--embed-head-unit", unit)
    assert p.returncode == 0, p.stderr
    assert "unit blocks.0, forward" in p.stdout and "unit blocks.0, backward" in p.stdout
