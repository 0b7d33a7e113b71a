import json
import math

import pytest

from zplan import arch, presets
from zplan.errors import UsageError

# Counts from each model's safetensors index (total_size / 2 bytes per bf16 weight).
EXACT = {
    "llama-3.1-8b": 8_030_261_248, "llama-3.1-70b": 70_553_706_496,
    "llama-3.1-405b": 405_853_388_800, "llama-2-7b": 6_738_415_616,
    "llama-2-13b": 13_015_864_320, "llama-2-70b": 68_976_648_192,
    "mistral-7b": 7_241_732_096, "mixtral-8x7b": 46_702_792_704,
    "qwen2.5-7b": 7_615_616_512, "qwen2.5-72b": 72_706_203_648, "llama-3.2-1b": 1_235_814_400,
    "llama-3.2-3b": 3_212_749_824,
}


@pytest.mark.parametrize("name", sorted(EXACT))
def test_param_count_matches_published_exactly(name):
    assert arch.param_count(presets.model(name)) == EXACT[name]


def test_gpt3_within_rounding_of_175b():
    n = arch.param_count(presets.model("gpt3-175b"))
    assert abs(n / 175e9 - 1) < 0.005  # the paper rounds to 175B


def test_every_preset_loads_and_cites_a_source():
    for kind in presets.KINDS:
        found = presets.names(kind)
        assert found, kind
        for name in found:
            spec = presets.load(kind, name)
            assert spec.source, f"{kind}/{name} cites no source"
    assert {"a100-40gb", "a100-80gb", "h100-sxm", "h100-pcie", "h200", "b200", "mi300x", "l40s",
            "rtx-4090"} <= set(presets.names("gpus"))


def test_units_sum_to_the_model():
    for name in ("llama-3.1-8b", "gpt3-175b", "mixtral-8x7b", "tiny"):
        m = presets.model(name)
        for k in (1, 2, 4):
            us = arch.units(m, k)
            assert sum(u.numel for u in us) == arch.param_count(m)
            assert sum(u.blocks for u in us) == m.num_layers


def test_tied_embeddings_share_one_unit():
    us = arch.units(presets.model("gpt3-175b"))
    assert us[0].name == "embed+head" and us[0].held
    assert not any(u.name == "norm+head" for u in us)


def test_hf_config_json_is_read_offline(tmp_path):
    cfg = {
        "model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336,
        "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
        "vocab_size": 128256, "tie_word_embeddings": False, "hidden_act": "silu",
        "max_position_embeddings": 131072,
    }
    d = tmp_path / "Llama-3.1-8B"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(cfg))
    assert arch.param_count(presets.model(str(d))) == EXACT["llama-3.1-8b"]
    assert arch.param_count(presets.model(str(d / "config.json"))) == EXACT["llama-3.1-8b"]


def test_qwen2_config_gets_qkv_bias(tmp_path):
    cfg = {"model_type": "qwen2", "hidden_size": 3584, "intermediate_size": 18944,
           "num_hidden_layers": 28, "num_attention_heads": 28, "num_key_value_heads": 4,
           "vocab_size": 152064, "tie_word_embeddings": False}
    p = tmp_path / "config.json"
    p.write_text(json.dumps(cfg))
    assert arch.param_count(presets.model(str(p))) == EXACT["qwen2.5-7b"]


def test_user_folder_overrides_and_extends(tmp_path):
    (tmp_path / "gpus").mkdir()
    (tmp_path / "gpus" / "my-gpu.toml").write_text(
        'name = "my-gpu"\nmemory_bytes = 1000\npeak_flops = { fp32 = 1e12, bf16 = 2e12 }\n'
        'hbm_bytes_per_s = 1e12\nhost_link_bytes_per_s = 1e10\nsource = "mine"\n'
    )
    g = presets.gpu("my-gpu", (str(tmp_path),))
    assert g.memory_bytes == 1000
    assert "my-gpu" in presets.names("gpus", (str(tmp_path),))


def test_unknown_name_suggests_close_ones():
    with pytest.raises(UsageError, match="did you mean.*h100-sxm"):
        presets.gpu("h100-smx")


def test_malformed_file_names_file_field_and_reason(tmp_path):
    p = tmp_path / "bad.toml"
    p.write_text('name = "x"\nmemory_bytes = -5\npeak_flops = { fp32 = 1e12, bf16 = 2e12 }\n'
                 'hbm_bytes_per_s = 1e12\nhost_link_bytes_per_s = 1e10\nsource = "s"\n')
    with pytest.raises(UsageError, match=r"bad\.toml: field 'memory_bytes': .*greater than 0"):
        presets.gpu(str(p))


def test_extra_fields_are_refused(tmp_path):
    p = tmp_path / "extra.toml"
    p.write_text('name = "x"\ngpus_per_node = 8\nintra_node_busbw_bytes_per_s = 1e9\n'
                 'inter_node_busbw_bytes_per_s = 1e9\nintra_node_latency_s = 0\n'
                 'inter_node_latency_s = 0\nhost_ram_bytes = 10\nsource = "s"\nbandwith = 3\n')
    with pytest.raises(UsageError, match="field 'bandwith': Extra inputs are not permitted"):
        presets.cluster(str(p))


def test_synthetic_model_keeps_the_exact_count():
    m = arch.synthetic(70_000_000_000)
    assert arch.param_count(m) == 70_000_000_000
    assert sum(u.numel for u in arch.units(m)) == 70_000_000_000
    assert math.isclose(m.hidden / m.num_layers, 128, rel_tol=0.1)


def test_a_preset_name_that_is_not_a_regular_file_is_named(tmp_path):
    import os

    (tmp_path / "gpus").mkdir()
    os.mkfifo(tmp_path / "gpus" / "pipe.toml")
    (tmp_path / "gpus" / "folder.toml").mkdir()
    for name, kind in (("pipe", "a FIFO"), ("folder", "a directory")):
        with pytest.raises(UsageError, match=f"preset .*gpus/{name}.toml is {kind}; pass a regular file"):
            presets.gpu(name, (str(tmp_path),))


def test_a_presets_folder_that_cannot_be_listed_holds_none(monkeypatch):
    monkeypatch.setenv("ZPLAN_PRESETS", "x" * 5000)  # ENAMETOOLONG, like a missing PATH entry
    assert presets.gpu("h100-sxm").name == "h100-sxm"
    with pytest.raises(UsageError, match="unknown gpu 'nope'"):
        presets.gpu("nope")


@pytest.mark.parametrize("name", ["", "   ", "x" * 5000, "a\x00b"])
def test_empty_huge_or_nul_names(name):
    with pytest.raises(UsageError, match=r"^--model "):
        presets.model(name)


def test_kernel_rates_above_the_datasheet_peak_are_refused(tmp_path):
    """An achieved rate above the peak it is measured against is a typo: one clear line."""
    text = (presets._shipped_dir() / "gpus" / "h100-sxm.toml").read_text()
    bad = tmp_path / "fast.toml"
    bad.write_text(text.replace("bf16 = 698.6e12", "bf16 = 998.6e12"))
    with pytest.raises(UsageError, match=r"fast\.toml: kernels\.gemm_flops\.bf16 = 9\.986e\+14 "
                                         r"exceeds the bf16 peak"):
        presets.gpu(str(bad))
    slow_hbm = tmp_path / "hbm.toml"
    slow_hbm.write_text(text.replace("hbm_achieved_bytes_per_s = 2903e9",
                                     "hbm_achieved_bytes_per_s = 3903e9"))
    with pytest.raises(UsageError, match="hbm_achieved_bytes_per_s exceeds"):
        presets.gpu(str(slow_hbm))


def test_every_accelerator_preset_is_timed_from_kernels():
    """No GPU preset falls back to one flat efficiency: each carries kernel constants with a source
    (the nominal CPU rank is the exception: calibrate measures the CPU at hand)."""
    for name in presets.names("gpus"):
        g = presets.gpu(name)
        if g.device == "cpu":
            continue
        assert g.kernels is not None, name
        assert g.kernels.source, name


def test_a_presets_known_miss_is_printed_with_the_assumptions(capsys):
    """MI300X's tuned-kernel figures ran 29-60% fast against the one public run: an estimate on it
    says so beside the assumptions (with zplan calibrate as the way to change it); a GPU
    without a caveat prints none."""
    from tests.helpers import cli
    r = cli(capsys, "estimate", "--model", "llama-3.1-8b", "--gpus", "8", "--cluster", "mi300x-node", "--json")
    a = json.loads(r.stdout)["assumptions"]
    assert a["gpu_figures"]["flag"] == "zplan calibrate" and "29-60%" in a["gpu_figures"]["meaning"]
    r = cli(capsys, "estimate", "--model", "llama-3.1-8b", "--gpus", "8", "--json")
    assert "gpu_figures" not in json.loads(r.stdout)["assumptions"]
    r = cli(capsys, "recommend", "--model", "llama-3.1-8b", "--gpus", "8", "--cluster", "mi300x-node", "--json")
    assert any("29-60%" in f and "zplan calibrate" in f for f in json.loads(r.stdout)["flags"])


def test_a_multi_node_estimate_names_its_network_figures(capsys):
    """Across nodes the cluster preset's network prices every collective: the estimate names its
    figures and how to give one's own (a cluster file), with the measured spread between fabrics;
    inside one node it says nothing of a network."""
    from tests.helpers import cli
    c = presets.cluster("dgx-h100")
    r = cli(capsys, "estimate", "--model", "llama-3.1-8b", "--gpus", "16", "--json")
    a = json.loads(r.stdout)["assumptions"]["inter_node_network"]
    assert a["value"] == (f"dgx-h100: {c.inter_node_busbw_bytes_per_s / 1e9:g} GB/s per GPU, "
                          f"{c.inter_node_latency_s * 1e6:g} us per network step")
    assert "aws-p5" in a["flag"] and "FILE.toml" in a["flag"] and "9bl" in a["meaning"]
    r = cli(capsys, "estimate", "--model", "llama-3.1-8b", "--gpus", "8", "--json")
    assert "inter_node_network" not in json.loads(r.stdout)["assumptions"]


def test_a_name_with_a_nul_or_too_long_is_named_in_its_error():
    """The fuzzer found `--gpu` with a NUL answered without naming the flag or the value."""
    with pytest.raises(UsageError, match=r"^--gpu 'a\\x00b' holds a NUL; name a preset"):
        presets.load("gpus", "a\x00b")
    with pytest.raises(UsageError, match=r"^--model 'xxxx.*'\.\.\. is 5,000 characters long"):
        presets.load("models", "x" * 5000)


def test_an_moe_estimate_states_how_its_experts_are_priced(capsys):
    """One measured MoE run is in the public set: an MoE model's estimate says how its experts
    are priced (k GEMMs over every token, routing balanced); a dense model's says nothing."""
    from tests.helpers import cli
    r = cli(capsys, "estimate", "--model", "mixtral-8x7b", "--gpus", "16", "--json")
    a = json.loads(r.stdout)["assumptions"]
    assert a["experts"]["value"] == "2 of 8 per token"
    assert "routing balanced" in a["experts"]["meaning"] and "One measured MoE run" in a["experts"]["meaning"]
    r = cli(capsys, "estimate", "--model", "llama-3.1-8b", "--gpus", "8", "--json")
    assert "experts" not in json.loads(r.stdout)["assumptions"]


def test_an_unaligned_gemm_dimension_is_named_with_the_assumptions(capsys, tmp_path):
    """GPT-2's vocabulary of 50257 is not a multiple of 8: the estimate names it (unpriced, with the
    end-to-end figures that show what it costs); a padded copy of the same model, and Llama,
    name nothing; an odd FFN width is named too."""
    from tests.helpers import cli
    r = cli(capsys, "estimate", "--model", "gpt2-124m", "--gpus", "8", "--seq-len", "1024", "--json")
    a = json.loads(r.stdout)["assumptions"]["unaligned_gemms"]
    assert a["value"] == "vocab 50,257" and "50304" in a["flag"] and "13.7%" in a["meaning"]
    padded = tmp_path / "gpt2-padded.toml"
    text = presets.shipped_file("models/gpt2-124m.toml").read_text()
    padded.write_text(text.replace("vocab_size = 50257", "vocab_size = 50304"))
    for model in (str(padded), "llama-3.1-8b"):
        r = cli(capsys, "estimate", "--model", model, "--gpus", "8", "--seq-len", "1024", "--json")
        assert "unaligned_gemms" not in json.loads(r.stdout)["assumptions"]
    odd = tmp_path / "odd-ffn.toml"
    odd.write_text(text.replace("vocab_size = 50257", "vocab_size = 50304").replace("ffn_hidden = 3072", "ffn_hidden = 3071"))
    r = cli(capsys, "estimate", "--model", str(odd), "--gpus", "8", "--seq-len", "1024", "--json")
    assert json.loads(r.stdout)["assumptions"]["unaligned_gemms"]["value"] == "ffn_hidden 3,071"


def test_a_gpu_alone_plans_on_its_own_node(capsys):
    """--gpu without --cluster plans for the node that GPU sits in (GPUSpec.cluster), not dgx-h100's
    NVSwitch and 400 Gb/s NICs: an L40S over 2 nodes is priced as with --cluster pcie-l40s, to the
    step, and slower than the same GPUs on dgx-h100's links (the QA pass found 2.2x between them)."""
    from tests.helpers import cli

    def step(*flags):
        r = cli(capsys, "estimate", "--model", "llama-3.1-8b", "--gpus", "16", "--strategy", "zero3",
                "--checkpointing", "full", "--json", *flags)
        d = json.loads(r.stdout)
        (res,) = d["strategies"]
        return d["inputs"]["cluster"], res["time"]["step_s"]

    own, explicit, h100_links = step("--gpu", "l40s"), step("--gpu", "l40s", "--cluster", "pcie-l40s"), \
        step("--gpu", "l40s", "--cluster", "dgx-h100")
    assert own == explicit and own[0] == "pcie-l40s"
    assert h100_links[1] < 0.8 * own[1]
    assert step()[0] == "dgx-h100" and step("--cluster", "dgx-a100")[0] == "dgx-a100"


def test_every_shipped_gpu_names_a_node_or_says_whose_links_it_takes(capsys, tmp_path):
    """Every shipped GPU preset names a shipped cluster whose GPUs are of its kind (same memory
    family: the node's links are what differ); a GPU file that names none plans on dgx-h100's
    links and says so among the assumptions, with the flag (the review: refusing broke bare
    recommend and launch on an H100 PCIe machine, where the GPU comes from detection). h100-pcie
    named none and was planned on NVSwitch links (an audit); it has its PCIe node now."""
    from tests.helpers import cli
    clusters = set(presets.names("clusters"))
    for name in presets.names("gpus"):
        g = presets.gpu(name)
        assert g.cluster in clusters, name
        node_gpu = presets.gpu(presets.cluster(g.cluster).gpu)
        assert node_gpu.device == g.device and node_gpu.name.split("-")[0] == g.name.split("-")[0], name
    assert presets.cluster(presets.gpu("h100-pcie").cluster).link == "pcie"
    text = "\n".join(line for line in (presets._shipped_dir() / "gpus" / "h100-pcie.toml").read_text().splitlines()
                     if not line.startswith("cluster ="))
    (tmp_path / "mine.toml").write_text(text.replace('name = "h100-pcie"', 'name = "mine"'))
    r = cli(capsys, "estimate", "--gpu", str(tmp_path / "mine.toml"), "--gpus", "8", "--json")
    a = json.loads(r.stdout)["assumptions"]["node_links"]
    assert r.returncode == 0 and a["value"] == "dgx-h100" and "--cluster" in a["flag"]


def test_a_calibrated_gpu_plans_on_its_base_parts_node(tmp_path, capsys):
    """A preset zplan calibrate wrote (measured, with the part it was measured on as `base`)
    plans on that part's node when it names none itself."""
    from tests.helpers import cli
    (tmp_path / "gpus").mkdir()
    text = (presets.shipped_file("gpus/a100-80gb.toml").read_text()
            .replace('name = "a100-80gb"', 'name = "mine"\nmeasured = true\nbase = "a100-80gb"'))
    text = "\n".join(l for l in text.splitlines() if not l.startswith("cluster ="))
    (tmp_path / "gpus" / "mine.toml").write_text(text)
    r = cli(capsys, "estimate", "--presets", str(tmp_path), "--gpu", "mine", "--gpus", "8", "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["inputs"]["cluster"] == "dgx-a100"


def test_a_learned_position_table_grows_to_the_sequence(capsys):
    """GPT-2 (learned positions, 1024 rows: 124,439,808 parameters, Hugging Face's count) at
    --seq-len 4096 has the 4096-row table a run at that length must build (the QA pass found the
    count kept 1024 rows); at 512 the preset's table stays; the estimate says how many rows."""
    from tests.helpers import cli
    from zplan.scenario_options import ScenarioOptions, build
    count = {s: build(ScenarioOptions(model="gpt2-124m", gpus="8", seq_len=s)).params for s in (512, 1024, 4096)}
    assert count == {512: 124_439_808, 1024: 124_439_808, 4096: 124_439_808 + 3072 * 768}
    r = cli(capsys, "estimate", "--model", "gpt2-124m", "--gpus", "8", "--seq-len", "4096", "--json")
    assert json.loads(r.stdout)["assumptions"]["position_table"]["value"] == "4,096 rows"
    r = cli(capsys, "estimate", "--model", "llama-3.1-8b", "--gpus", "8", "--json")
    assert "position_table" not in json.loads(r.stdout)["assumptions"]


def test_cpu_ranks_default_to_eight_on_their_own_node(capsys):
    """--gpu cpu alone plans on cpu-local (gloo on one host), whose 64 GPUs per node let any world
    fit one host: the default count stays 8, as before the GPU's own node became the default;
    a GPU's node otherwise gives the count (4 on a 4090 workstation)."""
    from tests.helpers import cli
    def n(*flags):
        return json.loads(cli(capsys, "estimate", "--model", "tiny", "--json", *flags).stdout)["inputs"]["num_gpus"]
    assert n("--gpu", "cpu") == 8 and n("--gpu", "rtx-4090") == 4 and n() == 8


def test_a_gpu_on_another_gpus_node_is_said(capsys):
    """--gpu h200 --cluster dgx-a100 plans an H200 on an A100 node's links: said among the
    assumptions, naming the node's own GPU; a GPU on its own node says nothing."""
    from tests.helpers import cli
    r = cli(capsys, "estimate", "--gpu", "h200", "--cluster", "dgx-a100", "--gpus", "8", "--json")
    a = json.loads(r.stdout)["assumptions"]["node_links"]
    assert r.returncode == 0 and a["value"] == "dgx-a100" and presets.cluster("dgx-a100").gpu in a["meaning"]
    # nor a GPU on its own home node whose preset names another part (the review: a100-40gb on
    # dgx-a100, whose node preset holds the 80 GB part)
    for args in (("--gpu", "h200"), ("--gpu", "h200", "--cluster", "hgx-h200"), ("--cluster", "dgx-a100"),
                 ("--gpu", "a100-40gb"), ("--gpu", "h100-hbm2e-500w")):
        r = cli(capsys, "estimate", *args, "--gpus", "8", "--json")
        assert "node_links" not in json.loads(r.stdout)["assumptions"], args


def test_an_unknown_name_says_zplan_presets_names_no_folder(run_zplan, tmp_path):
    """$ZPLAN_PRESETS is a search path (a missing entry is skipped, as PATH's is), so a typo in it
    left "unknown gpu 'mine'" with no word of why: the refusal now names the entry."""
    p = run_zplan("estimate", "--gpu", "mine", "--params", "7e9", env={"ZPLAN_PRESETS": str(tmp_path / "nope")})
    assert p.returncode == 2 and f"$ZPLAN_PRESETS names {tmp_path / 'nope'}, which is not a folder" in p.stderr


@pytest.mark.parametrize("vendor,want", [("AuthenticAMD", 2e-6), ("GenuineIntel", 1e-6), (None, 1e-6)])
def test_calibrate_reads_nccls_network_overhead_from_the_hosts_cpu(tmp_path, vendor, want):
    """tuning.cc getNetOverhead: 2 us on AMD x86 hosts, 1 us on Intel and others (an Arm host's
    /proc/cpuinfo has no vendor_id); calibrate writes this host's into its cluster preset (a
    review: a calibrated p5 got Intel's)."""
    from zplan.hardware import nccl_net_overhead_s

    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\n" + (f"vendor_id\t: {vendor}\n" if vendor else "Features\t: fp asimd\n"))
    assert nccl_net_overhead_s(info) == want
    assert nccl_net_overhead_s(tmp_path / "none") == 1e-6


# nvidia-smi -q's "FB Memory Usage" Total and Reserved (MiB) on the driver each preset's figure was
# read with (thamada/gls e20f22d, gls/*_smi.py): what CUDA lends is Total less Reserved, which
# deviceQuery's totalGlobalMem and torch's total_memory report. The presets held Total until
# 2026-12-06, ~0.3-0.8 GiB over what a run can have.
NVIDIA_SMI_Q = {"a100-80gb": (81920, 763), "h100-sxm": (81559, 454), "l40s": (46068, 479),
                "rtx-4090": (24564, 354)}


@pytest.mark.parametrize("name", sorted(NVIDIA_SMI_Q))
def test_a_gpus_memory_is_what_cuda_lends_not_nvidia_smis_total(name):
    total_mib, reserved_mib = NVIDIA_SMI_Q[name]
    assert presets.gpu(name).memory_bytes / 2**20 == pytest.approx(total_mib - reserved_mib, abs=1)


def test_every_nvidia_preset_is_under_its_nvidia_smi_total():
    """No shipped NVIDIA part counts the driver's reserve as its own (nvidia-smi's Totals, MiB)."""
    smi_total_mib = {"a100-40gb": 40960, "a100-80gb": 81920, "h100-sxm": 81559, "h100-pcie": 81559,
                     "h200": 143771, "b200": 183359, "gb200": 189471, "l40s": 46068, "rtx-4090": 24564}
    for name, total in smi_total_mib.items():
        reserve_mib = total - presets.gpu(name).memory_bytes / 2**20
        assert 300 <= reserve_mib <= 1000, (name, reserve_mib)
