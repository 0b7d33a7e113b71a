"""DeepSpeed ZeRO-3's default stage-3 settings, which a run gets where its config leaves them out
(`TrainSpec.deepspeed_defaults`): deepspeed/runtime/zero/config.py, the same at v0.16.6 and
v0.19.2. zplan's own export writes a unit for the buckets instead (export.deepspeed_config), so
a plan it exports gathers and reduces unit by unit."""

PREFETCH_BUCKET_ELEMS = 50_000_000  # stage3_prefetch_bucket_size
MAX_LIVE_ELEMS = 1_000_000_000  # stage3_max_live_parameters
MAX_REUSE_DISTANCE_ELEMS = 1_000_000_000  # stage3_max_reuse_distance
REDUCE_BUCKET_ELEMS = 500_000_000  # reduce_bucket_size (ZeRO-3; ZeRO-1/2 the same default)
ALLGATHER_BUCKET_ELEMS = 500_000_000  # allgather_bucket_size (ZeRO-1/2)
SUB_GROUP_ELEMS = 1_000_000_000  # sub_group_size: ZeRO-3's optimizer step, one sub-group at a time
PERSISTENCE_THRESHOLD_ELEMS = 100_000  # stage3_param_persistence_threshold: up to it, kept whole
# Without ZeRO (stage 0) the engine all-reduces the gradients after backward has returned, at the
# accumulation boundary only, in buffers of this many elements (engine.py _backward_epilogue ->
# allreduce_gradients -> buffered_allreduce_fallback, MEMORY_OPT_ALLREDUCE_SIZE; v0.16.6)
ALLREDUCE_FALLBACK_ELEMS = 500_000_000


def reduces_after_backward(strategy: str, layout: str) -> bool:
    """DeepSpeed's stage 0 (zplan's ddp in the zero layout): its all-reduce has nothing beside it."""
    return layout == "zero" and strategy == "ddp"
