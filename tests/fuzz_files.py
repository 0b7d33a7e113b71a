"""Hostile input files for the CLI fuzzer (tests/fuzzing.py): presets, config.json, plans.

Each generator starts from a valid file (a shipped preset, a Llama config.json, a plan zplan
wrote) and returns it valid, mutated (one to three fields zero, negative, NaN, huge, of the wrong
type, dropped or unknown, at any depth) or garbled as bytes (truncated, spliced with random
bytes, not UTF-8, random binary, nested 40 to 100,000 deep, dotted keys, a BOM, a NUL byte).
"""

from __future__ import annotations

import copy
import json
import math
import tomllib
from pathlib import Path

from hypothesis import strategies as st

ROOT = Path(__file__).resolve().parent.parent
PRESETS = ROOT / "presets"
MODELS = sorted(p.stem for p in (PRESETS / "models").glob("*.toml"))
GPUS = sorted(p.stem for p in (PRESETS / "gpus").glob("*.toml"))
CLUSTERS = sorted(p.stem for p in (PRESETS / "clusters").glob("*.toml"))
STRATEGIES = ["ddp", "zero1", "zero2", "zero3", "zero3-noreshard", "hsdp", "offload-opt", "offload-all"]
HF_LLAMA = {"model_type": "llama", "hidden_size": 512, "intermediate_size": 1376,
            "num_attention_heads": 8, "num_key_value_heads": 4, "num_hidden_layers": 4,
            "vocab_size": 32000, "max_position_embeddings": 2048, "tie_word_embeddings": False,
            "hidden_act": "silu", "_name_or_path": "fuzz/llama"}

HOSTILE_VALUES = [0, -1, -0.0, math.nan, math.inf, -math.inf, 1e300, 10**30, 2**63, 0.5, "x", "",
                  True, False, [], {}, [1, 2], {"a": 1}, "[/x]", "x" * 5000, 1e-300]


def toml_value(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, float):
        return "nan" if math.isnan(v) else ("inf" if v > 0 else "-inf") if math.isinf(v) else repr(v)
    if isinstance(v, int):
        return str(v)
    if isinstance(v, str):
        return json.dumps(v)
    if isinstance(v, list):
        return "[" + ", ".join(toml_value(x) for x in v) + "]"
    return "{" + ", ".join(f"{json.dumps(k)} = {toml_value(x)}" for k, x in v.items()) + "}"


def toml_text(d: dict) -> str:
    return "".join(f"{json.dumps(k)} = {toml_value(v)}\n" for k, v in d.items())


@st.composite
def mutated(draw, base: dict) -> dict:
    """A copy of `base` with one to three fields changed, removed or added, at any depth."""
    d = json.loads(json.dumps(base))
    for _ in range(draw(st.integers(1, 3))):
        node = d
        while True:
            keys = list(node) if isinstance(node, dict) else list(range(len(node)))
            if not keys:
                break
            k = draw(st.sampled_from(keys))
            if isinstance(node[k], (dict, list)) and node[k] and draw(st.booleans()):
                node = node[k]
                continue
            action = draw(st.sampled_from(["set", "set", "set", "drop", "add"]))
            if action == "set":
                node[k] = copy.deepcopy(draw(st.sampled_from(HOSTILE_VALUES)))  # shared lists stay intact
            elif action == "drop" and isinstance(node, dict):
                del node[k]
            elif isinstance(node, dict):
                node[draw(st.sampled_from(["extra", "x" * 300, "[/x]"]))] = 1
            break
    return d


@st.composite
def garbled(draw, text: str) -> bytes:
    """Valid text made hostile as bytes: truncated, spliced, not UTF-8, deeply nested, huge."""
    b = text.encode()
    kind = draw(st.sampled_from(["truncate", "splice", "latin1", "binary", "deep", "dotted", "bom", "nul"]))
    if kind == "truncate":
        return b[: draw(st.integers(0, max(0, len(b) - 1)))]
    if kind == "splice":
        at = draw(st.integers(0, len(b)))
        return b[:at] + draw(st.binary(max_size=12)) + b[at:]
    if kind == "latin1":
        return b + "\n# caf\u00e9\n".encode("latin-1")
    if kind == "binary":
        return draw(st.binary(max_size=200))
    if kind == "deep":
        n = draw(st.sampled_from([40, 1000, 100000]))
        return (b"a = " if draw(st.booleans()) else b"") + b"[" * n + b"]" * n
    if kind == "dotted":
        return (".".join(["k"] * draw(st.sampled_from([40, 5000]))) + " = 1\n").encode()
    if kind == "bom":
        return b"\xef\xbb\xbf" + b
    return b.replace(b"\n", b"\x00\n", 1)


def preset_dict(kind: str, name: str) -> dict:
    return tomllib.loads((PRESETS / kind / f"{name}.toml").read_text())


@st.composite
def edge_model(draw) -> dict:
    """A model at the scale edges: one layer or ten thousand, a vocabulary larger than the rest
    of the model, thousands of experts, tiny or huge widths."""
    heads = draw(st.sampled_from([1, 2, 64]))
    d = {"name": "edge", "num_layers": draw(st.sampled_from([1, 2, 256, 10_000])),
         "hidden": heads * draw(st.sampled_from([1, 64, 128, 1024])),
         "ffn_hidden": draw(st.sampled_from([1, 256, 2**20])), "num_heads": heads,
         "num_kv_heads": 1, "vocab_size": draw(st.sampled_from([1, 256, 2**20, 2**27])),
         "max_seq_len": draw(st.sampled_from([1, 4096, 2**27]))}
    if draw(st.booleans()):
        d["num_experts"] = draw(st.sampled_from([1, 8, 100, 4096]))
        d["experts_per_token"] = draw(st.sampled_from([1, 2]))
    return d


@st.composite
def toml_file(draw, kind: str) -> bytes:
    base = preset_dict(kind, draw(st.sampled_from({"models": MODELS, "gpus": GPUS, "clusters": CLUSTERS}[kind])))
    how = draw(st.sampled_from(["valid", "mutated", "mutated", "garbled"] + ["edge"] * (kind == "models")))
    if how == "valid":
        return toml_text(base).encode()
    if how == "edge":
        return toml_text(draw(edge_model())).encode()
    if how == "mutated":
        return toml_text(draw(mutated(base))).encode()
    return draw(garbled(toml_text(base)))


@st.composite
def json_file(draw, base: dict) -> bytes:
    how = draw(st.sampled_from(["valid", "mutated", "mutated", "garbled", "toplevel"]))
    if how == "valid":
        return json.dumps(base).encode()
    if how == "mutated":
        return json.dumps(draw(mutated(base))).encode()
    if how == "toplevel":
        return json.dumps(draw(st.sampled_from([[], [base], "x", 1, None, True, 1e308]))).encode()
    return draw(garbled(json.dumps(base, indent=1)))
