"""Optimizer and learning-rate schedule, built from `[optimizer]` and `[lr_scheduler]`."""

from __future__ import annotations

import functools
import math

import torch
from torch.optim.lr_scheduler import LambdaLR

from torchtitan_xla import runtime
from torchtitan_xla.config import JobConfig
from torchtitan_xla.logging import logger


def build_optimizer(model: torch.nn.Module, job_config: JobConfig) -> torch.optim.Optimizer:
    """torch's Adam(W), `capturable`: its step count and bias corrections live on the device, so the
    step's graph reads them as data instead of baking this step's Python numbers into it (which
    a replayed graph would keep; see runtime/step.py). The learning rate comes in the same way, as a
    device scalar given to `step_with_lr`."""
    cfg = job_config.optimizer
    cls = {"AdamW": torch.optim.AdamW, "Adam": torch.optim.Adam}[cfg.name]
    optimizer = cls(
        model.parameters(), lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps,
        weight_decay=cfg.weight_decay, foreach=False, capturable=True)
    init_optimizer_state(optimizer)
    return optimizer


@torch.no_grad()
def init_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Create Adam's state (step, exp_avg, exp_avg_sq) up front, exactly as the first
    `optimizer.step()` would, and with each parameter's sharding.

    Why: with the state present from the start, step 0 traces the same graph as every later
    step (one compile instead of two), and a checkpoint can be loaded into it in place."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            state = optimizer.state[p]
            if state:
                continue
            state["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
            for name in ("exp_avg", "exp_avg_sq"):
                t = torch.zeros_like(p, memory_format=torch.preserve_format)
                runtime.copy_sharding(p, t)
                state[name] = t


def step_with_lr(optimizer: torch.optim.Optimizer, lr: torch.Tensor) -> None:
    """`optimizer.step()` with the learning rate `lr` (a device scalar) for every group.

    The groups keep their Python float otherwise, for the scheduler and the state dict; only the
    traced update reads the tensor."""
    saved = [group["lr"] for group in optimizer.param_groups]
    for group in optimizer.param_groups:
        group["lr"] = lr
    try:
        optimizer.step()
    finally:
        for group, value in zip(optimizer.param_groups, saved):
            group["lr"] = value


def optimizer_state_tensors(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [t for state in optimizer.state.values() for t in state.values()
            if isinstance(t, torch.Tensor)]


def lr_factor(step: int, *, warmup_steps: int, decay_start: int, decay_steps: int,
              decay_type: str, min_lr_factor: float) -> float:
    """Multiplier of the peak lr for optimizer step `step` (0-based): linear warmup, a stable
    phase, then decay towards `min_lr_factor`.

    It is never exactly 0: a step with lr 0 is wasted."""
    if step < warmup_steps:
        return (step + 1) / (warmup_steps + 1)
    if step < decay_start or decay_steps == 0:
        return 1.0
    progress = (step - decay_start + 1) / (decay_steps + 1)  # in (0, 1)
    if decay_type == "linear":
        remaining = 1.0 - progress
    elif decay_type == "sqrt":
        remaining = 1.0 - math.sqrt(progress)
    else:  # cosine
        remaining = 0.5 * (1.0 + math.cos(math.pi * progress))
    return min_lr_factor + (1.0 - min_lr_factor) * remaining


def build_lr_scheduler(optimizer: torch.optim.Optimizer, job_config: JobConfig) -> LambdaLR:
    cfg, steps = job_config.lr_scheduler, job_config.training.steps
    warmup = min(cfg.warmup_steps, steps)
    if cfg.decay_ratio is None:
        decay_steps = steps - warmup
    else:
        decay_steps = round(steps * cfg.decay_ratio)
        if warmup + decay_steps > steps:
            logger.warning(
                f"[lr_scheduler] warmup_steps ({warmup}) + decay ({decay_steps} steps) exceed "
                f"training.steps ({steps}); decaying over the last {steps - warmup} steps instead")
            decay_steps = steps - warmup
    fn = functools.partial(
        lr_factor, warmup_steps=warmup, decay_start=steps - decay_steps, decay_steps=decay_steps,
        decay_type=cfg.decay_type, min_lr_factor=cfg.min_lr_factor)
    return LambdaLR(optimizer, fn)
