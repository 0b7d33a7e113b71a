"""Preset loading: one TOML file per GPU, cluster or model, shipped inside the wheel.

A name is looked up in the user's folders first (--presets DIR, or $ZPLAN_PRESETS, each holding
gpus/, clusters/, models/), then in the shipped presets. A path to a .toml file works too, and
for models a local Hugging Face config.json (read offline; no hub is ever contacted).
"""

from __future__ import annotations

import os
from functools import lru_cache
from importlib.util import find_spec
from pathlib import Path
from typing import TypeVar

from .errors import UsageError
from .files import read_json, read_toml
from .specs import ClusterSpec, GPUSpec, ModelSpec, validation_line
from .validated import Record, ValidationError

KINDS = {"gpus": GPUSpec, "clusters": ClusterSpec, "models": ModelSpec}
T = TypeVar("T", bound=Record)


@lru_cache(maxsize=1)
def _shipped_dir() -> Path:
    """The installed presets (package zplan.preset_files), or presets/ of a source checkout
    run without installing (PYTHONPATH=. as on the GPU check). Found by the import system's
    spec, not importlib.resources, whose readers import zipfile (~10 ms of estimate's 0.3 s);
    pip installs the package as a folder, and an editable install maps it to presets/."""
    try:
        spec = find_spec("zplan.preset_files")
    except ModuleNotFoundError:
        spec = None
    if spec is not None and spec.submodule_search_locations:
        return Path(list(spec.submodule_search_locations)[0])
    return Path(__file__).resolve().parent.parent / "presets"


def _search_dirs(extra: tuple[str, ...] = ()) -> list[Path]:
    dirs = [Path(d) for d in extra]
    env = os.environ.get("ZPLAN_PRESETS")
    if env:
        dirs += [Path(p) for p in env.split(os.pathsep) if p]
    dirs.append(_shipped_dir())
    return dirs


def names(kind: str, extra: tuple[str, ...] = ()) -> list[str]:
    """Every preset name of one kind, the user's folders first."""
    found: list[str] = []
    for d in _search_dirs(extra):
        try:  # a search path like PATH: a folder that cannot be listed holds no presets
            listed = sorted((d / kind).glob("*.toml"))
        except (OSError, ValueError):
            continue
        for p in listed:
            if p.stem not in found:
                found.append(p.stem)
    return found


def _parse(path: Path, cls: type[T], data: dict) -> T:
    try:
        return cls.model_validate(data)
    except ValidationError as err:
        raise UsageError(validation_line(f"preset {path}", err) + "; fix the file") from None


@lru_cache(maxsize=256)
def _load_file(path_str: str, kind: str) -> Record:
    path = Path(path_str)
    cls = KINDS[kind]
    if path.suffix == ".json":
        if kind != "models":
            raise UsageError(f"{path}: a .json file can only be a Hugging Face model config")
        return _parse(path, ModelSpec, hf_config_to_model(read_json(path, "model config"), path))
    return _parse(path, cls, read_toml(path, "preset"))


def _is(test, p: Path) -> bool:
    """Path.is_file / is_dir, False where the OS refuses the name (too long, bad bytes)."""
    try:
        return test(p)
    except (OSError, ValueError):
        return False


MAX_NAME = 255


def load(kind: str, name_or_path: str, extra: tuple[str, ...] = ()) -> Record:
    """Load a preset by name or path; unknown names list the close ones."""
    singular = kind[:-1]
    if not name_or_path.strip():
        raise UsageError(f"--{singular} {name_or_path!r} is empty; name a preset or a .toml file")
    if len(name_or_path) > 4096 or "\x00" in name_or_path:
        shown = repr(name_or_path[:40]) + ("..." if len(name_or_path) > 40 else "")
        why = "holds a NUL" if "\x00" in name_or_path else f"is {len(name_or_path):,} characters long"
        raise UsageError(f"--{singular} {shown} {why}; name a preset or a .toml file")
    p = Path(name_or_path)
    if p.suffix in (".toml", ".json") or _is(Path.is_dir, p) or os.sep in name_or_path:
        if _is(Path.is_dir, p) and _is(Path.is_file, p / "config.json"):
            p = p / "config.json"
        if not _is(Path.exists, p):
            raise UsageError(f"no such preset file: {name_or_path}")
        return _load_file(os.path.realpath(p), kind)
    key = name_or_path.lower()
    for d in _search_dirs(extra) if len(key) <= MAX_NAME else ():
        f = d / kind / f"{key}.toml"
        if _is(Path.exists, f):  # the reader refuses what is not a regular file, naming it
            return _load_file(str(f), kind)
    import difflib  # only for an unknown name: estimate's start-up is counted (issue 8)

    known = names(kind, extra)
    close = difflib.get_close_matches(key[:MAX_NAME], known, n=3, cutoff=0.4)
    hint = f"did you mean {', '.join(close)}?" if close else f"known: {', '.join(known)}"
    shown = name_or_path if len(name_or_path) <= 80 else name_or_path[:77] + "..."
    raise UsageError(
        f"unknown {singular} {' '.join(shown.split())!r}: {hint} (or pass a path to a .toml file)"
    )


def gpu(name: str, extra: tuple[str, ...] = ()) -> GPUSpec:
    return load("gpus", name, extra)  # type: ignore[return-value]


def cluster(name: str, extra: tuple[str, ...] = ()) -> ClusterSpec:
    return load("clusters", name, extra)  # type: ignore[return-value]


def model(name: str, extra: tuple[str, ...] = ()) -> ModelSpec:
    return load("models", name, extra)  # type: ignore[return-value]


def hf_config_to_model(cfg: object, path: Path) -> dict:
    """Map a Hugging Face config.json (Llama, Mistral, Mixtral, Qwen2, Gemma, GPT-2 style) to
    ModelSpec fields; blocks ModelSpec cannot express are refused (_refuse_unmodelled_blocks).
    Held against transformers' own model built from the file (tests/test_hf_configs.py).

    The file is data from anywhere: its top level must be an object, each field used must have
    the type Hugging Face writes (sizes are whole numbers, flags are booleans, names strings);
    the sizes' ranges are ModelSpec's. Anything else is one line naming the field.
    """
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
    hidden = get("hidden_size", "n_embd", "d_model")
    heads = get("num_attention_heads", "n_head")
    act = text("hidden_act") or text("activation_function") or "silu"
    gpt2_like = model_type in ("gpt2", "gpt_neox", "gptj", "opt")
    _refuse_unmodelled_blocks(cfg, path, model_type, hidden, heads, get)
    num_experts = get("num_local_experts", "num_experts", default=0)
    name = " ".join(text("_name_or_path").split())[-128:] or path.parent.name[-128:] or "hf-model"
    return {
        "name": "".join(c for c in name if c.isprintable()) or "hf-model",
        "num_layers": get("num_hidden_layers", "n_layer"),
        "hidden": hidden,
        # an MoE model whose dense MLP width differs names its experts' width apart (Qwen MoE)
        "ffn_hidden": (get("moe_intermediate_size") if num_experts and "moe_intermediate_size" in cfg
                       else get("intermediate_size", "n_inner", "ffn_dim", default=4 * hidden)),
        "num_heads": heads,
        "num_kv_heads": get("num_key_value_heads", default=heads),
        "vocab_size": get("vocab_size"),
        "tied_embeddings": flag("tie_word_embeddings", gpt2_like or model_type == "gemma"),
        # Gemma's MLP is gated (gate, up, down) with GELU: SwiGLU's shapes and kernels
        "mlp": "gelu" if gpt2_like or "gelu" in act and model_type != "gemma" else "swiglu",
        "norm": "layernorm" if gpt2_like else "rmsnorm",
        "position": "learned" if model_type == "gpt2" else "rope",
        "max_seq_len": get("max_position_embeddings", "n_positions", "n_ctx", default=4096),
        "linear_bias": gpt2_like,
        "qkv_bias": gpt2_like or model_type == "qwen2" or flag("attention_bias", False),
        # c_attn, query_key_value, Wqkv, qkv_proj: one q/k/v linear
        "qkv_fused": model_type in ("gpt2", "gpt_neox", "mpt", "falcon", "bloom", "gpt_bigcode", "phi3", "dbrx"),
        "qk_norm": model_type in QK_NORM_TYPES,
        "num_experts": num_experts,
        # heads wider or narrower than hidden / heads (Qwen3-32B, Gemma 7B, Mistral NeMo)
        "attention_head_dim": (head_dim if (head_dim := get("head_dim", default=0)) and head_dim * heads != hidden
                               else None),
        "experts_per_token": get("num_experts_per_tok", default=0),
        "source": f"Hugging Face config.json at {str(path)[-1000:]}",
    }


# Hugging Face model types whose blocks hold what zplan's block does not: an RMSNorm over the
# whole q and k projections (OLMo 2; Qwen3's per-head q/k norms are modelled: QK_NORM_TYPES),
# norms after attention and MLP as well as before (Gemma 2 and 3), multi-head latent attention
# (DeepSeek V2/V3).
_UNMODELLED_TYPES = {
    "olmo2": "an RMSNorm over the whole q and k projections",
    "olmoe": "an RMSNorm over the whole q and k projections", "gemma2": "norms after attention and MLP",
    "gemma3": "norms after attention and MLP, RMSNorm on q and k",
    "gemma3_text": "norms after attention and MLP, RMSNorm on q and k",
    "deepseek_v2": "multi-head latent attention", "deepseek_v3": "multi-head latent attention",
}


QK_NORM_TYPES = ("qwen3", "qwen3_moe")  # q_norm and k_norm of head_dim (Qwen3Attention)


def _refuse_unmodelled_blocks(cfg: dict, path: Path, model_type: str, hidden: int, heads: int, get) -> None:
    """One line, naming the field, for a config whose block zplan's ModelSpec cannot express
    (its parameter count would come out wrong without a word: a Qwen3-30B-A3B read as 233B)."""
    fix = "write a model .toml (presets/models/) for the closest block zplan models"
    why = _UNMODELLED_TYPES.get(model_type)
    if why:
        raise UsageError(f"model config {path}: model_type '{model_type}' has {why}, which zplan's "
                         f"block does not model; {fix}")
    if "kv_lora_rank" in cfg or "q_lora_rank" in cfg:
        raise UsageError(f"model config {path}: field 'kv_lora_rank': multi-head latent attention is "
                         f"not modelled; {fix}")
    for key in ("shared_expert_intermediate_size", "n_shared_experts", "num_shared_experts"):
        if get(key, default=0):
            raise UsageError(f"model config {path}: field '{key}': shared experts are not modelled; {fix}")
    if get("first_k_dense_replace", default=0) or get("decoder_sparse_step", default=1) != 1 or cfg.get("mlp_only_layers"):
        raise UsageError(f"model config {path}: dense MLP layers among the MoE ones (first_k_dense_replace, "
                         f"decoder_sparse_step, mlp_only_layers) are not modelled; {fix}")


def _json_type(v: object) -> str:
    return {list: "array", str: "string", int: "number", float: "number", bool: "boolean"}.get(
        type(v), "null")
