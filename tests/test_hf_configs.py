"""Hugging Face config.json files as users pass them (--model path/config.json), held against
Hugging Face's own model built from the same file on the meta device: zplan's parameter count
must be transformers' count exactly, or the file must be refused in one line naming the field."""

from __future__ import annotations

import json
import warnings

import pytest

from zplan import arch, presets
from zplan.errors import UsageError

# The fields of the published config.json files (Hugging Face hub, each model's main branch).
LLAMA_31_8B = {"model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336,
               "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
               "vocab_size": 128256, "tie_word_embeddings": False, "hidden_act": "silu",
               "max_position_embeddings": 131072, "head_dim": 128}
MIXTRAL_8X7B = {"model_type": "mixtral", "hidden_size": 4096, "intermediate_size": 14336,
                "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
                "num_local_experts": 8, "num_experts_per_tok": 2, "vocab_size": 32000,
                "tie_word_embeddings": False, "hidden_act": "silu", "max_position_embeddings": 32768}
GEMMA_2B = {"model_type": "gemma", "hidden_size": 2048, "intermediate_size": 16384,
            "num_hidden_layers": 18, "num_attention_heads": 8, "num_key_value_heads": 1,
            "head_dim": 256, "vocab_size": 256000, "hidden_act": "gelu",
            "hidden_activation": "gelu_pytorch_tanh", "max_position_embeddings": 8192}
GEMMA_7B = {**GEMMA_2B, "hidden_size": 3072, "intermediate_size": 24576, "num_hidden_layers": 28,
            "num_attention_heads": 16, "num_key_value_heads": 16}  # heads of 256 on a hidden of 3072
MISTRAL_NEMO = {"model_type": "mistral", "hidden_size": 5120, "intermediate_size": 14336,
                "num_hidden_layers": 40, "num_attention_heads": 32, "num_key_value_heads": 8,
                "head_dim": 128, "vocab_size": 131072, "tie_word_embeddings": False,
                "hidden_act": "silu", "max_position_embeddings": 1024000}
QWEN15_MOE = {"model_type": "qwen2_moe", "hidden_size": 2048, "intermediate_size": 5632,
              "moe_intermediate_size": 1408, "shared_expert_intermediate_size": 5632,
              "num_experts": 60, "num_experts_per_tok": 4, "num_hidden_layers": 24,
              "num_attention_heads": 16, "num_key_value_heads": 16, "vocab_size": 151936,
              "decoder_sparse_step": 1, "mlp_only_layers": []}
QWEN3_30B_A3B = {"model_type": "qwen3_moe", "hidden_size": 2048, "intermediate_size": 6144,
                 "moe_intermediate_size": 768, "num_experts": 128, "num_experts_per_tok": 8,
                 "num_hidden_layers": 48, "num_attention_heads": 32, "num_key_value_heads": 4,
                 "head_dim": 128, "vocab_size": 151936, "tie_word_embeddings": False,
                 "decoder_sparse_step": 1, "mlp_only_layers": []}
QWEN3_8B = {"model_type": "qwen3", "hidden_size": 4096, "intermediate_size": 12288,
            "num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 8,
            "head_dim": 128, "vocab_size": 151936, "tie_word_embeddings": False,
            "attention_bias": False, "hidden_act": "silu", "max_position_embeddings": 40960}
QWEN3_32B = {**QWEN3_8B, "hidden_size": 5120, "intermediate_size": 25600, "num_hidden_layers": 64,
             "num_attention_heads": 64}  # heads of 128 on a hidden of 5120: q is 8192 wide
OLMO2_7B = {"model_type": "olmo2", "hidden_size": 4096, "intermediate_size": 11008,
            "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 32,
            "vocab_size": 100352}
# More published config.json files (the fields that size the model), each read exactly as
# transformers builds it, or refused.
READ = {
    "phi-3-mini": {"model_type": "phi3", "hidden_size": 3072, "intermediate_size": 8192, "num_hidden_layers": 32,
                   "num_attention_heads": 32, "num_key_value_heads": 32, "vocab_size": 32064,
                   "hidden_act": "silu", "tie_word_embeddings": False},
    "gpt2": {"model_type": "gpt2", "n_embd": 768, "n_layer": 12, "n_head": 12, "vocab_size": 50257,
             "n_positions": 1024, "n_ctx": 1024, "activation_function": "gelu_new"},
    "pythia-1b": {"model_type": "gpt_neox", "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16,
                  "num_attention_heads": 8, "vocab_size": 50304, "hidden_act": "gelu",
                  "max_position_embeddings": 2048, "rotary_pct": 0.25, "use_parallel_residual": True},
    "qwen3-0.6b": {"model_type": "qwen3", "hidden_size": 1024, "intermediate_size": 3072, "num_hidden_layers": 28,
                   "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151936,
                   "tie_word_embeddings": True},
    "qwen3-4b-head-dim-default": {"model_type": "qwen3", "hidden_size": 2560, "intermediate_size": 9728,
                                  "num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 8,
                                  "vocab_size": 151936, "tie_word_embeddings": True},
    "gemma-7b-head-dim-default": {"model_type": "gemma", "hidden_size": 3072, "intermediate_size": 24576,
                                  "num_hidden_layers": 28, "num_attention_heads": 16, "num_key_value_heads": 16,
                                  "vocab_size": 256000, "hidden_act": "gelu"},
    "granite-3.0-8b": {"model_type": "granite", "hidden_size": 4096, "intermediate_size": 12800,
                       "num_hidden_layers": 40, "num_attention_heads": 32, "num_key_value_heads": 8,
                       "vocab_size": 49155, "tie_word_embeddings": True},
    "granitemoe-3b": {"model_type": "granitemoe", "hidden_size": 1536, "intermediate_size": 512,
                      "num_hidden_layers": 32, "num_attention_heads": 24, "num_key_value_heads": 8,
                      "num_local_experts": 40, "num_experts_per_tok": 8, "vocab_size": 49155,
                      "tie_word_embeddings": True},
    "smollm3-3b": {"model_type": "smollm3", "hidden_size": 2048, "intermediate_size": 11008, "num_hidden_layers": 36,
                   "num_attention_heads": 16, "num_key_value_heads": 4, "vocab_size": 128256},
    "qwen2-7b-tie-default": {"model_type": "qwen2", "hidden_size": 3584, "intermediate_size": 18944,
                             "num_hidden_layers": 28, "num_attention_heads": 28, "num_key_value_heads": 4,
                             "vocab_size": 152064},
    "mixtral-with-moe-size": {**MIXTRAL_8X7B, "moe_intermediate_size": 512},  # Mixtral ignores it
    "mistral-attention-bias": {**MISTRAL_NEMO, "attention_bias": True},  # Mistral ignores it
    "gpt2-no-positions": {"model_type": "gpt2", "n_embd": 768, "n_layer": 12, "n_head": 12,
                          "vocab_size": 50257},  # GPT-2's default: 1024 positions
    "llama-no-kv-heads": {k: v for k, v in LLAMA_31_8B.items() if k != "num_key_value_heads"},
}
REFUSED = {
    "falcon-7b": ({"model_type": "falcon", "hidden_size": 4544, "num_hidden_layers": 32, "num_attention_heads": 71,
                   "multi_query": True, "vocab_size": 65024}, "model_type 'falcon' is not one zplan reads"),
    "starcoderbase-1b": ({"model_type": "gpt_bigcode", "n_embd": 2048, "n_layer": 24, "n_head": 16,
                          "vocab_size": 49152, "multi_query": True}, "model_type 'gpt_bigcode' is not one"),
    "nemotron": ({"model_type": "nemotron", "hidden_size": 3072, "num_hidden_layers": 32, "num_attention_heads": 24,
                  "vocab_size": 256000, "hidden_act": "relu2"}, "model_type 'nemotron' is not one"),
    "command-r": ({"model_type": "cohere", "hidden_size": 8192, "num_hidden_layers": 40, "num_attention_heads": 64,
                   "vocab_size": 256000}, "model_type 'cohere' is not one"),
    "qwen1.5-moe": (QWEN15_MOE, "model_type 'qwen2_moe' is not one zplan reads"),  # shared experts
    "llama4": ({"model_type": "llama4_text", "hidden_size": 5120, "num_hidden_layers": 48,
                "num_attention_heads": 40, "vocab_size": 202048}, "model_type 'llama4_text' is not one"),
    "llama-mlp-bias": ({**LLAMA_31_8B, "mlp_bias": True}, "field 'mlp_bias' is true"),
    "no-type": ({k: v for k, v in LLAMA_31_8B.items() if k != "model_type"}, r"model_type '\(none\)'"),
    "llama-attention-bias": ({**LLAMA_31_8B, "attention_bias": True}, "field 'attention_bias' is true"),
    "no-intermediate": ({k: v for k, v in LLAMA_31_8B.items() if k != "intermediate_size"},
                        "field 'intermediate_size' is missing"),
}
DEEPSEEK_V3 = {"model_type": "deepseek_v3", "hidden_size": 7168, "intermediate_size": 18432,
               "moe_intermediate_size": 2048, "n_routed_experts": 256, "n_shared_experts": 1,
               "num_experts_per_tok": 8, "num_hidden_layers": 61, "num_attention_heads": 128,
               "num_key_value_heads": 128, "kv_lora_rank": 512, "q_lora_rank": 1536,
               "first_k_dense_replace": 3, "vocab_size": 129280}


def _write(tmp_path, cfg: dict):
    p = tmp_path / "config.json"
    p.write_text(json.dumps(cfg))
    return p


def _transformers_count(path) -> int:
    pytest.importorskip("transformers")
    import torch
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from transformers import AutoConfig, AutoModelForCausalLM
        cfg = AutoConfig.from_pretrained(str(path))
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(cfg)
    return sum(p.numel() for p in model.parameters())


# a dense model type's file with stray MoE keys: transformers builds the dense model (zplan priced
# 47.5B of experts); MoE keys are read only for the model types whose config class reads them
LLAMA_STRAY_MOE = {**LLAMA_31_8B, "num_local_experts": 8, "num_experts_per_tok": 2}


@pytest.mark.parametrize("cfg", [LLAMA_31_8B, MIXTRAL_8X7B, GEMMA_2B, GEMMA_7B, MISTRAL_NEMO, QWEN3_8B,
                                 QWEN3_32B, QWEN3_30B_A3B, LLAMA_STRAY_MOE],
                         ids=["llama", "mixtral", "gemma-2b", "gemma-7b", "mistral-nemo", "qwen3-8b",
                              "qwen3-32b", "qwen3-30b-a3b", "llama-stray-moe-keys"])
def test_param_count_is_transformers_own(tmp_path, cfg):
    p = _write(tmp_path, cfg)
    assert arch.param_count(presets.model(str(p))) == _transformers_count(p)


def test_gemma_mlp_is_gated_and_its_embeddings_tied(tmp_path):
    m = presets.model(str(_write(tmp_path, GEMMA_2B)))
    assert m.mlp == "swiglu" and m.tied_embeddings


@pytest.mark.parametrize("cfg,needle", [
    ({**QWEN3_30B_A3B, "shared_expert_intermediate_size": 5632}, "field 'shared_expert_intermediate_size': shared experts"),
    (OLMO2_7B, "model_type 'olmo2' is not one zplan reads"),
    (DEEPSEEK_V3, "model_type 'deepseek_v3' is not one zplan reads"),
    ({**QWEN3_8B, "model_type": "qwen2", "kv_lora_rank": 512}, "multi-head latent attention"),
    ({**QWEN3_30B_A3B, "decoder_sparse_step": 2}, "dense MLP layers among the MoE ones"),
], ids=["shared-experts", "olmo2", "deepseek-v3", "mla-field", "dense-layers"])
def test_blocks_zplan_does_not_model_are_refused(tmp_path, cfg, needle):
    with pytest.raises(UsageError, match=needle):
        presets.model(str(_write(tmp_path, cfg)))


def test_experts_take_moe_intermediate_size(tmp_path):
    """Qwen3's MoE configs name the experts' width apart from the dense width (intermediate_size)."""
    m = presets.model(str(_write(tmp_path, QWEN3_30B_A3B)))
    assert (m.ffn_hidden, m.num_experts, m.experts_per_token) == (768, 128, 8)


@pytest.mark.slow  # over a second in all: the fast loop leaves it to CI
@pytest.mark.parametrize("name", sorted(READ))
def test_more_published_configs_count_as_transformers_does(tmp_path, name):
    """Defaults the file leaves to its config class (tied embeddings, head_dim) taken as
    transformers takes them."""
    p = _write(tmp_path, READ[name])
    assert arch.param_count(presets.model(str(p))) == _transformers_count(p)


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_types_and_fields_zplan_does_not_model_are_refused(tmp_path, name):
    cfg, needle = REFUSED[name]
    with pytest.raises(UsageError, match=needle):
        presets.model(str(_write(tmp_path, cfg)))


def test_qwen3_has_q_and_k_norms_in_the_trainers_block_too(tmp_path):
    torch = pytest.importorskip("torch")
    from zplan.trainer.model import Block

    m = presets.model(str(_write(tmp_path, QWEN3_32B)))
    assert m.qk_norm and (m.head_dim, m.q_hidden) == (128, 8192)
    with torch.device("meta"):
        block = Block(m)
    assert sorted(tuple(p.shape) for p in block.parameters()) == sorted(arch.block_shapes(m))


def test_heads_wider_than_hidden_over_heads_size_q_and_the_output_projection(tmp_path):
    """Mistral NeMo: 32 heads of 128 on a hidden of 5120, so q and the attention output are
    4096 wide; the trainer's block builds the same shapes arch.block_shapes counts."""
    torch = pytest.importorskip("torch")
    from zplan.trainer.model import Block

    m = presets.model(str(_write(tmp_path, MISTRAL_NEMO)))
    assert (m.head_dim, m.q_hidden, m.kv_hidden) == (128, 4096, 1024)
    with torch.device("meta"):
        block = Block(m)
    assert sorted(tuple(p.shape) for p in block.parameters()) == sorted(arch.block_shapes(m))


@pytest.mark.parametrize("name,cfg", [("qwen3-8b", QWEN3_8B), ("qwen3-32b", QWEN3_32B),
                                      ("qwen3-30b-a3b", QWEN3_30B_A3B), ("mistral-nemo-12b", MISTRAL_NEMO)])
def test_presets_are_their_config_files(tmp_path, name, cfg):
    """The shipped presets describe the block their config.json does, and count transformers'
    parameters."""
    preset, read = presets.model(name), presets.model(str(_write(tmp_path, cfg)))
    fields = ("num_layers", "hidden", "ffn_hidden", "num_heads", "num_kv_heads", "head_dim", "q_hidden",
              "vocab_size", "qk_norm", "num_experts", "experts_per_token", "tied_embeddings", "mlp")
    assert {f: getattr(preset, f) for f in fields} == {f: getattr(read, f) for f in fields}
    assert arch.param_count(preset) == _transformers_count(tmp_path / "config.json")


def test_q_and_k_norms_run_in_fp32_under_autocast_without_a_dtype_mismatch():
    """Under autocast (ddp/zero1: fp32 master weights, bf16 compute) a q/k norm meets a bf16
    projection output and its fp32 weight. torch 2.13's CUDA autocast casts rms_norm's input to
    fp32; 2.11 has no autocast rule for rms_norm, so the mixed call fell to rms_norm's composite
    path ("Mismatch dtype between input and weight"), keeping an fp32 copy and an fp32 output:
    twice what qk_norm_inputs prices. The trainer's RMSNorm casts the input itself, so no torch
    version and no device takes that path; CPU autocast has no rms_norm rule either, as 2.11's CUDA."""
    torch = pytest.importorskip("torch")
    import warnings

    from zplan.specs import ModelSpec
    from zplan.trainer.model import Attention

    m = ModelSpec(name="t", num_layers=1, hidden=64, ffn_hidden=128, num_heads=4, num_kv_heads=2,
                  vocab_size=64, qk_norm=True, attention_head_dim=16)
    att = Attention(m)
    for p in att.parameters():
        torch.nn.init.normal_(p, 0, 0.02)
    seen = []
    for norm in (att.q_norm, att.k_norm):
        torch.nn.init.ones_(norm.weight)
        norm.register_forward_hook(lambda mod, args, out: seen.append((args[0].dtype, out.dtype)))
    torch.set_warn_always(True)
    try:
        with warnings.catch_warnings(record=True) as ws, torch.autocast("cpu", dtype=torch.bfloat16):
            warnings.simplefilter("always")
            out = att(torch.randn(2, 8, 64))
    finally:
        torch.set_warn_always(False)
    assert not [w for w in ws if "Mismatch dtype" in str(w.message)]
    assert seen == [(torch.bfloat16, torch.float32)] * 2  # fp32 out: the norm ran in fp32
    assert out.dtype == torch.bfloat16


def test_q_and_k_norms_hand_back_the_activation_dtype_as_cuda_autocast_needs():
    """CUDA autocast runs rms_norm in fp32 (torch's autocast op lists: rms_norm among CUDA's
    fp32 ops), so q_norm and k_norm return fp32 there; the trainer's block casts them back, so
    RoPE's tables and attention stay in the activation dtype and the planner's fp32 copy is the
    norms' own. On CPU, norms made to return fp32 as they would there: without the cast back
    SDPA would meet an fp32 q and a bf16 v."""
    torch = pytest.importorskip("torch")
    import torch.nn.functional as F

    from zplan.specs import ModelSpec
    from zplan.trainer.model import Block

    m = ModelSpec(name="t", num_layers=1, hidden=256, ffn_hidden=704, num_heads=4, num_kv_heads=2,
                  vocab_size=64, qk_norm=True, attention_head_dim=96)
    block = Block(m).to(torch.bfloat16)
    for norm in (block.attention.q_norm, block.attention.k_norm):
        norm.forward = lambda x, w=norm.weight: F.rms_norm(x.float(), (x.shape[-1],), w.float(), 1e-5)
    seen = []
    core = block.attention.core
    block.attention.core = lambda q, k, v: (seen.append((q.dtype, k.dtype, v.dtype)), core(q, k, v))[1]
    out = block(torch.randn(1, 16, 256, dtype=torch.bfloat16))
    assert out.dtype == torch.bfloat16 and seen == [(torch.bfloat16,) * 3]


def test_neox_without_its_biases_is_refused(tmp_path):
    with pytest.raises(UsageError, match="field 'attention_bias' is false"):
        presets.model(str(_write(tmp_path, {**READ["pythia-1b"], "attention_bias": False})))
