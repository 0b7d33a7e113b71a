"""ZeRO from scratch: bit for bit against unsharded AdamW, traffic equal to the planner's."""

import json

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]  # spawned ranks and torchrun


def test_selfcheck_bitwise_at_1_to_4(run_zplan):
    p = run_zplan("selfcheck", "--json", timeout=280)
    assert p.returncode == 0, p.stderr[-2000:]
    res = json.loads(p.stdout)["results"]
    assert {(r["world"], r["stage"]) for r in res} == {(n, s) for n in (1, 2, 3, 4) for s in (1, 2, 3)}
    for r in res:
        assert r["bitwise"], r
        assert r["traffic_ok"] and all(m == r["predicted_elements"] for m in r["measured_elements"])
        n = r["world"]
        if n > 1:  # 2 (zero1/2) or 3 (zero3) passes over the padded flat buffers
            factor = 3 if r["stage"] == 3 else 2
            from zplan.reference.selfcheck import SIZES
            units = [a * b + b for a, b in zip(SIZES, SIZES[1:])]  # weight + bias of each Linear
            padded = sum(-(-x // n) * n for x in units)
            assert r["predicted_elements"] == factor * padded
        else:
            assert r["predicted_elements"] == 0  # one rank moves nothing
        # AdamW's moments are sharded: each rank holds 2 x ceil(unit / N) per unit
        assert r["moment_floats"] * n >= r["unsharded_moment_floats"]
        assert r["moment_floats"] * n - r["unsharded_moment_floats"] < 2 * 4 * n


def test_ring_reduce_scatter_is_not_bitwise_at_3(run_zplan):
    p = run_zplan("selfcheck", "--ranks", "3", "--ring", timeout=120)
    assert p.returncode == 1
    assert "DIFFERS at unit" in p.stdout


def test_verify_small_matrix_within_tolerance(run_zplan, tmp_path):
    md = tmp_path / "table.md"
    # The measured CPU peak varies by up to ~3% from run to run (when gloo's async gathers
    # land), and zero3 at N = 2 sits at +4..7% (docs/verification.md): 8% keeps CI honest
    # without flaking; the whole matrix at the default 5% runs in benchmarks/.
    p = run_zplan("verify", "--strategy", "zero3", "--strategy", "zero2", "--strategy", "ddp",
                  "--ranks", "2", "--dtype", "bf16", "--checkpointing", "none", "--tolerance", "0.08",
                  "--workdir", str(tmp_path / "w"), "--markdown", str(md), timeout=280)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-2000:]
    rows = [l for l in md.read_text().splitlines() if l.startswith(("| zero", "| ddp"))]
    assert len(rows) == 3 and all(r.endswith("| yes |") for r in rows)
    assert all(r.split("|")[5].strip() == r.split("|")[6].strip() for r in rows)  # traffic exact


def test_verify_fails_loudly_past_tolerance(run_zplan, tmp_path):
    p = run_zplan("verify", "--strategy", "zero3", "--ranks", "2", "--dtype", "bf16",
                  "--checkpointing", "none", "--tolerance", "0.0001",
                  "--workdir", str(tmp_path / "w"), timeout=200)
    assert p.returncode == 1 and "outside tolerance" in p.stderr


def test_calibrate_writes_usable_presets(run_zplan, tmp_path):
    out = tmp_path / "cal"
    p = run_zplan("calibrate", "--output", str(out), "--max-mb", "1", "--json", timeout=200)
    assert p.returncode == 0, p.stderr[-2000:]
    d = json.loads(p.stdout)
    assert d["gpu"]["measured"] and d["gpu"]["device"] == "cpu"
    assert d["gpu"]["peak_flops"]["fp32"] > 1e9 and d["cluster"]["intra_node_busbw_bytes_per_s"] > 1e6
    e = run_zplan("estimate", "--presets", str(out), "--gpu", "calibrated", "--cluster", "calibrated",
                  "--model", "tiny", "--gpus", "2", "--seq-len", "128", "--json")
    assert e.returncode == 0, e.stderr
    est = json.loads(e.stdout)
    assert est["assumptions"]["compute_efficiency"]["value"] == 1.0  # measured rates: no derating
    assert est["inputs"]["gpu"] == "calibrated"


def test_verify_fake_traces_at_scale_without_memory(run_zplan):
    """The planner against PyTorch's own tracker under FakeTensorMode and a fake process group."""
    p = run_zplan("verify", "--fake", "--model", "tiny", "--world-size", "64", "--seq-len", "512",
                  "--strategy", "zero3", "--tolerance", "0.08", timeout=200)
    assert p.returncode == 0, p.stdout + p.stderr[-2000:]
    row = next(l for l in p.stdout.splitlines() if l.startswith("zero3"))
    err = float(row.split("%")[0].split()[-1])
    assert abs(err) <= 8.0
