"""DeepSpeed ZeRO-3's host time per module, on this machine's CPU (a lead, not a model input).

Usage: python benchmarks/deepspeed_host.py [--ranks 2]

A model of 16 blocks (7 linears and 2 norms each, width 256, 8 tokens: its compute negligible)
is stepped with and without `deepspeed.initialize` (ZeRO stage 3, DeepSpeed's defaults, SGD) on
gloo ranks of the CPU accelerator; forward, backward and the optimizer step are timed apart (the
mean of 20 steps after 3), and the time in c10d collectives counted. The difference over the
modules (each block and its 9 leaves, and the root) is what DeepSpeed's hooks cost the host per
module: its coordinator lets the host run at most two fetch events ahead of a GPU
(partitioned_param_coordinator.py, `__max_ongoing_fetch_events`), so where a module's GPU time is
shorter, the host paces the step (docs/accuracy-notes.md 9cr). A CPU-only figure: a GPU host adds
CUDA stream and event calls per fetch, and runs Python at its own speed.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

from zplan.netutil import free_port

_RANK = r"""
import json, os, sys, time
rank, port, world, mode = int(sys.argv[1]), sys.argv[2], int(sys.argv[3]), sys.argv[4]
os.environ.update(DS_ACCELERATOR="cpu", MASTER_ADDR="127.0.0.1", MASTER_PORT=port, RANK=str(rank),
                  WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
import torch, deepspeed
from torch.utils._python_dispatch import TorchDispatchMode
torch.set_num_threads(1)
sys.modules["deepspeed.comm.torch"].build_shm_op = lambda: None  # its inference path, JIT-built
deepspeed.init_distributed(dist_backend="gloo")
H, L = 256, 16

class Block(torch.nn.Module):
    def __init__(s):
        super().__init__()
        s.q, s.k, s.v, s.o, s.w1, s.w3, s.w2 = (torch.nn.Linear(H, H, bias=False) for _ in range(7))
        s.n1, s.n2 = torch.nn.LayerNorm(H), torch.nn.LayerNorm(H)
    def forward(s, x):
        h = s.n1(x)
        x = x + s.o(s.q(h) + s.k(h) + s.v(h))
        h = s.n2(x)
        return x + s.w2(torch.nn.functional.silu(s.w1(h)) * s.w3(h))

class Model(torch.nn.Module):
    def __init__(s):
        super().__init__()
        s.blocks = torch.nn.ModuleList(Block() for _ in range(L))
    def forward(s, x):
        for b in s.blocks:
            x = b(x)
        return x.pow(2).mean()

class Collectives(TorchDispatchMode):
    def __init__(s):
        super().__init__()
        s.seconds, s.calls = 0.0, 0
    def __torch_dispatch__(s, func, types, args=(), kwargs=None):
        if func.namespace != "c10d":
            return func(*args, **(kwargs or {}))
        t = time.perf_counter()
        out = func(*args, **(kwargs or {}))
        s.seconds, s.calls = s.seconds + time.perf_counter() - t, s.calls + 1
        return out

torch.manual_seed(0)
x = torch.randn(1, 8, H)
if mode == "plain":
    model = Model()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    forward, backward = model, lambda loss: loss.backward()
    def update():
        opt.step()
        opt.zero_grad()
else:
    cfg = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3},
           "optimizer": {"type": "SGD", "params": {"lr": 1e-3}}, "zero_allow_untested_optimizer": True}
    engine, *_ = deepspeed.initialize(model=Model(), config=cfg)
    forward, backward, update = engine, engine.backward, engine.step

def step():
    t0 = time.perf_counter()
    loss = forward(x)
    t1 = time.perf_counter()
    backward(loss)
    t2 = time.perf_counter()
    update()
    return t1 - t0, t2 - t1, time.perf_counter() - t2

for _ in range(3):
    step()
n, parts = 20, [0.0, 0.0, 0.0]
for _ in range(n):
    for i, v in enumerate(step()):
        parts[i] += v / n
coll, phases = Collectives(), []  # the collectives' own time, phase by phase (forward, backward, step)
with coll:
    for _ in range(5):
        for fn in (lambda: forward(x), None, update):
            before = coll.seconds
            if fn is None:
                backward(loss)
            else:
                out = fn()
                loss = out if out is not None and not isinstance(out, (list, tuple)) else loss
            phases.append(coll.seconds - before)
per_phase = [sum(phases[i::3]) / 5 * 1e3 for i in range(3)]
if rank == 0:
    print(json.dumps({"forward_ms": parts[0] * 1e3, "backward_ms": parts[1] * 1e3, "step_ms": parts[2] * 1e3,
                      "collective_ms": per_phase, "collective_calls": coll.calls / 5,
                      "modules": 1 + L * 10}))
"""


def run(mode: str, ranks: int) -> dict:
    port = str(free_port())
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    procs = [subprocess.Popen([sys.executable, "-c", _RANK, str(r), port, str(ranks), mode], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in range(ranks)]
    outs = [p.communicate(timeout=600) for p in procs]
    for p, (_, err) in zip(procs, outs):
        if p.returncode:
            raise SystemExit(f"{mode} on {ranks} rank(s) failed: {err.strip()[-1500:]}")
    return json.loads(outs[0][0].strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=2)
    args = ap.parse_args()
    plain, ds = run("plain", args.ranks), run("deepspeed", args.ranks)
    m, coll = ds["modules"], ds["collective_ms"]
    print(f"{args.ranks} gloo rank(s), {m} modules; ms per step: without DeepSpeed / ZeRO-3 (of which gloo's "
          f"collectives, {ds['collective_calls']:.0f} calls a step)")
    for i, k in enumerate(("forward", "backward", "step")):
        print(f"  {k:9s} {plain[k + '_ms']:7.1f} / {ds[k + '_ms']:7.1f} ({coll[i]:.1f})")
    # gloo runs its collectives on the host, synchronously; NCCL's are queued on the GPU: left out
    print("  per module beyond the model's own work, gloo's collectives left out: forward "
          f"{(ds['forward_ms'] - coll[0] - plain['forward_ms']) / m:.2f} ms, backward "
          f"{(ds['backward_ms'] - coll[1] - plain['backward_ms']) / m:.2f} ms")


if __name__ == "__main__":
    main()
