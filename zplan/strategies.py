"""The strategies zplan plans for: what each shards, and what PyTorch and DeepSpeed call it."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Strategy:
    name: str
    params_sharded: bool  # the persistent weights (FSDP2: the fp32 sharded params)
    grads_sharded: bool
    optim_sharded: bool  # master weights and optimizer state
    reshard_after_forward: bool = True
    hsdp: bool = False
    offload_optimizer: bool = False  # master + optimizer state (+ fp32 grads) in host RAM
    offload_params: bool = False
    torch: str = ""
    deepspeed: str = ""

    @property
    def fsdp(self) -> bool:
        """Weights are gathered per unit before use (ZeRO-3 style)."""
        return self.params_sharded


STRATEGIES: dict[str, Strategy] = {
    s.name: s
    for s in (
        Strategy("ddp", False, False, False,
                 torch="DistributedDataParallel", deepspeed="zero_optimization.stage 0"),
        Strategy("zero1", False, False, True,
                 torch="DDP + ZeroRedundancyOptimizer", deepspeed="zero_optimization.stage 1"),
        Strategy("zero2", False, True, True, reshard_after_forward=False,
                 torch="fully_shard(reshard_after_forward=False) (close, see docs)",
                 deepspeed="zero_optimization.stage 2"),
        Strategy("zero3", True, True, True,
                 torch="fully_shard(reshard_after_forward=True)", deepspeed="zero_optimization.stage 3"),
        Strategy("zero3-noreshard", True, True, True, reshard_after_forward=False,
                 torch="fully_shard(reshard_after_forward=False)",
                 deepspeed="stage 3 with stage3_max_reuse_distance large"),
        Strategy("hsdp", True, True, True, hsdp=True,
                 torch="fully_shard(mesh=(replicate, shard))", deepspeed="stage 3 + zero_hpz_partition_size"),
        Strategy("offload-opt", True, True, True, offload_optimizer=True,
                 torch="not in FSDP2 (DeepSpeed only)", deepspeed="stage 3 + offload_optimizer"),
        Strategy("offload-all", True, True, True, offload_optimizer=True, offload_params=True,
                 torch="fully_shard(offload_policy=CPUOffloadPolicy())",
                 deepspeed="stage 3 + offload_optimizer + offload_param"),
    )
}


def get(name: str) -> Strategy:
    return STRATEGIES[name]


def effective(name: str, layout: str) -> Strategy:
    """Under the torch layout ZeRO-2 is FSDP2 without resharding: weights sharded between steps."""
    s = STRATEGIES[name]
    if layout == "torch" and name == "zero2":
        return Strategy("zero2", True, True, True, reshard_after_forward=False,
                        torch=s.torch, deepspeed=s.deepspeed)
    return s
