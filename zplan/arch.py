"""What a model's architecture implies: parameter shapes, sharding units, activations and FLOPs.

Sources: parameter shapes follow the Hugging Face Llama / Mixtral / Qwen2 / GPT-2 modules;
activations follow Korthikanti et al. 2022 (Reducing Activation Recomputation in Large
Transformer Models, section 4.1), generalised to GQA, SwiGLU, flash attention and MoE;
FLOPs follow Chowdhery et al. 2022 (PaLM), appendix B. Derivations: docs/formulas.md.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property, lru_cache

from . import policy
from .specs import MAX_LAYERS, ModelSpec, TrainSpec
from .units import DTYPE_BITS

Shape = tuple[int, ...]


@dataclass(frozen=True)
class Unit:
    """One sharding unit: the parameters FSDP groups into one all-gather."""

    name: str
    shapes: tuple[Shape, ...]
    blocks: int  # transformer blocks inside (0 for embeddings / head)
    first_block: int  # global index of its first block (checkpoint placement)
    matmul_params: int  # weights that take part in a matmul per token (MoE: active experts only)
    held: bool = False  # gathered for the whole step (the root under FSDP2, e.g. tied embeddings)

    @cached_property
    def numel(self) -> int:
        return sum(math.prod(s) for s in self.shapes)


def _norm(m: ModelSpec) -> list[Shape]:
    return [(m.hidden,), (m.hidden,)] if m.norm == "layernorm" else [(m.hidden,)]


def _mlp(m: ModelSpec) -> list[Shape]:
    h, f = m.hidden, m.ffn_hidden
    if m.mlp == "swiglu":
        shapes: list[Shape] = [(f, h), (f, h), (h, f)]
    else:
        shapes = [(f, h), (h, f)]
    if m.linear_bias:
        shapes += [(f,), (h,)]
    return shapes


def block_shapes(m: ModelSpec) -> list[Shape]:
    """Parameter shapes of one transformer block, as torch Linear weights (out, in)."""
    h, kv = m.hidden, m.kv_hidden
    shapes: list[Shape] = _norm(m) + [(h, h), (kv, h), (kv, h), (h, h)]
    if m.qkv_bias:
        shapes += [(h,), (kv,), (kv,)]
    if m.linear_bias:
        shapes += [(h,)]
    shapes += _norm(m)
    if m.num_experts:
        shapes += [(m.num_experts, h)]  # router
        shapes += _mlp(m) * m.num_experts
    else:
        shapes += _mlp(m)
    return shapes


def _block_matmul_params(m: ModelSpec) -> int:
    h, kv, f = m.hidden, m.kv_hidden, m.ffn_hidden
    attn = 2 * h * h + 2 * kv * h
    mlp = (3 if m.mlp == "swiglu" else 2) * h * f
    if m.num_experts:
        return attn + m.num_experts * h + m.experts_per_token * mlp
    return attn + mlp


def embed_shapes(m: ModelSpec) -> list[Shape]:
    shapes: list[Shape] = [(m.vocab_size, m.hidden)]
    if m.position == "learned":
        shapes.append((m.max_seq_len, m.hidden))
    return shapes


def head_shapes(m: ModelSpec) -> list[Shape]:
    return _norm(m) + ([] if m.tied_embeddings else [(m.vocab_size, m.hidden)])


def param_count(m: ModelSpec) -> int:
    """Total parameters, derived from the architecture (or the bare count of a synthetic model)."""
    if m.total_params is not None:
        return m.total_params
    per = lambda shapes: sum(math.prod(s) for s in shapes)  # noqa: E731
    return per(embed_shapes(m)) + m.num_layers * per(block_shapes(m)) + per(head_shapes(m))


@lru_cache(maxsize=256)
def units(m: ModelSpec, blocks_per_unit: int = 1) -> tuple[Unit, ...]:
    """Embeddings, blocks grouped `blocks_per_unit` at a time, then norm + head (torchtitan's order).

    Tied embeddings share one weight between the first and the last module, so both sit in one
    unit that stays gathered for the whole step (FSDP2's root). A synthetic model (bare --params)
    is `num_layers` flat units of equal size.
    """
    L = m.num_layers
    groups = [len(g) for g in policy.block_groups(L, blocks_per_unit)]  # as the trainer groups them
    if m.total_params is not None:
        per_block, rem = divmod(m.total_params, L)
        out, done = [], 0
        for i, g in enumerate(groups):
            n = per_block * g + sum(1 for j in range(done, done + g) if j < rem)
            name = f"blocks.{done}" if g == 1 else f"blocks.{done}-{done + g - 1}"
            out.append(Unit(name, ((n,),), g, done, n))
            done += g
        return tuple(out)
    bs = tuple(block_shapes(m))
    bmm = _block_matmul_params(m)
    blocks = []
    done = 0
    for g in groups:
        name = f"blocks.{done}" if g == 1 else f"blocks.{done}-{done + g - 1}"
        blocks.append(Unit(name, bs * g, g, done, bmm * g))
        done += g
    head_mm = m.vocab_size * m.hidden
    if not policy.separate_embed_head(m.tied_embeddings):
        root = Unit("embed+head", tuple(embed_shapes(m) + head_shapes(m)), 0, 0, head_mm, held=True)
        return tuple([root] + blocks)
    return tuple([Unit("embed", tuple(embed_shapes(m)), 0, 0, 0)] + blocks + [
        Unit("norm+head", tuple(head_shapes(m)), 0, L, head_mm)
    ])


def synthetic(params: int, unit_params: int | None = None) -> ModelSpec:
    """A stand-in decoder for a bare parameter count (an assumption, printed as such).

    Depth from Ψ ≈ 12·L·h² with the aspect ratio h/L = 128 (Kaplan et al. 2020 found the loss
    flat for h/L between about 50 and 200); hidden rounded to a multiple of 128, heads of 128.
    With `unit_params` the depth is ⌈Ψ / unit_params⌉ instead (one block per unit). Depth is
    capped at specs.MAX_LAYERS (256, reached near Ψ = 3.3e12); beyond it the model gets wider.
    """
    if unit_params:
        L = max(1, -(-params // unit_params))
    else:
        L = min(MAX_LAYERS, max(1, round((params / (12 * 128**2)) ** (1 / 3))))
    h = max(128, round(math.sqrt(params / (12 * L)) / 128) * 128)
    return ModelSpec(
        name=f"{params:.3g}-params",
        num_layers=L,
        hidden=h,
        ffn_hidden=4 * h,
        num_heads=h // 128,
        num_kv_heads=h // 128,
        vocab_size=32000,
        mlp="gelu",
        total_params=params,
        source="synthesized from --params (depth and width are assumptions; pass --model for exact figures)",
    )


# ---------------------------------------------------------------- activations

def act_dtype_bytes(train: TrainSpec) -> int:
    """Bytes per activation element: activations are kept in the param dtype."""
    return DTYPE_BITS[train.precision.param] // 8


def block_mode(train: TrainSpec, index: int, num_layers: int) -> str:
    """The recomputation mode of block `index` (every-k: the blocks policy.checkpointed_blocks
    wraps are fully checkpointed, the others keep everything)."""
    if train.checkpointing == "every-k":
        wrapped = policy.checkpointed_blocks(num_layers, "every-k", train.checkpoint_every)
        return "full" if wrapped[index] else "none"
    return train.checkpointing


def block_backward_temp_bytes(m: ModelSpec, train: TrainSpec) -> int:
    """Gradients of activations alive at once inside one block's backward, at its largest: in
    the MLP, the gradient of the down projection's input and the two it splits into (SwiGLU's
    gate and up branches; GELU: one), with the residual stream's gradient."""
    B, sb = act_dtype_bytes(train), train.seq_len * train.micro_batch
    k = m.experts_per_token if m.num_experts else 1
    branches = 3 if m.mlp == "swiglu" else 2
    return k * branches * B * sb * m.ffn_hidden + B * sb * m.hidden


def head_saved_bytes(m: ModelSpec, train: TrainSpec) -> int:
    """The final norm keeps what a block's norm keeps; the head keeps the norm's output."""
    B, sbh = act_dtype_bytes(train), train.seq_len * train.micro_batch * m.hidden
    return norm_saved_per_token(train, B) * sbh + B * sbh


def norm_saved_per_token(train: TrainSpec, B: int) -> int:
    """Bytes per element a norm keeps besides its statistics: its input (fused kernel), or the
    fp32 upcast input and the fp32 normalized output (the composite implementation F.rms_norm
    falls back to on CPU, as torch 2.13's saved tensors show)."""
    return B if train.fused_norm else 8


def block_activation_terms(m: ModelSpec, train: TrainSpec) -> dict[str, int]:
    """Bytes one block saves for backward with no recomputation, term by term.

    With `train.compile` (torch.compile per block) the saved set is what AOTAutograd's min-cut
    partitioner (torch/_functorch/partitioners.py, min_cut_rematerialization_partition, which
    inductor uses) keeps: cheap pointwise results are recomputed in backward.

    Korthikanti et al. 2022 eq. (1) gives sbh(34 + 5as/h) for a GPT block (MHA, GELU, f = 4h,
    dropout, 16-bit); these terms reduce to exactly that and generalise it.
    """
    s, b, h, f, a = train.seq_len, train.micro_batch, m.hidden, m.ffn_hidden, m.num_heads
    kv, B = m.kv_hidden, act_dtype_bytes(train)
    sb = s * b
    stats = 8 * sb if m.norm == "layernorm" else 4 * sb  # fp32 mean/rstd saved by each norm
    t: dict[str, int] = {
        # torch.compile (each block compiled) fuses the norm as a fused kernel would
        "norm_inputs": 2 * ((B if train.compile else norm_saved_per_token(train, B)) * sb * h + stats),
        "qkv_input": B * sb * h,
        "q_k_v": B * sb * (h + 2 * kv),
        "attn_out_proj_input": B * sb * h,
        "mlp_input": B * sb * h,
    }
    if train.flash_attention:
        # the flash kernel saves its output and logsumexp; the output projection's input is a
        # separate contiguous copy (transpose + reshape), and RoPE's mul saves cos and sin
        t["attn_logsumexp"] = 4 * a * sb
        t["attn_output"] = B * sb * h
        if not train.compile:  # compiled, the tables are recomputed in backward
            t["rope_tables"] = B * s * m.head_dim
    else:
        t["attn_softmax"] = B * a * s * sb
        if m.dropout:
            t["attn_dropout"] = (1 + B) * a * s * sb
    if m.dropout:
        t["residual_dropout_masks"] = 2 * sb * h
    # SwiGLU keeps w1's and w3's outputs, silu(w1) and their product; compiled, AOTAutograd's
    # min-cut partitioner recomputes silu(w1) in backward (3 kept). GELU: its input and output.
    per_mlp = (2 if m.mlp == "gelu" else 3 if train.compile else 4) * B * sb * f
    if m.num_experts:
        k = m.experts_per_token
        t["router_logits"] = 4 * sb * m.num_experts
        t["expert_inputs"] = k * B * sb * h
        t["mlp_hidden"] = k * per_mlp
    else:
        t["mlp_hidden"] = per_mlp
    return t


def _matmul_widths(m: ModelSpec, names) -> list[int]:
    """Output width per token of each named block matmul (MoE: the k active experts' share)."""
    h, kv, f = m.hidden, m.kv_hidden, m.ffn_hidden
    k = m.experts_per_token if m.num_experts else 1
    width = {"wq": h, "wk": kv, "wv": kv, "wo": h, "w1": k * f, "w3": k * f, "w2": k * h}
    return [width[n] for n in names]


def _matmul_params(m: ModelSpec, names) -> int:
    """Weights of the named block matmuls that one token meets (MoE: k active experts)."""
    h, kv, f = m.hidden, m.kv_hidden, m.ffn_hidden
    k = m.experts_per_token if m.num_experts else 1
    size = {"wq": h * h, "wk": kv * h, "wv": kv * h, "wo": h * h, "w1": k * h * f,
            "w3": k * h * f, "w2": k * h * f}
    return sum(size[n] for n in names)


@lru_cache(maxsize=4096)
def block_saved_bytes(m: ModelSpec, train: TrainSpec, mode: str) -> int:
    """What one block keeps between forward and backward under a recomputation mode."""
    h, f = m.hidden, m.ffn_hidden
    B, sb = act_dtype_bytes(train), train.seq_len * train.micro_batch
    full = block_activation_terms(m, train)
    if mode == "none":
        return sum(full.values())
    if mode == "full":
        return B * sb * h  # the block's input only
    if mode == "attention":  # Megatron's selective: the attention core is recomputed
        return sum(v for k, v in full.items() if k not in ("attn_softmax", "attn_dropout"))
    if mode == "selective":
        # torchtitan op-level SAC (zplan/policy.py): the block's input, the outputs of the saved
        # matmuls and of the attention kernel; pointwise ops are recomputed.
        saved = B * sb * h + sum(B * sb * w for w in _matmul_widths(m, policy.selective_saved_matmuls(m.mlp)))
        if policy.SELECTIVE_SAVES_ATTENTION:
            saved += B * sb * h + (4 * m.num_heads * sb if train.flash_attention else 0)
        return saved
    raise ValueError(mode)


def loss_bytes_per_logit(train: TrainSpec, loss_fp32: bool = True) -> dict[str, int]:
    """Bytes per logit alive in the loss, eager as the trainer computes it,
    `F.cross_entropy(logits.float().view(-1, V), y)` (zplan/trainer/loop.py), or compiled.

    Eager, forward: the logits (param dtype), their fp32 copy (`.float()`, none when they are
    fp32 already or not upcast) and log_softmax's output. Backward: the logits (still
    referenced), log_softmax's saved output, nll_loss's gradient (vocabulary-sized) and
    log_softmax's input gradient, alive together inside log_softmax_backward: 2 + 4 + 4 + 4 = 14 B
    for bf16 logits upcast (what PyTorch's FSDPMemTracker shows), 2 + 2 + 2 + 2 = 8 B in bf16.

    Compiled (`train.compile_loss`): inductor's forward is row reductions only (max and
    log-sum-exp, per row) and keeps the logits for backward; its backward writes the logits'
    gradient in their dtype in one kernel (the upcast fused, the NLL scatter turned pointwise):
    B forward, 2B backward, whether or not the source upcasts (the code inductor generates for
    `F.cross_entropy(pred.float(), y)`, torch 2.13, shown by TORCH_LOGS=output_code;
    docs/formulas.md section 3)."""
    B = act_dtype_bytes(train)
    if train.compile_loss:
        return {"forward": B, "backward": 2 * B}
    L = 4 if loss_fp32 else B
    upcast = 4 if loss_fp32 and B != 4 else 0
    return {"forward": B + upcast + L, "backward": B + 3 * L}


def logits_bytes(m: ModelSpec, train: TrainSpec, loss_fp32: bool = True) -> int:
    """Peak bytes of the loss over the logits: the larger of its forward and its backward."""
    sbv = train.seq_len * train.micro_batch * m.vocab_size
    return sbv * max(loss_bytes_per_logit(train, loss_fp32).values())


@lru_cache(maxsize=4096)
def activation_breakdown(m: ModelSpec, train: TrainSpec, loss_fp32: bool = True) -> dict[str, int]:
    """Activation bytes per GPU for one micro-batch (data parallelism does not shard them): what
    the blocks and the head keep, and the larger of the loss and one block's recomputation. The
    step's peak combines these with the other pieces event by event (memory_timeline)."""
    L = m.num_layers
    none_b = block_saved_bytes(m, train, "none")
    per = [block_saved_bytes(m, train, block_mode(train, i, L)) for i in range(L)]
    saved = sum(per)
    recompute = max(none_b - p for p in per)
    head = head_saved_bytes(m, train)
    lg = logits_bytes(m, train, loss_fp32)
    return {
        "blocks_saved": saved,
        "head_inputs": head,
        "loss_or_recompute": max(lg, recompute),
        "total": saved + head + max(lg, recompute),
    }


# ---------------------------------------------------------------- FLOPs

def unit_forward_flop(m: ModelSpec, u: Unit, train: TrainSpec) -> int:
    """Forward FLOPs of one unit for one micro-batch: 2 per matmul weight per token, plus
    attention's QK^T and AV, 4·s·h per token per layer (PaLM appendix B; causal masking not
    subtracted, as PaLM's MFU does)."""
    T = train.seq_len * train.micro_batch
    return 2 * u.matmul_params * T + u.blocks * 4 * train.seq_len * m.hidden * T


def unit_recompute_flop(m: ModelSpec, u: Unit, train: TrainSpec) -> int:
    """Extra forward work that activation checkpointing adds in backward."""
    mode, T = train.checkpointing, train.seq_len * train.micro_batch
    if u.blocks == 0 or mode == "none":
        return 0
    fwd = unit_forward_flop(m, u, train)
    if mode == "full":
        return fwd
    if mode == "every-k":
        wrapped = policy.checkpointed_blocks(m.num_layers, mode, train.checkpoint_every)
        n_ckpt = sum(wrapped[u.first_block: u.first_block + u.blocks])
        return fwd * n_ckpt // u.blocks
    if mode == "attention":
        return 0 if train.flash_attention else u.blocks * 4 * train.seq_len * m.hidden * T
    # selective: the matmuls whose outputs are not kept run again (zplan/policy.py)
    return 2 * _matmul_params(m, policy.selective_recomputed_matmuls(m.mlp)) * T * u.blocks


def model_flop_per_token(m: ModelSpec, seq_len: int) -> int:
    """6·N_matmul + 12·L·h·s per token: the MFU numerator (PaLM appendix B)."""
    mm = m.num_layers * _block_matmul_params(m) + m.vocab_size * m.hidden
    if m.total_params is not None:
        mm = m.total_params
    return 6 * mm + 12 * m.num_layers * m.hidden * seq_len
