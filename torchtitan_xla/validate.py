"""Validation during training (`[validation]`): the plain cross-entropy on held-out data every
`freq` steps, as one compiled evaluation graph (forward and loss, no gradients, no optimizer).
With a preference objective on held-out pairs, that objective's loss and TRL's rewards/* metrics
instead (eval_rewards/accuracies in TRL), the reference's log-probabilities scored by its own graph
(or stored with the pairs). With grpo, the mean reward of completions of held-out prompts.

Every validation reads the same batches from the start of the split, so the curve compares like
with like. It reads the model's parameters and writes nothing: a run with validation has the
training losses of a run without it, bit for bit (tested).
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from torchtitan_xla import runtime
from torchtitan_xla.batch import Batch
from torchtitan_xla.config import JobConfig, renamed_keys
from torchtitan_xla.config.job_config import PREFERENCE_DATASETS
from torchtitan_xla.errors import ConfigError
from torchtitan_xla.logging import logger
from torchtitan_xla.losses import IGNORE_INDEX, LossFn


@dataclass
class ValidationResult:
    loss: float  # mean over every counted token of every batch (a preference objective's: of every pair)
    tokens: int
    batches: int
    seconds: float
    metrics: dict[str, float] = field(default_factory=dict)  # a preference objective's, over every pair

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


def validates_pairs(job_config: JobConfig) -> bool:
    """Whether validation reads preference pairs (it then scores the preference objective)."""
    return validation_config(job_config).training.dataset in PREFERENCE_DATASETS


class Validator:
    """`validator.run()` -> ValidationResult over `steps` batches of a fresh loader (all of them
    with steps = -1). `make_loader()` builds that loader; `eval_step(batch)` is the compiled
    graph returning [sum of token losses, counted tokens], or with a preference objective [its
    loss, its metrics named `metric_names` (batch means), counted tokens, pairs], the batch's
    `reference_logps` first scored by `reference(batch)` where a reference model runs (else the
    pairs carry them, or the objective has no reference)."""

    def __init__(self, *, freq: int, steps: int, make_loader: Callable, eval_step: Callable,
                 metric_names: tuple[str, ...] = (), reference: Callable | None = None):
        self.freq, self.steps = freq, steps
        self.make_loader, self.eval_step = make_loader, eval_step
        self.metric_names, self.reference = metric_names, reference
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
            for loaded in loader:
                batch = Batch.of(loaded)
                if self.reference is not None:
                    batch = batch.replace(reference_logps=self.reference(batch))
                sums.append(self.eval_step(batch))
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
        values = [[float(x) for x in v] for v in runtime.to_host(sums)]
        tokens = int(sum(v[-1 - bool(self.metric_names)] for v in values))
        self.runs += 1
        seconds = time.perf_counter() - start
        if not self.metric_names:
            loss = sum(v[0] for v in values) / max(tokens, 1)
            return ValidationResult(loss=loss, tokens=tokens, batches=len(sums), seconds=seconds)
        # Each batch's means weighted by its pairs (packed rows hold different numbers): the
        # means over every validated pair.
        pairs = sum(v[-1] for v in values)
        means = [sum(v[k] * v[-1] for v in values) / pairs for k in range(len(self.metric_names) + 1)]
        return ValidationResult(loss=means[0], tokens=tokens, batches=len(sums), seconds=seconds,
                                metrics=dict(zip(self.metric_names, means[1:])))


class RewardValidator:
    """grpo: the mean reward of the policy's completions of the held-out prompts (TRL's
    eval_reward), each function's and the completions' mean length, every `freq` steps; sampled
    with the same seed each time, so that the curve compares like with like."""

    def __init__(self, *, freq: int, rollouts, model: torch.nn.Module):
        self.freq, self.rollouts, self.runs = freq, rollouts, 0
        rollouts.sample_from(model)

    def due(self, step: int) -> bool:
        return step % self.freq == 0

    @property
    def warming_up(self) -> bool:
        """Its generation graphs (of its own batch size) compile at its first run."""
        return self.runs == 0

    def run(self) -> ValidationResult:
        start = time.perf_counter()
        figures = self.rollouts.evaluate()
        self.runs += 1
        return ValidationResult(loss=math.nan, tokens=0, batches=len(self.rollouts.records),
                                seconds=time.perf_counter() - start, metrics=figures)


def build_validator(job_config: JobConfig, *, model: torch.nn.Module, loss_fn: LossFn,
                    make_loader: Callable, host_count: int = 1, objective=None,
                    reference: Callable | None = None) -> Validator:
    """The Validator for `model`; `loss_fn` is the plain cross-entropy (no smoothing, no z-loss:
    the validation loss is the model's, so its exp is the perplexity). `objective`: a preference
    objective (objectives.py) built for one validation batch's pairs, scoring held-out pairs;
    `reference` its reference's scoring graph (reference/) for dpo and ipo, unless stored."""
    v = job_config.validation
    # The loader reads validation's data through [training]'s keys: its errors name [validation]'s.
    own = {"dataset_split": True, "dataset": bool(v.dataset), "dataset_path": bool(v.dataset_path)}
    renamed = renamed_keys({("training", k): ("validation", k) for k, mine in own.items() if mine})
    if job_config.training.objective == "grpo":
        with renamed:
            return RewardValidator(freq=v.freq, rollouts=make_loader(), model=model)
    if v.steps == -1 and host_count > 1:
        # Hosts would reach the end of their shares at different batches, one of them alone in
        # the eval graph's collectives.
        raise ConfigError(f"[validation] steps = -1 (the whole split) runs on one host only; "
                          f"this run has {host_count}: give a number of batches")

    @torch.no_grad()
    def eval_step(batch: Batch) -> torch.Tensor:
        model.eval()  # no dropout (LoRA's) in the traced graph
        try:
            losses = loss_fn(model, batch.inputs, batch.labels, *batch.packing).float()
        finally:
            model.train()
        counted = (batch.labels != IGNORE_INDEX).sum().to(losses.dtype)
        if objective is None:
            return torch.stack([losses.sum(), counted])
        totals = objective.totals(batch)
        loss, metrics = objective(losses, batch, totals)
        return torch.cat([loss.view(1), metrics, counted.view(1), totals[:1].to(losses.dtype)])

    state = [*model.parameters(), *model.buffers()]  # read, never written
    compiled = runtime.build_step(job_config.compile.step, eval_step, state, name="eval_step", whole=True)
    with renamed:
        return Validator(freq=v.freq, steps=v.steps, make_loader=make_loader, eval_step=compiled,
                         metric_names=objective.metric_names if objective else (), reference=reference)
