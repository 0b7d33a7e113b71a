"""Checkpoints as untrusted files: real DCP checkpoints written by zplan's own save, then
damaged or crafted. One in-process gloo group of size 1 (no torchrun), so these run in the
fast loop."""

import os
import pickle
import sys

import pytest
import torch
import torch.distributed as dist

from zplan.errors import UsageError
from tests.helpers import cli, torchrun_probe
from zplan.trainer import checkpoint as ckpt
from zplan.trainer.ckpt_files import CheckpointError, read_metadata


@pytest.fixture(scope="module", autouse=True)
def one_rank_group():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _model(seed: int):
    torch.manual_seed(seed)
    m = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4))
    opt = torch.optim.AdamW(m.parameters(), lr=0.1)
    m(torch.randn(3, 8)).sum().backward()
    opt.step()
    return m, opt


def _save(root, step, seed, model_name="tiny", keep=0, model_params=None):
    m, opt = _model(seed)
    meta = {"world_size": 1, "strategy": "zero3", "model": model_name}
    if model_params is not None:
        meta["model_params"] = model_params
    ckpt.save(root, step, m, opt, {"step": step, "data_seed": 0}, meta, keep=keep)
    return m


def _resume(root, model_name="tiny", model_params=None):
    m, opt = _model(99)
    state = ckpt.resume_newest(root, m, opt, 1, model_name=model_name, model_params=model_params)
    return state, m


class Evil:
    """A pickle that writes a marker file when loaded with pickle.load."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (exec, (f"open({self.marker!r}, 'w').write('ran')",))


def _craft(folder, marker, nested: bool):
    md = read_metadata(folder)
    if nested:  # a real Metadata with one field replaced
        md.planner_data = {"x": Evil(marker)}
        payload = pickle.dumps(md)
    else:
        payload = pickle.dumps(Evil(marker))
    (folder / ".metadata").write_bytes(payload)


def test_roundtrip_and_metadata_reader(tmp_path):
    saved = _save(tmp_path, 2, seed=1)
    md = read_metadata(tmp_path / "step_00000002")
    assert "model.0.weight" in md.state_dict_metadata
    state, m = _resume(tmp_path)
    assert state["step"] == 2
    assert all(torch.equal(a, b) for a, b in zip(saved.state_dict().values(), m.state_dict().values()))


@pytest.mark.parametrize("nested", [False, True])
def test_crafted_metadata_runs_nothing(tmp_path, capsys, nested):
    _save(tmp_path, 2, seed=1)
    folder = tmp_path / "step_00000002"
    marker = tmp_path / "marker"
    _craft(folder, marker, nested)
    with open(folder / ".metadata", "rb") as f:  # the oracle: plain pickle would run it
        try:
            pickle.load(f)
        except Exception:
            pass
    assert marker.exists()
    marker.unlink()
    with pytest.raises(CheckpointError, match="refused checkpoint metadata"):
        read_metadata(folder)
    p = cli(capsys, "consolidate", str(folder), str(tmp_path / "out.safetensors"))
    assert p.returncode == 2 and not marker.exists()
    assert len(p.stderr.strip().splitlines()) == 1 and "nothing from it was run" in p.stderr
    assert "Traceback" not in p.stderr
    with pytest.raises(CheckpointError):  # resume: skipped with a warning, then refused
        _resume(tmp_path)
    assert not marker.exists()



def test_crafted_non_tensor_item_in_a_shard_runs_nothing(tmp_path, capsys):
    """DCP stores non-tensor values (the step, the optimizer's hyper-parameters) as pickles in
    the shard files, and its default load planner reads them with torch.load(weights_only=False):
    a shard whose `extra.step` bytes are a crafted pickle ran code at resume. Here the metadata
    (itself well-formed) points `extra.step` at such a pickle appended to the shard."""
    import dataclasses

    _save(tmp_path, 2, seed=1)
    folder = tmp_path / "step_00000002"
    marker = tmp_path / "marker"
    md = read_metadata(folder)
    index = next(i for i in md.storage_data if i.fqn == "extra.step")
    info = md.storage_data[index]
    shard = folder / info.relative_path
    payload = pickle.dumps(Evil(marker))
    md.storage_data[index] = dataclasses.replace(info, offset=shard.stat().st_size, length=len(payload))
    with open(shard, "ab") as f:
        f.write(payload)
    (folder / ".metadata").write_bytes(pickle.dumps(md))
    assert read_metadata(folder).storage_data[index].length == len(payload)  # still well-formed
    with pytest.raises(CheckpointError, match="none of the 1 checkpoints"):
        _resume(tmp_path)
    assert not marker.exists()
    err = capsys.readouterr().err
    assert "CheckpointError: refused the value of extra.step in a checkpoint shard" in err
    assert "FrameSummary" not in err  # DCP's (exception, traceback) pair, unwrapped


def test_crafted_zero1_optimizer_file_is_refused(tmp_path):
    _save(tmp_path, 1, seed=1)
    folder = tmp_path / "step_00000001"
    marker = tmp_path / "marker"
    torch.save(Evil(marker), folder / "zero1_optim_rank0.pt")
    m, opt = _model(5)
    from torch.distributed.optim import ZeroRedundancyOptimizer
    zopt = ZeroRedundancyOptimizer(m.parameters(), optimizer_class=torch.optim.AdamW, lr=0.1)
    ckpt_meta = folder / ckpt.MANIFEST
    ckpt_meta.write_text('{"step": 1, "world_size": 1, "strategy": "zero1", "model": "tiny"}')
    with pytest.raises(CheckpointError, match="refused"):
        ckpt.load(folder, m, zopt, 1, zero1=True, model_name="tiny")
    assert not marker.exists()



def test_zero1_shard_saved_on_a_gpu_loads_on_any_device(tmp_path):
    """A zero1 optimizer shard saved by rank 7 of an 8-GPU node records cuda:7 in the file;
    resumed at the same world size on nodes of 4 GPUs, rank 7 has no cuda:7. The shard is read
    onto the host and load_state_dict moves it to the parameters' device. Reproduced here by
    tagging the saved storages cuda:7, which this machine lacks too."""
    from torch.distributed.optim import ZeroRedundancyOptimizer

    m, _ = _model(3)
    zopt = ZeroRedundancyOptimizer(m.parameters(), optimizer_class=torch.optim.AdamW, lr=0.1)
    zopt.step()
    want = {k: v["exp_avg"].clone() for k, v in zopt.optim.state_dict()["state"].items()}
    shard = tmp_path / "zero1_optim_rank0.pt"
    registry = list(torch.serialization._package_registry)
    torch.serialization.register_package(1, lambda obj: "cuda:7", lambda obj, location: None)
    try:
        torch.save(zopt.optim.state_dict(), shard)
    finally:
        torch.serialization._package_registry[:] = registry
    with pytest.raises(RuntimeError, match="(?i)cuda"):  # what a plain torch.load does with it
        torch.load(shard, weights_only=True)
    got = ckpt.load_zero1_shard(shard)["state"]
    assert set(got) == set(want) and all(torch.equal(got[k]["exp_avg"], want[k]) for k in want)
    assert all(v["exp_avg"].device.type == "cpu" for v in got.values())


def test_empty_metadata_is_one_line_not_aborted(tmp_path, capsys):
    _save(tmp_path, 2, seed=1)
    (tmp_path / "step_00000002" / ".metadata").write_bytes(b"")
    p = cli(capsys, "consolidate", str(tmp_path / "step_00000002"), str(tmp_path / "o.safetensors"))
    assert p.returncode == 2, p.stderr
    assert "aborted" not in p.stderr and len(p.stderr.strip().splitlines()) == 1


def test_truncated_newest_falls_back_with_one_warning(tmp_path, capsys):
    old = _save(tmp_path, 2, seed=1)
    _save(tmp_path, 4, seed=2)
    shard = next((tmp_path / "step_00000004").glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:100])
    state, m = _resume(tmp_path)
    assert state["step"] == 2
    assert all(torch.equal(a, b) for a, b in zip(old.state_dict().values(), m.state_dict().values()))
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "step_00000004 is incomplete" in err[0] and "shorter" in err[0]
    p = cli(capsys, "consolidate", str(tmp_path), str(tmp_path / "w.safetensors"))
    assert p.returncode == 0, p.stderr
    assert "step_00000004 is incomplete" in p.stderr and "from " + str(tmp_path / "step_00000002") in p.stderr
    p = cli(capsys, "consolidate", str(tmp_path / "step_00000004"), str(tmp_path / "x.safetensors"))
    assert p.returncode == 2 and "is incomplete" in p.stderr and len(p.stderr.strip().splitlines()) == 1


def test_damaged_shard_same_size_falls_back(tmp_path, capsys):
    """A shard of the right length but garbage inside: DCP's own load fails (a BaseException),
    the previous checkpoint is used."""
    _save(tmp_path, 2, seed=1)
    _save(tmp_path, 4, seed=2)
    shard = next((tmp_path / "step_00000004").glob("*.distcp"))
    shard.write_bytes(b"\x00" * shard.stat().st_size)
    state, _ = _resume(tmp_path)
    assert state["step"] == 2
    assert "step_00000004 cannot be loaded" in capsys.readouterr().err


def test_a_shard_torch_refuses_falls_back_without_torchs_advice(tmp_path, capsys):
    """A shard whose pickle torch.load(weights_only=True) refuses falls back to the previous
    checkpoint; the warning no longer passes on torch's "Re-running torch.load with
    weights_only set to False will likely succeed" for a file zplan refused as possibly crafted."""
    _save(tmp_path, 2, seed=1)
    _save(tmp_path, 4, seed=2)
    shard = next((tmp_path / "step_00000004").glob("*.distcp"))
    data = bytearray(shard.read_bytes())
    data[:8] = b"\x80\x02garbge"  # a pickle header that is not the tensor file torch.load expects
    shard.write_bytes(bytes(data))
    state, _ = _resume(tmp_path)
    err = capsys.readouterr().err
    assert state["step"] == 2 and "step_00000004 cannot be loaded" in err, err
    assert "weights_only set to False" not in err and "arbitrary code" not in err, err


def test_the_same_name_with_another_architecture_is_an_error_not_damage(tmp_path):
    """A checkpoint of a model of the same name but another architecture failed DCP's size check
    at every checkpoint, read as damage ("none ... can be loaded: move them away"): the manifest
    now records the parameter count, and another count is a one-line error naming both."""
    _save(tmp_path, 2, seed=1, model_params=1000)
    with pytest.raises(UsageError, match="with 1,000 parameters but the model resumed has 2,000") as e:
        _resume(tmp_path, model_params=2000)
    assert not isinstance(e.value, CheckpointError)  # an error, not a fallback
    assert _resume(tmp_path, model_params=1000)[0]["step"] == 2


def test_keep_prunes_and_stale_tmp_is_cleaned(tmp_path):
    for step in (1, 2, 3, 4):
        _save(tmp_path, step, seed=step, keep=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_00000003", "step_00000004"]
    (tmp_path / ".tmp-step_00000005").mkdir()
    (tmp_path / ".tmp-step_00000005" / "__0_0.distcp").write_bytes(b"x")
    assert [p.name for p in ckpt.clean_stale(tmp_path)] == [".tmp-step_00000005"]
    assert not (tmp_path / ".tmp-step_00000005").exists()


def test_other_model_is_an_error_not_a_fallback(tmp_path):
    _save(tmp_path, 2, seed=1, model_name="llama-7b")
    with pytest.raises(UsageError, match="is of model 'llama-7b' but the plan trains 'tiny'"):
        _resume(tmp_path)


def test_nothing_loadable_is_an_error(tmp_path):
    _save(tmp_path, 2, seed=1)
    (tmp_path / "step_00000002" / "zplan.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="none of the 1 checkpoints"):
        _resume(tmp_path)
    assert _resume(tmp_path / "empty")[0] is None
    # the only checkpoint's metadata damaged: the error says why (the run-half QA pass found it
    # silent there, and the fallback's reason read "it unpickling stack underflow")
    _save(tmp_path / "m", 2, seed=1)
    (tmp_path / "m" / "step_00000002" / ".metadata").write_bytes(b"0")
    with pytest.raises(CheckpointError, match=r"none of the 1 checkpoints .* \(step_00000002: refused checkpoint "
                                               r"metadata .*not a checkpoint's pickle"):
        _resume(tmp_path / "m")


def test_consolidate_output_that_cannot_be_written_is_one_line(tmp_path, capsys):
    _save(tmp_path, 2, seed=1)
    (tmp_path / "out.safetensors").mkdir()
    for out in (tmp_path / "out.safetensors", "/proc/zplan.safetensors", tmp_path / "no" / "such" / "o.pt"):
        p = cli(capsys, "consolidate", str(tmp_path), str(out))
        assert p.returncode == 2, (out, p.stderr)
        assert len(p.stderr.strip().splitlines()) == 1 and "internal error" not in p.stderr, p.stderr


def test_consolidate_never_writes_into_a_checkpoint(tmp_path, capsys):
    """An output inside a checkpoint folder replaced its files: `consolidate RUN
    RUN/step_N/zero1_optim_rank0.pt` overwrote the optimizer shard, exited 0, and the next --resume
    found no checkpoint it could load (a QA pass). Refused; the shard's bytes are unchanged."""
    _save(tmp_path, 2, seed=1)
    folder = tmp_path / "step_00000002"
    target = folder / "zero1_optim_rank0.pt"
    target.write_bytes(b"the rank's optimizer shard")
    for out in (target, folder / "model.safetensors", folder / "sub" / "model.pt"):
        p = cli(capsys, "consolidate", str(tmp_path), str(out))
        assert p.returncode == 2 and "inside checkpoint" in p.stderr and str(folder) in p.stderr, p.stderr
    assert target.read_bytes() == b"the rank's optimizer shard" and not (folder / "model.safetensors").exists()
    p = cli(capsys, "consolidate", str(tmp_path), str(tmp_path / "model.safetensors"))  # beside it: fine
    assert p.returncode == 0, p.stderr
    # a folder merely holding those names is no checkpoint: a plan saved as zplan.json, an Eclipse
    # workspace's .metadata/ (a review: every output under them was refused)
    project = tmp_path / "project"
    (project / ".metadata").mkdir(parents=True)
    (project / "zplan.json").write_text('{"schema_version": 1, "strategy": "zero3"}')
    (project / "out").mkdir()
    p = cli(capsys, "consolidate", str(tmp_path), str(project / "out" / "model.safetensors"))
    assert p.returncode == 0 and (project / "out" / "model.safetensors").is_file(), p.stderr


def test_consolidate_of_a_step_folder_without_its_metadata_says_so(tmp_path, capsys):
    """A step folder that lost .metadata (an interrupted save) was answered "no complete
    checkpoint in X; pass a step_N folder", which is what the user had passed."""
    _save(tmp_path, 2, seed=1)
    folder = tmp_path / "step_00000002"
    (folder / ".metadata").unlink()
    p = cli(capsys, "consolidate", str(folder), str(tmp_path / "o.safetensors"))
    assert p.returncode == 2 and "has no .metadata file" in p.stderr and "pass a step_N folder" not in p.stderr


SAVE_UNDER_A_FILE_SIZE_LIMIT = """
import resource, signal, sys, types
import torch, torch.distributed as dist
from zplan.errors import PlanError
from zplan.trainer import checkpoint as ckpt
dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
m = torch.nn.Linear(128, 128)
opt = torch.optim.AdamW(m.parameters())
m(torch.randn(2, 128)).sum().backward()
opt.step()
zero1 = sys.argv[2] == "zero1"
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG instead
resource.setrlimit(resource.RLIMIT_FSIZE, (int(sys.argv[3]), resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
try:
    ckpt.save(sys.argv[1], 3, m, types.SimpleNamespace(optim=opt) if zero1 else opt, {"step": 3, "data_seed": 0},
              {"world_size": 1, "strategy": sys.argv[2], "model": "tiny"}, zero1=zero1)
except PlanError as e:
    print("PlanError:", e)
"""


@pytest.mark.slow  # over a second each: the fast loop leaves it to CI
@pytest.mark.parametrize("strategy, limit", [("zero3", 4096), ("zero1", 100_000)])
def test_a_save_the_filesystem_refuses_is_named_as_a_save(tmp_path, strategy, limit):
    """A checkpoint write the OS refuses (here the file-size limit, RLIMIT_FSIZE, as a full disk's
    ENOSPC) is one line naming the folder being written and the free space; it read "checkpoint
    cannot be loaded (RuntimeError: [enforce fail at inline_container.cc ..." (a QA pass on a 60 MB
    tmpfs). zero1: DCP's 64 KiB weight file fits under the limit and the 128 KiB optimizer shard
    torch.save writes beside it does not (a review: that write was outside the guard). The
    filesystem is the oracle."""
    import subprocess

    p = subprocess.run([sys.executable, "-c", SAVE_UNDER_A_FILE_SIZE_LIMIT, str(tmp_path), strategy, str(limit)],
                       capture_output=True, text=True, timeout=120)
    line = p.stdout.strip()
    assert line.startswith("PlanError:"), (p.stdout, p.stderr[-2000:])
    assert ".tmp-step_00000003" in line and "GB free there" in line and "free space" in line, line
    assert ("errno 27" in line) or ("a short write" in line), line
    assert "\n" not in line and "load" not in line
    assert not (tmp_path / "step_00000003").exists()  # nothing half-written was published


def test_a_save_that_fails_for_another_reason_passes_through_as_it_was(tmp_path):
    """Only the filesystem's refusals are a save's own line: a peer lost inside DCP's collectives
    stays what it was, an echo of another rank's failure for rank_errors to rank below it (a
    review: every failure read "could not be written ... free space")."""
    from zplan.errors import PlanError
    from zplan.trainer.rank_errors import classify

    peer = RuntimeError("[gloo/transport/tcp/pair.cc:534] Connection closed by peer [10.0.0.2]:29500")
    with pytest.raises(RuntimeError) as got:
        with ckpt._writes(tmp_path / ".tmp-step_00000001"):
            raise peer
    assert got.value is peer and classify(got.value)[2] is True
    with pytest.raises(PlanError, match="pass another --run-dir$"):  # read-only: no room to free
        with ckpt._writes(tmp_path / ".tmp-step_00000001"):
            raise OSError(30, "Read-only file system")


def test_resume_keeps_the_runs_kernels_and_lr_not_the_checkpoints(tmp_path):
    """Optimizer.load_state_dict puts the saved param groups back, fused flag and lr included: a
    fused checkpoint resumed by a run planned for the single-tensor kernel (--deterministic) would
    step fused. The run's own flags and --lr stay; the step counter goes to the host, where the
    single-tensor kernel reads it (a device counter would be read with .item() per parameter)."""
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4))
    fused = torch.optim.AdamW(m.parameters(), lr=0.1, fused=True)
    m(torch.randn(3, 8)).sum().backward()
    fused.step()
    ckpt.save(tmp_path, 1, m, fused, {"step": 1, "data_seed": 0},
              {"world_size": 1, "strategy": "zero3", "model": "tiny"})
    single = torch.optim.AdamW(m.parameters(), lr=0.02, foreach=False)
    state = ckpt.resume_newest(tmp_path, m, single, 1, model_name="tiny")
    assert state["step"] == 1
    g = single.param_groups[0]
    assert (g["fused"], g["foreach"], g["lr"]) == (None, False, 0.02)
    assert all(int(s["step"]) == 1 for s in single.state.values())  # the state itself is the checkpoint's
    assert {s["step"].device.type for s in single.state.values()} == {"cpu"}


@pytest.mark.parametrize("damage", ["empty", "another optimizer's"])
def test_zero1_checkpoint_with_a_bad_optimizer_file_falls_back(tmp_path, damage):
    """A zero1 checkpoint is DCP's files plus one optimizer file per rank: one that is empty or
    missing (a crash before it reached the disk), or that reads but does not fit this rank's
    optimizer, is refused where it is loaded, and resume falls back past the checkpoint (on every
    rank: the ranks agree first, the two-rank test below)."""
    from torch.distributed.optim import ZeroRedundancyOptimizer

    m, _ = _model(4)
    zopt = ZeroRedundancyOptimizer(m.parameters(), optimizer_class=torch.optim.AdamW, lr=0.1)
    zopt.step()
    meta = {"world_size": 1, "strategy": "zero1", "model": "tiny"}
    for step in (1, 2):
        ckpt.save(tmp_path, step, m, zopt, {"step": step, "data_seed": 0}, meta, zero1=True)
    bad = tmp_path / "step_00000002" / "zero1_optim_rank0.pt"
    if damage == "empty":
        bad.write_bytes(b"")
    else:  # a valid optimizer state of no parameter groups: load_state_dict raises ValueError
        torch.save({"state": {}, "param_groups": []}, bad)
    state = ckpt.resume_newest(tmp_path, m, zopt, 1, zero1=True, model_name="tiny")
    assert state["step"] == 1


ZERO1_PROBE = r'''
import os, sys, torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.distributed.optim import ZeroRedundancyOptimizer
from zplan.trainer import checkpoint as ck
import datetime
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))  # a mismatch fails, not hangs
r = dist.get_rank()
torch.manual_seed(0)
m = DDP(torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 4)))
opt = ZeroRedundancyOptimizer(m.parameters(), optimizer_class=torch.optim.AdamW, lr=1e-3)
d = sys.argv[1]
meta = {"world_size": 2, "strategy": "zero1", "model": "x"}
for step in (1, 2):
    m(torch.randn(2, 8)).sum().backward(); opt.step(); opt.zero_grad()
    ck.save(d, step, m, opt, {"step": step, "data_seed": 0}, meta, zero1=True)
if r == 1:  # rank 1's optimizer file of step 2 cut short: it loads on rank 0, not on rank 1
    f = f"{d}/step_00000002/zero1_optim_rank1.pt"
    open(f, "r+b").truncate(os.path.getsize(f) // 2)
dist.barrier()
st = ck.resume_newest(d, m, opt, 2, zero1=True, model_name="x")
steps = [None, None]
dist.all_gather_object(steps, st["step"])
if r == 0:
    print("RESUMED", steps, flush=True)
'''


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_zero1_ranks_fall_back_together_when_one_cannot_read_its_file(tmp_path):
    """Two torchrun ranks: rank 1's zero1 optimizer file of the newest checkpoint is damaged and
    rank 0's is not. Every rank must resume from the same checkpoint (the previous one): a rank
    alone falling back would issue DCP's collectives while the others train (a hang until the
    collective timeout on NCCL)."""
    p = torchrun_probe(tmp_path, ZERO1_PROBE, tmp_path / "ckpt", timeout=140)
    assert "RESUMED [1, 1]" in p.stdout, p.stdout[-2000:]
