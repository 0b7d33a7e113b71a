"""JSON on stdout, written as json.dumps(obj, indent=2, allow_nan=False) writes it, faster.

The standard library encodes indented JSON in pure Python, one generator per level: ~16 ms for
an estimate of a 126-layer model (270 kB), a twentieth of estimate's start-up budget. This
writer handles the types the planning library emits (dict with str keys, list, str, int,
float, bool, None) with the standard library's own string encoder and float and int reprs, in
about half the time; anything else (tuples, other keys, NaN or infinity) is handed to json.dumps,
which produces the same text or raises the same error.
"""

from __future__ import annotations

import json
import sys
from json.encoder import encode_basestring_ascii as _quote

_INF = float("inf")


class _Unusual(Exception):
    """A value this writer leaves to json.dumps."""


def emit_json(obj: dict) -> None:
    """One JSON object on stdout; NaN or infinity is a bug upstream, never printed as non-JSON."""
    sys.stdout.write(dumps(obj) + "\n")


def dumps(obj) -> str:
    """json.dumps(obj, indent=2, allow_nan=False), character for character."""
    parts: list[str] = []
    try:
        _encode(obj, "\n", parts.append)
    except _Unusual:
        return json.dumps(obj, indent=2, allow_nan=False)
    return "".join(parts)


def _encode(o, newline: str, out) -> None:
    """Append `o`'s text to `out`; `newline` is a newline and the indentation of o's level."""
    t = type(o)
    if t is str:
        out(_quote(o))
    elif t is float:
        if o != o or o == _INF or o == -_INF:
            raise _Unusual
        out(float.__repr__(o))
    elif t is int:
        out(int.__repr__(o))
    elif o is None:
        out("null")
    elif o is True:
        out("true")
    elif o is False:
        out("false")
    elif t is dict or t is list:
        if not o:
            out("{}" if t is dict else "[]")
            return
        inner = newline + "  "
        sep = ("{" if t is dict else "[") + inner
        for k, v in o.items() if t is dict else zip(o, o):  # a list: each item is its own value
            out(sep)
            if t is dict:
                if type(k) is not str:
                    raise _Unusual
                out(_quote(k))
                out(": ")
            _encode(v, inner, out)
            sep = "," + inner
        out(newline + ("}" if t is dict else "]"))
    else:
        raise _Unusual
