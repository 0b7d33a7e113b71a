"""FSDP1's copies around its collectives (unit_ops.fsdp_copies with TrainSpec.fsdp1) against
PyTorch's own FullyShardedDataParallel, run on two gloo ranks, and --fsdp1's checks on the CLI."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.helpers import cli

# Two linears in one FSDP1 unit (one flat parameter of N elements), bf16 compute, gradients
# reduced in fp32 and in bf16; a first step outside the records (lazy init), then one step's
# forward and backward ops recorded on rank 0 with what each reads and writes.
N = 64 * 128 * 2
_FSDP1_RUN = r"""
import json, os, sys
rank, port = int(sys.argv[1]), sys.argv[2]
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port, RANK=str(rank), WORLD_SIZE="2")
import torch, torch.distributed as dist, torch.nn as nn
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP, MixedPrecision, ShardingStrategy
from torch.utils._python_dispatch import TorchDispatchMode

class Ops(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = []
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        def flat(xs):
            return [t for x in xs for t in (x if isinstance(x, (list, tuple)) else [x]) if isinstance(t, torch.Tensor)]
        ins, outs = flat(list(args) + list((kwargs or {}).values())), flat([out])
        self.ops.append((func._schema.name, sum(t.numel() * t.element_size() for t in ins),
                         [(t.numel(), t.numel() * t.element_size()) for t in outs]))
        return out

dist.init_process_group("gloo")
res = {}
for reduce in ("float32", "bfloat16"):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128, bias=False), nn.Linear(128, 64, bias=False))
    f = FSDP(model, device_id=torch.device("cpu"), sharding_strategy=ShardingStrategy.FULL_SHARD,
             mixed_precision=MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=getattr(torch, reduce)),
             use_orig_params=True)
    x = torch.randn(4, 64)
    f(x).float().sum().backward()
    fwd, bwd = Ops(), Ops()
    with fwd:
        loss = f(x).float().sum()
    with bwd:
        loss.backward()
    res[reduce] = {"forward": fwd.ops, "backward": bwd.ops}
if rank == 0:
    print("OPS " + json.dumps(res), flush=True)
dist.barrier()
sys.stdout.flush()
os._exit(0)
"""

# ops that move no bytes (views, allocations) or are the collectives themselves
_NOT_COPIES = ("aten::view", "aten::_unsafe_view", "aten::expand", "aten::t", "aten::slice", "aten::split",
               "aten::split_with_sizes", "aten::detach", "aten::alias", "aten::as_strided", "aten::empty",
               "aten::empty_like", "aten::mm", "aten::ones_like", "aten::sum")


def _fsdp1_ops(tmp_path) -> dict:
    from zplan.netutil import free_port

    script = tmp_path / "fsdp1_run.py"
    script.write_text(_FSDP1_RUN)
    port = str(free_port())
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    procs = [subprocess.Popen([sys.executable, str(script), str(r), port], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=env) for r in range(2)]
    outs = [p.communicate(timeout=240) for p in procs]
    for p, (_, err) in zip(procs, outs):
        assert p.returncode == 0, err[-3000:]
    (line,) = [x for x in outs[0][0].splitlines() if x.startswith("OPS ")]
    return json.loads(line[len("OPS "):])


def _copies(ops: list, numel: int) -> list[int]:
    """Bytes read and written by each op of the trace that makes a tensor of `numel` elements
    and is neither a view, an allocation, a matmul nor a collective (copy_'s destination, an
    argument, is written, not read; an in-place op's is both)."""
    def moved(name: str, nbytes: int, outs: list) -> int:  # copy_: its source read, its destination written
        return nbytes if name == "aten::copy_" else nbytes + sum(b for _, b in outs)
    return sorted(moved(name, nbytes, outs)
                  for name, nbytes, outs in ops
                  if not name.startswith("c10d::") and name not in _NOT_COPIES
                  and any(n == numel for n, _ in outs))


def _zplan_copies(reduce: str):
    """The same unit as zplan prices it: one unit of the two weights on 2 ranks, FSDP1."""
    from zplan import arch, presets
    from zplan.comm import gather_dtype
    from zplan.scenario import Scenario
    from zplan.specs import Hardware, TrainSpec
    from zplan.strategies import effective
    from zplan.unit_ops import fsdp_copies

    unit = arch.Unit("unit", ((128, 64), (64, 128)), 1, 0, N)
    hw = Hardware(gpu=presets.gpu("h100-sxm"), cluster=presets.cluster("dgx-h100"), num_gpus=2)
    sc = Scenario(arch.synthetic(N), hw, TrainSpec(precision={"param": "bf16", "reduce": reduce},
                                                   layout="torch", fsdp1=True), custom_units=(unit,))
    st = effective("zero3", "torch")
    sc = sc.for_strategy(st.fsdp)
    return fsdp_copies(sc, st, unit, 2, gather_dtype(sc, unit))


@pytest.mark.slow  # two processes importing torch.distributed
@pytest.mark.timeout(300)
def test_fsdp1_copies_are_fullyshardeddataparallels_own(tmp_path):
    """PyTorch's FullyShardedDataParallel (torch/distributed/fsdp, gloo ranks) is the oracle.
    Forward: the mixed-precision shard cast (a copy of N/2 elements, 4 + 2 bytes each) and the
    all-gather, nothing of N elements copied out of it (the parameters are views). Backward: of N
    elements, the concatenation of the weights' gradients (SplitWithSizesBackward), their cast to
    the reduce dtype where it differs, and the in-place pre-division before the reduce-scatter.
    zplan's FSDP1 copies (unit_ops.fsdp_copies) are these ops, byte for byte; FSDP2's would
    have a copy-out in each pass and one copy-in of N elements in backward."""
    pytest.importorskip("torch")
    traced = _fsdp1_ops(tmp_path)
    for reduce, name in (("fp32", "float32"), ("bf16", "bfloat16")):
        fwd, bwd = _zplan_copies(reduce)
        assert not any("copy-out" in o.name for o in fwd + bwd)
        assert _copies(traced[name]["forward"], N) == []  # no copy-out
        assert _copies(traced[name]["forward"], N // 2) == [o.bytes for o in fwd]  # the shard's cast
        flat = sorted(o.bytes for o in bwd if o.name.startswith("flat gradient"))
        assert _copies(traced[name]["backward"], N) == flat
        assert len(flat) == (3 if reduce == "fp32" else 2)


@pytest.mark.parametrize("args,expect", [
    (["--fsdp1"], "--layout torch"),  # estimate plans DeepSpeed's layout by default
    (["--fsdp1", "--layout", "zero"], "--layout torch"),
    (["--fsdp1", "--layout", "torch", "--gpu", "h100-sxm", "--float8"], "--no-float8-all-gather"),
])
def test_fsdp1_refused_where_it_cannot_apply(capsys, args, expect):
    r = cli(capsys, "estimate", "--model", "llama-3.1-8b", "--gpus", "16", *args)
    assert r.returncode == 2
    assert expect in r.stderr and "--fsdp1" in r.stderr
    assert "Traceback" not in r.stderr


def test_fsdp1_changes_only_the_copies():
    """--fsdp1 moves the step's time by its copies alone (memory and traffic as FSDP2's), and
    explain lists them; zplan's trainer (FSDP2) and accelerate's FSDP2 config refuse the plan."""
    from zplan.estimate import estimate_one
    from zplan.explain import explain_lines
    from zplan.export import _accelerate_refusal
    from zplan.plan import make_plan, trainer_refusal
    from zplan.scenario_options import ScenarioOptions, build

    base = dict(model="llama-3.1-8b", gpus="16", layout="torch")
    two, one = build(ScenarioOptions(**base)), build(ScenarioOptions(**base, fsdp1=True))
    e2, e1 = estimate_one(two, "zero3"), estimate_one(one, "zero3")
    assert e1.memory.total_bytes == e2.memory.total_bytes
    assert e1.bytes_per_step == e2.bytes_per_step
    assert e1.timing.step_s != e2.timing.step_s
    assert any(x.startswith("FSDP1's copies around") for x in explain_lines(one, "zero3"))
    assert any(x.startswith("FSDP2's copies around") for x in explain_lines(two, "zero3"))
    assert trainer_refusal(make_plan(two, "zero3", 16)) is None
    assert "--fsdp1" in trainer_refusal(make_plan(one, "zero3", 16))
    fits_accelerate = dict(base, reduce_dtype="bf16", embed_head_unit="head-kept")
    assert _accelerate_refusal(make_plan(build(ScenarioOptions(**fits_accelerate)), "zero3", 16)) is None
    assert "--fsdp1" in _accelerate_refusal(make_plan(build(ScenarioOptions(**fits_accelerate, fsdp1=True)), "zero3", 16))
