"""The forward's cached blocks under first-k checkpointing (a mix of checkpointed blocks and
blocks that keep their intermediates), against an oracle that owes nothing to zplan's code: the
caching allocator's rules restated here from c10/cuda/CUDACachingAllocator.cpp, the blocks'
tensors written out by hand, and the trainer's own Block traced without recomputation.

Before 2026-12-06 first-k with k < L priced one block's freed working set where full
checkpointing (first-L) simulated every block's holes: Llama 3.1 405B on 512 GPUs under FSDP2,
seq 4096, reserved 74.9 GB with the first 125 of 126 blocks checkpointed and 78.5 GB with all
126, though the first 125 blocks run the same way in both and the last keeps more under
first-125."""

import pytest

from zplan import memory, memory_reserve, strategies
from zplan.activation_memory import forward_tensor_steps
from zplan.scenario_options import ScenarioOptions, build, cpu_ranks

from .test_forward_holes import _traced_block_forward

# -- the oracle: PyTorch's caching allocator, classic segments, one stream, default config ------
_MIN, _SMALL, _SMALL_BUF, _LARGE_BUF, _MIN_LARGE, _ROUND_LARGE = 512, 1 << 20, 2 << 20, 20 << 20, 10 << 20, 2 << 20


class _Oracle:
    """round_size to 512 B; <= 1 MiB from 2 MiB segments, < 10 MiB from 20 MiB ones, larger
    requests a segment of their own rounded up to 2 MiB; best fit by (size, address) among the
    free blocks of the request's pool; the block split where the rest is >= 512 B (small pool)
    or > 1 MiB (large pool); a freed block merges with its free neighbours in its segment."""

    def __init__(self):
        self.segments, self.where, self.top = [], {}, 0
        self.reserved = self.allocated = 0

    def malloc(self, key, nbytes):
        n = _MIN if nbytes < _MIN else -(-nbytes // _MIN) * _MIN
        small = n <= _SMALL
        best = None
        for si, (pool, blocks) in enumerate(self.segments):
            for bi, (addr, size, free) in enumerate(blocks):
                if pool == small and free and size >= n and (best is None or (size, addr) < best[:2]):
                    best = (size, addr, si, bi)
        if best is None:
            size = _SMALL_BUF if small else _LARGE_BUF if n < _MIN_LARGE else -(-n // _ROUND_LARGE) * _ROUND_LARGE
            self.segments.append((small, [[self.top, size, True]]))
            best = (size, self.top, len(self.segments) - 1, 0)
            self.top += size + (1 << 40)
            self.reserved += size
        size, addr, si, bi = best
        blocks = self.segments[si][1]
        rest = size - n
        if rest >= _MIN if small else rest > _SMALL:
            blocks[bi:bi + 1] = [[addr, n, False], [addr + n, rest, True]]
        else:
            blocks[bi][2], n = False, size
        self.where[key] = (si, addr)
        self.allocated += n

    def free(self, key):
        si, addr = self.where.pop(key)
        blocks = self.segments[si][1]
        bi = next(i for i, b in enumerate(blocks) if b[0] == addr)
        blocks[bi][2] = True
        self.allocated -= blocks[bi][1]
        for j in (bi + 1, bi):  # merge with the next, then the previous
            if 0 < j < len(blocks) and blocks[j][2] and blocks[j - 1][2]:
                blocks[j - 1][1] += blocks[j][1]
                del blocks[j]


def _block_tensors(T, h, kv, f, heads, recompute):
    """The trainer's block (fused RMSNorm, RoPE, flash attention, SwiGLU) in bf16, T tokens:
    under recomputation (a checkpoint's first forward, nothing saved) each tensor goes once no
    later op reads it; without, autograd keeps what backward reads (the norms' inputs, the
    linears' inputs, RoPE'd q and k, v, the kernel's output and logsumexp, silu's input and the
    product's two inputs) and frees only the pre-RoPE q and k and the two output projections'
    outputs (an add saves nothing)."""
    H, KV, F = 2 * T * h, 2 * T * kv, 2 * T * f
    s = [("+", "norm1", H), ("+", "wq", H), ("+", "wk", KV), ("+", "wv", KV), ("+", "q", H), ("+", "k", KV),
         ("-", "wk"), ("-", "wq"), ("+", "attn", H), ("+", "lse", 4 * heads * T), ("-", "lse"), ("+", "wo", H),
         ("-", "q"), ("-", "k"), ("-", "wv"), ("-", "attn"), ("-", "norm1"), ("+", "h", H), ("-", "wo"),
         ("+", "norm2", H), ("+", "w1", F), ("+", "silu", F), ("-", "w1"), ("+", "w3", F), ("+", "mul", F),
         ("-", "silu"), ("-", "w3"), ("+", "w2", H), ("-", "mul"), ("-", "norm2"), ("+", "out", H), ("-", "w2"),
         ("-", "h")]
    saved = set() if recompute else {"norm1", "q", "k", "wv", "attn", "lse", "h", "norm2", "w1", "silu", "w3", "mul"}
    return [x for x in s if not (x[0] == "-" and x[1] in saved)]


def _oracle_free_at_forward_end(T, k, L=126, h=16384, kv=1024, f=53248, heads=128, vocab=128256, ranks=512):
    """Llama 3.1 405B's forward under FSDP2 (the default stream): the embedding unit's gathered
    weight freed before the first block, then each block's nine weights gathered into storages
    of their own, its tensors, its weights freed at its reshard; the first k blocks checkpointed.
    Each storage is its parameter's all-gather output, rows padded to a multiple of the ranks
    (FSDPParam.init_all_gather_outputs: the padded shard times the world): the vocabulary's
    128,256 rows gather as 128,512 on 512 ranks; the blocks' rows divide evenly. The free cached
    bytes when the forward ends."""
    shapes = [(h,), (h, h), (kv, h), (kv, h), (h, h), (h,), (f, h), (f, h), (h, f)]
    a = _Oracle()
    a.malloc("embed", 2 * -(-vocab // ranks) * ranks * h)
    a.malloc(("out", -1), 2 * T * h)
    a.free("embed")
    for i in range(L):
        for j, sh in enumerate(shapes):
            a.malloc(("w", i, j), 2 * sh[0] * (sh[1] if len(sh) > 1 else 1))
        for step in _block_tensors(T, h, kv, f, heads, recompute=i < k):
            key = ("out", i) if step[1] == "out" else (step[1], i)
            a.malloc(key, step[2]) if step[0] == "+" else a.free(key)
        for j in range(len(shapes)):
            a.free(("w", i, j))
    return a.reserved - a.allocated


def _scenario(k, model="llama-3.1-405b", gpus="512", seq=4096, mb=1):
    ck = dict(checkpointing=k) if k in ("none", "full") else dict(checkpointing="first-k", checkpoint_first=k)
    return build(ScenarioOptions(model=model, gpus=gpus, seq_len=seq, micro_batch=mb, layout="torch", **ck))


@pytest.mark.parametrize("k", ["none", 1, 63, 125, 126])
def test_first_k_forward_leaves_what_the_oracle_allocator_leaves(k):
    """The free cached bytes when the forward ends, first-k of 405B's 126 blocks: the planner's
    simulation (memory_reserve.forward_holes) equals the oracle's, the mixed forward included (before:
    one block's working set, 1.44 GB, where the allocator leaves 6.6-8.1 GB; none: nothing
    priced, where the last unit's freed weights and temporaries leave 6.8 GB)."""
    st = strategies.get("zero3")
    sc = _scenario(k).for_strategy(st.fsdp)
    free = memory_reserve.forward_holes(sc, st)[0]
    assert free == _oracle_free_at_forward_end(4096, 0 if k == "none" else k)


@pytest.mark.parametrize("mlp, kv_heads", [("swiglu", 1), ("gelu", 4)])
def test_a_block_without_recomputation_frees_what_the_trainers_block_frees(mlp, kv_heads):
    """forward_tensor_steps(..., "none"), a first-k run's blocks past k, against the trainer's
    Block traced storage by storage without a checkpoint (CPU, the composite fp32 norm): the same
    sizes made and freed in the same order, leaving out what the steps leave out (as
    test_forward_holes: storages of 8 KiB or less, RoPE's tables and half-size temporaries)."""
    log = _traced_block_forward("none", mlp, kv_heads)
    h, s, b, d = 256, 64, 2, 64
    half_q, half_k = 4 * d * s * b, d * kv_heads * s * b
    sizes = {i: n for op, i, n in log if op == "+"}
    tables = (s * d // 2 * 4, s * d // 2 * 2)
    rope_half = {i for i, n in sizes.items() if n in (half_q, half_k) + tables}
    traced = [(op, sizes[i]) for op, i, _ in log if sizes[i] > 8192 and i not in rope_half]
    sc = build(cpu_ranks(model="llama-3.2-1b", gpus="1", seq_len=s, micro_batch=b, checkpointing="first-k",
                         checkpoint_first=1, fused_norm=False))
    m = sc.model.model_copy(update=dict(hidden=h, num_heads=4, num_kv_heads=kv_heads, ffn_hidden=704, mlp=mlp))
    steps, made = [], {}
    for op, name, n in forward_tensor_steps(m, sc.train, "none"):
        made.setdefault(name, n)
        if made[name] > 8192:
            steps.append((op, made[name]))
    assert traced == steps


@pytest.mark.parametrize("model, gpus, seq, mb, L", [("llama-3.1-405b", "512", 4096, 1, 126),
                                                     ("llama-3.1-405b", "512", 8192, 1, 126),
                                                     ("llama-3.1-70b", "64", 4096, 2, 80),
                                                     ("llama-3.1-8b", "64", 4096, 1, 32)])
def test_reserved_falls_as_more_blocks_are_checkpointed(model, gpus, seq, mb, L):
    """Checkpointing one more block frees that block's intermediates and makes nothing new
    before backward (its recompute reuses what the forward freed): neither the allocated nor the
    reserved peak may rise with k, from none through first-(L-1) to full checkpointing (before
    2026-12-06 full reserved more than first-(L-1); pricing first-k's holes alone, first-1 more
    than none, whose last unit's weights, freed at its reshard, were not counted)."""
    st = strategies.get("zero3")
    ks = ["none", 1, L // 2, L - 2, L - 1, "full"]
    mems = [memory.memory(_scenario(k, model, gpus, seq, mb), st) for k in ks]
    for (k0, a), (k1, b) in zip(zip(ks, mems), zip(ks[1:], mems[1:])):
        assert b.allocated_bytes <= a.allocated_bytes, (k0, k1)
        assert b.reserved_bytes <= a.reserved_bytes, (k0, k1, a.reserved_bytes, b.reserved_bytes)


@pytest.mark.parametrize("mlp", ["swiglu", "gelu"])
def test_a_block_without_recomputation_frees_its_input_where_nothing_saves_it(mlp):
    """Two of the trainer's Blocks chained as the model's loop runs them (x = block(x)), no
    checkpoint, CPU (the composite fp32 norm, which saves its fp32 copy, not its input): the first
    block's output is freed once the second returns, as autograd saves nothing of it (the
    storage's weak reference is the oracle). The steps say so with ("-", "in"); a fused norm
    (rms_norm saves its input) keeps it (a review: the simulation kept every input)."""
    import weakref

    import torch

    from zplan.trainer.model import Block

    h = 256
    sc = build(cpu_ranks(model="llama-3.2-1b", gpus="1", seq_len=64, micro_batch=2, checkpointing="none"))
    m = sc.model.model_copy(update=dict(hidden=h, num_heads=4, num_kv_heads=2, ffn_hidden=704, mlp=mlp))
    torch.manual_seed(0)
    blocks = [Block(m).to(torch.bfloat16) for _ in range(2)]
    x = torch.randn(2, 64, h, dtype=torch.bfloat16, requires_grad=True)
    for i, block in enumerate(blocks):
        x = block(x)
        if i == 0:
            first_out = weakref.ref(x.untyped_storage())
    assert x.requires_grad and first_out() is None  # autograd kept nothing of block 0's output
    assert not sc.train.fused_norm and forward_tensor_steps(m, sc.train, "none")[-1] == ("-", "in", 0)
    fused = sc.train.model_copy(update={"fused_norm": True})
    assert ("-", "in", 0) not in forward_tensor_steps(m, fused, "none")
