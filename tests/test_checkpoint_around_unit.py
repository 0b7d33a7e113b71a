"""A reentrant checkpoint around a sharded FSDP1 unit (Hugging Face's gradient_checkpointing_enable
around FSDP-wrapped decoder layers, before transformers 4.52): each checkpointed block is gathered
twice in backward, neither prefetched (policy.regathers_for_recompute)."""

import pytest

from zplan.errors import UsageError
from tests.helpers import est, scenario

RUN = dict(model="llama-3.1-70b", gpus=32, seq_len=1024, layout="torch", checkpointing="full",
           embed_head_unit="root-kept", reduce_dtype="bf16")


def pair(**kw):
    base = dict(RUN, **kw)
    return est("zero3", **base), est("zero3", checkpoint_wraps_unit=True, **base)


def test_each_checkpointed_block_is_gathered_again_and_it_is_exposed():
    inside, around = pair(checkpoint_early_stop=False)
    sc = scenario(**RUN)
    blocks = [u for u in sc.units if u.blocks]
    D = 32
    # traffic: one more all-gather of every block unit (bf16), counted from the units themselves
    extra = sum(sc.padded_elems(u, D) for u in blocks)
    assert around.elements_per_step - inside.elements_per_step == extra
    assert around.bytes_per_step - inside.bytes_per_step == 2 * extra
    again = [c for c in around.collectives if "again after the recompute" in c.name]
    assert len(again) == 1 and again[0].elements == extra and again[0].group_size == D
    # time (FSDP1's order): neither backward gather is prefetched, both wait for the next
    # unit's reduce-scatter on the communicator; the recompute waits for the first with nothing
    # beside it, the second runs beside the recompute's forward
    units = around.timing.units
    j = next(i for i, u in enumerate(units) if u.name == "blocks.40")
    u, after = units[j], units[j + 1]
    assert u.backward_exposed_s == pytest.approx(
        after.reduce_s + u.all_gather_s + max(0.0, u.all_gather_s - u.forward_s), rel=1e-12)
    ag = sum(x.all_gather_s for x in inside.timing.units if x.name.startswith("blocks"))
    exposed = around.timing.exposed_comm_s - inside.timing.exposed_comm_s
    assert exposed > ag  # at least one bare gather a block, and the reduce-scatters it waits for
    more_compute = around.timing.compute_s - inside.timing.compute_s
    assert 0 < more_compute < 0.3 * ag  # FSDP2's copy-in and copy-out once more: HBM passes
    assert around.timing.contention_s <= inside.timing.contention_s  # less hides
    assert around.timing.step_s - inside.timing.step_s == pytest.approx(
        exposed + more_compute + around.timing.contention_s - inside.timing.contention_s
        + around.timing.slowest_rank_s - inside.timing.slowest_rank_s, rel=1e-9)
    # memory: the gathered unit is freed after the recompute and gathered again: the same peak
    assert around.memory.reserved_bytes == inside.memory.reserved_bytes


def test_a_non_reentrant_checkpoint_gathers_once_wherever_it_sits():
    """Non-reentrant: the recompute runs after the unit's pre-backward hook, whose unshard
    FSDP's pre-forward then skips."""
    inside, around = pair(checkpoint_early_stop=True)
    assert around.timing.as_dict() == inside.timing.as_dict()
    assert around.bytes_per_step == inside.bytes_per_step


def test_every_k_regathers_only_the_wrapped_blocks():
    inside, around = pair(checkpointing="every-k", checkpoint_every=4, checkpoint_early_stop=False)
    sc = scenario(**dict(RUN, checkpointing="every-k", checkpoint_every=4))
    wrapped = [u for u in sc.units if u.blocks and (u.first_block + 1) % 4 == 0]
    assert len(wrapped) == 20
    assert around.elements_per_step - inside.elements_per_step == sum(sc.padded_elems(u, 32) for u in wrapped)


def test_no_unit_resharded_after_forward_no_second_gather():
    a = est("zero3-noreshard", checkpoint_wraps_unit=True, checkpoint_early_stop=False,
            **dict(RUN, gpus=32))
    b = est("zero3-noreshard", checkpoint_early_stop=False, **dict(RUN, gpus=32))
    assert a.bytes_per_step == b.bytes_per_step


@pytest.mark.parametrize("kw,needle", [
    (dict(layout="zero"), "--layout torch"),
    (dict(checkpointing="none"), "wraps no block"),
    (dict(checkpointing="attention"), "wraps no block"),
])
def test_where_it_means_nothing_it_is_refused(kw, needle):
    with pytest.raises(UsageError, match=needle):
        scenario(**dict(RUN, checkpoint_wraps_unit=True, **kw))


def test_recommend_says_what_a_non_reentrant_checkpoint_would_save():
    from zplan.recommend import search
    sc = scenario(**dict(RUN, checkpoint_early_stop=False, checkpoint_wraps_unit=True))
    rec = search(sc, 64, families=["zero3"])
    note = [f for f in rec.flags if "use_reentrant" in f]
    assert len(note) == 1
    w = rec.winner
    t = w.sc.train
    alt = est("zero3", model=RUN["model"], gpus=32, seq_len=1024, layout="torch",
              checkpointing=t.checkpointing, checkpoint_first=t.checkpoint_first,
              checkpoint_every=t.checkpoint_every, embed_head_unit="root-kept", reduce_dtype="bf16",
              micro_batch=t.micro_batch, grad_accum=t.grad_accum, checkpoint_wraps_unit=True,
              blocks_per_unit=t.blocks_per_unit, prefetch=t.prefetch)
    from zplan.units import fmt_s
    assert f"would take {fmt_s(w.step_s - alt.timing.step_s)} off each step" in note[0]
    # where the checkpoint is non-reentrant already, nothing to say
    plain = search(scenario(**dict(RUN, checkpoint_wraps_unit=True)), 64, families=["zero3"])
    assert not [f for f in plain.flags if "use_reentrant" in f]
