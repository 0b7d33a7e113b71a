"""The command line through a real subprocess: JSON schema, bad input, exit codes."""

import json

import pytest

REQUIRED = ("params_bytes", "grads_bytes", "master_bytes", "optimizer_bytes", "model_state_bytes",
            "gather_buffer_bytes", "activation_bytes", "total_bytes")


def test_estimate_json_schema(run_zplan):
    p = run_zplan("estimate", "--params", "70e9", "--gpus", "64", "--checkpointing", "full", "--json")
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout)
    assert out["schema_version"] == 1
    names = [s["name"] for s in out["strategies"]]
    assert names[:4] == ["ddp", "zero1", "zero2", "zero3"]
    for s in out["strategies"]:
        for k in REQUIRED:
            assert isinstance(s["per_gpu"][k], int), (s["name"], k)
        assert isinstance(s["comm"]["elements_per_step"], int)
        assert isinstance(s["comm"]["bytes_per_step"], int)
        assert isinstance(s["overlap"], list)
    z3 = next(s for s in out["strategies"] if s["name"] == "zero3")
    assert z3["comm"]["elements_per_step"] >= 3 * 70_000_000_000
    assert len(z3["overlap"]) == len(out["inputs"]["units"])
    units = len(out["inputs"]["units"])
    assert 17_500_000_000 <= z3["per_gpu"]["model_state_bytes"] < 17_500_000_000 + 16 * units  # padding
    assert "compute_efficiency" in out["assumptions"]


def test_estimate_tables(run_zplan):
    p = run_zplan("estimate", "--model", "llama-3.1-8b", "--gpus", "8", "--unit", "GiB")
    assert p.returncode == 0, p.stderr
    assert "Memory per GPU" in p.stdout and "Overlap per unit" in p.stdout
    assert "GiB" in p.stdout and "2^30" in p.stdout
    assert "compute_efficiency" in p.stdout


def test_one_strategy(run_zplan):
    p = run_zplan("estimate", "--model", "tiny", "--gpus", "2", "--strategy", "zero3", "--json")
    out = json.loads(p.stdout)
    assert [s["name"] for s in out["strategies"]] == ["zero3"]


@pytest.mark.parametrize("args,needle", [
    (["--gpus", "0"], "--gpus '0' must be a positive count"),
    (["--gpus", "-3"], "--gpus '-3' must be a positive count"),
    (["--gpus", "many"], "--gpus 'many' is not a number"),
    (["--gpus", "2.5"], "--gpus '2.5' must be a whole number"),
    (["--gpus", "1e9"], "absurdly large"),
    (["--params", "lots"], "--params 'lots' is not a number"),
    (["--params", "-5e9"], "must be a positive count"),
    (["--params", "1e30"], "absurdly large"),
    (["--params", "nan"], "--params 'nan'"),
    (["--model", "llama-3.1-7b"], "did you mean"),
    (["--gpu", "h100"], "did you mean"),
    (["--gpus", "64", "--shard-size", "7"], "--shard-size 7 does not divide --gpus 64"),
    (["--checkpointing", "some"], "--checkpointing 'some' is not one of"),
    (["--strategy", "zero4"], "--strategy 'zero4' is not one of"),
    (["--params", "7e9", "--model", "tiny"], "either --params or --model"),
    (["--no-such-flag"], "No such option"),
])
def test_bad_input_is_one_line_exit_2(run_zplan, args, needle):
    p = run_zplan("estimate", *args)
    assert p.returncode == 2, (p.returncode, p.stderr)
    assert needle in p.stderr
    assert "Traceback" not in p.stderr
    assert len(p.stderr.strip().splitlines()) == 1, p.stderr


def test_malformed_preset_file(run_zplan, tmp_path):
    f = tmp_path / "broken.toml"
    f.write_text("name = 'x'\nnum_layers = 'many'\n")
    p = run_zplan("estimate", "--model", str(f))
    assert p.returncode == 2
    assert "broken.toml" in p.stderr and "num_layers" in p.stderr
    assert len(p.stderr.strip().splitlines()) == 1


def test_nothing_fits_is_exit_1_with_the_fix(run_zplan):
    p = run_zplan("estimate", "--model", "llama-3.1-405b", "--gpus", "4", "--json")
    assert p.returncode == 1
    assert "no strategy fits" in p.stderr and "--gpus" in p.stderr
    assert "Traceback" not in p.stderr
    json.loads(p.stdout)  # the figures are still printed


def test_debug_shows_the_traceback(run_zplan):
    p = run_zplan("estimate", "--gpus", "0", env={"ZPLAN_DEBUG": "1"})
    assert p.returncode != 0 and "Traceback" in p.stderr


def test_estimate_never_imports_torch():
    import subprocess
    import sys
    code = ("import sys, io, contextlib\n"
            "from zplan.cli.main import run\n"
            "with contextlib.redirect_stdout(io.StringIO()):\n"
            "    run(['estimate', '--model', 'llama-3.1-70b', '--gpus', '64'])\n"
            "    run(['estimate', '--params', '7e9', '--json'])\n"
            "bad = [m for m in sys.modules if m == 'torch' or m.startswith('torch.')]\n"
            "assert not bad, bad\n"
            "print('ok')\n")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert p.stdout.strip() == "ok", p.stderr
