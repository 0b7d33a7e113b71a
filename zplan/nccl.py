"""Collectives as NCCL runs them: algorithm, protocol, bus bandwidth and latency per call.

NCCL's tuner (src/graph/tuning.cc, NVIDIA/nccl at 5067397c) prices each collective as
t = latency + S / algbw for every (algorithm, protocol) it may use and runs the fastest. This
module mirrors that model, with the bandwidths a cluster really sustains (nccl-tests busbw,
from the cluster preset) in place of NCCL's internal estimates:

- ring, Simple protocol: latency = baseLat + (steps - inter)·intraLat + inter·interLat, with
  steps = n-1 for all-gather/reduce-scatter and 2(n-1) for all-reduce, inter = the steps that
  cross nodes (nodes-1, or 2(nodes-1)); time = latency + S·(n-1)/(n·busbw) (x2 for all-reduce).
  A reduce to one root (ring only) moves the whole S at the busbw, with one hop's latency.
- a ring spanning nodes pays the host's network overhead per step where it exceeds the link's
  (tuning.cc getNetOverhead: 1 us on Intel and other hosts, 2 on AMD x86, x3 for Simple; the
  cluster preset's net_overhead_s), and where each node holds one rank (HSDP's replica groups;
  NCCL's ppn = nRanks / nNodes is 1) its LL network steps take the tree's latency (hwLat[NET][TREE][LL], 5 us: "With ppn=1
  latencies are fully exposed").
- ring, LL protocol: NCCL's LL latencies, half the bandwidth and at most NCCL's llMaxBw for the
  group (tuning.cc: busBw = min(llMaxBw, busBw * .5); the cluster preset's
  ll_max_busbw_bytes_per_s: by GPU generation in one node, by host CPU across nodes, 20-39 GB/s
  there); it wins for small messages only.
- NVLS (NVLink SHARP) for all-reduce inside an NVSwitch node where the preset gives its busbw,
  with 65 µs per call: tuning.cc's hwLat[NVLINK][NVLS][Simple] is 25 µs, but the measured
  NVLS curve (nccl-tests all_reduce_perf on 8 H200, Azure ND H200 v5, NCCL 2.20.5) reaches half
  its bandwidth at 16 MiB and 92% at 512 MiB, which 65 µs reproduces within 5% from 16 MiB to
  8 GiB (25 µs puts 16 MiB 42% fast). Below that the ring's LL protocol is faster and NCCL's
  tuner runs it: the fastest of NVLS and the ring is taken.
- tree for all-reduce across nodes: latency base + 2((g-1)·4 µs + ⌊log2 nodes⌋·α_net), algbw
  0.46 busbw (tree busBw x .92, x .5) times NCCL's correction for medium sizes (tuning.cc
  treeCorrectionFactor[Simple], 0.5-0.9 from 64 B to 256 MiB: "trees are not perfectly sticking
  to the model for medium sizes"): it wins at many nodes, where a ring's 2(n-1) steps cost. A
  cluster preset may give the tree's bandwidth fraction its network measures (aws-p5: 0.26, the
  EFA curves of nccl-tests at 4-32 nodes; tree_busbw_fraction).

The bus bandwidth of a group depends on its shape: inside one node, the NVLink figure; across
nodes, each node's share of the ring goes through the NICs of the group's GPUs in that node,
so busbw = min(NVLink, g x per-GPU network figure) for g GPUs per node (a full node's rings use
every NIC at once; HSDP's replica groups have one or a few GPUs per node). Derivation:
docs/formulas.md, section 5.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from .specs import ClusterSpec

# NCCL's LL-protocol latencies (tuning.cc, baseLatencies and hwLatencies[*][RING][LL]), µs.
_LL_BASE_S = 6.6e-6
_LL_STEP_S = {"nvlink": 0.6e-6, "pcie": 1.0e-6}
_LL_NET_STEP_S = 2.7e-6
_LL_TREE_NET_STEP_S = 5.0e-6  # hwLat[NET][TREE][LL]: a ring's network step where each node has one rank
_NVLS_LATENCY_S = 65e-6  # the measured NVLS curve (module docstring); tuning.cc says 25 µs
_TREE_STEP_S = 4.0e-6  # hwLatencies[NVLINK or PCI][TREE][SIMPLE]
_TREE_BW = 0.92 * 0.5  # tuning.cc: tree all-reduce busBw * .92; algbw = busBw * .5
# tuning.cc treeCorrectionFactor[NCCL_PROTO_SIMPLE], indexed by log2(bytes / 64) below 23
_TREE_CORRECTION = (.9, .9, .9, .9, .9, .9, .9, .8, .7, .6, .6, .5, .5, .5, .5, .6, .7, .8, .7, .7,
                    .8, .9, .9)


@dataclass(frozen=True)
class CollectiveTime:
    seconds: float
    algorithm: str  # ring | tree | nvls
    protocol: str  # Simple | LL
    busbw_bytes_per_s: float  # the large-message bus bandwidth of this group's shape
    nodes: int
    per_node: int

    @property
    def scope(self) -> str:
        return "intra-node" if self.nodes == 1 else "inter-node"


def _factor(op: str) -> int:
    return 2 if op == "all_reduce" else 1


def nvls_busbw_share(n: int) -> float:
    """NVLS all-reduce bus bandwidth over n GPUs of one NVSwitch node, in units of one GPU's
    effective NVLink bandwidth L: 2(n-1)/(n+1).

    Source: the data NVLS moves (NCCL's NVLS kernels, multimem.ld_reduce then multimem.st): each
    GPU sends its whole buffer S to the switch, which reduces each 1/n chunk for its owner (in
    S/n), and each owner's reduced chunk goes back out once (S/n), the switch writing it to all n
    GPUs (in S): S(1 + 1/n) each way per GPU, so algbw = nL/(n+1) and busbw = algbw x 2(n-1)/n.
    Checked against nccl-tests with NVLS forced on 2, 4 and 6 H100 (waynehacking8/
    nccl-collectives-bench 38c093e, NCCL 2.29.2: 207, 376, 443 GB/s at 8 GiB), which the preset's
    8-GPU 479 GB/s and this ratio give within 2% (docs/formulas.md section 5)."""
    return 2.0 * (n - 1) / (n + 1)


def group_busbw(c: ClusterSpec, op: str, n: int, per_node: int) -> tuple[float, str]:
    """Bus bandwidth (large messages) and algorithm for a group of n ranks, per_node in a node.

    A preset's NVLS figure is measured over intra_node_allreduce_gpus GPUs (its whole node where
    unset); a smaller group inside the node gets it scaled by nvls_busbw_share, a larger one keeps
    it (the slower side); collective_time takes the faster of NVLS and the ring (the ring at 2 GPUs)."""
    nodes = -(-n // per_node)
    if nodes == 1:
        if op == "all_reduce" and c.intra_node_allreduce_busbw_bytes_per_s:
            ref = max(2, c.intra_node_allreduce_gpus or c.gpus_per_node)
            scale = nvls_busbw_share(min(n, ref)) / nvls_busbw_share(ref)
            return c.intra_node_allreduce_busbw_bytes_per_s * scale, "nvls"
        return c.intra_node_busbw_bytes_per_s, "ring"
    return min(c.intra_node_busbw_bytes_per_s, per_node * c.inter_node_busbw_bytes_per_s), "ring"


_CACHE: dict = {}


class NodeSlice(int):
    """GPUs per node of a group that straddles node boundaries (its narrowest slice, an int as
    any per-node count) with the number of nodes it spans, which n / per-node would overcount:
    six ranks on 8-GPU nodes sit 2 + 4 in 2 nodes, not 3 (contiguous_shape)."""

    nodes: int

    def __new__(cls, per_node: int, nodes: int) -> NodeSlice:
        obj = super().__new__(cls, per_node)
        obj.nodes = nodes
        return obj


def collective_time(c: ClusterSpec, op: str, nbytes: int, n: int, per_node: int) -> CollectiveTime:
    """Memoized _collective_time (keyed on the preset object: specs with dicts do not hash fast)."""
    key = (id(c), op, nbytes, n, per_node, getattr(per_node, "nodes", None))
    hit = _CACHE.get(key)
    if hit is not None and hit[0] is c:
        return hit[1]
    if len(_CACHE) > 65536:
        _CACHE.clear()
    out = _collective_time(c, op, nbytes, n, per_node)
    _CACHE[key] = (c, out)
    return out


def _collective_time(c: ClusterSpec, op: str, nbytes: int, n: int, per_node: int) -> CollectiveTime:
    """Seconds of one collective call over n ranks (S = nbytes, the whole tensor as nccl-tests
    counts it), with per_node of them in each node: the fastest of NCCL's options."""
    span = getattr(per_node, "nodes", None)  # a straddling group's real span (NodeSlice)
    per_node = max(1, min(int(per_node), n))
    nodes = span or -(-n // per_node)
    if n <= 1:
        return CollectiveTime(0.0, "none", "none", 0.0, 1, 1)
    f = _factor(op)
    bw, algo = group_busbw(c, op, n, per_node)
    if op == "reduce":
        return _reduce_time(c, nbytes, bw, nodes, per_node)
    wire = f * nbytes * (n - 1) / n
    nvls = None
    if algo == "nvls":  # NVLS where it is faster; small all-reduces run the ring's LL protocol
        nvls = CollectiveTime(_NVLS_LATENCY_S + wire / bw, algo, "Simple", bw, nodes, per_node)
        bw = c.intra_node_busbw_bytes_per_s
    steps = f * (n - 1)
    inter = 0 if nodes == 1 else f * (nodes - 1)
    fill = f * c.intra_node_ring_fill_s if nodes == 1 else 0.0
    # a ring spanning nodes launches every step with the host's network overhead (tuning.cc:
    # intraLat = max(intraLat, getNetOverhead x 3 for Simple)): 1 us on Intel hosts, 2 on AMD
    intra_simple = c.intra_node_latency_s if nodes == 1 else max(c.intra_node_latency_s, 3 * c.net_overhead_s)
    simple = (c.base_latency_s + fill + (steps - inter) * intra_simple
              + inter * c.inter_node_latency_s + wire / bw)
    best = CollectiveTime(simple, "ring", "Simple", bw, nodes, per_node)
    if nvls is not None and nvls.seconds < best.seconds:
        best = nvls
    if c.link in _LL_STEP_S:
        intra = _LL_STEP_S[c.link] if nodes == 1 else max(_LL_STEP_S[c.link], c.net_overhead_s)
        ll_bw = 0.5 * bw
        if c.ll_max_busbw_bytes_per_s is not None:
            ll_bw = min(ll_bw, c.ll_max_busbw_bytes_per_s[min(nodes, 3) - 1])
        # "With ppn=1 latencies are fully exposed, use the Tree network latency" (tuning.cc, where
        # ppn = nRanks / nNodes: one rank in every node, not a group whose narrowest slice is one)
        net_step = _LL_TREE_NET_STEP_S if n == nodes else _LL_NET_STEP_S
        ll = _LL_BASE_S + (steps - inter) * intra + inter * net_step + wire / ll_bw
        if ll < best.seconds:
            best = CollectiveTime(ll, "ring", "LL", bw, nodes, per_node)
        if op == "all_reduce" and nodes > 1:  # double binary tree: log-depth latency
            lat = c.base_latency_s + 2 * ((per_node - 1) * _TREE_STEP_S
                                          + math.floor(math.log2(nodes)) * c.inter_node_latency_s)
            log_size = int(math.log2(nbytes >> 6)) if nbytes >> 6 else -1  # NCCL's log2i(0) = -1
            corr = _TREE_CORRECTION[log_size] if 0 <= log_size < len(_TREE_CORRECTION) else 1.0
            frac = c.tree_busbw_fraction if c.tree_busbw_fraction is not None else _TREE_BW
            tree = lat + nbytes / (frac * corr * bw)
            if tree < best.seconds:
                best = CollectiveTime(tree, "tree", "Simple", bw, nodes, per_node)
    return best


def _reduce_time(c: ClusterSpec, nbytes: int, bw: float, nodes: int, per_node: int) -> CollectiveTime:
    """One ncclReduce of S bytes to one root (DeepSpeed's ZeRO-1/2 with
    use_multi_rank_bucket_allreduce off): NCCL runs it on the ring alone, with nsteps = n, so
    its algbw is the busbw itself (tuning.cc: ratio = nRanks / nsteps) and every rank sends the
    whole S, not S(n-1)/n; the pipeline pays one hop's latency on top of the base (tuning.cc,
    Reduce with sameChannels). LL where it is faster, as for the other collectives."""
    hop = c.intra_node_latency_s if nodes == 1 else c.inter_node_latency_s
    best = CollectiveTime(c.base_latency_s + hop + nbytes / bw, "ring", "Simple", bw, nodes, per_node)
    if c.link in _LL_STEP_S:
        ll_bw = 0.5 * bw
        if c.ll_max_busbw_bytes_per_s is not None:
            ll_bw = min(ll_bw, c.ll_max_busbw_bytes_per_s[min(nodes, 3) - 1])
        # (tuning.cc's Reduce adds the ring's own hop latency, ppn = 1 or not)
        ll = _LL_BASE_S + (_LL_STEP_S[c.link] if nodes == 1 else _LL_NET_STEP_S) + nbytes / ll_bw
        if ll < best.seconds:
            best = CollectiveTime(ll, "ring", "LL", bw, nodes, per_node)
    return best


def busbw_at(c: ClusterSpec, op: str, nbytes: int, n: int, per_node: int) -> float:
    """The busbw nccl-tests would print for this call: S/t x (n-1)/n (x2 for all-reduce; S/t
    for reduce, whose busbw nccl-tests takes as its algbw)."""
    t = collective_time(c, op, nbytes, n, per_node).seconds
    if t <= 0:
        return 0.0
    return nbytes / t if op == "reduce" else _factor(op) * nbytes * (n - 1) / (n * t)


def contiguous_shape(n: int, gpus_per_node: int, world: int | None = None) -> int:
    """GPUs per node of the narrowest group of n consecutive ranks among those tiling `world`
    ranks (a shard group; the world itself): whole nodes or slices of one where n and the node
    divide evenly; otherwise some group straddles a node boundary, and its smallest slice,
    gcd(n, gpus_per_node) GPUs, is all the NICs its ring has there (six-rank groups on 8-GPU
    nodes: a group with 2 GPUs in one node and 4 in the next). A world within one node is one
    node's group."""
    world = n if world is None else world
    if world <= gpus_per_node:
        return min(n, gpus_per_node)
    g = math.gcd(n, gpus_per_node)
    if g == min(n, gpus_per_node):  # whole nodes, or slices of one: n / g nodes
        return g
    # the straddling group starts where a slice of g ends: it spans ceil((gpn - g + n) / gpn)
    return NodeSlice(g, -(-(gpus_per_node - g + n) // gpus_per_node))


def strided_shape(n: int, stride: int, gpus_per_node: int) -> int:
    """GPUs per node of a group of n ranks `stride` apart (HSDP's replica group)."""
    if stride >= gpus_per_node:
        return 1
    return max(1, min(n, gpus_per_node // stride))
