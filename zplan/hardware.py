"""What this machine has: GPUs (through NVML), host RAM (clamped to the cgroup), usable CPUs.

No GPU, or no driver, is not an error: `detect()` says what it found and why.
NVML ignores CUDA_VISIBLE_DEVICES, so the visible set is applied here.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path

# NVML product names -> preset names, most specific first.
_NAME_MAP = (
    (r"H200", "h200"), (r"H100.*PCIe", "h100-pcie"), (r"H100", "h100-sxm"), (r"B200", "b200"),
    (r"GB200", "b200"), (r"A100.*80", "a100-80gb"), (r"A100", "a100-40gb"), (r"L40S", "l40s"),
    (r"RTX 4090", "rtx-4090"), (r"MI300X", "mi300x"),
)


@dataclass(frozen=True)
class GPUInfo:
    index: int
    name: str
    memory_bytes: int
    preset: str | None


@dataclass(frozen=True)
class Detected:
    gpus: list[GPUInfo] = field(default_factory=list)
    gpu_reason: str = ""
    host_ram_bytes: int = 0
    host_ram_source: str = ""
    cpus: int = 1

    @property
    def gpu_preset(self) -> str | None:
        names = {g.preset for g in self.gpus}
        return names.pop() if len(names) == 1 else None


def preset_for(nvml_name: str) -> str | None:
    for pattern, preset in _NAME_MAP:
        if re.search(pattern, nvml_name, re.IGNORECASE):
            return preset
    return None


def visible_indices(count: int, env: str | None) -> list[int]:
    """Apply CUDA_VISIBLE_DEVICES (integers; UUIDs are kept in order) to NVML's device list."""
    if env is None:
        return list(range(count))
    out = []
    for tok in env.split(","):
        tok = tok.strip()
        if not tok:
            continue
        if not tok.isdigit():
            break  # CUDA stops at the first invalid entry; UUID lists are handled by the caller
        i = int(tok)
        if i >= count or i in out:
            break
        out.append(i)
    return out


def _nvml(nvml) -> tuple[list[GPUInfo], str]:
    try:
        nvml.nvmlInit()
    except Exception as e:  # NVMLError: driver not loaded, library missing
        return [], f"NVML could not start ({e}); no NVIDIA driver here"
    try:
        count = nvml.nvmlDeviceGetCount()
        idx = visible_indices(count, os.environ.get("CUDA_VISIBLE_DEVICES"))
        gpus = []
        for i in idx:
            h = nvml.nvmlDeviceGetHandleByIndex(i)
            name = nvml.nvmlDeviceGetName(h)
            name = name.decode() if isinstance(name, bytes) else str(name)
            mem = int(nvml.nvmlDeviceGetMemoryInfo(h).total)
            gpus.append(GPUInfo(i, name, mem, preset_for(name)))
        why = f"{len(gpus)} of {count} GPUs visible" if len(gpus) != count else f"{count} GPU(s) found by NVML"
        return gpus, why
    finally:
        try:
            nvml.nvmlShutdown()
        except Exception:
            pass


def cgroup_memory_limit(root: Path = Path("/sys/fs/cgroup")) -> int | None:
    """The container's memory limit (cgroup v2 memory.max, or v1 limit_in_bytes), if any."""
    for f in (root / "memory.max", root / "memory" / "memory.limit_in_bytes"):
        try:
            text = f.read_text().strip()
        except OSError:
            continue
        if text.isdigit() and int(text) < 2**60:
            return int(text)
    return None


def detect(nvml_module=None) -> Detected:
    """Look at this machine. `nvml_module` replaces pynvml in tests (a fake module)."""
    if nvml_module is None:
        try:
            import pynvml as nvml_module  # nvidia-ml-py
        except ImportError:
            nvml_module = None
    if nvml_module is None:
        gpus, why = [], "nvidia-ml-py is not installed"
    else:
        gpus, why = _nvml(nvml_module)
    import psutil

    ram = int(psutil.virtual_memory().total)
    source = "psutil (host)"
    limit = cgroup_memory_limit()
    if limit is not None and limit < ram:
        ram, source = limit, "cgroup limit"
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:
        cpus = os.cpu_count() or 1
    return Detected(gpus, why, ram, source, cpus)
