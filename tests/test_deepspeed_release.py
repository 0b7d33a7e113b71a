"""DeepSpeed ZeRO-3 at its defaults releases a module's parameters after use unless they come
back within stage3_max_reuse_distance (1e9) elements of the module trace, or its prefetcher,
scanning ahead, marked them fetched for a later use (deepspeed.backward_gathers). The release
rule alone is worked here by hand; with the prefetcher, DeepSpeed's own ZeRO-3 on two gloo ranks
is the oracle, its settings scaled with the model."""

import fcntl
import json
import math
import os
import subprocess
import sys

import pytest

from zplan.deepspeed import backward_gathers, coordinate
from tests.helpers import est, scenario


def _no_prefetch(units):
    return backward_gathers(units, prefetch_bucket=0)


def test_two_wrapped_units_by_hand():
    """A then B, one 6e8-element parameter each, both checkpointed. Trace: A, B | B (recompute),
    B (backward), A (recompute), A (backward). B's forward is followed by its own recompute: kept,
    never gathered in backward. A's next use is 1.2e9 elements away (B, B): released after the
    forward, gathered for its recompute, then kept for its backward, the next step."""
    assert _no_prefetch((((600_000_000,), True), ((600_000_000,), True))) == ((600_000_000,), ())


def test_unwrapped_units_by_hand():
    """Without recompute: A, B | B, A. B's backward follows its forward: kept. A comes back
    after 2 x 4e8 = 8e8 elements, within the distance: kept too. With 6e8 each it is 1.2e9 away."""
    assert _no_prefetch((((400_000_000,), False), ((400_000_000,), False))) == ((), ())
    assert _no_prefetch((((600_000_000,), False), ((600_000_000,), False))) == ((600_000_000,), ())


def test_persistent_parameters_are_never_gathered_again():
    """At most 1e5 elements (stage3_param_persistence_threshold): kept whole by every rank."""
    assert _no_prefetch((((100_000, 600_000_000), True), ((600_000_000,), True))) == ((600_000_000,), ())


def test_the_prefetcher_gathers_ahead_by_hand():
    """A (3e8) and B (3e8) unwrapped, then C (6e8) and D (6e8), distance 1e9, bucket 5e7, live
    1e9. Trace: A B C D | D C B A. Without prefetch, every parameter whose next use lies 1e9 or
    more away is released: A (3e9), B (2.4e9), C (D, D: 1.2e9); D is next to its backward.
    With it, each fetch then scans the queue on, gathering until 5e7 elements are gathered or
    the live parameters reach 1e9: at D's forward the scan marks D's backward and gathers C
    for its own (6e8 > 5e7); at D's backward the live parameters (C, D: 1.2e9) leave no room;
    at C's backward it gathers B, at B's A. The same parameters again, each gathered one step
    earlier."""
    units = (((300_000_000,), False), ((300_000_000,), False), ((600_000_000,), False), ((600_000_000,), False))
    assert _no_prefetch(units) == backward_gathers(units) == ((300_000_000,), (300_000_000,), (600_000_000,), ())


def _units(model):
    sc = scenario(model=model, gpus=32, layout="zero", deepspeed_defaults=True, checkpointing="full")
    return sc, tuple((tuple(math.prod(s) for s in u.shapes), bool(u.blocks)) for u in sc.units)


def test_a_70b_block_without_prefetch_gathers_its_attention_weights_twice():
    """The release rule alone (prefetch off), Llama 3.1 70B (856M elements a block): after the
    recompute, wq/wk/wv/wo's next use (their backward) lies beyond 1e9 elements (the MLP's
    recompute and backward come between), the MLP's within it: the recompute gathers the 7
    linears, the backward the 4 attention ones again. With the prefetcher (DeepSpeed's default
    5e7), its scan passes the attention weights while they are still gathered and marks them for
    their backward: the 7 linears once. The head's backward follows its forward: never again.
    The embedding: once."""
    sc, units = _units("llama-3.1-70b")
    h, f, kv = 8192, 28672, 1024
    linears = (h * h, kv * h, kv * h, h * h, f * h, f * h, h * f)
    off, on = _no_prefetch(units), backward_gathers(units)
    for i, u in enumerate(sc.units[:-2]):  # the last block is next to its recompute
        if u.blocks:
            assert off[i] == linears + (h * h, kv * h, kv * h, h * h)[::-1], u.name
            assert on[i] == linears, u.name
    assert off[-1] == on[-1] == () and off[0] == on[0] == (128256 * h,)


def test_an_8b_block_keeps_all_its_weights_from_the_recompute():
    sc, units = _units("llama-3.1-8b")
    h, f, kv = 4096, 14336, 1024
    linears = (h * h, kv * h, kv * h, h * h, f * h, f * h, h * f)
    for again in (_no_prefetch(units), backward_gathers(units)):  # the 7 linears once, in any order
        # (the last blocks lie within the prefetcher's reach of their recompute: kept)
        assert all(sorted(again[i]) == sorted(linears) for i, u in enumerate(sc.units[:-3]) if u.blocks)
        assert again[-1] == ()


def test_the_step_prices_those_gathers():
    """The backward all-gather collective holds exactly those elements (padded to the group),
    and it costs time beside compute; a plan that writes its own buckets (no
    --deepspeed-defaults) gathers what the same coordinator gathers at the stage-3 settings its
    DeepSpeed export writes (read from the exported config: the one contract), which is not
    every unit once more, as FSDP does."""
    kw = dict(model="llama-3.1-70b", gpus=32, seq_len=1024, layout="zero", checkpointing="full")
    r = est("zero3", deepspeed_defaults=True, **kw)
    sc, units = _units("llama-3.1-70b")
    reentrant = not sc.train.checkpoint_early_stop
    again = backward_gathers(units, reentrant=reentrant)
    back = [c for c in r.collectives if c.name == "all-gather (backward)"]
    assert len(back) == 1 and back[0].elements == sum(-(-n // 32) * 32 for a in again for n in a)
    fwd = [c for c in r.collectives if c.name == "all-gather (forward)"][0]
    # each block and the embedding once more; not the head, whose backward follows its forward
    assert 0.95 < back[0].elements / fwd.elements < 1.0
    from zplan.export import deepspeed_config
    from zplan.plan import make_plan

    r = est("zero3", **kw)
    zo = deepspeed_config(make_plan(scenario(**kw), "zero3", 32, r))["zero_optimization"]
    again = backward_gathers(units, zo["stage3_max_reuse_distance"], zo["stage3_param_persistence_threshold"],
                             zo["stage3_prefetch_bucket_size"], zo["stage3_max_live_parameters"], reentrant=reentrant)
    back = [c.elements for c in r.collectives if c.name == "all-gather (backward)"]
    assert back == [sum(-(-n // 32) * 32 for a in again for n in a)]
    assert back[0] < sum(sc.padded_elems(u, 32) for u in sc.units)


_DS_RUN = r"""
import json, os, sys
rank, port = int(sys.argv[1]), sys.argv[2]
CONFIGS = json.loads(sys.argv[3])  # each: checkpoint mode, H, KV, F, blocks, the four settings, q's bias, MoE
os.environ.update(DS_ACCELERATOR="cpu", MASTER_ADDR="127.0.0.1", MASTER_PORT=port, RANK=str(rank),
                  WORLD_SIZE="2", LOCAL_RANK=str(rank))
import torch, deepspeed
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import checkpoint
sys.modules["deepspeed.comm.torch"].build_shm_op = lambda: None  # its inference path, JIT-built
deepspeed.init_distributed(dist_backend="gloo")

from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

from deepspeed.runtime.zero import partition_parameters as PP
import weakref

handles = weakref.WeakSet()  # the calls of several parameters alive: each holds its flat buffer
PP_init, PP_wait = PP.AllGatherCoalescedHandle.__init__, PP.AllGatherCoalescedHandle.wait

def held(extra=0):  # elements held for the parameters: their own storages and the flat buffers
    seen = {}
    for p in model.parameters():
        if p.data.numel() == p.ds_numel:  # whole: gathered, or its call of one in flight
            seen[p.data.untyped_storage().data_ptr()] = p.data.untyped_storage().nbytes()
    for h in list(handles):
        if h.partitions:
            seen[h.partitions[0].untyped_storage().data_ptr()] = h.partitions[0].untyped_storage().nbytes()
    return sum(seen.values()) // 4 + extra

def init(self, *a, **k):
    PP_init(self, *a, **k)
    handles.add(self)

def wait(self, *a, **k):  # after it has copied its parameters out of the flat buffer
    PP_wait(self, *a, **k)
    mode.held = max(mode.held, held())

PP.AllGatherCoalescedHandle.__init__, PP.AllGatherCoalescedHandle.wait = init, wait

class Gathers(TorchDispatchMode):  # elements all-gathered; the most gathered or in flight at a gather;
    # and the elements of calls that gathered several parameters: their send buffer is a slice of
    # the receive buffer, into which the shards were copied (_all_gather_dtype); a call of one
    # sends the shard itself (_all_gather_sequential)
    def __init__(self):
        super().__init__()
        self.elems = self.peak = self.coalesced = self.held = 0
        self.calls = []  # the elements of each call, in order
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func._schema.name
        if func.namespace == "c10d" and ("allgather" in name or "all_gather" in name):
            t = args[0]
            n = sum(x.numel() for x in t) if isinstance(t, (list, tuple)) else t.numel()
            self.elems += n
            self.calls.append(n)
            if isinstance(t, torch.Tensor) and args[1].untyped_storage().data_ptr() == t.untyped_storage().data_ptr():
                self.coalesced += t.numel()
            self.held = max(self.held, held(t.numel()))  # its receive buffer is no one's storage yet
            self.peak = max(self.peak, sum(p.ds_numel for p in model.parameters()
                                           if p.ds_status != ZeroParamStatus.NOT_AVAILABLE))
        return func(*args, **(kwargs or {}))

class Experts(torch.nn.Module):  # one module of three tensors, as an MoE block's experts
    def __init__(self):
        super().__init__()
        self.w1 = torch.nn.Parameter(torch.randn(F, H) * 0.02)
        self.w3 = torch.nn.Parameter(torch.randn(F, H) * 0.02)
        self.w2 = torch.nn.Parameter(torch.randn(H, F) * 0.02)
    def forward(self, h):
        return (torch.nn.functional.silu(h @ self.w1.t()) * (h @ self.w3.t())) @ self.w2.t()

class Block(torch.nn.Module):  # one parameter a module, Llama's order: norm, q, k, v, o, norm, w1, w3, w2
    def __init__(self):  # (MOE: w1, w3, w2 one module of three)
        super().__init__()
        self.n1 = torch.nn.LayerNorm(H, bias=False)
        self.q = torch.nn.Linear(H, H, bias=BIAS)
        self.k = torch.nn.Linear(H, KV, bias=False)
        self.v = torch.nn.Linear(H, KV, bias=False)
        self.o = torch.nn.Linear(H, H, bias=False)
        self.n2 = torch.nn.LayerNorm(H, bias=False)
        if MOE:
            self.experts = Experts()
        else:
            self.w1 = torch.nn.Linear(H, F, bias=False)
            self.w3 = torch.nn.Linear(H, F, bias=False)
            self.w2 = torch.nn.Linear(F, H, bias=False)
    def forward(self, x):
        h = self.n1(x)
        x = x + self.o(self.q(h) + torch.cat([self.k(h), self.v(h)] * (H // (2 * KV)), -1))
        h = self.n2(x)
        if MOE:
            return x + self.experts(h)
        return x + self.w2(torch.nn.functional.silu(self.w1(h)) * self.w3(h))

class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = torch.nn.ModuleList(Block() for _ in range(NB))
    def forward(self, x):
        for b in self.blocks:
            x = checkpoint(b, x, use_reentrant=reentrant) if checkpointed else b(x)
        return x

for index, (ck, H, KV, F, NB, reuse, persist, prefetch, live, BIAS, MOE) in enumerate(CONFIGS):
    # one engine after another in the same two processes (importing deepspeed twice per
    # configuration took most of the test's time); Block and Model read these globals
    reentrant, checkpointed = ck == "1", ck != "none"
    cfg = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "train_batch_size": 2,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
           "zero_optimization": {"stage": 3, "stage3_max_reuse_distance": reuse,
                                 "stage3_param_persistence_threshold": persist,
                                 "stage3_prefetch_bucket_size": prefetch, "stage3_max_live_parameters": live}}
    torch.manual_seed(0)
    model = Model()
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    x = torch.randn(2, 8, H, requires_grad=True)
    per_step = []
    for step in range(4):  # the trace is recorded in the first two; then it runs as recorded
        with Gathers() as mode:
            g = mode
            out = engine(x)
            at_loss = held()  # what is held while the loss runs: after forward, before backward
            engine.backward(out.pow(2).mean())
        engine.step()
        per_step.append([g.elems, g.peak, g.coalesced, g.calls, g.held, at_loss])
    if rank == 0:
        print("GATHERED", index, json.dumps(per_step), flush=True)
    torch.distributed.barrier()
    del engine, model
sys.stdout.flush()
os._exit(0)  # no interpreter teardown: gloo's threads (tests/test_deepspeed_reduce.py)
"""

# DeepSpeed's defaults divided by 4096, with blocks shaped like Llama 3.1 70B's (8192 wide, 1024
# of keys and values, 28672 of MLP: each matrix / 4096 = 128 x 128, 128 x 16, 128 x 448) and 8B's
# (64 x 64, 64 x 16, 64 x 224): the same ratios of block, prefetch bucket, live parameters and
# reuse distance (reuse, persistence, prefetch bucket, live). Norms stay persistent, as 8192 and
# 4096 are under 1e5. TIGHT: a shorter reuse distance and live limit (0.8 and 1 of a 70B-shaped
# block), where the reentrant and non-reentrant orders gather differently.
DEFAULTS = (1_000_000_000 // 4096, 200, 50_000_000 // 4096, 1_000_000_000 // 4096)
TIGHT = (167_116, 200, 10_444, 208_896)
# zplan's export (deepspeed.stage3_settings, resharded): every parameter sharded and released
# after use, a unit (here a block) prefetched, two units live; EXPORT_NO_PREFETCH: --no-prefetch
EXPORT, EXPORT_NO_PREFETCH = "export", "export-no-prefetch"
EXPORT_KEPT = "export-kept"  # zero3-noreshard's export: nothing released (reuse distance 1e12)
B70, B8 = (128, 16, 448), (64, 16, 224)
B8_BIAS = (64, 16, 224, True)  # 8B-shaped, its q with a bias (a review: one call of both, which copies)
# 8B-shaped, its MLP one module of three tensors (an MoE block's experts): at DeepSpeed's defaults
# scaled (a prefetch bucket of 12,207 elements against 14,336 a tensor) each prefetch stops inside it
B8_MOE = (64, 16, 224, False, True)


CONFIGS = [  # shape, blocks, settings, reentrant, checkpointed
    (B70, 6, DEFAULTS, True, True), (B8, 6, DEFAULTS, False, True), (B8, 4, DEFAULTS, True, True),
    (B70, 4, TIGHT, True, True), (B70, 4, TIGHT, False, True),
    (B70, 6, EXPORT, False, True), (B8, 4, EXPORT, True, False), (B70, 4, EXPORT_NO_PREFETCH, True, True),
    (B8, 4, EXPORT_KEPT, False, True), (B8_BIAS, 4, EXPORT, False, True), (B8_BIAS, 4, EXPORT_NO_PREFETCH, True, True),
    # a review's: the reuse walk counts a module's persistent bias too (at the edge of the window);
    # DeepSpeed's defaults with a persistent bias beside its sharded weight (a call of one)
    (B8_BIAS, 2, (39072, 200, 0, 10**9), True, True), (B8_BIAS, 4, DEFAULTS, False, True),
    # DeepSpeed's prefetch queue holds parameters: a prefetch stops inside a module (a review's,
    # failed while zplan prefetched whole modules: norm and q's weight fill the bucket, q's bias
    # waits for q's own fetch), and inside an MoE block's experts
    (B8_BIAS, 2, (0, 0, 4160, 10**9), False, True), (B8_MOE, 4, DEFAULTS, False, True),
    (B8_MOE, 2, DEFAULTS, True, False),
    # nothing released, and a prefetched call not yet waited on when all is gathered: its flat
    # buffer is held after that (a review's; zplan stopped its walk there and missed it)
    (B8, 1, (10**12, 0, 100, 10**12), True, True),
    # two of the review's fourteen further settings, exact on every figure: biased blocks with
    # every bias sharded and a bucket over three 8B-shaped weights; a one-element bucket (one
    # parameter a prefetch) under a live limit of a few weights, a persistence above the norms
    (B8_BIAS, 3, (30000, 0, 20000, 10**9), True, True), (B8, 2, (100000, 5000, 1, 6000), False, True)]


def _config(shape, blocks, settings, checkpointed):
    """(the block as modules, its parameters' elements, the units, the four settings)."""
    H, KV, F, *flags = shape
    bias, moe = (list(flags) + [False, False])[:2]
    q = (H * H, H) if bias else H * H  # a module of two parameters: one entry, a tuple
    mlp = ((H * F, H * F, H * F),) if moe else (H * F, H * F, H * F)
    block = (H, q, H * KV, H * KV, H * H, H) + mlp
    flat = [n for m in block for n in (m if isinstance(m, tuple) else (m,))]
    units = tuple((block, checkpointed) for _ in range(blocks))
    if settings in (EXPORT, EXPORT_NO_PREFETCH):  # export.deepspeed_config's keys for blocks as units
        settings = (0, 0, sum(flat) if settings == EXPORT else 0, 2 * sum(flat))
    if settings == EXPORT_KEPT:  # deepspeed.stage3_settings without resharding
        settings = (10**12, 0, sum(flat), 10**12)
    return block, flat, units, settings


@pytest.fixture(scope="module")
def deepspeed_runs(tmp_path_factory):
    """Every configuration of CONFIGS run by DeepSpeed's own ZeRO-3, one engine after another in
    one pair of gloo ranks: per configuration, per step, (elements gathered, the most gathered
    or in flight, elements in calls of several, each call's elements, the most held). Once per
    session: under pytest-xdist the first worker to need them runs them and leaves them in the
    session's shared temporary folder for the other (which waits on the lock), rather than each
    worker that draws one of these tests running every engine itself."""
    pytest.importorskip("deepspeed")
    run = os.environ.get("PYTEST_XDIST_TESTRUNUID")  # one per session, the same in every worker
    if not os.environ.get("PYTEST_XDIST_WORKER") or not run:  # not distributed
        return _deepspeed_runs(tmp_path_factory)
    shared = tmp_path_factory.getbasetemp().parent  # the session's folder above each worker's
    with open(shared / f"deepspeed_runs-{run}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        done = shared / f"deepspeed_runs-{run}.json"
        if done.exists():
            return {int(k): v for k, v in json.loads(done.read_text()).items()}
        runs = _deepspeed_runs(tmp_path_factory)
        done.write_text(json.dumps(runs))
        return runs


def _deepspeed_runs(tmp_path_factory) -> dict[int, list]:
    from zplan.netutil import free_port

    script = tmp_path_factory.mktemp("ds") / "ds_zero3.py"
    script.write_text(_DS_RUN)
    configs = []
    for shape, blocks, settings, reentrant, checkpointed in CONFIGS:
        H, KV, F, *flags = shape
        bias, moe = (list(flags) + [False, False])[:2]
        configs.append([str(int(reentrant)) if checkpointed else "none", H, KV, F, blocks,
                        *_config(shape, blocks, settings, checkpointed)[3], bool(bias), bool(moe)])
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    port = str(free_port())
    procs = [subprocess.Popen([sys.executable, str(script), str(r), port, json.dumps(configs)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env) for r in range(2)]
    outs = [p.communicate(timeout=400) for p in procs]
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, err[-3000:]
    runs = {}
    for line in outs[0][0].splitlines():
        if line.startswith("GATHERED "):
            _, index, data = line.split(" ", 2)
            runs[int(index)] = json.loads(data)
    assert sorted(runs) == list(range(len(CONFIGS)))
    return runs


@pytest.mark.slow  # two processes importing deepspeed, then eleven engines: about a minute
@pytest.mark.timeout(420)
@pytest.mark.parametrize("index", range(len(CONFIGS)))
def test_deepspeeds_own_zero3_gathers_what_zplan_prices(deepspeed_runs, index):
    """DeepSpeed's ZeRO-3 (partitioned_param_coordinator.py: its trace, release rule and
    prefetcher) on two gloo ranks, checkpointed blocks (or not), its settings scaled with the model: the
    elements it gathers in a step, once its trace is recorded, are those zplan prices (every
    parameter once for the forward, and backward_gathers for the recompute and backward), to the
    element. Reentrant (Hugging Face's default) and non-reentrant checkpoints; the whole model
    under the live limit (four 8B-shaped blocks: where the blocks' own fetches, which hold no
    parameter, move the prefetcher). Where the other checkpoint order, or no prefetch, would
    gather otherwise, the test says so: it would catch either. Also at the settings zplan's
    export writes (reuse distance and persistence 0, a unit prefetched or none, two units live),
    with and without checkpoints, and without resharding (nothing released): there DeepSpeed
    gathers neither FSDP's once more per unit (what zplan priced an export at) nor its defaults'
    pattern. In every configuration also the calls it issues, in order (comm.ds_gathers prices
    them), the elements of its calls of several parameters (which copy: unit_ops.fsdp_copies)
    and what it holds for the parameters, their storages and the calls' flat buffers
    (deepspeed.coordinate's peak_held, which memory prices), at its most and while the loss runs
    (held_at_loss)."""
    shape, blocks, named, reentrant, checkpointed = CONFIGS[index]
    block, flat, units, settings = _config(shape, blocks, named, checkpointed)
    reuse, persist, prefetch, live = settings

    def priced(reentrant: bool, prefetch: int = prefetch) -> int:
        again = backward_gathers(units, reuse, persist, prefetch, live, reentrant=reentrant)
        return blocks * sum(n for n in flat if n > persist) + sum(map(sum, again))

    per_step, peaks, coalesced, calls, held, at_loss = zip(*deepspeed_runs[index])
    assert per_step[1] == per_step[2] == per_step[3]  # the trace recorded in the first step
    assert per_step[3] == priced(reentrant)
    # the most it holds gathered (persistent parameters always): what memory prices it at
    sim = coordinate(units, reuse, persist, prefetch, live, reentrant=reentrant)
    assert peaks[3] == sim.peak_gathered, (peaks, sim.peak_gathered)
    # and what it holds for them: beside the gathered parameters, each call of several
    # parameters' flat buffer from its first wait until the last of them is fetched
    assert held[3] == sim.peak_held, (held, sim.peak_held)
    # and while the loss runs, between the forward and the backward (memory prices the loss's
    # events at it: memory.deepspeed_loss_buffers)
    assert at_loss[3] == sim.held_at_loss, (at_loss, sim.held_at_loss)
    # what it gathers in calls of several parameters, which copy (unit_ops.fsdp_copies)
    assert coalesced[3] == sum(sum(f) + sum(b) for f, b in sim.coalesced), (coalesced, sim.coalesced)
    if prefetch and named in (DEFAULTS, TIGHT, EXPORT, EXPORT_KEPT):
        # calls of several parameters and of one (but where nothing is released: all of several)
        assert 0 < coalesced[3] < per_step[3] or named == EXPORT_KEPT and coalesced[3] == per_step[3]
    # and the calls it issues, in order, each fetch and each prefetch one (comm.ds_gathers times
    # them; every shape here divides by the two ranks, so no padding)
    assert calls[3] == [sum(n for _, n, _ in c) for c in sim.calls], (calls[3], sim.calls)
    if prefetch > 1 and reuse < 10**12 and (checkpointed or named == EXPORT):
        # the prefetcher's marks count (without checkpoints at the defaults they gather nothing
        # more, nor where nothing is released, nor with a one-element bucket here: there its
        # calls and what is held, above, tell)
        assert priced(reentrant, prefetch=0) != per_step[3]
    if checkpointed and (named in (TIGHT, EXPORT) or shape == B8 and not reentrant and named == DEFAULTS):
        assert priced(not reentrant) != per_step[3]  # and so does the order
    if named in (EXPORT, EXPORT_NO_PREFETCH):  # not every unit once more, as FSDP (zplan's price
        assert per_step[3] != 2 * blocks * sum(flat)  # of an export until 2026-12: 0.81-1.5 x off)
    if named == EXPORT_KEPT:  # every parameter once, and all of them held by the forward's end
        assert per_step[3] == blocks * sum(flat) and peaks[3] == blocks * sum(flat)


def test_a_units_modules_are_its_parameters_grouped():
    """What DeepSpeed's coordinator fetches in one call each (comm._ds_parameters): every preset
    model's units, as modules, hold exactly their parameters; a Linear with a bias is one
    module of two (Qwen2.5's q, k and v; GPT-2's every Linear and LayerNorm), an MoE block's
    experts one module of all their tensors (transformers 5.x's experts module), a bias-free
    Llama block nine modules of one."""
    import math

    from zplan import arch, presets
    from zplan.comm import _ds_parameters

    def flat(mods):
        return sorted(n for e in mods for n in (e if isinstance(e, tuple) else (e,)))

    for name in presets.names("models"):
        sc = scenario(model=name, gpus=8, layout="zero")
        for u in sc.units:
            mods = _ds_parameters(sc, u)
            assert flat(mods) == sorted(math.prod(s) for s in u.shapes), (name, u.name)
            if u.blocks and sc.model.total_params is None:  # grouped, not the by-parameter fallback
                assert len(mods) == len(arch.block_modules(sc.model, "zero")) * u.blocks, (name, u.name)
    sc = scenario(model="qwen2.5-7b", gpus=8, layout="zero")
    block = _ds_parameters(sc, sc.units[1])
    assert block[1] == (3584 * 3584, 3584) and block[2] == (512 * 3584, 512) and len(block) == 9
    llama = scenario(model="llama-3.1-8b", gpus=8, layout="zero")
    assert all(isinstance(n, int) for n in _ds_parameters(llama, llama.units[1]))
    moe = scenario(model="mixtral-8x7b", gpus=8, layout="zero")
    assert _ds_parameters(moe, moe.units[1])[-1] == (8 * 2 * 14336 * 4096, 8 * 4096 * 14336)
