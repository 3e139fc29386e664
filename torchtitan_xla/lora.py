"""LoRA (`[lora]`): low-rank adapters trained beside frozen weights.

A target layer computes  W x + (alpha / r) B A dropout(x),  with A [r, in] and B [out, r]: peft's
LoRA, under peft's names (`lora_A.weight`, `lora_B.weight`), so an adapter exports as a PEFT folder
by renaming alone (checkpoint/hf.py). `apply_lora` swaps each target `nn.Linear` for `LoRALinear`, a
subclass that keeps `weight`: checkpoints, HF import and the parallelize plan find the base weights
under the same names. Everything else is frozen: no gradients and no optimizer state.

A starts random and B at zero (peft's default), so training starts from the base model exactly.
"""

from __future__ import annotations

import contextlib
import math
import re
from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from torchtitan_xla.logging import logger

if TYPE_CHECKING:
    from torchtitan_xla.config.job_config import LoRA

_ADAPTER = re.compile(r"(.+)\.(lora_[AB])\.weight")


class LoRALinear(nn.Linear):
    """nn.Linear plus a rank-r adapter; made from an existing Linear by `LoRALinear.wrap`."""

    rank: int
    scaling: float

    @classmethod
    def wrap(cls, linear: nn.Linear, rank: int, alpha: float, dropout: float) -> LoRALinear:
        linear.__class__ = cls  # keeps `weight` (and its name) as it is
        linear.rank, linear.scaling = rank, alpha / rank
        device, dtype = linear.weight.device, linear.weight.dtype
        linear.lora_A = nn.Linear(linear.in_features, rank, bias=False, device=device, dtype=dtype)
        linear.lora_B = nn.Linear(rank, linear.out_features, bias=False, device=device, dtype=dtype)
        linear.lora_dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        return linear

    adapter_enabled = True  # off: the base layer (a preference objective's reference model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.adapter_enabled:
            return F.linear(x, self.weight, self.bias)
        adapter = self.lora_B(self.lora_A(self.lora_dropout(x)))
        return F.linear(x, self.weight, self.bias) + adapter * self.scaling

    @torch.no_grad()
    def init_adapter(self) -> None:
        # peft's init: A as nn.Linear's default (Kaiming uniform, a = sqrt(5)), B zero.
        nn.init.kaiming_uniform_(self.lora_A.weight, a=math.sqrt(5))
        nn.init.zeros_(self.lora_B.weight)


def apply_lora(model: nn.Module, cfg: LoRA) -> None:
    """Freeze the model and give every Linear of a block named in `cfg.target_modules` an adapter
    (on the meta device, before the model is materialised). rank 0: nothing to do."""
    if cfg.rank == 0:
        return
    model.requires_grad_(False)
    wrapped = 0
    for name, module in list(model.named_modules()):
        if type(module) is nn.Linear and name.startswith("layers.") \
                and name.rpartition(".")[2] in cfg.target_modules:
            LoRALinear.wrap(module, cfg.rank, cfg.alpha, cfg.dropout)
            wrapped += 1
    # With the embedding frozen, no block input would require grad, and a reentrant activation
    # checkpoint (torch_xla's) gives a block output without gradient: the first block's input must
    # ask for one (peft's enable_input_require_grads).
    model.tok_embeddings.register_forward_hook(lambda m, args, out: out.requires_grad_())
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in model.parameters())
    logger.info(f"LoRA: rank {cfg.rank}, alpha {cfg.alpha:g} on {wrapped} layers "
                f"({', '.join(cfg.target_modules)}); {trainable:,} trainable of {total:,} parameters")


@contextlib.contextmanager
def adapters_disabled(model: nn.Module) -> Iterator[None]:
    """The model without its adapters (the base model, as peft's `disable_adapter()`)."""
    layers = [m for m in model.modules() if isinstance(m, LoRALinear)]
    for m in layers:
        m.adapter_enabled = False
    try:
        yield
    finally:
        for m in layers:
            m.adapter_enabled = True


def init_adapters(model: nn.Module) -> None:
    """Initialise every adapter (after the base weights are initialised)."""
    for module in model.modules():
        if isinstance(module, LoRALinear):
            module.init_adapter()


def frozen_matmul_params(model: nn.Module) -> int:
    """Elements of the frozen weights that multiply activations (all but the embedding, a lookup):
    their backward computes the input's gradient only (metrics.num_flops_per_token)."""
    return sum(p.numel() for name, p in model.named_parameters()
               if not p.requires_grad and not name.startswith("tok_embeddings."))


def is_adapter(name: str) -> bool:
    return _ADAPTER.fullmatch(name) is not None


def split_adapter(name: str) -> tuple[str, str | None]:
    """`layers.0.attention.wq.lora_A.weight` -> (`layers.0.attention.wq.weight`, "lora_A");
    a base weight's name -> (name, None)."""
    m = _ADAPTER.fullmatch(name)
    return (f"{m.group(1)}.weight", m.group(2)) if m else (name, None)


def merge(state_dict: dict[str, torch.Tensor], alpha: float) -> dict[str, torch.Tensor]:
    """The base weights with every adapter folded in, W + (alpha / r) B A, computed in float64 and
    returned in W's dtype; adapters dropped."""
    out = {k: v for k, v in state_dict.items() if not is_adapter(k)}
    for name, a in state_dict.items():
        base, kind = split_adapter(name)
        if kind != "lora_A":
            continue
        b = state_dict[name.replace(".lora_A.", ".lora_B.")]
        w = out[base]
        out[base] = (w.double() + (alpha / a.shape[0]) * (b.double() @ a.double())).to(w.dtype)
    return out
