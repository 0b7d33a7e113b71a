"""Two facts of the step's backward in the memory timeline (memory_timeline.fsdp_events), each
against bytes counted by hand: the step keeps its logits referenced until `loss.backward()`
returns (zplan/trainer/loop.py), and FSDP2 reshards a unit's weights before its reduce-scatter
(FSDPParamGroup.post_backward)."""

from __future__ import annotations

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
    # nothing saved before block 0 (the embedding keeps its integer input only); bf16 logits and
    # the residual stream's gradient
    assert ev.live["activations"] == 2 * S * V + 2 * S * H
    assert ev.live.get("gathered", 0) == 0  # block 0 resharded, nothing else gathered under zero3


def test_backward_of_a_block_holds_the_logits():
    sc = build(ScenarioOptions(model="llama-3.1-8b", gpus="8", layout="torch", seq_len=S, micro_batch=1))
    acts = activations(sc)  # per unit: embeddings, blocks.0, ...
    ev = {e.label: e for e in timeline(sc, effective("zero3", "torch"))}["backward blocks.0"]
    own = acts.saved[0] + acts.saved[1] + acts.recompute[1] + acts.backward_temp[1]
    assert ev.live["activations"] - own == 2 * S * V  # the bf16 logits, still referenced
