"""Builders for scenarios in tests, through the same path as the CLI."""

from zplan.scenario_options import ScenarioOptions, build
from zplan.estimate import estimate_one


def scenario(**kw):
    return build(ScenarioOptions(**kw))


def est(name: str, **kw):
    return estimate_one(scenario(**kw), name)


def cli(capsys, *args: str):
    """zplan's CLI in this process, through the same error boundary as the console script."""
    from types import SimpleNamespace

    from zplan.cli.main import run

    capsys.readouterr()
    rc = run(list(args))
    out = capsys.readouterr()
    return SimpleNamespace(returncode=rc, stdout=out.out, stderr=out.err)


def gemma_head_dim_256_config(tmp_path) -> str:
    """A Hugging Face config.json of a Gemma shape whose head dim is 256 (its config class's
    default head_dim), 16 query heads of 16 key/value heads: the path, as a string."""
    import json

    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps({"model_type": "gemma", "hidden_size": 3072, "intermediate_size": 24576,
                               "num_hidden_layers": 28, "num_attention_heads": 16,
                               "num_key_value_heads": 16, "vocab_size": 256000}))
    return str(cfg)


def fake_attention_rates(monkeypatch, calibrate, flag: str, other: tuple, flash: tuple) -> list:
    """calibrate.attention_rates replaced: `other` (forward, backward FLOP/s) when called with
    `flag` true (cudnn=True, masked=True), `flash` otherwise; returns the list of flags seen."""
    calls = []

    def rates(device, **kw):
        calls.append(kw.get(flag, False))
        return other if kw.get(flag, False) else flash

    monkeypatch.setattr(calibrate, "attention_rates", rates)
    return calls


def replace_linears(module, make) -> None:
    """Every nn.Linear under `module` replaced by make(linear) (a stand-in with its weight)."""
    import torch

    for parent in list(module.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, torch.nn.Linear):
                setattr(parent, name, make(child))


def function_linear(fn):
    """A module class standing in for nn.Linear: built from a Linear, it keeps that weight and
    runs the autograd.Function `fn` (fn.apply(x, weight))."""
    import torch

    class Linear(torch.nn.Module):
        def __init__(self, lin):
            super().__init__()
            self.weight = lin.weight

        def forward(self, x):
            return fn.apply(x, self.weight)

    return Linear


def saved_storages(module):
    """(saved, pack): a saved_tensors_hooks pack function that records, in `saved`, the bytes of
    each storage autograd saves, the module's weights apart (storage pointer -> bytes)."""
    weights = {p.untyped_storage().data_ptr() for p in module.parameters()}
    saved: dict[int, int] = {}

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in weights:
            saved[ptr] = t.untyped_storage().nbytes()
        return t
    return saved, pack


def cpu_scaled_mm_takes_row_scales() -> bool:
    """Whether this torch's CPU `torch._scaled_mm` takes per-row scales (torchao's rowwise float8
    recipes): torch 2.13's does; 2.11's asserts per-tensor scales on the CPU backend
    (aten/src/ATen/native/Blas.cpp), which CUDA does not."""
    import torch

    a = torch.ones(16, 16).to(torch.float8_e4m3fn)
    b = torch.ones(16, 16).to(torch.float8_e4m3fn).t()
    try:
        torch._scaled_mm(a, b, scale_a=torch.ones(16, 1), scale_b=torch.ones(1, 16),
                         out_dtype=torch.bfloat16)
    except RuntimeError:
        return False
    return True


# the end of every torchrun probe script: the group torn down, then the rank leaves at once
# (gloo cannot abort a rank in interpreter teardown: pytorch/pytorch#179291)
PROBE_END = '''
dist.barrier()
dist.destroy_process_group()
from zplan.trainer.rank_errors import leave
leave(0)
'''


def torchrun_probe(tmp_path, body: str, *args: str, nproc: int = 2, timeout: float = 110, env: dict | None = None):
    """Run `body` (which sets up its process group as `dist`) and PROBE_END as a script on
    `nproc` ranks of a standalone torchrun; the finished process, asserted to have exited 0."""
    import os
    import subprocess
    import sys

    import signal

    script = tmp_path / "probe.py"
    script.write_text(body + PROBE_END)
    # a session of its own: on a timeout the ranks go with torchrun, not on running to their
    # collective timeout beside the next tests
    p = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                          str(nproc), str(script), *map(str, args)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True, env={**os.environ, **(env or {})}, start_new_session=True)
    try:
        out, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        p.communicate()
        raise
    done = subprocess.CompletedProcess(p.args, p.returncode, out, err)
    assert done.returncode == 0, err[-3000:]
    return done


def storage_log(step) -> list[tuple[str, int, int]]:
    """Every storage PyTorch's MemTracker sees made and freed while `step()` runs, in order:
    (ADD or DEL, the storage's key, its bytes)."""
    from torch.distributed._tools.mem_tracker import MemTracker

    log: list[tuple[str, int, int]] = []

    class Recorder(MemTracker):
        def _update_snap(self, u_type, winfo, old_mem_consumed=None, old_reftype=None):
            log.append((u_type.name, id(winfo), winfo.mem_consumed))
            return super()._update_snap(u_type, winfo, old_mem_consumed, old_reftype)

    with Recorder():
        step()
    return log
