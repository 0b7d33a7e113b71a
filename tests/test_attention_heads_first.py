"""q heads-first in memory before the attention kernel (--attention-heads-first, litgpt's attention
before fabf765b): the flash kernel then writes its output heads-first, and the output projection
keeps a contiguous copy of it. The layout is PyTorch's own: its meta registration of the CUDA flash
kernel (what FakeTensorMode and torch.compile run on a machine without the GPU) allocates the output
like q; the bytes are that copy's, counted from the tensor."""

import pytest

from tests.helpers import cli, est, scenario
from zplan import activation_memory, unit_ops

torch = pytest.importorskip("torch")

B, S, HEADS, D = 2, 128, 8, 64


def _projection_input(q):
    """SDPA's CUDA flash kernel as PyTorch registers it for the meta device, then the reshape the
    output projection reads: (tensor, whether it is a view of the kernel's output)."""
    k, v = torch.empty_like(q), torch.empty_like(q)
    out = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, True)[0]
    y = out.transpose(1, 2).reshape(q.shape[0], q.shape[2], -1)
    return y, y._base is not None and y.untyped_storage().data_ptr() == out.untyped_storage().data_ptr()


def _litgpt_q(x_qkv, groups, per_kv):
    """litgpt's q before fabf765b, layout only: the fused output's heads permuted ahead of the
    sequence and split, q reshaped (a copy unless one query head a group), RoPE's result concatenated
    with the rest of the head (torch.cat: a new, contiguous tensor)."""
    b, s, _ = x_qkv.shape
    qkv = x_qkv.view(b, s, groups, per_kv + 2, D).permute(0, 2, 3, 1, 4)
    q = qkv.split((per_kv, 1, 1), dim=2)[0].reshape(b, -1, s, D)
    return torch.cat((q * 1.0, q[..., D:]), dim=-1)


@pytest.mark.parametrize("groups", [2, HEADS])
def test_flash_writes_its_output_like_q_and_the_projection_copies_a_heads_first_one(groups):
    """Heads-first q (litgpt's, grouped or not): PyTorch's kernel allocates the output heads-first,
    the projection's input is a copy of B·s·b·q bytes, zplan's attn_out_proj_input; q laid out
    (b, s, h, d), as Hugging Face's and the trainer's, gives a view and zplan counts nothing."""
    per_kv = HEADS // groups
    fused = torch.empty(B, S, groups * (per_kv + 2) * D, dtype=torch.bfloat16, device="meta")
    q = _litgpt_q(fused, groups, per_kv)
    assert q.is_contiguous() and q.shape == (B, HEADS, S, D)
    copied, is_view = _projection_input(q)
    assert not is_view
    bshd = torch.empty(B, S, HEADS, D, dtype=torch.bfloat16, device="meta").transpose(1, 2)
    _, bshd_view = _projection_input(bshd)
    assert bshd_view

    kw = dict(model="llama-2-7b", seq_len=S, micro_batch=B, gpus=8)
    t = scenario(**kw, attention_heads_first=True).train
    m = scenario(**kw).model
    per_block = copied.numel() * copied.element_size() * m.q_hidden // (HEADS * D)
    assert activation_memory.block_activation_terms(m, t)["attn_out_proj_input"] == per_block
    assert activation_memory.block_activation_terms(m, scenario(**kw).train)["attn_out_proj_input"] == 0


def test_the_copy_is_in_the_peak_and_in_the_step():
    """No recomputation, the peak in the loss's backward: every block's copy is alive there, so
    the peak grows by layers x the copy; the step reads and writes it once a block forward."""
    kw = dict(model="llama-2-7b", gpus=8, seq_len=4096, micro_batch=1)
    plain, first = est("zero3", **kw), est("zero3", **kw, attention_heads_first=True)
    sc = scenario(**kw)
    copy = 2 * 4096 * sc.model.q_hidden
    assert first.memory.allocated_bytes - plain.memory.allocated_bytes == sc.model.num_layers * copy
    ops = [o for o in unit_ops._block(scenario(**kw, attention_heads_first=True).for_strategy(True), False)
           if o.name == "attention output copy"]
    assert len(ops) == 1 and ops[0].bytes == 2 * copy
    assert not [o for o in unit_ops._block(sc.for_strategy(True), False) if o.name == "attention output copy"]


@pytest.mark.parametrize("extra,needle", [(("--compile",), "--compile"),
                                          (("--attention-kernel", "cudnn"), "--attention-kernel cudnn"),
                                          (("--no-flash",), "--no-flash")])
def test_refused_where_the_layout_is_not_modelled(capsys, extra, needle):
    r = cli(capsys, "estimate", "--model", "llama-2-7b", "--gpus", "8", "--gpu", "h100-sxm",
            "--attention-heads-first", *extra)
    assert r.returncode == 2 and needle in r.stderr and len(r.stderr.strip().splitlines()) == 1
    assert "Traceback" not in r.stderr
