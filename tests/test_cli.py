"""The command line through a real subprocess: JSON schema, bad input, exit codes."""

import json
import os

import pytest

from tests.conftest import ROOT

REQUIRED = ("params_bytes", "grads_bytes", "master_bytes", "optimizer_bytes", "model_state_bytes",
            "gather_buffer_bytes", "activation_bytes", "total_bytes")


def test_estimate_json_schema(run_zplan):
    p = run_zplan("estimate", "--params", "70e9", "--gpus", "64", "--checkpointing", "full", "--json")
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout)
    assert out["schema_version"] == 2
    # names carry units (an audit: "activations" held bytes, "breakdown" seconds, unnamed)
    assert all(isinstance(v, int) for v in out["inputs"]["activation_bytes"].values())
    assert "activations" not in out["inputs"] and all("breakdown" not in s["time"] for s in out["strategies"])
    names = [s["name"] for s in out["strategies"]]
    assert names[:4] == ["ddp", "zero1", "zero2", "zero3"]
    for s in out["strategies"]:
        for k in REQUIRED:
            assert isinstance(s["per_gpu"][k], int), (s["name"], k)
        assert isinstance(s["comm"]["elements_per_step"], int)
        assert isinstance(s["comm"]["bytes_per_step"], int)
        assert isinstance(s["overlap"], list)
    z3 = next(s for s in out["strategies"] if s["name"] == "zero3")
    # between ZeRO-2's 2 Psi and the paper's 3 Psi (DeepSpeed's prefetcher keeps the units
    # backward reaches first gathered: tests/test_golden.py), padding aside
    assert 2 * 70_000_000_000 < z3["comm"]["elements_per_step"] <= 3 * 70_000_000_000 + 3 * 64 * len(out["inputs"]["units"])
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
    (["--params", "1e400"], "absurdly large"),  # a float overflow: was "must be a positive count"
    (["--params", "nan"], "--params 'nan'"),
    (["--gpus", "1,6"], "commas may only group thousands"),  # a typo, not 16
    (["--model", "llama-3.1-7b"], "did you mean"),
    (["--gpu", "h100"], "did you mean"),
    (["--gpus", "64", "--shard-size", "7"], "--shard-size 7 does not divide --gpus 64"),
    (["--checkpointing", "some"], "--checkpointing 'some' is not one of"),
    (["--strategy", "zero4"], "--strategy 'zero4' is not one of"),
    (["--params", "7e9", "--model", "tiny"], "either --params or --model"),
    (["--no-such-flag"], "No such option"),
    (["--model", "llama-3.1-8b", "--eager-loss"], "--eager-loss goes with --compile"),
    (["--model", "llama-3.1-8b", "--compile-scope", "model"], "--compile-scope model goes with --compile"),
    (["--model", "llama-3.1-8b", "--logits-fp32", "--linear-loss", "chunked"], "drop --logits-fp32"),
    (["--model", "llama-3.1-8b", "--logits-fp32", "--no-loss-fp32"], "drop --no-loss-fp32"),
    (["--model", "llama-3.1-8b", "--last-block-kept"], "--last-block-kept is how FSDP reshards"),
    # hsdp alone at a GPU count its default shard (a node) does not divide: a usage error with
    # the shard size that works (was exit 1, "no strategy fits ... zero3 fits")
    (["--model", "llama-3.1-8b", "--gpus", "12", "--strategy", "hsdp"],
     "shard size 8 (a node) does not divide 12 GPUs: --shard-size 4 divides them"),
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


@pytest.mark.slow  # over a second in all: the fast loop leaves it to CI
@pytest.mark.parametrize("kind,src,field,line", [
    ("gpus", "h100-sxm", "host_link_bytes_per_s", "host_link_bytes_per_s = 1e-300"),
    ("gpus", "h100-sxm", "kernel_floor_s", "kernel_floor_s = 1e6"),
    ("clusters", "dgx-h100", "intra_node_busbw_bytes_per_s", "intra_node_busbw_bytes_per_s = 1e-300"),
    ("clusters", "dgx-h100", "cpu_adam_params_per_s", "cpu_adam_params_per_s = 1e-300"),
])
def test_a_preset_rate_too_small_to_price_is_refused(run_zplan, tmp_path, kind, src, field, line):
    """A rate of 1e-300 passed the spec (> 0) and ran every time to infinity: the tables printed
    inf and NaN, --json (strict, finite numbers) ended in "internal error". Rates are bounded
    below (specs.MIN_RATE) and the kernel floor above: the file and field in one line, exit 2."""
    import re
    import tomllib

    text = (ROOT / "presets" / kind / f"{src}.toml").read_text()
    text = re.sub(rf"(?m)^{field} = .*$", line, text)
    text = re.sub(r'(?m)^name = ".*"$', 'name = "odd"', text)
    data = tomllib.loads(text)
    assert data.get("kernels", data).get(field, data.get(field)) == float(line.split(" = ")[1])  # changed
    (tmp_path / kind).mkdir()
    (tmp_path / kind / "odd.toml").write_text(text)
    which = ("--gpu", "odd", "--cluster", "dgx-h100") if kind == "gpus" else ("--gpu", "h100-sxm", "--cluster", "odd")
    for extra in ((), ("--json",)):
        p = run_zplan("estimate", "--presets", str(tmp_path), *which, "--params", "7e9", "--strategy",
                      "offload-all", *extra)
        assert p.returncode == 2 and "odd.toml" in p.stderr and field in p.stderr, p.stderr
        assert len(p.stderr.strip().splitlines()) == 1 and p.stdout == ""


def test_nothing_fits_is_exit_1_with_the_fix(run_zplan):
    p = run_zplan("estimate", "--model", "llama-3.1-405b", "--gpus", "4", "--json")
    assert p.returncode == 1
    assert "no strategy fits" in p.stderr and "--gpus" in p.stderr
    assert "Traceback" not in p.stderr
    json.loads(p.stdout)  # the figures are still printed


def test_debug_shows_the_traceback(run_zplan):
    p = run_zplan("estimate", "--gpus", "0", env={"ZPLAN_DEBUG": "1"})
    assert p.returncode != 0 and "Traceback" in p.stderr


def test_planning_never_imports_torch_nor_pydantic_when_plain():
    """The planning path never imports torch. A plain estimate, recommend or explain (read without Typer,
    zplan/cli/plain_line.py) never imports pydantic either: it cost ~40% of estimate's 0.3 s
    budget, and zplan/validated.py replaced it (Typer 0.29 imports it for its own commands).
    Piped, without colour, they print without rich too (zplan/cli/textout.py)."""
    import os
    import subprocess
    import sys
    code = ("import sys, io, contextlib, tempfile, os\n"
            "from zplan.cli.main import run\n"
            "from zplan.plan import make_plan, save\n"
            "from zplan.scenario_options import ScenarioOptions, build\n"
            "plan = os.path.join(tempfile.mkdtemp(), 'p.json')\n"
            "save(make_plan(build(ScenarioOptions(model='llama-3.2-1b', gpus=8)), 'zero3', 8), plan)\n"
            "with contextlib.redirect_stdout(io.StringIO()):\n"
            "    run(['estimate', '--model', 'llama-3.1-70b', '--gpus', '64'])\n"
            "    run(['estimate', '--params', '7e9', '--json'])\n"
            "    assert run(['estimate', '--plan', plan]) == 0\n"
            "bad = [m for m in sys.modules if m.split('.')[0] in ('torch', 'pydantic', 'pydantic_core', 'typer', 'rich')]\n"
            "assert not bad, bad\n"
            "with contextlib.redirect_stdout(io.StringIO()):\n"
            "    assert run(['recommend', '--model', 'llama-3.2-1b', '--gpus', '8']) == 0\n"
            "bad = [m for m in sys.modules if m.split('.')[0] in ('torch', 'pydantic', 'pydantic_core', 'typer', 'rich')]\n"
            "assert not bad, bad\n"
            "with contextlib.redirect_stdout(io.StringIO()):\n"
            "    assert run(['explain', '--model', 'llama-3.2-1b', '--gpus', '8']) == 0\n"
            "bad = [m for m in sys.modules if m.split('.')[0] in ('torch', 'pydantic', 'pydantic_core', 'typer', 'rich')]\n"
            "assert not bad, bad\n"
            "print('ok')\n")
    # piped at the default width: no colour, and every table fits (a wider one goes to rich)
    env = {k: v for k, v in os.environ.items()
           if k not in ("FORCE_COLOR", "TTY_COMPATIBLE", "COLUMNS")}
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                       env=env)
    assert p.stdout.strip() == "ok", p.stderr


# ---------------------------------------------------------------- bad input, in this process

def cli(capsys, *args, cwd=None):
    """zplan.cli.main.run in this process (the subprocess tests above cover the entry point)."""
    from zplan.cli.main import run

    old = os.getcwd()
    try:
        if cwd is not None:
            os.chdir(cwd)
        rc = run(list(args))
    finally:
        os.chdir(old)
    out, err = capsys.readouterr()
    return rc, out, err


def one_error(err: str) -> str:
    lines = [ln for ln in err.strip().splitlines() if ln.startswith("zplan: error:")]
    assert len(lines) == 1 and "Traceback" not in err and "internal error" not in err, err
    return lines[0]


GPU_TOML = ('name = "g"\nmemory_bytes = 80000000000\npeak_flops = { fp32 = 6e13, bf16 = 9e14 }\n'
            'hbm_bytes_per_s = 3e12\nhost_link_bytes_per_s = 5e10\nsource = "test"\n')


@pytest.mark.parametrize("field,value", [
    ("memory_bytes", "0"), ("memory_bytes", "-1"), ("hbm_bytes_per_s", "nan"),
    ("hbm_bytes_per_s", "inf"), ("host_link_bytes_per_s", "0.0"), ("peak_flops", "{ fp32 = 6e13, bf16 = nan }"),
    ("peak_flops", "{ fp32 = 6e13, bf16 = -inf }"), ("memory_bytes", "1e300"),
])
def test_preset_numbers_zero_negative_nan_inf_are_refused(capsys, tmp_path, field, value):
    text = "\n".join(f"{field} = {value}" if ln.startswith(field + " ") else ln for ln in GPU_TOML.splitlines())
    (tmp_path / "g.toml").write_text(text + "\n")
    rc, out, err = cli(capsys, "estimate", "--gpu", str(tmp_path / "g.toml"), "--json")
    line = one_error(err)
    assert rc == 2 and f"g.toml: field '{field}" in line and out == ""


@pytest.mark.parametrize("cfg,needle", [
    ([1, 2], "the top level is a JSON array, not an object"),
    ({"model_type": "llama", "hidden_size": [4096], "num_attention_heads": 32},
     "field 'hidden_size' is [4096], not a whole number"),
    ({"model_type": "llama", "hidden_size": 64, "num_attention_heads": 1, "num_hidden_layers": 2, "vocab_size": 10,
      "intermediate_size": 128, "tie_word_embeddings": "yes"}, "field 'tie_word_embeddings' is 'yes', not true or false"),
    ({"model_type": "llama", "hidden_size": 64, "num_attention_heads": 1, "num_hidden_layers": 10**9,
      "intermediate_size": 128, "vocab_size": 10}, "field 'num_layers': Input should be less than or equal to 256"),
    ({"model_type": "mistral", "hidden_size": 64, "num_attention_heads": 1, "num_hidden_layers": 2,
      "intermediate_size": 128, "vocab_size": 10}, "field 'num_key_value_heads' is missing"),
    ({"model_type": "mixtral", "hidden_size": 64, "num_attention_heads": 1, "num_hidden_layers": 2,
      "vocab_size": 10, "num_local_experts": "8"}, "field 'num_local_experts' is '8', not a whole number"),
    ({"model_type": ["llama"]}, "field 'model_type' is ['llama'], not a string"),
    ({"model_type": "bloom", "hidden_size": 64}, "model_type 'bloom' is not one zplan reads"),
])
def test_config_json_needs_an_object_with_typed_sane_fields(capsys, tmp_path, cfg, needle):
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    rc, _, err = cli(capsys, "estimate", "--model", str(tmp_path))
    assert rc == 2 and needle in one_error(err) and "config.json" in err


@pytest.mark.parametrize("toml,needle", [
    ("seq_len = 'long'\n", "key 'seq_len' is 'long', not a whole number"),
    ("checkpointing = 3\n", "key 'checkpointing' is 3, not a string"),
    ("overlap = 'no'\n", "key 'overlap' is 'no', not true or false"),
    ("headroom = [0.1]\n", "key 'headroom' is [0.1], not a number"),
    ("gpus = 1979-05-27\n", "key 'gpus' is datetime.date(1979, 5, 27), not a string"),
    ("a = " + "[" * 5000 + "]" * 5000 + "\n", "nests deeper than"),
])
def test_project_file_values_of_the_wrong_type(capsys, tmp_path, toml, needle):
    (tmp_path / "zplan.toml").write_text(toml)
    rc, _, err = cli(capsys, "recommend", "--model", "tiny", "--gpus", "2", cwd=tmp_path)
    assert rc == 2 and needle in one_error(err) and "zplan.toml" in err


def test_a_bad_preset_name_from_the_project_file_says_so(capsys, tmp_path):
    (tmp_path / "zplan.toml").write_text('cluster = "dgx-h1000"\n')
    rc, _, err = cli(capsys, "recommend", "--model", "tiny", cwd=tmp_path)
    line = one_error(err)
    assert rc == 2 and "unknown cluster 'dgx-h1000'" in line and "(zplan.toml: cluster=dgx-h1000)" in line


def test_rich_markup_in_a_model_name_is_printed_as_text(capsys, tmp_path):
    p = tmp_path / "m.toml"
    p.write_text('name = "[/x] [bold]evil"\nnum_layers = 2\nhidden = 64\nffn_hidden = 128\n'
                 'num_heads = 1\nnum_kv_heads = 1\nvocab_size = 100\nsource = "t"\n')
    for cmd in (["estimate"], ["recommend", "--top", "2"]):
        rc, out, err = cli(capsys, *cmd, "--model", str(p), "--gpus", "2")
        assert rc == 0, err
        assert "[/x] [bold]evil" in out


@pytest.mark.parametrize("args,needle", [
    (["recommend", "--model", "tiny", "--gpus", "2", "--global-batch", "1e13"], "over the limit of 1,000,000"),
    (["estimate", "--params", "7e9", "--unit-params", "1"], "--unit-params 1 makes 7,000,000,000 units"),
    (["estimate", "--params", ""], "--params '' is not a number"),
    (["estimate", "--model", "x" * 300], "unknown model 'xxxx"),
    (["estimate", "--model", "x" * 300 + ".toml"], "no such preset file"),
    (["estimate", "--efficiency", "nan"], "--efficiency nan is out of range"),
    (["estimate", "--checkpoint-every", "-5"], "--checkpoint-every -5 is out of range"),
    (["estimate", "--checkpointing", "first-k", "--checkpoint-first", "0"], "--checkpoint-first 0 is out of range"),
    (["estimate", "--model", "tiny", "--checkpointing", "first-k", "--checkpoint-first", "9"],
     "--checkpoint-first 9 asks for more blocks than this"),
    (["estimate", "--checkpoint-every", "4"], "--checkpoint-every 4 sets the k of --checkpointing every-k, not of --checkpointing none"),
    (["estimate", "--checkpointing", "full", "--checkpoint-first", "4"], "add --checkpointing first-k or drop it"),
    (["estimate", "--no-flash", "--attention-kernel", "flash3"], "--attention-kernel flash3 names one: drop one of them"),
    (["estimate", "--gpus", "16", "--shard-size", "8", "--strategy", "zero3"], "add --strategy hsdp or drop --shard-size"),
    (["estimate", "--presets", "/nonexistent-zplan"], "--presets /nonexistent-zplan is not a folder"),
    (["estimate", "--optimizer", "muon", "--no-deepspeed-bucket-allreduce"], "DeepSpeed all-reduces every Muon matrix"),
    (["estimate", "--layout", "torch", "--no-deepspeed-bucket-allreduce"], "the torch layout (DDP, FSDP2) runs PyTorch's own"),
    (["recommend", "--model", "tiny", "--gpus", "4", "--shard-size", "2", "--strategy", "zero3"], "add --strategy hsdp"),
    (["explain", "--model", "tiny", "--gpus", "4", "--shard-size", "2"], "--strategy zero3 has no hsdp"),
    (["estimate", "--presets", "/dev/null"], "--presets /dev/null is not a folder"),
    (["launch", "--dry-run", "--nproc", "0"], "--nproc 0 is out of range"),
    (["launch", "--dry-run", "--run-dir", ""], "--run-dir '' is empty"),
    (["consolidate", "README.md", "o.safetensors"], "checkpoint README.md is not a folder"),
    (["launch", "--dry-run", "--global-batch", "0"], "--global-batch 0 is out of range"),
    (["launch", "--dry-run", "--save-every", "-5"], "--save-every -5 is out of range"),
    (["launch", "--dry-run", "--data", "no-such.txt"], "--data 'no-such.txt' is not a file"),
    (["launch", "--dry-run", "--strategy", "zero4"], "--strategy 'zero4' is not one of"),
    (["export", "--plan", "/dev/zero", "--to", "deepspeed"], "plan /dev/zero is a character device"),
    (["recommend", "--model", "tiny", "--gpus", "2", "--global-batch", "2.5"], "'2.5' must be a whole number"),
    (["recommend", "--model", "tiny", "--gpus", "2", "--global-batch-tokens", "256"],
     "--global-batch-tokens 256 is 1 sequences of 256 tokens, not a multiple of 2 GPUs"),
])
def test_nonsense_is_refused_in_one_line(capsys, args, needle):
    rc, out, err = cli(capsys, *args)
    assert rc == 2 and needle in one_error(err), err


def test_calibrate_ranks_0_is_refused_not_the_default(capsys, tmp_path):
    pytest.importorskip("torch")
    rc, _, err = cli(capsys, "calibrate", "--ranks", "0", "--output", str(tmp_path / "out"))
    assert rc == 2 and "--ranks 0 is out of range" in one_error(err)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("args,shown", [
    (("--model", "llama-3.1-8b", "--world-size", "64"), "--model, --world-size go with --fake"),
    (("--world-size=8",), "--world-size goes with --fake"),  # typed at its default: still not the real matrix's
    (("--seq-len", "512", "--micro-batch", "2"), "--seq-len, --micro-batch go with --fake"),
])
def test_verify_fake_only_scenario_flags_are_refused_without_fake(capsys, args, shown):
    """verify --model llama-3.1-8b --world-size 64 (no --fake) ran the real tiny-model matrix
    (about 40 s, exit 0), the flags ignored without a word; now one line, exit 2."""
    pytest.importorskip("torch")
    rc, _, err = cli(capsys, "verify", *args)
    assert rc == 2 and shown in one_error(err) and "add --fake" in one_error(err), err


@pytest.mark.parametrize("flag", ["--kv-cache", "--outputs-until-next-forward", "--loss-shifted-copy",
                                  "--loss-chunks=8"])
def test_verify_hugging_face_loop_flags_go_with_fake(capsys, flag):
    """The real matrix runs zplan's plain loop: the Hugging Face loop's flags (and the chunked
    loss) trace with --fake."""
    pytest.importorskip("torch")
    rc, _, err = cli(capsys, "verify", *flag.split("="))
    assert rc == 2 and flag.split("=")[0] in one_error(err) and "add --fake" in one_error(err)


@pytest.mark.parametrize("args, needle", [
    (("--checkpoint-first", "3"), "--checkpoint-first 3 sets the k of --checkpointing first-k: add --checkpointing first-k"),
    (("--fake", "--markdown", "t.md"), "--markdown writes the real matrix's table; drop it with --fake"),
    (("--fake", "--model", "tiny", "--strategy", "offload-all"), "--fake compares device memory"),
    (("--fake", "--checkpointing", "first-k", "--checkpoint-every", "2"), "add --checkpointing every-k"),
    (("--checkpointing", "first-k", "--checkpoint-first", "5"), "--checkpoint-first 5 is out of range; use a value in 1..4"),
    (("--checkpointing", "every-k", "--checkpoint-every", "0"), "--checkpoint-every 0 is out of range"),
    (("--fake", "--model", "tiny", "--checkpointing", "first-k", "--checkpoint-first", "5"),
     "--checkpoint-first 5 asks for more blocks than this 4-layer model has"),
])
def test_verify_k_of_a_partial_checkpointing_is_checked(capsys, args, needle):
    """--checkpoint-every / --checkpoint-first go with their mode and fit the model's blocks
    (the real matrix's model: tiny, 4 blocks), refused in one line before anything runs."""
    pytest.importorskip("torch")
    rc, _, err = cli(capsys, "verify", *args)
    assert rc == 2 and needle in one_error(err), err


@pytest.mark.parametrize("args, needle", [
    (("--loss-shifted-copy",), "add --logits-fp32"),
    (("--outputs-until-next-forward", "--no-logits-kept"), "drop one"),
    (("--loss-shifted-copy", "--logits-fp32", "--fused-loss"), "drop --fused-loss"),
])
def test_hugging_face_loop_flags_refuse_what_cannot_be(capsys, args, needle):
    rc, _, err = cli(capsys, "estimate", "--model", "llama-3.1-8b", "--gpus", "8", *args)
    assert rc == 2 and needle in one_error(err), err


def test_flags_next_to_a_plan_are_refused_not_dropped(capsys, tmp_path):
    plan = tmp_path / "plan.json"
    assert cli(capsys, "recommend", "--model", "tiny", "--gpus", "2", "--write", str(plan))[0] == 0
    rc, _, err = cli(capsys, "launch", "--dry-run", "--plan", str(plan), "--model", "llama-3.1-8b")
    assert rc == 2 and "--model applies to a fresh plan, and --plan" in one_error(err)


def test_plan_with_hostile_numbers(capsys, tmp_path):
    plan = tmp_path / "plan.json"
    assert cli(capsys, "recommend", "--model", "tiny", "--gpus", "2", "--write", str(plan))[0] == 0
    good = json.loads(plan.read_text())
    for path, value, needle in ((("predicted", "step_s"), -1.0, "field 'predicted': -1.0 is negative"),
                                (("gpu", "hbm_bytes_per_s"), 0, "field 'gpu.hbm_bytes_per_s'"),
                                (("train", "micro_batch"), 10**12, "field 'train.micro_batch'")):
        d = json.loads(json.dumps(good))
        node = d
        for k in path[:-1]:
            node = node[k]
        node[path[-1]] = value
        bad = tmp_path / f"bad-{'-'.join(path)}.json"
        bad.write_text(json.dumps(d))
        rc, _, err = cli(capsys, "export", "--plan", str(bad), "--to", "torchrun")
        assert rc == 2 and needle in one_error(err), err


@pytest.mark.parametrize("exc,code,needle", [
    (OSError(30, "Read-only file system", "/mnt/ro/plan.json"), 1, "Read-only file system: /mnt/ro/plan.json"),
    (IsADirectoryError(21, "Is a directory", "/tmp"), 2, "Is a directory: /tmp"),
    (RecursionError("maximum recursion depth exceeded"), 2, "input nested too deeply"),
    (UnicodeDecodeError("utf-8", b"\xff", 0, 1, "invalid start byte"), 2, "input is not valid text"),
    (OverflowError("int too large to convert to float"), 2, "a number in the input is too large"),
    (MemoryError(), 2, "more memory than this machine has"),
])
def test_error_boundary_turns_environment_errors_into_one_line(capsys, monkeypatch, exc, code, needle):
    import zplan.scenario_options

    def boom(*a, **k):
        raise exc

    monkeypatch.setattr(zplan.scenario_options, "build", boom)
    monkeypatch.setattr("zplan.cli.estimate_fast.build", boom)
    rc, _, err = cli(capsys, "estimate")
    assert rc == code and needle in one_error(err)


def test_json_output_never_holds_nan(capsys, monkeypatch):
    from zplan.cli.json_out import emit_json

    with pytest.raises(ValueError, match="Out of range float values are not JSON compliant"):
        emit_json({"x": float("nan")})


def test_slurm_name_whose_plan_name_is_too_long_names_the_flag(capsys, tmp_path, monkeypatch):
    """The plan goes beside the script as NAME.plan.json: a name that fits 255 bytes but whose
    plan name does not is refused naming --slurm, before anything is written (found by the fuzzer)."""
    monkeypatch.chdir(tmp_path)
    name = "n" * 250 + ".json"
    rc, _, err = cli(capsys, "launch", "--dry-run", "--run-dir", "run", "--slurm", name)
    assert rc == 2 and one_error(err).startswith(f"zplan: error: --slurm {name}")
    assert list(tmp_path.iterdir()) == []


def test_deepspeed_layout_warns_that_eager_zero3_overlaps_less(capsys):
    """The public set's eager DeepSpeed ZeRO-3 rows (DeepCompile's charts, 32 H100) run slower
    than overlap predicts; the zero layout's overlap assumption says by how much, the range the
    rows score now (a changed model must change the text), and the torch layout's does not."""
    import re
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    sys.path[:0] = [str(root / "benchmarks"), str(root / "benchmarks" / "published")]
    import published_accuracy as pa
    from published_rows import load

    errs = [pa.predict(r).tokens_err for r in load() if r.id.startswith("dc-h100-llama3-70b-z3-")]
    assert len(errs) == 12 and all(e is not None for e in errs)
    zero = json.loads(cli(capsys, "estimate", "--model", "llama-3.1-8b", "--gpus", "8", "--json")[1])
    torch_ = json.loads(cli(capsys, "estimate", "--model", "llama-3.1-8b", "--gpus", "8", "--layout", "torch",
                            "--json")[1])
    ddp = json.loads(cli(capsys, "estimate", "--model", "llama-3.1-8b", "--gpus", "8", "--strategy", "ddp",
                         "--json")[1])
    lo, hi = map(int, re.search(r"measured (\d+)-(\d+)% slower than overlap predicts",
                                zero["assumptions"]["overlap"]["meaning"]).groups())
    assert (lo, hi) == (round(100 * min(errs)), round(100 * max(errs)))
    assert "DeepSpeed" not in torch_["assumptions"]["overlap"]["meaning"]
    assert "DeepSpeed" not in ddp["assumptions"]["overlap"]["meaning"]  # no ZeRO-3 estimated


def test_estimate_states_how_compute_runs_beside_a_collective(capsys):
    """The assumption behind contention, from the GPU preset: its measured slowdown where it has
    one (h100-sxm, a100-80gb), NCCL's share of the SMs where it has none (b200); none under
    --efficiency, where no kernel is priced beside a collective."""
    from zplan import presets
    from zplan.kernels import taken_sms

    def assumed(*extra):
        out = cli(capsys, "estimate", "--model", "llama-3.1-8b", "--gpus", "8", "--json", *extra)[1]
        return json.loads(out)["assumptions"].get("compute_beside_collective")

    for cluster, gpu in (("dgx-h100", "h100-sxm"), ("dgx-a100", "a100-80gb")):
        want = presets.gpu(gpu).kernels.collective_slowdown
        assert want is not None and assumed("--cluster", cluster)["value"] == want
    k = presets.gpu("b200").kernels
    b200 = assumed("--cluster", "dgx-b200")
    assert k.collective_slowdown is None and b200["value"] == f"NCCL's {taken_sms(k)} of {k.sm_count} SMs"
    assert "no measurement" in b200["meaning"]
    assert assumed("--efficiency", "0.5") is None


@pytest.mark.parametrize("text,expected", [("3,033,344", 3033344), ("1,000", 1000), ("70B", 70 * 10**9),
                                           ("7.5b", 7_500_000_000), ("1_000", 1000), ("1,200.5k", 1_200_500)])
def test_counts_read_as_typed(text, expected):
    """Counts as people type them: suffixes, exponents, and commas that group thousands."""
    from zplan.parse import parse_count

    assert parse_count(text, "--params") == expected


@pytest.mark.parametrize("text", ["1,2", "12,34", "1,0000", ",100", "1,000,00"])
def test_a_misplaced_comma_is_refused_not_dropped(text):
    """'1,2' read as 12 would plan for a number the user did not type."""
    from zplan.errors import UsageError
    from zplan.parse import parse_count

    with pytest.raises(UsageError, match="commas may only group thousands"):
        parse_count(text, "--gpus")


def test_the_header_names_the_runs_departures_from_zplans_trainer(run_zplan):
    """How the run holds its loop, loss and units, where it departs from zplan's trainer, is one
    header line in the user's own flags; a plain plan prints none."""
    p = run_zplan("estimate", "--model", "llama-3.1-8b", "--gpus", "8", "--layout", "torch",
                  "--embed-head-unit", "root-kept", "--no-logits-kept", "--logits-fp32",
                  "--last-block-kept", "--expandable-segments")
    assert p.returncode == 0, p.stderr
    text = " ".join(p.stdout.split())
    assert ("as run: --embed-head-unit root-kept --no-logits-kept --logits-fp32 --last-block-kept "
            "--expandable-segments") in text
    plain = run_zplan("estimate", "--model", "llama-3.1-8b", "--gpus", "8")
    assert plain.returncode == 0 and "as run:" not in plain.stdout


def test_a_refused_count_shows_a_value_of_its_own_flag(run_zplan):
    """--gpus -1 is shown a GPU count to write, not a parameter count."""
    p = run_zplan("estimate", "--model", "llama-3.1-8b", "--gpus", "-1")
    assert p.returncode == 2
    assert p.stderr.strip() == "zplan: error: --gpus '-1' must be a positive count; write it like 64"
    p = run_zplan("estimate", "--params", "-7", "--gpus", "8")
    assert p.returncode == 2 and "write it like 70e9" in p.stderr


@pytest.mark.parametrize("args, line", [
    (("estimate", "--seq-len", "8e3"), "--seq-len '8e3' is not a whole number (write it out: 8192, not 8e3)"),
    (("estimate", "--micro-batch=2.5"), "--micro-batch '2.5' is not a whole number"),
    (("recommend", "--context-gib", "abc"), "--context-gib 'abc' is not a number"),
])
def test_a_number_flag_given_text_names_the_value(capsys, args, line):
    """Typer said "Input should be a valid integer, unable to parse string as an integer" with
    neither the value nor the fix (the QA pass); the line now names both."""
    rc, _, err = cli(capsys, *args)
    assert rc == 2 and one_error(err).startswith(f"zplan: error: {line}")


def test_zplan_toml_counts_are_checked_where_a_flag_overrides_them(tmp_path, capsys, monkeypatch):
    """docs/reliability.md: the whole zplan.toml is checked even where a flag overrides a key; the
    run-half QA pass found gpus = -3 beside --gpus 4 taken silently."""
    monkeypatch.chdir(tmp_path)
    for value, needle in (("-3", "gpus '-3' must be a positive count; write it like 64"),
                          ('"two"', "gpus 'two' is not a number")):
        (tmp_path / "zplan.toml").write_text(f'model = "tiny"\ngpus = {value}\n')
        rc, _, err = cli(capsys, "recommend", "--gpus", "4")
        assert rc == 2 and needle in one_error(err), err
    (tmp_path / "zplan.toml").write_text('model = "tiny"\ngpus = 2\n')
    assert cli(capsys, "recommend", "--gpus", "4")[0] == 0


def test_detect_says_in_text_what_its_json_says_of_bf16(capsys):
    """README: detect reports whether the CPU has bf16 matrix instructions; the text form left
    it out (the run-half QA pass). Both forms from one detection now agree."""
    import json
    rc, out, _ = cli(capsys, "detect", "--json")
    flag = json.loads(out)["cpu_bf16"]
    rc, out, _ = cli(capsys, "detect")
    assert rc == 0
    said = out.split("CPU bf16 matrix instructions: ")[1].split()[0]
    assert said == {True: "yes", False: "no", None: "unknown"}[flag]


def test_a_bad_number_names_the_value_that_fails(capsys):
    """The review: with a flag repeated or after a script, the line named a good value ('2' for
    --ranks x --ranks 2; the script's own --seq-len 64); and 'ten' got the 8e3 hint."""
    rc, _, err = cli(capsys, "verify", "--ranks", "x", "--ranks", "2")
    assert rc == 2 and "--ranks 'x' is not a whole number" in err and "8e3" not in err
    rc, _, err = cli(capsys, "estimate", "--seq-len", "ten")
    assert rc == 2 and "--seq-len 'ten' is not a whole number (" not in err.replace("(see", "")


@pytest.mark.parametrize("args", [
    ("estimate", "--params", "7e9", "--gpus", "0"),  # was a traceback (the error boundary's flush)
    ("estimate", "--params", "7e9", "--json"),  # was "internal error"
    ("estimate", "--params", "7e9"),  # was exit 0 with nothing printed
    ("recommend", "--model", "llama-3.1-8b", "--gpus", "8", "--write", "{tmp}/plan.json"),  # wrote, then exit 2
    ("export", "--plan", "{tmp}/none.json", "--to", "torchrun", "--output", "{tmp}/run.sh"),
])
def test_a_closed_stdout_is_one_line_before_any_work(args, tmp_path):
    """fd 1 closed (`>&-`: Python sets sys.stdout to None): the error boundary's flush raised
    AttributeError (a traceback, the real error lost), --json ended in "internal error", a
    result went nowhere with exit 0, and `recommend --write` wrote its plan before failing to
    print. Now one line on stderr, exit 2, and nothing written."""
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "ZPLAN_DEBUG"}
    argv = [a.replace("{tmp}", str(tmp_path)) for a in args]
    p = subprocess.run([sys.executable, "-m", "zplan", *argv], stdout=None, stderr=subprocess.PIPE, text=True,
                       env=env, timeout=60, preexec_fn=lambda: os.close(1))
    assert p.returncode == 2 and "standard output is closed" in p.stderr, p.stderr
    assert len(p.stderr.strip().splitlines()) == 1 and "Traceback" not in p.stderr
    assert list(tmp_path.iterdir()) == []


def test_files_meet_the_checks_the_flags_do(run_zplan, tmp_path):
    """A plan file with int4 weights was priced (a 0-byte gather buffer) where --param-dtype int4
    is refused; a model file with total_params beside its architecture had its count replaced
    (Llama 3.1 8B read as 1 parameter). Both are refused in one line, exit 2, naming the field."""
    plan = tmp_path / "p.json"
    assert run_zplan("recommend", "--model", "llama-3.1-8b", "--gpus", "8", "--write", str(plan)).returncode == 0
    d = json.loads(plan.read_text())
    d["train"]["precision"]["param"] = "int4"
    (tmp_path / "int4.json").write_text(json.dumps(d))
    p = run_zplan("estimate", "--plan", str(tmp_path / "int4.json"))
    assert p.returncode == 2 and "param dtype int4" in p.stderr and len(p.stderr.strip().splitlines()) == 1, p.stderr
    text = (ROOT / "presets" / "models" / "llama-3.1-8b.toml").read_text()
    (tmp_path / "m.toml").write_text(text + "\ntotal_params = 1\n")
    p = run_zplan("estimate", "--model", str(tmp_path / "m.toml"), "--strategy", "zero3")
    assert p.returncode == 2 and "total_params" in p.stderr and len(p.stderr.strip().splitlines()) == 1, p.stderr
    ok = run_zplan("estimate", "--params", "7e9", "--strategy", "zero3", "--json")  # a synthesized model keeps it
    assert ok.returncode == 0, ok.stderr


@pytest.mark.parametrize("args", [("--help",), ("estimate", "--help")])
def test_help_through_a_closed_pipe_exits_0(args):
    """`zplan --help | head -1` exited 1 with nothing said (rich's broken-pipe handler exits 1),
    unlike every other command's output through a closed pipe (exit 0)."""
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "ZPLAN_DEBUG"}
    env["COLUMNS"] = "200"
    p = subprocess.Popen([sys.executable, "-m", "zplan", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         env=env)
    p.stdout.read(1)
    p.stdout.close()
    assert p.wait(timeout=60) == 0
    assert p.stderr.read() == b""


def test_recommend_help_says_its_search_dimensions_are_searched(run_zplan):
    """recommend --help showed `[default: 1]` for --micro-batch (and none for --checkpointing,
    1 for --blocks-per-unit...), which typed pins the search and changes the answer (a QA pass:
    global batch 64 -> 8, another winner). Each search dimension now says it is searched."""
    from zplan.cli.options import OPTION_ARGS
    from zplan.recommend import PINNABLE

    p = run_zplan("recommend", "--help", env={"COLUMNS": "300"})
    assert p.returncode == 0
    rows = {}
    for line in p.stdout.splitlines():
        cells = line.strip("│ ").split()
        if cells and cells[0].startswith("--"):
            rows[cells[0]] = line
    for name in PINNABLE | {"shard_size"}:
        line = rows["--" + name.replace("_", "-")]
        assert "default: searched" in line and "[default:" not in line, line
    assert "[default: 1]" in run_zplan("estimate", "--help", env={"COLUMNS": "300"}).stdout  # estimate's are defaults
    assert set(PINNABLE) <= set(OPTION_ARGS)


@pytest.mark.parametrize("bad", ["zero4", ""])
def test_verify_fake_refuses_an_unknown_strategy_in_one_line(capsys, bad):
    """--fake ran its strategies before verify's own checks: an unknown one was `internal error:
    KeyError` with exit 1 (a QA pass). Now the choice is refused as without --fake."""
    rc, _, err = cli(capsys, "verify", "--fake", "--strategy", "zero3", "--strategy", bad)
    assert rc == 2 and f"--strategy '{bad}' is not one of" in err and "internal error" not in err


def test_zplan_toml_takes_the_presets_options_long_name(tmp_path, capsys, monkeypatch):
    """README: zplan.toml's keys are the long option names; `presets = [...]` (--presets) was
    refused as unknown, only the field's name presets_dir read (a QA pass). Both now read."""
    import shutil

    from zplan.presets import _shipped_dir

    monkeypatch.chdir(tmp_path)
    (tmp_path / "mine" / "models").mkdir(parents=True)
    shutil.copy(_shipped_dir() / "models" / "tiny.toml", tmp_path / "mine" / "models" / "mytiny.toml")
    text = (tmp_path / "mine" / "models" / "mytiny.toml").read_text().replace('name = "tiny"', 'name = "mytiny"')
    (tmp_path / "mine" / "models" / "mytiny.toml").write_text(text)
    for key in ("presets", "presets_dir"):
        (tmp_path / "zplan.toml").write_text(f'{key} = ["{tmp_path / "mine"}"]\nmodel = "mytiny"\ngpus = 2\n')
        rc, out, err = cli(capsys, "recommend")
        assert rc == 0, err
    both = f'presets = ["{tmp_path / "mine"}"]\npresets_dir = ["{tmp_path}"]\nmodel = "mytiny"\n'
    (tmp_path / "zplan.toml").write_text(both)  # one option twice: refused, not one silently dropped
    rc, _, err = cli(capsys, "recommend")
    assert rc == 2 and "both presets and presets_dir are set" in err, err


def test_recommend_says_a_given_shard_size_is_kept(capsys):
    """--shard-size pins HSDP's shard size (every size is searched otherwise) but the "as given,
    not searched" line did not name it (a QA pass)."""
    rc, _, err = cli(capsys, "recommend", "--model", "tiny", "--gpus", "16", "--strategy", "hsdp", "--shard-size", "4")
    assert rc == 0 and "as given, not searched: --shard-size 4 (HSDP)" in err, err


def test_a_count_below_the_smallest_synthesized_decoder_is_refused(capsys):
    """--params 1 planned '15.4 GB per GPU, MFU 18.5%': the stand-in decoder for a count has at
    least one block of width 128 and a 32,000-token embedding and head (arch.synthetic), whose
    own parameters a smaller count cannot hold (the smallest shape it builds, arch.synthetic at one
    block of width 128, counted by arch.param_count); the refusal names the floor, counted here from
    the shape, and the way to a small model."""
    from tests.helpers import cli
    from zplan import arch

    smallest = arch.synthetic(1).model_copy(update={"total_params": None})  # the shape, counted
    assert (smallest.num_layers, smallest.hidden) == (1, 128)
    shape = arch.SYNTHETIC_MIN_PARAMS
    assert shape <= arch.param_count(smallest) <= shape * 1.001  # the norms' gains aside
    r = cli(capsys, "estimate", "--params", str(shape - 1), "--gpus", "2")
    assert r.returncode == 2 and f"{shape:,}" in r.stderr and "--model" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1
    assert cli(capsys, "estimate", "--params", str(shape), "--gpus", "2").returncode == 0


@pytest.mark.parametrize("tolerance", [0.00001, 0.0])
def test_verify_shows_the_difference_a_tight_tolerance_fails_on(tolerance):
    """`verify --tolerance 0.00001` showed a failing cell as '+0.0%' beside 'tolerance 0%': the
    table's digits follow the tolerance, so the error a cell fails on is visible."""
    from zplan.verify import Cell, CellResult, table

    r = CellResult(Cell("zero3", 2, "fp32", "none"), predicted_memory_bytes=1_000_050,
                   measured_memory_bytes=1_000_000, predicted_traffic_bytes=1, measured_traffic_bytes=1)
    assert not r.ok(tolerance)
    row = next(ln for ln in table([r], tolerance) if ln.startswith("| zero3"))
    err = row.split("|")[4].strip()
    assert float(err.rstrip("%")) / 100 == pytest.approx(r.memory_error, abs=5e-7) and float(err.rstrip("%")) != 0
