"""Sequence parallelism's gather of the norms' outputs in the compute dtype.

Under autocast the residual stream and the norms stay float32, and the column-parallel layers
after a norm read its output in bfloat16. Gathering it whole along the sequence in float32 (where
the partitioner puts the gather otherwise) moves twice the bytes the layers read: cast first,
gather, and hand the layers the float32 of the bf16 values (which they cast back, exactly). The
gradient passes in float32 (autograd's own cast would round the layers' summed input gradient).
"""

from __future__ import annotations

from collections.abc import Callable

import torch


class _GatherIn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, dtype: torch.dtype, gather: Callable,
                scatter: Callable) -> torch.Tensor:
        ctx.scatter = scatter
        # The cast held in the input's layout, or XLA's partitioner gathers before casting.
        return gather(scatter(x.to(dtype))).to(x.dtype)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return ctx.scatter(grad), None, None, None


def gather_in_compute_dtype(gather: Callable, scatter: Callable) -> Callable[[torch.Tensor], torch.Tensor]:
    """`gather` (a constraint to the gathered layout) applied to the cast of its input under
    autocast; `scatter` (a constraint to the input's layout) applied to the gradient. Without
    autocast, `gather` itself."""

    def apply(x: torch.Tensor) -> torch.Tensor:
        kind = x.device.type
        if not torch.is_autocast_enabled(kind) or x.dtype != torch.float32:
            return gather(x)
        return _GatherIn.apply(x, torch.get_autocast_dtype(kind), gather, scatter)

    return apply
