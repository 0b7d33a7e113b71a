"""estimate prints, beside its predictions, how far the public set's predictions were from the
measurements on the GPU it plans for (presets/public_accuracy.json, zplan/public_accuracy.py)."""

from __future__ import annotations

import json
from pathlib import Path

from tests.helpers import cli
from zplan import public_accuracy

SHIPPED = Path(__file__).resolve().parent.parent / "presets" / "public_accuracy.json"


def _shipped() -> dict:
    return json.loads(SHIPPED.read_text())


def test_estimate_prints_the_sets_figures_for_its_gpu(capsys):
    """The h100-sxm figures, read from the file here, appear in estimate's text as percentages,
    with the row count and which way the predictions leaned."""
    f = _shipped()["gpus"]["h100-sxm"]["tokens"]
    r = cli(capsys, "estimate", "--model", "llama-3.1-8b", "--gpus", "8", "--gpu", "h100-sxm")
    assert r.returncode == 0
    text = " ".join(r.stdout.split())
    assert "Predicted against measured" in text and "on h100-sxm:" in text
    side = "high" if f["bias"] >= 0 else "low"
    assert (f"tokens/s {100 * f['mean_abs']:.1f}% off on average over {f['rows']} runs (90% within "
            f"{100 * f['p90_abs']:.0f}%; {100 * abs(f['bias']):.1f}% {side} on average)") in text


def test_a_gpu_the_set_never_ran_gets_the_whole_sets_figures(capsys):
    a = _shipped()["all"]["tokens"]
    r = cli(capsys, "estimate", "--model", "llama-3.1-8b", "--gpus", "8", "--gpu", "l40s",
            "--checkpointing", "full")
    text = " ".join(r.stdout.split())
    assert "no run of the set used l40s; on every GPU of the set:" in text
    assert f"over {a['rows']} runs" in text


def test_json_carries_the_figures_and_cpu_ranks_none(capsys):
    r = cli(capsys, "estimate", "--model", "llama-3.1-8b", "--gpus", "8", "--gpu", "a100-80gb",
            "--json", "--checkpointing", "full")
    got = json.loads(r.stdout)["public_accuracy"]
    want = _shipped()["gpus"]["a100-80gb"]
    assert got["scope"] == "a100-80gb" and got["tokens"] == want["tokens"] and got["memory"] == want["memory"]
    r = cli(capsys, "estimate", "--params", "1e7", "--gpus", "2", "--gpu", "cpu",
            "--cluster", "cpu-local", "--json")
    assert json.loads(r.stdout)["public_accuracy"] is None


def test_a_malformed_summary_is_ignored_not_misread():
    """The file is data: a metric without its four numbers, or with a flag for a number, is no
    figure; a GPU entry that is not a table falls back to the whole set's."""
    good = {"rows": 3, "mean_abs": 0.1, "p90_abs": 0.2, "bias": -0.05}
    data = {"gpus": {"x": {"tokens": {"rows": 3}, "memory": dict(good, rows=True)}, "y": [1]},
            "all": {"tokens": good, "memory": None}}
    assert public_accuracy.for_gpu("x", data) is None
    y = public_accuracy.for_gpu("y", data)
    assert y["scope"] == "all" and y["tokens"] == good and y["memory"] is None
    assert "peak memory: no measurement" in public_accuracy.sentence("y", y)


def test_recommend_carries_the_figures_for_its_gpu(capsys):
    """recommend's winner comes with the same figures, in its text and its JSON."""
    want = _shipped()["gpus"]["a100-80gb"]["tokens"]
    args = ("recommend", "--model", "llama-3.2-1b", "--gpus", "8", "--gpu", "a100-80gb", "--cluster",
            "dgx-a100", "--strategy", "zero3", "--checkpointing", "full", "--top", "0")
    got = json.loads(cli(capsys, *args, "--json").stdout)["public_accuracy"]
    assert got["scope"] == "a100-80gb" and got["tokens"] == want
    r = cli(capsys, *args)
    assert f"over {want['rows']} runs" in " ".join(r.stdout.split())
