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
from collections import Counter
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
    if len(shape) == 3:  # an MoE block's experts (arch.expert_shapes): one matrix per expert
        return [shape[1:]] * shape[0]
    return [(math.prod(shape[:-1]), shape[-1])]


def matrices(sc: Scenario) -> list[Shape]:
    """Every matrix Muon orthogonalises, whole."""
    return [shape for shape, n in _matrix_counts(sc.model, tuple(sc.units)) for _ in range(n)]


def matrix_elements(sc: Scenario) -> int:
    """Elements of the parameters Muon steps (the rest is AdamW's)."""
    return _matrix_elements(sc.model, tuple(sc.units))


@lru_cache(maxsize=256)
def _unit_kinds(m, units: tuple) -> tuple[tuple[arch.Unit, int], ...]:
    """One unit of each kind (the blocks repeat: same shapes, inside a block or not) and how many."""
    kinds: dict = {}
    for u in units:
        key = (u.blocks > 0, u.shapes)
        first, n = kinds.get(key, (u, 0))
        kinds[key] = (first, n + 1)
    return tuple(kinds.values())


@lru_cache(maxsize=256)
def _matrix_counts(m, units: tuple) -> Counted:
    c: Counter = Counter()
    for u, n in _unit_kinds(m, units):
        for s in u.shapes:
            for x in _as_matrices(m, u, s):
                c[x] += n
    return tuple(sorted(c.items()))


@lru_cache(maxsize=256)
def _matrix_elements(m, units: tuple) -> int:
    return sum(n * math.prod(s) for u, n in _unit_kinds(m, units) for s in u.shapes if is_matrix(m, u, s))


Counted = tuple[tuple[Shape, int], ...]  # distinct matrix shapes and how many of each
# One rank's optimizer: (Muon's elements, Muon's tensors, AdamW's tensors' sizes, matrices it runs)
Holding = tuple[int, int, tuple[int, ...], Counted]


def counted(shapes) -> Counted:
    """The distinct shapes of these matrices with how many of each (a stable order)."""
    return tuple(sorted(Counter(shapes).items()))


def zero1_ranks(sc: Scenario) -> list[list[tuple[int, list[Shape]]]]:
    """Every rank's parameters under ZeroRedundancyOptimizer (_zero1_ranks)."""
    return _zero1_ranks(sc.model, tuple(sc.units), sc.n)


@lru_cache(maxsize=64)
def _zero1_ranks(m, units: tuple, n: int) -> list[list[tuple[int, list[Shape]]]]:
    """Every rank's parameters under ZeroRedundancyOptimizer, (elements, its matrices if Muon's),
    for one optimizer over two parameter groups, Muon's matrices first and AdamW's rest (Muon's
    MuonWithAuxAdam; torch.optim.Muon takes 2-D tensors only):
    torch/distributed/optim/zero_redundancy_optimizer.py `_partition_parameters` sorts each group's
    parameters largest first and gives each to the rank holding the fewest elements so far, the
    running totals shared across the groups."""
    tagged = [(math.prod(s), _as_matrices(m, u, s)) for u in units for s in u.shapes]
    held: list[list[tuple[int, list[Shape]]]] = [[] for _ in range(n)]
    loads = [(0, r) for r in range(n)]
    for group in ([t for t in tagged if t[1]], [t for t in tagged if not t[1]]):
        for size, mats in sorted(group, key=lambda t: t[0], reverse=True):
            load, r = heapq.heappop(loads)
            held[r].append((size, mats))
            heapq.heappush(loads, (load + size, r))
    return held


def owns_whole_parameters(sc: Scenario, strategy: str) -> bool:
    """ZeroRedundancyOptimizer (zero1, torch layout) over several ranks: each rank steps whole
    parameters of its own, orthogonalising only those."""
    return strategy == "zero1" and sc.train.layout == "torch" and sc.n > 1


def holdings(sc: Scenario, strategy: str, D: int) -> tuple[Holding, ...]:
    """What one rank's optimizer steps, (Muon's elements and tensors, AdamW's tensors, the
    matrices it runs Newton-Schulz on, counted), one entry per kind of rank (the step and the
    memory take the worst):
    - DDP (D = 1): every parameter whole, every matrix;
    - ZeroRedundancyOptimizer: each rank its own whole parameters and only their matrices
      (one entry per kind of rank: they differ);
    - FSDP2: each parameter's dim-0 shard, every matrix (gathered whole);
    - DeepSpeed: its flat partition in the model's proportion (its ranges cut across
      parameters: one part each), every matrix (gathered whole).
    Element counts follow Scenario.shard_elems. Cached: the tuples are shared, not to be changed."""
    zero1 = owns_whole_parameters(sc, strategy)
    return _holdings(sc.model, tuple(sc.units), sc.train.layout, sc.n if zero1 else 0, D)


@lru_cache(maxsize=1024)
def _holdings(m, units: tuple, layout: str, zero1_ranks: int, D: int) -> tuple[Holding, ...]:
    if zero1_ranks:
        kinds: dict = {}
        for r in _zero1_ranks(m, units, zero1_ranks):
            mine = [n for n, mats in r if mats]
            h = (sum(mine), len(mine), tuple(sorted(n for n, mats in r if not mats)),
                 counted(x for _, mats in r for x in mats))
            kinds.setdefault(h, h)
        return tuple(kinds.values())
    every = _matrix_counts(m, units)
    if layout == "zero" and D > 1:
        flat = sum(ceil_div(u.numel, D) for u in units)  # Scenario.shard_elems, zero layout
        part = flat * _matrix_elements(m, units) // max(1, sum(u.numel for u in units))
        return ((part, 1, (flat - part,), every),)
    elems = tensors = 0
    adamw: list[int] = []
    for u, n in _unit_kinds(m, units):
        for s in u.shapes:
            size = arch.fsdp_shard_elems(s, D)
            if is_matrix(m, u, s):
                elems, tensors = elems + n * size, tensors + n
            else:
                adamw += [size] * n
    return ((elems, tensors, tuple(adamw), every),)


@lru_cache(maxsize=4096)
def step_temp_bytes(matrices: Counted, grad_bytes: int, gather_bytes: int) -> int:
    """The largest of torch.optim.Muon's temporaries over these matrices (rows x cols; m, n the
    short and long side), alive together in Newton-Schulz's last addmm: the Nesterov update (a
    new tensor in the gradient's dtype, rows x cols), the bf16 X being read and the one being
    written (2mn each), A = X Xt and B (2m² each): G·mn + 4mn + 4m²; plus, where the state is
    sharded, the matrix gathered whole (in the gather's dtype) to be orthogonalised."""
    best = 0
    for (rows, cols), _ in matrices:
        m, n = min(rows, cols), max(rows, cols)
        best = max(best, (grad_bytes + gather_bytes) * m * n + 4 * m * n + 4 * m * m)
    return best


def newton_schulz_flop(matrices: Counted) -> int:
    """FLOPs of orthogonalising these matrices (newton_schulz_gemms: 2MNK each)."""
    return sum(count * sum(2 * M * N * K for M, N, K, _ in newton_schulz_gemms(*shape))
               for shape, count in matrices)


def newton_schulz_gemms(rows: int, cols: int, steps: int = NS_STEPS) -> list[tuple[int, int, int, bool]]:
    """The GEMMs (M, N, K, accumulate) of orthogonalising one rows x cols matrix: on X of m x n,
    m = min(rows, cols) (the wider way round, as both implementations transpose), each step is
    A = X Xᵀ (m, m, n), B = b·A + c·A·A (m, m, m, an addmm onto A) and X = a·X + B·X (m, n, m,
    an addmm onto X) (torch/optim/_muon.py _zeropower_via_newtonschulz): 4m²n + 2m³ FLOPs."""
    m, n = min(rows, cols), max(rows, cols)
    return [(m, m, n, False), (m, m, m, True), (m, n, m, True)] * steps
