"""What a training step does with a mixture of experts' routers, beside the loss (moe.py holds the
blocks themselves): the model's own forward stays the same for every objective.

- The router losses (load-balancing aux loss, z-loss) enter the backward pass inside each MoE
  block, weighted like the loss: averaged over the blocks and the step's microbatches.
- Their values, the dropped share and the load spread are the step's router statistics, averaged
  the same way, for the log line.
- DeepSeek-V3's routers balance by a bias, moved after each optimizer step by that step's expert
  load (every microbatch and rank). It is an optimizer step hook: whatever skips the update (a
  non-finite step) skips it too.
"""

from __future__ import annotations

import torch

from torchtitan_xla.models.llama.moe import set_router_loss_weights, update_expert_bias


class Routers:
    """`routers.start()` before a step's first forward, `routers.observe()` after each,
    `routers.stats()` at the end: [aux, z, dropped, spread] averaged, or None for a dense model."""

    def __init__(self, model: torch.nn.Module, moe_config, microbatches: int,
                 optimizer: torch.optim.Optimizer):
        self.blocks = set_router_loss_weights(model, moe_config.aux_loss_weight,
                                              moe_config.z_loss_weight, microbatches)
        self.rate = moe_config.bias_update_rate
        self.biased = [m for m in self.blocks if m.expert_bias is not None] if self.rate else []
        self._stats: list[torch.Tensor] = []
        self._counts: list[torch.Tensor] = []
        if self.biased:
            optimizer.register_step_post_hook(self._move_bias)

    @property
    def state(self) -> list[torch.Tensor]:
        """What the step writes besides the weights and the optimizer's state (the expert biases)."""
        return [m.expert_bias for m in self.biased]

    def start(self) -> None:
        self._stats, self._counts = [], []

    def observe(self) -> None:
        """After a forward: its blocks' statistics, and the expert counts summed over the step."""
        self._stats += [m.router_stats for m in self.blocks]
        counts = [m.expert_counts for m in self.biased]
        self._counts = [a + b for a, b in zip(self._counts, counts)] if self._counts else counts

    def stats(self) -> torch.Tensor | None:
        return torch.stack(self._stats).mean(0) if self._stats else None

    def _move_bias(self, optimizer, args, kwargs) -> None:
        # Only a step's own counts move the bias, once: an optimizer step with no forward
        # observed since the last move (none in train.py) leaves it as it is.
        if self._counts:
            update_expert_bias(self.biased, self._counts, self.rate)
            self._counts = []
