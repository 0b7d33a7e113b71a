"""The public validation set (benchmarks/published/) loads, names its sources, and the accuracy
script turns rows into finite predictions. No accuracy threshold here: docs/accuracy.md reports it."""

from __future__ import annotations

import importlib.util
import json
import math
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PUBLISHED = ROOT / "benchmarks" / "published"
sys.path.insert(0, str(PUBLISHED))

import published_rows  # noqa: E402

from zplan import presets  # noqa: E402


def _accuracy_module():
    if "published_accuracy" not in sys.modules:
        spec = importlib.util.spec_from_file_location("published_accuracy", ROOT / "benchmarks" / "published_accuracy.py")
        mod = importlib.util.module_from_spec(spec)
        sys.modules["published_accuracy"] = mod  # dataclasses look their module up while the class is built
        spec.loader.exec_module(mod)
    return sys.modules["published_accuracy"]


@pytest.fixture(scope="module")
def rows():
    return published_rows.load()


def test_set_covers_three_sources_and_three_gpus(rows):
    assert len(rows) >= 30
    orgs = {r.source.org for r in rows}
    assert len(orgs) >= 3, orgs
    assert {"A100", "H100", "H200"} <= {r.gpu_kind for r in rows}
    scored = [r for r in rows if r.expressible]
    assert {"A100", "H100", "H200"} <= {r.gpu_kind for r in scored if r.tokens_per_s_per_gpu}
    assert any(r.memory is not None for r in scored)


def test_every_row_names_its_source_and_resolves(rows):
    for r in rows:
        s = r.source
        assert s.url.startswith("https://") and s.file and s.tokens, r.id
        assert r.table, r.id
        presets.model(r.model)  # every model is a shipped preset
        presets.gpu(r.gpu)
        if not r.expressible:
            assert r.why_not, r.id
        if max(r.tp, r.pp, r.cp) > 1:
            assert not r.expressible, r.id
    assert len({r.id for r in rows}) == len(rows)


def test_memory_units_convert_as_named(rows):
    r = next(r for r in rows if r.id == "tt-8b-8gpu-fsdp")
    assert (r.memory, r.memory_unit, r.memory_kind) == (82.4, "GiB", "reserved")
    assert r.memory_bytes == round(82.4 * 1024**3)


GOOD_SOURCE = '''[source]
name = "x"
org = "o"
who = "w"
url = "https://example.org/x"
file = "f.md"
date = "2025"
memory_kind = ""
tokens = "as published"
notes = ""
'''
GOOD_ROW = '''[[row]]
id = "a"
model = "llama-3.1-8b"
gpu = "h100-sxm"
num_gpus = 8
gpus_per_node = 8
parallelism = "FSDP2"
strategy = "zero3"
micro_batch = 1
grad_accum = 1
seq_len = 8192
checkpointing = "full"
compile = false
float8 = "none"
param_dtype = "bf16"
reduce_dtype = "fp32"
table = "t"
tokens_per_s_per_gpu = 1000.0
'''


@pytest.mark.parametrize("change, message", [
    (("num_gpus = 8", 'num_gpus = "eight"'), "num_gpus = 'eight' is not a int"),
    (("checkpointing = \"full\"", 'checkpointing = "some"'), "checkpointing = 'some' is not one of"),
    (("tokens_per_s_per_gpu = 1000.0", "tokens_per_s_per_gpu = -1.0"), "must be a finite number above 0"),
    (("tokens_per_s_per_gpu = 1000.0", "memory = 40.0"), "memory needs memory_unit"),
    (("table = \"t\"", 'table = "t"\ntp = 8'), "tp/pp/cp above 1 cannot be expressed"),
    (("num_gpus = 8", "num_gpus = 12"), "not a whole number of nodes"),
    (("table = \"t\"", 'table = "t"\ncolour = "red"'), "unknown field(s) colour"),
    (("float8 = \"none\"", 'float8 = "rowwise"\nfloat8_all_gather = false'), "float8_all_gather states"),
    (("table = \"t\"", 'table = "t"\ncluster = "my-cluster"'), "cluster = 'my-cluster' is not one of"),
])
def test_bad_row_names_file_row_and_field(tmp_path, change, message):
    (tmp_path / "bad.toml").write_text(GOOD_SOURCE + GOOD_ROW.replace(*change))
    with pytest.raises(published_rows.RowError) as e:
        published_rows.load(tmp_path)
    assert str(e.value).startswith("bad.toml row 1 (a)") and message in str(e.value)


def test_good_row_loads_and_duplicate_ids_refused(tmp_path):
    (tmp_path / "a.toml").write_text(GOOD_SOURCE + GOOD_ROW)
    assert [r.id for r in published_rows.load(tmp_path)] == ["a"]
    (tmp_path / "b.toml").write_text(GOOD_SOURCE + GOOD_ROW)
    with pytest.raises(published_rows.RowError, match="also in a.toml"):
        published_rows.load(tmp_path)
    (tmp_path / "c.toml").write_text(GOOD_ROW)
    with pytest.raises(published_rows.RowError, match=r"c.toml: no \[source\] table"):
        published_rows.load(tmp_path)


def test_script_predicts_two_rows_with_finite_numbers(rows, tmp_path, capsys):
    acc = _accuracy_module()
    picked = {r.id: r for r in rows if r.id in ("tt-8b-8gpu-fsdp", "foundry-a100-80gb-7b-s65536-n8-amp_bf16")}
    assert len(picked) == 2
    for r in picked.values():
        res = acc.predict(r)
        assert not res.error
        assert math.isfinite(res.tokens_pred) and res.tokens_pred > 0
        assert math.isfinite(res.tokens_err)
        assert res.memory_pred_bytes > 0
        o, _ = acc.options(r)  # the row's facts reach the scenario unchanged
        assert (o.seq_len, o.micro_batch, o.grad_accum, o.gpus, o.gpus_per_node) == (
            r.seq_len, r.micro_batch, r.grad_accum, str(r.num_gpus), r.gpus_per_node)
    assert math.isfinite(acc.predict(picked["tt-8b-8gpu-fsdp"]).memory_err)
    out = tmp_path / "accuracy.md"
    assert acc.main(["--rows", *picked, "--markdown", str(out)]) == 0
    printed = capsys.readouterr().out
    assert all(i in printed for i in picked)
    md = out.read_text()
    assert md.startswith("# Accuracy") and f"Generated by `{acc.COMMAND}`" in md
    assert acc.main(["--rows", *picked, "--summary", str(tmp_path / "s.json")]) == 2  # of the whole set only
    assert not (tmp_path / "s.json").exists()


def test_shipped_accuracy_summary_is_the_current_models(rows):
    """presets/public_accuracy.json, which estimate prints beside its predictions, is what the
    current model scores on the set: a change that moves a figure must regenerate it."""
    acc = _accuracy_module()
    shipped = json.loads((ROOT / "presets" / "public_accuracy.json").read_text())
    assert acc.summary(acc.run(rows)) == shipped, f"regenerate it: {acc.COMMAND}"


def test_summary_figures_are_mean_nearest_rank_p90_and_bias():
    """Errors -0.3, then +0.01..+0.09 (ten rows): mean |error| 0.075, the 90th percentile by
    nearest rank the 9th smallest |error| (0.09), bias 0.015; no memory figures: None."""
    acc = _accuracy_module()
    errs = [-0.3] + [i / 100 for i in range(1, 10)]
    assert acc._errors_summary(errs) == {"rows": 10, "mean_abs": 0.075, "p90_abs": 0.09, "bias": 0.015}
    assert acc._errors_summary([]) is None


def test_compile_and_float8_reach_the_options_or_are_marked_ignored(rows):
    acc = _accuracy_module()
    from zplan.scenario_options import FIELDS

    r = next(r for r in rows if r.id == "tt-8b-8gpu-fsdp-compile-float8")
    o, ignored = acc.options(r)
    if "compile" in FIELDS:
        assert o.compile is True and "compile" not in ignored
    else:
        assert "compile" in ignored
    assert ("float8" in ignored) != ("float8" in FIELDS)
    plain = next(r for r in rows if r.id == "tt-8b-8gpu-fsdp")
    assert acc.options(plain)[1] == ()


def test_a_rows_cluster_is_a_preset_of_its_gpu(rows):
    """published_rows keeps its own list of the cluster presets a row may name (the loader imports
    no zplan) with the GPU each is for: held here against the presets themselves."""
    from zplan import presets
    for name, gpu in published_rows.CLUSTERS_WITH_NETWORKS.items():
        assert presets.cluster(name).gpu == gpu, name
    named = [r for r in rows if r.cluster is not None]
    assert named and all(presets.cluster(r.cluster).gpu == r.gpu for r in named)


def test_a_stated_float8_all_gather_reaches_the_options(rows):
    """torchtitan PR 812's log says enable_fsdp_float8_all_gather=False: priced so; a row that does
    not state it is priced at zplan's default (on), tensorwise-fp8-allgather on."""
    acc = _accuracy_module()
    stated_off = next(r for r in rows if r.id == "tt812-h100-llama3-8b-8gpu-fsdp-compile-float8-tensorwise")
    assert stated_off.float8_all_gather is False
    assert acc.options(stated_off)[0].float8_all_gather is False
    unstated = next(r for r in rows if r.id == "tt-8b-8gpu-fsdp-compile-float8")
    assert unstated.float8_all_gather is None and acc.options(unstated)[0].float8_all_gather is True
    on = next(r for r in rows if r.float8 == "tensorwise-fp8-allgather")
    assert acc.options(on)[0].float8_all_gather is True


def test_mpt_scenarios_have_the_published_parameter_counts(rows):
    """llm-foundry prints each run's NumParams; the MPT presets, with the position table built for the
    run's sequence as llm-foundry builds it, must count the same (an oracle independent of zplan)."""
    acc = _accuracy_module()
    checked = 0
    for r in rows:
        if r.source.name == "llm-foundry" and r.seq_len in (512, 2048, 65536):
            sc, _ = acc.scenario(r)
            assert sc.params == r.published_params, r.id
            checked += 1
    assert checked >= 20


def test_unknown_row_id_is_a_usage_error(capsys):
    assert _accuracy_module().main(["--rows", "no-such-row"]) == 2
    assert "unknown row id(s): no-such-row" in capsys.readouterr().err


def test_communication_share_bands_the_rows(rows):
    """The report's communication band: a row on one GPU has no collective (share 0, the lowest
    band); an FSDP row on 8 GPUs has some, below its compute (llama 3.1 8B at 8192 tokens: the
    all-gathers and reduce-scatters of 8B parameters, a few per cent of the step's kernels);
    the band edges are as labelled."""
    acc = _accuracy_module()
    by_id = {r.id: r for r in rows}
    single = acc.predict(by_id["kf-h200-7b-1gpu-single"])
    assert single.comm_share == 0 and acc.comm_band(single.comm_share) == "00-02%"
    fsdp = acc.predict(by_id["tt-8b-8gpu-fsdp"])
    assert 0.01 < fsdp.comm_share < 0.5
    assert [acc.comm_band(x) for x in (0.0, 0.0199, 0.02, 0.0999, 0.1, 0.99, 1.0, 3.0, None)] == [
        "00-02%", "00-02%", "02-05%", "05-10%", "10-30%", "30-100%", ">100%", ">100%", "-"]


def test_free_memory_bands_the_rows(rows):
    """The report's free-memory band: the predicted free share is 1 - total / the GPU's memory
    (the 8B FSDP row on 8 H100 leaves well over a tenth free); the tight band is estimate's
    own line (under 10% free), the edges as labelled."""
    acc = _accuracy_module()
    by_id = {r.id: r for r in rows}
    res = acc.predict(by_id["tt-8b-8gpu-fsdp"])
    sc, _ = acc.scenario(by_id["tt-8b-8gpu-fsdp"])
    from zplan.estimate import estimate_one

    total = estimate_one(sc, "zero3").memory.total_bytes
    assert res.free_share == pytest.approx(1 - total / sc.hw.gpu.memory_bytes, rel=1e-12)
    assert res.free_share > 0.10 and res.fits
    assert [acc.free_band(x) for x in (0.0, 0.0999, 0.1, 0.1999, 0.2, 0.9, None)] == [
        "under 10% (tight)", "under 10% (tight)", "10%-20%", "10%-20%", "20% or more", "20% or more", "-"]
    assert acc.free_band(-0.05, fits=False) == acc.free_band(0.5, fits=False) == "does not fit"
