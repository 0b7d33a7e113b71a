"""DeepSpeed ZeRO-3's default stage-3 settings, which a run gets where its config leaves them out
(`TrainSpec.deepspeed_defaults`): deepspeed/runtime/zero/config.py, the same at v0.16.6 and
v0.19.2. zplan's own export writes a unit for the buckets instead (export.deepspeed_config), so
a plan it exports gathers and reduces unit by unit."""

PREFETCH_BUCKET_ELEMS = 50_000_000  # stage3_prefetch_bucket_size
REDUCE_BUCKET_ELEMS = 500_000_000  # reduce_bucket_size
PERSISTENCE_THRESHOLD_ELEMS = 100_000  # stage3_param_persistence_threshold: smaller ones stay whole
