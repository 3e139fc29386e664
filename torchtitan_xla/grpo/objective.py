"""The GRPO objective (TRL's formulas, `[grpo]`): advantages from the rollout's rewards, and the
clipped per-token policy loss with an optional KL penalty, aggregated as `loss_type` says.

For a completion token with log-probability logp under the policy (at the sampling temperature),
old_logp under the policy that sampled it (logp itself, detached, when each rollout gets one
update) and ref under the reference model:

    ratio = exp(logp - old_logp)
    loss  = -min(ratio A, clamp(ratio, 1 - epsilon, 1 + epsilon_high) A) + beta KL
    KL    = exp(ref - logp) - (ref - logp) - 1          (the k3 estimator)

A is the completion's advantage: its reward minus its group's mean reward, divided by the group's
std (Bessel-corrected) + 1e-4 (scale_rewards "group"), by the whole rollout's std ("batch"), or
not divided ("none", Dr. GRPO). Aggregation over the step's completion tokens (`loss_type`):
grpo, each completion's token mean, averaged over completions; bnpo, each data-parallel rank's
microbatch's token mean, averaged over them; dapo, the token mean over the whole step; dr_grpo,
the token sum over (completions x max_completion_length).
"""

from __future__ import annotations

import torch

from torchtitan_xla.batch import Batch
from torchtitan_xla.config import JobConfig
from torchtitan_xla.losses import IGNORE_INDEX

STD_EPS = 1e-4  # TRL's


def advantages(rewards: torch.Tensor, num_generations: int, scale: str) -> torch.Tensor:
    """[completions] rewards, in groups of `num_generations` consecutive ones -> advantages."""
    groups = rewards.view(-1, num_generations)
    centred = (groups - groups.mean(-1, keepdim=True)).flatten()
    if scale == "group":
        std = groups.std(-1, keepdim=True).expand_as(groups).flatten()
    elif scale == "batch":
        std = rewards.std().expand_as(rewards)
    else:
        return centred
    return centred / (std + STD_EPS)


def per_token_losses(logps: torch.Tensor, old_logps: torch.Tensor, advantages: torch.Tensor,
                     reference_logps: torch.Tensor | None, *, epsilon: float, epsilon_high: float,
                     beta: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(loss, KL, clipped) per token, [rows, seq], of log-probs [rows, seq] and advantages [rows]."""
    ratio = torch.exp(logps - old_logps)
    a = advantages.unsqueeze(-1)
    clipped_ratio = ratio.clamp(1 - epsilon, 1 + epsilon_high)
    unclipped, clipped_loss = ratio * a, clipped_ratio * a
    # min(x, y) as a where: the same value and gradient (torch.minimum splits a tie's gradient
    # in halves that add up to it); DTensor has a rule for where's backward, none for minimum's.
    losses = -torch.where(unclipped <= clipped_loss, unclipped, clipped_loss)
    clipped = ((ratio < 1 - epsilon) & (a < 0)) | ((ratio > 1 + epsilon_high) & (a > 0))
    kl = torch.zeros_like(losses)
    if beta:
        delta = reference_logps - logps
        kl = torch.exp(delta) - delta - 1
        losses = losses + beta * kl
    return losses, kl, clipped


class GRPO:
    """`[training] objective = "grpo"` on rollout batches (rollouts.py): the batch's `advantages`
    [rows], `old_logps` [rows, seq] (num_iterations > 1) and `reference_logps` [rows, seq] (beta > 0),
    labels on the completion tokens only. Metrics, as TRL names them: the mean KL and the share of
    clipped tokens over the step's completion tokens."""

    metric_names = ("kl", "clip_ratio/region_mean")

    def __init__(self, job_config: JobConfig, *, accumulation_steps: int, dp_degree: int):
        g = job_config.grpo
        self.loss_type, self.max_completion_length = g.loss_type, g.max_completion_length
        self.accumulation_steps, self.dp_degree = accumulation_steps, dp_degree
        high = g.epsilon if g.epsilon_high == -1 else g.epsilon_high
        self.settings = dict(epsilon=g.epsilon, epsilon_high=high, beta=g.beta)
        self.needs_reference = g.beta > 0

    def totals(self, batch: Batch) -> torch.Tensor:
        """[completions, completion tokens] of the whole step."""
        counted = batch.labels != IGNORE_INDEX
        return torch.stack([torch.tensor(counted.shape[0], device=counted.device), counted.sum()])

    def __call__(self, token_losses: torch.Tensor, batch: Batch, totals: torch.Tensor):
        mask = (batch.labels != IGNORE_INDEX).float()
        logps = -token_losses.reshape(batch.labels.shape)
        old = logps.detach() if batch.old_logps is None else batch.old_logps
        losses, kl, clipped = per_token_losses(logps, old, batch.advantages, batch.reference_logps,
                                               **self.settings)
        losses, tokens = losses * mask, totals[1].clamp(min=1)
        if self.loss_type == "grpo":
            loss = (losses.sum(-1) / mask.sum(-1).clamp(min=1)).sum() / totals[0]
        elif self.loss_type == "bnpo":  # each rank's microbatch's token mean, averaged
            per_rank = mask.view(self.dp_degree, -1).sum(-1).clamp(min=1)
            ranks = losses.view(self.dp_degree, -1).sum(-1) / per_rank
            loss = ranks.sum() / (self.dp_degree * self.accumulation_steps)
        elif self.loss_type == "dapo":
            loss = losses.sum() / tokens
        else:  # dr_grpo
            loss = losses.sum() / (totals[0] * self.max_completion_length)
        metrics = torch.stack([(kl * mask).sum(), (clipped * mask).sum()]) / tokens
        return loss, metrics
