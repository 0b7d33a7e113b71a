"""DeepSpeed ZeRO-3 at its defaults releases a module's parameters after use unless they come
back within stage3_max_reuse_distance (1e9) elements of the module trace
(deepspeed.backward_gathers); what it gathers again in backward follows, worked here by hand."""

import math

from zplan.deepspeed import backward_gathers
from tests.helpers import est, scenario


def test_two_wrapped_units_by_hand():
    """A then B, one 6e8-element parameter each, both checkpointed. Trace: A, B | B (recompute),
    B (backward), A (recompute), A (backward). B's forward is followed by its own recompute: kept,
    never gathered in backward. A's next use is 1.2e9 elements away (B, B): released after the
    forward, gathered for its recompute, then kept for its backward, the next step."""
    assert backward_gathers((((600_000_000,), True), ((600_000_000,), True))) == ((600_000_000,), ())


def test_unwrapped_units_by_hand():
    """Without recompute: A, B | B, A. B's backward follows its forward: kept. A comes back
    after 2 x 4e8 = 8e8 elements, within the distance: kept too. With 6e8 each it is 1.2e9 away."""
    assert backward_gathers((((400_000_000,), False), ((400_000_000,), False))) == ((), ())
    assert backward_gathers((((600_000_000,), False), ((600_000_000,), False))) == ((600_000_000,), ())


def test_persistent_parameters_are_never_gathered_again():
    """At most 1e5 elements (stage3_param_persistence_threshold): kept whole by every rank."""
    assert backward_gathers((((100_000, 600_000_000), True), ((600_000_000,), True))) == ((600_000_000,), ())


def _again(model):
    sc = scenario(model=model, gpus=32, layout="zero", deepspeed_defaults=True, checkpointing="full")
    units = tuple((tuple(math.prod(s) for s in u.shapes), bool(u.blocks)) for u in sc.units)
    return sc, backward_gathers(units)


def test_a_70b_block_gathers_its_attention_weights_twice_in_backward():
    """Llama 3.1 70B (856M elements a block): after the recompute, wq/wk/wv/wo's next use (their
    backward) lies beyond 1e9 elements (the MLP's recompute and backward come between), the
    MLP's within it: the recompute gathers the 7 linears, the backward the 4 attention ones
    again. The head's backward follows its forward: never again. The embedding: once."""
    sc, again = _again("llama-3.1-70b")
    h, f, kv = 8192, 28672, 1024
    linears = (h * h, kv * h, kv * h, h * h, f * h, f * h, h * f)
    for i, u in enumerate(sc.units):
        if u.blocks:
            assert again[i] == linears + (h * h, kv * h, kv * h, h * h)[::-1], u.name
    assert again[-1] == () and again[0] == (128256 * h,)


def test_an_8b_block_keeps_all_its_weights_from_the_recompute():
    sc, again = _again("llama-3.1-8b")
    h, f, kv = 4096, 14336, 1024
    linears = (h * h, kv * h, kv * h, h * h, f * h, f * h, h * f)
    assert all(again[i] == linears for i, u in enumerate(sc.units) if u.blocks)
    assert again[-1] == ()


def test_the_step_prices_those_gathers():
    """The backward all-gather collective holds exactly those elements (padded to the group),
    and it costs time beside compute; a plan that writes its own buckets (no
    --deepspeed-defaults) gathers every unit whole again, as FSDP does."""
    kw = dict(model="llama-3.1-70b", gpus=32, seq_len=1024, layout="zero", checkpointing="full")
    r = est("zero3", deepspeed_defaults=True, **kw)
    sc, _ = _again("llama-3.1-70b")
    # by hand: each of 80 blocks, its 7 linears for the recompute and wq, wk, wv, wo again;
    # the embedding once; the head never (all divide by 32: no padding)
    h, f, kv = 8192, 28672, 1024
    block = 2 * h * h + 2 * kv * h + 3 * f * h + (2 * h * h + 2 * kv * h)
    back = [c for c in r.collectives if c.name == "all-gather (backward)"]
    assert len(back) == 1 and back[0].elements == 80 * block + 128256 * h
    fwd = [c for c in r.collectives if c.name == "all-gather (forward)"][0]
    assert back[0].elements / fwd.elements > 1.1  # 1.176 of each block, no head
    whole = est("zero3", **kw)
    assert [c.elements for c in whole.collectives if c.name == "all-gather (backward)"] == \
        [sum(sc.padded_elems(u, 32) for u in sc.units)]
