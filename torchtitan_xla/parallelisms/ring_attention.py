"""Ring attention over the `cp` axis (`[parallelism] context_parallel_rotate_method = "ring"`).

The sequence is viewed as [cp chunks, chunk length] with the chunk dimension split over `cp`: each
device holds its queries, keys and values. In cp steps every device attends with its queries to
the keys and values it holds, accumulating with the online softmax (running max, running sum), then
passes them on: `torch.roll` by one along the split chunk dimension, which XLA's SPMD partitioner
turns into a collective permute between neighbouring `cp` devices (and autograd's backward into the
permute of their gradients the other way). No device ever holds the whole sequence's keys and
values; the mask comes from the positions and document ids, which travel with the keys, so the
load-balanced order works unchanged. Written as plain tensor ops on global shapes, as everything
else under SPMD: the partitioner makes it per-device.
"""

from __future__ import annotations

import torch
from torch import nn

from torchtitan_xla import runtime
from torchtitan_xla.models.llama.layers import repeat_kv, upcast
from torchtitan_xla.parallelisms.parallel_dims import BATCH_AXES

# A masked score: far below any real one, and below the running max's start (_START), so that a
# chunk a query sees nothing of adds exp(_MASKED - _START) = 0 (float32 and wider).
_START, _MASKED = -1e30, -2e30


class RingAttention(nn.Module):
    """Causal attention over q, k, v [batch, heads, seq, head_dim] with the sequence split over the
    `cp` axis of `mesh` into `cp` chunks; replaces a block's `attention.sdpa`."""

    def __init__(self, mesh, cp: int, window: int = 0):
        super().__init__()
        self.cp, self.window = cp, window
        # [batch, heads, chunk, chunk length, head_dim] with the chunks over cp (heads over tp).
        self.chunked = runtime.constraint(mesh, (BATCH_AXES, "tp", "cp", None, None))
        self.chunked_ids = runtime.constraint(mesh, (BATCH_AXES, "cp", None))  # [batch, chunk, length]

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                document_ids: torch.Tensor | None = None,
                positions: torch.Tensor | None = None) -> torch.Tensor:
        b, h, s, d = q.shape
        if positions is None:  # in index order, one document
            positions = torch.arange(s, device=q.device).expand(b, s)
            document_ids = torch.ones_like(positions)

        def chunks(t: torch.Tensor) -> torch.Tensor:
            return self.chunked(t.reshape(*t.shape[:2], self.cp, s // self.cp, t.shape[-1]))

        def id_chunks(t: torch.Tensor) -> torch.Tensor:
            return self.chunked_ids(t.reshape(b, self.cp, s // self.cp))

        q, k, v = chunks(q * d ** -0.5), chunks(k), chunks(v)
        q_pos, q_doc = id_chunks(positions), id_chunks(document_ids)
        k_pos, k_doc = q_pos, q_doc
        out = q.new_zeros(*q.shape[:-1], v.shape[-1], dtype=upcast(q).dtype)
        top = torch.full(q.shape[:-1], _START, dtype=out.dtype, device=q.device)
        total = torch.zeros_like(top)
        for step in range(self.cp):
            if step:  # the next device's keys, values and their ids (a collective permute)
                k, v, k_pos, k_doc = (shift(t, 2 if t.dim() == 5 else 1) for t in (k, v, k_pos, k_doc))
                k, v = self.chunked(k), self.chunked(v)
            scores = upcast(torch.einsum("bhcqd,bhckd->bhcqk", q, repeat_kv5(k, h)))
            seen = ((k_pos[:, None, :, None, :] <= q_pos[:, None, :, :, None])
                    & (k_doc[:, None, :, None, :] == q_doc[:, None, :, :, None]))
            if self.window:
                seen &= k_pos[:, None, :, None, :] > q_pos[:, None, :, :, None] - self.window
            scores = scores.masked_fill(~seen, _MASKED)
            new_top = torch.maximum(top, scores.amax(-1))
            keep = torch.exp(top - new_top)
            probs = torch.exp(scores - new_top[..., None])
            total = total * keep + probs.sum(-1)
            out = out * keep[..., None] + torch.einsum("bhcqk,bhckd->bhcqd", probs, upcast(repeat_kv5(v, h)))
            top = new_top
        out = (out / total[..., None]).type_as(v)
        return out.reshape(b, h, s, -1)


def _roll(t: torch.Tensor, dim: int, by: int) -> torch.Tensor:
    """torch.roll(t, by, dim) for by = +-1, as slices and a concatenation, which XLA's partitioner
    turns into one collective permute of each device's chunk (torch.roll it lowered to an
    all-gather)."""
    n = t.shape[dim]
    head, tail = (n - 1, 1) if by == 1 else (1, n - 1)
    return torch.cat([t.narrow(dim, head, tail), t.narrow(dim, 0, head)], dim)


class _Shift(torch.autograd.Function):
    """Chunk c of a tensor moved to c + 1 along `dim` (the last to 0); its backward moves the
    gradient back the same way (autograd's own, through the slices, also permuted their masks)."""

    @staticmethod
    def forward(ctx, t: torch.Tensor, dim: int) -> torch.Tensor:
        ctx.dim = dim
        return _roll(t, dim, 1)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _roll(grad, ctx.dim, -1), None


def shift(t: torch.Tensor, dim: int) -> torch.Tensor:
    """Chunk c of `t` moved to c + 1 along `dim` (the last to 0): one collective permute when `dim`
    is split over a mesh axis (ring attention's chunks, pipeline stages)."""
    return _Shift.apply(t, dim) if t.requires_grad else _roll(t, dim, 1)


def apply_ring_attention(model: nn.Module, mesh, cp: int) -> None:
    """Every block's attention module replaced by ring attention over `cp` (no parameters change),
    each block's window kept."""
    for block in model.layers.values():
        block.attention.sdpa = RingAttention(mesh, cp, window=block.attention.sdpa.window)


def repeat_kv5(x: torch.Tensor, heads: int) -> torch.Tensor:
    """`repeat_kv` for chunked [batch, kv_heads, chunk, length, head_dim]."""
    b, kv, c, n, d = x.shape
    return repeat_kv(x.reshape(b, kv, c * n, d), heads).reshape(b, heads, c, n, d)
