"""What DeepSpeed ZeRO-3's reduce stream holds: the flat copy its coalesced reduce-scatter makes of
a bucket, and the buckets backward fills (zplan/deepspeed.py reduce_scatter_copy_elems), with
DeepSpeed's own reduce_scatter_coalesced as the oracle of the copy."""

import pytest

from zplan.deepspeed import REDUCE_BUCKET_ELEMS, reduce_scatter_copy_elems


def _deepspeed_copy(sizes, world, monkeypatch):
    """The elements of the tensor DeepSpeed's reduce_scatter_coalesced (v0.19) concatenates for
    one bucket of gradients of these sizes over `world` ranks (0 where it reduces in place)."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("deepspeed")
    from deepspeed.runtime.comm import coalesced_collectives as cc

    made = []

    def spy(fn):
        def call(*args, **kwargs):
            out = fn(*args, **kwargs)
            made.append(out.numel())
            return out
        return call

    monkeypatch.setattr(cc, "instrument_w_nvtx", spy)
    monkeypatch.setattr(cc.dist, "get_rank", lambda group=None: 0)
    monkeypatch.setattr(cc.dist, "get_world_size", lambda group=None: world)
    monkeypatch.setattr(cc, "_torch_reduce_scatter_fn", lambda *a, **k: None)
    cc.reduce_scatter_coalesced([torch.zeros(n) for n in sizes])
    return max(made, default=0)


@pytest.mark.parametrize("sizes, world", [((12, 7, 5), 4), ((1000,), 8), ((1001,), 8), ((3, 3), 3), ((64, 1), 8)])
def test_one_bucket_is_copied_as_deepspeed_copies_it(sizes, world, monkeypatch):
    """A bucket of several gradients is copied whole, each padded to a multiple of the ranks; one
    gradient that divides evenly is reduced in place."""
    assert reduce_scatter_copy_elems(sizes, world) == _deepspeed_copy(sizes, world, monkeypatch)


def test_backward_fills_buckets_as_stage3_does():
    """stage3.py reduce_independent_p_g_buckets_and_remove_grads: a gradient that would take the
    bucket past reduce_bucket_size reduces the bucket first; one larger than the bucket goes alone.
    Llama 3.1 8B in backward order, worked by hand: the head (525,336,576) alone, in place over 8
    ranks; then the final norm, blocks 31 and 30 (218,112,000 each) and block 29's down projection
    (58,720,256): 494,948,352, where its up projection would pass 5e8. The copy is that bucket."""
    B = REDUCE_BUCKET_ELEMS
    head, norm, emb = 128256 * 4096, 4096, 128256 * 4096
    forward = [4096, 4096 * 4096, 1024 * 4096, 1024 * 4096, 4096 * 4096, 4096] + [4096 * 14336] * 3
    backward = [head, norm] + [n for _ in range(32) for n in reversed(forward)] + [emb]
    assert sum(forward) == 218_112_000
    assert reduce_scatter_copy_elems(tuple(backward), 8) == 494_948_352
    assert reduce_scatter_copy_elems((B + 8,), 8) == 0  # alone, and divisible: in place
    assert reduce_scatter_copy_elems((B + 1,), 8) == B + 8  # alone, padded: copied


def test_the_reserve_takes_the_models_gradients_in_backward_order():
    """Llama 3.1 8B, ZeRO-3 at DeepSpeed's defaults over 8 GPUs: the worked bucket above in bf16,
    and with the optimizer offloaded the embedding's partition (128256 x 4096 / 8) in bf16 and in
    fp32 beside it, each a segment rounded up to 2 MiB; nothing where the reduction has no stream
    of its own or DeepSpeed's buckets are not its defaults."""
    from tests.helpers import scenario
    from zplan.deepspeed import reduce_stream_bytes
    from zplan.strategies import effective

    def mib2(n):
        return -(-n // (2 << 20)) * (2 << 20)

    kw = dict(model="llama-3.1-8b", gpus="8", cluster="hgx-h200", reduce_dtype="bf16")
    sc = scenario(layout="zero", deepspeed_defaults=True, **kw)
    part = 128256 * 4096 // 8
    assert reduce_stream_bytes(sc, effective("zero3", "zero")) == mib2(494_948_352 * 2)
    assert reduce_stream_bytes(sc, effective("offload-opt", "zero")) == (
        mib2(494_948_352 * 2) + mib2(part * 2) + mib2(part * 4))
    assert reduce_stream_bytes(sc, effective("zero2", "zero")) == 0  # stage 2: not this path
    assert reduce_stream_bytes(scenario(layout="zero", **kw), effective("zero3", "zero")) == 0
    assert reduce_stream_bytes(scenario(layout="zero", deepspeed_defaults=True, overlap=False, **kw),
                               effective("zero3", "zero")) == 0
    assert reduce_stream_bytes(scenario(layout="torch", **kw), effective("zero3", "torch")) == 0
