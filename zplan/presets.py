"""Preset loading: one TOML file per GPU, cluster or model, shipped inside the wheel.

A name is looked up in the user's folders first (--presets DIR, or $ZPLAN_PRESETS, each holding
gpus/, clusters/, models/), then in the shipped presets. A path to a .toml file works too, and
for models a local Hugging Face config.json (read offline; no hub is ever contacted).
"""

from __future__ import annotations

import difflib
import json
import os
import tomllib
from functools import lru_cache
from importlib import resources
from pathlib import Path
from typing import TypeVar

from pydantic import BaseModel, ValidationError

from .errors import UsageError
from .specs import ClusterSpec, GPUSpec, ModelSpec

KINDS = {"gpus": GPUSpec, "clusters": ClusterSpec, "models": ModelSpec}
T = TypeVar("T", bound=BaseModel)


@lru_cache(maxsize=1)
def _shipped_dir() -> Path:
    """The installed presets (package zplan.preset_files), or presets/ of a source checkout
    run without installing (PYTHONPATH=. as on the GPU check)."""
    try:
        return Path(str(resources.files("zplan.preset_files")))
    except ModuleNotFoundError:
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
        for p in sorted((d / kind).glob("*.toml")):
            if p.stem not in found:
                found.append(p.stem)
    return found


def _validation_line(path: Path, err: ValidationError) -> str:
    e = err.errors()[0]
    field = ".".join(str(x) for x in e["loc"]) or "(file)"
    return f"preset {path}: field '{field}': {e['msg']}"


def _parse(path: Path, cls: type[T], data: dict) -> T:
    try:
        return cls.model_validate(data)
    except ValidationError as err:
        raise UsageError(_validation_line(path, err) + "; fix the file") from None


@lru_cache(maxsize=256)
def _load_file(path_str: str, kind: str) -> BaseModel:
    path = Path(path_str)
    cls = KINDS[kind]
    try:
        text = path.read_text()
    except OSError as e:
        raise UsageError(f"cannot read preset {path}: {e.strerror}") from None
    if path.suffix == ".json":
        if kind != "models":
            raise UsageError(f"{path}: a .json file can only be a Hugging Face model config")
        try:
            return _parse(path, ModelSpec, hf_config_to_model(json.loads(text), path))
        except json.JSONDecodeError as e:
            raise UsageError(f"preset {path}: not valid JSON (line {e.lineno}: {e.msg})") from None
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise UsageError(f"preset {path}: not valid TOML ({e})") from None
    return _parse(path, cls, data)


def load(kind: str, name_or_path: str, extra: tuple[str, ...] = ()) -> BaseModel:
    """Load a preset by name or path; unknown names list the close ones."""
    p = Path(name_or_path)
    if p.suffix in (".toml", ".json") or p.is_dir() or os.sep in name_or_path:
        if p.is_dir() and (p / "config.json").is_file():
            p = p / "config.json"
        if not p.is_file():
            raise UsageError(f"no such preset file: {name_or_path}")
        return _load_file(str(p.resolve()), kind)
    key = name_or_path.lower()
    for d in _search_dirs(extra):
        f = d / kind / f"{key}.toml"
        if f.is_file():
            return _load_file(str(f), kind)
    known = names(kind, extra)
    close = difflib.get_close_matches(key, known, n=3, cutoff=0.4)
    hint = f"did you mean {', '.join(close)}?" if close else f"known: {', '.join(known)}"
    singular = kind[:-1]
    raise UsageError(
        f"unknown {singular} '{name_or_path}': {hint} (or pass a path to a .toml file)"
    )


def gpu(name: str, extra: tuple[str, ...] = ()) -> GPUSpec:
    return load("gpus", name, extra)  # type: ignore[return-value]


def cluster(name: str, extra: tuple[str, ...] = ()) -> ClusterSpec:
    return load("clusters", name, extra)  # type: ignore[return-value]


def model(name: str, extra: tuple[str, ...] = ()) -> ModelSpec:
    return load("models", name, extra)  # type: ignore[return-value]


def hf_config_to_model(cfg: dict, path: Path) -> dict:
    """Map a Hugging Face config.json (Llama, Mistral, Mixtral, Qwen2, GPT-2 style) to ModelSpec fields."""

    def get(*keys, default=None):
        for k in keys:
            if k in cfg and cfg[k] is not None:
                return cfg[k]
        if default is None:
            raise UsageError(f"preset {path}: field '{keys[0]}' is missing; add it to the config")
        return default

    model_type = str(cfg.get("model_type", ""))
    hidden = get("hidden_size", "n_embd", "d_model")
    heads = get("num_attention_heads", "n_head")
    act = str(cfg.get("hidden_act", cfg.get("activation_function", "silu")))
    gpt2_like = model_type in ("gpt2", "gpt_neox", "gptj", "opt")
    return {
        "name": str(cfg.get("_name_or_path") or path.parent.name or "hf-model"),
        "num_layers": get("num_hidden_layers", "n_layer"),
        "hidden": hidden,
        "ffn_hidden": get("intermediate_size", "n_inner", "ffn_dim", default=4 * hidden),
        "num_heads": heads,
        "num_kv_heads": get("num_key_value_heads", default=heads),
        "vocab_size": get("vocab_size"),
        "tied_embeddings": bool(cfg.get("tie_word_embeddings", gpt2_like)),
        "mlp": "gelu" if gpt2_like or "gelu" in act else "swiglu",
        "norm": "layernorm" if gpt2_like else "rmsnorm",
        "position": "learned" if model_type == "gpt2" else "rope",
        "max_seq_len": get("max_position_embeddings", "n_positions", "n_ctx", default=4096),
        "linear_bias": gpt2_like,
        "qkv_bias": gpt2_like or model_type == "qwen2" or bool(cfg.get("attention_bias", False)),
        "num_experts": int(cfg.get("num_local_experts", cfg.get("num_experts", 0)) or 0),
        "experts_per_token": int(cfg.get("num_experts_per_tok", 0) or 0),
        "source": f"Hugging Face config.json at {path}",
    }
