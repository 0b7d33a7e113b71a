"""Every strategy, world size and checkpointing mode starts from the same weights: each
parameter's initial value follows from the model's own parameter name (docs/trainer.md)."""

import pytest

torch = pytest.importorskip("torch")


def _initial(checkpointing: str) -> dict:
    from zplan import presets
    from zplan.trainer.model import Transformer, init_weights_
    from zplan.trainer.parallel import apply_checkpointing

    with torch.device("meta"):
        m = Transformer(presets.model("tiny"))
    apply_checkpointing(m, checkpointing, 2)
    m.to_empty(device="cpu")
    init_weights_(m, seed=3)
    return {n.replace("_checkpoint_wrapped_module.", ""): p.detach().clone() for n, p in m.named_parameters()}


def test_checkpointing_does_not_change_the_initial_weights():
    plain = _initial("none")
    for mode in ("full", "every-k"):
        wrapped = _initial(mode)
        assert plain.keys() == wrapped.keys()
        for name, value in plain.items():
            assert torch.equal(value, wrapped[name]), (mode, name)
    # and the weights are not trivially equal (random, seeded per name)
    assert not torch.equal(plain["layers.0.attention.wq.weight"], plain["layers.1.attention.wq.weight"])
