"""Training data in a deterministic, resumable order.

Sample i of the run is a pure function of (seed, i): the batch of step t on rank r is samples
t·G + r·(G/N) ... for a global batch of G sequences, so any step can be regenerated after a
restart, at any world size, without replaying the ones before it.

- synthetic: a fixed random Markov chain over the vocabulary (next token = perm[token] with
  probability 0.9, else uniform), learnable in a few dozen steps, so the loss falls visibly.
- text file: byte-level tokens (vocabulary 256) from a local file, windows at seeded offsets.
"""

from __future__ import annotations

from pathlib import Path

import torch

FOLLOW = 0.9


class TokenSource:
    def __init__(self, vocab: int, seq_len: int, seed: int = 0, text: str | None = None):
        self.vocab, self.seq_len, self.seed = vocab, seq_len, seed
        self.data = None
        if text is not None:
            raw = Path(text).read_bytes()
            if vocab < 256:
                raise ValueError(f"a text file needs a vocabulary of 256 bytes; the model has {vocab}")
            if len(raw) <= seq_len + 1:
                raise ValueError(f"{text} has {len(raw)} bytes; it needs more than seq_len + 1 = {seq_len + 1}")
            self.data = torch.frombuffer(bytearray(raw), dtype=torch.uint8).long()
        g = torch.Generator().manual_seed(seed)
        self.perm = torch.randperm(vocab, generator=g)

    def sample(self, index: int) -> torch.Tensor:
        """Sequence `index` of the run: seq_len + 1 tokens (inputs and shifted targets)."""
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + index)
        n = self.seq_len + 1
        if self.data is not None:
            start = int(torch.randint(0, len(self.data) - n, (1,), generator=g))
            return self.data[start: start + n]
        noise = torch.randint(0, self.vocab, (n,), generator=g)
        follow = torch.rand(n, generator=g) < FOLLOW
        out = torch.empty(n, dtype=torch.long)
        out[0] = noise[0]
        for t in range(1, n):
            out[t] = self.perm[out[t - 1]] if follow[t] else noise[t]
        return out

    def batch(self, step: int, micro: int, rank: int, world: int, global_batch: int,
              micro_batch: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Inputs and targets of micro-batch `micro` of `step` on `rank`."""
        per_rank = global_batch // world
        first = step * global_batch + rank * per_rank + micro * micro_batch
        seqs = torch.stack([self.sample(first + i) for i in range(micro_batch)])
        return seqs[:, :-1], seqs[:, 1:]
