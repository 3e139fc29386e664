"""Optimizer state created before the first step (so step 1 traces the graph step 2 replays, and a
checkpoint loads into it in place), each tensor of a parameter's shape sharded like it."""

from __future__ import annotations

from collections.abc import Iterator

import torch

from torchtitan_xla import runtime


def new_states(optimizer: torch.optim.Optimizer) -> Iterator[tuple[dict, torch.Tensor, dict]]:
    """(group, parameter, its state dict) for every parameter that has no state yet."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            if not optimizer.state[p]:
                yield group, p, optimizer.state[p]


def zeros_like_param(p: torch.Tensor, shape: torch.Size | None = None) -> torch.Tensor:
    """A zero state tensor for `p`: its shape (or `shape`), with p's sharding when the shapes match,
    replicated otherwise."""
    if shape is None or tuple(shape) == tuple(p.shape):
        t = torch.zeros_like(p)  # a DTensor's layout comes with it; XLA's is copied
        runtime.copy_sharding(p, t)
        return t
    # Replicated: new_zeros of a DTensor is a DTensor on its mesh (a plain tensor here would make
    # the in-place updates mix the two, which torch 2.11's DTensor refuses).
    return p.new_zeros(shape)
