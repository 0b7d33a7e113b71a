"""Preset loading: one TOML file per GPU, cluster or model, shipped inside the wheel.

A name is looked up in the user's folders first (--presets DIR, or $ZPLAN_PRESETS, each holding
gpus/, clusters/, models/), then in the shipped presets. A path to a .toml file works too, and
for models a local Hugging Face config.json (read offline; no hub is ever contacted).
"""

from __future__ import annotations

import os
from functools import lru_cache
from importlib.util import find_spec
from pathlib import Path
from typing import TypeVar

from .errors import UsageError
from .files import read_json, read_toml
from .specs import ClusterSpec, GPUSpec, ModelSpec, validation_line
from .validated import Record, ValidationError

KINDS = {"gpus": GPUSpec, "clusters": ClusterSpec, "models": ModelSpec}
T = TypeVar("T", bound=Record)


@lru_cache(maxsize=1)
def _shipped_dir() -> Path:
    """The installed presets (package zplan.preset_files), or presets/ of a source checkout
    run without installing (PYTHONPATH=. as on the GPU check). Found by the import system's
    spec, not importlib.resources, whose readers import zipfile (~10 ms of estimate's 0.3 s);
    pip installs the package as a folder, and an editable install maps it to presets/."""
    try:
        spec = find_spec("zplan.preset_files")
    except ModuleNotFoundError:
        spec = None
    if spec is not None and spec.submodule_search_locations:
        return Path(list(spec.submodule_search_locations)[0])
    return Path(__file__).resolve().parent.parent / "presets"


def shipped_file(name: str) -> Path:
    """A data file shipped beside the presets (public_accuracy.json)."""
    return _shipped_dir() / name


def _search_dirs(extra: tuple[str, ...] = ()) -> list[Path]:
    """The user's --presets folders (each must be one: a typo would otherwise plan silently on
    the shipped presets), $ZPLAN_PRESETS (a search path, like PATH), then the shipped ones."""
    dirs = [Path(d) for d in extra]
    for d in dirs:
        if not _is(Path.is_dir, d):
            raise UsageError(f"--presets {d} is not a folder; pass a folder holding gpus/, clusters/ "
                             f"or models/ (zplan calibrate --output writes one)")
    env = os.environ.get("ZPLAN_PRESETS")
    if env:
        dirs += [Path(p) for p in env.split(os.pathsep) if p]
    dirs.append(_shipped_dir())
    return dirs


def names(kind: str, extra: tuple[str, ...] = ()) -> list[str]:
    """Every preset name of one kind, the user's folders first."""
    found: list[str] = []
    for d in _search_dirs(extra):
        try:  # a search path like PATH: a folder that cannot be listed holds no presets
            listed = sorted((d / kind).glob("*.toml"))
        except (OSError, ValueError):
            continue
        for p in listed:
            if p.stem not in found:
                found.append(p.stem)
    return found


def _parse(path: Path, cls: type[T], data: dict) -> T:
    try:
        return cls.model_validate(data)
    except ValidationError as err:
        raise UsageError(validation_line(f"preset {path}", err) + "; fix the file") from None


@lru_cache(maxsize=256)
def _load_file(path_str: str, kind: str) -> Record:
    path = Path(path_str)
    cls = KINDS[kind]
    if path.suffix == ".json":
        if kind != "models":
            raise UsageError(f"{path}: a .json file can only be a Hugging Face model config")
        from .hf_config import to_model_fields  # only for a config.json: estimate's start-up is counted

        return _parse(path, ModelSpec, to_model_fields(read_json(path, "model config"), path))
    return _parse(path, cls, read_toml(path, "preset"))


def _is(test, p: Path) -> bool:
    """Path.is_file / is_dir, False where the OS refuses the name (too long, bad bytes)."""
    try:
        return test(p)
    except (OSError, ValueError):
        return False


MAX_NAME = 255


def load(kind: str, name_or_path: str, extra: tuple[str, ...] = ()) -> Record:
    """Load a preset by name or path; unknown names list the close ones."""
    singular = kind[:-1]
    if not name_or_path.strip():
        raise UsageError(f"--{singular} {name_or_path!r} is empty; name a preset or a .toml file")
    if len(name_or_path) > 4096 or "\x00" in name_or_path:
        shown = repr(name_or_path[:40]) + ("..." if len(name_or_path) > 40 else "")
        why = "holds a NUL" if "\x00" in name_or_path else f"is {len(name_or_path):,} characters long"
        raise UsageError(f"--{singular} {shown} {why}; name a preset or a .toml file")
    p = Path(name_or_path)
    if p.suffix in (".toml", ".json") or _is(Path.is_dir, p) or os.sep in name_or_path:
        if _is(Path.is_dir, p) and _is(Path.is_file, p / "config.json"):
            p = p / "config.json"
        if not _is(Path.exists, p):
            raise UsageError(f"no such preset file: {name_or_path}")
        return _load_file(os.path.realpath(p), kind)
    key = name_or_path.lower()
    for d in _search_dirs(extra) if len(key) <= MAX_NAME else ():
        f = d / kind / f"{key}.toml"
        if _is(Path.exists, f):  # the reader refuses what is not a regular file, naming it
            return _load_file(str(f), kind)
    import difflib  # only for an unknown name: estimate's start-up is counted (issue 8)

    known = names(kind, extra)
    close = difflib.get_close_matches(key[:MAX_NAME], known, n=3, cutoff=0.4)
    hint = f"did you mean {', '.join(close)}?" if close else f"known: {', '.join(known)}"
    missing = [d for d in os.environ.get("ZPLAN_PRESETS", "").split(os.pathsep) if d and not _is(Path.is_dir, Path(d))]
    if missing:  # a search path skips what is not there, as PATH does: said where a name is not found
        hint += f"; $ZPLAN_PRESETS names {', '.join(missing)[:200]}, which is not a folder"
    shown = name_or_path if len(name_or_path) <= 80 else name_or_path[:77] + "..."
    raise UsageError(
        f"unknown {singular} {' '.join(shown.split())!r}: {hint} (or pass a path to a .toml file)"
    )


def gpu(name: str, extra: tuple[str, ...] = ()) -> GPUSpec:
    return load("gpus", name, extra)  # type: ignore[return-value]


def cluster(name: str, extra: tuple[str, ...] = ()) -> ClusterSpec:
    return load("clusters", name, extra)  # type: ignore[return-value]


def shipped(kind: str, name: str) -> bool:
    """Whether `name` is one of zplan's own presets of this kind (not a user's file or folder,
    nor one zplan calibrate wrote)."""
    return _is(Path.is_file, _shipped_dir() / kind / f"{name}.toml")


def model(name: str, extra: tuple[str, ...] = ()) -> ModelSpec:
    m: ModelSpec = load("models", name, extra)  # type: ignore[assignment]
    if m.total_params is not None:  # a plan's model synthesized from --params carries it; a file does not
        raise UsageError(f"model {name}: total_params is set only for a model synthesized from --params and "
                         f"replaces the count of the architecture the file gives ({m.num_layers} layers, hidden "
                         f"{m.hidden}); drop total_params (or use --params N)")
    return m


def home_cluster(g: GPUSpec, extra: tuple[str, ...] = ()) -> str | None:
    """The cluster preset a GPU preset sits in (GPUSpec.cluster; a calibrated preset's, its base
    part's): what --gpu alone plans for and a one-GPU calibration takes its links from. None: no
    node of its own (h100-pcie, a file of the user's)."""
    if g.cluster is not None or g.base is None:
        return g.cluster
    try:
        return gpu(g.base, extra).cluster
    except UsageError:  # a base without a preset file
        return None
