"""Keys and values copied to every query head before attention (--attention-expands-kv, Hugging
Face's repeat_kv ahead of SDPA): the trainer computes the same thing, and the copies' traffic
the planner charges is what PyTorch's ops move (tests/test_fake_trace.py holds the memory)."""

import pytest

from tests.helpers import scenario
from zplan import activation_memory, unit_ops

torch = pytest.importorskip("torch")


def test_the_copies_change_nothing_in_the_result():
    """SDPA on copied keys and values gives what its grouped-query path gives (the same grouping:
    query head i reads key/value head i // group), to the bit on CPU."""
    from zplan.trainer.model import Transformer, init_weights_

    sc = scenario(model="tiny", gpus=1)
    assert sc.model.num_kv_heads < sc.model.num_heads
    torch.manual_seed(0)
    model = Transformer(sc.model)
    init_weights_(model)
    tokens = torch.randint(0, sc.model.vocab_size, (2, 64))
    grouped = model(tokens)
    model.expand_kv(True)
    copied = model(tokens)
    assert torch.equal(grouped, copied)


def test_the_copies_traffic_is_what_the_ops_move():
    """The copies one attention core makes (a dispatch mode sees repeat_interleave run as
    unsqueeze, expand, clone, view on CPU: HF's repeat_kv exactly): each clone reads a key/value
    tensor's storage (kv wide) and writes a q-wide one, the planner's 2·T·B·(q + kv) for k and v
    together; a model whose heads each have their own key/value head copies nothing."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from zplan.trainer.model import Attention

    sc = scenario(model="tiny", gpus=1, micro_batch=2, seq_len=64, attention_expands_kv=True)
    m = sc.model
    att = Attention(m)
    att.expand_kv = True
    q = torch.randn(2, m.num_heads, 64, m.head_dim)
    k, v = (torch.randn(2, m.num_kv_heads, 64, m.head_dim) for _ in range(2))

    class Copies(TorchDispatchMode):
        moved = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func.__name__.startswith("clone"):
                Copies.moved += args[0].untyped_storage().nbytes() + out.untyped_storage().nbytes()
            return out

    with Copies():
        att.core(q, k, v)
    T, B = 2 * 64, 4  # fp32 here
    assert Copies.moved == 2 * T * B * (m.q_hidden + m.kv_hidden)
    ops = [o for o in unit_ops._block(sc.for_strategy(True), False) if "repeat_kv" in o.name]
    assert len(ops) == 1 and ops[0].bytes == 2 * T * 2 * (m.q_hidden + m.kv_hidden)  # bf16 in the plan
    mha = scenario(model="llama-2-7b", attention_expands_kv=True)
    assert not activation_memory.expands_kv(mha.model, mha.train)
    assert not [o for o in unit_ops._block(mha.for_strategy(True), False) if "repeat_kv" in o.name]


@pytest.mark.parametrize("mode", ["full", "selective", "attention"])
def test_every_recomputation_reruns_the_copies(mode):
    """Full, selective (SDPA's saved k and v come from an op its policy does not keep) and the
    checkpointed attention core all make the copies again in backward: their recompute prices
    them once per block."""
    sc = scenario(model="tiny", gpus=1, checkpointing=mode, attention_expands_kv=True).for_strategy(True)
    block = next(u for u in sc.units if u.blocks)
    ops, _ = unit_ops.recompute_ops(sc, block)
    assert sum("repeat_kv" in o.name for o in ops) == 1
