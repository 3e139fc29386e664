"""Multi-head latent attention (DeepSeek-V2/V3): plain PyTorch, no parallelism code.

Keys and values come from one low-rank latent per token (`wkv_a` -> RMSNorm -> `wkv_b`), so an
inference cache holds kv_lora_rank + qk_rope_head_dim numbers per token instead of 2 x heads x
head_dim; queries from a latent of their own (`wq_a` -> `q_norm` -> `wq_b`; with q_lora_rank 0 one
projection `wq`). Each head's query and key are a part without position (qk_nope_head_dim) and a
RoPE-rotated part (qk_rope_head_dim), the key's rotated part computed once from the input and
shared by every head. Parameter names are torchtitan's DeepSeek-V3 names.

RoPE rotates interleaved pairs, as DeepSeek's checkpoints hold their weights (transformers'
`rope_interleave`), so HF weights load without a permutation. The attention itself is the same
`sdpa` module as Llama's (a kernel replaces it from outside); YaRN's softmax scale is applied to
the queries, so every kernel computes it with its own 1 / sqrt(head_dim).
"""

from __future__ import annotations

import torch
from torch import nn

from torchtitan_xla.models.llama.args import ModelArgs
from torchtitan_xla.models.llama.layers import (
    RMSNorm,
    ScaledDotProductAttention,
    apply_rope,
    masked_attention,
)


class MultiHeadLatentAttention(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.n_heads, self.kv_lora_rank = args.n_heads, args.kv_lora_rank
        self.nope_dim, self.rope_dim = args.qk_nope_head_dim, args.qk_rope_head_dim
        self.v_dim = args.v_head_dim
        qk_dim = self.nope_dim + self.rope_dim
        if args.q_lora_rank:
            self.wq_a = nn.Linear(args.dim, args.q_lora_rank, bias=False)
            self.q_norm = RMSNorm(args.q_lora_rank, args.norm_eps)
            self.wq_b = nn.Linear(args.q_lora_rank, args.n_heads * qk_dim, bias=False)
        else:
            self.wq = nn.Linear(args.dim, args.n_heads * qk_dim, bias=False)
        self.wkv_a = nn.Linear(args.dim, args.kv_lora_rank + self.rope_dim, bias=False)
        self.kv_norm = RMSNorm(args.kv_lora_rank, args.norm_eps)
        self.wkv_b = nn.Linear(args.kv_lora_rank, args.n_heads * (self.nope_dim + self.v_dim), bias=False)
        self.wo = nn.Linear(args.n_heads * self.v_dim, args.dim, bias=False)
        self.sdpa = ScaledDotProductAttention()
        # YaRN sharpens the softmax by mscale^2 (1 without YaRN).
        self.query_scale = args.yarn.mscale_of(args.yarn.mscale_all_dim) ** 2 if args.yarn else 1.0

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                *mask: torch.Tensor, cache=None) -> torch.Tensor:
        """As Attention.forward; the `cache` holds each token's normalised latent and rotated key
        part (what an inference cache of this attention keeps), expanded at every call."""
        # Parts by slicing, not split(sizes): torch_xla 2.9 without functionalization (the replayed
        # step's mode) returns wrong values from split with a list of sizes (tests/test_deepseek_training.py).
        bsz, seqlen, _ = x.shape
        q = self.wq_b(self.q_norm(self.wq_a(x))) if hasattr(self, "wq_a") else self.wq(x)
        q = q.view(bsz, seqlen, self.n_heads, -1)
        q = torch.cat([q[..., :self.nope_dim], apply_rope(q[..., self.nope_dim:], cos, sin)], -1)
        if self.query_scale != 1.0:
            q = q * self.query_scale
        kv_a = self.wkv_a(x)
        # [batch, seq, 1, rope]: one rotated key part for all heads
        k_rope = apply_rope(kv_a[..., self.kv_lora_rank:].unsqueeze(2), cos, sin)
        latent = self.kv_norm(kv_a[..., :self.kv_lora_rank])
        if cache is not None:
            latent, k_rope = cache.update(latent, k_rope)
        kv = self.wkv_b(latent).view(bsz, latent.shape[1], self.n_heads, self.nope_dim + self.v_dim)
        k = torch.cat([kv[..., :self.nope_dim], k_rope.expand(-1, -1, self.n_heads, -1)], -1)
        v = kv[..., self.nope_dim:]
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        if cache is None:
            out = self.sdpa(q, k, v, *mask)
        else:
            out = masked_attention(q, k, v, cache.mask_within(), heads_outer=True)
        return self.wo(out.transpose(1, 2).reshape(bsz, seqlen, -1))

    def init_weights(self, init_std: float) -> None:
        for name in ("wq", "wq_a", "wq_b", "wkv_a", "wkv_b"):
            if hasattr(self, name):
                nn.init.trunc_normal_(getattr(self, name).weight, mean=0.0, std=0.02)
        nn.init.trunc_normal_(self.wo.weight, mean=0.0, std=init_std)
        for norm in (self.kv_norm, *((self.q_norm,) if hasattr(self, "q_norm") else ())):
            norm.reset_parameters()
