"""Turn a sharded DCP checkpoint into one weights file, one tensor at a time.

No process group is needed and the whole model is never in memory at once: the safetensors
header is written from the checkpoint's metadata first, then each tensor is loaded alone and
its bytes appended. (`.pt` output is torch.save of the whole state dict, which does hold it.)
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import torch

from ..errors import UsageError
from ..files import atomic_writer

ST_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16",
             torch.int64: "I64", torch.int32: "I32", torch.uint8: "U8"}
PREFIX = "model."


def model_tensors(path: str | Path) -> dict[str, tuple[torch.Size, torch.dtype]]:
    """Name -> (shape, dtype) of every model tensor in the checkpoint, from its metadata."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from .ckpt_files import CheckpointError, check_complete, read_metadata

    meta = read_metadata(path)
    why = check_complete(path, meta)
    if why:
        raise CheckpointError(f"checkpoint {path} is incomplete: {why}; pass an earlier step_N folder")
    out = {}
    for key, m in meta.state_dict_metadata.items():
        if key.startswith(PREFIX) and isinstance(m, TensorStorageMetadata):
            out[key[len(PREFIX):]] = (m.size, m.properties.dtype)
    return dict(sorted(out.items()))


def load_tensor(path: str | Path, name: str, shape, dtype) -> torch.Tensor:
    import warnings

    import torch.distributed.checkpoint as dcp

    from .ckpt_files import SafeLoadPlanner, SafeReader

    t = torch.empty(shape, dtype=dtype)
    state = {"model": {name: t}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "assuming ... a single process": we are
        dcp.load(state, storage_reader=SafeReader(str(path)), planner=SafeLoadPlanner(), no_dist=True)
    return state["model"][name]


def consolidate(path: str | Path, out: str | Path) -> int:
    """Write every model tensor to `out` (.safetensors or .pt); return the bytes written."""
    tensors = model_tensors(path)
    if not tensors:
        raise ValueError(f"{path} holds no model tensors (is it a zplan checkpoint?)")
    out = Path(out)
    if not out.parent.is_dir():  # the shared writer would create it; consolidate never did
        raise UsageError(f"cannot write consolidated weights {out}: folder {out.parent} does not "
                         f"exist; create it or choose another path")
    if out.suffix == ".pt":
        full = {n: load_tensor(path, n, s, d) for n, (s, d) in tensors.items()}
        with atomic_writer(out, "consolidated weights") as f:
            torch.save(full, f)
        return out.stat().st_size
    header, offset = {}, 0
    for name, (shape, dtype) in tensors.items():
        n = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
        header[name] = {"dtype": ST_DTYPES[dtype], "shape": list(shape), "data_offsets": [offset, offset + n]}
        offset += n
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with atomic_writer(out, "consolidated weights") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for name, (shape, dtype) in tensors.items():
            t = load_tensor(path, name, shape, dtype).contiguous()
            f.write(t.view(torch.uint8).numpy().tobytes() if t.dtype == torch.bfloat16 else t.numpy().tobytes())
    return out.stat().st_size
