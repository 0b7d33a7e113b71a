"""Reading a checkpoint folder as untrusted data.

DCP's `.metadata` is a pickle, and `pickle.load` runs whatever callable the file names. Here it
is read by an unpickler that resolves only the classes a DCP checkpoint's metadata is made of
(torch.distributed.checkpoint.metadata's dataclasses, the file system reader's storage info,
torch.Size, dtypes and layouts, pathlib paths); any other global refuses the file with one line.
`SafeReader` is DCP's FileSystemReader with that reader in place of pickle.load, and
`SafeLoadPlanner` reads the non-tensor values inside the shards with weights_only=True; every
zplan load goes through both. `check_complete` says whether every byte range the metadata names
exists on disk (a truncated or missing shard makes a checkpoint incomplete).
"""

from __future__ import annotations

import io
import pickle
from pathlib import Path

import torch
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader

from ..errors import UsageError

METADATA = ".metadata"
MAX_METADATA_BYTES = 1 << 30  # a 1 TB model's metadata is a few MiB

_DCP_CLASSES = {
    "torch.distributed.checkpoint.metadata": {
        "Metadata", "MetadataIndex", "TensorStorageMetadata", "BytesStorageMetadata",
        "ChunkStorageMetadata", "TensorProperties", "StorageMeta", "_MEM_FORMAT_ENCODING"},
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo", "_StoragePrefix"},
    "torch.serialization": {"_get_layout"},
    "torch": {"Size"},
    "pathlib": {"PosixPath", "PurePosixPath", "Path", "WindowsPath", "PureWindowsPath"},
}


class CheckpointError(UsageError):
    """A checkpoint that cannot be read: crafted, truncated, or not a checkpoint at all."""


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if name in _DCP_CLASSES.get(module, ()):
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), (torch.dtype, torch.layout)):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"refers to {module}.{name}, which is not part of a checkpoint's metadata")


def read_metadata(folder: str | Path):
    """The Metadata of the DCP checkpoint in `folder`, read without running code from it."""
    from torch.distributed.checkpoint.metadata import Metadata

    path = Path(folder) / METADATA
    try:
        if not path.is_file():
            raise CheckpointError(f"{folder} is not a checkpoint: it has no {METADATA} file")
        size = path.stat().st_size
        if size == 0 or size > MAX_METADATA_BYTES:
            raise CheckpointError(f"checkpoint metadata {path} is {size:,} bytes: it is empty or not a "
                                  f"checkpoint's; pass another step_N folder")
        raw = path.read_bytes()
    except OSError as e:
        raise CheckpointError(f"cannot read checkpoint metadata {path}: {e.strerror}") from None
    try:
        md = _MetadataUnpickler(io.BytesIO(raw)).load()
    except pickle.UnpicklingError as e:
        why = f"it {e}" if str(e).startswith("refers to") else f"not a checkpoint's pickle ({e})"
        raise CheckpointError(f"refused checkpoint metadata {path}: {why} (the file may be crafted; "
                              f"nothing from it was run)") from None
    except (EOFError, ValueError, TypeError, AttributeError, IndexError, KeyError, RecursionError,
            MemoryError, RuntimeError, OverflowError) as e:
        raise CheckpointError(f"checkpoint metadata {path} is damaged ({type(e).__name__}); "
                              f"pass another step_N folder") from None
    if not isinstance(md, Metadata) or not isinstance(getattr(md, "state_dict_metadata", None), dict):
        raise CheckpointError(f"checkpoint metadata {path} holds a {type(md).__name__}, not DCP metadata")
    return md


def check_complete(folder: str | Path, md=None) -> str | None:
    """Why the checkpoint in `folder` is incomplete (a shard missing or shorter than the metadata
    says), or None."""
    folder = Path(folder)
    md = read_metadata(folder) if md is None else md
    need: dict[str, int] = {}
    for info in (md.storage_data or {}).values():
        rel = getattr(info, "relative_path", None)
        if not isinstance(rel, str) or "/" in rel or rel.startswith("."):
            return f"its metadata names a shard {rel!r} outside the folder"
        need[rel] = max(need.get(rel, 0), int(info.offset) + int(info.length))
    for rel, end in sorted(need.items()):
        f = folder / rel
        if not f.is_file():
            return f"shard {rel} is missing"
        if f.stat().st_size < end:
            return f"shard {rel} is {f.stat().st_size:,} bytes, shorter than the {end:,} its metadata names"
    return None


def _refused(what: str, e: BaseException) -> CheckpointError:
    first = str(e).splitlines()[0] if str(e) else type(e).__name__
    return CheckpointError(f"refused {what}: {first} (the file may be crafted; nothing from it was run)")


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, with the non-tensor values of a checkpoint (the step, the
    optimizer's hyper-parameters: DCP stores each as a pickle inside a shard) read by
    torch.load(weights_only=True). DCP's own load_bytes uses weights_only=False, so a crafted
    shard ran code at resume. Tensors are read by DCP with weights_only=True already."""

    def load_bytes(self, read_item, value) -> None:
        try:
            obj = torch.load(value, weights_only=True)
        except (pickle.UnpicklingError, RuntimeError, EOFError, ValueError, TypeError) as e:
            raise _refused(f"the value of {read_item.dest_index.fqn} in a checkpoint shard", e) from None
        clean = io.BytesIO()  # handed to DCP's own placement, re-serialised from the vetted value
        torch.save(obj, clean)
        clean.seek(0)
        super().load_bytes(read_item, clean)


class SafeReader(FileSystemReader):
    """DCP's file system reader, with the metadata read by `read_metadata` above."""

    def read_metadata(self, *args, **kwargs):
        from torch.distributed.checkpoint.metadata import StorageMeta

        md = read_metadata(self.path)
        if getattr(md, "storage_meta", None) is None:
            md.storage_meta = StorageMeta()
        if hasattr(self, "load_id"):
            md.storage_meta.load_id = self.load_id
        return md
