"""Properties over random inputs (hypothesis)."""

from hypothesis import HealthCheck, given, settings, strategies as st

from zplan.estimate import estimate_one
from tests.helpers import scenario

MODELS = st.sampled_from(["tiny", "llama-3.1-8b", "mixtral-8x7b", "gpt3-175b", "qwen2.5-7b"])
LAYOUT = st.sampled_from(["zero", "torch"])
N = st.integers(min_value=1, max_value=4096)
SET = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _state(model, n, layout, name, **kw):
    return estimate_one(scenario(model=model, gpus=n, layout=layout, **kw), name).memory.model_state_bytes


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
@given(st.integers(min_value=1, max_value=10**12), N)
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
@given(st.integers(min_value=1, max_value=10**13), st.integers(min_value=1, max_value=10**6))
def test_huge_inputs_compute_without_overflow(params, n):
    import math
    r = estimate_one(scenario(params=str(params), gpus=n), "zero3")
    m = r.memory
    assert isinstance(m.total_bytes, int) and m.total_bytes > 0
    assert math.isfinite(r.timing.step_s) and r.timing.step_s > 0
