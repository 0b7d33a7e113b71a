"""The kernels of one sharding unit's forward, backward and recompute, and of the optimizer
step, as the trainer runs them (zplan/trainer/model.py, parallel.py); timed by zplan.kernels.

Bytes per token of the memory-bound kernels (B = activation bytes, h hidden, kv the K/V width,
f the MLP width, V the vocabulary), eager first, then torch.compile's fused pass:
  forward : RMSNorm 2hB x2 (composite fp32: (28+4B)h x2); RoPE on q and k 9(h+kv)B (mul x4,
            add/sub, stack over halves) or 2(h+kv)B fused, none with learned positions; the attention output transpose copy 2hB; SwiGLU silu + mul 5fB
            (3fB fused), GELU 2fB; two residual adds 6hB (fused into the norms: 8hB for both).
  backward: RMSNorm 5hB x2 (composite: (76+8B)h x2); RoPE 14(h+kv)B (2(h+kv)B fused); copy 2hB; SwiGLU 9fB (5fB fused),
            GELU 3fB; residual and shared-input gradient sums 15hB (8hB + 6hB fused); with
            biases, each bias gradient reads the output gradient (width x B).
  loss    : logits to fp32, log_softmax, nll: 14V bytes forward, 22V backward (fused: 2V, 4V).
  autocast (DDP/ZeRO-1 on fp32 weights): the norms and residual adds in the stream's dtype S;
            each linear's input cast at each call and each weight once per forward (2+S per
            element), their gradients cast back in backward.
Derivation: docs/formulas.md, section 6.
"""

from __future__ import annotations

from . import kernels as K
from . import muon, policy
from .activation_memory import expands_kv
from .arch import Unit
from .comm import gathers_for_recompute, regathered
from .scenario import PinnedMemo, Scenario
from .strategies import Strategy
from .units import DTYPE_BITS

Ops = list[K.Op]


def _b(dtype: str) -> int:
    return DTYPE_BITS[dtype] // 8


def _linears(sc: Scenario) -> list[tuple[str, int, int, int]]:
    """(name, out, in, rows per token) of one block's linears as the trainer builds them. MoE:
    each expert weight is one grouped GEMM over the k routed copies of every token
    (torch._grouped_mm over all experts at once, torchtitan's GroupedExperts at b36e4b6)."""
    m = sc.model
    h, q, kv, f = m.hidden, m.q_hidden, m.kv_hidden, m.ffn_hidden
    out = [("wq", q, h, 1), ("wk", kv, h, 1), ("wv", kv, h, 1), ("wo", h, q, 1)]
    mlp = [("w1", f, h), ("w3", f, h), ("w2", h, f)] if m.mlp == "swiglu" else [("w1", f, h), ("w2", h, f)]
    if m.num_experts:
        return out + [(f"{name} (grouped, {m.num_experts} experts)", o, i, m.experts_per_token)
                      for name, o, i in mlp]
    return out + [(name, o, i, 1) for name, o, i in mlp]


def _block(sc: Scenario, backward: bool, only: tuple[str, ...] | None = None,
           with_memory: bool = True, with_attention: bool = True) -> Ops:
    m, t, gpu = sc.model, sc.train, sc.hw.gpu
    tokens, s = t.seq_len * t.micro_batch, t.seq_len
    T = tokens
    act = t.precision.param
    B = _b(act)
    lin = "fp8" if t.float8 else act
    h, q, kv, f = m.hidden, m.q_hidden, m.kv_hidden, m.ffn_hidden
    S = _b(t.precision.master) if t.autocast else B  # the residual stream's element
    ops: Ops = []
    cast_elems, casts = 0, 0
    for name, o, i, r in _linears(sc):
        if only is None or name.split()[0] in only:
            T = tokens * r  # an expert's GEMMs run over the k routed copies of each token
            experts = m.num_experts if r > 1 else 1
            # torchao's float8 converter leaves GroupedExperts alone: the experts stay in 16 bits
            f8 = t.float8 and experts == 1
            if t.autocast:  # the weight, and the input where it is fp32 (the norm's output;
                # compiled, that cast is fused into the norm's kernel)
                from_stream = name.split()[0] in ("wq", "wk", "wv", "w1", "w3") and not (
                    m.qkv_fused and name in ("wk", "wv")) and not t.compile
                cast_elems += o * i + (T * i if from_stream else 0)
                casts += 1 + from_stream
            if backward and f8 and not t.te_float8:
                # torchao: dW written in the weight's dtype; rowwise-gw-hp runs it in 16 bits
                dw = act if t.float8_recipe == "rowwise-gw-hp" else lin
                ops += [K.linear(gpu, name, T, o, i, lin, act, True)[0],
                        K.gemm(gpu, f"{name} dW", o, i, T, dw, act,  # fp8 runs dW on T-contiguous operands
                               widths_aligned=K.aligned(dw, o, i, *((T,) if dw == "fp8" else ())))]
            else:
                ops += K.linear(gpu, name, T, o, i, lin if f8 else act, act, backward, groups=experts)
            # a fused q/k/v linear casts its input once (charged on wq)
            T_in = 0 if m.qkv_fused and name in ("wk", "wv") else T
            if t.te_float8 and f8:
                ops.append(float8_te_casts(gpu, name, T_in, T, o, i, B, backward, m.qkv_fused))
            elif f8:
                ops += torchao_float8_casts(gpu, t, name, T_in, T, o, i, backward, m.qkv_fused)
    T = tokens
    if m.num_experts and (only is None or "w1" in only):  # the router runs before the experts,
        # in fp32: torchtitan computes its gate under torch.autocast(dtype=torch.float32), and
        # PyTorch leaves TF32 off for matmuls by default (an fp32 GEMM on the CUDA cores)
        ops += K.linear(gpu, "router (fp32)", T, m.num_experts, h, "fp32", "fp32", backward)
        if t.autocast:  # autocast casts every expert's weights (the grouped linears above cast
            # one expert's each); the gate's fp32 autocast casts nothing (fp32 weights, and the
            # norm's output is fp32 under autocast)
            expert = (3 if m.mlp == "swiglu" else 2) * h * f  # one expert's weights
            cast_elems += (m.num_experts - 1) * expert
    if with_attention:
        if t.flash_attention:
            ops.append(K.attention(gpu, s, q, T, backward, t.attention_kernel, m.head_dim, act))
        else:
            heads = m.num_heads * t.micro_batch
            for _ in range(2 if backward else 1):
                ops.append(K.gemm(gpu, "attention QKᵀ", s * heads, s, m.head_dim, act, act))
                ops.append(K.gemm(gpu, "attention AV", s * heads, m.head_dim, s, act, act))
            ops.append(K.memory(gpu, "attention softmax", 4 * m.num_heads * s * T * B, 3))
    if expands_kv(m, t):
        # repeat_kv's copies of k and v to every query head (each reads kv, writes q wide);
        # backward sums their gradients back over the heads that share them (reads q, writes kv).
        # Outside with_attention: selective recomputation reruns the copies (SDPA's saved k and v
        # come from an op its policy does not keep) though not the attention kernel
        ops.append(K.memory(gpu, "k/v copies to the query heads (repeat_kv)", 2 * T * B * (q + m.kv_hidden), 2))
    if not with_memory:
        return ops
    swiglu = m.mlp == "swiglu"
    fk = f * (m.experts_per_token if m.num_experts else 1)  # MoE: the activation runs on k copies
    # a flash kernel's output is (b, s, h, d) in memory and read as a view; the math path's
    # (b, h, s, d) output is transposed into a contiguous copy
    copy = ("attention output copy", 0, 0) if t.attention_out_view else ("attention output copy", 2 * q, 1)
    if t.compile:
        if backward:
            rows = [("norms + residual (fused)", 8 * h, 2), ("gradient sums", 6 * h, 2),
                    ("RoPE (fused)", 2 * (q + kv), 1), copy, ("activation (fused)", (5 if swiglu else 3) * fk, 1)]
        else:
            rows = [("norms + residual (fused)", 8 * h, 2), ("RoPE (fused)", 2 * (q + kv), 1), copy,
                    ("activation (fused)", (3 if swiglu else 2) * fk, 1)]
    elif backward:
        # RoPE's backward (autograd through apply_rope): four half-width muls, a neg, two adds,
        # each strided half's slice_backward (zero fill, then the half), the halves' sum: 14 B
        rows = [("RoPE", 14 * (q + kv), 12), copy, _activation_row(m, t, backward),
                ("residual + gradient sums", 15 * h, 5)]
    else:
        rows = [("RoPE", 9 * (q + kv), 14), copy, _activation_row(m, t, backward), ("residual adds", 6 * h, 2)]
    if m.position != "rope":  # a learned position table is added once, in the embedding unit
        rows = [r for r in rows if not r[0].startswith("RoPE")]
    biases = _bias_widths(m)
    if backward and biases:  # autograd's addmm backward: grad_bias = grad_out.sum(0), one kernel each
        rows.append(("bias gradients", sum(biases), len(biases)))
    # compiled, each norm is one generated row reduction with the residual add it follows
    ops += [K.memory(gpu, n, per * (S if "residual" in n else B) * T, kern,
                     _norm_pace(gpu, t, h) if n.startswith("norms") else 1.0)
            for n, per, kern in rows if per]
    if m.num_experts:
        ops += moe_layer_ops(sc, backward)
    if not t.compile:
        per, kern = norm_bytes(t, S, backward)
        ops.append(K.memory(gpu, _norm_name(m, t), 2 * per * h * T, 2 * kern, _norm_pace(gpu, t, h)))
    if m.qk_norm:  # over q's and k's heads, in the activation dtype (compiled: one generated kernel
        # each); under autocast rms_norm runs in fp32 (trainer.model.RMSNorm): input up, output back
        fp32 = t.autocast and not t.compile  # compiled, the casts fuse into the norm's kernel
        per, kern = norm_bytes(t, 4 if fp32 else B, backward)
        # compiled: at the copy rate (quack's narrowest measured width, 256, is a 16 MB problem:
        # its rate says the size, not the width; q/k norms run over T x heads rows)
        ops.append(K.memory(gpu, "q/k " + _norm_name(m, t), per * (q + kv) * T, 2 * kern,
                            1.0 if t.compile else _norm_pace(gpu, t, m.head_dim)))
        if fp32:
            ops.append(K.memory(gpu, "q/k norm casts (autocast)", 2 * (B + 4) * (q + kv) * T, 4))
    if casts:
        ops.append(K.memory(gpu, "autocast casts", (B + S) * cast_elems, casts))
    return ops


def sort_bytes(n: int, key_bits: int) -> int:
    """HBM bytes of cub's radix sort of n (int64 key, int64 value) pairs: one pass per 8 key
    bits, each reading and writing the 16-byte pairs. torch.sort/argsort of int64 sorts all 64
    bits; index_put's sort of row indices (aten/src/ATen/native/cuda/Indexing.cu,
    index_put_with_sort_kernel) only the bits of the largest row index (index_bits)."""
    return 32 * n * -(-key_bits // 8)


def index_bits(rows: int) -> int:
    """Bits of the largest row index of a tensor of `rows` rows (at least 1)."""
    return max(1, (rows - 1).bit_length())


def moe_layer_ops(sc: Scenario, backward: bool) -> Ops:
    """The memory-bound work of an MoE layer around its experts' GEMMs, as torchtitan runs it
    (models/common/moe.py, token_dispatcher.py LocalTokenDispatcher, ops/scatter_add.py at
    b36e4b6; no expert parallelism), for T tokens, k experts each (N = T·k routed rows), width D,
    16-bit element B, E experts. Derivation: docs/formulas.md section 6, "MoE layer".

    Forward: the gate's fp32 copies of its input and weight (autocast to fp32; compiled, the norm
    writes the fp32 copy beside its output), routing (scores 8TE, the load-balancing expert bias
    added 8TE, topk 4TE + 12Tk, the routing map 2TE, the scores gathered, normalised and scaled
    by route_scale, the sorted scores and token indices: 96Tk + 16T), two sorts of N int64 pairs
    (argsort over every key bit; the deterministic scatter_add's index_put over the bits of T:
    sort_bytes), the tokens gathered into expert order (read and write N·D·B), the
    scores applied in fp32 (eager: to fp32, mul, back: (2B + 16)·ND in 3 kernels; compiled one
    kernel, 2B·ND) and the combine (`deterministic_scatter_add`, out of place: zeros T·D, its
    clone 2·T·D, the accumulation reading N·D and reading and writing T·D: 5B·TD + B·ND).
    Backward: the combine's gradient gathered back (2B·ND), the score product's backward (eager:
    to fp32 B+4, grad·score 8, grad·output 12 and its row sum 4, back to B 4+B: (2B + 32)·ND;
    compiled one kernel reading the gradient and the saved output, writing one: 3B·ND), the
    experts' two input gradients summed (3B·ND; compiled, fused into the scatter), the gather's
    backward (index_put accumulating into zeros, out of place: B·ND + 5B·TD; compiled 3B·TD), the
    routing's backward (the sorted scores' index_put, the scale and normalisation, topk's scatter
    and the softmax: 32TE + 118Tk) with two sorts (both index_puts accumulate in sorted order,
    over the bits of N and of T), and the gate's gradient casts back to 16 bits."""
    m, t, gpu = sc.model, sc.train, sc.hw.gpu
    T, B, D = t.seq_len * t.micro_batch, _b(t.precision.param), m.hidden
    E, k = m.num_experts, m.experts_per_token
    N, c = T * k, t.compile
    gate_casts = 0 if t.autocast else (B + 4) * E * D + (4 if c else B + 4) * T * D
    if not backward:
        routing = 22 * T * E + 96 * T * k + 16 * T + sort_bytes(N, 64) + sort_bytes(N, index_bits(T))
        moved = (2 * B + (2 * B if c else 2 * B + 16) + B) * N * D + 5 * B * T * D
        return [K.memory(gpu, "MoE gate casts to fp32", gate_casts, 0 if c or t.autocast else 2),
                K.memory(gpu, "MoE routing + sorts", routing, 14 if c else 32),
                K.memory(gpu, "MoE dispatch + combine", moved, 5 if c else 8)]
    routing = 32 * T * E + 118 * T * k + sort_bytes(N, index_bits(N)) + sort_bytes(N, index_bits(T))
    moved = ((2 * B + 3 * B + 2 * B) * N * D + 3 * B * T * D if c
             else (2 * B + (2 * B + 32) + 3 * B + B) * N * D + 5 * B * T * D)
    return [K.memory(gpu, "MoE gate gradient casts", 0 if t.autocast else (4 + B) * (E + T) * D,
                     0 if t.autocast else 2),
            K.memory(gpu, "MoE routing backward + sort", routing, 12 if c else 22),
            K.memory(gpu, "MoE combine + dispatch backward", moved, 4 if c else 10)]


def _activation_row(m, t, backward: bool) -> tuple[str, int, int]:
    """The MLP's activation function, eager: SwiGLU silu + mul 5f forward (silu reads w1's
    output and writes, mul reads it and w3's and writes), 9f backward in 3 kernels; fused
    (`fused_swiglu`, Liger's LigerSiLUMulFunction) one kernel each way, 3f forward (reads a, b,
    writes c) and 5f backward (reads dc, a, b; writes da, db; silu recomputed in registers);
    GELU 2f and 3f. Bytes per token in units of B; an MoE layer's on each of its k routed copies."""
    f = m.ffn_hidden * (m.experts_per_token if m.num_experts else 1)
    if m.mlp != "swiglu":
        return ("GELU", (3 if backward else 2) * f, 1)
    if t.fused_swiglu:
        return ("SwiGLU (fused)", (5 if backward else 3) * f, 1)
    return ("SwiGLU", (9 if backward else 5) * f, 3 if backward else 2)


def _bias_widths(m) -> list[int]:
    """Output widths of one block's linears that carry a bias (arch.block_shapes' bias vectors)."""
    h, kv, f = m.hidden, m.kv_hidden, m.ffn_hidden
    k = m.experts_per_token if m.num_experts else 1
    out = [m.q_hidden, kv, kv] if m.qkv_bias else []
    if m.linear_bias:
        out += [h] + [f, h] * k
    return out


def _norm_name(m, t) -> str:
    return ("RMSNorm" if m.norm == "rmsnorm" else "LayerNorm") + ("" if _fused(t) else " (composite fp32)")


def _norm_pace(gpu, t, width: int) -> float:
    """The share of the copy rate a norm's kernels reach over rows of `width`: PyTorch's native
    fused norm kernel (layer_norm, rms_norm) at the preset's measured eager_norm_efficiency; a
    compiled (generated) one at torch.compile's measured rate for that width
    (kernels.compiled_row_pace); a composite norm's elementwise kernels at the copy rate
    (docs/formulas.md 6)."""
    if t.compile:
        return K.compiled_row_pace(gpu, "norm", width)
    return K.eager_norm(gpu) if t.fused_norm else 1.0


def _fused(t) -> bool:
    return t.fused_norm or t.compile  # torch.compile generates one kernel per norm


def norm_bytes(t, B: int, backward: bool) -> tuple[int, int]:
    """HBM bytes per element and kernels of one norm, eager. Fused kernel: read x, write y (2B)
    forward; backward, read x and dy, write dx, and the weight gradient's kernel reads x and dy
    again (5B in 2 kernels: PyTorch's layer_norm_backward, aten/src/ATen/native/cuda/
    layer_norm_kernel.cu, GammaBetaBackward; RMSNorm's fused kernel shares it). Composite fp32 (torchtitan's RMSNorm,
    F.rms_norm's fallback): x.float() B+4, pow 8, mean 4, mul by rsqrt 8, type_as 4+B, x weight
    2B = 28+4B forward in 6 kernels (+2 on the statistics); backward, autograd's reverse of each:
    weight mul 2B and its reduction 4B, type_as B+4, rsqrt mul 8 + 16 for its reduction, mean 4,
    pow (x^1, x 2, x grad) 28, sum of the two gradients 12, float 4+B = 76+8B in 15 kernels."""
    if _fused(t):
        return (5 * B, 2) if backward else (2 * B, 1)
    return (76 + 8 * B, 15) if backward else (28 + 4 * B, 8)


def _head(sc: Scenario, backward: bool) -> Ops:
    m, t, gpu = sc.model, sc.train, sc.hw.gpu
    T, act = t.seq_len * t.micro_batch, t.precision.param
    B, V, h = _b(act), m.vocab_size, m.hidden
    S = _b(t.precision.master) if t.autocast else B  # the residual stream's element
    # compiled block by block (--compile-scope block, torchtitan's apply_compile), the final norm
    # outside the blocks runs eager; torch.compile(model) generates it with the rest
    tn = t if t.compile_scope == "model" else t.model_copy(update={"compile": False})
    per, kern = norm_bytes(tn, S, backward)
    ops = [K.memory(gpu, "final " + _norm_name(m, tn), per * h * T, kern, _norm_pace(gpu, tn, h))]
    if t.autocast:  # the head's input (unless compiled) and weight, their gradients back in backward
        ops.append(K.memory(gpu, "autocast casts", (B + S) * ((0 if t.compile else T * h) + V * h),
                            1 if t.compile else 2))
    if t.linear_loss != "none":
        return ops + _linear_loss(sc, backward)
    ops += K.linear(gpu, "output", T, V, h, act, act, backward)
    if t.loss_fused and t.logits_fp32 and B != 4:
        # the model's upcast (B+4 per logit each way, its own kernel), the fused kernel over fp32
        per, kern = ((8 + 4 + B) * V, 2) if backward else ((B + 4 + 4) * V, 2)
    elif t.loss_fused:  # one fused kernel each way, bf16 in and out (activation_memory.loss_bytes_per_logit)
        per, kern = (2 * B * V, 1) if backward else (B * V, 1)
    elif sc.assume.loss_fp32 and B != 4:
        per, kern = (22 * V, 4) if backward else (14 * V, 3)
    else:
        per, kern = (4 * B * V, 3) if backward else (2 * B * V, 2)
    # compiled, inductor's forward is row reductions over the vocabulary, at their measured rate
    # (its backward is one pointwise kernel: the copy rate)
    compiled = t.compile_loss and not t.fused_loss and not t.logits_fp32 and not backward
    pace = K.compiled_row_pace(gpu, "cross-entropy", V) if compiled else 1.0
    k = t.loss_chunks  # chunked (activation_memory.loss_tensor_steps): the same passes chunk by chunk
    ops.append(K.memory(gpu, "cross-entropy" + (" backward" if backward else ""), per * T, kern * k, pace))
    if k > 1 and backward:  # torch.chunk's backward: the chunks' gradients concatenated
        ops.append(K.memory(gpu, "chunk gradients concatenated", 2 * B * V * T, 1))
    elif k > 1 and t.micro_batch > 1:  # each chunk flattened into a copy before its upcast
        ops.append(K.memory(gpu, "chunks flattened (copies)", 2 * B * V * T, k))
    if t.loss_shifted_copy:  # HF's shift: a contiguous fp32 copy; backward, a zero fill and the copy back in
        ops.append(K.memory(gpu, "shifted logits" + (" backward" if backward else " (copy)"),
                            (12 if backward else 8) * V * T, 2 if backward else 1))
    return ops


def _linear_loss(sc: Scenario, backward: bool) -> Ops:
    """A linear loss (activation_memory.linear_loss_bytes): all three of the head's GEMMs run in
    the forward, chunk by chunk (policy.loss_chunk_tokens: c tokens): logits (c, V, h), the input
    gradient (c, h, V) and the weight gradient (V, h, c, accumulated). Memory-bound, per chunk:
    liger, the cross-entropy kernel reads each logit twice and writes its gradient in place (3B
    per logit, one kernel) and the weight gradient goes through an fp32 copy, `+=
    mm(...).float()` ((B+4) + (2B+4) bytes per weight element, 2 kernels; B = 4: 3B, 1); chunked
    (the trainer, zplan/trainer/linear_loss.py), in torch ops per logit: fp32 copy B+4, amax 4,
    sub_ 8, exp_ 8, sum 4, div_ by the row sum 8, div_ by the token count 8, back to B 4+B (B = 4:
    no copies): 48+2B in 8 kernels and 8 small ones (row vectors, the targets' logits); 40 in 6
    + 8; its weight-gradient GEMM accumulates into the gradient (addmm with out=, beta 1: the
    gradient read as well as written). Once: zeroed gradients (liger both, chunked the weight's). Backward:
    both gradients scaled in place (Liger skips a gradient of 1: grad_accum 1; the trainer
    always scales)."""
    m, t, gpu = sc.model, sc.train, sc.hw.gpu
    T, act = t.seq_len * t.micro_batch, t.precision.param
    B, V, h = _b(act), m.vocab_size, m.hidden
    if backward:
        if t.grad_accum == 1 and t.linear_loss == "liger":
            return []
        return [K.memory(gpu, "linear loss: gradients scaled", 2 * B * (T * h + V * h), 2)]
    c = policy.loss_chunk_tokens(T, V, h)
    liger = t.linear_loss == "liger"
    ops: Ops = [K.memory(gpu, "linear loss: gradients zeroed", B * (V * h + (T * h if liger else 0)),
                         2 if liger else 1)]
    for rows, n in ((c, T // c), (T % c, 1)):
        if not rows or not n:
            continue
        ok = K.aligned(act, V, h)  # a chunk's row count is no leading dimension
        chunk = [K.gemm(gpu, "output logits (chunked)", rows, V, h, act, act, widths_aligned=ok),
                 K.gemm(gpu, "output dX (chunked)", rows, h, V, act, act, widths_aligned=ok),
                 K.gemm(gpu, "output dW (chunked)", V, h, rows, act, act, accumulate=not liger,
                        widths_aligned=ok)]
        if liger:
            per, kern = 3 * B, 1
            w_b, w_k = ((B + 4) + (2 * B + 4), 2) if B != 4 else (3 * B, 1)
            chunk += [K.memory(gpu, "cross-entropy (Liger, in place)", per * rows * V, kern),
                      K.memory(gpu, "weight gradient through fp32", w_b * V * h, w_k)]
        else:
            per, kern = (48 + 2 * B, 16) if B != 4 else (40, 14)
            chunk.append(K.memory(gpu, "cross-entropy (chunk, torch ops)", per * rows * V, kern))
        ops += [K.repeat(op, n) for op in chunk]
    return ops


def _embed(sc: Scenario, backward: bool) -> Ops:
    m, t, gpu = sc.model, sc.train, sc.hw.gpu
    T, B = t.seq_len * t.micro_batch, _b(t.precision.param)
    if backward:
        return [K.memory(gpu, "embedding backward", m.vocab_size * m.hidden * B + 3 * T * m.hidden * B, 4)]
    return [K.memory(gpu, "embedding lookup", 2 * T * m.hidden * B, 1)]


def unit_ops(sc: Scenario, u: Unit, backward: bool) -> Ops:
    """The kernels of one unit's forward (or backward) for one micro-batch."""
    if u.blocks:
        return _block(sc, backward) * u.blocks
    ops: Ops = []
    if "embed" in u.name:
        ops += _embed(sc, backward)
    if "head" in u.name:
        ops += _head(sc, backward)
    return ops


def recompute_ops(sc: Scenario, u: Unit) -> tuple[Ops, float]:
    """What checkpointing recomputes in this unit's backward, and the share of blocks it covers."""
    mode, m = sc.train.checkpointing, sc.model
    if not u.blocks or mode == "none":
        return [], 0.0
    if mode == "attention":  # the trainer checkpoints the attention core (SDPA) and reruns it
        return _block(sc, False, only=(), with_memory=False), float(u.blocks)
    # the matmuls not kept (policy.recomputed_matmuls: with early stop not a dense block's last;
    # selective, torchtitan's op-level SAC, keeps every second one) and every pointwise op
    only = policy.recomputed_matmuls(m.mlp, mode, policy.early_stop_applies(sc.train), bool(m.num_experts),
                                     m.qkv_fused)
    if "wqkv" in only:  # the one q/k/v linear, priced as its three parts (_linears)
        only += ("wq", "wk", "wv")
    if mode == "selective":  # the attention forward reruns where the save list misses its kernel
        return _block(sc, False, only=only, with_attention=not sc.train.sac_saves_attention), float(u.blocks)
    if mode == "full":
        return _block(sc, False, only=only), float(u.blocks)
    # every-k, first-k: the blocks zplan/policy.py wraps, as the trainer does
    wrapped = policy.wrapped_blocks(sc.train, m.num_layers)
    return _block(sc, False, only=only), float(sum(wrapped[u.first_block: u.first_block + u.blocks]))


def fsdp_copies(sc: Scenario, st: Strategy, u: Unit, D: int, gather_dtype: str,
                ds_copied: tuple | None = None) -> tuple[Ops, Ops]:
    """FSDP2's copies around one unit's collectives (forward ops, backward ops): all-gather
    copy-in (the fp32 shard cast into the send buffer) and copy-out (the gathered flat buffer
    split into parameters), reduce-scatter copy-in (gradients cast to the reduce dtype), and on
    the reduced shard the cast back to the sharded dtype and the sum into an accumulated
    gradient (_shard_tail). Held op for op against fully_shard on four gloo ranks
    (tests/test_fsdp_copies.py).

    DeepSpeed's ZeRO-3 copies otherwise (deepspeed/runtime/zero/partition_parameters.py, 0.19):
    a call gathering several parameters (`_all_gather_coalesced` -> `_all_gather_dtype`) copies
    their shards into its send buffer with one torch.cat and each parameter out of the gathered
    partitions with one torch.cat (AllGatherCoalescedHandle.wait): FSDP2's bytes; a call of one
    (`_all_gather_sequential`) sends the shard itself and makes the parameter a view of the
    buffer it received: no copy. Which parameters its coordinator gathers in calls of several,
    forward and backward, and how many such calls (`ds_copied`: the unit's
    deepspeed.Coordination coalesced forward and backward elements, and calls) is simulated
    (comm.ds_coordination).

    A shard group of one rank (D = 1) runs no collective (PyTorch >= 2.9,
    FSDPParamGroup.unshard / wait_for_unshard and foreach_reduce at `world_size == 1`): each
    parameter's shard, cast to the gather dtype where it differs (a view otherwise), is copied
    into its unsharded parameter, one copy per parameter; the reduce-scatter input is copied
    into its output (`reduce_output.copy_(...)`).

    FSDP1 (`sc.train.fsdp1`; torch/distributed/fsdp/_flat_param.py and _runtime_utils.py, the same
    from PyTorch 2.1 to 2.13) gathers into its padded flat parameter, whose views the parameters
    are: the copy-in (the mixed-precision shard cast into `_mp_shard`) and no copy-out. Its
    backward is another path: autograd's SplitWithSizesBackward concatenates the unit's gradients
    into one flat gradient in the param dtype (`aten.cat`, 2P bytes an element), the post-backward
    hook casts it to the reduce dtype where they differ (P + R) and pre-divides it in place
    (`_div_if_needed`, 2R: gradient_divide_factors, above 1 from two ranks on), then reduce-scatters
    it; on the shard it post-divides and casts back to the sharded dtype (_fsdp1_copies). Held op
    for op against FullyShardedDataParallel on four gloo ranks (tests/test_fsdp_copies.py)."""
    gpu, p = sc.hw.gpu, sc.train.precision
    n = sc.padded_elems(u, D)
    g, r, store = _b(gather_dtype), _b(p.reduce), _b(p.master if sc.train.layout == "torch" else p.param)
    one = D == 1
    if sc.train.fsdp1 and ds_copied is None:
        return _fsdp1_copies(sc, st, u, D, g, r, store)
    per_param = len(u.shapes) if one else 1
    gather = [K.memory(gpu, "all-gather copy-out", 2 * g * n, per_param)]
    if not (one and g == store):
        gather.insert(0, K.memory(gpu, "all-gather copy-in", (store + g) * n // D, per_param))
    if ds_copied is None:
        bwd = list(gather) * (int(regathered(sc, st, u)) + int(gathers_for_recompute(sc, st, u)))
    else:  # DeepSpeed; one rank gathers nothing (_no_gather_coalesced)
        (fwd_params, back_params), (fwd_calls, back_calls) = ds_copied

        def copies(params: tuple[int, ...], calls: int) -> Ops:
            m = sum(-(-x // D) * D for x in params)
            if one or not m:
                return []
            return [K.memory(gpu, "all-gather copy-in", (store + g) * m // D, max(calls, 1)),
                    K.memory(gpu, "all-gather copy-out", 2 * g * m, len(params))]
        gather, bwd = copies(fwd_params, fwd_calls), copies(back_params, back_calls)
    bwd.append(K.memory(gpu, "reduce-scatter copy-in", (_b(p.param) + r) * n, 1))
    if one:
        bwd.append(K.memory(gpu, "reduce-scatter output copy (one rank)", 2 * r * n, 1))
    if ds_copied is not None:
        bwd.append(K.memory(gpu, "gradient accumulate (shard)", 3 * r * n // D, 1))
        return gather, bwd
    # FSDP2 (foreach_reduce): fp32 and bf16 reduce-scatters average in NCCL (ReduceOp.AVG, no
    # division kernel); fp16 ones divide before and after (_get_gradient_divide_factors)
    pre, post = gradient_divide_factors(sc.n) if p.reduce == "fp16" else (1, 1)
    if pre > 1:
        bwd.append(K.memory(gpu, "reduce-scatter input pre-divide", 2 * r * n, 1))
    bwd += _shard_tail(sc, n // D, r, store, post)
    return gather, bwd


def _shard_tail(sc: Scenario, shard: int, r: int, store: int, post: float, accumulates: bool = True) -> Ops:
    """What FSDP1 and FSDP2 do to a unit's reduced shard of `shard` elements: the post-division
    where it is above 1, the cast back to the sharded dtype where the reduce dtype differs, and,
    accumulating micro-batches, the sum into the gradient already there (every micro-batch
    but the first; a step's first assigns it; none where `accumulates` is false: FSDP1's
    NO_SHARD, whose gradient autograd accumulates)."""
    gpu, A = sc.hw.gpu, sc.train.grad_accum if accumulates else 1
    ops = []
    if post > 1:
        ops.append(K.memory(gpu, "gradient post-divide", 2 * r * shard, 1))
    if r != store:
        ops.append(K.memory(gpu, "gradient cast to the sharded dtype", (r + store) * shard, 1))
    if A > 1:
        ops.append(K.memory(gpu, "gradient accumulate (shard)", 3 * store * shard * (A - 1) // A, 1))
    return ops


def gradient_divide_factors(world: int) -> tuple[int, float]:
    """FSDP's gradient pre- and post-division over a data-parallel world of `world` ranks
    (shard group x replicas under HSDP): FSDP1's always (torch/distributed/fsdp/_init_utils.py,
    DefaultState._get_gradient_predivide_factor), FSDP2's under an fp16 reduce
    (_fsdp_collectives.py _get_gradient_divide_factors; fp32 and bf16 average in the
    collective): f doubles from 1 while `world` is a multiple of f and
    world / f > f; the post-division is world / f (1, 2: 2 and 1; 4: 2 and 2; 8: 4 and 2;
    64: 8 and 8; 3: 2 and 1.5). A factor of 1 divides nothing (`_div_if_needed`)."""
    f = 1
    while world % f == 0 and world / f > f:
        f *= 2
    return f, world / f


def _fsdp1_copies(sc: Scenario, st: Strategy, u: Unit, D: int, g: int, r: int, store: int) -> tuple[Ops, Ops]:
    """fsdp_copies under FSDP1 (its docstring), torch 2.1-2.13 _runtime_utils.py: g, r, store the
    gather, reduce and sharded dtypes' bytes; the unit's flat parameter of u.numel elements,
    padded to a multiple of D. Forward: the mixed-precision cast of the padded shard
    (`_use_low_precision_shard`). Backward: each gather again, the gradients' concatenation
    (SplitWithSizesBackward), the cast to the reduce dtype, the padding (`F.pad`, where the
    flat parameter does not divide), the pre-division; then on the shard the post-division,
    the cast back to the sharded dtype (`_cast_grad_to_param_dtype`) and, accumulating
    micro-batches, the sum into the saved shard. One rank per shard group (NO_SHARD): the
    whole gradient all-reduced over the replicas, divided before and after, cast back."""
    gpu, t = sc.hw.gpu, sc.train
    P, n = _b(t.precision.param), u.numel
    padded = -(-n // D) * D
    shard = padded // D
    pre, post = gradient_divide_factors(sc.n)
    gather = [] if g == store else [K.memory(gpu, "all-gather copy-in (mixed-precision shard)",
                                             (store + g) * shard, 1)]
    bwd = list(gather) * (int(regathered(sc, st, u)) + int(gathers_for_recompute(sc, st, u)))
    bwd.append(K.memory(gpu, "flat gradient (SplitWithSizesBackward cat)", 2 * P * n, 1))
    if r != P:
        bwd.append(K.memory(gpu, "flat gradient cast to the reduce dtype", (P + r) * n, 1))
    if D == 1:  # NO_SHARD: all-reduced whole, if across replicas
        reduced = n
    else:
        if padded != n:
            bwd.append(K.memory(gpu, "flat gradient padded (F.pad)", r * (n + padded), 1))
        reduced = shard
    if pre > 1:
        bwd.append(K.memory(gpu, "flat gradient pre-divide", 2 * r * (padded if D > 1 else n), 1))
    return gather, bwd + _shard_tail(sc, reduced, r, store, post, accumulates=D > 1)


def float8_te_casts(gpu, name: str, T_in: int, T: int, o: int, i: int, B: int, backward: bool,
                    qkv_fused: bool = False) -> K.Op:
    """TransformerEngine's delayed-scaling float8 linear (transformer_engine/pytorch/module/
    linear.py at v0.10): scales come from the amax history, so each cast is one
    fp8_cast_transpose_fused kernel that reads the 16-bit tensor and writes it in float8 and its
    float8 transpose, recording the amax on the way: B + 1 + 1 bytes per element (B the 16-bit
    tensor's bytes). Forward casts
    the input (T x i) and the weight (o x i; a new float8 weight every forward when
    is_first_microbatch is not passed); backward casts the output's gradient (T x o, with the bias
    gradient fused: fp8_cast_transpose_bgrad_fused) and reuses the weight transpose forward saved.
    `T_in`: the input's tokens this linear casts (0 for k and v of a fused q/k/v linear, whose
    one weight and one gradient cast carry k's and v's bytes, charged here without a launch)."""
    per = B + 2
    part = qkv_fused and name in ("wk", "wv")
    if backward:
        return K.memory(gpu, f"{name} float8 cast+transpose", per * T * o, 0 if part else 1)
    return K.memory(gpu, f"{name} float8 cast+transpose", per * (T_in * i + o * i), 0 if part else 2)


# torchao's eager cast (hp_tensor_to_float8_dynamic at 0.18, traced): abs, amax, the fp32 copy,
# the multiply by the scale, clamp, the float8 copy: 2+2, 2, 2+4, 4+4, 4+4, 4+1 bytes per element;
# the scale's own small ops make 12 launches in all per tensorwise cast, 15 per rowwise one
# (its per-row scales rounded to a power of two: log2, floor, exp2).
EAGER_CAST_BYTES = 33
EAGER_CAST_KERNELS = {"tensorwise": 12, "rowwise": 15}


def torchao_float8_casts(gpu, t, name: str, T_in: int, T: int, o: int, i: int, backward: bool,
                         qkv_fused: bool = False) -> Ops:
    """The casts, layout copies and rescales around one linear's float8 GEMMs under torchao's
    recipes (torchao/float8/config.py Float8LinearConfig.from_recipe_name, float8_linear.py
    matmul_with_hp_or_float8_args, float8_ops.py addmm_float8_unwrapped; the same at ao 890e0ac8,
    the H100 table's version, and 0.18.0). The linear saves its 16-bit input and weight and casts
    each float8 operand from them where a GEMM needs it: forward the input (T x i) and the weight
    (o x i); backward the output gradient for dX and again for dW, the weight for dX and the input
    for dW. Tensorwise scales once per tensor; a weight gathered in float8 (torchao's float8
    all-gather) arrives cast (its shard's cast before the gather is the all-gather's copy-in).
    Rowwise scales each operand along its GEMM's reduction axis; rowwise-gw-hp casts the output
    gradient once and the weight (tensorwise) and runs dW in 16 bits. Backward GEMMs run without
    fast accumulation, for which torchao calls the tensorwise cuBLAS kernel with unit scales and
    rescales a rowwise output by the outer product of the scale vectors (dX's T x i; dW's o x i
    under rowwise).

    Compiled (torchao's documented use): a cast is an amax reduction and a cast pass, 2 + 2 + 1 =
    5 bytes per element in 2 kernels; a rescale 2 + 2 bytes per output element; tensorwise: its
    output gradient cast once for both GEMMs and the input's float8 kept from forward, the weight
    cast in each pass unless it arrives cast (float8 all-gather: FSDP's pre-all-gather hook casts
    the shard, which the all-gather copy-in prices at its 1-byte width), the layout copies fused
    into the casts (a weight that arrives cast has none to fuse into: dX's GEMM copies it, 1 + 1
    bytes per element). Eager: each cast is EAGER_CAST_BYTES per
    element in EAGER_CAST_KERNELS launches; backward copies the transposed float8 operands
    contiguous (1 + 1 bytes per element of the weight, the output gradient and the input); a
    rescale writes the fp32 outer product and multiplies in place, 4 + 8 bytes per output element.
    Eager bytes held against torchao's Float8Linear traced op by op (tests/test_float8_rowwise.py).
    `T_in`: the input's tokens this linear casts (0 for k and v of a fused q/k/v linear, which
    share wq's input, its cast and its dX; their weight and gradient bytes are charged here
    without a launch)."""
    recipe, part = t.float8_recipe, qkv_fused and name in ("wk", "wv")
    k = 0 if part else 1
    gathered8 = t.float8_gather  # tensorwise with float8 all-gather: the weight arrives cast
    if t.compile:
        if recipe == "tensorwise":  # the weight: cast here unless it arrives cast from the gather,
            # when dX still copies it to the layout its GEMM takes (float8_ops.py preprocess_addmm)
            weight = 0 if gathered8 else 5 * o * i
            ops = [K.memory(gpu, f"{name} float8 casts", 5 * (T * o if backward else T_in * i) + weight,
                            (2 + (2 if weight else 0)) * k)]
            if backward and gathered8:
                ops.append(K.memory(gpu, f"{name} float8 weight layout copy", 2 * o * i, k))
            return ops
        if not backward:
            return [K.memory(gpu, f"{name} float8 rowwise casts", 5 * (T_in * i + o * i), 4 * k)]
        if recipe == "rowwise-gw-hp":
            return [K.memory(gpu, f"{name} float8 rowwise casts", 5 * (T * o + o * i), 4 * k),
                    K.memory(gpu, f"{name} dX rescale", 4 * T_in * i, k)]
        return [K.memory(gpu, f"{name} float8 rowwise casts", 5 * (2 * T * o + o * i + T_in * i), 8 * k),
                K.memory(gpu, f"{name} dX, dW rescale", 4 * (T_in * i + o * i), 2 * k)]
    c = EAGER_CAST_BYTES
    per = EAGER_CAST_KERNELS["tensorwise" if recipe == "tensorwise" else "rowwise"]
    weight = 0 if gathered8 else o * i
    if not backward:
        casts = [(T_in * i, k), (weight, k if weight else 0)]
        ops = [("float8 casts (eager)", c * sum(n for n, _ in casts), per * sum(n for _, n in casts))]
    elif recipe == "rowwise-gw-hp":  # the gradient rowwise, the weight tensorwise; dW in 16 bits
        ops = [("float8 casts (eager)", c * (T * o + o * i), (EAGER_CAST_KERNELS["rowwise"] + 12) * k),
               ("float8 layout copies", 2 * o * i, k), ("dX rescale", 12 * T_in * i, 2 * k)]
    else:
        elems = 2 * T * o + weight + T_in * i
        casts = (2 + bool(weight)) * k + (1 if T_in else 0)
        ops = [("float8 casts (eager)", c * elems, per * casts),
               ("float8 layout copies", 2 * (T * o + T_in * i + o * i), 3 * k)]
        if recipe == "rowwise":
            ops.append(("dX, dW rescale", 12 * (T_in * i + o * i), 4 * k))
    return [K.memory(gpu, f"{name} {what}", nbytes, kernels) for what, nbytes, kernels in ops if nbytes]


def optimizer_ops(sc: Scenario, local_sizes: list[int], grad_sizes: list[int] | None = None,
                  muon_split: tuple | None = None) -> Ops:
    """The optimizer step over this rank's state, `local_sizes` the element counts of the tensors
    it steps: gradient clipping first (`grad_clip_ops`, over `grad_sizes`, the local gradients,
    default `local_sizes`: every rank's whole gradients under ddp and zero1), then AdamW as the run's implementation
    launches it (`TrainSpec.optimizer_kernels`, torch layout): fused, one multi-tensor pass
    (torch.optim.AdamW(fused=True), the trainer's default) of 2P + G + 4S bytes per element; foreach,
    torch's eight multi-tensor ops (`ADAMW_FOREACH_OPS`, AdamW's default on CUDA), 4P + 2G + 14S;
    single, the same eight ops one parameter at a time (foreach=False; Composer's
    DecoupledAdamW). P, G: master dtype (weights and gradients), S: state dtype. zero layout:
    DeepSpeed's FusedAdam over its flat fp32 partition (one tensor) and its copy of the updated
    master partition into the 16-bit weights (master + param bytes, one kernel). Launches follow
    torch's multi_tensor_apply chunking (kernels.multi_tensor_launches). The trainer's
    --deterministic runs single where the plan says fused, a run option the plan does not carry:
    priced as planned (docs/formulas.md, section 6)."""
    t = sc.train
    ops = grad_clip_ops(sc, local_sizes if grad_sizes is None else grad_sizes)
    if t.optimizer == "muon" and muon_split is not None:  # muon.holdings' entry for this rank
        elems, tensors, adamw_sizes, matrices = muon_split
        return ops + _adamw_ops(sc, list(adamw_sizes)) + muon_ops(sc, elems, tensors, matrices)
    if t.optimizer == "adam8bit":
        return ops + _adam8bit_ops(sc, local_sizes)
    if t.optimizer == "sgd":
        return ops + _sgd_ops(sc, local_sizes)
    return ops + _adamw_ops(sc, local_sizes)


# torch.optim.SGD with momentum (no weight decay, its default) as the foreach path runs it
# (_multi_tensor_sgd, PyTorch 2.13): the momentum's _foreach_mul_ (2S), the gradient's
# _foreach_add_ into it (2S + G) and the weights' _foreach_add_ of it (2P + S): 2P + G + 5S bytes
# an element in three multi-tensor ops (depths 1, 2, 2); single runs the same three a tensor;
# fused (_fused_sgd_) loads p, g and the buffer and stores p and the buffer, 2P + G + 2S, in one.
SGD_FOREACH_DEPTHS = (1, 2, 2)


def _sgd_ops(sc: Scenario, local_sizes: list[int]) -> Ops:
    """SGD with momentum over these tensors as the run launches it (SGD_FOREACH_DEPTHS), P the
    master dtype, S the momentum's; the zero layout (DeepSpeed's torch.optim.SGD over its flat
    partition, as zplan's export configures it: momentum 0.9, no weight decay) foreach, and its
    copy into the 16-bit weights as AdamW's."""
    gpu, t = sc.hw.gpu, sc.train
    sizes = [n for n in local_sizes if n]
    if not sizes:
        return []
    P, S, n = _b(t.precision.master), _b(t.precision.optimizer), sum(sizes)
    if t.optimizer_kernels == "fused" and t.layout == "torch":
        ops: Ops = [K.memory(gpu, "SGD (fused)", (3 * P + 2 * S) * n, K.multi_tensor_launches(sizes, 3))]
    elif t.optimizer_kernels == "foreach" or t.layout == "zero":  # DeepSpeed builds torch.optim.SGD:
        # foreach, its CUDA default
        ops = [K.memory(gpu, "SGD (foreach, 3 ops)", (3 * P + 5 * S) * n,
                        sum(K.multi_tensor_launches(sizes, d) for d in SGD_FOREACH_DEPTHS))]
    else:
        ops = [K.memory(gpu, "SGD (per parameter, 3 ops)", (3 * P + 5 * S) * n, 3 * len(sizes))]
    if t.layout == "zero" and t.precision.master != t.precision.param:
        ops.append(K.memory(gpu, "weight copy (master to 16-bit)", (P + _b(t.precision.param)) * n, 1))
    return ops


def adam8bit_bytes(n: int, P: int) -> int:
    """Bytes bitsandbytes' AdamW8bit step moves over a tensor of n elements, weights and
    gradients of P bytes (bitsandbytes csrc/kernels.cu at 95f9af30): at 4096 elements and over,
    kOptimizerStatic8bit2StateBlockwise loads g, p and the two uint8 states and stores p and the
    states, with the fp32 absmax of each 256-element block of each state read and written
    (2P + G + 4 + 16/256 a element); under min_8bit_size, kOptimizer32bit2State on fp32 states
    (2P + G + 16, AdamW's fused bytes)."""
    from .memory import ADAM8BIT_BLOCK, ADAM8BIT_MIN_8BIT_SIZE

    if n < ADAM8BIT_MIN_8BIT_SIZE:
        return (3 * P + 16) * n
    return (3 * P + 4) * n + 16 * -(-n // ADAM8BIT_BLOCK)


def _adam8bit_ops(sc: Scenario, local_sizes: list[int]) -> Ops:
    """bitsandbytes' AdamW8bit over these tensors: one kernel per tensor (its step loops over
    the parameters, Optimizer8bit.step -> update_step), bytes as adam8bit_bytes, P the master
    dtype (the weights it steps); the zero layout's copy into the 16-bit weights as AdamW's."""
    gpu, t = sc.hw.gpu, sc.train
    P = _b(t.precision.master)
    sizes = [n for n in local_sizes if n]
    if not sizes:
        return []
    ops: Ops = [K.memory(gpu, "AdamW8bit (bitsandbytes, a kernel per tensor)",
                         sum(adam8bit_bytes(n, P) for n in sizes), len(sizes))]
    if t.layout == "zero" and t.precision.master != t.precision.param:
        ops.append(K.memory(gpu, "weight copy (master to 16-bit)", (P + _b(t.precision.param)) * sum(sizes), 1))
    return ops


def _adamw_ops(sc: Scenario, local_sizes: list[int]) -> Ops:
    """AdamW over these tensors as the run launches it (optimizer_ops)."""
    gpu, t = sc.hw.gpu, sc.train
    tensors = sum(1 for n in local_sizes if n)
    local_elems = sum(local_sizes)
    if not local_elems:
        return []
    ops: Ops = []
    P, S = _b(t.precision.master), _b(t.precision.optimizer)
    if t.layout == "torch":
        if t.optimizer_kernels == "fused":
            return ops + [K.memory(gpu, "AdamW (fused)", adamw_fused_bytes(P, S) * local_elems,
                                   K.multi_tensor_launches(local_sizes, 4))]
        foreach = t.optimizer_kernels == "foreach"
        launches = (sum(K.multi_tensor_launches(local_sizes, d, sl) for _, _, d, sl in ADAMW_FOREACH_OPS)
                    if foreach else len(ADAMW_FOREACH_OPS) * tensors)
        name = "AdamW (foreach, 8 ops)" if foreach else "AdamW (per parameter, 8 ops)"
        return ops + [K.memory(gpu, name, adamw_unfused_bytes(P, P, S) * local_elems, launches)]
    ops.append(K.memory(gpu, "FusedAdam (DeepSpeed)", adamw_fused_bytes(P, S) * local_elems,
                        K.multi_tensor_launches(local_sizes, 4)))
    if t.precision.master != t.precision.param:
        ops.append(K.memory(gpu, "weight copy (master to 16-bit)",
                            (P + _b(t.precision.param)) * local_elems, 1))
    return ops


# torch.optim.Muon's elementwise ops per tensor (_single_tensor_muon, PyTorch 2.9-2.13): the
# momentum's lerp_ (G + 2S), the Nesterov lerp into a new tensor (2G + S), the bf16 copy (G + 2),
# its norm (2) and division (2 + 2), the decoupled weight decay's mul_ (2P) and the update's add_
# (2P + 2): 4G + 3S + 4P + 10 bytes per element, in 8 launches (norm, clamp counted).
MUON_ELEMENTWISE_KERNELS = 8


def muon_elementwise_bytes(G: int, S: int, P: int) -> int:
    """Bytes per element of Muon's elementwise work (MUON_ELEMENTWISE_KERNELS' comment)."""
    return 4 * G + 3 * S + 4 * P + 10


def muon_ops(sc: Scenario, elems: int, tensors: int, matrices) -> Ops:
    """Muon's step on this rank (zplan/muon.py): its elementwise work over the `tensors` it
    holds (`elems` elements) and Newton-Schulz over the matrices it orthogonalises ((shape,
    count) pairs), each step three bf16 GEMMs (muon.newton_schulz_gemms), summed into one Op."""
    gpu, t = sc.hw.gpu, sc.train
    P, S = _b(t.precision.master), _b(t.precision.optimizer)
    ops: Ops = []
    if tensors and elems:
        ops.append(K.memory(gpu, "Muon (momentum, update)", muon_elementwise_bytes(P, S, P) * elems,
                            MUON_ELEMENTWISE_KERNELS * tensors))
    if matrices:
        ops.append(_newton_schulz(gpu, matrices))
    if t.layout == "zero" and t.precision.master != t.precision.param and elems:
        ops.append(K.memory(gpu, "weight copy (master to 16-bit, Muon's)",
                            (P + _b(t.precision.param)) * elems, 1))
    return ops


_NS_CACHE = PinnedMemo()  # (id(gpu), shape) -> its Newton-Schulz GEMMs' sums


def _ns_one(gpu, shape) -> tuple:
    def make() -> tuple:
        gs = [K.gemm(gpu, "ns", M, N, Kd, "bf16", "bf16", accumulate=acc)
              for M, N, Kd, acc in muon.newton_schulz_gemms(*shape)]
        return (sum(g.kernels for g in gs), sum(g.flop for g in gs), sum(g.bytes for g in gs),
                sum(g.seconds for g in gs), sum(g.contended_s for g in gs))
    return _NS_CACHE.get((id(gpu), shape), gpu, make)


def _newton_schulz(gpu, matrices) -> K.Op:
    """matrices: (shape, count) pairs (muon.counted)."""
    kernels = flop = nbytes = 0
    seconds = contended = 0.0
    for shape, count in matrices:
        k, f, b, t, c = _ns_one(gpu, shape)
        kernels, flop, nbytes = kernels + count * k, flop + count * f, nbytes + count * b
        seconds, contended = seconds + count * t, contended + count * c
    return K.Op(f"Muon Newton-Schulz ({muon.NS_STEPS} steps, {sum(c for _, c in matrices)} matrices)", "gemm",
                kernels, flop, nbytes, seconds, contended)


def grad_clip_ops(sc: Scenario, local_sizes: list[int]) -> Ops:
    """Clipping by the global norm (`TrainSpec.grad_clip`): torch.nn.utils.clip_grad_norm_ reads
    every local gradient for its norm (_foreach_norm) and then scales every gradient by the clip
    coefficient, clamped to 1 but always applied (_foreach_mul_): 3 x gradient bytes per element,
    two multi-tensor ops and the norm's cleanup kernel (CUDA's _foreach_norm reduces per-block
    partials in a second launch); two kernels per tensor under `single`, as the trainer then
    runs clip_grad_norm_(foreach=False) and FSDP1's clip_grad_norm_ and Composer loop over the
    gradients. The norm's all-reduce is one scalar (latency only, not priced)."""
    t = sc.train
    if not t.grad_clip:
        return []
    G = _b(t.precision.master)
    tensors = sum(1 for n in local_sizes if n)
    launches = (2 * tensors if t.optimizer_kernels == "single" and t.layout == "torch"
                else 2 * K.multi_tensor_launches(local_sizes, 1) + 1)  # _foreach_norm's cleanup
    return [K.memory(sc.hw.gpu, "gradient clipping (norm, scale)", 3 * G * sum(local_sizes), launches)]


# torch 2.13 torch/optim/adam.py, _multi_tensor_adam (decoupled weight decay, capturable False)
# and _single_tensor_adam: each op's HBM bytes per element as (P, G, S) multipliers (P the
# weight, G the gradient, S the state dtype; an op reading one tensor twice reads it once from
# HBM), its tensor lists (multi_tensor_apply depth), and whether it takes a list of scalars (the
# per-parameter bias corrections: a smaller tensor limit per launch).
ADAMW_FOREACH_OPS: tuple[tuple[str, tuple[int, int, int], int, bool], ...] = (
    ("mul_ (weight decay)", (2, 0, 0), 1, False),
    ("lerp_ (exp_avg)", (0, 1, 2), 2, False),
    ("mul_ (exp_avg_sq)", (0, 0, 2), 1, False),
    ("addcmul_ (exp_avg_sq)", (0, 1, 2), 3, False),
    ("sqrt (new)", (0, 0, 2), 2, False),
    ("div_ (bias correction)", (0, 0, 2), 1, True),
    ("add_ (eps)", (0, 0, 2), 1, False),
    ("addcdiv_ (weight)", (2, 0, 2), 3, True),
)


def adamw_unfused_bytes(param: int, grad: int, state: int) -> int:
    """Bytes per element of AdamW's eight unfused ops (foreach or per parameter): 4P + 2G + 14S,
    80 in fp32 (ADAMW_FOREACH_OPS). Composer's DecoupledAdamW with weight decay 0 (llm-foundry)
    runs mul_ + add_ for the lerp and no decay: 2P + 2G + 16S, the same 80 when P = S."""
    return sum(p * param + g * grad + s * state for _, (p, g, s), _, _ in ADAMW_FOREACH_OPS)


def adamw_fused_bytes(master: int, state: int) -> int:
    """Bytes per element of one fused AdamW pass: read and write the weight (2 x master), read
    the gradient (master dtype), read and write exp_avg and exp_avg_sq (4 x state)."""
    return 3 * master + 4 * state
