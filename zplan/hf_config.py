"""A Hugging Face config.json read as ModelSpec fields (--model path/config.json).

Only model types whose block zplan models are read (BLOCKS), each with the defaults its
transformers config class takes for a field the file leaves out (tied embeddings, head_dim);
any other type, and any field that describes a block zplan does not model (latent attention,
shared experts, dense layers among MoE ones, q/k layer norms), is refused in one line naming
it. Held against transformers' own model built from each file on the meta device: the
parameter count, exactly (tests/test_hf_configs.py).

The file is data from anywhere: its top level must be an object, each field used must have the
type Hugging Face writes (sizes are whole numbers, flags booleans, names strings); the sizes'
ranges are ModelSpec's.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from .errors import UsageError


@dataclass(frozen=True)
class Block:
    """What a model type's block is, as zplan's ModelSpec says it, and its config class's
    defaults (transformers 5.24, models/<type>/configuration_<type>.py)."""
    tied: bool = False  # tie_word_embeddings' default
    gated: bool = True  # gate, up, down (SwiGLU's shapes, whatever the activation); else up, down
    norm: str = "rmsnorm"
    position: str = "rope"
    biases: bool = False  # every linear and norm carries a bias (GPT-2 style)
    qkv_bias: bool = False
    qkv_fused: bool = False
    qk_norm: bool = False
    head_dim: int = 0  # head_dim's default where the file has none (0: hidden / heads)
    experts_moe_size: bool = False  # experts sized by moe_intermediate_size
    # num_key_value_heads left out means as many as the heads (Llama's, Granite's default); where
    # the config class defaults to a number of its own, the file must say
    kv_heads_default_heads: bool = False
    heads_only: bool = False  # the block reads no num_key_value_heads or head_dim (GPT-2, GPT-NeoX)
    # attention_bias: "q/k/v/o" (true adds a bias to q, k, v and the output projection: not a
    # block zplan models), "ignored" (the block does not read it), "kept" (false drops biases
    # zplan's block keeps)
    attention_bias: str = "q/k/v/o"
    max_positions_default: int = 4096
    moe: bool = False  # the config class reads num_local_experts / num_experts (a dense one ignores them)


BLOCKS: dict[str, Block] = {
    "llama": Block(kv_heads_default_heads=True), "granite": Block(kv_heads_default_heads=True),
    "granitemoe": Block(kv_heads_default_heads=True, moe=True),
    "mistral": Block(attention_bias="ignored"), "mixtral": Block(attention_bias="ignored", moe=True),
    "smollm3": Block(tied=True),
    "qwen2": Block(qkv_bias=True, attention_bias="ignored"),
    "qwen3": Block(qk_norm=True, head_dim=128),
    "qwen3_moe": Block(qk_norm=True, experts_moe_size=True, moe=True),
    "gemma": Block(tied=True, head_dim=256),  # gated GELU
    "phi3": Block(qkv_fused=True, attention_bias="ignored", kv_heads_default_heads=True),
    "gpt2": Block(tied=True, gated=False, norm="layernorm", position="learned", biases=True, qkv_fused=True,
                  heads_only=True, attention_bias="ignored", max_positions_default=1024),
    "gpt_neox": Block(gated=False, norm="layernorm", biases=True, qkv_fused=True, heads_only=True,
                      attention_bias="kept"),
}


def to_model_fields(cfg: object, path: Path) -> dict:
    """ModelSpec fields for a config.json whose model_type zplan reads (BLOCKS)."""
    if not isinstance(cfg, dict):
        raise UsageError(f"model config {path}: the top level is a JSON {_json_type(cfg)}, not an "
                         f"object; pass a Hugging Face config.json")

    def typed(key: str, types: tuple[type, ...], what: str):
        v = cfg.get(key)
        if v is None:
            return None
        if isinstance(v, bool) and bool not in types or not isinstance(v, types):
            shown = " ".join(repr(v).split())[:60]
            raise UsageError(f"model config {path}: field '{key}' is {shown}, not {what}; fix the file")
        return v

    def get(*keys: str, default: int | None = None) -> int:
        for k in keys:
            v = typed(k, (int,), "a whole number")
            if v is not None:
                return v
        if default is None:
            raise UsageError(f"model config {path}: field '{keys[0]}' is missing; add it to the config")
        return default

    def text(key: str, default: str = "") -> str:
        v = typed(key, (str,), "a string")
        return default if v is None else v

    def flag(key: str, default: bool) -> bool:
        v = typed(key, (bool,), "true or false")
        return default if v is None else v

    model_type = text("model_type")
    fix = "write a model .toml (presets/models/) for the closest block zplan models"
    block = BLOCKS.get(model_type)
    if block is None:
        shown = " ".join(model_type.split())[:40] or "(none)"
        raise UsageError(f"model config {path}: model_type '{shown}' is not one zplan reads "
                         f"({', '.join(sorted(BLOCKS))}); {fix}")
    _refuse_unmodelled_fields(cfg, path, get, flag, fix)
    if block.attention_bias == "q/k/v/o" and flag("attention_bias", False):
        raise UsageError(f"model config {path}: field 'attention_bias' is true: {model_type} then biases "
                         f"q, k, v and the output projection, which zplan's block does not model; {fix}")
    if block.attention_bias == "kept" and not flag("attention_bias", True):
        raise UsageError(f"model config {path}: field 'attention_bias' is false: {model_type}'s "
                         f"projections without biases are not modelled; {fix}")
    hidden = get("hidden_size", "n_embd")
    heads = get("num_attention_heads", "n_head")
    # a dense model type's config class does not read the MoE keys (transformers builds the dense
    # model whatever the file carries): stray ones priced Llama 3.1 8B as 47.5B of experts
    num_experts = get("num_local_experts", "num_experts", default=0) if block.moe else 0
    head_dim = 0 if block.heads_only else get("head_dim", default=block.head_dim)
    if block.heads_only:
        kv_heads = heads
    else:
        kv_heads = get("num_key_value_heads", default=heads if block.kv_heads_default_heads else None)
    name = " ".join(text("_name_or_path").split())[-128:] or path.parent.name[-128:] or "hf-model"
    return {
        "name": "".join(c for c in name if c.isprintable()) or "hf-model",
        "num_layers": get("num_hidden_layers", "n_layer"),
        "hidden": hidden,
        "ffn_hidden": (get("moe_intermediate_size") if num_experts and block.experts_moe_size
                       else get("n_inner", default=4 * hidden) if model_type == "gpt2"
                       else get("intermediate_size")),
        "num_heads": heads,
        "num_kv_heads": kv_heads,
        "vocab_size": get("vocab_size"),
        "tied_embeddings": flag("tie_word_embeddings", block.tied),
        "mlp": "swiglu" if block.gated else "gelu",
        "norm": block.norm,
        "position": block.position,
        "max_seq_len": get("max_position_embeddings", "n_positions", default=block.max_positions_default),
        "linear_bias": block.biases,
        "qkv_bias": block.biases or block.qkv_bias,
        "qkv_fused": block.qkv_fused,
        "qk_norm": block.qk_norm,
        "num_experts": num_experts,
        # heads wider or narrower than hidden / heads (Qwen3-32B, Gemma 7B, Mistral NeMo)
        "attention_head_dim": head_dim if head_dim and head_dim * heads != hidden else None,
        "experts_per_token": get("num_experts_per_tok", default=0) if num_experts else 0,
        "source": f"Hugging Face config.json at {str(path)[-1000:]}",
    }


def _refuse_unmodelled_fields(cfg: dict, path: Path, get, flag, fix: str) -> None:
    """One line, naming the field, where a config of a type zplan reads describes a block its
    ModelSpec cannot express (its parameter count would come out wrong without a word)."""
    if "kv_lora_rank" in cfg or "q_lora_rank" in cfg:
        raise UsageError(f"model config {path}: field 'kv_lora_rank': multi-head latent attention is "
                         f"not modelled; {fix}")
    for key in ("shared_expert_intermediate_size", "n_shared_experts", "num_shared_experts"):
        if get(key, default=0):
            raise UsageError(f"model config {path}: field '{key}': shared experts are not modelled; {fix}")
    if get("first_k_dense_replace", default=0) or get("decoder_sparse_step", default=1) != 1 or cfg.get("mlp_only_layers"):
        raise UsageError(f"model config {path}: dense MLP layers among the MoE ones (first_k_dense_replace, "
                         f"decoder_sparse_step, mlp_only_layers) are not modelled; {fix}")
    for key in ("mlp_bias", "qk_layernorm", "use_qk_norm"):
        if flag(key, False):
            raise UsageError(f"model config {path}: field '{key}' is true, which zplan's block does not "
                             f"model; {fix}")


def _json_type(v: object) -> str:
    return {list: "array", str: "string", int: "number", float: "number", bool: "boolean"}.get(
        type(v), "null")
