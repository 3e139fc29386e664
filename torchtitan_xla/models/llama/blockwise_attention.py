"""Causal attention in query blocks, written for the XLA CPU backend (`model.attention = "blockwise"`).

The same function as causal SDPA (tests/test_model.py checks values and gradients in float64), in
plain tensor ops: XLA lowers SDPA to full [seq, seq] score, mask and softmax tensors, and on the
CPU backend those dominate the step. Here block i of n attends only keys [0, end_i), so
(n - 1) / 2n of the score matrix, the masked upper triangle, is never computed.

The two batched products (scores = q k^T, out = probs v) have their own backward so that every
gradient product reaches XLA CPU in the one orientation its Eigen kernels run fast: both operands
row-major, contracting over the left operand's last and the right operand's first dimension, and
no [keys, head_dim] output (head_dim 16: a narrow matrix). XLA chooses the layouts itself; what
the code controls is which products it is given (tests/test_model.py checks the compiled result).
docs/performance.md has the measurements.
"""

from __future__ import annotations

import torch
from torch import nn

from torchtitan_xla.models.llama.layers import attention_mask, repeat_kv, softmax_with_sink, upcast


def _save_in_dtype(ctx, dtype: torch.dtype, *inputs: torch.Tensor) -> None:
    """Save the inputs for backward in the dtype the forward product ran in, and their own dtypes
    for the gradients: what autograd does under autocast (bf16), where the product's inputs are
    cast copies (softmax's probabilities stay float32) and each cast's backward casts back."""
    ctx.save_for_backward(*(x.to(dtype) for x in inputs))
    ctx.dtypes = tuple(x.dtype for x in inputs)


class _QueriesTimesKeys(torch.autograd.Function):
    """q @ k^T. Backward: dq = ds @ k written out, because from autograd's ds @ (k^T)^T XLA reads
    the k^T it laid out for the forward, a transposed operand for the contraction over keys
    (slower: docs/performance.md); dk as autograd computes it, (q^T @ ds)^T: a [head_dim, keys] product.
    (forward and setup_context apart, so that torch.vmap batches it: pipeline stages.)"""

    generate_vmap_rule = True

    @staticmethod
    def forward(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        return q @ k.transpose(-1, -2)

    @staticmethod
    def setup_context(ctx, inputs: tuple, output: torch.Tensor) -> None:
        _save_in_dtype(ctx, output.dtype, *inputs)

    @staticmethod
    def backward(ctx, grad_scores: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        q, k = ctx.saved_tensors
        grad_q = grad_scores @ k
        grad_k = (q.transpose(-1, -2) @ grad_scores).transpose(-1, -2)
        return grad_q.to(ctx.dtypes[0]), grad_k.to(ctx.dtypes[1])


class _ProbsTimesValues(torch.autograd.Function):
    """probs @ v. Backward: dv as (grad_out^T @ probs)^T, a [head_dim, keys] product transposed
    after, rather than autograd's probs^T @ grad_out, whose [keys, head_dim] output XLA CPU runs
    several times slower (docs/performance.md). The same sums."""

    generate_vmap_rule = True

    @staticmethod
    def forward(probs: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return probs @ v

    @staticmethod
    def setup_context(ctx, inputs: tuple, output: torch.Tensor) -> None:
        _save_in_dtype(ctx, output.dtype, *inputs)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        probs, v = ctx.saved_tensors
        grad_v = (grad_out.transpose(-1, -2) @ probs).transpose(-1, -2)
        return (grad_out @ v.transpose(-1, -2)).to(ctx.dtypes[0]), grad_v.to(ctx.dtypes[1])


class BlockwiseCausalAttention(nn.Module):
    """Causal attention over [batch, heads, seq, head_dim] in `blocks` query blocks (within
    documents, given `document_ids`); replaces a block's `attention.sdpa`
    (attention_kernels.apply_attention_kernel). With a sliding `window`, each query block reads
    only the keys from its first query's window on, in blocks half a window long at most: the
    keys wholly outside the window are never multiplied. `sinks` [heads] (gpt-oss): one more logit
    per head in each softmax's denominator."""

    def __init__(self, blocks: int = 4, window: int = 0):
        super().__init__()
        self.blocks, self.window = blocks, window

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                document_ids: torch.Tensor | None = None,
                positions: torch.Tensor | None = None, *, sinks: torch.Tensor | None = None) -> torch.Tensor:
        # Keys are skipped by index: the positions are those of a sequence in index order (the
        # config refuses this kernel with context parallelism, which reorders), so unused.
        k, v = repeat_kv(k, q.shape[1]), repeat_kv(v, q.shape[1])
        seqlen, window = q.shape[-2], self.window
        n = min(max(self.blocks, -(-2 * seqlen // window) if window else 0), seqlen)
        bounds = [seqlen * i // n for i in range(n + 1)]
        q = q * q.shape[-1] ** -0.5
        outs = []
        for start, end in zip(bounds[:-1], bounds[1:]):
            first = max(start - window + 1, 0) if window else 0  # the first key any query here sees
            scores = _QueriesTimesKeys.apply(q[..., start:end, :], k[..., first:end, :])
            # Each block's mask is built from positions, not sliced from one [seq, seq] mask: with
            # sliced masks, op-level selective checkpointing (torch's dispatch-mode SAC) on
            # torch_xla 2.9 gave wrong forward values from 4 blocks on (cause not found; the
            # selective_op tests compare against no checkpointing bit for bit).
            mask = attention_mask(torch.arange(start, end, device=q.device),
                                  torch.arange(first, end, device=q.device), document_ids, window)
            scores = scores.masked_fill(~mask, float("-inf"))  # never a whole row: a query sees itself
            probs = (torch.softmax(scores, dim=-1) if sinks is None  # (float32 under autocast, as this)
                     else softmax_with_sink(upcast(scores), upcast(sinks)[:, None, None]))
            outs.append(_ProbsTimesValues.apply(probs, v[..., first:end, :]))
        return torch.cat(outs, dim=-2)
