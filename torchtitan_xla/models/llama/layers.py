"""The building blocks the model files share (models/llama/model.py, mla.py, moe.py): the
embedding, RoPE, RMSNorm, the attention mask and the attention module kernels replace, the SwiGLU
feed-forward.
Plain PyTorch, no parallelism code."""

from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F
from torch import nn

from torchtitan_xla.models.llama.args import ModelArgs


def upcast(x: torch.Tensor) -> torch.Tensor:
    """At least float32 (bf16 -> f32; f32 and f64 unchanged)."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


class _LookUpIn(torch.autograd.Function):
    """Rows of `weight` read in `dtype`, returned in at least float32; the weight's gradient summed
    in it too (a bf16 scatter-add would round frequent tokens' sums)."""

    @staticmethod
    def forward(ctx, tokens: torch.Tensor, weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        ctx.save_for_backward(tokens)
        ctx.rows = weight.shape[0]
        return upcast(F.embedding(tokens, weight.to(dtype)))

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (tokens,) = ctx.saved_tensors
        return None, torch.ops.aten.embedding_dense_backward(grad, tokens, ctx.rows, -1, False), None


class Embedding(nn.Embedding):
    """nn.Embedding that, under autocast, reads its table in the compute dtype, as autocast reads
    every linear's weight: the table is cast where it is sharded, so FSDP gathers it in bfloat16
    (torchtitan's param_dtype). Its rows enter the residual stream in float32, as before."""

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        device = tokens.device.type
        if not torch.is_autocast_enabled(device):
            return super().forward(tokens)
        return _LookUpIn.apply(tokens, self.weight, torch.get_autocast_dtype(device))


def rope_tables(args: ModelArgs) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of position * frequency, shape [max_seq_len, rope_dim // 2], in float64; with a
    local base (Gemma 3's `rope_local_theta`), the local blocks' tables after the global ones,
    [max_seq_len, rope_dim] (one pair of tensors for every signature that passes them on; each
    block takes its half, model.Attention).

    Computed in float64 on the host (the tables are small) and stored in the buffers' dtype, which
    keeps positions near max_seq_len accurate."""
    cos, sin = _rope_tables(args, args.rope_theta)
    if args.rope_local_theta:
        local_cos, local_sin = _rope_tables(args, args.rope_local_theta, local=True)
        cos, sin = torch.cat([cos, local_cos], -1), torch.cat([sin, local_sin], -1)
    return cos, sin


def _rope_tables(args: ModelArgs, theta: float, local: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    d = args.rope_dim
    freqs = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    if local:  # Gemma 3's local blocks: plain RoPE
        angles = torch.outer(torch.arange(args.max_seq_len, dtype=torch.float64), freqs)
        return angles.cos(), angles.sin()
    freqs = freqs / args.rope_linear_factor
    if args.rope_scaling is not None:
        s = args.rope_scaling
        wavelen = 2 * math.pi / freqs
        low_wavelen = s.original_max_position_embeddings / s.low_freq_factor
        high_wavelen = s.original_max_position_embeddings / s.high_freq_factor
        smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (
            s.high_freq_factor - s.low_freq_factor)
        blended = (1 - smooth) * freqs / s.factor + smooth * freqs
        freqs = torch.where(wavelen > low_wavelen, freqs / s.factor,
                            torch.where(wavelen < high_wavelen, freqs, blended))
    scale = 1.0
    if args.yarn is not None:
        freqs, scale = _yarn(args.yarn, freqs, d, args.rope_theta)
    angles = torch.outer(torch.arange(args.max_seq_len, dtype=torch.float64), freqs)
    return angles.cos() * scale, angles.sin() * scale


def _yarn(y, freqs: torch.Tensor, d: int, theta: float) -> tuple[torch.Tensor, float]:
    """YaRN's frequencies and cos/sin scale (args.Yarn; transformers' "yarn"): the
    dimensions rotating fewer than beta_slow times over the original context interpolated by
    `factor`, those rotating more than beta_fast times kept, a linear ramp between."""
    def rotations_dim(rotations: float) -> float:
        turns = y.original_max_position_embeddings / (rotations * 2 * math.pi)
        return d * math.log(turns) / (2 * math.log(theta))

    low, high = rotations_dim(y.beta_fast), rotations_dim(y.beta_slow)
    if y.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, d - 1)
    ramp = ((torch.arange(d // 2, dtype=torch.float64) - low) / max(high - low, 0.001)).clamp(0, 1)
    freqs = freqs / y.factor * ramp + freqs * (1 - ramp)
    return freqs, y.mscale_of(y.mscale) / y.mscale_of(y.mscale_all_dim)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate interleaved pairs (x[2i], x[2i+1]) of x: [batch, seq, heads, head_dim] by the angles
    of each token's position, cos and sin: [seq, head_dim // 2] or per sequence [batch, seq, ...]."""
    xf = upcast(x)
    x0, x1 = xf[..., 0::2], xf[..., 1::2]
    cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)  # broadcast over heads
    rotated = (x0 * cos - x1 * sin, x0 * sin + x1 * cos)
    # Interleaved back by cat, not stack: the backward of stack selects twice from one DTensor,
    # which DTensor (torch 2.9) gets wrong (the second select sees the first one's shape).
    out = torch.cat([r.unsqueeze(-1) for r in rotated], dim=-1).flatten(-2)
    # Back to the compute dtype: under bf16 autocast q, k and v must share a dtype for SDPA.
    return out.type_as(x)


def repeat_kv(x: torch.Tensor, heads: int) -> torch.Tensor:
    """Grouped-query attention's keys or values [b, kv_heads, s, d] -> [b, heads, s, d]: query head
    j uses kv head j // (heads / kv_heads). Done inside the attention modules, so whatever reaches
    them (context parallelism's gather of the keys and values) moves the kv heads only."""
    b, h, s, d = x.shape
    if h == heads:
        return x
    return x[:, :, None].expand(b, h, heads // h, s, d).reshape(b, heads, s, d)


class RMSNorm(nn.Module):
    """x / rms(x) times (offset + weight): Llama's offset 0 (weight from 1), Gemma's 1 (from 0)."""

    def __init__(self, dim: int, eps: float, offset: float = 0.0):
        super().__init__()
        self.eps, self.offset = eps, offset
        self.weight = nn.Parameter(torch.full((dim,), 1.0 - offset))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = upcast(x)  # normalise in float32 even under bf16 autocast
        out = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        scale = self.weight + self.offset if self.offset else self.weight
        return (out * scale).type_as(x)

    def reset_parameters(self) -> None:
        nn.init.constant_(self.weight, 1.0 - self.offset)


def attention_mask(queries: torch.Tensor, keys: torch.Tensor,
                   document_ids: torch.Tensor | None, window: int = 0) -> torch.Tensor:
    """Which keys each query sees: causal over positions `queries` [q] and `keys` [k] (with a
    `window`, only the `window` latest, its own included), and with `document_ids` [batch, seq]
    (several documents packed in one sequence) only its own document's. Document 0 is padding
    (packing.py).
    [q, k], or [batch, 1, q, k] with documents."""
    mask = within(queries[:, None], keys[None, :], window)
    if document_ids is None:
        return mask
    same = document_ids[:, queries, None] == document_ids[:, None, keys]
    return (mask & same)[:, None]


def position_mask(document_ids: torch.Tensor, positions: torch.Tensor, window: int = 0) -> torch.Tensor:
    """[batch, 1, seq, seq]: each query sees the keys of its document at or before its position
    (and within its `window`), wherever they are in the sequence (context parallelism reorders it)."""
    same = document_ids[:, :, None] == document_ids[:, None, :]
    return (same & within(positions[:, :, None], positions[:, None, :], window))[:, None]


def within(query_positions: torch.Tensor, key_positions: torch.Tensor, window: int = 0) -> torch.Tensor:
    """Causal: a key at or before its query; with a `window`, also fewer than `window` before it."""
    seen = key_positions <= query_positions
    return seen if not window else seen & (key_positions > query_positions - window)


class ScaledDotProductAttention(nn.Module):
    """Causal attention over [batch, heads, seq, head_dim] (within a sliding `window` if one is
    given); given `document_ids` and `positions` [batch, seq], within documents and by position; a
    module so a kernel can replace it (attention_kernels.py)."""

    def __init__(self, window: int = 0):
        super().__init__()
        self.window = window

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                document_ids: torch.Tensor | None = None,
                positions: torch.Tensor | None = None, *, sinks: torch.Tensor | None = None) -> torch.Tensor:
        # SDPA's decomposition (and `@`) folds batch and heads into one dimension, which cannot be
        # split over two mesh axes: with a sharded batch, tensor parallelism would then gather
        # every head onto every device. einsum keeps them apart. Grouped-query attention as groups
        # of query heads [kv heads, heads per kv head] against their kv head, never a repeated
        # copy (with context parallelism the keys' gradient is then summed at the kv heads' width).
        if positions is None:
            seq = torch.arange(q.shape[2], device=q.device)
            mask = attention_mask(seq, seq, None, self.window)
        else:
            mask = position_mask(document_ids, positions, self.window)  # [batch, 1, q, k]
        return masked_attention(q, k, v, mask, sinks=sinks)


def masked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, *,
                     heads_outer: bool = False, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """softmax(q k^T / sqrt(head_dim) where `mask`) v: queries [batch, heads, q, head_dim], keys and
    values [batch, kv_heads, k, head_dim], `mask` [q, k] or [batch, 1, q, k] (True: seen).
    `sinks` [heads] (gpt-oss): one more logit per head in each softmax's denominator, with no value.
    `heads_outer` (the KV cache's calls): einsum folds the kv heads outermost into its batch, the
    only fold DTensor allows for heads split over tp (the same values; training keeps the batch
    outermost, the layout the plan's memory model was fitted to on XLA)."""
    b, h, s, d = q.shape
    q = q.view(b, k.shape[1], h // k.shape[1], s, d)
    if mask.dim() == 4:
        mask = mask[:, None]  # [batch, 1, 1, q, k]
    if heads_outer:  # with the cache's [batch, 1, q, k] mask
        q, k, v, mask = (t.transpose(0, 1) for t in (q, k, v, mask))
    scores = upcast(torch.einsum("bgrqd,bgkd->bgrqk", q, k) * d ** -0.5).masked_fill(~mask, float("-inf"))
    if sinks is None:
        probs = scores.softmax(-1).type_as(v)
    else:
        sink = upcast(sinks).view(k.shape[1], -1)[:, :, None, None]  # [kv heads, heads per kv head, 1, 1]
        probs = softmax_with_sink(scores, sink[:, None] if heads_outer else sink[None]).type_as(v)
    out = torch.einsum("bgrqk,bgkd->bgrqd", probs, v)
    return (out.transpose(0, 1) if heads_outer else out).reshape(b, h, s, v.shape[-1])


def softmax_with_sink(scores: torch.Tensor, sink: torch.Tensor) -> torch.Tensor:
    """softmax over the last dimension of `scores` and one more logit, `sink` (broadcast to
    [..., 1]), which is then dropped: gpt-oss's attention sinks (the rows sum to less than 1)."""
    # Any shift gives the same values; detached, autograd does no work for it. A row masked whole
    # is shifted by the sink.
    top = torch.maximum(scores.amax(-1, keepdim=True), sink).detach()
    e = (scores - top).exp()
    return e / (e.sum(-1, keepdim=True) + (sink - top).exp())


GATES = {"silu": F.silu, "gelu_tanh": functools.partial(F.gelu, approximate="tanh")}


def glu(act: str, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """The gated unit of an FFN or expert: act(gate) * up (args.ModelArgs.ffn_act); gpt-oss's
    "swiglu_clamp" clamps both (the gate from above) at 7, scales the gate's sigmoid by 1.702 and
    adds 1 to up."""
    if act == "swiglu_clamp":
        gate, up = gate.clamp(max=7.0), up.clamp(-7.0, 7.0)
        return gate * torch.sigmoid(1.702 * gate) * (up + 1)
    return GATES[act](gate) * up


class FeedForward(nn.Module):
    """SwiGLU: w2(silu(w1 x) * w3 x); with act "gelu_tanh", GeGLU (Gemma)."""

    def __init__(self, dim: int, hidden_dim: int, act: str = "silu"):
        super().__init__()
        self.act = act
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(glu(self.act, self.w1(x), self.w3(x)))

    def init_weights(self, init_std: float) -> None:
        nn.init.trunc_normal_(self.w1.weight, mean=0.0, std=0.02)
        for w in (self.w2, self.w3):
            nn.init.trunc_normal_(w.weight, mean=0.0, std=init_std)
