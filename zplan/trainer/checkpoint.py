"""Checkpoints with torch.distributed.checkpoint: each rank writes its own shard.

A checkpoint is complete or invisible: all ranks write into `.tmp-step_N`, meet at a barrier,
then rank 0 writes `zplan.json` (step, world size, strategy), fsyncs and renames the folder to
`step_N`. Resume loads the newest `step_N` that has `zplan.json`; DCP reshards at load, so a
checkpoint saved at N = 4 resumes at N = 2. ZeroRedundancyOptimizer's state is per rank and
resumes only at the same world size (it says so).
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import torch
import torch.distributed as dist

STEP_DIR = re.compile(r"^step_(\d{8})$")
MANIFEST = "zplan.json"


def step_dir(root: Path, step: int) -> Path:
    return root / f"step_{step:08d}"


def newest(root: str | Path) -> Path | None:
    """The newest complete checkpoint under root (one with its manifest), or None."""
    root = Path(root)
    if not root.is_dir():
        return None
    done = [p for p in root.iterdir() if STEP_DIR.match(p.name) and (p / MANIFEST).is_file()]
    return max(done, key=lambda p: int(STEP_DIR.match(p.name).group(1)), default=None)


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _model_optim_state(model, optim, zero1: bool):
    from torch.distributed.checkpoint.state_dict import get_state_dict, get_model_state_dict

    if zero1:
        return get_model_state_dict(model), None
    return get_state_dict(model, optim)


def save(root: str | Path, step: int, model, optim, extra: dict, meta: dict, zero1: bool = False) -> Path:
    import torch.distributed.checkpoint as dcp

    root = Path(root)
    final = step_dir(root, step)
    tmp = root / f".tmp-{final.name}"
    rank = dist.get_rank()
    if rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        if tmp.exists():
            shutil.rmtree(tmp)
    dist.barrier()
    msd, osd = _model_optim_state(model, optim, zero1)
    state = {"model": msd, "extra": extra}
    if osd is not None:
        state["optim"] = osd
    dcp.save(state, checkpoint_id=str(tmp))
    if zero1:
        torch.save(optim.optim.state_dict(), tmp / f"zero1_optim_rank{rank}.pt")
    dist.barrier()
    if rank == 0:
        manifest = tmp / MANIFEST
        with open(manifest, "w") as f:
            json.dump({"step": step, **meta}, f)
            f.flush()
            os.fsync(f.fileno())
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        _fsync_dir(root)
    dist.barrier()
    return final


def load(path: str | Path, model, optim, world: int, zero1: bool = False) -> dict:
    """Load a checkpoint into a (possibly differently sharded) model and optimizer."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_state_dict

    path = Path(path)
    meta = json.loads((path / MANIFEST).read_text())
    msd, osd = _model_optim_state(model, optim, zero1)
    state = {"model": msd, "extra": {"step": 0, "data_seed": 0}}
    if osd is not None:
        state["optim"] = osd
    dcp.load(state, checkpoint_id=str(path))
    if zero1:
        if meta.get("world_size") != world:
            raise RuntimeError(f"zero1 checkpoint {path} was saved at world size {meta.get('world_size')}; "
                               f"ZeroRedundancyOptimizer state resumes only at the same size (run with "
                               f"{meta.get('world_size')} ranks, or use an FSDP strategy)")
        set_model_state_dict(model, state["model"])
        local = torch.load(path / f"zero1_optim_rank{dist.get_rank()}.pt", weights_only=False)
        optim.optim.load_state_dict(local)
    else:
        set_state_dict(model, optim, model_state_dict=state["model"], optim_state_dict=state["optim"])
    return {"meta": meta, **state["extra"]}
