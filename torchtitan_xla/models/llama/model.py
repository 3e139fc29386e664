"""Llama 2 and Llama 3 / 3.1 in one file (its building blocks in layers.py): plain PyTorch, no
parallelism code. With `ModelArgs.num_experts` it is Mixtral: some or all blocks have a mixture of
experts (moe.py) in place of the SwiGLU. With `ModelArgs.qk_norm` (and its own head size) it is
Qwen3. With `ModelArgs.kv_lora_rank` its attention is multi-head latent attention (mla.py) and, with
the sigmoid router and shared experts, it is DeepSeek-V3.

Parameter names follow Meta's checkpoints (and torchtitan): `tok_embeddings`, `layers.N.attention.
wq|wk|wv|wo` (Qwen3: and `q_norm|k_norm`), `layers.N.feed_forward.w1|w2|w3`,
`layers.N.attention_norm|ffn_norm`, `norm`, `output`;
a mixture of experts is the block's `feed_forward` too: `layers.N.feed_forward.router.weight` and
the stacked experts `layers.N.feed_forward.w1|w2|w3`.
Parallelism, activation checkpointing and scan are applied from outside by module name
(torchtitan_xla/parallelisms); attention is its own module (`attention.sdpa`) so a kernel can be
swapped in the same way.

RoPE rotates interleaved pairs (Meta's layout, so Meta/torchtitan weights load unchanged); the
HuggingFace exporter permutes wq/wk to HF's rotate-half layout.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from torchtitan_xla.models.llama.args import ModelArgs
from torchtitan_xla.models.llama.layers import (
    Embedding,
    FeedForward,
    RMSNorm,
    ScaledDotProductAttention,
    apply_rope,
    masked_attention,
    rope_tables,
)
from torchtitan_xla.models.llama.mla import MultiHeadLatentAttention
from torchtitan_xla.models.llama.moe import MoE

__all__ = ["Attention", "FeedForward", "Transformer", "TransformerBlock"]


class Attention(nn.Module):
    def __init__(self, args: ModelArgs, layer_id: int = 0):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = args.n_heads, args.kv_heads, args.head_dim
        bias = args.attn_bias  # gpt-oss
        self.wq = nn.Linear(args.dim, args.n_heads * self.head_dim, bias=bias)
        self.wk = nn.Linear(args.dim, self.n_kv_heads * self.head_dim, bias=bias)
        self.wv = nn.Linear(args.dim, self.n_kv_heads * self.head_dim, bias=bias)
        self.wo = nn.Linear(args.n_heads * self.head_dim, args.dim, bias=bias)
        self.window = args.window(layer_id)  # 0: global
        self.sdpa = ScaledDotProductAttention(self.window)
        # gpt-oss: each head's sink logit (the einsum and blockwise kernels and the KV cache take it;
        # config/checks.py refuses the Pallas ones).
        self.sinks = nn.Parameter(torch.zeros(args.n_heads)) if args.attn_sinks else None
        # Gemma 3: RoPE tables of two bases, this block's half; scores scaled by
        # query_pre_attn_scalar^-0.5, as the queries times sqrt(head_dim / it) under the kernels'
        # head_dim^-0.5.
        self.rope_half = bool(args.rope_local_theta)
        scalar = args.query_pre_attn_scalar
        self.query_scale = (self.head_dim / scalar) ** 0.5 if scalar else 1.0
        if args.qk_norm:  # Qwen3, Gemma 3: over each head's vector, shared by the heads
            self.q_norm = RMSNorm(self.head_dim, args.norm_eps, args.norm_offset)
            self.k_norm = RMSNorm(self.head_dim, args.norm_eps, args.norm_offset)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                *mask: torch.Tensor, cache=None) -> torch.Tensor:
        """`mask`: (document_ids, positions) [batch, seq] each, or nothing for plain causal
        attention in index order. `cache` (generation): this layer's KV cache, which stores the
        new keys and values and gives back all of them with their mask."""
        bsz, seqlen, _ = x.shape
        q = self.wq(x).view(bsz, seqlen, self.n_heads, self.head_dim)
        k = self.wk(x).view(bsz, seqlen, self.n_kv_heads, self.head_dim)
        v = self.wv(x).view(bsz, seqlen, self.n_kv_heads, self.head_dim)
        if hasattr(self, "q_norm"):
            q, k = self.q_norm(q), self.k_norm(k)
        if self.rope_half:
            half = cos.shape[-1] // 2
            part = slice(half, None) if self.window else slice(None, half)
            cos, sin = cos[..., part], sin[..., part]
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if self.query_scale != 1.0:
            q = q * self.query_scale
        if cache is not None:
            k, v = cache.update(k, v)
        # Grouped-query attention: each kv head serves n_heads / n_kv_heads query heads (the
        # attention module repeats them).
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        sinks = {} if self.sinks is None else {"sinks": self.sinks}
        if cache is None:
            out = self.sdpa(q, k, v, *mask, **sinks)
        else:
            out = masked_attention(q, k, v, cache.mask_within(self.window), heads_outer=True, **sinks)
        return self.wo(out.transpose(1, 2).reshape(bsz, seqlen, -1))

    def init_weights(self, init_std: float) -> None:
        for w in (self.wq, self.wk, self.wv):
            nn.init.trunc_normal_(w.weight, mean=0.0, std=0.02)
        nn.init.trunc_normal_(self.wo.weight, mean=0.0, std=init_std)
        for w in (self.wq, self.wk, self.wv, self.wo):
            if w.bias is not None:
                nn.init.zeros_(w.bias)
        if self.sinks is not None:
            nn.init.trunc_normal_(self.sinks, mean=0.0, std=0.02)
        if hasattr(self, "q_norm"):
            self.q_norm.reset_parameters()
            self.k_norm.reset_parameters()


class TransformerBlock(nn.Module):
    def __init__(self, layer_id: int, args: ModelArgs):
        super().__init__()
        self.attention = MultiHeadLatentAttention(args) if args.mla else Attention(args, layer_id)
        if args.is_moe_layer(layer_id):
            self.feed_forward = MoE(args.dim, args.expert_hidden_dim, args.num_experts, args.top_k,
                                    args.capacity_factor, router=args.router, norm_topk=args.norm_topk,
                                    groups=args.expert_groups,
                                    topk_groups=args.topk_groups, routed_scaling=args.routed_scaling,
                                    shared_experts=args.shared_experts, act=args.ffn_act, bias=args.moe_bias)
        else:
            self.feed_forward = FeedForward(args.dim, args.ffn_hidden_dim, args.ffn_act)
        self.attention_norm = RMSNorm(args.dim, args.norm_eps, args.norm_offset)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps, args.norm_offset)
        if args.sandwich_norm:  # Gemma: the attention's and the FFN's outputs normalised too
            self.post_attention_norm = RMSNorm(args.dim, args.norm_eps, args.norm_offset)
            self.post_ffn_norm = RMSNorm(args.dim, args.norm_eps, args.norm_offset)
        depth = layer_id + 1 if args.depth_init else args.n_layers
        self.init_std = 0.02 / (2 * depth) ** 0.5

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                *mask: torch.Tensor, cache=None) -> torch.Tensor:
        h = x + self._post("post_attention_norm", self.attention(self.attention_norm(x), cos, sin, *mask,
                                                                  cache=cache))
        if mask and isinstance(self.feed_forward, MoE):
            # Padding (document 0) is routed nowhere: it takes no expert slot and no share of
            # the router losses.
            return h + self._post("post_ffn_norm", self.feed_forward(self.ffn_norm(h), mask[0] != 0))
        return h + self._post("post_ffn_norm", self.feed_forward(self.ffn_norm(h)))

    def _post(self, norm: str, out: torch.Tensor) -> torch.Tensor:
        return getattr(self, norm)(out) if hasattr(self, norm) else out

    def init_weights(self) -> None:
        for norm in ("attention_norm", "ffn_norm", "post_attention_norm", "post_ffn_norm"):
            if hasattr(self, norm):
                getattr(self, norm).reset_parameters()
        self.attention.init_weights(self.init_std)
        self.feed_forward.init_weights(self.init_std)


class TiedOutput(nn.Module):
    """The output projection through the input embedding's matrix (`tie_embeddings`): one
    parameter, `tok_embeddings.weight`, read at each call, so whatever moves, shards or loads the
    embedding applies here too (a second reference to the Parameter would be left behind by
    `to_empty`, which gives each module a new one)."""

    def __init__(self, embedding: nn.Embedding):
        super().__init__()
        self._source = [embedding]  # in a list: not a submodule, so its weight is listed once

    @property
    def weight(self) -> torch.Tensor:
        return self._source[0].weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


class Layers(nn.ModuleDict):
    """The transformer blocks, keyed "0".."n-1" (names stay stable whatever wraps the blocks)."""

    def forward(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                *mask: torch.Tensor, cache=None) -> torch.Tensor:
        """`mask`: (document_ids, positions), or nothing (causal in index order). Passed on as
        positional arguments only when given: wrappers (checkpointing, scan) see plain tensors.
        `cache`: a KV cache (generation), indexed by layer."""
        for i, layer in enumerate(self.values()):
            h = layer(h, cos, sin, *mask) if cache is None else layer(h, cos, sin, *mask, cache=cache[i])
        return h


class Transformer(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        if args.vocab_size <= 0:
            raise ValueError("ModelArgs.vocab_size must be set (from the tokenizer)")
        self.args = args
        self.tok_embeddings = Embedding(args.vocab_size, args.dim)
        self.layers = Layers({str(i): TransformerBlock(i, args) for i in range(args.n_layers)})
        self.norm = RMSNorm(args.dim, args.norm_eps, args.norm_offset)
        self.output = (TiedOutput(self.tok_embeddings) if args.tie_embeddings
                       else nn.Linear(args.dim, args.vocab_size, bias=False))
        # Derived from args, so not saved in checkpoints; (re)computed by init_weights().
        cos, sin = rope_tables(args)
        self.register_buffer("rope_cos", cos.float(), persistent=False)
        self.register_buffer("rope_sin", sin.float(), persistent=False)

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor | None = None,
                document_ids: torch.Tensor | None = None, cache=None) -> torch.Tensor:
        """tokens: [batch, seq] int64 -> logits [batch, seq, vocab]. Several documents packed in
        one sequence: `positions` [batch, seq] (restarting at each document) and `document_ids`
        [batch, seq] (attention stays within a document). The mask is then computed from the
        positions, not the order of the tokens, so a sequence may arrive reordered (context
        parallelism's load balancing). `cache` (generation, torchtitan_xla/generate): the keys
        and values of the tokens before these, which attend to them as well; positions given."""
        return self.output(self.hidden_states(tokens, positions, document_ids, cache))

    def hidden_states(self, tokens: torch.Tensor, positions: torch.Tensor | None = None,
                      document_ids: torch.Tensor | None = None, cache=None) -> torch.Tensor:
        """As forward, up to the final normalised hidden states [batch, seq, dim], what the output
        layer projects (a chunked loss projects them itself: torchtitan_xla/losses.py)."""
        if positions is None:
            seqlen = tokens.shape[1]
            # Copies, not views of the buffers: with op-level selective activation checkpointing
            # a view left the buffer with a pending update after the step, which the replayed
            # step's donated buffers then broke (torch_xla 2.9, "buffer ... is deleted" at step 2).
            cos, sin = self.rope_cos[:seqlen].clone(), self.rope_sin[:seqlen].clone()
        else:
            cos, sin = self.rope_cos[positions], self.rope_sin[positions]
        if (positions is None) != (document_ids is None):
            raise ValueError("positions and document_ids are given together, or neither")
        mask = () if document_ids is None else (document_ids, positions)
        # `cache` only when given: scan replaces the layers with a module that takes none.
        extra = {} if cache is None else {"cache": cache}
        h = self.tok_embeddings(tokens)
        if self.args.embed_scale:  # Gemma: the rows times sqrt(dim)
            h = h * self.args.dim ** 0.5
        return self.norm(self.layers(h, cos, sin, *mask, **extra))

    @torch.no_grad()
    def init_weights(self) -> None:
        """Initialise every parameter and buffer in place (after `to_empty` on the target device)."""
        cos, sin = rope_tables(self.args)
        self.rope_cos.copy_(cos)
        self.rope_sin.copy_(sin)
        nn.init.normal_(self.tok_embeddings.weight)
        for layer in self.layers.values():
            layer.init_weights()
        self.norm.reset_parameters()
        # A tied matrix gets the output's init (the last one, as torchtitan).
        std = self.args.dim ** -0.5
        nn.init.trunc_normal_(self.output.weight, mean=0.0, std=std, a=-3 * std, b=3 * std)

    def num_params(self, exclude_embedding: bool = False) -> int:
        """Parameters, once each; without the embedding's lookup table, unless it is also the output
        projection (tied), whose matmul it is."""
        n = sum(p.numel() for p in self.parameters())
        tied = isinstance(self.output, TiedOutput)
        return n - self.tok_embeddings.weight.numel() if exclude_embedding and not tied else n
