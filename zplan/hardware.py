"""What this machine has: GPUs (through NVML), host RAM (clamped to the cgroup), usable CPUs
(affinity, clamped to the cgroup's quota).

No GPU, or no driver, is not an error: `detect()` says what it found and why.
NVML ignores CUDA_VISIBLE_DEVICES, so the visible set (ordinals, GPU UUIDs, MIG identifiers) is
applied here.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path

# NVML product names -> preset names, most specific first (the first match wins). None: a part
# whose name contains a preset's but which no preset describes (GH200: 96 or 144 GB beside a
# Grace CPU, "NVIDIA GH200 480GB"; H100 NVL: 94 GB at lower clocks than the SXM part); such a
# GPU plans with --gpu FILE.toml, or with the preset zplan calibrate writes on it.
_NAME_MAP: tuple[tuple[str, str | None], ...] = (
    (r"GH200", None), (r"H100 NVL", None), (r"H200", "h200"), (r"H100.*PCIe", "h100-pcie"),
    (r"H100", "h100-sxm"), (r"GB200", "gb200"), (r"B200", "b200"), (r"A100.*80", "a100-80gb"),
    (r"A100", "a100-40gb"), (r"L40S", "l40s"), (r"RTX 4090", "rtx-4090"), (r"MI300X", "mi300x"),
)


@dataclass(frozen=True)
class GPUInfo:
    index: int  # NVML's index (a MIG slice: its parent GPU's)
    name: str
    memory_bytes: int
    preset: str | None  # None for a MIG slice: it is not the preset's whole GPU
    uuid: str = ""
    mig: bool = False


@dataclass(frozen=True)
class Detected:
    gpus: list[GPUInfo] = field(default_factory=list)
    gpu_reason: str = ""
    host_ram_bytes: int = 0
    host_ram_source: str = ""
    cpus: int = 1
    cpu_bf16: bool | None = None  # bf16 matrix instructions (cpu_has_bf16); None: unknown

    @property
    def gpu_preset(self) -> str | None:
        names = {g.preset for g in self.gpus}
        return names.pop() if len(names) == 1 else None


def preset_for(nvml_name: str) -> str | None:
    for pattern, preset in _NAME_MAP:
        if re.search(pattern, nvml_name, re.IGNORECASE):
            return preset
    return None


def _text(v) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


def _gpu_by_uuid(nvml, count: int, prefix: str):
    """(index, handle) of the one GPU whose UUID starts with `prefix` (CUDA accepts a unique
    prefix of "GPU-..."), or None."""
    hits = []
    for i in range(count):
        h = nvml.nvmlDeviceGetHandleByIndex(i)
        if _text(nvml.nvmlDeviceGetUUID(h)).startswith(prefix):
            hits.append((i, h))
    return hits[0] if len(hits) == 1 else None


def _mig_by_ids(nvml, parent, gi: int, ci: int):
    """The MIG device of `parent` with GPU instance `gi` and compute instance `ci`, or None."""
    for j in range(int(nvml.nvmlDeviceGetMaxMigDeviceCount(parent))):
        try:
            h = nvml.nvmlDeviceGetMigDeviceHandleByIndex(parent, j)
        except Exception:  # NVMLError_NotFound: an empty slot
            continue
        if (int(nvml.nvmlDeviceGetGpuInstanceId(h)), int(nvml.nvmlDeviceGetComputeInstanceId(h))) == (gi, ci):
            return h
    return None


def _resolve(nvml, count: int, tok: str):
    """One CUDA_VISIBLE_DEVICES entry -> (index, handle, is_mig), or None if CUDA would reject it.

    Forms: an ordinal; "GPU-<uuid>" (or a unique prefix); "MIG-<uuid>" (R470+ drivers);
    "MIG-GPU-<uuid>/<gpu instance>/<compute instance>" (older drivers)."""
    if tok.isdigit():
        i = int(tok)
        return (i, nvml.nvmlDeviceGetHandleByIndex(i), False) if i < count else None
    if tok.startswith("GPU-"):
        hit = _gpu_by_uuid(nvml, count, tok)
        return (hit[0], hit[1], False) if hit else None
    m = re.fullmatch(r"MIG-(GPU-[0-9a-fA-F-]+)/(\d+)/(\d+)", tok)
    if m:
        hit = _gpu_by_uuid(nvml, count, m.group(1))
        h = _mig_by_ids(nvml, hit[1], int(m.group(2)), int(m.group(3))) if hit else None
        return (hit[0], h, True) if h is not None else None
    if tok.startswith("MIG-"):
        try:
            h = nvml.nvmlDeviceGetHandleByUUID(tok)
            parent = nvml.nvmlDeviceGetDeviceHandleFromMigDeviceHandle(h)
            return int(nvml.nvmlDeviceGetIndex(parent)), h, True
        except Exception:  # NVMLError_NotFound / InvalidArgument: CUDA would not see it either
            return None
    return None


def visible_devices(nvml, count: int, env: str | None) -> list[tuple[int, object, bool]]:
    """CUDA_VISIBLE_DEVICES applied to NVML (which ignores it): (index, handle, is_mig) in
    CUDA's order, stopping at the first entry CUDA would reject or repeat."""
    if env is None:
        return [(i, nvml.nvmlDeviceGetHandleByIndex(i), False) for i in range(count)]
    out, seen = [], set()
    for tok in (t.strip() for t in env.split(",")):
        if not tok:
            continue
        hit = _resolve(nvml, count, tok)
        key = None if hit is None else (hit[0], hit[2], tok if hit[2] else None)
        if hit is None or key in seen:
            break
        seen.add(key)
        out.append(hit)
    return out


def lendable_bytes(nvml, handle) -> int:
    """What CUDA lends of a GPU (totalGlobalMem, torch's total_memory, the presets' figure): NVML's
    total less the driver's reserve (nvmlMemory_v2_t, as `nvidia-smi -q` prints Total and
    Reserved); the v1 total, which counts the reserve, where the driver or binding has no v2."""
    v2 = getattr(nvml, "nvmlMemory_v2", None)
    if v2 is not None:
        try:
            m = nvml.nvmlDeviceGetMemoryInfo(handle, version=v2)
            return int(m.total) - int(m.reserved)
        except Exception:  # NVMLError_FunctionNotFound (drivers before R510), NotSupported
            pass
    return int(nvml.nvmlDeviceGetMemoryInfo(handle).total)


def _nvml(nvml) -> tuple[list[GPUInfo], str]:
    try:
        nvml.nvmlInit()
    except Exception as e:  # NVMLError: driver not loaded, library missing
        return [], f"NVML could not start ({e}); no NVIDIA driver here"
    try:
        count = nvml.nvmlDeviceGetCount()
        env = os.environ.get("CUDA_VISIBLE_DEVICES")
        gpus = []
        for i, h, mig in visible_devices(nvml, count, env):
            name = _text(nvml.nvmlDeviceGetName(h))
            # a MIG slice: NVML's v1 total (what v2's reserve means on a slice is not documented)
            mem = int(nvml.nvmlDeviceGetMemoryInfo(h).total) if mig else lendable_bytes(nvml, h)
            uuid = _text(nvml.nvmlDeviceGetUUID(h)) if hasattr(nvml, "nvmlDeviceGetUUID") else ""
            gpus.append(GPUInfo(i, name, mem, None if mig else preset_for(name), uuid, mig))
        why = f"{len(gpus)} of {count} GPUs visible" if len(gpus) != count else f"{count} GPU(s) found by NVML"
        if env is not None and env.strip() and not gpus:
            why += f" (CUDA_VISIBLE_DEVICES={env!r} names none of them)"
        if any(g.mig for g in gpus):
            why += "; a MIG slice matches no preset (it is not the whole GPU): pass --gpu with a preset of your own"
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


def cgroup_cpu_limit(root: Path = Path("/sys/fs/cgroup")) -> int | None:
    """The container's CPU quota in whole CPUs, rounded up (cgroup v2 cpu.max "quota period",
    or v1 cfs_quota_us / cfs_period_us), if any."""
    pairs = [(root / "cpu.max", None), (root / "cpu" / "cpu.cfs_quota_us", root / "cpu" / "cpu.cfs_period_us")]
    for first, second in pairs:
        try:
            words = first.read_text().split()
            if second is not None:
                words = words[:1] + second.read_text().split()[:1]
        except OSError:
            continue
        if len(words) == 2 and words[0].isdigit() and words[1].isdigit() and int(words[1]) > 0:
            return max(1, -(-int(words[0]) // int(words[1])))
    return None


def usable_cpus(root: Path = Path("/sys/fs/cgroup")) -> int:
    """CPUs this process may run on (its affinity), clamped to the cgroup's quota."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:
        cpus = os.cpu_count() or 1
    limit = cgroup_cpu_limit(root)
    return min(cpus, limit) if limit is not None else cpus


BF16_CPU_FLAGS = ("avx512_bf16", "amx_bf16", "bf16")  # x86 (AVX-512 BF16, AMX), Arm (FEAT_BF16)


def cpu_has_bf16(cpuinfo: Path = Path("/proc/cpuinfo")) -> bool | None:
    """Whether this CPU has bf16 matrix instructions, from the kernel's flags (x86's `flags`:
    avx512_bf16 or amx_bf16; Arm's `Features`: bf16); None where /proc/cpuinfo cannot be read.
    Without them PyTorch emulates bf16 matmuls: one thread of an AVX2-only AMD EPYC (this
    project's 2-core test machine, torch 2.13) ran them at 0.9-1.3 GFLOP/s against 46-57 in fp32
    (1024-cube products: bf16 0.9, fp16 0.7, fp32 45.7 on 2026-12-02)."""
    try:
        text = cpuinfo.read_text(errors="replace")
    except OSError:
        return None
    words = set()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip().lower() in ("flags", "features"):
            words.update(value.split())
    if not words:
        return None
    return any(f in words for f in BF16_CPU_FLAGS)


def nccl_net_overhead_s(cpuinfo: Path = Path("/proc/cpuinfo")) -> float:
    """NCCL's per-step network overhead of a ring spanning nodes on this host (tuning.cc
    getNetOverhead: 2 us on AMD x86, 1 us on Intel x86 and any other host), from the CPU's
    vendor_id; 1 us where /proc/cpuinfo cannot be read."""
    try:
        text = cpuinfo.read_text(errors="replace")
    except OSError:
        return 1.0e-6
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "vendor_id":
            return 2.0e-6 if value.strip() == "AuthenticAMD" else 1.0e-6
    return 1.0e-6


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
    return Detected(gpus, why, ram, source, usable_cpus(), cpu_has_bf16())
