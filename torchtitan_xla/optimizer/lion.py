"""Lion (Chen et al., 2023): the sign of an interpolated momentum as the update, decoupled weight
decay; one state tensor per parameter. The same update as the lion-pytorch package (tested equal
to it); written here because torch has no Lion. Its lr is typically 3-10x below AdamW's and its
weight decay as much higher."""

from __future__ import annotations

import torch

from torchtitan_xla.optimizer.state import new_states, zeros_like_param


class Lion(torch.optim.Optimizer):
    def __init__(self, params, *, lr: float = 1e-4, betas: tuple[float, float] = (0.9, 0.99),
                 weight_decay: float = 0.0):
        super().__init__(params, dict(lr=lr, betas=betas, weight_decay=weight_decay))

    @torch.no_grad()
    def init_state(self) -> None:
        for _, p, state in new_states(self):
            state["exp_avg"] = zeros_like_param(p)

    @torch.no_grad()
    def step(self, closure=None):
        self.init_state()
        for group in self.param_groups:
            lr, (beta1, beta2) = group["lr"], group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                m = self.state[p]["exp_avg"]
                p.mul_(1 - lr * group["weight_decay"])
                p.sub_(m.lerp(p.grad, 1 - beta1).sign() * lr)
                m.lerp_(p.grad, 1 - beta2)
