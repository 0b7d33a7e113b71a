"""A Llama-style decoder sized by a zplan ModelSpec: RMSNorm, RoPE, GQA through
scaled_dot_product_attention, SwiGLU (or GELU), optionally tied embeddings and MoE-free.

Built on the meta device; `init_weights_` materialises each parameter from a seed that depends
only on its name in the plain model (wrappers such as activation checkpointing's removed), so
every strategy, checkpointing mode and world size starts from the same weights.
"""

from __future__ import annotations

import math
import zlib

import torch
import torch.nn.functional as F
from torch import nn

from ..specs import ModelSpec
from .linear_loss import chunked_linear_cross_entropy

# SDPA's backends in the order the plan's attention kernel asks (TrainSpec.attention_kernel),
# installed around every call with sdpa_kernel(..., set_priority=True). flash2 keeps cuDNN's
# attention out: torch prefers it on Hopper and Blackwell with a cuDNN newer than 9.15 (sdp_utils.cpp
# check_prefer_cudnn_attention; 2.11's cu130 wheels), as under 2.9, where the plan priced
# FlashAttention-2. (torch sets its default order at the first SDPA call; made inside this context,
# the process keeps flash first after it: no other model in a trainer's process.) cudnn
# puts it first; the others stay behind each as the fallback SDPA takes where a kernel cannot
# run (fp32, or a head dim it does not take), as without the context.
SDPA_BACKENDS = {
    "flash2": ("FLASH_ATTENTION", "EFFICIENT_ATTENTION", "MATH"),
    "cudnn": ("CUDNN_ATTENTION", "FLASH_ATTENTION", "EFFICIENT_ATTENTION", "MATH"),
    "math": ("MATH",),  # no plan's: tests count the attention matmuls (FlopCounterMode has no CPU flash formula)
}


def sdpa_backends(kernel: str) -> list:
    """The SDPBackend list for a plan's attention kernel (SDPA_BACKENDS); flash2's for a kernel
    the trainer does not run (plan.py refuses to train those; a fake trace of their memory,
    the same for every flash kernel, still builds the model)."""
    from torch.nn.attention import SDPBackend

    return [getattr(SDPBackend, name) for name in SDPA_BACKENDS.get(kernel, SDPA_BACKENDS["flash2"])]

ROPE_THETA = 500000.0
INIT_STD = 0.02


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Under autocast (ddp/zero1) the weight is the fp32 master. torch 2.13's CUDA autocast
        # runs rms_norm in fp32 (an AutocastCUDA kernel); torch 2.11 has none, so a bf16 q or k
        # meets the fp32 weight and rms_norm falls back to its composite (dtype mismatch: fp32
        # copy and fp32 output both saved, twice what qk_norm_inputs prices). Cast here, alike
        # on every version and device.
        if torch.is_autocast_enabled(x.device.type) and x.dtype != self.weight.dtype:
            x = x.to(self.weight.dtype)
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)


def _rope(seq: int, head_dim: int, device, dtype) -> tuple[torch.Tensor, torch.Tensor]:
    inv = 1.0 / (ROPE_THETA ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim))
    t = torch.arange(seq, device=device, dtype=torch.float32)
    freqs = torch.outer(t, inv)
    return freqs.cos().to(dtype), freqs.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (x[2i], x[2i+1]); x is (batch, seq, heads, head_dim), cos and sin are
    (seq, head_dim/2). Applied before the heads move to dim 1 (torchtitan's order), so the
    rotated q is (b, s, h, d) in memory: SDPA's flash kernels allocate their output like q
    (empty_like), and the output projection then reads it as a (b, s, h·d) view, no copy (as in
    HF's and torchtitan's attention)."""
    cos, sin = cos[:, None, :], sin[:, None, :]
    x1, x2 = x[..., 0::2], x[..., 1::2]
    out = torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)
    return out.flatten(-2)


class Attention(nn.Module):
    def __init__(self, m: ModelSpec):
        super().__init__()
        self.n_heads, self.n_kv, self.head_dim = m.num_heads, m.num_kv_heads, m.head_dim
        self.wq = nn.Linear(m.hidden, m.q_hidden, bias=m.qkv_bias)
        self.wk = nn.Linear(m.hidden, m.kv_hidden, bias=m.qkv_bias)
        self.wv = nn.Linear(m.hidden, m.kv_hidden, bias=m.qkv_bias)
        self.wo = nn.Linear(m.q_hidden, m.hidden, bias=m.linear_bias)
        # Qwen3's q_norm and k_norm: each head of q and k normalized before RoPE
        self.q_norm, self.k_norm = (RMSNorm(m.head_dim), RMSNorm(m.head_dim)) if m.qk_norm else (None, None)
        self.checkpoint_core = False  # Megatron-style selective recomputation of the core
        self.return_cache = False  # TrainSpec.kv_cache: also return the keys (after RoPE) and values
        self.expand_kv = False  # TrainSpec.attention_expands_kv: copy k and v to every query head
        self.backends = sdpa_backends("flash2")  # TrainSpec.attention_kernel (Transformer.attention_kernel)

    def core(self, q, k, v):
        from torch.nn.attention import sdpa_kernel

        with sdpa_kernel(self.backends, set_priority=True):
            if self.expand_kv and self.n_kv != self.n_heads:
                # Hugging Face's repeat_kv: each key/value head copied to the query heads sharing it,
                # in SDPA's grouping (query head i reads key/value head i // (heads / kv heads))
                k, v = (t.repeat_interleave(self.n_heads // self.n_kv, dim=1) for t in (k, v))
                return F.scaled_dot_product_attention(q, k, v, is_causal=True)
            return F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                                  enable_gqa=self.n_kv != self.n_heads)

    def forward(self, x: torch.Tensor):
        b, s, _ = x.shape
        q = self.wq(x).view(b, s, self.n_heads, self.head_dim)
        # under autocast the norm runs in fp32 (RMSNorm.forward): cast back, so RoPE and attention run in q's dtype
        if self.q_norm is not None:
            q = self.q_norm(q).to(q.dtype)
        k = self.wk(x).view(b, s, self.n_kv, self.head_dim)
        if self.k_norm is not None:
            k = self.k_norm(k).to(k.dtype)
        v = self.wv(x).view(b, s, self.n_kv, self.head_dim).transpose(1, 2)
        cos, sin = _rope(s, self.head_dim, x.device, q.dtype)
        q, k = apply_rope(q, cos, sin).transpose(1, 2), apply_rope(k, cos, sin).transpose(1, 2)
        if self.checkpoint_core and torch.is_grad_enabled():
            from torch.utils.checkpoint import checkpoint

            o = checkpoint(self.core, q, k, v, use_reentrant=False)
        else:
            o = self.core(q, k, v)
        out = self.wo(o.transpose(1, 2).reshape(b, s, -1))
        # Hugging Face's `past_key_value = (key_states, value_states)`: the RoPE output and a view
        # of the value projection's output (activation_memory.kv_cache_bytes)
        return (out, k, v) if self.return_cache else out


class FeedForward(nn.Module):
    def __init__(self, m: ModelSpec):
        super().__init__()
        self.swiglu = m.mlp == "swiglu"
        self.w1 = nn.Linear(m.hidden, m.ffn_hidden, bias=m.linear_bias)
        self.w2 = nn.Linear(m.ffn_hidden, m.hidden, bias=m.linear_bias)
        self.w3 = nn.Linear(m.hidden, m.ffn_hidden, bias=False) if self.swiglu else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.swiglu:
            return self.w2(F.silu(self.w1(x)) * self.w3(x))
        return self.w2(F.gelu(self.w1(x), approximate="tanh"))


class Block(nn.Module):
    def __init__(self, m: ModelSpec):
        super().__init__()
        self.attention_norm = RMSNorm(m.hidden)
        self.attention = Attention(m)
        self.ffn_norm = RMSNorm(m.hidden)
        self.feed_forward = FeedForward(m)

    def forward(self, x: torch.Tensor):
        """The block's output; with the attention's `return_cache`, (output, keys, values): the
        cache is the block's output, so a recomputation (checkpoint) discards its own."""
        a = self.attention(self.attention_norm(x))
        a, kv = (a[0], a[1:]) if isinstance(a, tuple) else (a, ())
        h = x + a
        del a  # freed at the add, as a temporary would be (the block's memory order: tests/test_forward_holes.py)
        h = h + self.feed_forward(self.ffn_norm(h))
        return (h, *kv) if kv else h


class Head(nn.Linear):
    """The output projection: an nn.Linear (same parameter, same state-dict name), called with
    the targets for TrainSpec.linear_loss "chunked": then it returns the mean cross-entropy,
    the logits computed chunk by chunk and never kept whole (linear_loss.py). Called as a module
    either way, so FSDP2's hooks on the head's unit (gather before, reshard after) still fire."""

    def forward(self, x: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        if targets is None:
            return super().forward(x)
        if self.bias is not None:
            raise ValueError("the chunked linear loss takes a head without bias")
        return chunked_linear_cross_entropy(x, self.weight, targets)


class Transformer(nn.Module):
    def __init__(self, m: ModelSpec):
        super().__init__()
        if m.num_experts or m.position != "rope" or m.norm != "rmsnorm":
            raise ValueError(f"the trainer builds RoPE/RMSNorm dense decoders; {m.name} is not one")
        self.spec = m
        self.tok_embeddings = nn.Embedding(m.vocab_size, m.hidden)
        self.layers = nn.ModuleList(Block(m) for _ in range(m.num_layers))
        self.norm = RMSNorm(m.hidden)
        self.output = Head(m.hidden, m.vocab_size, bias=False)
        if m.tied_embeddings:
            self.output.weight = self.tok_embeddings.weight
        self.cache_on = False  # return_cache

    def attention_kernel(self, kernel: str) -> None:
        """Run every layer's SDPA with the plan's kernel first (SDPA_BACKENDS): flash2 or cudnn."""
        for layer in self.layers:
            layer.attention.backends = sdpa_backends(kernel)

    def expand_kv(self, on: bool = True) -> None:
        """Copy keys and values to every query head before attention (TrainSpec.attention_expands_kv,
        Hugging Face's repeat_kv ahead of SDPA): the same result, the kernel keeping the copies."""
        for layer in self.layers:
            layer.attention.expand_kv = on

    def return_cache(self, on: bool = True) -> None:
        """Return every layer's keys and values with the logits (TrainSpec.kv_cache, Hugging
        Face's use_cache in training): forward then answers (logits, cache)."""
        for layer in self.layers:
            layer.attention.return_cache = on
        self.cache_on = on
        if on:  # the cache is views (RoPE's k transposed, v of the value projection), as Hugging
            # Face's are; FSDP2 warns about a unit returning a view on every forward of every rank
            import warnings

            warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor",
                                    category=UserWarning)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor | None = None):
        """The logits; with `targets`, the mean cross-entropy from the head's chunked linear
        loss instead (no logits kept); with return_cache, (that, the layers' (keys, values))."""
        h = self.tok_embeddings(tokens)
        cache = []
        for layer in self.layers:
            h = layer(h)
            if isinstance(h, tuple):
                h, kv = h[0], h[1:]
                cache.append(kv)
        out = self.output(self.norm(h)) if targets is None else self.output(self.norm(h), targets)
        return (out, cache) if self.cache_on else out


def param_seed(name: str, seed: int) -> int:
    return (zlib.crc32(name.encode()) + 1_000_003 * seed) % 2**63


INIT_BLOCK_ROWS = 256  # rows drawn from one seed: a rank makes only the blocks of its own rows


def init_rows(name: str, shape: torch.Size, seed: int, num_layers: int, start: int = 0,
              stop: int | None = None) -> torch.Tensor:
    """Rows [start, stop) of one parameter's initial value (fp32, CPU), from its name alone:
    drawn INIT_BLOCK_ROWS rows at a time, each block from a seed of its own, so that a rank
    draws only the blocks that hold its shard's rows (a 70B model's ranks each drew every
    parameter whole, minutes on one core) and the value is the same at every world size."""
    stop = shape[0] if stop is None else stop
    rows = (stop - start,) + tuple(shape[1:])
    if name.endswith("norm.weight"):
        return torch.ones(rows)
    if name.endswith(".bias"):
        return torch.zeros(rows)
    std = INIT_STD
    if name.endswith(("wo.weight", "w2.weight")):
        std = INIT_STD / math.sqrt(2 * num_layers)  # GPT-2's scaled residual projections
    out = torch.empty(rows)
    first, last = start // INIT_BLOCK_ROWS, -(-stop // INIT_BLOCK_ROWS)
    for b in range(first, last):
        lo, hi = b * INIT_BLOCK_ROWS, min((b + 1) * INIT_BLOCK_ROWS, shape[0])
        g = torch.Generator().manual_seed(param_seed(f"{name}#{b}", seed))
        block = torch.empty((hi - lo,) + tuple(shape[1:])).normal_(0.0, std, generator=g)
        a, z = max(lo, start), min(hi, stop)
        out[a - start:z - start] = block[a - lo:z - lo]
    return out


def full_init(name: str, shape: torch.Size, seed: int, num_layers: int) -> torch.Tensor:
    """The full initial value of one parameter, from its name alone (fp32, CPU)."""
    return init_rows(name, shape, seed, num_layers)


def local_rows(param) -> tuple[int, int]:
    """The rows of the full parameter this rank holds: FSDP2 shards dim 0 (Shard(0), padded
    chunks of ceil(rows / n)); Replicate keeps them all; a plain tensor is whole."""
    from torch.distributed.tensor import DTensor

    rows = param.shape[0] if param.dim() else 1
    if not isinstance(param, DTensor):
        return 0, rows
    start, stop = 0, rows
    coord = param.device_mesh.get_coordinate()
    for mesh_dim, placement in enumerate(param.placements):
        if placement.is_shard():
            if placement.dim != 0:
                raise ValueError(f"parameter sharded on dim {placement.dim}: the trainer shards dim 0")
            n = param.device_mesh.size(mesh_dim)
            chunk = -(-(stop - start) // n)
            lo = min(start + coord[mesh_dim] * chunk, stop)
            start, stop = lo, min(lo + chunk, stop)
    return start, stop


# Name components that wrappers insert (torch's checkpoint_wrapper, DDP, torch.compile): not
# part of the model's own parameter names.
WRAPPER_PARTS = ("_checkpoint_wrapped_module", "_fsdp_wrapped_module", "_orig_mod", "module")


def canonical_name(name: str) -> str:
    """A parameter's name in the plain model, whatever wraps its modules."""
    return ".".join(part for part in name.split(".") if part not in WRAPPER_PARTS)


@torch.no_grad()
def init_weights_(model: nn.Module, seed: int = 0) -> None:
    """Materialise every parameter from its plain name: each rank draws the rows it holds
    (init_rows), the same values at any world size and strategy."""
    layers = getattr(model, "spec", None).num_layers if hasattr(model, "spec") else 1
    for name, p in model.named_parameters():
        local = p.to_local() if hasattr(p, "to_local") else p
        if p.dim() == 0:  # a scalar: one row's value
            local.copy_(init_rows(canonical_name(name), torch.Size((1,)), seed, layers)[0].to(local.dtype))
            continue
        start, stop = local_rows(p)
        piece = init_rows(canonical_name(name), p.shape, seed, layers, start, stop)
        local[: stop - start].copy_(piece.to(local.dtype))  # FSDP2 pads the last shard
