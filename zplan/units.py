"""Byte and dtype units. Bytes are integers everywhere; GB and GiB appear only when printing."""

from __future__ import annotations

import math
from typing import Literal

DType = Literal["fp32", "tf32", "bf16", "fp16", "fp8", "int8", "int4"]

DTYPE_BITS: dict[str, int] = {
    "fp32": 32,
    "tf32": 32,  # stored as fp32; tf32 only changes the matmul
    "bf16": 16,
    "fp16": 16,
    "fp8": 8,
    "int8": 8,
    "int4": 4,
}

GB = 10**9
GiB = 2**30
MiB = 2**20


def dtype_bytes(dtype: str) -> float:
    """Bytes per element (0.5 for int4); use nbytes() for counts."""
    return DTYPE_BITS[dtype] / 8


def nbytes(elements: int, dtype: str) -> int:
    """Bytes that `elements` values of `dtype` occupy, rounded up to a whole byte."""
    return (int(elements) * DTYPE_BITS[dtype] + 7) // 8


def ceil_div(a: int, b: int) -> int:
    return -(-int(a) // int(b))


def relative_error(predicted: float, measured: float) -> float:
    """(predicted - measured) / measured: zplan's one sign convention for predicted against
    measured (verify, the run report, selfcheck). Negative: the prediction was too small."""
    return (predicted - measured) / max(abs(measured), 1e-300)


def fmt_bytes(n: int | float, unit: str = "GB") -> str:
    """Print bytes in GB (1e9) or GiB (2^30); the unit is always shown."""
    div = GB if unit == "GB" else GiB
    v = n / div
    if v >= 100:
        return f"{v:,.0f} {unit}"
    if v >= 10:
        return f"{v:.1f} {unit}"
    return f"{v:.2f} {unit}"


def fmt_count(n: float) -> str:
    for div, suffix in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "k")):
        if abs(n) >= div:
            return f"{n / div:.3g}{suffix}"
    return f"{n:.0f}"


def fmt_s(t: float) -> str:
    if not math.isfinite(t):
        return "inf"
    if t >= 1:
        return f"{t:.2f} s"
    return f"{t * 1e3:.1f} ms"
