"""How far zplan's predictions were from measured runs: the public set's summary, per GPU preset.

benchmarks/published_accuracy.py --summary writes presets/public_accuracy.json (shipped with the
presets) from the same run that generates docs/accuracy.md; tests/test_published.py holds the
shipped file to the current model, so it cannot go stale. `zplan estimate` prints the line for
the GPU it plans for, so every prediction comes with its measured error beside it."""

from __future__ import annotations

from .errors import UsageError
from .files import read_json
from .presets import shipped_file

FILE = "public_accuracy.json"
_METRICS = ("tokens", "memory")
_FIELDS = {"rows": int, "mean_abs": float, "p90_abs": float, "bias": float}


def _figures(d) -> dict | None:
    """One metric's figures, or None where the file holds none (or not in the expected form)."""
    if not isinstance(d, dict) or set(d) != set(_FIELDS):
        return None
    if not all(isinstance(d[k], (int, float)) and not isinstance(d[k], bool) for k in _FIELDS):
        return None
    return {k: t(d[k]) for k, t in _FIELDS.items()}


def load() -> dict | None:
    """The shipped summary, or None where it is missing or not in the form written."""
    path = shipped_file(FILE)
    if not path.is_file():
        return None
    try:
        data = read_json(path, "public-set accuracy summary")
    except UsageError:
        return None
    if not isinstance(data, dict) or not isinstance(data.get("gpus"), dict):
        return None
    return data


def for_gpu(gpu: str, data: dict | None = None) -> dict | None:
    """{"scope": the preset name, or "all" where no row of the set used it, "tokens", "memory"
    (each {"rows", "mean_abs", "p90_abs", "bias"} as fractions, or None), "report"}."""
    data = load() if data is None else data
    if data is None:
        return None
    block, scope = data["gpus"].get(gpu), gpu
    if not isinstance(block, dict):
        block, scope = data.get("all"), "all"
    if not isinstance(block, dict):
        return None
    out = {"scope": scope, "report": str(data.get("report", "docs/accuracy.md"))}
    out.update({m: _figures(block.get(m)) for m in _METRICS})
    return out if out["tokens"] or out["memory"] else None


def sentence(gpu: str, acc: dict) -> str:
    """One line: how far the set's predictions (default assumptions) were from the measurements
    on this GPU preset, or on all GPUs where the set has no run on it."""
    def part(what: str, f: dict | None) -> str:
        if f is None:
            return f"{what}: no measurement"
        side = "high" if f["bias"] >= 0 else "low"
        return (f"{what} {f['mean_abs']:.1%} off on average over {f['rows']} runs (90% within "
                f"{f['p90_abs']:.0%}; {abs(f['bias']):.1%} {side} on average)")

    where = (f"on {gpu}" if acc["scope"] == gpu else
             f"no run of the set used {gpu}; on every GPU of the set")
    return (f"Predicted against measured (the public set with default assumptions, "
            f"{acc['report']}), {where}: {part('tokens/s', acc['tokens'])}; "
            f"{part('peak memory', acc['memory'])}")
