"""The FSDP2 trainer through real torchrun and gloo: training, equality, resume, resharding."""

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]  # torchrun on CPU ranks

SEQ = "64"


def make_plan(run_zplan, path, strategy, gpus, batch, param_dtype="fp32", *extra):
    p = run_zplan("recommend", "--model", "tiny", "--gpu", "cpu", "--cluster", "cpu-local",
                  "--gpus", str(gpus), "--global-batch", str(batch), "--seq-len", SEQ,
                  "--layout", "torch", "--context-gib", "0", "--fragmentation", "0",
                  "--param-dtype", param_dtype, "--strategy", strategy, *extra,
                  "--write", str(path), "--json")
    assert p.returncode == 0, p.stderr
    return json.loads(Path(path).read_text())


def launch(run_zplan, plan, run_dir, steps, *extra, resume=False, save_every=0):
    args = ["launch", "--plan", str(plan), "--run-dir", str(run_dir), "--steps", str(steps),
            "--save-every", str(save_every)]
    if resume:
        args.append("--resume")
    if extra:
        args += ["--", *extra]
    p = run_zplan(*args, timeout=200)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    return json.loads((Path(run_dir) / "run_report.json").read_text()), p


def weights(run_dir, tmp):
    """The run's newest checkpoint as one weights file, consolidated in this process (no
    `zplan consolidate` subprocess importing torch again: the command has its own tests in
    tests/test_checkpoint.py)."""
    from zplan.trainer.checkpoint import newest
    from zplan.trainer.consolidate import consolidate

    out = tmp / f"{Path(run_dir).name}.safetensors"
    consolidate(newest(run_dir), out)
    return load_file(str(out))


def test_launch_without_arguments_trains_and_compares(run_zplan, tmp_path):
    """The built-in trainer on a fresh plan, as a benchmark: --no-save writes no checkpoint, not
    even the one at the end (the others' tests check checkpoints)."""
    p = run_zplan("launch", "--run-dir", str(tmp_path / "r"), "--steps", "6", "--no-save", timeout=200)
    assert p.returncode == 0, p.stderr[-3000:]
    assert not list((tmp_path / "r").glob("*step_*"))
    assert "predicted" in p.stdout and "measured" in p.stdout
    rep = json.loads((tmp_path / "r" / "run_report.json").read_text())
    assert rep["losses"][-1] < rep["losses"][0] - 0.3
    assert rep["measured"]["elements_per_step"] == rep["predicted"]["elements_per_step"]
    assert rep["measured"]["peak_memory_bytes"] > 0
    assert rep["config"]["steps"] == 6 and rep["config"]["clip"] == 1.0  # the run's settings
    assert all(n is not None and n > 0 for n in rep["grad_norms"])  # clipped: a norm each step


def test_zero3_matches_ddp(run_zplan, tmp_path):
    """The same weights after 4 steps, DDP and FSDP2; the FSDP2 model also returns its keys
    and values (--kv-cache, Hugging Face's use_cache), which its loop holds into the next forward
    (--outputs-until-next-forward): memory only, the arithmetic is unchanged."""
    flags = {"ddp": (), "zero3": ("--kv-cache", "--outputs-until-next-forward")}
    for s in ("ddp", "zero3"):
        plan = make_plan(run_zplan, tmp_path / f"{s}.json", s, 2, 8, "fp32", *flags[s])
        assert plan["train"]["kv_cache"] == plan["train"]["outputs_until_next_forward"] == (s == "zero3")
        rep, _ = launch(run_zplan, tmp_path / f"{s}.json", tmp_path / s, 4, save_every=4)
        assert rep["strategy"] == s
        assert rep["measured"]["elements_per_step"] == rep["predicted"]["elements_per_step"]
    a, b = weights(tmp_path / "ddp", tmp_path), weights(tmp_path / "zero3", tmp_path)
    assert a.keys() == b.keys() and len(a) == 39
    worst = max((a[k] - b[k]).abs().max().item() for k in a)
    assert worst < 1e-4, worst  # AdamW amplifies last-bit differences of the reductions
    moved = max((a[k] - weights_init(k, a[k].shape)).abs().max().item() for k in a)
    assert moved > 1e-3  # and training did change the weights


def _traffic_by_unit(run_zplan, tmp_path, units):
    """Per --embed-head-unit value, a 2-rank zero3 run's measured elements per step (asserted
    equal to the prediction) and its micro-batches per step."""
    got = {}
    for unit in units:
        plan = make_plan(run_zplan, tmp_path / f"{unit}.json", "zero3", 2, 4, "fp32",
                         "--embed-head-unit", unit)
        rep, _ = launch(run_zplan, tmp_path / f"{unit}.json", tmp_path / unit, 2)
        assert rep["measured"]["elements_per_step"] == rep["predicted"]["elements_per_step"]
        got[unit] = (rep["measured"]["elements_per_step"], plan["train"]["grad_accum"])
    return got


def test_the_root_reshards_as_the_plan_says(run_zplan, tmp_path):
    """Embeddings, norm and head left to FSDP2's root: `root` reshards it after forward and
    gathers it again for backward; `root-kept` keeps it gathered (the trainer passes
    reshard_after_forward=False to the root). The trainer's measured traffic equals the
    prediction for both, and they differ by the root's elements once per micro-batch: the tiny
    model's 256 x 256 embedding and head and its 256-element norm. `head-root-kept` (FSDP1's
    embedding unit beside the decoder layers) keeps norm + head in the root and reshards the
    embedding's own unit, gathered again for backward: 256 x 256 more than root-kept."""
    got = _traffic_by_unit(run_zplan, tmp_path, ("root", "root-kept", "head-root-kept"))
    (root, accum), (kept, _), (head_kept, _) = got["root"], got["root-kept"], got["head-root-kept"]
    assert root - kept == accum * (256 * 256 * 2 + 256)
    assert head_kept - kept == accum * 256 * 256


def test_the_head_unit_stays_gathered_as_the_plan_says(run_zplan, tmp_path):
    """torchtitan's default since 2025-07 (head-kept): norm + head, a unit of their own, kept
    gathered from forward to backward, so not gathered again: the measured traffic equals the
    prediction and is the head unit's elements (256 x 256 + 256) per micro-batch below
    separate's, whose trainer reshards every unit."""
    got = _traffic_by_unit(run_zplan, tmp_path, ("separate", "head-kept"))
    (sep, accum), (kept, _) = got["separate"], got["head-kept"]
    assert sep - kept == accum * (256 * 256 + 256)


def test_the_last_block_stays_gathered_as_the_plan_says(run_zplan, tmp_path):
    """torchtitan's 2024 policy (--last-block-kept): the trainer keeps the last block's unit
    gathered from its forward to its backward, so it is not gathered again. The measured traffic
    equals the prediction and is one tiny block's elements (q, o 256 x 256; k, v 256 x 128; three
    256 x 688 MLP weights; two 256-element norms) per micro-batch below separate's. That run
    also has the model return fp32 logits (--logits-fp32), which the trainer applies."""
    got = {}
    for name, flags in (("separate", ()), ("kept", ("--last-block-kept", "--logits-fp32"))):
        plan = make_plan(run_zplan, tmp_path / f"{name}.json", "zero3", 2, 4, "bf16", *flags)
        assert plan["train"]["last_block_kept"] == (name == "kept") == plan["train"]["logits_fp32"]
        rep, _ = launch(run_zplan, tmp_path / f"{name}.json", tmp_path / name, 2)
        assert rep["measured"]["elements_per_step"] == rep["predicted"]["elements_per_step"]
        got[name] = (rep["measured"]["elements_per_step"], plan["train"]["grad_accum"])
    (sep, accum), (kept, _) = got["separate"], got["kept"]
    block = 2 * 256 * 256 + 2 * 256 * 128 + 3 * 256 * 688 + 2 * 256
    assert sep - kept == accum * block


def weights_init(name, shape):
    from zplan.trainer.model import full_init
    return full_init(name, shape, 0, 4)


@pytest.mark.timeout(480)  # four launches and two consolidations; about 200 s on 2 busy cores
def test_stop_and_resume_equals_uninterrupted(run_zplan, tmp_path):
    make_plan(run_zplan, tmp_path / "p.json", "zero3", 2, 8)
    launch(run_zplan, tmp_path / "p.json", tmp_path / "straight", 6, "--keep", "1", save_every=4)
    # the end of a run is always saved; --keep 1 left only the newest
    assert sorted(d.name for d in (tmp_path / "straight").glob("step_*")) == ["step_00000006"]
    launch(run_zplan, tmp_path / "p.json", tmp_path / "broken", 6, "--stop-after", "3", save_every=3)
    assert not (tmp_path / "broken" / "step_00000006").exists()
    stale = tmp_path / "broken" / ".tmp-step_00000005"  # what a save killed half-way leaves
    stale.mkdir()
    # the data order is the seed's: resuming with another one is refused, in one line
    p = run_zplan("launch", "--plan", str(tmp_path / "p.json"), "--run-dir", str(tmp_path / "broken"),
                  "--steps", "6", "--save-every", "6", "--resume", "--", "--seed", "7", timeout=200)
    assert p.returncode == 2 and "trained with --seed 0" in p.stderr and "Traceback" not in p.stderr, p.stderr[-2000:]
    rep, _ = launch(run_zplan, tmp_path / "p.json", tmp_path / "broken", 6, resume=True, save_every=6)
    assert rep["start_step"] == 3 and rep["end_step"] == 6
    assert not stale.exists()
    a = weights(tmp_path / "straight", tmp_path)
    b = weights(tmp_path / "broken", tmp_path)
    assert all(torch.equal(a[k], b[k]) for k in a)  # bit for bit
    # resuming a finished run says so and changes nothing; with --steps below the newest
    # checkpoint it names the step it reached, not --steps (it said "finished at step 3"); one
    # launch for both (CI time: --steps 6 takes the same path)
    report = (tmp_path / "broken" / "run_report.json").read_bytes()
    _, p = launch(run_zplan, tmp_path / "p.json", tmp_path / "broken", 3, resume=True, save_every=6)
    assert "already reached step 6 (--steps 3)" in p.stderr
    assert (tmp_path / "broken" / "run_report.json").read_bytes() == report


def test_save_at_4_resume_at_2(run_zplan, tmp_path):
    make_plan(run_zplan, tmp_path / "p4.json", "zero3", 4, 8)
    make_plan(run_zplan, tmp_path / "p2.json", "zero3", 2, 8)
    r4, _ = launch(run_zplan, tmp_path / "p4.json", tmp_path / "run", 3, save_every=3)
    assert r4["world_size"] == 4
    r2, _ = launch(run_zplan, tmp_path / "p2.json", tmp_path / "run", 5, resume=True, save_every=5)
    assert r2["world_size"] == 2 and r2["start_step"] == 3 and r2["end_step"] == 5
    assert r2["losses"][0] < r4["losses"][0]  # it continued from trained weights


def test_plan_world_size_mismatch_is_refused(run_zplan, tmp_path):
    make_plan(run_zplan, tmp_path / "p.json", "zero3", 2, 8)
    p = run_zplan("launch", "--plan", str(tmp_path / "p.json"), "--nproc", "3", "--dry-run")
    assert p.returncode == 2 and "the plan is for 2 ranks" in p.stderr


def test_deterministic_fsdp2_equals_unsharded_adamw(run_zplan, tmp_path):
    """--deterministic: FSDP2 at N = 3 is bit for bit unsharded AdamW on the rank-ordered mean
    gradient (clipping inactive: the clip norm itself is an unordered all-reduce)."""
    import torch.nn.functional as F
    from zplan.plan import load
    from zplan.trainer.data import TokenSource
    from zplan.trainer.model import Transformer, init_weights_

    make_plan(run_zplan, tmp_path / "p.json", "zero3", 3, 6)
    launch(run_zplan, tmp_path / "p.json", tmp_path / "det", 3, "--deterministic", "--clip", "1e9",
           save_every=3)
    got = weights(tmp_path / "det", tmp_path)

    plan = load(tmp_path / "p.json")
    torch.set_num_threads(1)
    model = Transformer(plan.model)
    init_weights_(model, 0)
    params = dict(model.named_parameters())
    opt = torch.optim.AdamW(params.values(), lr=3e-3, betas=(0.9, 0.95), weight_decay=0.1,
                            eps=1e-8, foreach=False)
    data = TokenSource(plan.model.vocab_size, plan.train.seq_len, 0)
    for step in range(3):
        grads = []
        for r in range(3):
            model.zero_grad(set_to_none=True)
            x, y = data.batch(step, 0, r, 3, 6, plan.train.micro_batch)
            logits = model(x)
            F.cross_entropy(logits.float().view(-1, logits.shape[-1]), y.reshape(-1)).backward()
            grads.append({n: p.grad.clone() for n, p in params.items()})
        for n, p in params.items():
            g = grads[0][n].clone()
            g += grads[1][n]
            g += grads[2][n]
            p.grad = g / 3
        opt.step()
    ref = {n: p.detach() for n, p in params.items()}
    assert got.keys() == ref.keys()
    diff = [n for n in ref if not torch.equal(got[n], ref[n])]
    assert not diff, f"{len(diff)} tensors differ, e.g. {diff[0]}"
    # and the guarantee needs the ordered sum: gloo's ring reduce-scatter rounds differently
    launch(run_zplan, tmp_path / "p.json", tmp_path / "ring", 3, "--clip", "1e9", save_every=3)
    ring = weights(tmp_path / "ring", tmp_path)
    assert any(not torch.equal(ring[n], ref[n]) for n in ref)
