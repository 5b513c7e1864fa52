"""One training step and one validation pass: train() and the benchmarks run this same code. Nothing here reads a
tensor back to the host; the caller decides when to pay for that sync (train(): once per log_interval)."""

from __future__ import annotations

import contextlib
import math

import torch
from torch.nn.parallel import DistributedDataParallel


def lr_at(step: int, cfg) -> float:
    """Linear warmup to the peak, then cosine down to min_lr_ratio * peak at max_steps; or wsd: the peak until the
    last cooldown_frac of max_steps, then linear down (before the cooldown the LR does not depend on max_steps, so
    a run extends exactly)."""
    peak = cfg.learning_rate
    if cfg.warmup_steps and step < cfg.warmup_steps:
        return peak * (step + 1) / cfg.warmup_steps
    if cfg.schedule == "wsd":
        # 1 at the cooldown's start
        left = (cfg.max_steps - step) / max(1.0, cfg.cooldown_frac * cfg.max_steps)
        return peak * (cfg.min_lr_ratio + (1.0 - cfg.min_lr_ratio) * min(1.0, max(0.0, left)))
    span = max(1, cfg.max_steps - cfg.warmup_steps)
    progress = min(1.0, (step - cfg.warmup_steps) / span)
    min_lr = peak * cfg.min_lr_ratio
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (peak - min_lr)


def set_lr(optimizer, lr: float) -> None:
    """A group with an lr_scale (Muon's, training/optimizer.py) runs at lr * lr_scale."""
    for group in optimizer.param_groups:
        group["lr"] = lr * group["lr_scale"] if "lr_scale" in group else lr


def train_step(
    model,
    optimizer,
    scaler,
    batches,
    *,
    accum: int,
    grad_clip: float,
    autocast,
    timer,
    lr: float | None = None,
) -> torch.Tensor:
    """One optimizer step over `accum` micro-batches -> their mean loss, on the device. batches.next_batch() ->
    (x, y), each (micro_batch, block_size) token ids; timer: a StepTimer (the data / fwd_bwd / optim split);
    lr: None keeps the optimizer's."""
    if lr is not None:
        set_lr(optimizer, lr)
    loss_sum = torch.zeros((), device=next(model.parameters()).device)
    timer.start()
    for micro in range(accum):
        x, y = batches.next_batch()
        timer.mark("data")
        # DDP all-reduces the gradients on the last micro-batch only: the others accumulate locally
        skip_sync = isinstance(model, DistributedDataParallel) and micro < accum - 1
        with model.no_sync() if skip_sync else contextlib.nullcontext():
            # [1]: the loss alone; the logits (B, T, vocab) are not kept past the forward
            with autocast:
                loss = model(x, y)[1]
            loss = loss / accum  # the mean over the micro-batches, as one large batch would give
            loss_sum += loss.detach()
            scaler.scale(
                loss
            ).backward()  # fp16: a scaled loss, so small gradients do not underflow
        timer.mark("fwd_bwd")
    # clip (fp16: the gradients unscaled first), update (skipped on inf/nan gradients), drop the gradients
    if grad_clip > 0:
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)
    timer.mark("optim")
    return loss_sum


@torch.no_grad()
def validation_loss(model, sampler, n_batches: int, autocast) -> float:
    """Mean loss over n_batches of a fresh fixed-seed sampler (the same batches at every evaluation); a host sync."""
    was_training = model.training
    model.eval()
    losses = torch.zeros(n_batches, device=next(model.parameters()).device)
    for i in range(n_batches):
        x, y = sampler.next_batch()
        with autocast:
            losses[i] = model(x, y)[1].float()
    model.train(was_training)
    return float(losses.mean())
