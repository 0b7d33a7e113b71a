"""Modelling decisions the planner and the trainer must make the same way, made once, here.

- Unit grouping: which transformer blocks share one all-gather (`block_groups`), and whether the
  embeddings and the norm + head are units of their own (`embed_unit`, `head_unit`).
- Activation checkpointing: which blocks are wrapped (`checkpointed_blocks`, including every-k
  and first-k),
  and, for the selective policy, which ops' outputs are kept (`selective_saved_matmuls`,
  and TrainSpec.sac_saves_attention), by op kind so that the planner can price them.

The planner (zplan/activation_memory.py, zplan/arch.py) turns these into bytes and FLOPs; the trainer
(zplan/trainer/parallel.py) turns them into fully_shard groups and checkpoint contexts.
Torch-free: the planning path imports it.
"""

from __future__ import annotations

from functools import lru_cache

# The matmuls of one block in the order the trainer's block runs them (zplan/trainer/model.py:
# Attention.forward, then FeedForward.forward: w2(silu(w1 x) * w3 x) or w2(gelu(w1 x))).
BLOCK_MATMULS = {
    "swiglu": ("wq", "wk", "wv", "wo", "w1", "w3", "w2"),
    "gelu": ("wq", "wk", "wv", "wo", "w1", "w2"),
}

# Selective checkpointing keeps the attention kernel's outputs (output and logsumexp), as
# torchtitan's op-level SAC does, where TrainSpec.sac_saves_attention (the default) says so; every
# pointwise op is recomputed.


def block_groups(num_layers: int, blocks_per_unit: int) -> list[range]:
    """Blocks grouped `blocks_per_unit` at a time, in order; the last group may be shorter."""
    if blocks_per_unit < 1:
        raise ValueError(f"blocks_per_unit must be >= 1, not {blocks_per_unit}")
    return [range(i, min(i + blocks_per_unit, num_layers))
            for i in range(0, num_layers, blocks_per_unit)]


def embed_unit(tied_embeddings: bool, embed_head_unit: str = "separate") -> bool:
    """The embeddings are a unit of their own (torchtitan's order; FSDP1's auto-wrap policy
    naming the embedding module besides the decoder layers, `head-root-kept`), unless they share
    one weight with the head or the plan leaves them to the root (`TrainSpec.embed_head_unit`
    root or root-kept, as auto-wrapping only the decoder layers does)."""
    return not tied_embeddings and embed_head_unit in ("separate", "head-kept", "head-root-kept")


def head_unit(tied_embeddings: bool, embed_head_unit: str = "separate") -> bool:
    """The final norm + head are a unit of their own (`separate`, `head-kept`); otherwise they sit
    in the root, the held unit, gathered in forward and in backward and, where it does not
    reshard (`root_reshards`), in between; FSDP reduces its gradients at the end of backward
    (the root's post-backward)."""
    return not tied_embeddings and embed_head_unit in ("separate", "head-kept")


def root_reshards(embed_head_unit: str) -> bool:
    """Whether the root unit reshards after its forward and gathers again for its backward (with
    reshard_after_forward on): FSDP2 honours an explicit reshard_after_forward=True on the root
    since PyTorch 2.8 (pytorch/pytorch PR 154704), as zplan's trainer passes it; "root-kept" and
    "head-root-kept" are FSDP1, which never frees the root after forward, and FSDP2 before 2.8
    (the trainer passes reshard_after_forward=False to the root for them)."""
    return embed_head_unit not in ("root-kept", "head-root-kept")


def head_unit_reshards(embed_head_unit: str) -> bool:
    """Whether a norm + head unit of its own reshards after forward (with reshard_after_forward
    on): not under "head-kept", as torchtitan's default policy (parallelize.py: `fully_shard([norm,
    output], reshard_after_forward=policy == "always")`, since 2025-07) and accelerate's FSDP2
    keep it, FSDP prefetching it again at once for backward otherwise."""
    return embed_head_unit != "head-kept"


def stays_gathered(held: bool, head: bool, embed_head_unit: str, kept_last_block: bool = False) -> bool:
    """Whether a unit, with reshard_after_forward on, stays gathered from its forward to its
    backward instead of being gathered again: the held root where it does not reshard
    (`root_reshards`), a norm + head unit of its own where it does not (`head_unit_reshards`),
    the last block's unit where the plan keeps it (`kept_last_block`: `holds_kept_last_block`).
    The memory timeline (at the loss) and the traffic (comm.regathered) both read it."""
    if held:
        return not root_reshards(embed_head_unit)
    return kept_last_block or (head and not head_unit_reshards(embed_head_unit))


def holds_kept_last_block(train, first_block: int, blocks: int, num_layers: int) -> bool:
    """Whether a unit of blocks [first_block, first_block + blocks) is the one the plan keeps
    gathered after forward (`TrainSpec.last_block_kept`, torchtitan's
    `reshard_after_forward = int(layer_id) < len(model.layers) - 1` of 2024-03..2025-07): the
    unit holding the model's last block. The planner (`unit_stays_gathered`) and the trainer
    (parallel.py) both ask it."""
    return train.last_block_kept and blocks > 0 and first_block + blocks == num_layers


def unit_stays_gathered(u, train, num_layers: int) -> bool:
    """`stays_gathered` for one of the planner's units (arch.Unit)."""
    return stays_gathered(u.held, "head" in u.name, train.embed_head_unit,
                          holds_kept_last_block(train, u.first_block, u.blocks, num_layers))


@lru_cache(maxsize=4096)  # recommend's search asks per unit and per candidate
def checkpointed_blocks(num_layers: int, mode: str, every: int, first: int = 1) -> tuple[bool, ...]:
    """Which blocks are wrapped whole for recomputation. `attention` recomputes inside each block
    (the attention core only), so it wraps none; every-k wraps blocks k, 2k, ... counting from 1
    (torchtitan's `ac_freq`); first-k the first `first` blocks (Megatron-LM's `--recompute-method
    block --recompute-num-layers`, YaFSDP's `num-ckpt-layers`)."""
    if mode in ("none", "attention"):
        return (False,) * num_layers
    if mode in ("full", "selective"):
        return (True,) * num_layers
    if mode == "every-k":
        if every < 1:
            raise ValueError(f"checkpoint_every must be >= 1, not {every}")
        return tuple((i + 1) % every == 0 for i in range(num_layers))
    if mode == "first-k":
        if first < 1:
            raise ValueError(f"checkpoint_first must be >= 1, not {first}")
        return tuple(i < first for i in range(num_layers))
    raise ValueError(f"unknown checkpointing mode {mode!r}")


# the modes that wrap some blocks whole and leave the others keeping everything
PARTIAL_CHECKPOINTING = ("every-k", "first-k")
# the TrainSpec / ScenarioOptions field holding each partial mode's k
K_FIELD = {"every-k": "checkpoint_every", "first-k": "checkpoint_first"}


def checkpointing_label(train) -> str:
    """The mode as a user reads it: every-k and first-k with their k (every-2, first-40)."""
    if train.checkpointing == "every-k":
        return f"every-{train.checkpoint_every}"
    if train.checkpointing == "first-k":
        return f"first-{train.checkpoint_first}"
    return train.checkpointing


def wrapped_blocks(train, num_layers: int) -> tuple[bool, ...]:
    """checkpointed_blocks for a TrainSpec: the one reading of its mode, k and count that the
    planner and the trainer share."""
    return checkpointed_blocks(num_layers, train.checkpointing, train.checkpoint_every, train.checkpoint_first)


def uniform_mode(train, num_layers: int) -> str:
    """The mode every block is under: every-k and first-k that wrap all blocks (every-1, first-L)
    are full checkpointing and those that wrap none are none, block for block, and priced as
    such; a mix stays partial."""
    if train.checkpointing not in PARTIAL_CHECKPOINTING:
        return train.checkpointing
    wrapped = wrapped_blocks(train, num_layers)
    return "full" if all(wrapped) else "none" if not any(wrapped) else train.checkpointing


def block_matmuls(mlp: str, qkv_fused: bool = False) -> tuple[str, ...]:
    """The block's matmuls in the order they run; with q, k and v as one linear (ModelSpec.qkv_fused:
    MPT's Wqkv, torchtitan's FusedQKVLinear) "wqkv" stands for the three."""
    order = BLOCK_MATMULS[mlp]
    return ("wqkv",) + order[3:] if qkv_fused else order


def selective_saved_matmuls(mlp: str, moe: bool = False, qkv_fused: bool = False) -> tuple[str, ...]:
    """The matmuls whose outputs selective checkpointing keeps: every second one of the block,
    starting with the first (torchtitan's `_save_list` rule, 'save every other mm'). SwiGLU keeps
    wq, wv, w1, w2; GELU keeps wq, wv, w1 (its w2 is recomputed).

    An MoE block as torchtitan runs it (models/common/moe.py at b36e4b6, GroupedExperts) computes
    its experts with torch._grouped_mm, an op outside the save list (PyTorch's compute-intensive
    ops, torch/_functorch/partitioners.py get_default_op_list, and torchtitan's own): the experts
    are recomputed and take no part in the every-other count, and the router's matmul is forced to
    recompute (SelectiveAC force_recompute_mm_shapes_by_fqns, default ["moe.router.gate"]). Of an
    MoE block only the attention's matmuls count: wq and wv are kept (tests/test_moe_selective.py
    runs the rule through torch.utils.checkpoint). With q, k and v as one linear its whole output
    is the first matmul's, kept: SwiGLU keeps wqkv, w1, w2; an MoE block wqkv."""
    order = block_matmuls(mlp, qkv_fused)
    if moe:
        order = order[:order.index("wo") + 1]
    return tuple(name for i, name in enumerate(order) if i % 2 == 0)


def early_stop_applies(train) -> bool:
    """Whether early stop spares the block's last matmul: with non-reentrant checkpoint (early
    stop on), unless the linears are TransformerEngine's, whose autograd.Function packs its saved
    tensors only after its forward returns, the GEMM included, so the last one is rerun too
    (checked with torch.utils.checkpoint on a custom Function, tests/test_policy.py)."""
    return train.checkpoint_early_stop and not train.te_float8


def recomputed_matmuls(mlp: str, mode: str, early_stop: bool = True, moe: bool = False,
                       qkv_fused: bool = False) -> tuple[str, ...]:
    """The block matmuls that backward runs again for a checkpointed block: under full (and
    every-k's checkpointed blocks) all of them, under selective those whose outputs are not kept.
    With early stop (non-reentrant torch.utils.checkpoint since PyTorch 2.1, the default;
    `set_checkpoint_early_stop`, pytorch/pytorch#96866) recomputation stops once every tensor
    backward saved is rebuilt: a dense block's last matmul is not rerun, since nothing saves its
    output (its backward needs its input and weight, which are saved before its kernel runs, and
    the residual add saves nothing). An MoE block's combine saves the experts' outputs, so its last
    matmul is rerun. Without early stop (reentrant checkpoint, or PyTorch before 2.1) the whole
    block is. Measured with PyTorch's FlopCounterMode on the trainer's block (tests/test_policy.py).
    SwiGLU selective reruns wk, wo, w3; GELU selective wk, wo; an MoE block's selective reruns wk,
    wo and every expert matmul (selective_saved_matmuls)."""
    order = block_matmuls(mlp, qkv_fused)
    kept = selective_saved_matmuls(mlp, moe, qkv_fused) if mode == "selective" else ()
    last = order[-1] if early_stop and not moe else None
    return tuple(name for name in order if name not in kept and name != last)


def selective_saved_positions(mlp: str) -> frozenset[int]:
    """The same choice as positions in the block's matmul order (how the trainer sees them: a
    checkpoint policy is called with each op, not with the module that issued it)."""
    saved = set(selective_saved_matmuls(mlp))
    return frozenset(i for i, name in enumerate(BLOCK_MATMULS[mlp]) if name in saved)


def loss_chunk_tokens(tokens: int, vocab: int, hidden: int) -> int:
    """Tokens per chunk of a linear loss (TrainSpec.linear_loss), Liger-Kernel's rule
    (ops/fused_linear_cross_entropy.py, v0.8.0): a chunk's logits are about as large as the
    head's input, `inc = ceil(V / h)`, `chunk = next_power_of_2(ceil(T / inc))`, and at most T
    (Liger slices a chunk at the last token: one chunk of T when the power of two exceeds it).
    The trainer's chunked loss uses the same chunks."""
    inc = -(-vocab // hidden)
    return min(tokens, 1 << (max(1, -(-tokens // inc)) - 1).bit_length())


def optimizer_splits_matrices(st, layout: str) -> bool:
    """Whether the optimizer's shard splits parameters, so that an optimizer of whole matrices
    (Muon) must gather each matrix before its update: DeepSpeed's flat partitions (zero layout)
    and FSDP2's dim-0 shards do; ZeroRedundancyOptimizer (zero1, torch layout) owns whole
    parameters and updates them from DDP's all-reduced gradients, nothing more to gather."""
    return st.optim_sharded and not (st.name == "zero1" and layout == "torch")


def all_reduces_gradients(st, t) -> bool:
    """Whether a sharded strategy reduces its gradients with an all-reduce, not a reduce-scatter:
    DeepSpeed's ZeRO-3 (the zero layout's sharded strategies) refuses Muon with reduce_scatter
    on ("Muon and reduce scatter cannot be used together", runtime/zero/stage3.py, v0.19), and
    with it off all-reduces each contiguous gradient bucket and keeps its own partition
    (__avg_scatter_contiguous_grads): twice a reduce-scatter's bytes. The export writes
    reduce_scatter false for it."""
    return st.fsdp and t.layout == "zero" and t.optimizer == "muon"


def autocast_dtype(fsdp: bool, layout: str, param: str, master: str) -> str | None:
    """The dtype the trainer autocasts forward and loss to (trainer/parallel.py, micro_batch.py),
    which the planner prices as `TrainSpec.autocast` (Scenario.for_strategy): DDP and ZeRO-1 in
    the torch layout keep the weights in the master dtype and compute in the param dtype where
    it is lower. FSDP2 casts the gathered weights (MixedPrecisionPolicy) and DeepSpeed keeps
    16-bit weights (the zero layout): no autocast."""
    return param if not fsdp and layout == "torch" and param != master else None


def regathers_for_recompute(train, fsdp: bool, reshard_after_forward: bool) -> bool:
    """Whether each checkpointed block's unit is gathered twice in backward, both unprefetched:
    under FSDP1 (HF Trainer's and accelerate's FSDP) with the checkpoint wrapping the unit from
    outside (Hugging Face's gradient_checkpointing_enable before transformers 4.52, whose
    GradientCheckpointingLayer puts it inside) and reentrant. The checkpointed forward ran
    without grad, so it registered no pre-backward hook (torch/distributed/fsdp/_runtime_utils.py
    `_register_pre_backward_hooks` returns under no_grad) and backward prefetch skips the unit
    (`_get_handle_to_prefetch` takes only handles that need a pre-backward unshard). In backward
    the recompute is an ordinary forward of the unit: `_pre_forward_unshard` gathers it,
    `_post_forward_reshard` frees it, and the pre-backward hook its outputs now register gathers
    it again. A non-reentrant checkpoint recomputes after the unit's pre-backward hook, whose
    unshard `_pre_forward` then skips (BACKWARD_PRE): one gather. FSDP2 on PyTorch 2.13 does not
    reshard after a forward that runs inside backward (FSDPParamGroup.post_forward,
    pytorch/pytorch#164009): one gather too; the option is for FSDP1."""
    return (fsdp and reshard_after_forward and train.checkpoint_wraps_unit
            and not train.checkpoint_early_stop and train.layout == "torch")
