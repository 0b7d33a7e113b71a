"""The trainer's chunked linear cross-entropy (TrainSpec.linear_loss "chunked",
zplan/trainer/linear_loss.py) against PyTorch: its loss and gradients against autograd through
F.cross_entropy, the bytes it holds against MemTracker and the planner's linear_loss_bytes, its
FLOPs against FlopCounterMode, and a real FSDP2 run against the same plan with the logits."""

import json
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
import torch.nn.functional as F  # noqa: E402

from zplan import activation_memory  # noqa: E402
from zplan.specs import ModelSpec, Precision, TrainSpec  # noqa: E402
from zplan.policy import loss_chunk_tokens as chunk_tokens  # noqa: E402
from zplan.trainer.linear_loss import chunked_linear_cross_entropy  # noqa: E402
from zplan.trainer.model import Head  # noqa: E402

H, V = 64, 1000


def _inputs(T, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g).to(dtype).requires_grad_()
    w = (torch.randn(V, H, generator=g) * 0.2).to(dtype).requires_grad_()
    y = torch.randint(0, V, (T,), generator=g)
    return x, w, y


def _grads(loss_fn, x, w, y, scale):
    x.grad = w.grad = None
    loss = loss_fn(x, w, y)
    (loss * scale).backward()
    return loss.detach(), x.grad.clone(), w.grad.clone()


def _oracle(x, w, y):
    """The plain head and the trainer's loss: logits in the input's dtype, the loss over fp32."""
    return F.cross_entropy((x @ w.t()).float(), y)


def _close(a, b, exact: bool):
    """fp32: tight. bf16 (or bf16 matmuls): the weight gradient is accumulated chunk by chunk
    in the weight's dtype (as Liger's with accum_dtype None), autograd's in one fp32-accumulated
    matmul: 16 roundings to bf16 apart, within 2% of the largest element."""
    a, b = a.float(), b.float()
    if exact:
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
    else:
        torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-2 * b.abs().max().item())
        assert ((a - b).norm() / b.norm()).item() < 1e-2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("scale", [1.0, 0.25])
def test_loss_and_gradients_equal_autograd_through_cross_entropy(dtype, scale):
    T = 500  # chunks of 32 tokens (inc = ceil(1000 / 64) = 16): 15 full ones and 20 tokens
    assert chunk_tokens(T, V, H) == 32 and T % 32
    x, w, y = _inputs(T, dtype)
    got = _grads(chunked_linear_cross_entropy, x, w, y, scale)
    ref = _grads(_oracle, x, w, y, scale)
    torch.testing.assert_close(got[0], ref[0], rtol=1e-6, atol=1e-6)  # the loss: fp32 both ways
    for a, b in zip(got[1:], ref[1:]):
        assert a.dtype == dtype
        _close(a, b, dtype == torch.float32)


def test_one_chunk_and_a_leading_batch_dimension():
    """T no larger than the chunk (V <= h: one chunk of all tokens), x given as (b, s, h)."""
    x = torch.randn(2, 8, 32, requires_grad=True)
    w = torch.randn(16, 32, requires_grad=True)
    y = torch.randint(0, 16, (2, 8))
    assert chunk_tokens(16, 16, 32) == 16
    loss = chunked_linear_cross_entropy(x, w, y)
    loss.backward()
    gx, gw = x.grad.clone(), w.grad.clone()
    x.grad = w.grad = None
    F.cross_entropy((x @ w.t()).view(-1, 16), y.view(-1)).backward()
    torch.testing.assert_close(gx, x.grad, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(gw, w.grad, rtol=1e-5, atol=1e-7)


def test_head_module_returns_logits_or_the_loss_and_keeps_its_names():
    from zplan.trainer.model import Transformer, init_weights_

    m = ModelSpec(name="t", num_layers=1, hidden=32, ffn_hidden=64, num_heads=2, num_kv_heads=1,
                  vocab_size=100, tied_embeddings=False)
    model = Transformer(m)
    init_weights_(model, 0)
    assert isinstance(model.output, Head) and isinstance(model.output, torch.nn.Linear)
    assert "output.weight" in model.state_dict() and "output.bias" not in model.state_dict()
    tokens = torch.randint(0, 100, (2, 12))
    targets = torch.randint(0, 100, (2, 12))
    logits = model(tokens)
    assert logits.shape == (2, 12, 100)
    ref = F.cross_entropy(logits.float().view(-1, 100), targets.view(-1))
    torch.testing.assert_close(model(tokens, targets), ref, rtol=1e-6, atol=1e-6)
    tied = Transformer(m.model_copy(update={"tied_embeddings": True}))
    assert tied.output.weight is tied.tok_embeddings.weight


def test_under_autocast_the_chunks_run_in_the_autocast_dtype():
    """DDP's mixed precision (fp32 weights, autocast bf16): the chunk matmul is the plain head's
    bf16 matmul, the gradients arrive in fp32, and both losses agree."""
    x, w, y = _inputs(500, torch.float32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = _grads(chunked_linear_cross_entropy, x, w, y, 1.0)
        ref = _grads(lambda x, w, y: F.cross_entropy(F.linear(x, w).float(), y), x, w, y, 1.0)
    torch.testing.assert_close(got[0], ref[0], rtol=1e-6, atol=1e-6)
    for a, b in zip(got[1:], ref[1:]):
        assert a.dtype == torch.float32
        _close(a, b, False)


# ---------------------------------------------------------------------------- memory
def _memtracker_head(T: int, dtype):
    """PyTorch's MemTracker over the trainer's head module computing the chunked loss and its
    backward: the module's snapshots before and at the peak of its forward and its backward."""
    from torch.distributed._tools.mem_tracker import MemTracker, _ModState

    head = Head(H, V, bias=False).to(dtype)
    x = torch.randn(T, H, dtype=dtype, requires_grad=True)
    y = torch.randint(0, V, (T,))
    mt = MemTracker()
    mt.track_external(head, x, y)
    with mt:
        loss = head(x, y)
        loss.backward()
    snaps = mt.memory_tracking[head].snapshots

    def total(state):
        return next(iter(snaps[state][0].values()))["Total"]

    return {"forward": total(_ModState.PEAK_FW) - total(_ModState.PRE_FW),
            "kept": total(_ModState.POST_FW) - total(_ModState.PRE_FW),
            "backward": total(_ModState.PEAK_BW) - total(_ModState.PRE_BW)}


@pytest.mark.parametrize("param", ["fp32", "bf16"])
def test_bytes_held_against_pytorch_memtracker_and_linear_loss_bytes(param):
    """What MemTracker sees over the head's chunked loss (h 64, V 1000, T 512: 16 chunks of 32)
    against the planner's linear_loss_bytes, byte for byte: the input gradient, the weight
    gradient, the 0-d fp32 loss, and at the chunk's largest moment its c x V logits and their
    fp32 copy (B = 2) or the fp32 logits with two per-row fp32 vectors (B = 4: the target logit
    and the row sums). After the forward the planner counts the input gradient in
    head_saved_bytes (in place of the head's saved input)."""
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[param]
    seq, mb = 256, 2
    T, B = seq * mb, dtype.itemsize
    m = ModelSpec(name="t", num_layers=1, hidden=H, ffn_hidden=4 * H, num_heads=2, num_kv_heads=1,
                  vocab_size=V)
    t = TrainSpec(seq_len=seq, micro_batch=mb, linear_loss="chunked",
                  precision=Precision(param=param))
    planned = activation_memory.linear_loss_bytes(m, t)
    c = chunk_tokens(T, V, H)
    assert c == 32
    measured = _memtracker_head(T, dtype)
    grad_input, loss_scalar = B * T * H, 4
    # the planner's forward holds the head's input beside its gradient; MemTracker counts from
    # the module's entry, when the input exists already: the gradient takes its place
    assert measured["forward"] == planned["forward"], (measured, planned)
    assert measured["kept"] == planned["kept"] + grad_input + loss_scalar
    # the backward only scales the kept gradients in place, which autograd hands on as the
    # gradients themselves: nothing beyond what the forward kept (linear_loss_bytes' backward)
    assert planned["backward"] == planned["kept"]
    assert measured["backward"] == 0


# ---------------------------------------------------------------------------- FLOPs
def test_flops_against_flop_counter_mode():
    """Three matmuls of 2·T·V·h each in the forward (logits, input gradient, weight gradient),
    none in the backward (it only scales)."""
    from torch.utils.flop_counter import FlopCounterMode

    T = 500
    x, w, y = _inputs(T, torch.float32)
    with FlopCounterMode(display=False) as fwd:
        loss = chunked_linear_cross_entropy(x, w, y)
    with FlopCounterMode(display=False) as bwd:
        loss.backward()
    assert fwd.get_total_flops() == 6 * T * V * H
    assert bwd.get_total_flops() == 0


# ---------------------------------------------------------------------------- a real run
SMALL = """name = "small-vocab"
num_layers = 2
hidden = 64
ffn_hidden = 176
num_heads = 2
num_kv_heads = 1
vocab_size = 1024
max_seq_len = 128
"""


def _plan(tmp_path, linear_loss: str) -> Path:
    """zero3 on 2 CPU ranks, fp32 weights, 2 micro-batches of 2 x 50 tokens (the loss over
    T = 100 tokens in chunks of 8: inc = 1024 / 64 = 16; the backward's incoming gradient 1/2)."""
    from zplan.estimate import estimate_one
    from zplan.plan import make_plan, save
    from zplan.scenario_options import build, cpu_ranks

    model = tmp_path / "small.toml"
    model.write_text(SMALL)
    sc = build(cpu_ranks(model=str(model), gpus="2", seq_len=50, micro_batch=2, grad_accum=2,
                         param_dtype="fp32", linear_loss=linear_loss))
    assert sc.train.linear_loss == linear_loss and chunk_tokens(100, 1024, 64) == 8
    path = tmp_path / f"{linear_loss}.json"
    save(make_plan(sc, "zero3", 2 * 2 * 2, estimate_one(sc, "zero3")), path)
    return path


@pytest.mark.slow  # torchrun on CPU ranks
@pytest.mark.timeout(480)
def test_fsdp2_run_with_the_chunked_loss_equals_the_run_with_logits(run_zplan, tmp_path):
    reports = {}
    for ll in ("none", "chunked"):
        run = tmp_path / ll
        p = run_zplan("launch", "--plan", str(_plan(tmp_path, ll)), "--run-dir", str(run),
                      "--steps", "3", "--save-every", "0", timeout=200)
        assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
        reports[ll] = json.loads((run / "run_report.json").read_text())
    a, b = reports["none"], reports["chunked"]
    assert a["strategy"] == b["strategy"] == "zero3" and len(a["losses"]) == 3
    assert b["losses"][-1] < b["losses"][0]  # it trains
    assert b["losses"] == pytest.approx(a["losses"], rel=1e-5)
    assert b["grad_norms"] == pytest.approx(a["grad_norms"], rel=1e-4)
    # 3 steps are too few for the memory tracker: not measured (None), never a measured 0
    assert a["measured"]["peak_memory_bytes"] is None and b["predicted"]["peak_memory_bytes"] > 0
    assert "peak allocated: not measured" in p.stdout


@pytest.mark.slow
@pytest.mark.parametrize("model", ["llama-3.1-8b", "llama-3.2-1b"])
@pytest.mark.parametrize("checkpointing", ["none", "full"])
def test_planner_agrees_with_the_fake_trace_at_real_scale(model, checkpointing):
    """8 ranks, seq 4096, zero3, the chunked loss: PyTorch's FSDPMemTracker under FakeTensorMode
    (zplan verify --fake's cell) against the planner, within the matrix's 3% and with the peak's
    phase agreeing. Llama 3.1 8B: -0.00% and +0.43%. Llama 3.2 1B ties its embeddings: the head's
    weight gradient, handed over in the loss's backward, stays unsharded until the root's
    reduce-scatter at the end (-0.27%, -0.43%; -4.85% before the planner knew it)."""
    from zplan.trainer.fake_trace import fake_cell

    cell = fake_cell(model, 8, 4096, 1, checkpointing, "zero3", linear_loss="chunked")
    assert cell.ok(0.03), cell


@pytest.mark.parametrize("args,needle", [
    (("--linear-loss", "chunked"), "--fake"),
    (("--fake", "--linear-loss", "liger"), "--linear-loss"),
])
def test_verify_takes_the_chunked_loss_only_for_fake_traces(capsys, args, needle):
    from tests.helpers import cli

    r = cli(capsys, "verify", *args)
    assert r.returncode == 2 and needle in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr


def small_model(name: str, hidden: int, ffn: int, heads: int, vocab: int, **extra) -> str:
    """A 2-block model file the trainer builds (RoPE, RMSNorm, SwiGLU, 2 key/value heads)."""
    lines = [f'name = "{name}"', "num_layers = 2", f"hidden = {hidden}", f"ffn_hidden = {ffn}",
             f"num_heads = {heads}", "num_kv_heads = 2", f"vocab_size = {vocab}", "max_seq_len = 256",
             *(f"{k} = {str(v).lower()}" for k, v in extra.items()), 'source = "test: a small model"']
    return "\n".join(lines) + "\n"


TIED_SMALL = small_model("tied-small", 256, 688, 4, 32000, tied_embeddings=True)


@pytest.mark.slow
def test_a_tied_weights_gradients_meet_out_of_place_under_fsdp2_with_a_chunked_loss(run_zplan, tmp_path):
    """A real run (2 CPU ranks over gloo, zero3, the chunked loss, bf16 gather and reduce, full
    checkpointing) of a tied model whose embedding's backward is the peak: FSDPMemTracker on
    real tensors holds three weight-sized gradients there (the loss's, made in its forward, as
    an activation; the embedding's and their sum as temps), where without FSDP the loss's takes
    the embedding's in place (test_memory.py). The planner priced two (-12.7%)."""
    import json

    model = tmp_path / "tied.toml"
    model.write_text(TIED_SMALL)
    plan = tmp_path / "plan.json"
    p = run_zplan("recommend", "--model", str(model), "--gpu", "cpu", "--cluster", "cpu-local", "--gpus", "2",
                  "--strategy", "zero3", "--seq-len", "64", "--global-batch", "4", "--checkpointing", "full",
                  "--linear-loss", "chunked", "--reduce-dtype", "bf16", "--write", str(plan))
    assert p.returncode == 0, p.stderr
    run = tmp_path / "run"
    p = run_zplan("launch", "--plan", str(plan), "--run-dir", str(run), "--steps", "6", timeout=280)
    assert p.returncode == 0, p.stderr[-2000:]
    r = json.loads((run / "run_report.json").read_text())
    measured, predicted = r["measured"]["peak_memory_bytes"], r["predicted"]["peak_memory_bytes"]
    # -0.1% on an idle machine; -1.0% once in CI beside other work (1.45 MB more measured; likely
    # an asynchronous gloo collective still holding a buffer at the peak, not verified); the bug
    # this guards was -12.7%
    assert abs(predicted / measured - 1) < 0.02, (predicted, measured)
    W = 32000 * 256 * 2  # the tied weight in bf16
    cats = r["measured"]["memory_by_category_rank0"]
    assert cats["Activation"] + cats["Temp"] >= 3 * W and W <= cats["Unsharded Param"] < W + 4096  # + the norm


M5 = small_model("m5", 512, 1376, 8, 8000, qk_norm=True)  # the real-run survey's m5 and m1
M1 = small_model("m1", 256, 688, 4, 32000)


@pytest.mark.slow
@pytest.mark.parametrize("text,gpus,kw", [
    # one rank, bf16 weights, fp32 reduce: the reduce-scatter's output beside its input (-2.1%)
    (M5, 1, dict(micro_batch=2, grad_accum=1)),
    # two ranks, fp32 weights and reduce, accumulating without a reduce: the head's new weight
    # gradient before AccumulateGrad adds it in place (-0.98%)
    (M1, 2, dict(micro_batch=2, grad_accum=2, param_dtype="fp32", reduce_last_only=True)),
])
def test_two_moments_the_real_run_survey_found(run_zplan, tmp_path, text, gpus, kw):
    """Real runs (CPU ranks over gloo, FSDPMemTracker on real tensors, zero3, seq 128): each
    peaks at a moment the timeline lacked, now priced within 0.2% (+0.11% and +0.00%)."""
    import json

    from tests.helpers import est, scenario
    from zplan.plan import make_plan, save

    model = tmp_path / "m.toml"
    model.write_text(text)
    opts = dict(model=str(model), gpus=gpus, gpu="cpu", cluster="cpu-local", seq_len=128, layout="torch",
                checkpointing="none", **kw)
    sc = scenario(**opts)
    plan = tmp_path / "plan.json"
    save(make_plan(sc, "zero3", gpus * kw["micro_batch"] * kw["grad_accum"], est("zero3", **opts)), plan)
    run = tmp_path / "run"
    p = run_zplan("launch", "--plan", str(plan), "--run-dir", str(run), "--steps", "6", "--nproc", str(gpus),
                  timeout=280)
    assert p.returncode == 0, p.stderr[-2000:]
    r = json.loads((run / "run_report.json").read_text())
    measured, predicted = r["measured"]["peak_memory_bytes"], r["predicted"]["peak_memory_bytes"]
    # once in CI (beside two-process DeepSpeed runs) +9% measured, one ~32 MB tensor more at a
    # rank's peak; not reproduced alone: the categories at the peak say which kind, if it recurs
    assert abs(predicted / measured - 1) < 0.002, (predicted, measured, r["measured"]["memory_by_category_rank0"])
