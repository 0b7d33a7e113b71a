"""What a model's architecture implies: parameter shapes, sharding units and FLOPs (the bytes
of activations are zplan/activation_memory.py).

Sources: parameter shapes follow the Hugging Face Llama / Mixtral / Qwen2 / GPT-2 modules (an MoE
block's routed experts as the runner of each layout stores them: expert_shapes);
FLOPs follow Chowdhery et al. 2022 (PaLM), appendix B. Derivations: docs/formulas.md.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property, lru_cache

from . import policy
from .specs import MAX_LAYERS, ModelSpec, TrainSpec
from .units import ceil_div, fmt_count

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

    @cached_property
    def dim0_shards(self) -> dict[tuple[int, int], int]:
        """Scenario.shard_elems' FSDP2 answers by (degree, world), kept with the unit: hashing an
        MoE unit's thousands of shapes on every call cost recommend a quarter of its time."""
        return {}


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


def expert_shapes(m: ModelSpec, layout: str = "zero") -> list[Shape]:
    """An MoE block's routed experts: one 3-D tensor per weight, the experts on dim 0, as the
    runners of 2026 store them (the same elements as `num_experts` dense MLPs).
    zero layout (DeepSpeed under the HF Trainer or accelerate): transformers 5.x's experts
    module (Qwen3MoeExperts, MixtralExperts): gate_up_proj (E, 2F, H), down_proj (E, H, F).
    torch layout (FSDP2, DDP): torchtitan's GroupedExperts (models/common/moe.py at b36e4b6),
    w1 (E, F, H), w2 (E, H, F), w3 (E, F, H); FSDP2 shards them by fsdp_shard_elems."""
    E, h, f = m.num_experts, m.hidden, m.ffn_hidden
    if m.mlp != "swiglu":
        shapes: list[Shape] = [(E, f, h), (E, h, f)]
    elif layout == "zero":
        shapes = [(E, 2 * f, h), (E, h, f)]
    else:
        shapes = [(E, f, h), (E, h, f), (E, f, h)]
    if m.linear_bias:
        shapes += [(E, f), (E, h)]
    return shapes


def fsdp_shard_elems(shape: Shape, degree: int, world: int | None = None) -> int:
    """Elements one rank holds of one parameter under FSDP2 (torch layout) at this shard degree:
    dim 0 split and padded to a multiple of the degree (FSDPParam._init_sharded_param: torch.chunk,
    its first chunk's size; torch 2.13 _fsdp_param.py); a 3-D expert weight on more ranks than
    experts on dim 1 instead, torchtitan's shard_placement_fn Shard(1) "to avoid padding"
    (torchtitan/distributed/fsdp.py at b36e4b6: efsdp size > num_experts), where FSDP2 requires
    dim 1 to divide evenly. torchtitan compares the whole data-parallel mesh (`world`: under HSDP
    replicas x shard, dp_mesh.size()) with the expert count and splits over the shard group
    (`degree`); `world` defaults to the degree (FSDP over every rank)."""
    if len(shape) == 3 and shape[0] < (world or degree):
        return shape[0] * ceil_div(shape[1], degree) * shape[2]
    rest = 1
    for d in shape[1:]:
        rest *= d
    return ceil_div(shape[0], degree) * rest


def block_shapes(m: ModelSpec, layout: str = "zero") -> list[Shape]:
    """Parameter shapes of one transformer block, as torch Linear weights (out, in); an MoE
    block's experts as `layout`'s runner stores them (expert_shapes)."""
    h, q, kv = m.hidden, m.q_hidden, m.kv_hidden
    if m.qkv_fused:  # one q/k/v weight (MPT's Wqkv): the same elements in one tensor
        shapes: list[Shape] = _norm(m) + [(q + 2 * kv, h), (h, q)]
        shapes += [(q + 2 * kv,)] if m.qkv_bias else []
    else:
        shapes = _norm(m) + [(q, h), (kv, h), (kv, h), (h, q)]
        shapes += [(q,), (kv,), (kv,)] if m.qkv_bias else []
    if m.linear_bias:
        shapes += [(h,)]
    if m.qk_norm:  # q_norm, k_norm: one weight of head_dim each, shared by the heads
        shapes += [(m.head_dim,), (m.head_dim,)]
    shapes += _norm(m)
    if m.num_experts:
        shapes += [(m.num_experts, h)]  # router
        shapes += expert_shapes(m, layout)
    else:
        shapes += _mlp(m)
    return shapes


@lru_cache(maxsize=256)
def block_modules(m: ModelSpec, layout: str = "zero") -> tuple[tuple[Shape, ...], ...]:
    """block_shapes grouped by the module that holds them, in forward order: a Linear with its
    bias, a LayerNorm with its bias, an MoE block's experts module with all its tensors. What
    DeepSpeed's ZeRO-3 fetches in one call each (comm.ds_coordination)."""
    h, q, kv = m.hidden, m.q_hidden, m.kv_hidden
    mods: list[tuple[Shape, ...]] = [tuple(_norm(m))]
    if m.qkv_fused:
        mods.append(((q + 2 * kv, h),) + (((q + 2 * kv,),) if m.qkv_bias else ()))
    else:
        qkv = [((o, h),) + (((o,),) if m.qkv_bias else ()) for o in (q, kv, kv)]
        if m.qk_norm:  # q_norm right after q_proj, k_norm after k_proj (Qwen3's forward)
            qkv[1:1] = [((m.head_dim,),)]
            qkv[3:3] = [((m.head_dim,),)]
        mods += qkv
    mods.append(((h, q),) + (((h,),) if m.linear_bias else ()))
    mods.append(tuple(_norm(m)))
    if m.num_experts:
        return tuple(mods + [((m.num_experts, h),), tuple(expert_shapes(m, layout))])
    f = m.ffn_hidden
    bias: tuple[tuple[Shape, ...], ...] = (((f,),), (), ((h,),)) if m.linear_bias else ((), (), ())
    if m.mlp == "swiglu":  # _mlp's two biases on the gate and down projections
        return tuple(mods + [((f, h),) + bias[0], ((f, h),) + bias[1], ((h, f),) + bias[2]])
    return tuple(mods + [((f, h),) + bias[0], ((h, f),) + bias[2]])


def _blockmatmul_params(m: ModelSpec) -> int:
    h, q, kv, f = m.hidden, m.q_hidden, m.kv_hidden, m.ffn_hidden
    attn = 2 * q * h + 2 * kv * h
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
def units(m: ModelSpec, blocks_per_unit: int = 1, embed_head_unit: str = "separate",
          layout: str = "zero") -> tuple[Unit, ...]:
    """Embeddings, blocks grouped `blocks_per_unit` at a time, then norm + head (torchtitan's
    order), FSDP's units in forward order; a held root (below) first.

    Tied embeddings share one weight between the first and the last module, so both sit in one
    held unit, FSDP's root; `embed_head_unit` root or root-kept puts them there untied too, and
    head-root-kept norm + head alone, after the embeddings' unit (policy.embed_unit,
    policy.head_unit, policy.root_reshards). The held root comes first: FSDP gathers it at its
    pre-forward, before any other unit's. A synthetic model (bare --params)
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
    bs = tuple(block_shapes(m, layout))
    bmm = _blockmatmul_params(m)
    blocks = []
    done = 0
    for g in groups:
        name = f"blocks.{done}" if g == 1 else f"blocks.{done}-{done + g - 1}"
        blocks.append(Unit(name, bs * g, g, done, bmm * g))
        done += g
    head_mm = m.vocab_size * m.hidden
    embed = [Unit("embed", tuple(embed_shapes(m)), 0, 0, 0)] if policy.embed_unit(m.tied_embeddings, embed_head_unit) else []
    if not policy.head_unit(m.tied_embeddings, embed_head_unit):
        # the root, first in forward order (FSDP gathers it at its pre-forward), last in backward
        name, shapes = ("norm+head", head_shapes(m)) if embed else ("embed+head", embed_shapes(m) + head_shapes(m))
        return tuple([Unit(name, tuple(shapes), 0, 0, head_mm, held=True)] + embed + blocks)
    return tuple(embed + blocks + [Unit("norm+head", tuple(head_shapes(m)), 0, L, head_mm)])


# the smallest decoder synthetic() can build, one block of width 128 (12 h^2) with its 32,000-token
# embedding and head: no stand-in holds fewer parameters, so a smaller count describes none. (Above
# it the stand-in still outgrows small counts: its embedding is not taken off the count, 4.5x at 1e7,
# 1.7x at 1e8, 1.1x at 1e9; the count itself is what the state is priced from.)
SYNTHETIC_MIN_PARAMS = 12 * 128**2 + 2 * 32000 * 128


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
        name=f"{fmt_count(params)}-params",  # 70B-params, 1.5T-params
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


def matmul_widths(m: ModelSpec, names) -> list[int]:
    """Output width per token of each named block matmul (MoE: the k active experts' share)."""
    h, q, kv, f = m.hidden, m.q_hidden, m.kv_hidden, m.ffn_hidden
    k = m.experts_per_token if m.num_experts else 1
    width = {"wq": q, "wk": kv, "wv": kv, "wqkv": q + 2 * kv, "wo": h, "w1": k * f, "w3": k * f, "w2": k * h}
    return [width[n] for n in names]


def matmul_params(m: ModelSpec, names) -> int:
    """Weights of the named block matmuls that one token meets (MoE: k active experts)."""
    h, q, kv, f = m.hidden, m.q_hidden, m.kv_hidden, m.ffn_hidden
    k = m.experts_per_token if m.num_experts else 1
    size = {"wq": q * h, "wk": kv * h, "wv": kv * h, "wqkv": (q + 2 * kv) * h, "wo": h * q,
            "w1": k * h * f, "w3": k * h * f, "w2": k * h * f}
    return sum(size[n] for n in names)



# ---------------------------------------------------------------- FLOPs

def unit_forward_flop(m: ModelSpec, u: Unit, train: TrainSpec) -> int:
    """Forward FLOPs of one unit for one micro-batch: 2 per matmul weight per token, plus
    attention's QK^T and AV, 4·s·q per token per layer, q = heads x head_dim (h unless the
    heads are set wider; PaLM appendix B; causal masking not subtracted, as PaLM's MFU does)."""
    T = train.seq_len * train.micro_batch
    return 2 * u.matmul_params * T + u.blocks * 4 * train.seq_len * m.q_hidden * T


def unit_recompute_flop(m: ModelSpec, u: Unit, train: TrainSpec) -> int:
    """Extra forward work that activation checkpointing adds in backward: the matmuls
    policy.recomputed_matmuls names (early stop: not a dense block's last; torch.utils.checkpoint,
    pytorch/pytorch#96866), the router, and attention's 4·s·h per token where the block reruns it
    (full, every-k, first-k, and selective where its save list misses the attention kernel;
    PaLM appendix B counting). Checked with FlopCounterMode (tests/test_policy.py)."""
    mode, T = train.checkpointing, train.seq_len * train.micro_batch
    if u.blocks == 0 or mode == "none":
        return 0
    if mode == "attention":
        return 0 if train.flash_attention else u.blocks * 4 * train.seq_len * m.q_hidden * T
    # the matmuls not kept run again (zplan/policy.py recomputed_matmuls); full and every-k rerun
    # attention (its output feeds wo), selective keeps it
    names = policy.recomputed_matmuls(m.mlp, mode, policy.early_stop_applies(train), bool(m.num_experts),
                                      m.qkv_fused)
    router_params = m.num_experts * m.hidden if m.num_experts else 0
    # the unit's own matmul weights per block (a bare --params count sizes them, not the
    # stand-in widths), the rerun share by the block's matmul widths
    block_mm = u.matmul_params // u.blocks - router_params
    per_block = 2 * (block_mm * matmul_params(m, names) // matmul_params(m, policy.BLOCK_MATMULS[m.mlp])) * T
    if mode == "selective":  # torchtitan's policy recomputes the router (policy.selective_saved_matmuls),
        # and the attention forward where its save list misses the kernel (sac_saves_attention)
        attention = 0 if train.sac_saves_attention else 4 * train.seq_len * m.q_hidden * T
        return (per_block + 2 * router_params * T + attention) * u.blocks
    per_block += 2 * router_params * T + 4 * train.seq_len * m.q_hidden * T
    if mode == "full":
        return per_block * u.blocks
    wrapped = policy.wrapped_blocks(train, m.num_layers)  # every-k, first-k
    return per_block * sum(wrapped[u.first_block: u.first_block + u.blocks])


def model_flop_per_token(m: ModelSpec, seq_len: int) -> int:
    """6·N_matmul + 12·L·q·s per token, q = heads x head_dim: the MFU numerator (PaLM appendix B)."""
    mm = m.num_layers * _blockmatmul_params(m) + m.vocab_size * m.hidden
    if m.total_params is not None:
        mm = m.total_params
    return 6 * mm + 12 * m.num_layers * m.q_hidden * seq_len
