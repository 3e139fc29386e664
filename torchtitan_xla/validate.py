"""Validation during training (`[validation]`): the plain cross-entropy on held-out data every
`freq` steps, as one compiled evaluation graph (forward and loss, no gradients, no optimizer).

Every validation reads the same batches from the start of the split, so the curve compares like
with like. It reads the model's parameters and writes nothing: a run with validation has the
training losses of a run without it, bit for bit (tested).
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from torchtitan_xla import runtime
from torchtitan_xla.config import JobConfig, renamed_keys
from torchtitan_xla.errors import ConfigError
from torchtitan_xla.logging import logger
from torchtitan_xla.losses import IGNORE_INDEX, LossFn


@dataclass
class ValidationResult:
    loss: float  # mean over every counted token of every batch
    tokens: int
    batches: int
    seconds: float

    @property
    def perplexity(self) -> float:
        return math.exp(min(self.loss, 700.0))  # exp overflows float64 past ~709


def validation_config(job_config: JobConfig) -> JobConfig:
    """The JobConfig whose [training] data keys describe the validation data (what
    build_data_loader reads): the validation dataset and split, source order, no workers."""
    v, t = job_config.validation, job_config.training
    dataset = v.dataset or t.dataset
    path = v.dataset_path or (t.dataset_path if dataset == t.dataset else "")
    training = dataclasses.replace(t, dataset=dataset, dataset_path=path, dataset_split=v.dataset_split,
                                   shuffle_buffer=0, num_workers=0)
    return dataclasses.replace(job_config, training=training)


class Validator:
    """`validator.run()` -> ValidationResult over `steps` batches of a fresh loader (all of them
    with steps = -1). `make_loader()` builds that loader; `eval_step(inputs, labels)` is the
    compiled graph returning [sum of token losses, counted tokens]."""

    def __init__(self, *, freq: int, steps: int, make_loader: Callable, eval_step: Callable):
        self.freq, self.steps = freq, steps
        self.make_loader, self.eval_step = make_loader, eval_step
        self.runs = self.calls = 0
        # Built now, so that a missing or unreadable validation set stops the run at start.
        self._loader = make_loader()

    def due(self, step: int) -> bool:
        return step % self.freq == 0

    @property
    def warming_up(self) -> bool:
        """The eval graph is traced (and compiled) at its first two calls."""
        return self.calls < 2

    def run(self) -> ValidationResult:
        start = time.perf_counter()
        loader, self._loader = self._loader or self.make_loader(), None
        sums = []
        try:
            for batch in loader:
                sums.append(self.eval_step(*batch))
                self.calls += 1
                if len(sums) == self.steps:
                    break
        finally:
            loader.close()
        if not sums:
            raise ConfigError("[validation]: the validation split holds less than one batch "
                              "(local_batch_size x data-parallel degree sequences)")
        if self.steps > 0 and len(sums) < self.steps and self.runs == 0:
            logger.warning(f"[validation] steps = {self.steps}: the split holds only {len(sums)} "
                           f"batches; validating on those")
        # One transfer for every batch's sums, after the last batch was queued.
        values = runtime.to_host(sums)
        loss_sum = sum(float(v[0]) for v in values)
        tokens = int(sum(float(v[1]) for v in values))
        self.runs += 1
        return ValidationResult(loss=loss_sum / max(tokens, 1), tokens=tokens, batches=len(sums),
                                seconds=time.perf_counter() - start)


def build_validator(job_config: JobConfig, *, model: torch.nn.Module, loss_fn: LossFn,
                    make_loader: Callable, host_count: int = 1) -> Validator:
    """The Validator for `model`; `loss_fn` is the plain cross-entropy (no smoothing, no z-loss:
    the validation loss is the model's, so its exp is the perplexity)."""
    v = job_config.validation
    if v.steps == -1 and host_count > 1:
        # Hosts would reach the end of their shares at different batches, one of them alone in
        # the eval graph's collectives.
        raise ConfigError(f"[validation] steps = -1 (the whole split) runs on one host only; "
                          f"this run has {host_count}: give a number of batches")

    @torch.no_grad()
    def eval_step(inputs: torch.Tensor, labels: torch.Tensor, *packing: torch.Tensor) -> torch.Tensor:
        model.eval()  # no dropout (LoRA's) in the traced graph
        try:
            losses = loss_fn(model, inputs, labels, *packing).float()
        finally:
            model.train()
        counted = (labels != IGNORE_INDEX).sum()
        return torch.stack([losses.sum(), counted.to(losses.dtype)])

    state = [*model.parameters(), *model.buffers()]  # read, never written
    compiled = runtime.build_step(job_config.compile.step, eval_step, state, name="eval_step")
    # The loader reads validation's data through [training]'s keys: its errors name [validation]'s.
    own = {"dataset_split": True, "dataset": bool(v.dataset), "dataset_path": bool(v.dataset_path)}
    with renamed_keys({("training", k): ("validation", k) for k, mine in own.items() if mine}):
        return Validator(freq=v.freq, steps=v.steps, make_loader=make_loader, eval_step=compiled)
