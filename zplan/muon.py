"""Muon as runs use it: which tensors it steps, what state they keep, which rank orthogonalises what.

Muon (K. Jordan et al. 2024, github.com/KellerJordan/Muon; torch.optim.Muon since PyTorch 2.9)
steps the 2-D weight matrices of the hidden layers with momentum orthogonalised by a quintic
Newton-Schulz iteration; every published recipe steps the embedding, the output head and the
1-D gains and biases with AdamW instead (Muon's README: "embedding, classifier head, and
gains/biases should be optimized using AdamW"; Moonlight, Liu et al. 2025, arXiv 2502.16982,
section 2.1; torch.optim.Muon refuses tensors that are not 2-D). So --optimizer muon means:
Muon over the blocks' matrices, AdamW over the rest (docs/formulas.md, sections 2 and 6).

Who orthogonalises what, as each wrapper runs torch.optim.Muon: DDP hands every rank every
matrix (each rank runs all of them, the same work N times); ZeroRedundancyOptimizer hands each
rank whole parameters, so a rank runs only the matrices it owns; a sharded optimizer state
(FSDP2's dim-0 shards, DeepSpeed's flat partitions) cannot orthogonalise a shard, so each
matrix is gathered whole and every rank runs every matrix, keeping its own part of the update
(Moonlight's Distributed Muon, Algorithm 1: gather, full Newton-Schulz, discard the rest).
"""

from __future__ import annotations

import heapq
import math
from functools import lru_cache

from . import arch
from .scenario import Scenario
from .units import ceil_div

NS_STEPS = 5  # torch.optim.Muon's and the reference implementation's default ns_steps

Shape = tuple[int, ...]


def is_matrix(m, unit: arch.Unit, shape: Shape) -> bool:
    """Whether Muon steps this parameter: a weight of two or more dimensions inside a block (a
    synthetic model's flat block units count whole: its blocks are matrices but for their norms)."""
    if unit.blocks == 0:
        return False
    return len(shape) >= 2 or m.total_params is not None


def _as_matrices(m, unit: arch.Unit, shape: Shape) -> list[Shape]:
    """The matrices one parameter is to Muon: itself as (rows, columns), a synthetic model's
    flat block as square matrices of its width (its shapes are not known), none if AdamW's."""
    if not is_matrix(m, unit, shape):
        return []
    if len(shape) == 1:
        return [(m.hidden, m.hidden)] * max(1, round(shape[0] / m.hidden**2))
    return [(math.prod(shape[:-1]), shape[-1])]


def matrices(sc: Scenario) -> list[Shape]:
    """Every matrix Muon orthogonalises, whole."""
    return list(_matrices(sc.model, tuple(sc.units)))


def matrix_elements(sc: Scenario) -> int:
    """Elements of the parameters Muon steps (the rest is AdamW's)."""
    return _matrix_elements(sc.model, tuple(sc.units))


@lru_cache(maxsize=256)
def _matrices(m, units: tuple) -> tuple[Shape, ...]:
    return tuple(x for u in units for s in u.shapes for x in _as_matrices(m, u, s))


@lru_cache(maxsize=256)
def _matrix_elements(m, units: tuple) -> int:
    return sum(math.prod(s) for u in units for s in u.shapes if is_matrix(m, u, s))


Holding = tuple[list[int], list[int], list[Shape]]  # Muon's tensors, AdamW's, matrices it runs


def zero1_ranks(sc: Scenario) -> list[list[tuple[int, list[Shape]]]]:
    """Every rank's parameters under ZeroRedundancyOptimizer (_zero1_ranks)."""
    return _zero1_ranks(sc.model, tuple(sc.units), sc.n)


def _zero1_ranks(m, units: tuple, n: int) -> list[list[tuple[int, list[Shape]]]]:
    """Every rank's parameters under ZeroRedundancyOptimizer, (elements, its matrices if Muon's):
    whole parameters, largest first, each to the rank holding the fewest elements so far (the
    same greedy rule as memory.zero1_torch_partition)."""
    tagged = [(math.prod(s), _as_matrices(m, u, s)) for u in units for s in u.shapes]
    held: list[list[tuple[int, list[Shape]]]] = [[] for _ in range(n)]
    loads = [(0, r) for r in range(n)]
    for size, mats in sorted(tagged, key=lambda t: t[0], reverse=True):
        load, r = heapq.heappop(loads)
        held[r].append((size, mats))
        heapq.heappush(loads, (load + size, r))
    return held


def owns_whole_parameters(sc: Scenario, strategy: str) -> bool:
    """ZeroRedundancyOptimizer (zero1, torch layout) over several ranks: each rank steps whole
    parameters of its own, orthogonalising only those."""
    return strategy == "zero1" and sc.train.layout == "torch" and sc.n > 1


def holdings(sc: Scenario, strategy: str, D: int) -> list[Holding]:
    """What one rank's optimizer steps, (Muon's tensors, AdamW's tensors, the matrices it runs
    Newton-Schulz on), one entry per kind of rank (the step and the memory take the worst):
    - DDP (D = 1): every parameter whole, every matrix;
    - ZeroRedundancyOptimizer: each rank its own whole parameters and only their matrices
      (one entry per kind of rank: they differ);
    - FSDP2: each parameter's dim-0 shard, every matrix (gathered whole);
    - DeepSpeed: its flat partition in the model's proportion (its ranges cut across
      parameters: one part each), every matrix (gathered whole).
    Element counts follow memory.optimizer_tensor_sizes (and Scenario.shard_elems)."""
    zero1 = owns_whole_parameters(sc, strategy)
    return [(list(a), list(b), list(c)) for a, b, c in
            _holdings(sc.model, tuple(sc.units), sc.train.layout, sc.n if zero1 else 0, D)]


@lru_cache(maxsize=1024)
def _holdings(m, units: tuple, layout: str, zero1_ranks: int, D: int) -> tuple:
    if zero1_ranks:
        kinds: dict = {}
        for r in _zero1_ranks(m, units, zero1_ranks):
            h = (tuple(n for n, mats in r if mats), tuple(n for n, mats in r if not mats),
                 tuple(x for _, mats in r for x in mats))
            kinds.setdefault(tuple(tuple(sorted(x)) for x in h), h)
        return tuple(kinds.values())
    every = _matrices(m, units)
    if layout == "zero" and D > 1:
        flat = sum(ceil_div(u.numel, D) for u in units)  # Scenario.shard_elems, zero layout
        part = flat * _matrix_elements(m, units) // max(1, sum(u.numel for u in units))
        return (((part,), (flat - part,), every),)
    mine: list[int] = []
    adamw: list[int] = []
    for u in units:
        for s in u.shapes:
            (mine if is_matrix(m, u, s) else adamw).append(ceil_div(s[0], D) * math.prod(s[1:]))
    return ((tuple(mine), tuple(adamw), every),)


def newton_schulz_gemms(rows: int, cols: int, steps: int = NS_STEPS) -> list[tuple[int, int, int, bool]]:
    """The GEMMs (M, N, K, accumulate) of orthogonalising one rows x cols matrix: on X of m x n,
    m = min(rows, cols) (the wider way round, as both implementations transpose), each step is
    A = X Xᵀ (m, m, n), B = b·A + c·A·A (m, m, m, an addmm onto A) and X = a·X + B·X (m, n, m,
    an addmm onto X) (torch/optim/_muon.py _zeropower_via_newtonschulz): 4m²n + 2m³ FLOPs."""
    m, n = min(rows, cols), max(rows, cols)
    return [(m, m, n, False), (m, m, m, True), (m, n, m, True)] * steps
