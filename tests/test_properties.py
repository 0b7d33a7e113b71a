"""Properties over random inputs (hypothesis)."""

from hypothesis import HealthCheck, assume, given, settings, strategies as st

from zplan.estimate import estimate_one
from tests.helpers import scenario

MODELS = st.sampled_from(["tiny", "llama-3.1-8b", "mixtral-8x7b", "gpt3-175b", "qwen2.5-7b"])
LAYOUT = st.sampled_from(["zero", "torch"])
N = st.integers(min_value=1, max_value=4096)
SYNTHETIC_MIN_PARAMS = 12 * 128**2 + 2 * 32000 * 128  # the smallest count --params takes (zplan.arch)
SET = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _state(model, n, layout, name, **kw):
    r = estimate_one(scenario(model=model, gpus=n, layout=layout, **kw), name)
    # a configuration the runner refuses (an MoE model's uneven dim-1 expert shard) has no state
    assume(r.memory is not None)
    return r.memory.model_state_bytes


@SET
@given(MODELS, N, LAYOUT)
def test_stages_are_ordered(model, n, layout):
    s = {k: _state(model, n, layout, k) for k in ("ddp", "zero1", "zero2", "zero3")}
    assert s["zero3"] <= s["zero2"] <= s["zero1"] <= s["ddp"]


@SET
@given(MODELS, LAYOUT)
def test_at_one_gpu_the_stages_agree(model, layout):
    s = {_state(model, 1, layout, k) for k in ("ddp", "zero1", "zero2", "zero3", "zero3-noreshard")}
    assert len(s) == 1


@SET
@given(MODELS, N, N, LAYOUT, st.sampled_from(["ddp", "zero1", "zero2", "zero3", "offload-all"]))
def test_model_state_never_grows_with_n(model, a, b, layout, name):
    lo, hi = sorted((a, b))
    assert _state(model, hi, layout, name) <= _state(model, lo, layout, name)


@SET
@given(st.integers(min_value=SYNTHETIC_MIN_PARAMS, max_value=10**12), N)
def test_padding_is_less_than_n_per_unit(params, n):
    sc = scenario(params=str(params), gpus=n)  # zero layout: flat buffer per unit
    for u in sc.units:
        assert 0 <= sc.padded_elems(u, n) - u.numel < n


@SET
@given(MODELS, N)
def test_fsdp2_pads_each_parameter_on_dim0(model, n):
    import math
    sc = scenario(model=model, gpus=n, layout="torch")
    for u in sc.units[:3]:
        for s in u.shapes:
            rest = math.prod(s[1:])
            padded = -(-s[0] // n) * n * rest
            assert 0 <= padded - math.prod(s) < n * rest


@SET
@given(st.one_of(st.integers(min_value=SYNTHETIC_MIN_PARAMS, max_value=10**13), st.integers(3 * 10**12, 10**13)),
       st.integers(min_value=1, max_value=10**6))
def test_huge_inputs_compute_without_overflow(params, n):
    import math
    r = estimate_one(scenario(params=str(params), gpus=n), "zero3")
    m = r.memory
    assert isinstance(m.total_bytes, int) and m.total_bytes > 0
    assert math.isfinite(r.timing.step_s) and r.timing.step_s > 0


# ---------------------------------------------------------------- scale edges (issue 10 item 7)

EDGE_MODELS = st.builds(
    dict, num_layers=st.sampled_from([1, 2, 3, 256]), heads=st.sampled_from([1, 8]),
    head_dim=st.sampled_from([1, 64, 128]), ffn_hidden=st.sampled_from([1, 64, 2**16]),
    vocab_size=st.sampled_from([1, 50_000, 2**27]), experts=st.sampled_from([0, 8, 100]),
    tied=st.booleans())
STRATEGY = st.sampled_from(["ddp", "zero1", "zero2", "zero3", "zero3-noreshard", "hsdp",
                            "offload-opt", "offload-all"])


def _numbers(obj):
    if isinstance(obj, dict):
        for v in obj.values():
            yield from _numbers(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _numbers(v)
    elif isinstance(obj, (int, float)) and not isinstance(obj, bool):
        yield obj


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(EDGE_MODELS, st.sampled_from([1, 7, 1024, 10**6]), STRATEGY, LAYOUT)
def test_scale_edges_give_finite_non_negative_figures(m, n, name, layout):
    """One-layer and 256-layer models, a vocabulary larger than the rest of the model,
    100 experts a block, a million GPUs: every figure finite and non-negative (headroom is signed)."""
    import dataclasses
    import math

    from zplan.specs import ModelSpec

    h = m["heads"] * m["head_dim"]
    model = ModelSpec(name="edge", num_layers=m["num_layers"], hidden=h, ffn_hidden=m["ffn_hidden"],
                      num_heads=m["heads"], num_kv_heads=1, vocab_size=m["vocab_size"],
                      num_experts=m["experts"], experts_per_token=min(2, m["experts"]),
                      tied_embeddings=m["tied"], max_seq_len=4096)
    sc = dataclasses.replace(scenario(model="tiny", gpus=n, layout=layout, seq_len=256), model=model)
    r = estimate_one(sc, name)
    if r.memory is None:
        return  # unavailable for this configuration, with its reason
    figures = dict(r.memory.as_dict(), step_s=r.timing.step_s, mfu=r.timing.mfu,
                   tokens=r.timing.tokens_per_s_per_gpu, elements=r.elements_per_step,
                   bytes=r.bytes_per_step)
    for k, v in figures.items():
        assert math.isfinite(v) and v >= 0, (k, v)
    assert r.memory.total_bytes >= r.memory.params_bytes
    assert r.timing.step_s > 0 and 0 < r.timing.mfu
    assert all(math.isfinite(x) and x >= 0 for x in _numbers(r.as_dict()) if x is not r.headroom_bytes)
