"""One micro-batch's forward and loss as the plan prices them: the one copy that the training
loop (loop.py) and the fake-tensor trace of `zplan verify --fake` (fake_trace.py) both run, so
the step that is traced is the step that `zplan launch` runs."""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F

from .parallel import Parallelized, set_sync


def micro_batch_context(p: Parallelized, sync: bool, device_type: str) -> contextlib.ExitStack:
    """Around one micro-batch's forward: whether its backward reduces gradients (`sync`), and
    under DDP the autocast to the plan's param dtype (FSDP2 casts in its mixed precision)."""
    stack = contextlib.ExitStack()
    stack.enter_context(set_sync(p, sync))
    if p.autocast_dtype is not None:
        stack.enter_context(torch.autocast(device_type, dtype=p.autocast_dtype))
    return stack


def forward_loss(p: Parallelized, train, x: torch.Tensor, y: torch.Tensor,
                 sync: bool) -> tuple[torch.Tensor, object]:
    """The micro-batch's loss divided by the accumulation steps, and the logits that stay
    referenced until its backward ends, as the planner prices the loss (memory_timeline.py;
    fp32 where the plan's model returns fp32 logits, `TrainSpec.logits_fp32`):
    None where the plan drops them (`TrainSpec.logits_kept` false: torchtitan's `del pred`) or
    never makes them whole (the chunked linear loss computes the loss in the head); with
    `TrainSpec.kv_cache`, (logits, the model's keys and values), the output the loop holds.
    `sync` says whether this micro-batch's backward reduces gradients."""
    A = train.grad_accum
    with micro_batch_context(p, sync, x.device.type):
        if train.linear_loss == "chunked":
            return p.model(x, y) / A, None
        logits, cache = p.model(x), None
        if train.kv_cache:  # the model returns its keys and values too (Hugging Face's use_cache)
            logits, cache = logits
        if train.logits_fp32:  # the model's own upcast (torchtitan's `self.output(h).float()`)
            logits = logits.float()
        if train.loss_shifted_copy:  # Hugging Face's `logits[..., :-1, :].contiguous()` (the last position dropped)
            shifted = logits[:, :-1].contiguous()
            loss = F.cross_entropy(shifted.view(-1, shifted.shape[-1]), y[:, :-1].reshape(-1)) / A
            del shifted
        elif train.loss_chunks > 1:  # torchtitan's chunked_cross_entropy_loss (components/loss.py,
            # e23bb70): each sequence chunk flattened, upcast and reduced in turn, the chunks' means averaged
            k = train.loss_chunks
            loss = sum(F.cross_entropy(c.flatten(0, 1).float(), t.flatten(0, 1))
                       for c, t in zip(logits.chunk(k, dim=1), y.chunk(k, dim=1))) / k / A
        else:
            loss = F.cross_entropy(logits.float().view(-1, logits.shape[-1]), y.reshape(-1)) / A
    if not train.logits_kept:
        return loss, None
    return loss, ((logits, cache) if train.kv_cache else logits)
