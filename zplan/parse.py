"""Parsing of user-typed values into validated numbers; every failure is one UsageError line."""

from __future__ import annotations

import math
import re

from .errors import UsageError
from .specs import MAX_GPUS, MAX_PARAMS  # noqa: F401  (re-exported: the flags' limits)

_SUFFIX = {"": 1, "k": 1e3, "m": 1e6, "b": 1e9, "g": 1e9, "t": 1e12}


def parse_count(text: str, flag: str, maximum: int = MAX_PARAMS, integer: bool = False,
                example: str = "70e9 or 70B") -> int:
    """'70e9', '70B', '7.5b', '1.2T', '3033344' -> int, refusing zero, negatives and absurd sizes;
    a refusal shows `example`, a value the flag takes."""
    s = str(text).strip().lower().replace("_", "")
    if "," in s:  # thousands separators only: 3,033,344 is a count, 1,2 is a typo (not 12)
        if not re.fullmatch(r"[+-]?\d{1,3}(?:,\d{3})+(?:\.\d*)?\s*[kmbgt]?", s):
            raise UsageError(f"{flag} {text!r} is not a number: commas may only group thousands "
                             f"(3,033,344); write it like {example}")
        s = s.replace(",", "")
    m = re.fullmatch(r"([+-]?[0-9.]+(?:e[+-]?\d+)?)\s*([kmbgt]?)", s)
    if not m:
        raise UsageError(f"{flag} {text!r} is not a number; write it like {example}")
    try:
        value = float(m.group(1)) * _SUFFIX[m.group(2)]
    except ValueError:
        raise UsageError(f"{flag} {text!r} is not a number; write it like {example}") from None
    if value == math.inf:  # 1e400: a float overflows to infinity, too large rather than not positive
        raise UsageError(f"{flag} {text!r} is absurdly large (limit {maximum:.0e}); check the exponent")
    if not math.isfinite(value) or value < 1:
        raise UsageError(f"{flag} {text!r} must be a positive count; write it like {example}")
    if integer and value != int(value):
        raise UsageError(f"{flag} {text!r} must be a whole number")
    if value > maximum:
        raise UsageError(f"{flag} {text!r} is absurdly large (limit {maximum:.0e}); check the exponent")
    return int(round(value))


def check_range(value: int | float | None, flag: str, lo: float, hi: float) -> None:
    """Refuse a value outside lo..hi, NaN, and anything that is not a number (from zplan.toml)."""
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise UsageError(f"{flag} {value!r} is not a number; use a value in {lo:g}..{hi:g}")
    if not (lo <= value <= hi):
        raise UsageError(f"{flag} {value} is out of range; use a value in {lo:g}..{hi:g}")


def check_choice(value: str, flag: str, choices: tuple[str, ...] | list[str]) -> str:
    if not isinstance(value, str) or value not in choices:
        raise UsageError(f"{flag} {value!r} is not one of: {', '.join(choices)}")
    return value
