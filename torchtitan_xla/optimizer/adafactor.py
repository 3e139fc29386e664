"""Adafactor (Shazeer and Stern, 2018) as torch.optim.Adafactor defines it (tested equal to it):
no first moment, the second moment of a matrix factored into row and column means, the step
size relative to the parameter's RMS and at most min(lr, 1/sqrt(t)), updates clipped to RMS `d`.

Written here because torch's reads the step count and two norms back to the host every step
(`.item()`), which a compiled step cannot do: the same arithmetic on device tensors.
"""

from __future__ import annotations

import torch

from torchtitan_xla.optimizer.state import new_states, zeros_like_param


class Adafactor(torch.optim.Optimizer):
    def __init__(self, params, *, lr: float = 1e-2, beta2_decay: float = -0.8,
                 eps: tuple[float | None, float] = (None, 1e-3), d: float = 1.0,
                 weight_decay: float = 0.0):
        super().__init__(params, dict(lr=lr, beta2_decay=beta2_decay, eps=eps, d=d,
                                      weight_decay=weight_decay))

    @torch.no_grad()
    def init_state(self) -> None:
        for _, p, state in new_states(self):
            state["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
            if p.dim() > 1:
                state["row_var"] = zeros_like_param(p, (*p.shape[:-1], 1))
                state["col_var"] = zeros_like_param(p, (*p.shape[:-2], 1, p.shape[-1]))
            else:
                state["variance"] = zeros_like_param(p)

    @torch.no_grad()
    def step(self, closure=None):
        self.init_state()
        for group in self.param_groups:
            lr, d, wd = group["lr"], group["d"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state, grad = self.state[p], p.grad
                eps1, eps2 = group["eps"]
                eps1 = torch.finfo(p.dtype).eps if eps1 is None else eps1
                step = state["step"]
                step += 1
                t = step.to(p.dtype)
                one_minus_beta2 = t ** group["beta2_decay"]
                rho = torch.clamp(1 / t.sqrt(), max=lr)  # min(lr, 1 / sqrt(t))
                alpha = torch.clamp(p.norm() / p.numel() ** 0.5, min=eps2) * rho
                if wd:
                    p.mul_(1 - lr * wd)
                if grad.dim() > 1:
                    row_var, col_var = state["row_var"], state["col_var"]
                    row_var.lerp_(grad.norm(dim=-1, keepdim=True).square() / grad.shape[-1], one_minus_beta2)
                    col_var.lerp_(grad.norm(dim=-2, keepdim=True).square() / grad.shape[-2], one_minus_beta2)
                    var = (row_var @ col_var) / row_var.mean(dim=-2, keepdim=True).clamp(min=eps1)
                else:
                    state["variance"].lerp_(grad * grad, one_minus_beta2)
                    var = state["variance"]
                update = var.clamp(min=eps1 * eps1).rsqrt() * grad
                denom = torch.clamp(update.norm() / (update.numel() ** 0.5 * d), min=1.0)
                p.sub_(update * (alpha / denom))
