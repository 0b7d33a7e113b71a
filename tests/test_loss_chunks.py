"""The eager cross-entropy over the logits in sequence chunks (--loss-chunks, torchtitan's
chunked_cross_entropy_loss since PR 996, after torchtune's CEWithChunkedOutputLoss): the trainer
runs it, PyTorch's tracers record what it holds, and the planner prices the same tensors."""

import pytest

from tests.helpers import cli, scenario, storage_log
from zplan import activation_memory, unit_ops
from zplan.scenario_options import build, cpu_ranks

VOCAB_HEAVY = ('name = "vocab-heavy"\nnum_layers = 2\nhidden = 256\nffn_hidden = 512\nnum_heads = 4\n'
               'num_kv_heads = 4\nvocab_size = 32768\nmax_seq_len = 1024\nsource = "test"\n')


def test_the_peaks_by_hand():
    """Llama 3.1 8B's bf16 logits, upcast, 8 chunks, the loop dropping the logits (torchtitan's
    `del pred`). Forward, at the last chunk: the logits (2 B a logit), seven chunks' fp32
    log-softmax (7 x 4/8), the last chunk's fp32 copy and its log-softmax (4/8 each): 6.5 B a
    logit, where one cross-entropy holds 2 + 4 + 4 = 10. Backward, at the last chunk (run first):
    every log-softmax (4) and its two fp32 gradients (4/8 each): 5 B, where one holds 12."""
    kw = dict(model="llama-3.1-8b", seq_len=8192, logits_kept=False)
    E = 8192 * 128256
    chunked = activation_memory.loss_peak_bytes(scenario(**kw, loss_chunks=8).train, True, E)
    whole = activation_memory.loss_peak_bytes(scenario(**kw).train, True, E)
    assert chunked == {"forward": 13 * E // 2, "backward": 5 * E}
    assert whole == {"forward": 10 * E, "backward": 12 * E}


@pytest.mark.slow  # a second or two: the fast loop leaves it to CI
@pytest.mark.parametrize("micro_batch", [1, 2])
@pytest.mark.parametrize("kept", [False, True])
def test_the_chunks_tensors_are_made_and_freed_in_the_order_pytorch_runs_them(tmp_path, micro_batch, kept):
    """The trainer's chunked loss under PyTorch's MemTracker, every storage of a chunk's size or
    more in order: activation_memory.loss_tensor_steps, to the byte; at micro-batch 2 each chunk
    is flattened into a copy first (not viewable as rows), at 1 it is a view."""
    torch = pytest.importorskip("torch")
    from zplan import presets
    from zplan.trainer.micro_batch import forward_loss
    from zplan.trainer.model import Transformer
    from zplan.trainer.parallel import Parallelized

    path = tmp_path / "m.toml"  # hidden 16: the head's weight (256 KiB) under a chunk's 512 KiB
    path.write_text('name = "vocab-heavy"\nnum_layers = 1\nhidden = 16\nffn_hidden = 32\nnum_heads = 4\n'
                    'num_kv_heads = 2\nvocab_size = 8192\nmax_seq_len = 128\nsource = "test"\n')
    k = 4
    sc = build(cpu_ranks(model=str(path), gpus="1", seq_len=128, micro_batch=micro_batch, logits_kept=kept,
                         loss_chunks=k))
    E = micro_batch * 128 * 8192
    torch.manual_seed(0)
    model = Transformer(presets.model(str(path))).to(torch.bfloat16)
    p = Parallelized(model, model, False, [], None)
    x = torch.randint(0, 8192, (micro_batch, 128))

    def step():
        loss, _ = forward_loss(p, sc.train, x, x, sync=True)
        loss.backward()

    log = storage_log(step)
    weight = 8192 * 16 * 2  # the largest tensor besides the loss's
    seq = [("+" if op == "ADD" else "-", key, b) for op, key, b in log if b > weight and op in ("ADD", "DEL")]
    expected = activation_memory.loss_tensor_steps(sc.train, True, E)
    assert [(op, b) for op, _, b in seq[:len(expected)]] == [(op, b) for _, op, _, b in expected]
    order: dict = {}
    for (_, op, name, _), (_, key, _) in zip(expected, seq):
        assert order.setdefault(name, key) == key  # each tensor freed is the one made under its name


def test_the_chunked_loss_is_the_same_objective():
    """Equal chunks' means averaged are the mean over all tokens: the trainer's chunked loss and
    its gradient equal the unchunked ones to fp32 rounding."""
    torch = pytest.importorskip("torch")
    from zplan.trainer.micro_batch import forward_loss
    from zplan.trainer.model import Transformer, init_weights_
    from zplan.trainer.parallel import Parallelized

    results = []
    for k in (1, 4):
        sc = scenario(model="tiny", gpus=1, micro_batch=2, seq_len=64, loss_chunks=k)
        torch.manual_seed(0)
        model = Transformer(sc.model)
        init_weights_(model)
        x = torch.randint(0, sc.model.vocab_size, (2, 64))
        loss, _ = forward_loss(Parallelized(model, model, False, [], None), sc.train, x, x, sync=True)
        loss.backward()
        results.append((loss.detach(), model.output.weight.grad.clone()))
    (a, ga), (b, gb) = results
    assert torch.allclose(a, b, rtol=1e-6) and torch.allclose(ga, gb, rtol=1e-5, atol=1e-8)
    assert not torch.equal(ga, torch.zeros_like(ga))


@pytest.mark.slow  # about ten seconds: eight fake traces
@pytest.mark.parametrize("micro_batch", [1, 2])
def test_the_planner_is_the_trackers_with_chunks(tmp_path, micro_batch):
    """FSDPMemTracker on the trainer (2 ranks, a vocabulary-heavy model whose loss holds the peak)
    and the planner agree to the loss's scalars (under 64 KiB) and in phase, chunked and not; the
    planned reserve is the caching allocator's replayed over three traced steps within 4% (the
    unchunked cell's own error is +3.3% with expandable segments at micro-batch 1)."""
    pytest.importorskip("torch")
    from zplan.trainer import fake_trace

    path = tmp_path / "m.toml"
    path.write_text(VOCAB_HEAVY)
    peaks = {}
    for k in (1, 8):
        cell = fake_trace.fake_cell(str(path), 2, 1024, micro_batch, "none", "zero3", loss_chunks=k,
                                    logits_kept=False, reserved=True)
        assert cell.predicted_phase == cell.traced_phase == "loss", cell
        assert 0 <= cell.traced_bytes - cell.predicted_bytes < 64 * 1024, cell
        for name, (planned, replayed) in cell.reserved_by_allocator.items():
            assert abs(planned / replayed - 1) < 0.04, (k, name, planned, replayed)
        peaks[k] = cell.traced_bytes
    assert peaks[8] < 0.7 * peaks[1]  # the chunks are worth having here: the loss holds the peak


def test_the_step_runs_each_pass_chunk_by_chunk():
    """The same bytes of cross-entropy in k times the kernels; backward concatenates the chunks'
    gradients (2 B a logit read and written); at micro-batch 2 each chunk is copied flat first."""
    kw = dict(model="llama-3.1-8b", gpus=8, seq_len=8192, micro_batch=2)
    for backward in (False, True):
        whole = {o.name: o for o in unit_ops._head(scenario(**kw).for_strategy(True), backward)}
        chunked = {o.name: o for o in unit_ops._head(scenario(**kw, loss_chunks=8).for_strategy(True), backward)}
        name = "cross-entropy backward" if backward else "cross-entropy"
        assert chunked[name].bytes == whole[name].bytes and chunked[name].kernels == 8 * whole[name].kernels
        extra = "chunk gradients concatenated" if backward else "chunks flattened (copies)"
        assert chunked[extra].bytes == 2 * 2 * 128256 * 8192 * 2 and extra not in whole


@pytest.mark.parametrize("args,needle", [
    (("--loss-chunks", "3"), "does not divide the sequence length 4096"),
    (("--loss-chunks", "0"), "--loss-chunks 0"),
    (("--loss-chunks", "8", "--compile"), "--compile"),
    (("--loss-chunks", "8", "--linear-loss", "chunked"), "--linear-loss chunked"),
    (("--loss-chunks", "8", "--logits-fp32"), "--logits-fp32"),
])
def test_what_chunks_do_not_describe_is_refused_in_one_line(capsys, args, needle):
    r = cli(capsys, "estimate", "--model", "llama-3.1-8b", "--gpus", "8", "--gpu", "h100-sxm", *args)
    assert r.returncode == 2 and needle in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
