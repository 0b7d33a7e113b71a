"""Communication per step: every collective, its size, and its time.

Volume convention (Rajbhandari et al. 2020, section 7): an all-gather or a reduce-scatter of a
tensor of S elements counts S, an all-reduce counts 2S; so DDP moves 2Ψ per step and ZeRO-3 3Ψ.
Time is the ring model of nccl-tests (doc/PERFORMANCE.md): busbw = algbw·(n-1)/n for all-gather
and reduce-scatter, algbw·2(n-1)/n for all-reduce, so t = S·(n-1)/(n·busbw) (twice that for an
all-reduce), plus a latency α per ring step. Derivations: docs/formulas.md.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from .scenario import Scenario
from .strategies import Strategy
from .units import nbytes


WHOLE_MATRIX = "all-gather (whole matrices for the optimizer)"


@dataclass(frozen=True)
class Collective:
    name: str  # e.g. "all-gather (forward)"
    op: str  # all_gather | reduce_scatter | all_reduce | h2d | d2h
    elements: int  # size of the full tensor the op works on, per call
    dtype: str
    group_size: int
    scope: str  # intra-node | inter-node | pcie
    calls_per_step: int
    seconds_per_call: float

    @property
    def volume_factor(self) -> int:
        return 2 if self.op == "all_reduce" else 1

    @property
    def moves(self) -> bool:
        """A collective over one rank moves nothing (FSDP2 and the reference skip it)."""
        return self.group_size > 1 or self.op in ("h2d", "d2h")

    @property
    def elements_per_step(self) -> int:
        if self.op in ("h2d", "d2h") or not self.moves:
            return 0
        return self.volume_factor * self.elements * self.calls_per_step

    @property
    def bytes_per_step(self) -> int:
        if not self.moves:
            return 0
        return self.volume_factor * nbytes(self.elements, self.dtype) * self.calls_per_step

    def as_dict(self) -> dict:
        d = {f.name: getattr(self, f.name) for f in fields(self)}
        d.update(elements_per_step=self.elements_per_step, bytes_per_step=self.bytes_per_step)
        return d


def collective_seconds(op: str, nbytes_: int, n: int, busbw: float, latency_s: float) -> float:
    """nccl-tests ring model: t = S·(n-1)/(n·busbw) + (n-1)·α; twice both for an all-reduce."""
    if n <= 1:
        return 0.0
    factor = 2 if op == "all_reduce" else 1
    return factor * (nbytes_ * (n - 1) / (n * busbw) + (n - 1) * latency_s)


def link(sc: Scenario, group_size: int, spans_nodes: bool) -> tuple[str, float, float]:
    c = sc.hw.cluster
    if spans_nodes:
        return "inter-node", c.inter_node_busbw_bytes_per_s, c.inter_node_latency_s
    return "intra-node", c.intra_node_busbw_bytes_per_s, c.intra_node_latency_s


def _coll(sc, name, op, elements, dtype, group, spans, calls) -> Collective:
    scope, bw, lat = link(sc, group, spans)
    t = collective_seconds(op, nbytes(elements, dtype), group, bw, lat)
    return Collective(name, op, elements, dtype, group, scope, calls, t)


@dataclass(frozen=True)
class UnitComm:
    """Per unit, per micro-batch: seconds of its gathers and of its gradient reduction."""

    name: str
    gathered_elements: int
    all_gather_s: float
    reduce_s: float  # reduce-scatter (+ HSDP replica all-reduce) of its gradients
    h2d_s: float  # offload: bringing its shard from host memory before the gather
    gathers_in_backward: bool


def unit_comm(sc: Scenario, st: Strategy) -> list[UnitComm]:
    """Gathers and reductions of each sharded unit (FSDP-style strategies only)."""
    p = sc.train.precision
    gpn = sc.hw.cluster.gpus_per_node
    D = sc.shard_degree(st.hsdp)
    spans = D > gpn
    _, bw, lat = link(sc, D, spans)
    out = []
    for u in sc.units:
        full = sc.padded_elems(u, D)
        ag = collective_seconds("all_gather", nbytes(full, p.param), D, bw, lat)
        rs = collective_seconds("reduce_scatter", nbytes(full, p.reduce), D, bw, lat)
        if st.hsdp and sc.n > D:
            R = sc.n // D
            _, bw2, lat2 = link(sc, R, True)
            rs += collective_seconds("all_reduce", nbytes(full // D, p.reduce), R, bw2, lat2)
        h2d = 0.0
        if st.offload_params:
            store = p.master if sc.train.layout == "torch" else p.param
            h2d = nbytes(full // D, store) / sc.hw.gpu.host_link_bytes_per_s
        out.append(UnitComm(u.name, full, ag, rs, h2d,
                            st.reshard_after_forward and not u.held))
    return out


def collectives(sc: Scenario, st: Strategy) -> list[Collective]:
    """Every collective of one optimizer step (grad_accum micro-batches)."""
    t, p, psi, N = sc.train, sc.train.precision, sc.params, sc.n
    A = t.grad_accum
    gpn = sc.hw.cluster.gpus_per_node
    spans_world = N > gpn
    rs_calls = A if t.reduce_every_microbatch else 1
    out: list[Collective] = []
    if t.optimizer == "muon" and st.optim_sharded and N > 1:
        # Muon orthogonalises whole matrices: each sharded update gathers its matrix first
        out.append(_coll(sc, WHOLE_MATRIX, "all_gather", psi, p.param, N, spans_world, 1))
    if not st.fsdp:
        torch = t.layout == "torch"
        if st.name == "ddp" or (st.name == "zero1" and torch):
            # torch layout (DDP with autocast): the parameters are stored in the master dtype, so
            # DDP's gradient buckets and ZeroRedundancyOptimizer's broadcasts are in that dtype
            store = p.master if torch else p.param
            out.append(_coll(sc, "all-reduce (gradients)", "all_reduce", psi,
                             p.master if torch else p.reduce, N, spans_world, rs_calls))
            if st.name == "zero1":  # ZeroRedundancyOptimizer: owners broadcast whole parameters
                out.append(_coll(sc, "broadcast (updated weights)", "all_gather", psi, store, N,
                                 spans_world, 1))
            return out
        # DeepSpeed pads each flat partition to a multiple of N, as the reference does
        padded = sum(sc.padded_elems(u, N) for u in sc.units)
        grad_calls = rs_calls if st.name == "zero2" else 1
        out.append(_coll(sc, "reduce-scatter (gradients)", "reduce_scatter", padded, p.reduce,
                         N, spans_world, grad_calls))
        out.append(_coll(sc, "all-gather (updated weights)", "all_gather", padded, p.param, N,
                         spans_world, 1))
        return out
    D = sc.shard_degree(st.hsdp)
    spans = D > gpn
    units = sc.units
    gathered = sum(sc.padded_elems(u, D) for u in units)
    re_gathered = sum(sc.padded_elems(u, D) for u in units if st.reshard_after_forward and not u.held)
    out.append(_coll(sc, "all-gather (forward)", "all_gather", gathered, p.param, D, spans, A))
    if re_gathered:
        out.append(_coll(sc, "all-gather (backward)", "all_gather", re_gathered, p.param, D,
                         spans, A))
    out.append(_coll(sc, "reduce-scatter (gradients)", "reduce_scatter", gathered, p.reduce, D,
                     spans, rs_calls))
    if st.hsdp and N > D:
        out.append(_coll(sc, "all-reduce (replicas, 1/S shard)", "all_reduce", gathered // D,
                         p.reduce, N // D, True, rs_calls))
    shard = gathered // D
    link_bw = sc.hw.gpu.host_link_bytes_per_s
    if st.offload_params:
        store = p.master if t.layout == "torch" else p.param
        b = nbytes(shard, store)
        out.append(Collective("host->GPU (sharded weights)", "h2d", shard, store, 1, "pcie",
                              A * (2 if st.reshard_after_forward else 1), b / link_bw))
    if st.offload_optimizer:
        out.append(Collective("GPU->host (gradients)", "d2h", shard, p.reduce, 1, "pcie",
                              rs_calls, nbytes(shard, p.reduce) / link_bw))
        if not st.offload_params:
            out.append(Collective("host->GPU (updated weights)", "h2d", shard, p.param, 1, "pcie",
                                  1, nbytes(shard, p.param) / link_bw))
    return out
