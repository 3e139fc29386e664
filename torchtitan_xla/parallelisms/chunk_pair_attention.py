"""Blockwise attention over a context-parallel sequence (`[model] attention = "blockwise"` with
`[parallelism] context_parallel_degree` > 1, keys and values gathered).

The sequence arrives split over `cp` and, load-balanced, reordered (context_parallel.py): device c
holds chunks c and 2cp-1-c of the 2 x cp chunks. Whole-sequence sdpa computes each device's
[2 chunks, 2cp chunks] of scores; causally, chunk j attends to chunks 0..j only, so a device needs
(c + 1) + (2cp - c) = 2cp + 1 (query chunk, key chunk) pairs, the same number on every device (the
point of the balanced order). This kernel computes exactly those pairs: a static table per device,
its key chunks gathered from the whole keys, masked by positions and document ids (not by index:
the sequence is reordered) and combined per query chunk with one softmax over all of a chunk's
pairs. With a sliding window, the pairs wholly outside it are dropped too (padded to one count with
masked pairs). Tensor ops on global shapes, as everything else under SPMD (the softmax's backward
written out), so FSDP, TP and scan take it unchanged.
"""

from __future__ import annotations

import torch
from torch import nn

from torchtitan_xla import runtime
from torchtitan_xla.models.llama.layers import upcast
from torchtitan_xla.parallelisms.context_parallel import load_balanced_order
from torchtitan_xla.parallelisms.parallel_dims import BATCH_AXES


def chunk_order(cp: int, balanced: bool) -> list[int]:
    """Which chunk of the sequence each slot (its chunks in the order it is stored in) holds."""
    return load_balanced_order(2 * cp, cp).tolist() if balanced else list(range(cp))


def chunk_pairs(cp: int, chunk_at: list[int], chunk: int, window: int = 0) -> tuple[list, list, list]:
    """For each device c: which of its slots (0 or 1) each pair's queries are, which of the
    sequence's slots its keys are, whether the pair is real (False: padding), as [cp][pairs] lists
    of one length, for the chunks `chunk` tokens long in `chunk_order`."""
    n = len(chunk_at)
    slot_of = {c: s for s, c in enumerate(chunk_at)}
    per_device = []
    for c in range(cp):
        pairs = []
        for u in range(n // cp):
            j = chunk_at[c * n // cp + u]
            first = max(j * chunk - window + 1, 0) // chunk if window else 0  # the first key chunk seen
            pairs += [(u, slot_of[m], True) for m in range(first, j + 1)]
        per_device.append(pairs)
    most = max(len(p) for p in per_device)
    per_device = [p + [(0, 0, False)] * (most - len(p)) for p in per_device]
    return tuple([[pair[i] for pair in p] for p in per_device] for i in range(3))


def _per_chunk(x: torch.Tensor, mine: torch.Tensor) -> torch.Tensor:
    """[..., cp, pairs, q] summed over each query chunk's pairs: [..., cp, slots, q]."""
    return torch.einsum("...cpq,cpu->...cuq", x, mine)


def _per_pair(x: torch.Tensor, mine: torch.Tensor) -> torch.Tensor:
    """[..., cp, slots, q] -> [..., cp, pairs, q]: each pair its query chunk's value."""
    return torch.einsum("...cuq,cpu->...cpq", x, mine)


class _ChunkSoftmax(torch.autograd.Function):
    """softmax(scores where `seen`) [b, kv heads, heads per kv head, cp, pairs, q, k], each query's
    over the keys of all its chunk's pairs (`mine` [cp, pairs, slots]: which chunk each pair's
    queries are) and `sinks` [heads] (one more logit per head, no value). Saves only the
    probabilities: autograd's own masked exp and division kept the mask and two score-sized
    tensors, about what whole-sequence sdpa keeps (docs/parallelisms.md)."""

    @staticmethod
    def forward(ctx, scores, seen, mine, sinks):
        g, r = scores.shape[1:3]
        scores = scores.masked_fill(~seen, float("-inf"))
        pair_top = scores.amax(-1)  # [b, g, r, cp, pairs, q]; -inf for a padding pair
        top = torch.stack([torch.where(mine[:, :, u, None] > 0, pair_top, float("-inf")).amax(-2)
                           for u in range(mine.shape[-1])], -2)  # [b, g, r, cp, slots, q]: finite
        sink = None if sinks is None else sinks.to(scores.dtype).view(g, r)[None, :, :, None, None, None]
        if sink is not None:
            top = torch.maximum(top, sink)
        probs = (scores - _per_pair(top, mine)[..., None]).exp_()
        total = _per_chunk(probs.sum(-1), mine)
        if sink is not None:
            total = total + (sink - top).exp()
        probs = probs.div_(_per_pair(total, mine)[..., None])
        ctx.save_for_backward(probs, mine)
        ctx.sinks = None if sinks is None else (sinks.shape, sinks.dtype)
        return probs

    @staticmethod
    def backward(ctx, grad):
        probs, mine = ctx.saved_tensors
        dot = _per_chunk((grad * probs).sum(-1), mine)  # [b, g, r, cp, slots, q]
        grad_scores = probs * (grad - _per_pair(dot, mine)[..., None])
        grad_sinks = None
        if ctx.sinks is not None:  # the sink's probability is what the keys leave of 1
            sink_probs = 1 - _per_chunk(probs.sum(-1), mine)
            shape, dtype = ctx.sinks
            grad_sinks = -(sink_probs * dot).sum((0, 3, 4, 5)).reshape(shape).to(dtype)
        return grad_scores, None, None, grad_sinks


class ChunkPairAttention(nn.Module):
    """Causal attention over q [batch, heads, seq, head_dim] split over `cp` and k, v [batch,
    kv_heads, seq, head_dim] whole, computing only each device's (query chunk, key chunk) pairs
    that the causal mask (and `window`) leave anything of; replaces a block's `attention.sdpa`."""

    def __init__(self, mesh, cp: int, balanced: bool, window: int = 0):
        super().__init__()
        self.cp, self.window = cp, window
        self.chunk_at = chunk_order(cp, balanced)  # (here: a traced forward cannot read a tensor)
        # [batch, heads, cp, pairs x chunk, head_dim] (torch_xla takes specs of 5 dimensions at
        # most) and the ids' [batch, cp, pairs, chunk]
        heads = runtime.constraint(mesh, (BATCH_AXES, "tp", "cp", None, None))
        self.paired = lambda t: heads(t.flatten(3, 4)).view(t.shape)
        self.paired_ids = runtime.constraint(mesh, (BATCH_AXES, "cp", None, None))

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                document_ids: torch.Tensor | None = None,
                positions: torch.Tensor | None = None, *, sinks: torch.Tensor | None = None) -> torch.Tensor:
        b, h, s, d = q.shape
        kv_heads, n = k.shape[1], len(self.chunk_at)
        slots = n // self.cp
        if positions is None:  # in index order, one document
            positions = torch.arange(s, device=q.device).expand(b, s)
            document_ids = torch.ones_like(positions)
        q_slot, k_slot, real = (torch.tensor(t, device=q.device)
                                for t in chunk_pairs(self.cp, self.chunk_at, s // n, self.window))
        second = (q_slot == 1)[:, :, None]  # [cp, pairs, 1]: the pair's queries are the device's 2nd chunk

        def query_pairs(t: torch.Tensor) -> torch.Tensor:  # [..., seq, *f] -> [..., cp, pairs, chunk, *f]
            lead = t.dim() - (2 if t.dim() == 4 else 1)
            t = t.reshape(*t.shape[:lead], self.cp, slots, s // n, *t.shape[lead + 1:])
            first_chunk, second_chunk = t.select(lead + 1, 0), t.select(lead + 1, slots - 1)
            pick = second if t.dim() == lead + 3 else second[..., None]
            return torch.where(pick, second_chunk.unsqueeze(lead + 1), first_chunk.unsqueeze(lead + 1))

        def key_pairs(t: torch.Tensor) -> torch.Tensor:  # the same, keys gathered from every chunk
            lead = t.dim() - (2 if t.dim() == 4 else 1)
            t = t.reshape(*t.shape[:lead], n, s // n, *t.shape[lead + 1:])
            return t[(slice(None),) * lead + (k_slot,)]

        qp = self.paired(query_pairs(q * d ** -0.5))  # [b, heads, cp, pairs, chunk, d]
        kp, vp = self.paired(key_pairs(k)), self.paired(key_pairs(v))
        q_pos, q_doc = (self.paired_ids(query_pairs(t)) for t in (positions, document_ids))
        k_pos, k_doc = (self.paired_ids(key_pairs(t)) for t in (positions, document_ids))
        seen = ((k_pos[..., None, :] <= q_pos[..., :, None]) & (k_doc[..., None, :] == q_doc[..., :, None])
                & real[:, :, None, None])
        if self.window:
            seen &= k_pos[..., None, :] > q_pos[..., :, None] - self.window
        # Grouped-query attention: query heads as [kv heads, heads per kv head].
        qp = qp.reshape(b, kv_heads, h // kv_heads, *qp.shape[2:])
        scores = upcast(torch.einsum("bgrcpqd,bgcpkd->bgrcpqk", qp, kp))
        # Which of the device's query chunks each pair's queries are: [cp, pairs, slots], one-hot.
        mine = (q_slot[:, :, None] == torch.arange(slots, device=q.device)).to(scores.dtype)
        probs = _ChunkSoftmax.apply(scores, seen[:, None, None], mine, sinks).type_as(v)
        out = torch.einsum("bgrcpqk,bgcpkd->bgrcpqd", probs, vp)
        # Each query chunk's pairs summed: [b, g, r, cp, slots, q, dv], the slots in stored order.
        out = torch.einsum("bgrcpqd,cpu->bgrcuqd", out, mine.to(out.dtype))
        return out.reshape(b, h, s, v.shape[-1])


def apply_chunk_pair_attention(model: nn.Module, mesh, cp: int, balanced: bool) -> None:
    """Every block's blockwise attention replaced by its context-parallel form (no parameters
    change); the window each block has kept."""
    for block in model.layers.values():
        block.attention.sdpa = ChunkPairAttention(mesh, cp, balanced, window=block.attention.sdpa.window)
