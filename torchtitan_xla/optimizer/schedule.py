"""The learning-rate schedule (`[lr_scheduler]`): linear warmup, a stable phase, then a decay
(warmup-stable-decay, torchtitan's keys). Its special cases are the other common schedules:

- constant after warmup: `decay_ratio = 0`;
- cosine with warmup: `decay_type = "cosine"` with `decay_ratio` unset (decay over every step after
  warmup), towards `min_lr_factor`.

The schedule is a factor of each parameter group's own peak lr (LambdaLR), so optimizers with
several groups (Muon's matrices and its AdamW group) share its shape.
"""

from __future__ import annotations

import functools
import math

import torch
from torch.optim.lr_scheduler import LambdaLR

from torchtitan_xla.config import JobConfig, where
from torchtitan_xla.logging import logger


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
    if cfg.warmup_steps > steps:
        # As torchtitan: the warmup is cut to the run, said once at start rather than refused, so
        # that a recipe's schedule still runs a short test of it.
        logger.warning(
            f"{where(job_config, 'lr_scheduler', 'warmup_steps')} = {cfg.warmup_steps} exceeds "
            f"{where(job_config, 'training', 'steps')} = {steps}: warming up over all {steps} steps "
            f"instead (the lr stays below its peak)")
    if cfg.decay_ratio is None:
        decay_steps = steps - warmup
    else:
        decay_steps = round(steps * cfg.decay_ratio)
        if warmup + decay_steps > steps:
            logger.warning(
                f"{where(job_config, 'lr_scheduler', 'warmup_steps')} ({warmup}) + decay_ratio's "
                f"{decay_steps} steps exceed training.steps ({steps}); decaying over the last "
                f"{steps - warmup} steps instead")
            decay_steps = steps - warmup
    fn = functools.partial(
        lr_factor, warmup_steps=warmup, decay_start=steps - decay_steps, decay_steps=decay_steps,
        decay_type=cfg.decay_type, min_lr_factor=cfg.min_lr_factor)
    return LambdaLR(optimizer, fn)
