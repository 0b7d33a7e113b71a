"""DeepSpeed ZeRO-3's host time per module, on this machine's CPU: the source of zplan's
Assumptions.deepspeed_hook_forward_s and deepspeed_hook_backward_s (specs.DEEPSPEED_HOOK_*).

Usage: python benchmarks/deepspeed_host.py [--ranks 1] [--widths 384 768]

A model of 16 blocks (7 linears and 2 norms each, width 384 and 768, 8 tokens) is
stepped with and without `deepspeed.initialize` (ZeRO stage 3 at DeepSpeed's defaults, SGD) on
gloo ranks of the CPU accelerator; forward, backward and the optimizer step are timed apart (the
mean of 20 steps after 3). Each linear's 147,456 (589,824) elements are over DeepSpeed's default
persistence threshold (1e5), so every linear is partitioned, fetched and released as in a real
model; the norms (384) stay persistent, as a real model's do. The difference over the modules
(each block and its 9 leaves, and the root) is what DeepSpeed's hooks cost the host per module:
its coordinator lets the host run at most three fetch events ahead of a GPU
(partitioned_param_coordinator.py: `__max_ongoing_fetch_events = 2`, then `event.synchronize()`
on the oldest once more are outstanding), so where a module's GPU time is shorter, the host paces
the step (docs/accuracy-notes.md 9cr). On one rank no collective runs (`_no_gather_coalesced`);
on two, gloo's collectives run on the host and their waits, outside PyTorch's dispatcher, stay in
the figure. The backward also copies each gradient into DeepSpeed's buckets and partitions, real
work on a CPU that a GPU runs as kernels (which zplan prices as such): the two widths separate it,
the figure at a parameter of no elements being the hooks' own. A CPU's figure: a GPU host adds
CUDA stream and event calls per fetch and runs Python at its own speed.
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
rank, port, world, mode, H = int(sys.argv[1]), sys.argv[2], int(sys.argv[3]), sys.argv[4], int(sys.argv[5])
os.environ.update(DS_ACCELERATOR="cpu", MASTER_ADDR="127.0.0.1", MASTER_PORT=port, RANK=str(rank),
                  WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
import torch, deepspeed
from torch.utils._python_dispatch import TorchDispatchMode
torch.set_num_threads(1)
sys.modules["deepspeed.comm.torch"].build_shm_op = lambda: None  # its inference path, JIT-built
deepspeed.init_distributed(dist_backend="gloo")
L = 16

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


def run(mode: str, ranks: int, width: int) -> dict:
    port = str(free_port())
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    procs = [subprocess.Popen([sys.executable, "-c", _RANK, str(r), port, str(ranks), mode, str(width)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in range(ranks)]
    outs = [p.communicate(timeout=600) for p in procs]
    for p, (_, err) in zip(procs, outs):
        if p.returncode:
            raise SystemExit(f"{mode} on {ranks} rank(s) failed: {err.strip()[-1500:]}")
    return json.loads(outs[0][0].strip().splitlines()[-1])


def per_module(ranks: int, width: int) -> tuple[float, float]:
    """ms a module beyond the model's own work (forward, backward), gloo's collective calls left out."""
    plain, ds = run("plain", ranks, width), run("deepspeed", ranks, width)
    m, coll = ds["modules"], ds["collective_ms"]
    print(f"{ranks} gloo rank(s), width {width}, {m} modules; ms per step: without DeepSpeed / ZeRO-3 (of which "
          f"gloo's collectives, {ds['collective_calls']:.0f} calls a step)")
    for i, k in enumerate(("forward", "backward", "step")):
        print(f"  {k:9s} {plain[k + '_ms']:7.1f} / {ds[k + '_ms']:7.1f} ({coll[i]:.1f})")
    # gloo runs its collectives on the host; NCCL's are queued on the GPU: their calls left out
    # (the waits on gloo's threads, outside the dispatcher, are not: on one rank there are none)
    f = (ds["forward_ms"] - coll[0] - plain["forward_ms"]) / m
    b = (ds["backward_ms"] - coll[1] - plain["backward_ms"]) / m
    print(f"  per module beyond the model's own work: forward {f:.2f} ms, backward {b:.2f} ms")
    return f, b


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=1)
    ap.add_argument("--widths", type=int, nargs=2, default=(384, 768),
                    help="two hidden widths (over 316 every linear is partitioned)")
    args = ap.parse_args()
    (w0, w1), points = args.widths, [per_module(args.ranks, w) for w in args.widths]
    # the hooks' own time is per module; what grows with a parameter's elements (the gradient's
    # copy into DeepSpeed's bucket, its partition) is real work on a CPU that a GPU runs as
    # kernels, priced as such: extrapolated to a parameter of no elements, linear in them
    e0, e1 = w0 * w0, w1 * w1
    line = [p0 - (p1 - p0) / (e1 - e0) * e0 for p0, p1 in zip(*points)]
    print(f"per module at no elements (two widths, linear in a linear's {e0:,} and {e1:,} elements): "
          f"forward {line[0]:.2f} ms, backward {line[1]:.2f} ms")


if __name__ == "__main__":
    main()
