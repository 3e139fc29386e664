"""Context parallelism's causal load balancing: the order of a sequence's tokens on the `cp` axis.

Split over `cp` devices in index order, a causal sequence gives the last device cp times the
attention work of the first (its queries see the most keys). Cut into 2 x cp chunks, device i
holding chunks i and 2cp-1-i, every device has the same work (TorchPrime's and MaxText's layout).
The reordering happens on the host, before the batch reaches the devices, on tokens, labels,
positions and document ids together; the model takes positions and document ids, computes RoPE
and the attention mask from them (models/llama/layers.py: `position_mask`), and so never sees the
order. The per-token losses come out in the same order as the labels, and are summed: nothing to
restore. The sharding side: `apply_activation_sharding` in parallelize_llama.py (activations split
over `cp`, keys and values gathered), with the projections here.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
from torch import nn

from torchtitan_xla import runtime
from torchtitan_xla.parallelisms.compute_dtype import is_plain_linear, project
from torchtitan_xla.parallelisms.parallel_dims import BATCH_AXES, ParallelDims


def load_balanced_order(seq_len: int, cp: int) -> torch.Tensor:
    """The token indices in their balanced order: [chunk 0, chunk 2cp-1, chunk 1, chunk 2cp-2, ...],
    so that the i-th of cp equal parts holds chunks i and 2cp-1-i."""
    chunks = torch.arange(seq_len).view(2 * cp, seq_len // (2 * cp))
    return torch.cat([torch.cat([chunks[i], chunks[2 * cp - 1 - i]]) for i in range(cp)])


def balance_batches(parallel_dims: ParallelDims, seq_len: int) -> Callable[[tuple], tuple] | None:
    """The host batch transform of a load-balanced context-parallel run: (inputs, labels[,
    positions, document_ids[, per-row columns]]) -> (inputs, labels, positions, document_ids[,
    per-row columns]), every [rows, seq] tensor reordered along the sequence; a sequence without
    documents becomes one document. None when no reordering is needed."""
    if parallel_dims.cp == 1 or not parallel_dims.cp_load_balance:
        return None
    order = load_balanced_order(seq_len, parallel_dims.cp)

    def reorder(batch: tuple) -> tuple:
        inputs, labels, *packing = batch
        packing, per_row = packing[:2], packing[2:]  # per row: stored reference log-probabilities
        if not packing:
            packing = (torch.arange(seq_len).expand_as(inputs), torch.ones_like(inputs))
        return (*(t[:, order] for t in (inputs, labels, *packing)), *per_row)

    return reorder


def project_on_sequence_shards(block: nn.Module, mesh, seq: str, tp_spec: Callable) -> None:
    """Every projection of the block computed on this device's part of the sequence, as an einsum:
    nn.Linear flattens [batch, seq] into one dimension, which cannot be split over both the batch
    and the `cp` axes, so XLA gathered the sequence at every projection, forward and backward.
    Each projection's input, and its output unless row-parallel (the block's hooks constrain
    those), is held on the sequence split: the keys and values are then gathered after their
    projections, their gradients reduce-scattered before the projections' backward, and no weight
    gradient is computed from gathered activations (under TP, XLA gathered the attention output
    and the SwiGLU hidden for wo's and w2's)."""
    # `tp_spec`: parallelize_llama's (name, ndim) -> tensor-parallel spec of a weight.
    for name, layer in block.named_modules():
        if not is_plain_linear(layer):
            continue
        layer.forward = functools.partial(einsum_linear, layer)
        out_axis, in_axis = tp_spec(f"layers.0.{name}.weight", 2)
        inputs = runtime.constraint(mesh, (BATCH_AXES, seq, in_axis))
        layer.register_forward_pre_hook(lambda m, args, c=inputs: (c(args[0]),))
        outputs = runtime.constraint(mesh, (BATCH_AXES, seq, out_axis))
        layer.register_forward_hook(lambda m, args, out, c=outputs: c(out))


def einsum_linear(layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """layer(x) for x [batch, seq, in] and a layer with a `weight` [out, in] and no bias, the token
    dimensions kept apart."""
    return project(layer, x, tokens_apart=True)
