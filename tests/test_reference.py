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


def _tiny_params() -> int:
    """Ψ of the trainer's tiny model, counted on the torch module itself (not by the planner)."""
    import torch

    from zplan import presets
    from zplan.trainer.model import Transformer

    with torch.device("meta"):
        return sum(p.numel() for p in Transformer(presets.model("tiny")).parameters())


# Measured spread (issue 11), zplan verify --strategy zero3 --strategy zero1 --ranks 2 --dtype bf16
# --checkpointing none, 4 runs on this 2-core machine while 7 other engineers worked on it:
# zero3 -3.56, -3.58, -3.56, -3.56 %; zero1 -3.92 % all 4 times (memory in bytes: zero3 varies
# by 8.7 kB in 37.5 MB, zero1 not at all); ddp -2.5 % in the quick matrix.
# Since then the zero3 cell's measured peak varies between runs: in about 30 runs in stop 15
# (idle machine; the same at f50a86e, before that stop's changes) most measured 37,454,000 bytes
# (predicted 37,057,536: -1.1 %), about one in five 38,552,752 (-3.9 %) or 39,278,256 (-5.65 %),
# on either rank.
# The larger peaks sit at the head's backward (the root's weights gathered and its gradients
# reduce-scattered while the loss's buffers are still alive), the usual one at the loss: which
# moment is higher depends on the timing of the CPU ranks' gloo work, a CPU artifact not found
# (gc, intra-op threads and the data thread ruled out). The test allows that spread: 7 %.
TOLERANCE = 0.07


def test_verify_cells_within_tolerance(run_zplan, tmp_path):
    md = tmp_path / "table.md"
    p = run_zplan("verify", "--strategy", "zero3", "--strategy", "zero1", "--strategy", "ddp",
                  "--ranks", "2", "--dtype", "bf16", "--checkpointing", "none",
                  "--json", "--workdir", str(tmp_path / "w"), "--tolerance", str(TOLERANCE),
                  "--markdown", str(md), timeout=280)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-2000:]
    d = json.loads(p.stdout)
    assert d["sign"] == "error = (predicted - measured) / measured"
    cells = {c["strategy"]: c for c in d["cells"]}
    assert set(cells) == {"zero3", "zero1", "ddp"} and d["ok"]
    for c in cells.values():
        pred, meas = c["predicted_memory_bytes"], c["measured_memory_bytes"]
        assert c["memory_error"] == pytest.approx((pred - meas) / meas)
        assert abs(c["memory_error"]) <= TOLERANCE
        assert c["measured_traffic_bytes"] == c["predicted_traffic_bytes"]  # bytes, exactly
    # bytes by hand, from the module's own parameter count: DDP all-reduces fp32 gradient
    # buckets (2 x 4 bytes per parameter); ZeroRedundancyOptimizer then broadcasts the fp32
    # parameters once (4 more), whatever the bf16 compute dtype
    psi = _tiny_params()
    assert cells["ddp"]["measured_traffic_bytes"] == 8 * psi
    assert cells["zero1"]["measured_traffic_bytes"] == 12 * psi
    # zero3: two bf16 gathers and one fp32 reduce-scatter of the (padded) parameters
    assert 8 * psi <= cells["zero3"]["measured_traffic_bytes"] < 8 * psi * 1.001
    rows = [line for line in md.read_text().splitlines() if line.startswith(("| zero", "| ddp"))]
    assert len(rows) == 3 and all(r.endswith("| yes |") for r in rows)
    assert "error = (predicted - measured) / measured" in md.read_text()


def test_verify_leaves_offload_all_out_on_cpu_with_the_reason(run_zplan, tmp_path):
    p = run_zplan("verify", "--strategy", "offload-all", "--ranks", "2", "--dtype", "bf16",
                  "--checkpointing", "none", "--json", "--workdir", str(tmp_path / "w"), timeout=60)
    assert p.returncode == 0, p.stderr
    (cell,) = json.loads(p.stdout)["cells"]
    assert cell["skipped"] and "same memory" in cell["skipped"] and cell["measured_memory_bytes"] == 0
    assert "offload-all N=2 bf16 ckpt=none: left out of the CPU matrix" in p.stderr


def test_verify_fails_loudly_past_tolerance(run_zplan, tmp_path):
    # tolerance 0: the cell is now within 0.01% (the scalars the planner does not count), so
    # any difference at all is past it
    p = run_zplan("verify", "--strategy", "zero3", "--ranks", "2", "--dtype", "bf16",
                  "--checkpointing", "none", "--tolerance", "0",
                  "--workdir", str(tmp_path / "w"), timeout=200)
    assert p.returncode == 1 and "outside tolerance" in p.stderr


def test_calibrate_writes_usable_presets(run_zplan, tmp_path):
    out = tmp_path / "cal"
    p = run_zplan("calibrate", "--output", str(out), "--max-mb", "1", "--json", timeout=200)
    assert p.returncode == 0, p.stderr[-2000:]
    d = json.loads(p.stdout)
    assert d["gpu"]["measured"] and d["gpu"]["device"] == "cpu"
    assert d["gpu"]["peak_flops"]["fp32"] > 1e9 and d["cluster"]["intra_node_busbw_bytes_per_s"] > 1e6
    ov = d["link"]["overlap"]  # compute beside a collective, timed (written to a GPU preset only)
    assert ov["gemms"] >= 1 and ov["overlapped_s"] > 0
    assert ov["slowdown_beside"] is None or 1 <= ov["slowdown_beside"] <= 4
    per = d["link"]["gemm_per_rank_s"]  # one GEMM on each rank at once; no spread from 2 ranks
    assert len(per) == 2 and min(per) > 0 and d["link"]["rank_speed_spread"] is None
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


@pytest.mark.slow
def test_verify_runs_first_k_at_the_k_asked(run_zplan, tmp_path):
    """verify --checkpoint-first k reaches the trainer: the same cell measured at k = 1 and k = 3
    (of tiny's 4 blocks) keeps less at k = 3 (measured by the trainer's own peak, not the planner),
    and each run agrees with its own prediction."""
    peaks = {}
    for k in (1, 3):
        p = run_zplan("verify", "--strategy", "zero3", "--ranks", "2", "--dtype", "fp32",
                      "--checkpointing", "first-k", "--checkpoint-first", str(k), "--json",
                      "--workdir", str(tmp_path / f"k{k}"), timeout=300)
        assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
        (cell,) = json.loads(p.stdout)["cells"]
        assert cell["checkpoint_k"] == k and cell["cell"].endswith(f"ckpt=first-k k={k}") and cell["ok"]
        peaks[k] = cell["measured_memory_bytes"]
    assert peaks[3] < peaks[1]


@pytest.mark.slow
def test_verify_fake_traces_first_k_at_the_k_asked(run_zplan):
    """verify --fake --checkpoint-first k: the tracker's peak falls as k grows and the label says k."""
    traced = {}
    for k in (1, 8):
        p = run_zplan("verify", "--fake", "--model", "llama-3.2-1b", "--world-size", "8", "--seq-len", "1024",
                      "--checkpointing", "first-k", "--checkpoint-first", str(k), timeout=200)
        assert p.returncode == 0, p.stdout + p.stderr[-2000:]
        row = next(l for l in p.stdout.splitlines() if l.startswith("zero3"))
        assert row.startswith(f"zero3 ckpt=first-k k={k} ")
        traced[k] = float(row.split("GiB")[1].split()[-1])
    assert traced[8] < traced[1]


@pytest.mark.slow
def test_a_one_rank_cpu_calibration_keeps_its_ranks_on_one_host(run_zplan, tmp_path):
    """calibrate --ranks 1 on CPU wrote a node of one rank, so two ranks were priced as two
    nodes over network figures never measured (the run-half QA pass): CPU ranks share the host,
    one node of them on cpu-local's links, said so in the source."""
    out = tmp_path / "cal"
    p = run_zplan("calibrate", "--ranks", "1", "--output", str(out), "--max-mb", "1", "--json", timeout=200)
    assert p.returncode == 0, p.stderr[-2000:]
    c = json.loads(p.stdout)["cluster"]
    assert c["gpus_per_node"] == 64 and "one rank: no collective measured, links as the cpu-local preset's" in c["source"]
    assert "assumed 1/10" not in c["source"]
    e = run_zplan("estimate", "--presets", str(out), "--gpu", "calibrated", "--cluster", "calibrated",
                  "--model", "tiny", "--gpus", "2", "--json")
    assert e.returncode == 0 and json.loads(e.stdout)["inputs"]["gpus_per_node"] == 64


@pytest.mark.slow
def test_verify_into_a_reused_workdir_runs_each_cell_afresh(run_zplan, tmp_path):
    """A fresh run never lands in a run's folder: verify --workdir reused (or a cell asked twice)
    gives each run a folder of its own instead of every cell failing (the review)."""
    args = ("verify", "--strategy", "ddp", "--ranks", "1", "--dtype", "fp32", "--checkpointing", "none",
            "--workdir", str(tmp_path / "w"))
    for _ in range(2):
        p = run_zplan(*args, timeout=300)
        assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    assert sorted(d.name for d in (tmp_path / "w").iterdir()) == ["ddp_N1_fp32_ckptnone", "ddp_N1_fp32_ckptnone-2"]
