"""The head's matmul and the cross-entropy together, chunk by chunk of tokens
(TrainSpec.linear_loss "chunked"): the logits are never materialised whole.

The algorithm is Liger-Kernel's fused linear cross-entropy (v0.8.0,
src/liger_kernel/ops/fused_linear_cross_entropy.py, `fused_linear_cross_entropy_forward`) with
torch ops in place of its Triton cross-entropy kernel: the forward computes, chunk by chunk, the
loss and at once the gradient of the chunk's logits, turned straight into the head's input and
weight gradients; the backward only scales those by the incoming gradient. The chunks are
Liger's (zplan.policy.loss_chunk_tokens), so that the planner's memory model
(zplan.activation_memory.linear_loss_bytes, "chunked") describes exactly what this holds:

- kept, from the loss forward to the head's backward: the input gradient (T x h, the input's
  dtype) and the weight gradient (V x h, the weight's dtype), saved for backward;
- per chunk of c tokens, at most: the matmul's output `x_c @ w.t()` (c x V, dtype B) and its
  fp32 working copy (c x V x 4 bytes), alive together only while `.float()` runs and while the
  gradient is cast back to B (when B is fp32 `.float()` and the cast return the tensor itself:
  one c x V tensor); the working copy is turned into the softmax, then the logit gradient, in
  place (no second c x V fp32 tensor: the log-sum-exp is taken as max, in-place exp and sum,
  because `torch.logsumexp` allocates a c x V temporary for `self - maxes` inside the op, where
  MemTracker does not see it but the allocator does: torch.profiler, aten::sub); the weight gradient
  accumulated in place (`addmm(..., out=grad_w)`: no V x h temporary) and the input gradient
  written into its rows (`mm(..., out=grad_x[s:e])`);
- besides those, a few tensors of c fp32 values per chunk (the row maxima, the target's logit,
  the row sums) and the 0-d fp32 loss.

The targets carry no ignore index: every token counts, the loss is the mean over all T tokens
(F.cross_entropy's default reduction over targets without -100).
"""

from __future__ import annotations

import torch

from ..policy import loss_chunk_tokens

__all__ = ["ChunkedLinearCrossEntropy", "chunked_linear_cross_entropy"]


class ChunkedLinearCrossEntropy(torch.autograd.Function):
    """mean_t cross_entropy(x_t @ weight.T, target_t) over x (T, h), weight (V, h), targets (T,)
    int64; x and weight in one dtype. The gradients are made in the forward and saved."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        T, h = x.shape
        V = weight.shape[0]
        c = loss_chunk_tokens(T, V, h)
        grad_x = torch.empty_like(x)
        grad_w = torch.zeros_like(weight)
        loss = torch.zeros((), dtype=torch.float32, device=x.device)
        for s in range(0, T, c):
            e = min(s + c, T)
            x_c, y_c = x[s:e], targets[s:e, None]
            z = (x_c @ weight.t()).float()  # the chunk's logits, fp32 (itself when fp32)
            m = z.amax(1, keepdim=True)
            z.sub_(m)
            del m
            target = z.gather(1, y_c)  # the target's logit, less the row's maximum
            z.exp_()
            total = z.sum(1, keepdim=True)
            z.div_(total)  # softmax
            total.log_().sub_(target)  # each token's loss: logsumexp - target logit
            del target
            loss.add_(total.sum())
            del total
            p = z.gather(1, y_c).sub_(1)  # d loss / d logits: softmax - one-hot ...
            z.scatter_(1, y_c, p)
            del p
            z.div_(T)  # ... over the mean's T tokens
            g = z.to(x.dtype)  # itself when x is fp32
            del z
            torch.mm(g, weight, out=grad_x[s:e])
            # in place, as grad_w.addmm_(g.t(), x_c); the out= form is aten.addmm, which
            # FlopCounterMode counts (it has no formula for aten.addmm_)
            torch.addmm(grad_w, g.t(), x_c, out=grad_w)
            del g
        loss.div_(T)
        ctx.save_for_backward(grad_x, grad_w)
        return loss

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        grad_x, grad_w = ctx.saved_tensors
        # scaled in place, as Liger's element_mul_kernel does. Liger skips the scaling when
        # grad_out == 1, which reads the value on the host (a device sync in the middle of
        # backward, and impossible under FakeTensorMode); multiplying by 1.0 is exact, so the
        # trainer always scales.
        grad_x.mul_(grad_out)
        grad_w.mul_(grad_out)
        return grad_x, grad_w, None


def chunked_linear_cross_entropy(x: torch.Tensor, weight: torch.Tensor,
                                 targets: torch.Tensor) -> torch.Tensor:
    """The scalar mean cross-entropy of `x @ weight.T` against `targets`, chunk by chunk.

    x is (..., h), flattened to (T, h); targets hold T int64 class indices. Under autocast the
    matmul runs in the autocast dtype, as the plain head's nn.Linear would: x and the weight are
    cast to it before the loss (autograd casts the gradients back), autocast off inside."""
    h = x.shape[-1]
    x2 = x.reshape(-1, h)
    if not x2.is_contiguous():
        x2 = x2.contiguous()
    y = targets.reshape(-1)
    if y.shape[0] != x2.shape[0]:
        raise ValueError(f"{x2.shape[0]} tokens but {y.shape[0]} targets")
    device_type = x.device.type
    w = weight
    if torch.is_autocast_enabled(device_type):
        dtype = torch.get_autocast_dtype(device_type)
        x2, w = x2.to(dtype), w.to(dtype)
    with torch.autocast(device_type, enabled=False):
        return ChunkedLinearCrossEntropy.apply(x2, w, y)
