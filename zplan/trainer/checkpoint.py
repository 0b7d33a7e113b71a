"""Checkpoints with torch.distributed.checkpoint: each rank writes its own shard.

A checkpoint is complete or invisible: all ranks write into `.tmp-step_N`, meet at a barrier,
then rank 0 writes `zplan.json` (step, world size, strategy, model and its parameter count), fsyncs and renames the
folder to `step_N`. Resume takes the newest `step_N` that has `zplan.json` and whose shards are
all there (ckpt_files.check_complete); a damaged newest checkpoint falls back to the previous
complete one with a one-line warning. Metadata is read as data (ckpt_files.SafeReader), never
with pickle. DCP reshards at load, so a checkpoint saved at N = 4 resumes at N = 2.
ZeroRedundancyOptimizer's state is per rank and resumes only at the same world size (it says so).
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import pickle
import re
import shutil
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from ..errors import UsageError
from .ckpt_files import CheckpointError, SafeLoadPlanner, SafeReader, check_complete, read_metadata

STEP_DIR = re.compile(r"^step_(\d{8})$")
TMP_DIR = re.compile(r"^\.tmp-step_\d{8}$")
MANIFEST = "zplan.json"


def step_dir(root: Path, step: int) -> Path:
    return root / f"step_{step:08d}"


def _published(root: Path) -> list[Path]:
    """Every step_N folder with its manifest, newest first."""
    if not root.is_dir():
        return []
    done = [p for p in root.iterdir() if STEP_DIR.match(p.name) and (p / MANIFEST).is_file()]
    return sorted(done, key=lambda p: int(STEP_DIR.match(p.name).group(1)), reverse=True)


def manifest(path: Path) -> dict:
    try:
        meta = json.loads((path / MANIFEST).read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"checkpoint {path} has an unreadable {MANIFEST} ({type(e).__name__})") from None
    if not isinstance(meta, dict) or not isinstance(meta.get("step"), int):
        raise CheckpointError(f"checkpoint {path} has a {MANIFEST} without a step")
    return meta


def why_incomplete(path: Path) -> str | None:
    """Why the published checkpoint `path` cannot be loaded, or None."""
    try:
        manifest(path)
        return check_complete(path, read_metadata(path))
    except CheckpointError as e:
        return str(e)


def complete(root: str | Path, warn=None) -> list[Path]:
    """The complete checkpoints under root, newest first; `warn(line)` hears of each one skipped."""
    out = []
    for p in _published(Path(root)):
        why = why_incomplete(p)
        if why is None:
            out.append(p)
        elif warn is not None:
            warn(f"checkpoint {p.name} is incomplete ({why}); skipping it")
    return out


def is_checkpoint_folder(folder: Path) -> bool:
    """A checkpoint folder by its signature: DCP's .metadata file beside .distcp shards, or this
    module's MANIFEST (a JSON object with step and world_size); not any folder holding something
    of those names (a plan saved as zplan.json, an Eclipse workspace's .metadata/: a review)."""
    if (folder / ".metadata").is_file() and next(folder.glob("*.distcp"), None) is not None:
        return True
    try:
        manifest = json.loads((folder / MANIFEST).read_text()) if (folder / MANIFEST).is_file() else None
    except (OSError, ValueError):
        return False
    return isinstance(manifest, dict) and {"step", "world_size"} <= manifest.keys()


def newest(root: str | Path, warn=None) -> Path | None:
    """The newest complete checkpoint under root, or None."""
    found = complete(root, warn)
    return found[0] if found else None


def clean_stale(root: str | Path) -> list[Path]:
    """Remove `.tmp-step_N` folders a killed run left behind (call it on one rank, before saving)."""
    root = Path(root)
    gone = [p for p in root.iterdir() if TMP_DIR.match(p.name) and p.is_dir()] if root.is_dir() else []
    for p in gone:
        shutil.rmtree(p, ignore_errors=True)
    return gone


def prune(root: str | Path, keep: int) -> list[Path]:
    """Keep the newest `keep` complete checkpoints (0: all); remove older published ones."""
    if keep <= 0:
        return []
    ok = complete(root)
    if not ok:
        return []
    oldest_kept = int(STEP_DIR.match(ok[min(keep, len(ok)) - 1].name).group(1))
    gone = [p for p in _published(Path(root)) if int(STEP_DIR.match(p.name).group(1)) < oldest_kept]
    for p in gone:
        shutil.rmtree(p, ignore_errors=True)
    return gone


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


def save(root: str | Path, step: int, model, optim, extra: dict, meta: dict, zero1: bool = False,
         keep: int = 0) -> Path:
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
    with _writes(tmp):
        dcp.save(state, checkpoint_id=str(tmp))
    if zero1:  # on disk before rank 0 publishes, as DCP's own files are (sync_files)
        with _writes(tmp), open(tmp / f"zero1_optim_rank{rank}.pt", "wb") as f:
            torch.save(optim.optim.state_dict(), f)
            f.flush()
            os.fsync(f.fileno())
    dist.barrier()
    if rank == 0:
        with _writes(tmp):
            with open(tmp / MANIFEST, "w") as f:
                json.dump({"step": step, **meta}, f)
                f.flush()
                os.fsync(f.fileno())
            if final.exists():
                shutil.rmtree(final)
            os.replace(tmp, final)
        _fsync_dir(root)
        prune(root, keep)
    dist.barrier()
    return final


# what the filesystem says when it refuses a write: no room (a full disk, a quota, a file-size
# limit) or no right (read-only, permission); anything else a save raises is not a refused write
NO_ROOM = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG}
NO_RIGHT = {errno.EROFS, errno.EACCES, errno.EPERM}


@contextlib.contextmanager
def _writes(tmp: Path):
    """A checkpoint write the filesystem refuses is one line naming the folder (it read as a failed
    load: a QA pass on a full tmpfs); any other failure (a lost peer inside DCP's collectives, a
    bug) passes through as it was, for rank_errors.classify to rank."""
    try:
        yield
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as e:  # DCP's CheckpointException is a BaseException
        refused = _refused_write(e)
        if refused is None:
            raise
        raise _write_failure(tmp, refused) from e


def _refused_write(e: BaseException) -> BaseException | None:
    """The filesystem's refusal among a failed save's errors (DCP's per-rank failures, or the
    error itself): an OSError of NO_ROOM or NO_RIGHT, or torch.save's zip writer after a short
    write ("unexpected pos", inline_container.cc). None where there is none."""
    from .rank_errors import dcp_failures

    for x in dcp_failures(e) or [e]:
        if isinstance(x, OSError) and x.errno in NO_ROOM | NO_RIGHT:
            return x
        if isinstance(x, RuntimeError) and "unexpected pos" in str(x):
            return x
    return None


def _write_failure(tmp: Path, inner: BaseException):
    """One line for a refused write: a save, not a load, naming the folder, the errno and the free
    space, and what to do (room for NO_ROOM and a short write, another folder for NO_RIGHT)."""
    from ..errors import PlanError

    free = ""
    try:
        free = f"; {shutil.disk_usage(tmp.parent).free / 1e9:.2f} GB free there"
    except OSError:
        pass
    if isinstance(inner, OSError):
        what = f"{inner.strerror or inner} (errno {inner.errno})"
    else:
        what = f"a short write, {type(inner).__name__}: {first_sentence(str(inner))}"
    fix = ("pass another --run-dir" if isinstance(inner, OSError) and inner.errno in NO_RIGHT
           else "free space (or pass --keep K), or pass another --run-dir")
    return PlanError(f"checkpoint {tmp} could not be written ({what}){free}: {fix}")


def _check_fits(path: Path, meta: dict, world: int, zero1: bool, model_name: str | None,
                model_params: int | None = None) -> None:
    if model_name is not None and meta.get("model") not in (None, model_name):
        raise UsageError(f"checkpoint {path} is of model {meta.get('model')!r} but the plan trains "
                         f"{model_name!r}: pass another --run-dir, or resume with a plan for {meta.get('model')!r}")
    saved = meta.get("model_params")
    if model_params is not None and isinstance(saved, int) and saved != model_params:
        # the same name, another architecture: DCP's size mismatch, which read as damage (every
        # checkpoint "cannot be loaded": move them away) where the plan is what differs
        raise UsageError(f"checkpoint {path} is of model {meta.get('model')!r} with {saved:,} parameters but the "
                         f"model resumed has {model_params:,}: pass another --run-dir, or resume with the plan "
                         f"(and model) the run was made under")
    if zero1 and meta.get("world_size") != world:
        raise UsageError(f"zero1 checkpoint {path} was saved at world size {meta.get('world_size')}; "
                         f"ZeroRedundancyOptimizer state resumes only at the same size: run with "
                         f"{meta.get('world_size')} ranks, or use an FSDP strategy")
    if zero1 and meta.get("strategy") != "zero1":
        raise UsageError(f"checkpoint {path} was saved by strategy {meta.get('strategy')!r}; zero1 "
                         f"cannot resume it: resume with a plan for {meta.get('strategy')!r}")


def load(path: str | Path, model, optim, world: int, zero1: bool = False, model_name: str | None = None,
         model_params: int | None = None) -> dict:
    """Load a checkpoint into a (possibly differently sharded) model and optimizer."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_state_dict

    path = Path(path)
    meta = manifest(path)
    _check_fits(path, meta, world, zero1, model_name, model_params)
    inner = optim.optim if zero1 else optim
    planned = [{k: g[k] for k in PLANNED_GROUP_KEYS if k in g} for g in inner.param_groups]
    if not inner.state:  # get_state_dict makes a fresh optimizer's state to load into, unless a
        # parameter holds a gradient (state_dict.py _init_optim_state): then none would load
        inner.zero_grad(set_to_none=True)
    msd, osd = _model_optim_state(model, optim, zero1)
    state = {"model": msd, "extra": {"step": 0, "data_seed": 0}}
    if osd is not None:
        state["optim"] = osd
    dcp.load(state, storage_reader=SafeReader(str(path)), planner=SafeLoadPlanner())
    if zero1:
        set_model_state_dict(model, state["model"])
        shard = path / f"zero1_optim_rank{dist.get_rank()}.pt"
        err = None
        try:  # read and loaded: a file that unpickles can still not fit this rank's optimizer
            try:
                optim.optim.load_state_dict(load_zero1_shard(shard))
            except (ValueError, KeyError, IndexError, TypeError, RuntimeError) as e:
                raise CheckpointError(f"{shard.name} does not fit this rank's optimizer "
                                      f"({type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''})") from None
        except CheckpointError as e:
            err = str(e)
        # a per-rank file can fail on one rank only: every rank must fall back together, or the
        # others train on while this one loads the previous checkpoint (mismatched collectives);
        # a rank that loaded is overwritten by the previous checkpoint's load
        why = [None] * dist.get_world_size()
        dist.all_gather_object(why, err)  # an object collective: the group's CPU backend
        bad = [(r, w) for r, w in enumerate(why) if w is not None]
        if bad:
            r, w = bad[0]
            raise CheckpointError(f"rank {r}'s zero1 optimizer file in {path.name}: {w}")
    else:
        set_state_dict(model, optim, model_state_dict=state["model"], optim_state_dict=state["optim"])
    keep_planned_groups(inner, planned)
    return {"meta": meta, **state["extra"]}


# what the run's plan and command line set on each param group, not the checkpoint
PLANNED_GROUP_KEYS = ("fused", "foreach", "capturable", "lr")


def keep_planned_groups(optim, planned: list[dict]) -> None:
    """The run's AdamW kernels and learning rate, not the checkpoint's: Optimizer.load_state_dict
    replaces each param group with the saved one (optim/optimizer.py update_group), its fused and
    foreach flags included, so a fused GPU checkpoint resumed under --deterministic (the
    single-tensor kernel) would run fused, and a plan priced for one kernel would run another;
    --lr on the resuming command line is the one the report states. The step counters go where
    the kernel wants them: on the parameter's device for fused or capturable, else on the host
    (a device step under the foreach or single-tensor kernel is read with .item(): a host sync
    per parameter per step)."""
    for group, keys in zip(optim.param_groups, planned):
        group.update(keys)
        on_device = bool(group.get("fused") or group.get("capturable"))
        for p in group["params"]:
            st = optim.state.get(p)
            if st is not None and torch.is_tensor(st.get("step")):
                where = p.device if on_device else torch.device("cpu")
                if st["step"].device != where:
                    st["step"] = st["step"].to(where, torch.float32)


def load_zero1_shard(shard: Path) -> dict:
    """One rank's ZeroRedundancyOptimizer state, read onto the host: torch.load would put each
    tensor back on the GPU it was saved from (cuda:7 on an 8-GPU node), which a rank of the same
    world size laid out on other nodes may not have; load_state_dict moves the state to its
    parameters' device."""
    try:  # tensors and plain containers only: never weights_only=False on a file from disk
        return torch.load(shard, weights_only=True, map_location="cpu")
    except (pickle.UnpicklingError, RuntimeError, EOFError, OSError) as e:
        raise CheckpointError(f"refused {shard}: {str(e).splitlines()[0] if str(e) else type(e).__name__}") from None


def _say(line: str) -> None:
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(f"zplan: warning: {line}", file=sys.stderr, flush=True)


def first_sentence(text: str) -> str:
    """A failure's first line, up to torch.load's advice: a weights_only refusal goes on to say
    that weights_only=False "will likely succeed", which for a file zplan reads as data (and
    refused as possibly crafted) is the wrong thing to pass on."""
    line = text.splitlines()[0] if text else ""
    if "weights_only" in line and "Re-running" in line:  # its first sentence: "Weights only load failed."
        line = line.split(". ", 1)[0].rstrip(".") + " (not a tensor file zplan reads as data)"
    return line[:300]


def resume_newest(root: str | Path, model, optim, world: int, zero1: bool = False,
                  model_name: str | None = None, model_params: int | None = None) -> dict | None:
    """Load the newest checkpoint under root that loads; None when there is none.

    A damaged checkpoint (a shard missing or truncated, metadata refused, or DCP failing to read
    it: every rank sees the same failure) falls back to the previous one with one warning line.
    A checkpoint of another model or world size (zero1) is an error, not a fallback.
    """
    from torch.distributed.checkpoint.api import CheckpointException

    from .rank_errors import dcp_failures

    published = _published(Path(root))
    last = ""  # why the oldest one tried could not be loaded, for the error when none can

    def skipped(line: str) -> None:  # complete()'s "checkpoint NAME is incomplete (WHY); skipping it"
        nonlocal last
        name, _, why = line.removeprefix("checkpoint ").partition(" is incomplete (")
        last = f"{name}: {why.removesuffix('); skipping it').replace('; pass another step_N folder', '')}"
        _say(line)

    for path in complete(root, skipped):
        try:
            return load(path, model, optim, world, zero1, model_name, model_params)
        except UsageError as e:
            if not isinstance(e, CheckpointError):
                raise
            last = f"{path.name}: {str(e).replace('; pass another step_N folder', '')}"
            _say(f"checkpoint {path.name} cannot be read ({e}); trying the previous one")
        except CheckpointException as e:  # a BaseException: DCP gathers every rank's failure
            first = next(iter(dcp_failures(e)), e)
            last = f"{path.name}: {type(first).__name__}: {first_sentence(str(first))}"
            _say(f"checkpoint {path.name} cannot be loaded ({last.split(': ', 1)[1]}); trying the previous one")
    if published:
        raise CheckpointError(f"none of the {len(published)} checkpoints in {root} can be loaded"
                              + (f" ({last})" if last else "") + "; move them away to start again from step 0")
    return None
