"""Activation memory of one micro-batch: what each block, the head and the loss keep for
backward, and the temporaries of a block's backward (bytes; frozen specs in, integers out).

Sources: Korthikanti et al. 2022 (Reducing Activation Recomputation in Large Transformer Models,
section 4.1), generalised to GQA, SwiGLU, flash attention and MoE, checked tensor by tensor against
PyTorch's MemTracker and FSDPMemTracker (tests/test_memory.py); the loss from PyTorch's own kernels
and inductor's generated code. Derivations: docs/formulas.md sections 3 and 4. The step's peak
combines these event by event (memory_timeline).
"""

from __future__ import annotations

from functools import lru_cache

from . import arch, policy
from .specs import ModelSpec, TrainSpec
from .units import DTYPE_BITS


def act_dtype_bytes(train: TrainSpec) -> int:
    """Bytes per activation element: activations are kept in the param dtype."""
    return DTYPE_BITS[train.precision.param] // 8


def stream_dtype_bytes(train: TrainSpec) -> int:
    """Bytes per element of the residual stream (each block's input and output, and their
    gradients): the param dtype, or under autocast (`train.autocast`: DDP and ZeRO-1 on weights
    kept in the master dtype) the master dtype: the embedding is not an autocast op, so its output
    is in the weights' dtype, and each residual add promotes the 16-bit branch output to it
    (torch.autocast's op lists; MemTracker on the trainer's blocks, tests/test_memory.py). The
    linears' inputs are autocast's 16-bit copies, their outputs 16-bit: act_dtype_bytes."""
    return DTYPE_BITS[train.precision.master if train.autocast else train.precision.param] // 8


def block_mode(train: TrainSpec, index: int, num_layers: int) -> str:
    """The recomputation mode of block `index` (every-k, first-k: the blocks
    policy.checkpointed_blocks wraps are fully checkpointed, the others keep everything)."""
    if train.checkpointing in policy.PARTIAL_CHECKPOINTING:
        return "full" if policy.wrapped_blocks(train, num_layers)[index] else "none"
    return train.checkpointing


def largest_block_tensor_bytes(m: ModelSpec, train: TrainSpec) -> int:
    """The largest single tensor a block allocates: the MLP's hidden (s·b·f; an MoE block's
    experts over the k·s·b routed tokens, as block_activation_terms counts them), a
    residual-stream tensor (s·b·h), or without a flash kernel the attention probabilities
    (a·s²·b). Freed by the end of backward, its cached block can serve a later request
    (allocator.HeadTail)."""
    sb, B, S = train.seq_len * train.micro_batch, act_dtype_bytes(train), stream_dtype_bytes(train)
    mlp = (m.experts_per_token if m.num_experts else 1) * m.ffn_hidden
    probs = 0 if train.flash_attention else m.num_heads * train.seq_len
    return sb * max(B * mlp, S * m.hidden, B * m.q_hidden, B * probs)


def forward_transient_bytes(m: ModelSpec, train: TrainSpec) -> tuple[int, int]:
    """What a checkpointed block's first forward frees by its end, at most, and the largest
    tensor among it, bytes: the working set at its peak (in the MLP) less what the block keeps.
    Fully checkpointed (no intermediate kept): SwiGLU's product, silu(w1) and w3's output (the
    three MLP-wide tensors alive once w1's output is gone) and the MLP's normed input; GELU: its
    input and output and the normed input. Selective (the policy keeps w1's output,
    policy.selective_saved_matmuls): SwiGLU's three others; GELU's output, the normed input and
    the residual sum; an MoE block's selective keeps no expert tensor and frees what full does
    (not traced: the trainer builds no MoE block). Equal to PyTorch's MemTracker over the trainer's
    block (peak less what is left after it, tests/test_memory.py). With classic segments each of these tensors (>= 10 MiB)
    has a segment of its own, reused block after block, and is free but cached when the loss
    begins (allocator.forward_residue_bytes). (0, 0) where no block is checkpointed this way (a
    block without recomputation keeps its intermediates for backward) and for compiled blocks
    under selective checkpointing, whose unsaved tensors inductor's fused kernels decide (not
    derived; compiled full checkpointing is taken as eager's: the three MLP-wide tensors are
    w1's and w3's outputs and their fused product there)."""
    if train.checkpointing in policy.PARTIAL_CHECKPOINTING:
        mode = "full" if any(policy.wrapped_blocks(train, m.num_layers)) else "none"
    else:
        mode = train.checkpointing
    if mode not in ("full", "selective") or (mode == "selective" and train.compile):
        return 0, 0  # compiled, silu(w1) * w3 is one kernel and the unsaved outputs differ: not derived
    sb, B, S = train.seq_len * train.micro_batch, act_dtype_bytes(train), stream_dtype_bytes(train)
    k = m.experts_per_token if m.num_experts else 1
    wide = k * B * sb * m.ffn_hidden
    if mode == "full" or m.num_experts:  # an MoE block's selective keeps no expert tensor
        freed = (2 if m.mlp == "gelu" else 3) * wide + B * sb * m.hidden
    elif m.mlp == "gelu":
        freed = wide + (B + S) * sb * m.hidden
    else:  # Liger's fused SwiGLU never makes silu(w1): two
        freed = (2 if train.fused_swiglu else 3) * wide
    return freed, wide


def _norm_steps(tag: str, train: TrainSpec, sbh: int, B: int) -> list[tuple[str, str, int]]:
    """An RMSNorm's forward, tensor by tensor (no grad kept: a checkpointed block's first run).
    Fused (one kernel): its output. Composite, output in fp32 (F.rms_norm's decomposition, which
    the trainer runs on CPU): x.float(), its square (freed by the mean), x * rsqrt, times the
    weight in fp32, then the cast back. Composite, cast back before the weight (torchtitan's
    `self._norm(x.float()).type_as(x) * self.weight`): x.float(), its square, x * rsqrt, the cast,
    the product. The statistics (4 B per token) come from the small pool and are left out."""
    if train.fused_norm:
        return [("+", tag, B * sbh)]
    x32 = 4 * sbh
    if train.norm_output_fp32:
        return [("+", tag + ".f", x32), ("+", tag + ".sq", x32), ("-", tag + ".sq", 0), ("+", tag + ".n", x32),
                ("+", tag + ".w", x32), ("-", tag + ".n", 0), ("-", tag + ".f", 0), ("+", tag, B * sbh),
                ("-", tag + ".w", 0)]
    return [("+", tag + ".f", x32), ("+", tag + ".sq", x32), ("-", tag + ".sq", 0), ("+", tag + ".n", x32),
            ("-", tag + ".f", 0), ("+", tag + ".c", B * sbh), ("-", tag + ".n", 0), ("+", tag, B * sbh),
            ("-", tag + ".c", 0)]


def expands_kv(m: ModelSpec, train: TrainSpec) -> bool:
    """Whether the attention kernel gets keys and values copied to every query head
    (TrainSpec.attention_expands_kv; Hugging Face's repeat_kv returns its input where each
    key/value head serves one query head: nothing then changes)."""
    return train.attention_expands_kv and m.num_kv_heads < m.num_heads


def forward_tensor_steps(m: ModelSpec, train: TrainSpec,
                         mode: str | None = None) -> tuple[tuple[str, str, int], ...] | None:
    """One block's first forward, tensor by tensor, in the order the trainer's block
    (trainer/model.py) makes and frees them: ("+", name, bytes) allocates, ("-", name, 0) frees;
    its output is the last tensor made, and its input stays (a checkpoint saves it, a fused norm
    too) but under "none" with an unfused norm, where ("-", "in", 0) frees it as the block returns.
    Under selective checkpointing the outputs the policy saves (policy.selective_saved_matmuls and
    the attention kernel's output and logsumexp) are never freed. Read off PyTorch's
    FSDPMemTracker over a traced step (benchmarks/reserved_matrix.py); tests/test_forward_holes.py
    holds them to the trainer's Block traced storage by storage, their peak to MemTracker's, and
    their simulation to the allocator replayed over a traced step. None where the block's order
    is not derived: blocks unlike the trainer's (LayerNorm, learned positions, a fused q/k/v
    projection, q/k norms, dropout's masks, MoE), compiled blocks (inductor's kernels decide), attention
    without a flash kernel, float8 linears (their casts), Liger's SwiGLU, autocast, and modes
    other than full, selective or none, and a heads-first q (attention_heads_first: the output's
    copy, which the trainer does not make). Keys and values copied to the query heads (expands_kv):
    the copies made in the attention core and freed when it returns, kept under "none" in place
    of RoPE's k and the value projection's output.

    "none" is a block without recomputation, which frees only what autograd saves nothing of
    (RoPE's inputs, the output projections' outputs, an unfused norm's temporaries) and keeps the
    rest for its backward (block_kept_tensors "none"; the trainer's Block traced without a
    checkpoint, tests/test_first_k_holes.py). `mode`: one block's steps under that mode (a block
    of every-k or first-k, block_mode); without it, the mode every block is under
    (policy.uniform_mode; a mix, every-k or first-k, gives None here)."""
    if mode is None:
        mode = policy.uniform_mode(train, m.num_layers)  # every-1 and first-L are full, block for block
    if (mode not in ("full", "selective", "none") or m.norm != "rmsnorm" or m.position != "rope" or m.qkv_fused
            or m.qk_norm or m.dropout or m.num_experts or train.compile or not train.flash_attention or train.float8
            or train.te_float8 or train.fused_swiglu or train.autocast or train.attention_heads_first):
        return None
    copies = expands_kv(m, train)
    sb, B = train.seq_len * train.micro_batch, act_dtype_bytes(train)
    H, KV, F = B * sb * m.hidden, B * sb * m.kv_hidden, B * sb * m.ffn_hidden
    Q = B * sb * m.q_hidden  # q and the attention output (H unless the heads are set wider)
    kept = set()
    if mode == "selective":
        kept = set(policy.selective_saved_matmuls(m.mlp))
        kept |= {"attn", "lse"} if train.sac_saves_attention else set()
    elif mode == "none":
        # autograd's saved tensors: the norms' (a fused norm's input, the residual sum h for the
        # second; an unfused one's fp32 copy and normalized output), q/k/v's input, RoPE'd q and
        # k, v, the flash kernel's output and logsumexp, the MLP's input and its four hidden tensors
        norm = (lambda tag: {tag}) if train.fused_norm else (
            lambda tag: {tag, tag + ".f", tag + (".n" if train.norm_output_fp32 else ".c")})
        kept = norm("norm1") | norm("norm2") | {"q", "k", "wv", "attn", "lse"}
        kept |= {"h"} if train.fused_norm else set()
        kept |= {"w1", "silu", "w3", "mul"} if m.mlp == "swiglu" else {"w1", "gelu"}
        if copies:  # the kernel saves the copies; RoPE's k and the value projection's output go
            kept = (kept - {"k", "wv"}) | {"kc", "vc"}
    if train.kv_cache:  # the cache the block returns keeps RoPE's k and the value projection's output
        kept |= {"k", "wv"}
    steps = _norm_steps("norm1", train, sb * m.hidden, B)
    steps += [("+", "wq", Q), ("+", "wk", KV), ("+", "wv", KV)]
    # RoPE's rotated q and k (trainer/model.py apply_rope); its half-size temporaries, made and
    # freed in turn, move no simulated figure (the reserved matrix's cells and PR #165's, checked)
    steps += [("+", "q", Q), ("+", "k", KV)]
    steps += [("-", "wk", 0), ("-", "wq", 0)]
    # expands_kv: k and v copied q wide inside the attention core (the trainer's repeat_interleave,
    # HF's repeat_kv), freed with the logsumexp when it returns unless the kernel's saved inputs keep them
    steps += [("+", "kc", Q), ("+", "vc", Q)] if copies else []
    steps += [("+", "attn", Q), ("+", "lse", 4 * m.num_heads * sb), ("-", "lse", 0)]
    steps += [("-", "kc", 0), ("-", "vc", 0)] if copies else []
    steps += [("+", "wo", H), ("-", "q", 0), ("-", "k", 0), ("-", "wv", 0),
              ("-", "attn", 0), ("-", "norm1", 0), ("+", "h", H), ("-", "wo", 0)]
    steps += _norm_steps("norm2", train, sb * m.hidden, B)
    if m.mlp == "swiglu":
        steps += [("+", "w1", F), ("+", "silu", F), ("-", "w1", 0), ("+", "w3", F), ("+", "mul", F),
                  ("-", "silu", 0), ("-", "w3", 0), ("+", "w2", H), ("-", "mul", 0)]
    else:
        steps += [("+", "w1", F), ("+", "gelu", F), ("-", "w1", 0), ("+", "w2", H), ("-", "gelu", 0)]
    steps += [("-", "norm2", 0), ("+", "out", H), ("-", "w2", 0), ("-", "h", 0)]
    if mode == "none" and not train.fused_norm:  # nothing saves the block's input: an unfused norm
        # copies it to fp32, the residual add saves nothing; the model's loop drops it on return
        steps += [("-", "in", 0)]
    return tuple(st for st in steps if not (st[0] == "-" and st[1] in kept))


def block_backward_temp_bytes(m: ModelSpec, train: TrainSpec) -> int:
    """Gradients of activations alive at once inside one block's backward, at its largest: in
    the MLP, the gradient of the down projection's input and the two it splits into (SwiGLU's
    gate and up branches; GELU: one), with the residual stream's gradient; less the down
    projection's saved input, which autograd releases once that matmul's backward has run
    (before the branch gradients are made: a node's saved tensors go when it returns), so the
    bytes a block keeps (block_saved_bytes) plus these are the block's backward peak. Held
    against FSDPMemTracker under FakeTensorMode (tests/test_memory.py).

    Liger's fused SwiGLU (`fused_swiglu`) writes its two branch gradients into its saved inputs
    (ops/swiglu.py at v0.8.0) and allocates nothing, so its block peaks in the down projection's
    backward, before that input goes; the branch gradients are counted as new tensors all the
    same: without them ml-engineering's 64k-256k rows
    fall 10% below the reserved memory they measured, a reserve the allocator model does not
    explain yet (docs/accuracy-notes.md 9m)."""
    B, sb = act_dtype_bytes(train), train.seq_len * train.micro_batch
    k = m.experts_per_token if m.num_experts else 1
    branches = 3 if m.mlp == "swiglu" else 2
    temp = k * branches * B * sb * m.ffn_hidden + stream_dtype_bytes(train) * sb * m.hidden
    if not train.fused_swiglu and not compiled_float8_recasts(m, train):
        # the down projection's input, freed before the branches are made (compiled float8
        # linears keep none: it is made again in backward, and lives through its GEMMs)
        temp -= k * (1 if train.te_float8 else B) * sb * m.ffn_hidden
    if train.te_float8:  # the widest linear's output gradient cast to float8 and transposed
        temp += 2 * sb * max(m.ffn_hidden, m.q_hidden + 2 * m.kv_hidden if m.qkv_fused else max(m.hidden, m.q_hidden))
    return temp


def head_saved_bytes(m: ModelSpec, train: TrainSpec) -> int:
    """The final norm keeps what a block's norm keeps; the head keeps the norm's output (under
    autocast, the 16-bit copy autocast makes of it)."""
    B, sbh = act_dtype_bytes(train), train.seq_len * train.micro_batch * m.hidden
    return norm_saved_per_token(train, stream_dtype_bytes(train)) * sbh + B * sbh


def norm_saved_per_token(train: TrainSpec, B: int) -> int:
    """Bytes per element a norm keeps besides its statistics: its input (fused kernel), or the
    fp32 upcast input and the normalized output: in fp32 for the composite implementation
    F.rms_norm falls back to on CPU (torch 2.13's saved tensors), in the input's dtype for a
    module that casts back before multiplying by the weight (torchtitan/models/norms.py RMSNorm,
    `self._norm(x.float()).type_as(x) * self.weight`: 4 + B; MemTracker, tests/test_memory.py)."""
    if train.fused_norm:
        return B
    return 4 + (4 if train.norm_output_fp32 else B)


def block_activation_terms(m: ModelSpec, train: TrainSpec) -> dict[str, int]:
    """Bytes one block saves for backward with no recomputation, term by term.

    With `train.compile` (torch.compile per block) the saved set is what AOTAutograd's min-cut
    partitioner (torch/_functorch/partitioners.py, min_cut_rematerialization_partition, which
    inductor uses) keeps: cheap pointwise results are recomputed in backward.

    Korthikanti et al. 2022 eq. (1) gives sbh(34 + 5as/h) for a GPT block (MHA, GELU, f = 4h,
    dropout, 16-bit); these terms reduce to exactly that and generalise it.
    """
    s, b, h, f, a = train.seq_len, train.micro_batch, m.hidden, m.ffn_hidden, m.num_heads
    q, kv, B, S = m.q_hidden, m.kv_hidden, act_dtype_bytes(train), stream_dtype_bytes(train)
    sb = s * b
    stats = 8 * sb if m.norm == "layernorm" else 4 * sb  # fp32 mean/rstd saved by each norm
    t: dict[str, int] = {
        # torch.compile (each block compiled) fuses the norm as a fused kernel would
        # the norms read the residual stream: under autocast in the master dtype
        "norm_inputs": 2 * ((S if train.compile else norm_saved_per_token(train, S)) * sb * h + stats),
        "qkv_input": B * sb * h,
        # the attention kernel keeps q, k and v; with expands_kv k and v are its q-wide copies
        # (Hugging Face's repeat_kv), RoPE's k and the value projection's output then freed
        "q_k_v": B * sb * (q + 2 * (q if expands_kv(m, train) else kv)) + fused_qkv_rope_extra_bytes(m, train),
        # a flash kernel's output is (b, s, h, d) in memory (SDPA's flash allocates it like q,
        # which RoPE leaves (b, s, h, d) in HF, torchtitan and the trainer): the projection keeps
        # a (b, s, h·d) view of what the kernel saved (HF's `reshape(...).contiguous()` and
        # torchtitan's `.contiguous()` are no-ops); the math path's output is copied first
        "attn_out_proj_input": 0 if train.attention_out_view else B * sb * q,
        "mlp_input": B * sb * h,
    }
    if m.qk_norm:  # q_norm and k_norm keep their inputs (the q and k projections' outputs), as
        # the block's norms keep theirs, and a statistic per head and token; under autocast the
        # norm runs in fp32 (torch 2.13's CUDA autocast op list; the trainer's RMSNorm casts its
        # input itself, as 2.11 has no autocast rule for rms_norm), so the kept input is its fp32 copy
        # (compiled, the casts fuse into the norm's kernel and the 16-bit input is what is kept)
        rows, QB = sb * (a + m.num_kv_heads), 4 if train.autocast and not train.compile else B
        t["qk_norm_inputs"] = (QB if train.compile else norm_saved_per_token(train, QB)) * sb * (q + kv) + 4 * rows
    if train.flash_attention:
        # the flash kernel saves its output and logsumexp, and RoPE's mul saves cos and sin
        t["attn_logsumexp"] = 4 * a * sb
        t["attn_output"] = B * sb * q
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
    # Liger's fused SwiGLU (train.fused_swiglu) keeps the same three.
    per_mlp = (2 if m.mlp == "gelu" else 3 if train.compile or train.fused_swiglu else 4) * B * sb * f
    if m.num_experts:  # torchtitan's MoE (models/common/moe.py, token_dispatcher.py at b36e4b6)
        k = m.experts_per_token
        t["router_logits"] = 4 * sb * m.num_experts  # the fp32 scores the softmax (sigmoid) keeps
        # the router runs under autocast to fp32: its matmul keeps the fp32 copies of its input
        # and weight (and the experts' int32 offsets), compiled too
        t["router_input"] = 4 * (sb * h + m.num_experts * h + m.num_experts)
        # topk's int64 indices (gather's), the sort's int64 order and the token index it gives (the
        # routed input's and scatter_add's), the sorted scores, the gathered scores (topk picks on
        # the scores plus the load-balancing expert bias, so its values are not them: compiled
        # too); eager also their fp32 sum (compiled, recomputed)
        t["routing"] = (8 + 8 + 8 + 4 + 4) * sb * k + (0 if train.compile else 4 * sb)
        t["expert_inputs"] = k * B * sb * h
        # the experts' SwiGLU keeps four tensors compiled too (w1's, silu's, w3's outputs, their
        # product: the partitioner does not recompute silu beside the grouped GEMMs)
        t["mlp_hidden"] = k * (4 * B * sb * f if m.mlp == "swiglu" else per_mlp)
        # the scores multiply the experts' outputs in fp32: eager keeps the fp32 copy, compiled
        # (one fused kernel) the 16-bit output
        t["expert_outputs"] = (B if train.compile else 4) * k * sb * h
    else:
        t["mlp_hidden"] = per_mlp
    if train.autocast and not train.compile:
        # autocast casts a linear's fp32 input at each call (only leaf parameters are cached):
        # q, k and v each keep a 16-bit copy of the norm's output (one when fused), SwiGLU's w1
        # and w3 one each (MoE: the router's; the experts' inputs are routed copies, counted
        # above, not checked against a run). Compiled, AOTAutograd keeps one copy per norm.
        t["qkv_input"] = (1 if m.qkv_fused else 3) * B * sb * h
        t["mlp_input"] = (2 if m.mlp == "swiglu" and not m.num_experts else 1) * B * sb * h
    if train.te_float8:
        _te_float8_saves(t, m, sb, B)
    elif compiled_float8_recasts(m, train):
        _compiled_float8_saves(t, m, sb, B)
    return t


def compiled_float8_recasts(m: ModelSpec, train: TrainSpec) -> bool:
    """Whether torch.compile's partitioner saves a block's linear inputs as torchao's float8
    casts do (_compiled_float8_saves): compiled torchao linears whose weight gradient is a
    float8 GEMM (tensorwise and rowwise; rowwise-gw-hp's is 16-bit and reads the 16-bit inputs,
    which are then kept as without float8), a dense MLP (torchao leaves grouped experts in 16
    bits), a flash kernel, no autocast, dropout or Liger SwiGLU (an opaque kernel whose output
    the partitioner cannot make again; none traced)."""
    return (train.compile and train.float8 and train.float8_recipe in ("tensorwise", "rowwise")
            and not m.num_experts and train.flash_attention and not train.autocast and not m.dropout
            and not train.fused_swiglu)


def _compiled_float8_saves(t: dict[str, int], m: ModelSpec, sb: int, B: int) -> None:
    """torch.compile over torchao's float8 linears (compiled_float8_recasts): the backward's
    weight-gradient GEMMs read each linear's input in float8, which the min-cut partitioner
    (torch/_functorch/partitioners.py, inductor's) makes again in backward from what the block
    keeps anyway where it can: the norms' outputs (q/k/v's and the MLP's inputs) from the kept
    residual stream and per-row statistics, the down projection's input from the kept w1 (and
    w3) outputs; none is kept. The output projection's input, the attention kernel's output (kept
    for the kernel's backward in 16 bits), is kept a second time as its float8 cast (1 byte per
    element). The scales are scalars (tensorwise) or a row vector (rowwise), not counted.
    PyTorch's partitioner on the trainer's block with torchao 0.18's Float8Linear
    (tests/test_memory.py): 16-bit inputs 2 x B·sbh and B·sbf fewer, a float8 sbq more."""
    t["qkv_input"] = 0
    t["mlp_input"] = 0
    t["mlp_hidden"] -= B * sb * m.ffn_hidden
    t["attn_out_proj_input"] = sb * m.q_hidden


def _te_float8_saves(t: dict[str, int], m: ModelSpec, sb: int, B: int) -> None:
    """TransformerEngine's float8 linear (transformer_engine/pytorch/module/linear.py at v0.10,
    `ctx.save_for_backward(..., inputmat_t, weight, weight_t_fp8, ...)`) keeps for backward the
    float8 transpose of its input (1 byte per element) instead of the 16-bit input, and the float8
    transpose of its weight (1 byte per weight element, a new tensor every forward). The linear
    inputs nothing else saves (the norms save their own inputs; GELU/SiLU theirs) become one
    1-byte copy per linear that reads them: q/k/v's input (three linears, one when the model
    fuses them), the output projection's, the MLP's input (SwiGLU's w1 and w3: two) and the down
    projection's input (the last MLP term). Held against MemTracker on the trainer's block with
    every linear keeping what TransformerEngine's keeps (tests/test_memory.py)."""
    h, q, f, kv = m.hidden, m.q_hidden, m.ffn_hidden, m.kv_hidden
    t["qkv_input"] = (1 if m.qkv_fused else 3) * sb * h
    t["attn_out_proj_input"] = sb * q
    t["mlp_input"] = (2 if m.mlp == "swiglu" else 1) * sb * h
    t["mlp_hidden"] -= (B - 1) * sb * f
    mlp_weights = (3 if m.mlp == "swiglu" else 2) * h * f
    t["float8_weight_transposes"] = h * (q + 2 * kv) + h * q + mlp_weights


@lru_cache(maxsize=4096)
def block_saved_bytes(m: ModelSpec, train: TrainSpec, mode: str) -> int:
    """What one block keeps between forward and backward under a recomputation mode."""
    h, f = m.hidden, m.ffn_hidden
    B, sb = act_dtype_bytes(train), train.seq_len * train.micro_batch
    full = block_activation_terms(m, train)
    if mode == "none":
        return sum(full.values())
    S = stream_dtype_bytes(train)
    if mode == "full":
        return S * sb * h  # the block's input only
    if mode == "attention":  # Megatron's selective: the attention core is recomputed, the
        # copies of k and v (expands_kv) with it: the checkpoint keeps RoPE's k and v, kv wide
        copies = 2 * B * sb * (m.q_hidden - m.kv_hidden) if expands_kv(m, train) else 0
        return sum(v for k, v in full.items() if k not in ("attn_softmax", "attn_dropout")) - copies
    if mode == "selective":
        # torchtitan op-level SAC (zplan/policy.py): the block's input, the outputs of the saved
        # matmuls and of the attention kernel; pointwise ops are recomputed. An MoE block keeps
        # no expert tensor (policy.selective_saved_matmuls) but its router's topk, which the save
        # list names: the values (fp32, the router's scores) and int64 indices, k per token.
        # Compiled, the partitioner keeps a saved op's output only where backward reads it: topk's
        # values are dropped (the router's scores are gathered again), its indices kept; so is
        # SwiGLU's w2 output (PyTorch's partitioner on the trainer's block, tests/test_memory.py).
        moe = bool(m.num_experts)
        names = policy.selective_saved_matmuls(m.mlp, moe, m.qkv_fused)
        if train.compile:  # backward never reads the down projection's output (it flows into
            # the residual add alone): the partitioner drops it, float8 linears or not
            names = tuple(n for n in names if n != "w2")
        saved = S * sb * h + sum(B * sb * w for w in arch.matmul_widths(m, names))
        if train.sac_saves_attention:
            saved += B * sb * m.q_hidden + (4 * m.num_heads * sb if train.flash_attention else 0)
        if moe:
            saved += (8 if train.compile else 4 + 8) * sb * m.experts_per_token
        return saved
    raise ValueError(mode)


@lru_cache(maxsize=4096)
def block_recompute_bytes(m: ModelSpec, train: TrainSpec, mode: str) -> int:
    """What one block under `mode` holds in its own backward beyond what it kept from its
    forward (block_saved_bytes): the tensors its recomputation makes again, those a block
    without recomputation keeps (block_saved_bytes "none") other than the ones the mode kept
    and the recomputation reads instead, less what the replay drops of what the mode kept. A
    difference of sets, not of byte counts. Full checkpointing keeps the block's input, which
    is among a block's own saved tensors only where its norm keeps its input: a fused norm, or
    a composite one on an fp32 stream (`x.float()` is then the input itself; on a 16-bit stream
    it keeps an fp32 copy). Selective checkpointing (torch.utils.checkpoint's policy, early stop
    on) keeps the input and the outputs of wq, wv, w1 (w2: SwiGLU), the attention and its
    logsumexp: the recomputed graph reads the input (where the norm keeps it), wv's, w1's, the
    attention's and the logsumexp as they are; wq's it either reads (where nothing transforms
    it first) or the replay takes back from the policy's cache and drops after RoPE, and wv's
    likewise after copying it to every query head (expands_kv): either way those bytes are
    not new. w2's is never replayed (early stop) and stays. FSDPMemTracker on the trainer
    (tests/test_fake_trace.py): the peak in a block's backward to the byte less the loss's scalars,
    bf16 and fp32, with the query heads wider than the hidden size and not.
    Where the sets are not derived (compiled blocks, float8 linears, MoE, a fused q/k/v
    projection, attention without a flash kernel, autocast, dropout, no early stop, Megatron's
    attention mode), the difference of the byte counts."""
    none_b = block_saved_bytes(m, train, "none")
    kept = block_saved_bytes(m, train, mode)
    if mode == "none":
        return 0
    if mode not in ("full", "selective") or not _recompute_sets_derived(m, train):
        return none_b - kept
    B, S, sb = act_dtype_bytes(train), stream_dtype_bytes(train), train.seq_len * train.micro_batch
    x = S * sb * m.hidden if train.fused_norm or S == 4 else 0  # the kept input, if the norm keeps it
    if mode == "full":
        return none_b - x
    names = policy.selective_saved_matmuls(m.mlp, False, False)
    read = sum(B * sb * w for w in arch.matmul_widths(m, tuple(n for n in names if n != "w2")))
    if train.sac_saves_attention:
        read += B * sb * m.q_hidden + 4 * m.num_heads * sb
    return none_b - x - read


def _recompute_sets_derived(m: ModelSpec, train: TrainSpec) -> bool:
    """Where block_recompute_bytes derives a recomputation's sets (tests/test_fake_trace.py):
    eager 16-bit linears, a dense MLP, separate q/k/v projections, a flash kernel, no autocast
    or dropout, early stop."""
    return not (train.compile or train.float8 or train.te_float8 or m.num_experts or m.qkv_fused
                or not train.flash_attention or train.autocast or m.dropout
                or not policy.early_stop_applies(train))


def kv_cache_bytes(m: ModelSpec, train: TrainSpec) -> int:
    """What one block's entry of the cache the model returns (TrainSpec.kv_cache, Hugging Face's
    use_cache in training) keeps referenced: the keys after RoPE, a new tensor (without RoPE a
    view of the key projection's output), and the values, a view of the value projection's
    output; views keep their whole storage, so with q, k and v as one linear the cache keeps
    that linear's whole output (HF's `past_key_value = (key_states, value_states)`,
    modeling_llama.py; GPT-2's `present = (key, value)` from `c_attn(...).split`).
    Derivation: docs/formulas.md section 3."""
    B, sb, kv = act_dtype_bytes(train), train.seq_len * train.micro_batch, m.kv_hidden
    if m.qkv_fused:
        return B * sb * (m.q_hidden + 2 * kv) + (B * sb * kv if m.position == "rope" else 0)
    return 2 * B * sb * kv


def kv_cache_saved_bytes(m: ModelSpec, train: TrainSpec, mode: str) -> int:
    """Of a block's cache entry (kv_cache_bytes), what the block keeps for its backward anyway
    under recomputation `mode` (block_saved_bytes counts it), so the cache adds nothing while the
    block's activations live: all of it without recomputation ("none", "attention": the
    attention kernel saves its q, k and v, the cache's own tensors); nothing under "full" (the
    block keeps its input alone); under "selective" the value storage where the policy keeps the
    value projection's output (the fused q/k/v output), and the keys where they are a view of a
    kept output (no RoPE), never RoPE's output, which is recomputed."""
    if mode == "none":  # with copies (expands_kv) the kernel keeps those instead
        return 0 if expands_kv(m, train) else kv_cache_bytes(m, train)
    if mode == "attention":  # the checkpointed core keeps its inputs: q, RoPE's k and v
        return kv_cache_bytes(m, train)
    if mode != "selective":
        return 0
    B, sb, kv = act_dtype_bytes(train), train.seq_len * train.micro_batch, m.kv_hidden
    names = policy.selective_saved_matmuls(m.mlp, bool(m.num_experts), m.qkv_fused)
    if m.qkv_fused:
        return B * sb * (m.q_hidden + 2 * kv) if "wqkv" in names else 0
    rope = m.position == "rope"
    return (B * sb * kv if "wv" in names else 0) + (B * sb * kv if "wk" in names and not rope else 0)


def fused_qkv_rope_extra_bytes(m: ModelSpec, train: TrainSpec) -> int:
    """What a fused q/k/v projection (ModelSpec.qkv_fused) keeps beyond q, k and v where RoPE
    makes q and k new tensors: the attention kernel saves RoPE's q and k and v, a view of the
    fused output, whose whole storage (q + 2kv wide) the view keeps; so the block keeps that
    storage and RoPE's q and k (q + kv). Without RoPE (MPT's ALiBi, GPT-2's learned positions)
    q, k and v are all views of the one storage: nothing more; with the key/value heads copied
    to the query heads (expands_kv) the kernel saves the copies and not the view; where q/k
    norms keep their inputs (compiled, fused, or an fp32 stream), those inputs are q's and k's
    part of the storage, which qk_norm_inputs counts already. Eager and compiled alike (the
    partitioner keeps the view too): PyTorch's partitioner and saved-tensor hooks on the
    trainer's block with a fused projection (tests/test_memory.py)."""
    if not m.qkv_fused or m.position != "rope" or expands_kv(m, train):
        return 0
    B = act_dtype_bytes(train)
    if m.qk_norm and (train.compile or train.fused_norm or (B == 4 and not train.autocast)):
        return 0  # the q/k norms keep their inputs, views of the fused output: qk_norm_inputs counts them
    return B * train.seq_len * train.micro_batch * (m.q_hidden + m.kv_hidden)


def block_kept_tensors(m: ModelSpec, train: TrainSpec, mode: str) -> tuple[int, ...] | None:
    """The tensors of over 1 MiB one block keeps from its forward to its backward under `mode`,
    bytes, in forward order, as block_activation_terms and block_saved_bytes count them (their
    sum is block_saved_bytes less the statistics, the logsumexp and RoPE's tables): none: each
    norm's input (the composite norm's fp32 copy and normalized output apart), q/k/v's input,
    q, k, v, the attention output, the MLP's input and hidden tensors; full: the block's input;
    selective: its input, the outputs the policy saves and the attention output. None where the
    terms are not split into tensors (MoE, dropout, attention without a flash kernel, compiled,
    float8, autocast, a returned cache (kv_cache: held past the block's backward), every-k and
    attention modes). q/k norms keep their inputs (the q and k projections' outputs) as the
    block's norms keep theirs."""
    if (m.num_experts or m.dropout or not train.flash_attention or train.compile or train.float8
            or train.autocast or train.kv_cache or expands_kv(m, train) or mode not in ("none", "full", "selective")):
        return None
    sb, B, S = train.seq_len * train.micro_batch, act_dtype_bytes(train), stream_dtype_bytes(train)
    h, q, kv = m.hidden, m.q_hidden, m.kv_hidden
    block_input = S * sb * h
    if mode == "full":
        out = [block_input]
    elif mode == "selective":
        out = [block_input] + [B * sb * w for w in arch.matmul_widths(
            m, policy.selective_saved_matmuls(m.mlp, qkv_fused=m.qkv_fused))]
        out += [B * sb * q] if train.sac_saves_attention else []
    else:
        terms = block_activation_terms(m, train)
        def norm(width: int, b: int) -> list[int]:
            return [b * sb * width] if train.fused_norm else [4 * sb * width, (norm_saved_per_token(train, b) - 4) * sb * width]
        qk = norm(q, B) + norm(kv, B) if m.qk_norm else []
        fused = [B * sb * (q + 2 * kv)] if fused_qkv_rope_extra_bytes(m, train) else []  # the fused output, whole
        out = norm(h, S) + [terms["qkv_input"]] + qk + fused + [B * sb * q, B * sb * kv] + ([] if fused else [B * sb * kv]) + [
            terms["attn_output"], terms["attn_out_proj_input"]]
        out += norm(h, S) + [terms["mlp_input"]]
        out += [B * sb * m.ffn_hidden] * (terms["mlp_hidden"] // (B * sb * m.ffn_hidden))
    return tuple(b for b in out if b > 1 << 20)


def block_recompute_tensors(m: ModelSpec, train: TrainSpec, mode: str) -> tuple[int, ...] | None:
    """The tensors of over 1 MiB a checkpointed block's recomputation makes again, bytes, in
    forward order: the no-recomputation list (block_kept_tensors "none") less what `mode` kept
    and the replay reads, the sets block_recompute_bytes derives (full: the block's input where
    the norm keeps it; selective: that, wq's, wv's and w1's outputs and the attention's). None
    where block_recompute_bytes does not derive the sets or the list does not name them one by
    one (a fused q/k/v projection, q/k norms): the caller then takes the whole list."""
    none = block_kept_tensors(m, train, "none")
    if mode == "none":
        return ()
    if none is None or mode not in ("full", "selective") or m.qk_norm or not _recompute_sets_derived(m, train):
        return None
    B, S, sb = act_dtype_bytes(train), stream_dtype_bytes(train), train.seq_len * train.micro_batch
    out = list(none)
    drop = [S * sb * m.hidden] if train.fused_norm or S == 4 else []  # the kept input, first in the list
    if mode == "selective":
        names = [n for n in policy.selective_saved_matmuls(m.mlp) if n != "w2"]
        drop += [B * sb * w for w in arch.matmul_widths(m, tuple(names))]
        drop += [B * sb * m.q_hidden] if train.sac_saves_attention else []
    for b in drop:
        if b > 1 << 20:
            out.remove(b)
    return tuple(out)


def loss_steps(train: TrainSpec, loss_fp32: bool = True) -> tuple[tuple[str, str, str, int], ...]:
    """The loss's tensors in the order they are made (+) and freed (-), bytes per logit:
    (phase, op, tensor, bytes). Eager, as the trainer computes it,
    `F.cross_entropy(logits.float().view(-1, V), y)` (zplan/trainer/loop.py):

    forward: the logits (param dtype, the head's output), their fp32 copy (`.float()`; none when
    they are fp32 already or not upcast), log_softmax's output (saved for backward); the copy is
    freed when cross_entropy returns, the logits too where the loop drops them before backward
    (`TrainSpec.logits_kept` False). backward: nll_loss's gradient (vocabulary-sized), then
    log_softmax's input gradient, both alive with the saved output inside log_softmax_backward;
    then the first two are freed and the upcast's backward casts the input gradient back to the
    logits' dtype. This is the order PyTorch's FSDPMemTracker records under FakeTensorMode
    (trainer/fake_trace.py), and the caching allocator sees (caching_allocator.py).

    Compiled (`train.compile_loss`): inductor's forward is row reductions only (max and
    log-sum-exp, per row) and keeps the logits for backward; its backward writes the logits'
    gradient in their dtype in one kernel (the upcast fused, the NLL scatter turned pointwise),
    whether or not the source upcasts (the code inductor generates for
    `F.cross_entropy(pred.float(), y)`, torch 2.13, shown by TORCH_LOGS=output_code;
    docs/formulas.md section 3). A fused cross-entropy kernel (`train.fused_loss`) holds the same:
    flash-attn's xentropy (v1.0.9 csrc/xentropy/xentropy_kernel.cu: fp32 per-row losses and
    log-sum-exp, the logits saved, `gI = at::empty_like(logits)` in backward unless in place)."""
    B = act_dtype_bytes(train)
    if train.logits_fp32 and B != 4:
        return _model_upcast_loss_steps(train, B)
    if train.loss_fused:
        return (("forward", "+", "logits", B), ("backward", "+", "logits grad", B))
    L = 4 if loss_fp32 else B
    upcast = 4 if loss_fp32 and B != 4 else 0
    shifted = L if train.loss_shifted_copy else 0  # fp32 logits from the model (B = 4 here): _model_upcast_loss_steps
    steps = [("forward", "+", "logits", B)]
    if upcast:
        steps.append(("forward", "+", "fp32 logits", upcast))
    if shifted:
        steps.append(("forward", "+", "shifted logits", shifted))
    steps.append(("forward", "+", "log_softmax", L))
    if shifted:
        steps.append(("forward", "-", "shifted logits", shifted))
    if upcast:
        steps.append(("forward", "-", "fp32 logits", upcast))
    if train.logits_dropped:
        steps.append(("forward", "-", "logits", B))
    steps += [("backward", "+", "nll grad", L), ("backward", "+", "log_softmax grad", L),
              ("backward", "-", "nll grad", L), ("backward", "-", "log_softmax", L)]
    if shifted:  # the slice's backward: the whole logits' gradient, zero-filled, the shifted one copied in
        steps += [("backward", "+", "slice grad", shifted), ("backward", "-", "log_softmax grad", L)]
        return tuple(steps)  # (no cast back: the logits are fp32, the slice's gradient is theirs)
    if upcast:
        steps += [("backward", "+", "logits grad", B), ("backward", "-", "log_softmax grad", L)]
    return tuple(steps)


def loss_tensor_steps(train: TrainSpec, loss_fp32: bool, logits_elems: int) -> tuple[tuple[str, str, str, int], ...]:
    """The loss's tensors in the order they are made (+) and freed (-), in bytes over
    `logits_elems` logits: `loss_steps` scaled, or, with `train.loss_chunks` k > 1, torchtitan's
    chunked cross-entropy (components/loss.py chunked_cross_entropy_loss at e23bb70, after
    torchtune's CEWithChunkedOutputLoss; zplan/trainer/micro_batch.py runs the same), whose k
    sequence chunks of the whole logits (torch.chunk on the sequence: views) each run
    `F.cross_entropy(chunk.flatten(0, 1).float(), labels)` in turn, c = E/k logits each:

    forward, per chunk: the flattened copy (B·c: only where micro_batch > 1, the chunk then not
    viewable as rows), its fp32 copy (4·c, the copy freed once made), log_softmax's output (L·c,
    kept), the fp32 copy freed; the logits freed after the loss where the loop drops them (no
    chunk is saved). backward, the last chunk first (autograd runs the highest sequence number):
    nll_loss's gradient and log_softmax's input gradient (L·c each), the first and the chunk's
    saved output freed, the upcast's backward casting the gradient to B·c; then torch.chunk's
    backward concatenates the k chunk gradients into the logits' gradient (B·E) and frees them.
    The order PyTorch's MemTracker records on the trainer's loss, storage by storage
    (tests/test_loss_chunks.py; FSDPMemTracker over a whole step there too)."""
    k = train.loss_chunks
    if k == 1:
        return tuple((ph, op, name, per * logits_elems) for ph, op, name, per in loss_steps(train, loss_fp32))
    B = act_dtype_bytes(train)
    L = 4 if loss_fp32 else B
    upcast = 4 if loss_fp32 and B != 4 else 0
    c = logits_elems // k
    flat = B * c if train.micro_batch > 1 else 0
    steps: list[tuple[str, str, str, int]] = [("forward", "+", "logits", B * logits_elems)]
    for i in range(k):
        if flat:
            steps.append(("forward", "+", f"flattened chunk {i}", flat))
        if upcast:
            steps.append(("forward", "+", f"fp32 chunk {i}", upcast * c))
            if flat:
                steps.append(("forward", "-", f"flattened chunk {i}", flat))
        steps.append(("forward", "+", f"log_softmax {i}", L * c))
        if upcast:
            steps.append(("forward", "-", f"fp32 chunk {i}", upcast * c))
        elif flat:
            steps.append(("forward", "-", f"flattened chunk {i}", flat))
    if train.logits_dropped:
        steps.append(("forward", "-", "logits", B * logits_elems))
    grads = []
    for i in reversed(range(k)):
        steps += [("backward", "+", f"nll grad {i}", L * c), ("backward", "+", f"log_softmax grad {i}", L * c),
                  ("backward", "-", f"nll grad {i}", L * c), ("backward", "-", f"log_softmax {i}", L * c)]
        if upcast:
            steps += [("backward", "+", f"chunk grad {i}", B * c), ("backward", "-", f"log_softmax grad {i}", L * c)]
        grads.append((f"chunk grad {i}", B * c) if upcast else (f"log_softmax grad {i}", L * c))
    steps.append(("backward", "+", "logits grad", B * logits_elems))
    steps += [("backward", "-", name, b) for name, b in reversed(grads)]  # the input buffer's order
    return tuple(steps)


def loss_peak_bytes(train: TrainSpec, loss_fp32: bool, logits_elems: int) -> dict[str, int]:
    """Bytes alive in the loss at its largest over `logits_elems` logits, forward and backward:
    the running sum of `loss_tensor_steps` (`loss_bytes_per_logit` x logits without chunks)."""
    live, peak = 0, {"forward": 0, "backward": 0}
    for phase, op, _, b in loss_tensor_steps(train, loss_fp32, logits_elems):
        live += b if op == "+" else -b
        peak[phase] = max(peak[phase], live)
    return peak


def _model_upcast_loss_steps(train: TrainSpec, B: int) -> tuple[tuple[str, str, str, int], ...]:
    """`loss_steps` where the model returns fp32 logits (`TrainSpec.logits_fp32`, torchtitan's
    `self.output(h).float()`): the head's output in the param dtype, its fp32 copy -- the logits
    the loss gets and the loop keeps -- and the head's output freed at once (the copy's backward
    saves nothing). Eager: the loss's own `.float()` is a no-op, log_softmax saves its fp32
    output, the backward is the upcast's (the input gradient cast back to B bytes by the model's
    copy). Compiled or fused: the kernel saves the fp32 logits and writes their fp32 gradient,
    which the model's copy casts back -- after the kernel's saved logits are freed, where the
    loop holds none. With `loss_shifted_copy` (Hugging Face's shift of the logits, eager), the
    loss's forward holds the shifted copy beside the logits and log_softmax's output until it
    returns, and its backward a zero-filled gradient of the whole logits (SliceBackward0) with
    the shifted one copied in, before the upcast's backward casts it back."""
    steps = [("forward", "+", "head output", B), ("forward", "+", "logits", 4),
             ("forward", "-", "head output", B)]
    if train.loss_fused:
        steps.append(("backward", "+", "fp32 logits grad", 4))
        if train.logits_unreferenced:  # the kernel's saved logits go when its backward returns,
            steps.append(("backward", "-", "logits", 4))  # before the model's copy casts back
        return tuple(steps + [("backward", "+", "logits grad", B), ("backward", "-", "fp32 logits grad", 4)])
    shifted = train.loss_shifted_copy  # HF's `logits[..., :-1, :].contiguous()`: one logit fewer a sequence
    if shifted:
        steps.append(("forward", "+", "shifted logits", 4))
    steps.append(("forward", "+", "log_softmax", 4))
    if shifted:  # a local of the loss, gone when it returns
        steps.append(("forward", "-", "shifted logits", 4))
    if train.logits_dropped:
        steps.append(("forward", "-", "logits", 4))
    steps += [("backward", "+", "nll grad", 4), ("backward", "+", "log_softmax grad", 4),
              ("backward", "-", "nll grad", 4), ("backward", "-", "log_softmax", 4)]
    if shifted:  # the slice's backward: a zero-filled gradient of the whole logits, the shifted one copied in
        steps += [("backward", "+", "slice grad", 4), ("backward", "-", "log_softmax grad", 4),
                  ("backward", "+", "logits grad", B), ("backward", "-", "slice grad", 4)]
        return tuple(steps)
    return tuple(steps + [("backward", "+", "logits grad", B), ("backward", "-", "log_softmax grad", 4)])


BATCH_ID_TENSORS = 2  # the input ids and the labels, each a (micro_batch, seq_len) tensor
BATCH_ID_BYTES = 8  # int64: what a tokenizer and torch.randint produce, and nn.Embedding indexes with


def batch_ids_bytes(train: TrainSpec) -> int:
    """The micro-batch on the GPU: its input ids and labels, int64 (8 B a token each), from the
    host-to-device copy before the forward until the last backward returns; gone at the
    optimizer step, as zplan's trainer holds them (trainer/data.py Prefetcher.get: x and y,
    copied to the device per micro-batch, locals of the micro-batch loop); nn.Embedding's
    backward and cross_entropy save them by reference, no copy. PyTorch's FSDPMemTracker counts
    them (tests/test_fake_trace.py). Other loops hold them longer (torchtitan's train_step keeps
    the last micro-batch's through the optimizer step, recent versions every micro-batch's):
    not modelled, a few MB at most."""
    return BATCH_ID_TENSORS * BATCH_ID_BYTES * train.seq_len * train.micro_batch


def kept_logit_bytes(train: TrainSpec) -> int:
    """Bytes per logit of the logits a loop keeps (and a compiled or fused loss saves): the
    head's dtype, 4 where the model returns them in fp32 (`TrainSpec.logits_fp32`)."""
    return 4 if train.logits_fp32 else act_dtype_bytes(train)


def loss_bytes_per_logit(train: TrainSpec, loss_fp32: bool = True) -> dict[str, int]:
    """Bytes per logit alive in the loss at its largest, forward and backward: the running sum
    of `loss_steps`, which it is derived from. Eager, forward: the logits, their fp32 copy and
    log_softmax's output; backward: the logits (unless dropped), log_softmax's saved output,
    nll_loss's gradient and log_softmax's input gradient: 2 + 4 + 4 + 4 = 14 B for bf16 logits
    upcast (what PyTorch's FSDPMemTracker shows), 2 + 2 + 2 + 2 = 8 B in bf16; 12 B and 6 B where
    the loop drops the logits first. Compiled or fused: B forward, 2B backward. Where the model
    returns fp32 logits (`logits_fp32`): eager 8 B forward (the fp32 logits and log_softmax's
    output), 16 B backward kept and 12 B dropped; compiled or fused B+4 forward, 4+4+B backward
    kept and 8 B dropped."""
    live, peak = 0, {"forward": 0, "backward": 0}
    for phase, op, _, b in loss_steps(train, loss_fp32):
        live += b if op == "+" else -b
        peak[phase] = max(peak[phase], live)
    return peak


def liger_loss_tensors(m: ModelSpec, train: TrainSpec) -> tuple[int, ...]:
    """The tensors Liger-Kernel's fused linear cross-entropy allocates in the loss's forward,
    bytes (linear_loss_bytes' liger terms, one by one): the input gradient B·T·h, the weight
    gradient B·V·h, a chunk's logits B·c·V, and at the weight gradient's update the product
    B·V·h and its fp32 copy 4·V·h (none where B = 4). Liger-Kernel v0.8.0
    ops/fused_linear_cross_entropy.py; the allocator places them (memory_reserve.forward_residue)."""
    T, V, h, B = train.seq_len * train.micro_batch, m.vocab_size, m.hidden, act_dtype_bytes(train)
    c = policy.loss_chunk_tokens(T, V, h)
    return (B * T * h, B * V * h, B * c * V, B * V * h) + ((4 * V * h,) if B != 4 else ())


def linear_loss_bytes(m: ModelSpec, train: TrainSpec) -> dict[str, int]:
    """A linear loss (`train.linear_loss`): the head's matmul and the cross-entropy chunk by
    chunk (policy.loss_chunk_tokens, c tokens), each chunk's logit gradient turned at once into
    the head's input and weight gradients; the logits are never kept whole.

    kept, from the loss forward to the head's backward: the input gradient B·T·h (in place of the
    head's saved input, which head_saved_bytes counts: the same size) and the weight gradient
    B·V·h. forward, besides `kept`: the head's input B·T·h, alive as the loss's argument while
    its gradient fills, the 0-d fp32 loss, and at the chunk's largest moment:
      liger (Liger-Kernel v0.8.0 ops/fused_linear_cross_entropy.py, accum_dtype None): the chunk's
        logits B·c·V (the Triton kernel writes their gradient in place), and at
        `grad_weight += torch.mm(grad_logits_chunk.t(), _input_chunk).float()` the product B·V·h
        and its fp32 copy 4·V·h (none when B = 4: `.float()` returns the tensor itself);
      chunked (the trainer, zplan/trainer/linear_loss.py): the chunk's logits out of the matmul
        B·c·V and their fp32 working copy 4·c·V (one tensor when B = 4, beside two fp32 row
        vectors, 8·c), the weight gradient accumulated in place (addmm with out=). MemTracker
        on the trainer's head shows exactly these (tests/test_linear_loss.py).
    backward: the gradients scaled in place (Liger's element_mul_kernel; the trainer's mul_)."""
    T, V, h, B = train.seq_len * train.micro_batch, m.vocab_size, m.hidden, act_dtype_bytes(train)
    if train.linear_loss == "none":
        return {"kept": 0, "forward": 0, "backward": 0}
    c = policy.loss_chunk_tokens(T, V, h)
    kept = B * V * h
    if train.linear_loss == "liger":  # the chunk's logits, the update's product and fp32 copy
        temp = sum(liger_loss_tensors(m, train)[2:]) + 4 * T
    else:
        temp = B * c * V + (4 * c * V if B != 4 else 8 * c)
    # under autocast the head's input is cast before the loss (trainer/linear_loss.py): its fp32
    # original stays alive beside the copy
    arg = B * T * h + (stream_dtype_bytes(train) * T * h if train.autocast else 0)
    return {"kept": kept, "forward": kept + arg + 4 + temp, "backward": kept}


def logits_bytes(m: ModelSpec, train: TrainSpec, loss_fp32: bool = True) -> int:
    """Peak bytes of the loss over the logits: the larger of its forward and its backward (a
    linear loss: its forward, linear_loss_bytes)."""
    if train.linear_loss != "none":
        return linear_loss_bytes(m, train)["forward"]
    sbv = train.seq_len * train.micro_batch * m.vocab_size
    return max(loss_peak_bytes(train, loss_fp32, sbv).values())


@lru_cache(maxsize=4096)
def activation_breakdown(m: ModelSpec, train: TrainSpec, loss_fp32: bool = True) -> dict[str, int]:
    """Activation bytes per GPU for one micro-batch (data parallelism does not shard them): what
    the blocks and the head keep, and the larger of the loss and one block's recomputation. The
    step's peak combines these with the other pieces event by event (memory_timeline)."""
    L = m.num_layers
    per = [block_saved_bytes(m, train, block_mode(train, i, L)) for i in range(L)]
    saved = sum(per)
    recompute = max(block_recompute_bytes(m, train, block_mode(train, i, L)) for i in range(L))
    head = head_saved_bytes(m, train)
    lg = logits_bytes(m, train, loss_fp32)
    out = {"blocks_saved": saved, "head_inputs": head, "loss_or_recompute": max(lg, recompute),
           "batch_ids": batch_ids_bytes(train)}
    extra = out["batch_ids"]
    if train.kv_cache:  # what the returned cache adds beyond what the blocks keep (kv_cache_saved_bytes)
        out["kv_cache"] = sum(kv_cache_bytes(m, train) - kv_cache_saved_bytes(m, train, block_mode(train, i, L))
                              for i in range(L))
        extra += out["kv_cache"]
    if train.outputs_until_next_forward:  # the previous micro-batch's logits and cache, held
        out["previous_output"] = ((L * kv_cache_bytes(m, train) if train.kv_cache else 0)
                                  + train.seq_len * train.micro_batch * m.vocab_size * kept_logit_bytes(train))
        extra += out["previous_output"]
    out["total"] = saved + head + max(lg, recompute) + extra
    return out
