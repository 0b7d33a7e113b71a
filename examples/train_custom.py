"""Your own model and loop, run under a zplan plan: `zplan launch examples/train_custom.py [STEPS]`.

The plan (strategy, mesh, precision, micro-batch, accumulation) comes from zplan; the model,
data and loss are yours. Here: a small MLP language model over zplan's synthetic tokens. Signalled
(Ctrl-C, or SIGTERM/SIGUSR1 from a scheduler) it stops after a step with a checkpoint, and the
launch the launcher's last line names (`--run-dir RUN --plan RUN/plan.json`) continues from it.
"""

import sys

import torch
import torch.nn.functional as F
from torch import nn

from zplan.trainer import api
from zplan.trainer.data import TokenSource

VOCAB, WIDTH, DEPTH, SEQ = 256, 128, 4, 64
STEPS = int(sys.argv[1]) if len(sys.argv) > 1 else 8  # `zplan launch examples/train_custom.py 100`


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(WIDTH)
        self.up = nn.Linear(WIDTH, 4 * WIDTH)
        self.down = nn.Linear(4 * WIDTH, WIDTH)

    def forward(self, x):
        return x + self.down(F.gelu(self.up(self.norm(x))))


class TinyLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.blocks = nn.ModuleList(Block() for _ in range(DEPTH))
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, tokens):
        h = self.embed(tokens)
        for b in self.blocks:
            h = b(h)
        return self.head(h)


def main():
    ctx = api.init()
    torch.manual_seed(0)
    with torch.device("meta"):
        model = TinyLM()
    model = ctx.apply(model, units=[model.embed, *model.blocks, model.head])
    opt = ctx.optimizer(model, lr=3e-3)
    data = TokenSource(VOCAB, SEQ, seed=0)
    start = ctx.resume(model, opt)
    per_rank = ctx.micro_batch * ctx.grad_accum
    done = start
    for step in range(start, STEPS):
        total = 0.0
        for micro in range(ctx.grad_accum):
            x, y = data.batch(step, micro, ctx.rank, ctx.world, per_rank * ctx.world, ctx.micro_batch)
            with ctx.accumulate(model, last=micro == ctx.grad_accum - 1):
                loss = F.cross_entropy(model(x.to(ctx.device)).float().flatten(0, 1),
                                       y.to(ctx.device).flatten()) / ctx.grad_accum
            loss.backward()
            total += loss.item()
        opt.step()
        opt.zero_grad()
        if ctx.rank == 0:
            print(f"step {step + 1}: loss {total:.4f}", flush=True)
        done = step + 1
        stop = ctx.stop_requested()  # SIGTERM, SIGUSR1, Ctrl-C to any rank: all stop after this step
        if stop:
            if ctx.rank == 0:
                print(f"stopped by {stop.name} after step {done}, with a checkpoint", flush=True)
            break
    ctx.save(model, opt, done)
    full = ctx.full_state_dict(model)
    if ctx.rank == 0:
        print(f"full weights on rank 0: {sum(t.numel() for t in full.values()):,} parameters")
    ctx.close(leave=True)  # the last line: ends the process (no teardown abort in gloo)


if __name__ == "__main__":
    main()
