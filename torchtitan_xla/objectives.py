"""What the training step minimises (`[training] objective`), from the per-token losses the loss
function gives (losses.py) and the batch's labels.

Each objective is called once per microbatch as `objective(token_losses, microbatch, totals)`
(a Batch, batch.py) and returns (that microbatch's share of the step's loss, its metric sums or
None); `totals` is what the objective normalises by, computed once over the whole step's batch
(`objective.totals(batch)`), so that accumulating microbatches gives the loss of the whole batch.
The step's metrics are the sums over microbatches (already divided by the step's count), logged
under `metric_names`.

- `lm`: next-token cross-entropy, the mean over every counted label of the step (pre-training
  and SFT).
- `dpo`, `ipo`, `simpo`, `orpo`: preference objectives on pairs of documents (preference.py:
  documents 2j + 1 and 2j + 2 of a packed row, or rows 2i and 2i + 1 unpacked, are a pair's chosen
  and rejected completions). A document's log-probability is the SUM of its completion tokens'
  log-probabilities (TRL's), gathered per document into a [rows, slots] tensor of static shape;
  the formulas are `preference_losses`, the mean over the step's pairs (a count over the whole
  batch: packed rows hold different numbers). dpo and ipo also take the reference model's
  per-document log-probabilities (reference/, or stored with the pairs), the batch's
  `reference_logps`.
- `grpo`: online RL on rollouts of the policy (grpo/objective.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from torchtitan_xla.batch import Batch
from torchtitan_xla.config import JobConfig
from torchtitan_xla.losses import IGNORE_INDEX

WITH_REFERENCE = ("dpo", "ipo")


def preference_losses(kind: str, logps: torch.Tensor, counts: torch.Tensor,
                      reference_logps: torch.Tensor | None, *, beta: float,
                      label_smoothing: float = 0.0, simpo_gamma: float = 0.5
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(losses, chosen rewards, rejected rewards), each [pairs], of pairs whose completions have
    summed log-probabilities `logps` [pairs, 2] (chosen, rejected) over `counts` [pairs, 2]
    tokens; `reference_logps` as `logps`, under the reference model (dpo, ipo).

    - dpo (the sigmoid loss; with label smoothing eps, conservative DPO):
      z = beta ((c - c_ref) - (r - r_ref)), loss = -(1 - eps) logsigmoid(z) - eps logsigmoid(-z)
    - ipo: the log-ratios divided by the completion lengths, loss = (delta - 1 / (2 beta))^2
    - simpo (TRL's CPO trainer with cpo_alpha = 0): average log-probabilities a,
      z = beta (a_c - a_r) - gamma, the loss as dpo's
    - orpo: average log-probabilities a, log odds(a) = a - log(1 - exp(a)),
      loss = -beta logsigmoid(log odds(a_c) - log odds(a_r)) (its NLL term is added by the caller)
    Rewards as TRL reports them: beta times the (length-normalised for ipo) log-ratio, or beta
    times the average log-probability where there is no reference."""
    eps = label_smoothing
    if kind in WITH_REFERENCE:
        ratios = logps - reference_logps
        if kind == "ipo":
            ratios = ratios / counts
        rewards = beta * ratios
        if kind == "dpo":
            z = rewards[:, 0] - rewards[:, 1]
            losses = -(1 - eps) * F.logsigmoid(z) - eps * F.logsigmoid(-z)
        else:
            losses = (ratios[:, 0] - ratios[:, 1] - 1 / (2 * beta)).square()
    else:
        average = logps / counts
        rewards = beta * average
        if kind == "simpo":
            z = rewards[:, 0] - rewards[:, 1] - simpo_gamma
            losses = -(1 - eps) * F.logsigmoid(z) - eps * F.logsigmoid(-z)
        else:  # orpo
            log_odds = average - torch.log1p(-torch.exp(average))
            losses = -beta * F.logsigmoid(log_odds[:, 0] - log_odds[:, 1])
    return losses, rewards[:, 0], rewards[:, 1]


def document_sums(values: torch.Tensor, document_ids: torch.Tensor, slots: int) -> torch.Tensor:
    """[rows, slots]: the sum of `values` [rows, seq] over each document of each row, document d
    (numbered from 1; 0 is padding) in slot d - 1. A row of one document (slots = 1) is its sum."""
    if slots == 1:
        return values.sum(-1, keepdim=True)
    sums = values.new_zeros(values.shape[0], slots + 1).scatter_add(1, document_ids, values)
    return sums[:, 1:]


def document_counts(batch: Batch, slots: int) -> torch.Tensor:
    """[rows, slots]: each document's counted (labelled) tokens."""
    return document_sums((batch.labels != IGNORE_INDEX).long(), batch.document_ids, slots)


def document_logps(token_losses: torch.Tensor, batch: Batch, slots: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(summed log-probability, counted tokens) of each document slot [rows, slots], from the loss
    function's per-token losses (any shape holding the rows in order; 0 where not counted)."""
    logps = document_sums(-token_losses.reshape(batch.labels.shape), batch.document_ids, slots)
    return logps, document_counts(batch, slots)


class LanguageModeling:
    """`lm`: the mean loss over every counted label of the step. Batches of whole sequences count
    every token: there it is written as the plain mean, the graph the plan's memory model was
    calibrated on."""

    metric_names: tuple[str, ...] = ()
    needs_reference = False

    def __init__(self, accumulation_steps: int):
        self.accumulation_steps = accumulation_steps

    def totals(self, batch: Batch) -> torch.Tensor | None:
        return (batch.labels != IGNORE_INDEX).sum().clamp(min=1) if batch.packed else None

    def __call__(self, token_losses: torch.Tensor, batch: Batch, totals: torch.Tensor | None):
        if totals is None:
            return token_losses.mean() / self.accumulation_steps, None
        return token_losses.sum() / totals, None


class Preference:
    """dpo, ipo, simpo, orpo on the step's pairs, `slots` documents to a row (module docstring).
    Metrics, as TRL logs them: the mean chosen and rejected rewards, their margin, and the fraction
    of pairs whose chosen reward is the larger."""

    metric_names = ("rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies")

    def __init__(self, kind: str, job_config: JobConfig, slots: int):
        cfg = job_config.preference
        self.kind, self.slots = kind, slots
        # A reference model to run: not where the pairs carry its log-probabilities.
        self.needs_reference = kind in WITH_REFERENCE and not cfg.precomputed_reference
        self.settings = dict(beta=cfg.beta, label_smoothing=cfg.label_smoothing,
                             simpo_gamma=cfg.simpo_gamma)

    def totals(self, batch: Batch) -> torch.Tensor:
        """[pairs, chosen completions' tokens] over the step: the losses' and ORPO's NLL's counts."""
        chosen = document_counts(batch, self.slots).reshape(-1, 2)[:, 0]
        return torch.stack([(chosen > 0).sum(), chosen.sum()]).clamp(min=1)

    def __call__(self, token_losses: torch.Tensor, batch: Batch, totals: torch.Tensor):
        logps, counts = (t.reshape(-1, 2) for t in document_logps(token_losses, batch, self.slots))
        real = counts[:, 0] > 0  # a slot of a packed row may hold no pair
        # An empty slot's sums are 0, whose log odds (ORPO) are infinite: a finite stand-in.
        logps = torch.where(real.unsqueeze(-1), logps, -1.0)
        reference = None if batch.reference_logps is None else batch.reference_logps.reshape(-1, 2)
        losses, chosen, rejected = preference_losses(self.kind, logps, counts.clamp(min=1), reference,
                                                     **self.settings)
        pairs = totals[0]
        loss = torch.where(real, losses, 0.0).sum() / pairs
        if self.kind == "orpo":
            loss = loss - torch.where(real, logps[:, 0], 0.0).sum() / totals[1]
        metrics = torch.stack([torch.where(real, chosen, 0.0).sum(), torch.where(real, rejected, 0.0).sum(),
                               torch.where(real, chosen - rejected, 0.0).sum(),
                               (real & (chosen > rejected)).float().sum()]) / pairs
        return loss, metrics


def runs_reference(job_config: JobConfig) -> bool:
    """Whether the objective runs a reference model: dpo and ipo (unless the pairs carry its
    log-probabilities, [preference] precomputed_reference), grpo with a KL penalty ([grpo] beta > 0)."""
    kind = job_config.training.objective
    if kind == "grpo":
        return job_config.grpo.beta > 0
    return kind in WITH_REFERENCE and not job_config.preference.precomputed_reference


def copies_reference(job_config: JobConfig) -> bool:
    """Whether the objective keeps a frozen copy of the weights (reference/): where it runs a
    reference, unless LoRA's base model (the adapters switched off) is the reference."""
    return runs_reference(job_config) and bool(job_config.preference.reference or not job_config.lora.rank)


def build_objective(job_config: JobConfig, *, accumulation_steps: int, dp_degree: int = 1):
    kind = job_config.training.objective
    if kind == "lm":
        return LanguageModeling(accumulation_steps)
    if kind == "grpo":
        from torchtitan_xla.grpo.objective import GRPO

        return GRPO(job_config, accumulation_steps=accumulation_steps, dp_degree=dp_degree)
    from torchtitan_xla.datasets.preference import document_slots

    t = job_config.training
    return Preference(kind, job_config, document_slots(t.seq_len, t.packing))
