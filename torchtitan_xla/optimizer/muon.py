"""Muon: momentum whose update is orthogonalised by a Newton-Schulz iteration, for the 2-D hidden
weights; every other parameter (embeddings, the output projection, norms) by AdamW, as Muon's
reference recipe does. One optimizer with two parameter groups, so its state is one state dict.

The matrix update is torch.optim.Muon's (tested against it): Nesterov momentum, the quintic
Newton-Schulz iteration with coefficients (3.4445, -4.7750, 2.0315), decoupled weight decay, and
the learning rate scaled per matrix shape: "match_rms_adamw" (Moonshot's 0.2 * sqrt(max(A, B)),
so the AdamW learning rate and weight decay carry over) or "original" (sqrt(max(1, A / B))).
The iteration runs in `ns_dtype` (bfloat16 as the reference, or float32). On a sharded weight XLA
gathers what the iteration's matmuls need (docs/performance.md).
"""

from __future__ import annotations

import math

import torch

from torchtitan_xla.optimizer.state import new_states, zeros_like_param

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
NS_EPS = 1e-7


def muon_param_groups(model: torch.nn.Module) -> list[dict]:
    """[Muon's group: the trainable 2-D weights inside `layers` (linear layers', not gpt-oss's
    expert biases [E, dim]), AdamW's group: the other trainable parameters]."""
    matrices, others = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        matrix = name.startswith("layers.") and name.endswith(".weight") and p.dim() == 2
        (matrices if matrix else others).append(p)
    return [{"params": matrices, "use_muon": True}, {"params": others, "use_muon": False}]


def newton_schulz(g: torch.Tensor, steps: int, dtype: torch.dtype) -> torch.Tensor:
    """The orthogonalised direction of the matrix `g` (U S' V^T with S' near 1), iterated in
    `dtype`: every product takes `dtype` operands and accumulates in float32 (or wider), and each of
    torch.optim.Muon's two addmm per step rounds to `dtype` once, as torch's do. (Written as
    products and sums: torch_xla 2.9 runs addmm with coefficients on the CPU, an aten fallback a
    compiled step cannot contain.)"""
    a, b, c = NS_COEFFICIENTS
    acc = torch.promote_types(dtype, torch.float32)
    x = g.to(dtype)
    tall = g.shape[0] > g.shape[1]
    if tall:
        x = x.T
    # The norm summed in float32 then rounded to `dtype`, as torch's bfloat16 norm on CPU and CUDA:
    # XLA sums a bfloat16 reduction in bfloat16 (10% low for a 64 x 256 matrix, measured).
    x = x / x.to(acc).norm().to(dtype).clamp(min=NS_EPS)
    for _ in range(steps):
        gram = _product(x, x.T, acc).to(dtype)
        update = (b * gram.to(acc) + c * _product(gram, gram, acc)).to(dtype)
        x = (a * x.to(acc) + _product(update, x, acc)).to(dtype)
    return x.T if tall else x


def _product(m: torch.Tensor, n: torch.Tensor, acc: torch.dtype) -> torch.Tensor:
    """m @ n accumulated and returned in `acc` (on XLA one dot with a wider result: what TPU
    matrix units do with bfloat16 operands)."""
    if m.device.type == "xla" and acc != m.dtype:
        from torchtitan_xla import runtime

        dot_f32 = runtime.kernels.dot_f32

        return dot_f32(m, n, [1], [0]).to(acc)
    return m.to(acc) @ n.to(acc)


def lr_scale(shape: torch.Size, adjust_lr: str) -> float:
    rows, cols = shape[:2]
    if adjust_lr == "match_rms_adamw":
        return 0.2 * math.sqrt(max(rows, cols))
    return math.sqrt(max(1, rows / cols))


class Muon(torch.optim.Optimizer):
    def __init__(self, params, *, lr: float = 1e-3, muon_lr: float | None = None,
                 weight_decay: float = 0.1, momentum: float = 0.95, nesterov: bool = True,
                 ns_steps: int = 5, ns_dtype: torch.dtype = torch.bfloat16,
                 adjust_lr: str = "match_rms_adamw", betas: tuple[float, float] = (0.9, 0.95),
                 eps: float = 1e-8):
        defaults = dict(lr=lr, weight_decay=weight_decay, momentum=momentum, nesterov=nesterov,
                        ns_steps=ns_steps, ns_dtype=ns_dtype, adjust_lr=adjust_lr, betas=betas,
                        eps=eps, use_muon=False)
        super().__init__(params, defaults)
        for group in self.param_groups:
            if group["use_muon"]:
                if muon_lr is not None:
                    group["lr"] = muon_lr
                if any(p.dim() != 2 for p in group["params"]):
                    raise ValueError("Muon's group takes 2-D parameters only")

    @torch.no_grad()
    def init_state(self) -> None:
        for group, p, state in new_states(self):
            if group["use_muon"]:
                state["momentum_buffer"] = zeros_like_param(p)
            else:
                state["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
                state["exp_avg"], state["exp_avg_sq"] = zeros_like_param(p), zeros_like_param(p)

    @torch.no_grad()
    def step(self, closure=None):
        self.init_state()
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if group["use_muon"]:
                self._muon(group, params)
            else:
                self._adamw(group, params)

    def _muon(self, group: dict, params: list[torch.Tensor]) -> None:
        lr, momentum = group["lr"], group["momentum"]
        for p in params:
            buf = self.state[p]["momentum_buffer"]
            buf.lerp_(p.grad, 1 - momentum)
            update = p.grad.lerp(buf, momentum) if group["nesterov"] else buf
            update = newton_schulz(update, group["ns_steps"], group["ns_dtype"]).to(p.dtype)
            p.mul_(1 - lr * group["weight_decay"])
            p.sub_(update * (lr * lr_scale(p.shape, group["adjust_lr"])))

    def _adamw(self, group: dict, params: list[torch.Tensor]) -> None:
        from torch.optim.adamw import adamw

        state = [self.state[p] for p in params]
        beta1, beta2 = group["betas"]
        adamw(
            params, [p.grad for p in params], [s["exp_avg"] for s in state],
            [s["exp_avg_sq"] for s in state], [], [s["step"] for s in state], foreach=False,
            capturable=any(p.device.type != "cpu" for p in params), amsgrad=False, beta1=beta1,
            beta2=beta2, lr=group["lr"], weight_decay=group["weight_decay"], eps=group["eps"],
            maximize=False)
