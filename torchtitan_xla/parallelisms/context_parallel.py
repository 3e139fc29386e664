"""Context parallelism's causal load balancing: the order of a sequence's tokens on the `cp` axis.

Split over `cp` devices in index order, a causal sequence gives the last device cp times the
attention work of the first (its queries see the most keys). Cut into 2 x cp chunks, device i
holding chunks i and 2cp-1-i, every device has the same work (TorchPrime's and MaxText's layout).
The reordering happens on the host, before the batch reaches the devices, on tokens, labels,
positions and document ids together; the model takes positions and document ids, computes RoPE
and the attention mask from them (models/llama/layers.py: `position_mask`), and so never sees the
order. The per-token losses come out in the same order as the labels, and are summed: nothing to
restore. The sharding side (activations split over `cp`, keys and values gathered) is
`apply_activation_sharding` in parallelize_llama.py.
"""

from __future__ import annotations

from typing import Callable

import torch

from torchtitan_xla.parallelisms.parallel_dims import ParallelDims


def load_balanced_order(seq_len: int, cp: int) -> torch.Tensor:
    """The token indices in their balanced order: [chunk 0, chunk 2cp-1, chunk 1, chunk 2cp-2, ...],
    so that the i-th of cp equal parts holds chunks i and 2cp-1-i."""
    chunks = torch.arange(seq_len).view(2 * cp, seq_len // (2 * cp))
    return torch.cat([torch.cat([chunks[i], chunks[2 * cp - 1 - i]]) for i in range(cp)])


def balance_batches(parallel_dims: ParallelDims, seq_len: int) -> Callable[[tuple], tuple] | None:
    """The host batch transform of a load-balanced context-parallel run: (inputs, labels[,
    positions, document_ids]) -> (inputs, labels, positions, document_ids), every tensor reordered
    along the sequence; a sequence without documents becomes one document. None when no reordering
    is needed."""
    if parallel_dims.cp == 1 or not parallel_dims.cp_load_balance:
        return None
    order = load_balanced_order(seq_len, parallel_dims.cp)

    def reorder(batch: tuple) -> tuple:
        inputs, labels, *packing = batch
        if not packing:
            packing = (torch.arange(seq_len).expand_as(inputs), torch.ones_like(inputs))
        return tuple(t[:, order] for t in (inputs, labels, *packing))

    return reorder


def attention_work(positions: torch.Tensor, document_ids: torch.Tensor, cp: int) -> list[int]:
    """(query, key) pairs each of the `cp` devices attends over for one sequence laid out as given
    (positions, document_ids [seq]): the work of a kernel that skips masked pairs (splash), as
    counted from the mask each device holds: its own queries against every key."""
    queries = positions.view(cp, -1)
    docs = document_ids.view(cp, -1)
    seen = (positions[None, None, :] <= queries[:, :, None]) & (document_ids[None, None, :] == docs[:, :, None])
    return seen.sum((1, 2)).tolist()
