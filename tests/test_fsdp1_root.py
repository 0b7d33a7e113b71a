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
    labels = list(root)
    assert labels[0] == "forward norm+head" and labels[-4:-1] == [
        "backward norm+head", "reduce-scatter norm+head", "reduce-scatter norm+head (output)"]


FSDP1_PROBE = r'''
import weakref
import torch, torch.nn as nn, torch.nn.functional as F, torch.distributed as dist
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP, ShardingStrategy
from torch.distributed.fsdp.wrap import ModuleWrapPolicy
from zplan import arch, policy
from zplan.presets import model as preset
from zplan.trainer.model import Block, Transformer

dist.init_process_group("gloo")
m = preset("tiny")
torch.manual_seed(0)
net = Transformer(m)
f = FSDP(net, auto_wrap_policy=ModuleWrapPolicy({Block, nn.Embedding}), device_id=torch.device("cpu"),
         sharding_strategy=ShardingStrategy.FULL_SHARD)
# FSDP1's flat parameters, the root's first, against the planner's units in forward order
handles = [s._handle for s in FSDP.fsdp_modules(f)]
sizes = [h.flat_param._unpadded_unsharded_size.numel() for h in handles]
units = arch.units(m, 1, "head-root-kept", "torch")
assert sizes == [u.numel for u in units], (sizes, [u.numel for u in units])
assert units[0].held and not policy.root_reshards("head-root-kept")
root, embed = handles[0], handles[1]
full = root.flat_param._unpadded_unsharded_size.numel()

made = []
class Mark(torch.autograd.Function):
    """The head's weight gradient as it is made (its backward runs in the head's backward)."""
    @staticmethod
    def forward(ctx, w):
        return w.view_as(w)
    @staticmethod
    def backward(ctx, g):
        g = g.clone()
        made.append(weakref.ref(g))
        return g
net.output.forward = lambda x, targets=None: F.linear(x, Mark.apply(net.output.weight))
seen = []
def at(name):
    def hook(module, grad_output):
        seen.append((name, root.flat_param.numel() == full, bool(made) and made[0]() is not None,
                     embed.flat_param.numel() < embed.flat_param._unpadded_unsharded_size.numel()))
    return hook
for i, layer in enumerate(net.layers):
    layer.register_full_backward_pre_hook(at(i))
tokens = torch.randint(0, m.vocab_size, (2, 16))
f(tokens).float().logsumexp(-1).mean().backward()
assert len(seen) == m.num_layers, seen
for name, root_gathered, head_grad_alive, embed_sharded in seen:
    assert root_gathered and head_grad_alive, (name, seen)
assert seen[0][3], seen  # the embedding's unit resharded after its forward
assert root.flat_param.numel() < full and made[0]() is None  # resharded, reduced: backward ended
print("ok", len(seen))
'''


@pytest.mark.slow
def test_fsdp1_keeps_its_root_and_the_heads_gradient_through_backward(tmp_path):
    """Real FSDP1 on two gloo ranks, zplan's trainer model wrapped by block and embedding: its
    flat parameters are arch.units' for head-root-kept, root first; at every block's backward
    the root is still unsharded and the head's weight gradient alive; both go at backward's end."""
    pytest.importorskip("torch")
    from tests.helpers import torchrun_probe

    done = torchrun_probe(tmp_path, FSDP1_PROBE)
    assert "ok" in done.stdout
