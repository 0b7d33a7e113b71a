"""Whether a plan can run in the world torchrun started: the trainer and the user API both ask."""

from __future__ import annotations

import os


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

        found = preset_for(torch.cuda.get_device_name())
        if plan.gpu.family not in (found, "auto") and not os.environ.get("ZPLAN_ALLOW_GPU_MISMATCH"):
            return (f"the plan is for {plan.gpu.name} but this GPU is {torch.cuda.get_device_name()} "
                    f"({found or 'no preset'}); plan again with --gpu auto, or set ZPLAN_ALLOW_GPU_MISMATCH=1")
    elif plan.gpu.device != "cpu":
        return (f"the plan is for {plan.gpu.name} GPUs but this machine has none; plan for CPU ranks "
                f"with zplan recommend --gpu cpu --cluster cpu-local")
    return None
