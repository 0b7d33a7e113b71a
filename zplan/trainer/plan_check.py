"""Whether a plan can run in the world torchrun started: the trainer and the user API both ask."""

from __future__ import annotations

import os


# How far below the plan's GPU memory this GPU's may be: the presets hold CUDA's totalGlobalMem,
# which moves by 0.1-0.2 GiB with the driver (the reserve it keeps); a GPU with less memory than
# the plan counts (a preset or file of a larger part) is far below.
MEMORY_SHORTFALL = 0.03


def check_plan(plan, world: int, cuda: bool, builtin_model: bool = False) -> str | None:
    """Why this plan cannot run in this world, or None (`builtin_model`: zplan's own trainer,
    whose model the plan's architecture must fit; a user's script brings its own)."""
    from ..plan import trainer_refusal

    why = trainer_refusal(plan, builtin_model)
    if why:
        return why
    if plan.num_gpus != world:
        return (f"the plan is for {plan.num_gpus} ranks but torchrun started {world}; run it with "
                f"zplan launch --plan (it sets --nproc), or plan again with --gpus {world}")
    if cuda:
        import torch

        from ..hardware import preset_for

        name = torch.cuda.get_device_name()
        found = preset_for(name)
        if os.environ.get("ZPLAN_ALLOW_GPU_MISMATCH"):
            return None
        from ..presets import shipped

        if found is None and shipped("gpus", plan.gpu.family):
            # a part no preset describes (GH200, H100 NVL): its plans come from a file or calibrate
            return (f"the plan is for {plan.gpu.name} but this GPU is {name}, which no shipped preset describes; "
                    f"plan with zplan calibrate's preset of it (or --gpu FILE.toml), or set "
                    f"ZPLAN_ALLOW_GPU_MISMATCH=1")
        if found is not None and plan.gpu.family not in (found, "auto"):
            return (f"the plan is for {plan.gpu.name} but this GPU is {name} "
                    f"({found}); plan again with --gpu auto, or set ZPLAN_ALLOW_GPU_MISMATCH=1")
        have = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
        if have < plan.gpu.memory_bytes * (1 - MEMORY_SHORTFALL):
            return (f"the plan counts {plan.gpu.memory_bytes / 2**30:.1f} GiB per GPU ({plan.gpu.name}) but this "
                    f"{name} has {have / 2**30:.1f} GiB; plan again with --gpu auto or a preset of this GPU, "
                    f"or set ZPLAN_ALLOW_GPU_MISMATCH=1")
    elif plan.gpu.device != "cpu":
        return (f"the plan is for {plan.gpu.name} GPUs but this machine has none; plan for CPU ranks "
                f"with zplan recommend --gpu cpu --cluster cpu-local")
    return None
