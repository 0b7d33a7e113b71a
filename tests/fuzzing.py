"""The CLI fuzzer shared by tests/test_fuzz.py (CI) and benchmarks/fuzz_cli.py (long runs).

A case is a command line for one planner command (flags with good or hostile values) plus the
files it names, written fresh into its own folder: presets (TOML), Hugging Face config.json, plan
files, zplan.toml, each valid, mutated (one field zero, negative, NaN, huge, of the wrong type,
missing, unknown) or garbled (truncated, random bytes, not UTF-8, nested deeply), and special
paths (a FIFO, a directory, /dev/zero, a missing file, a name too long). The case runs in this
process through zplan.cli.main.run with captured output (a subprocess each would cost ~0.4 s).

Files: tests/fuzz_files.py. Running a case and judging it: tests/fuzz_oracle.py.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from hypothesis import strategies as st

from tests.fuzz_files import (CLUSTERS, GPUS, HF_LLAMA, HOSTILE_VALUES, MODELS, garbled, json_file,
                              toml_file, toml_text)

STRATEGIES = ["ddp", "zero1", "zero2", "zero3", "zero3-noreshard", "hsdp", "offload-opt", "offload-all"]
HOSTILE_TEXT = ["", " ", "0", "-1", "-0", "0.0", "1e999", "nan", "NaN", "inf", "-inf", "1e13",
                "1e300", "0.5", "2.5", "abc", "[/x]", "[bold]x[/]", "x" * 300, "a\nb", "é", "1_000",
                "70B", "1.2T", "0x10", "-", "9" * 400, "1e-300", "\u202e", "💥", "1,000", "+5",
                "2**64", "18446744073709551617", "1e6", "1000000", "3"]
text_value = st.one_of(st.sampled_from(HOSTILE_TEXT), st.text(max_size=20),
                       st.integers(-10**20, 10**20).map(str),
                       st.floats(allow_nan=True, allow_infinity=True).map(repr))


@st.composite
def choice_or_hostile(draw, good: list[str]) -> str:
    """A good value seven times in eight, so that most cases get past the first check."""
    return draw(text_value) if draw(st.sampled_from(range(8))) == 0 else draw(st.sampled_from(good))


def number(good: list[str]) -> st.SearchStrategy[str]:
    return choice_or_hostile(good)


SCENARIO = {
    "--params": number(["7e9", "70B", "1e13", "1", "1000", "1.2T", "405e9"]),
    "--unit-params": number(["1e8", "1", "1000", "1e9"]),
    "--gpus": number(["1", "2", "8", "64", "1000", "1e6", "4096"]),
    "--gpu": choice_or_hostile(GPUS),
    "--cluster": choice_or_hostile(CLUSTERS),
    "--gpus-per-node": number(["1", "4", "8", "72", "1024"]),
    "--seq-len": number(["1", "256", "4096", "131072", "10000000"]),
    "--micro-batch": number(["1", "2", "8", "100000"]),
    "--grad-accum": number(["1", "4", "1000000"]),
    "--checkpointing": choice_or_hostile(["none", "full", "selective", "attention", "every-k", "first-k"]),
    "--checkpoint-every": number(["1", "2", "3", "100"]),
    "--checkpoint-first": number(["1", "2", "3", "100"]),
    "--optimizer": choice_or_hostile(["adamw", "sgd", "adam8bit", "muon"]),
    "--param-dtype": choice_or_hostile(["bf16", "fp32", "fp16", "fp8"]),
    "--reduce-dtype": choice_or_hostile(["fp32", "bf16"]),
    "--master-dtype": choice_or_hostile(["fp32", "bf16"]),
    "--optimizer-dtype": choice_or_hostile(["fp32", "bf16", "int8"]),
    "--layout": choice_or_hostile(["zero", "torch"]),
    "--blocks-per-unit": number(["1", "2", "4", "10000"]),
    "--embed-head-unit": choice_or_hostile(["separate", "head-kept", "root", "root-kept", "head-root-kept"]),
    "--shard-size": number(["1", "2", "8", "16"]),
    "--efficiency": number(["0.5", "1", "0.01"]),
    "--context-gib": number(["0", "0.5", "1024"]),
    "--fragmentation": number(["0", "0.05", "0.9"]),
    "--bucket-mib": number(["0", "25", "1000000"]),
    "--attention-kernel": choice_or_hostile(["flash2", "flash-triton", "flash3", "flash4", "flex", "cudnn",
                                             "flash1", "efficient"]),
    "--linear-loss": choice_or_hostile(["none", "chunked", "liger"]),
    "--loss-chunks": number(["1", "8", "3", "0", "65"]),
    "--deepspeed-sub-group": number(["100000000", "1", "0", "1e9"]),
    "--deepspeed-hook-forward-ms": number(["0", "0.22", "100"]),
    "--deepspeed-hook-backward-ms": number(["0", "0.32", "100"]),
    "--compile-scope": choice_or_hostile(["block", "model"]),
    "--optimizer-kernels": choice_or_hostile(["fused", "foreach", "single"]),
    "--float8-recipe": choice_or_hostile(["tensorwise", "rowwise", "rowwise-gw-hp", "te-delayed"]),
}
SWITCHES = ["--reduce-last-only", "--no-flash", "--no-prefetch", "--fused-norm", "--no-fused-norm",
            "--no-overlap", "--compile", "--eager-loss", "--float8", "--no-loss-fp32",
            "--no-checkpoint-early-stop", "--fused-loss", "--fused-swiglu", "--no-grad-clip", "--no-float8-all-gather",
            "--no-norm-output-fp32", "--logits-fp32", "--last-block-kept", "--attention-heads-first",
            "--attention-expands-kv"]
OWN = {
    "estimate": {"--strategy": choice_or_hostile(STRATEGIES), "--unit": choice_or_hostile(["GB", "GiB"])},
    "recommend": {"--global-batch": number(["8", "64", "1e13", "1000000", "7"]),
                  "--global-batch-tokens": number(["4096", "1e6", "2097152"]),
                  "--objective": choice_or_hostile(["throughput", "memory"]),
                  "--headroom": number(["0", "0.1", "0.9"]), "--top": number(["0", "3", "1000"]),
                  "--strategy": choice_or_hostile(STRATEGIES)},
    "explain": {"--strategy": choice_or_hostile(STRATEGIES)},
    "export": {"--to": choice_or_hostile(["deepspeed", "accelerate", "torchrun"])},
    "launch": {"--model": choice_or_hostile(["tiny"] + MODELS), "--strategy": choice_or_hostile(STRATEGIES),
               "--global-batch": number(["2", "4", "0", "-3"]), "--seq-len": number(["16", "0"]),
               "--nproc": number(["1", "2", "0", "-1"]), "--nnodes": number(["1", "2", "0"]),
               "--node-rank": number(["0", "1", "5"]), "--rdzv-endpoint": choice_or_hostile(["h:29500"]),
               "--max-restarts": number(["0", "3", "-1"]), "--steps": number(["1", "20", "0"]),
               "--save-every": number(["0", "5", "-5"])},
}


@dataclass
class Case:
    command: str
    argv: list[str]
    files: dict[str, bytes] = field(default_factory=dict)  # relative name -> bytes
    specials: dict[str, str] = field(default_factory=dict)  # relative name -> fifo | dir
    project: bytes | None = None  # zplan.toml


PROJECT_KEYS = {k.lstrip("-").replace("-", "_"): v for k, v in SCENARIO.items()}
PROJECT_KEYS.update({"model": choice_or_hostile(MODELS), "global_batch": number(["64"]),
                     "objective": choice_or_hostile(["memory"]), "headroom": number(["0.2"]),
                     "presets_dir": st.sampled_from([["presets"], "presets"]), "no_such_key": st.just("1")})


@st.composite
def project_file(draw) -> bytes:
    keys = draw(st.lists(st.sampled_from(sorted(PROJECT_KEYS)), max_size=4, unique=True))
    d = {}
    for k in keys:  # the flag's text, or a TOML value of another type
        d[k] = draw(st.one_of(PROJECT_KEYS[k], st.sampled_from(HOSTILE_VALUES)))
    text = toml_text(d)
    return draw(garbled(text)) if draw(st.integers(0, 9)) == 0 else text.encode()


def base_plan() -> dict:
    """A valid plan to mutate (tiny model on 2 CPU ranks), written by zplan itself."""
    from zplan.plan import make_plan
    from zplan.recommend import search
    from zplan.scenario_options import build, cpu_ranks

    sc = build(cpu_ranks(model="tiny", gpus="2", gpus_per_node=2))
    rec = search(sc, 4)
    return json.loads(make_plan(rec.winner.sc, rec.winner.family, 4, rec.winner.result).model_dump_json())


PLAN = None


def special_path(draw, case: Case, stem: str) -> str:
    """A path that is not an ordinary input file, or one that cannot be written."""
    kind = draw(st.sampled_from(["fifo", "dir", "missing", "/dev/zero", "/dev/null", "long",
                                 "under-file", "/proc/zplan-fuzz/x"]))
    if kind == "fifo":
        case.specials[stem] = "fifo"
        return stem
    if kind == "dir":
        case.specials[stem] = "dir"
        return stem
    if kind == "missing":
        return stem + "-missing"
    if kind == "long":
        return "n" * 300 + ".json"
    if kind == "under-file":
        case.files["afile"] = b"x"
        return "afile/" + stem
    return kind


@st.composite
def input_file(draw, case: Case, what: str) -> str:
    """Name (relative to the case folder) of an input file of type `what`, written into the case."""
    global PLAN
    if draw(st.integers(0, 7)) == 0:
        return special_path(draw, case, f"{what}-special")
    if what == "plan":
        PLAN = PLAN or base_plan()
        name, data = "plan.json", draw(json_file(PLAN))
    elif what == "config":
        name, data = draw(st.sampled_from(["config.json", "hf/config.json"])), draw(json_file(HF_LLAMA))
    else:
        name, data = f"{what}.toml", draw(toml_file(what))
    case.files[name] = data
    return "hf" if name == "hf/config.json" and draw(st.booleans()) else name


@st.composite
def cases(draw, commands=("estimate", "recommend", "explain", "export", "launch", "detect")) -> Case:
    cmd = draw(st.sampled_from(commands))
    case = Case(cmd, [cmd])
    argv = case.argv
    if cmd in ("estimate", "recommend", "explain"):
        flags = dict(SCENARIO, **OWN[cmd])
        for flag in draw(st.lists(st.sampled_from(sorted(flags)), max_size=6, unique=True)):
            argv += [flag, draw(flags[flag])]
        argv += draw(st.lists(st.sampled_from(SWITCHES), max_size=2, unique=True))
        model = draw(st.sampled_from(["none", "none", "preset", "toml", "config", "presets-dir"]))
        if model == "preset":
            argv += ["--model", draw(st.sampled_from(MODELS))]
        elif model in ("toml", "config"):
            argv += ["--model", draw(input_file(case, "models" if model == "toml" else "config"))]
        elif model == "presets-dir":
            kind = draw(st.sampled_from(["gpus", "clusters", "models"]))
            if draw(st.integers(0, 5)):
                case.files[f"user/{kind}/mine.toml"] = draw(toml_file(kind))
            else:  # a preset name that is a FIFO or a folder
                case.specials[f"user/{kind}/mine.toml"] = draw(st.sampled_from(["fifo", "dir"]))
            argv += ["--presets", "user", {"gpus": "--gpu", "clusters": "--cluster", "models": "--model"}[kind], "mine"]
        if cmd != "explain" and draw(st.booleans()):
            argv.append("--json")
        if cmd == "estimate" and draw(st.integers(0, 3)) == 0:
            argv += ["--plan", draw(input_file(case, "plan"))]
        if cmd == "recommend" and draw(st.integers(0, 3)) == 0:
            argv += ["--write", draw(st.sampled_from(["out/plan.json", "plan.json"]))
                     if draw(st.booleans()) else special_path(draw, case, "write-target")]
        if cmd == "recommend" and draw(st.integers(0, 2)) == 0:
            case.project = draw(project_file())
    elif cmd == "export":
        argv += ["--plan", draw(input_file(case, "plan")), "--to", draw(OWN["export"]["--to"])]
        if draw(st.booleans()):
            argv += ["--output", "out.json" if draw(st.booleans()) else special_path(draw, case, "export-target")]
        if draw(st.booleans()):
            argv.append("--zeropp")
    elif cmd == "launch":
        argv += ["--dry-run", "--run-dir", "run"]  # never a real torchrun from the fuzzer
        for flag in draw(st.lists(st.sampled_from(sorted(OWN["launch"])), max_size=4, unique=True)):
            argv += [flag, draw(OWN["launch"][flag])]
        if draw(st.integers(0, 2)) == 0:
            argv += ["--plan", draw(input_file(case, "plan"))]
        if draw(st.integers(0, 3)) == 0:
            argv += ["--data", draw(st.sampled_from(["missing.txt", "data.txt"]))]
            case.files["data.txt"] = b"hello world\n"
        if draw(st.integers(0, 3)) == 0:
            argv += ["--slurm", "job.sh" if draw(st.booleans()) else special_path(draw, case, "slurm-target")]
    else:
        argv += draw(st.lists(st.just("--json"), max_size=1))
    if draw(st.integers(0, 9)) == 0:  # an unknown flag, a stray argument, a bare value
        first = 2 if cmd == "launch" else 1  # after launch's --dry-run: "--" would hand it to the script
        argv.insert(draw(st.integers(first, len(argv))), draw(st.sampled_from(["--no-such-flag", "stray", "--", "-x"])))
    return case


def _never_launch(*args, **kwargs):
    raise AssertionError("the fuzzer reached a real torchrun launch")
