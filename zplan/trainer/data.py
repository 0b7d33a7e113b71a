"""Training data in a deterministic, resumable order.

Sample i of the run is a pure function of (seed, i): the batch of step t on rank r is samples
t·G + r·(G/N) ... for a global batch of G sequences, so any step can be regenerated after a
restart, at any world size, without replaying the ones before it.

- synthetic: a fixed random Markov chain over the vocabulary (next token = perm[token] with
  probability 0.9, else uniform), learnable in a few dozen steps, so the loss falls visibly.
- text file: byte-level tokens (vocabulary 256) from a local file, windows at seeded offsets.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from ..errors import UsageError

FOLLOW = 0.9


class TokenSource:
    def __init__(self, vocab: int, seq_len: int, seed: int = 0, text: str | None = None):
        self.vocab, self.seq_len, self.seed = vocab, seq_len, seed
        self.data = None
        if text is not None:
            raw = Path(text).read_bytes()
            if vocab < 256:
                raise UsageError(f"--data {text}: a text file needs a vocabulary of 256 bytes; the model has {vocab}")
            if len(raw) <= seq_len + 1:
                raise UsageError(f"--data {text} has {len(raw)} bytes; the trainer needs more than seq_len + 1 = "
                                 f"{seq_len + 1} (a longer text file, or a shorter --seq-len)")
            self.data = torch.frombuffer(bytearray(raw), dtype=torch.uint8).long()
        g = torch.Generator().manual_seed(seed)
        self.perm = torch.randperm(vocab, generator=g)
        self.powers = permutation_powers(self.perm, seq_len + 1)

    def sample(self, index: int) -> torch.Tensor:
        """Sequence `index` of the run: seq_len + 1 tokens (inputs and shifted targets)."""
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + index)
        n = self.seq_len + 1
        if self.data is not None:
            start = int(torch.randint(0, len(self.data) - n, (1,), generator=g))
            return self.data[start: start + n]
        noise = torch.randint(0, self.vocab, (n,), generator=g)
        follow = torch.rand(n, generator=g) < FOLLOW
        return markov_chain(self.powers, noise, follow)

    def batch(self, step: int, micro: int, rank: int, world: int, global_batch: int,
              micro_batch: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Inputs and targets of micro-batch `micro` of `step` on `rank`."""
        per_rank = global_batch // world
        first = step * global_batch + rank * per_rank + micro * micro_batch
        seqs = torch.stack([self.sample(first + i) for i in range(micro_batch)])
        return seqs[:, :-1], seqs[:, 1:]


def permutation_powers(perm: torch.Tensor, n: int) -> list[torch.Tensor]:
    """perm^1, perm^2, perm^4, ...: enough powers of two for any run shorter than n."""
    out = [perm]
    while 1 << len(out) < n:
        out.append(out[-1][out[-1]])
    return out


def markov_chain(powers: list[torch.Tensor], noise: torch.Tensor, follow: torch.Tensor) -> torch.Tensor:
    """out[0] = noise[0]; out[t] = perm[out[t-1]] where follow[t], else noise[t]; with tensor ops.

    A position that does not follow starts a run; position t of a run that started at s holds
    perm^(t-s)(noise[s]), applied bit by bit from `powers` (permutation_powers(perm, n)), so
    a sequence costs O(n log n) gathers instead of n Python steps (45 ms per 4k-token sequence)."""
    n = noise.numel()
    pos = torch.arange(n)
    starts = torch.where(follow, torch.zeros_like(pos), pos)
    start = torch.cummax(starts, 0).values  # the run each position belongs to (position 0 starts one)
    k = pos - start
    out = noise[start]
    for bit in range(max(int(k.max()), 1).bit_length()):
        take = (k >> bit) & 1 == 1
        out = torch.where(take, powers[bit][out], out)
    return out

class Prefetcher:
    """Micro-batches in run order, each prepared on a background thread while the one before
    it trains (torch ops release the GIL), so data preparation stays off the timed path. On
    CUDA the batch is pinned and copied without blocking the host."""

    def __init__(self, source: TokenSource, rank: int, world: int, global_batch: int,
                 micro_batch: int, grad_accum: int, device: torch.device):
        self.source, self.rank, self.world = source, rank, world
        self.global_batch, self.micro_batch, self.grad_accum = global_batch, micro_batch, grad_accum
        self.device = device
        self.pin = device.type == "cuda"
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="zplan-data")
        self._next = None  # ((step, micro), future)

    def _prepare(self, step: int, micro: int) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = self.source.batch(step, micro, self.rank, self.world, self.global_batch, self.micro_batch)
        # x and y are strided views of one (B, s + 1) tensor, and pin_memory keeps strides: a
        # non-contiguous pinned source makes the copy to the GPU stage it through a fresh pageable
        # contiguous tensor on the caller's thread, a blocking copy. Contiguous here, on this
        # thread, so the copy in get() is one asynchronous DMA from pinned memory.
        x, y = x.contiguous(), y.contiguous()
        if self.pin:
            x, y = x.pin_memory(), y.pin_memory()
        return x, y

    def get(self, step: int, micro: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Micro-batch `micro` of `step` on this rank's device; starts preparing the next one."""
        key = (step, micro)
        if self._next is not None and self._next[0] == key:
            x, y = self._next[1].result()
        else:
            x, y = self._prepare(step, micro)
        nxt = (step, micro + 1) if micro + 1 < self.grad_accum else (step + 1, 0)
        self._next = (nxt, self._pool.submit(self._prepare, *nxt))
        return x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
