"""The native runtime's answers to the model-side kernel calls: plain PyTorch ones. The Pallas
kernels and scan over layers are torch_xla's; the config refuses them on this runtime before
anything is built (config/checks.py), so reaching one here is a bug."""

from __future__ import annotations

from collections.abc import Callable

import torch

from torchtitan_xla.runtime.common import python_scan as scan

__all__ = ["checkpoint", "check_torchax", "dot_f32", "enable_torch_checkpoint", "flash_attention",
           "grouped_mm", "optimization_barrier_", "scan", "scan_layers", "splash_attention",
           "total_norm"]


def _xla_only(name: str):
    def refuse(*args, **kwargs):
        raise NotImplementedError(f"{name} is the XLA runtime's ([runtime] backend = \"xla\")")
    return refuse


flash_attention = _xla_only("the Pallas flash attention kernel")
splash_attention = _xla_only("the Pallas splash attention kernel")
grouped_mm = _xla_only("the Pallas grouped matmul")
scan_layers = _xla_only("scan over layers")
check_torchax = _xla_only("scan over layers")


def dot_f32(a: torch.Tensor, b: torch.Tensor, a_dims: list[int], b_dims: list[int]) -> torch.Tensor:
    """`a` and `b` contracted over `a_dims` / `b_dims`, in float32 (free dims of a, then of b)."""
    return torch.tensordot(a.float(), b.float(), dims=(a_dims, b_dims))


def total_norm(tensors: list[torch.Tensor]) -> torch.Tensor:
    """The 2-norm of all `tensors` together, as a sum of squares. (torch's get_total_norm stacks
    per-tensor norms whose DTensor placements differ, sharded and replicated over tp, and
    combined them wrongly: 0.1-0.2% off with tensor parallelism, torch 2.9.)"""
    total = sum(t.float().square().sum() for t in tensors)
    return total.sqrt()


def checkpoint(fn: Callable, *args):
    """Full activation checkpointing of `fn(*args)`: torch's non-reentrant checkpoint."""
    from torch.utils.checkpoint import checkpoint as torch_checkpoint

    return torch_checkpoint(fn, *args, use_reentrant=False, preserve_rng_state=False)


def optimization_barrier_(tensors: list[torch.Tensor]) -> None:
    """Eager recomputation is never merged with the forward pass: nothing to fence."""


def enable_torch_checkpoint() -> None:
    """torch's checkpoint knows this runtime's devices."""
