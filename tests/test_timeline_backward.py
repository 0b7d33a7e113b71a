"""Facts of the step's backward in the memory timeline (memory_timeline.fsdp_events), each
against bytes counted by hand: the step keeps its logits referenced until `loss.backward()`
returns (zplan/trainer/loop.py), FSDP2 reshards a unit's weights before its reduce-scatter
(FSDPParamGroup.post_backward), and on CPU ranks gloo's reduce-scatter clones its input (held
against torch itself)."""

from __future__ import annotations

import pytest

from zplan.memory import timeline
from zplan.memory_timeline import activations
from zplan.scenario_options import ScenarioOptions, build
from zplan.strategies import effective

S, H, V = 4096, 4096, 128256  # Llama 3.1 8B: seq, hidden, vocabulary


def _events(strategy: str):
    sc = build(ScenarioOptions(model="llama-3.1-8b", gpus="8", layout="torch", seq_len=S, micro_batch=1))
    return {e.label: e for e in timeline(sc, effective(strategy, "torch"))}


def test_reduce_scatter_of_the_first_block_holds_logits_not_its_weights():
    ev = _events("zero3")["reduce-scatter blocks.0"]
    # nothing saved before block 0 (the embedding keeps its integer input only, which with the
    # labels the loop holds: int64); bf16 logits and the residual stream's gradient
    assert ev.live["activations"] == 2 * S * V + 2 * S * H + 2 * 8 * S
    assert ev.live.get("gathered", 0) == 0  # block 0 resharded, nothing else gathered under zero3


def test_backward_of_a_block_holds_the_logits():
    sc = build(ScenarioOptions(model="llama-3.1-8b", gpus="8", layout="torch", seq_len=S, micro_batch=1))
    acts = activations(sc)  # per unit: embeddings, blocks.0, ...
    ev = {e.label: e for e in timeline(sc, effective("zero3", "torch"))}["backward blocks.0"]
    own = acts.saved[0] + acts.saved[1] + acts.recompute[1] + acts.backward_temp[1]
    # the bf16 logits, still referenced; the micro-batch's input ids and labels (int64)
    assert ev.live["activations"] - own == 2 * S * V + 2 * 8 * S


# ------------------------------------------------- gloo's reduce-scatter clones its input

TINY_BLOCK = 2 * 256 * 256 + 2 * 128 * 256 + 3 * 688 * 256 + 2 * 256  # tiny.toml: q, o, k, v, MLP, 2 norms


def _cpu_events(gpu: str, cluster: str, **kw):
    sc = build(ScenarioOptions(model="tiny", gpu=gpu, cluster=cluster, gpus="2", layout="torch",
                               seq_len=64, micro_batch=2, **kw))
    return {e.label: e for e in timeline(sc, effective("zero3", "torch"))}


def test_cpu_ranks_hold_a_second_reduce_scatter_input_at_the_collective():
    """On CPU ranks (gloo) a block's reduce-scatter holds its fp32 input twice, beside the
    sharded output it writes into; on GPUs (NCCL) there is no such moment."""
    cpu = _cpu_events("cpu", "cpu-local")
    at, before = cpu["reduce-scatter blocks.1 (gloo's copy)"], cpu["reduce-scatter blocks.1"]
    assert at.live["reduce_scatter"] == 2 * 4 * TINY_BLOCK  # fp32 reduce dtype, the whole unit
    # the block's sharded gradient (fp32, half of it on 2 ranks) is allocated before the call
    assert at.live["grads"] - before.live["grads"] == 4 * TINY_BLOCK // 2
    assert not any("gloo" in k for k in _cpu_events("h100-sxm", "dgx-h100"))


def test_gloo_copy_after_an_accumulated_gradient_is_dropped():
    """Reducing only on the last micro-batch, the unit's accumulated gradient (fp32, the reduce
    dtype) is copied in and dropped before the collective (post_backward, then foreach_reduce's
    clear), but its last parameter's: foreach_reduce's dim-0 loop variable (`for i, (fsdp_param,
    unsharded_grad) in enumerate(zip(fsdp_params, unsharded_grads))`, in the installed torch's
    _fsdp_collectives.py before the clear) still references it until foreach_reduce returns.
    The gloo event holds the other units' accumulated gradients and that one."""
    import importlib.util
    from pathlib import Path

    spec = importlib.util.find_spec("torch")
    if spec is not None and spec.origin is not None:
        src = (Path(spec.origin).parent / "distributed" / "fsdp" / "_fully_shard" / "_fsdp_collectives.py").read_text()
        loop = src.index("for i, (fsdp_param, unsharded_grad) in enumerate(")
        assert loop < src.index("unsharded_grads.clear()")
    ev = _cpu_events("cpu", "cpu-local", grad_accum=2, reduce_last_only=True)
    at, before = ev["reduce-scatter blocks.1 (gloo's copy)"], ev["reduce-scatter blocks.1"]
    last = 256 * 688  # the block's last parameter, an MLP matrix (688 x 256)
    assert before.live["unsharded_grads"] - at.live["unsharded_grads"] == 4 * TINY_BLOCK - 4 * last


GLOO_PROBE = r'''
import os, sys, torch, torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

class Storages(TorchDispatchMode):
    """The storages of the tensors ops return on the calling thread, as FSDPMemTracker counts
    them: by storage, whatever view of it an op returns."""
    def __init__(self, known):
        super().__init__()
        self.seen = {t.untyped_storage().data_ptr() for t in known}
        self.made = []
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for o in (out if isinstance(out, (tuple, list)) else [out]):
            st = o.untyped_storage() if isinstance(o, torch.Tensor) else None
            if st is not None and st.data_ptr() not in self.seen:
                self.seen.add(st.data_ptr())
                self.made.append(st.nbytes())
        return out

dist.init_process_group("gloo")
n = 1 << 16
inp, out = torch.ones(2 * n), torch.empty(n)
rec = Storages([inp, out])
with rec:
    dist.reduce_scatter_tensor(out, inp)
assert torch.equal(out, torch.full((n,), 2.0))
if dist.get_rank() == 0:
    print("MADE", rec.made)
'''


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_gloo_reduce_scatter_allocates_a_copy_of_its_input(tmp_path):
    """The fact gloo_reduce_scatter_copies_its_input rests on, held against torch itself: a
    reduce_scatter_tensor over gloo makes one storage on the calling thread, the size of its input
    (the clone it all-reduces; the chunk copied out is a view of it)."""
    from tests.helpers import torchrun_probe

    p = torchrun_probe(tmp_path, GLOO_PROBE)
    made = next(line for line in p.stdout.splitlines() if line.startswith("MADE"))
    assert made == f"MADE [{4 * 2 * (1 << 16)}]", made
