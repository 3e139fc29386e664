"""Llama's, Mixtral's, Qwen3's and DeepSeek-V3's hyperparameters and their published flavors;
importable without torch (the launcher and config validation read them before XLA starts)."""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class RopeScaling:
    """Llama 3.1 RoPE frequency scaling (long-context extension)."""

    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True)
class Yarn:
    """YaRN RoPE scaling (DeepSeek-V3's long context), as transformers' "yarn" rope type: the
    frequencies between the beta_fast and beta_slow rotations blended from extrapolated to
    interpolated by `factor`, cos/sin scaled by mscale(mscale) / mscale(mscale_all_dim) and the
    softmax by mscale(mscale_all_dim)^2, where mscale(m) = 0.1 m ln(factor) + 1."""

    factor: float = 40.0
    original_max_position_embeddings: int = 4096
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 1.0
    mscale_all_dim: float = 1.0
    # The ramp's ends rounded to whole dimensions (transformers' default; gpt-oss: False).
    truncate: bool = True

    def mscale_of(self, m: float) -> float:
        return 0.1 * m * math.log(self.factor) + 1.0 if self.factor > 1 else 1.0


@dataclass
class ModelArgs:
    dim: int = 4096
    n_layers: int = 32
    n_heads: int = 32
    n_kv_heads: int | None = None  # None: same as n_heads (no grouped-query attention)
    vocab_size: int = -1  # set from the tokenizer
    multiple_of: int = 256  # SwiGLU hidden size is rounded up to a multiple of this
    ffn_dim_multiplier: float | None = None
    # The SwiGLU hidden size itself (a published intermediate_size), in place of Llama's 8/3 rule
    # above, which cannot give every size (none below 8/3 dim without a multiplier's rounding).
    ffn_dim: int | None = None
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    max_seq_len: int = 2048  # the RoPE tables' length: train.py makes it training.seq_len
    # The model's context length: its flavor's max_seq_len, which train.py's max_seq_len override
    # leaves here (None: max_seq_len). An HF export's max_position_embeddings is the larger of the two.
    context_len: int | None = None
    # Scale the init of each block's output projections by its depth (torchtitan's default).
    depth_init: bool = True
    # Qwen3: each head's queries and keys RMS-normalised before RoPE, and a head size of its own
    # (None: dim // n_heads).
    qk_norm: bool = False
    head_dim_override: int | None = None
    # One matrix for the input embedding and the output projection (Qwen3 0.6B-4B, Llama 3.2).
    tie_embeddings: bool = False
    # Sliding-window (local) attention: a local block's query sees the `sliding_window` keys up to
    # and including its own position (transformers' definition). With `sliding_window_pattern` p
    # > 0, every p-th block ((i + 1) % p == 0) is global (Gemma 3: 6, gpt-oss: 2); with 0 all are
    # local. sliding_window 0: none.
    sliding_window: int = 0
    sliding_window_pattern: int = 0
    # Gemma 3: local blocks' RoPE base (0: rope_theta for every block), the global blocks'
    # frequencies divided by a linear factor; RMSNorm scaling by (norm_offset + weight), its weight
    # starting at 1 - norm_offset; norms on the attention's and FFN's outputs too ("sandwich"); the
    # FFN's gate activation ("silu": SwiGLU, "gelu_tanh": GeGLU); the embedding rows times
    # sqrt(dim); the attention scores scaled by query_pre_attn_scalar^-0.5 (None: head_dim's).
    rope_local_theta: float = 0.0
    rope_linear_factor: float = 1.0
    norm_offset: float = 0.0
    sandwich_norm: bool = False
    ffn_act: str = "silu"
    embed_scale: bool = False
    query_pre_attn_scalar: float | None = None
    # gpt-oss: biases on the attention's projections, on the router and the experts; a learned
    # logit per head in each softmax's denominator (an "attention sink", with no value); its
    # experts' ffn_act "swiglu_clamp" ((up + 1) * gate * sigmoid(1.702 gate), both clamped at 7).
    attn_bias: bool = False
    attn_sinks: bool = False
    moe_bias: bool = False
    # Mixture of experts (models/llama/moe.py) in place of the SwiGLU of some blocks.
    num_experts: int = 0  # 0: dense SwiGLU in every block
    top_k: int = 2  # experts per token; their router probabilities are renormalised to sum 1
    # Block i (0-based) is MoE when (i + 1) % moe_every == 0: 1 every block (Mixtral), 2 every
    # other block, the first one dense (GLaM).
    moe_every: int = 1
    moe_hidden_dim: int | None = None  # each expert's SwiGLU hidden size; None: ffn_hidden_dim
    # 0: dropless (every token reaches its top_k experts). c > 0: each expert takes at most
    # ceil(c * top_k * S / num_experts) of a sequence's S tokens, the rest are dropped (GShard).
    capacity_factor: float = 0.0
    # The weight of the load-balancing loss in training ([moe] aux_loss_weight, through
    # models.moe_overrides): unused by the model, it is what a Mixtral export's router_aux_loss_coef
    # says. A dense model has no router: 0.
    aux_loss_weight: float = 0.0
    # DeepSeek-V3's routing (moe.py): "sigmoid" scores, experts chosen by score + a per-expert bias
    # that training moves towards balance (`[moe] bias_update_rate`), within the `topk_groups`
    # best of `expert_groups` groups of experts, weights renormalised and times `routed_scaling`;
    # "softmax": Mixtral's. `shared_experts` always-on experts (one SwiGLU of that many times the
    # experts' size) beside the routed ones; the first `dense_layers` blocks have no experts.
    router: str = "softmax"
    norm_topk: bool = True  # the chosen experts' weights renormalised (False: DeepSeek-V2's)
    expert_groups: int = 1
    topk_groups: int = 1
    routed_scaling: float = 1.0
    shared_experts: int = 0
    dense_layers: int = 0
    # Multi-head latent attention (DeepSeek-V2/V3, mla.py) when kv_lora_rank > 0: keys and values
    # from a latent of kv_lora_rank, queries from one of q_lora_rank (0: straight from the input);
    # each head's query and key have qk_nope_head_dim features without and qk_rope_head_dim with
    # RoPE (the key's RoPE part shared by the heads), its value v_head_dim. n_kv_heads unused.
    kv_lora_rank: int = 0
    q_lora_rank: int = 0
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    yarn: Yarn | None = None

    def __post_init__(self):
        if self.context_len is None:
            self.context_len = self.max_seq_len
        if not self.num_experts:
            self.aux_loss_weight = 0.0
        if self.ffn_dim is not None and self.ffn_dim < 1:
            raise ValueError(f"ModelArgs: ffn_dim must be >= 1 (or None: Llama's sizing), not {self.ffn_dim}")
        if self.num_experts < 0 or self.moe_every < 1 or self.capacity_factor < 0:
            raise ValueError("ModelArgs: num_experts and capacity_factor must be >= 0, moe_every >= 1")
        if self.num_experts and not 1 <= self.top_k <= self.num_experts:
            raise ValueError(f"ModelArgs: top_k must be in [1, num_experts={self.num_experts}], "
                             f"not {self.top_k}")
        if self.ffn_act not in ("silu", "gelu_tanh", "swiglu_clamp"):
            raise ValueError(f"ModelArgs: ffn_act must be silu, gelu_tanh or swiglu_clamp, "
                             f"not {self.ffn_act!r}")
        if self.router not in ("softmax", "sigmoid"):
            raise ValueError(f"ModelArgs: router must be softmax or sigmoid, not {self.router!r}")
        if self.rope_scaling is not None and self.yarn is not None:
            raise ValueError("ModelArgs: rope_scaling (Llama 3.1's) and yarn cannot both be set")

    @property
    def head_dim(self) -> int:
        return self.head_dim_override or self.dim // self.n_heads

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads if self.n_kv_heads and not self.mla else self.n_heads

    @property
    def mla(self) -> bool:
        return self.kv_lora_rank > 0

    @property
    def qk_head_dim(self) -> int:
        """Features per head in the query-key product."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim if self.mla else self.head_dim

    @property
    def v_dim(self) -> int:
        """Features per head of the values (and the attention's output)."""
        return self.v_head_dim if self.mla else self.head_dim

    @property
    def rope_dim(self) -> int:
        """Features per head that RoPE rotates."""
        return self.qk_rope_head_dim if self.mla else self.head_dim

    @property
    def ffn_hidden_dim(self) -> int:
        if self.ffn_dim is not None:
            return self.ffn_dim
        # Llama's SwiGLU sizing: 2/3 of 4*dim, times an optional multiplier, rounded up.
        hidden = int(2 * 4 * self.dim / 3)
        if self.ffn_dim_multiplier is not None:
            hidden = int(self.ffn_dim_multiplier * hidden)
        return self.multiple_of * ((hidden + self.multiple_of - 1) // self.multiple_of)

    @property
    def expert_hidden_dim(self) -> int:
        return self.moe_hidden_dim if self.moe_hidden_dim is not None else self.ffn_hidden_dim

    def window(self, i: int) -> int:
        """Block i's attention window (0-based; 0: global)."""
        p = self.sliding_window_pattern
        return 0 if not self.sliding_window or (p and (i + 1) % p == 0) else self.sliding_window

    @property
    def windows(self) -> tuple[int, ...]:
        """Every block's window (what sliding_window and its pattern make of them)."""
        return tuple(self.window(i) for i in range(self.n_layers))

    def is_moe_layer(self, i: int) -> bool:
        """Whether block i (0-based) has a mixture of experts instead of the dense SwiGLU."""
        return self.num_experts > 0 and i >= self.dense_layers and (i + 1) % self.moe_every == 0


# vocab_size comes from the tokenizer. max_seq_len is the published context length (Llama 2: 4096,
# Llama 3.1: 131072; the debug models 2048): training replaces it by its seq_len, and it stays the
# model's context_len, which the HF export writes as max_position_embeddings.
llama2_configs = {
    "debugmodel": ModelArgs(dim=256, n_layers=8, n_heads=16),
    "7B": ModelArgs(dim=4096, n_layers=32, n_heads=32, max_seq_len=4096),
    "13B": ModelArgs(dim=5120, n_layers=40, n_heads=40, max_seq_len=4096),
    "70B": ModelArgs(dim=8192, n_layers=80, n_heads=64, n_kv_heads=8,
                     ffn_dim_multiplier=1.3, multiple_of=4096, max_seq_len=4096),
}

# Llama 3 flavors carry Llama 3.1's RoPE scaling (405B exists only as 3.1); the debug model
# keeps plain RoPE so its numbers stay easy to check.
llama3_configs = {
    "debugmodel": ModelArgs(dim=256, n_layers=8, n_heads=16, rope_theta=500000),
    "8B": ModelArgs(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_dim_multiplier=1.3,
                    multiple_of=1024, rope_theta=500000, rope_scaling=RopeScaling(), max_seq_len=131072),
    "70B": ModelArgs(dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, ffn_dim_multiplier=1.3,
                     multiple_of=4096, rope_theta=500000, rope_scaling=RopeScaling(), max_seq_len=131072),
    "405B": ModelArgs(dim=16384, n_layers=126, n_heads=128, n_kv_heads=8, ffn_dim_multiplier=1.2,
                      multiple_of=4096, rope_theta=500000, rope_scaling=RopeScaling(), max_seq_len=131072),
    # Llama 3.2: tied embeddings, RoPE scaled by 32.
    "1B": ModelArgs(dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, ffn_dim_multiplier=1.5, multiple_of=256,
                    rope_theta=500000, rope_scaling=RopeScaling(factor=32.0), max_seq_len=131072,
                    tie_embeddings=True),
    "3B": ModelArgs(dim=3072, n_layers=28, n_heads=24, n_kv_heads=8, ffn_dim_multiplier=1.0, multiple_of=256,
                    rope_theta=500000, rope_scaling=RopeScaling(factor=32.0), max_seq_len=131072,
                    tie_embeddings=True),
}

# Mixtral (Mistral AI, 2024): Mistral 7B's attention with 8 SwiGLU experts, top-2, in every block.
# The published flavors' numbers are those of the checkpoints' config.json (transformers'
# MixtralConfig defaults are 8x7B's but for max_position_embeddings and router_aux_loss_coef, which
# are max_seq_len and aux_loss_weight here; 8x22B's from mistral-community/Mixtral-8x22B-v0.1). Their
# vocabulary comes from the tokenizer, as for Llama: 32000 for 8x7B, 32000 / 32768 for 8x22B
# v0.1 / Instruct-v0.1. The dense FFN size (ffn_dim; used only in dense blocks, with moe_every > 1)
# is the experts' size, Mistral 7B's 14336 for 8x7B, as reading their config.json gives.
# The debug model has Llama's debug attention (head_dim 16) and experts of half the dense debug FFN
# (384 = 768 / 2): with top-2 it computes as much per token as the dense debug model, with 4x its
# FFN parameters; 4 blocks keep a test step's compilation short.
mixtral_configs = {
    "debugmodel": ModelArgs(dim=256, n_layers=4, n_heads=16, n_kv_heads=8, rope_theta=1e6,
                            num_experts=8, top_k=2, moe_hidden_dim=384),
    "8x7B": ModelArgs(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_dim=14336, rope_theta=1e6,
                      norm_eps=1e-5, num_experts=8, top_k=2, moe_hidden_dim=14336, max_seq_len=32768,
                      aux_loss_weight=0.02),
    "8x22B": ModelArgs(dim=6144, n_layers=56, n_heads=48, n_kv_heads=8, ffn_dim=16384, rope_theta=1e6,
                       norm_eps=1e-5, num_experts=8, top_k=2, moe_hidden_dim=16384, max_seq_len=65536,
                       aux_loss_weight=0.001),
}

# Qwen3 (Alibaba, 2025): Llama's block with per-head query/key RMSNorm, 128-wide heads whatever the
# width, grouped-query attention and rope_theta 1e6; the numbers of the checkpoints' config.json
# (intermediate_size is the FFN size, ffn_dim). Context 40960 (32768 trained, as published). The
# 0.6B-4B flavors tie their embeddings, as does the debug model, whose heads (32) are not dim /
# n_heads (16), as Qwen3's are not. The MoE flavors have experts in every block (128 small ones,
# top-8, renormalised: norm_topk_prob), no shared expert, and their config's router_aux_loss_coef;
# their debug model has 8 experts, top-4, of a quarter of the dense debug FFN (as much compute per
# token), untied as theirs are.
def _qwen3(dim: int, n_layers: int, n_heads: int, n_kv_heads: int, ffn: int, *, tied: bool = False,
           head_dim: int = 128, context: int = 40960, experts: int = 0, top_k: int = 8,
           expert_ffn: int | None = None) -> ModelArgs:
    moe = {}
    if experts:
        moe = dict(num_experts=experts, top_k=top_k, moe_hidden_dim=expert_ffn, aux_loss_weight=0.001)
    return ModelArgs(dim=dim, n_layers=n_layers, n_heads=n_heads, n_kv_heads=n_kv_heads, ffn_dim=ffn,
                     head_dim_override=head_dim, qk_norm=True, rope_theta=1e6, norm_eps=1e-6,
                     max_seq_len=context, tie_embeddings=tied, **moe)


qwen3_configs = {  # dim, layers, heads, kv heads, FFN size (the dense blocks')
    "debugmodel": _qwen3(256, 4, 16, 4, 768, tied=True, head_dim=32, context=2048),
    "debugmodel_moe": _qwen3(256, 4, 16, 4, 768, head_dim=32, context=2048, experts=8, top_k=4,
                             expert_ffn=192),
    "0.6B": _qwen3(1024, 28, 16, 8, 3072, tied=True),
    "1.7B": _qwen3(2048, 28, 16, 8, 6144, tied=True),
    "4B": _qwen3(2560, 36, 32, 8, 9728, tied=True),
    "8B": _qwen3(4096, 36, 32, 8, 12288),
    "14B": _qwen3(5120, 40, 40, 8, 17408),
    "32B": _qwen3(5120, 64, 64, 8, 25600),
    "30B-A3B": _qwen3(2048, 48, 32, 4, 6144, experts=128, expert_ffn=768),
    "235B-A22B": _qwen3(4096, 94, 64, 4, 12288, experts=128, expert_ffn=1536),
}


# DeepSeek-V3 (DeepSeek-AI, 2024): multi-head latent attention, 256 routed experts of 2048 (top-8
# within the 4 best of 8 groups, sigmoid scores balanced by bias) and one shared expert per block
# after 3 dense blocks, YaRN to 128k; the numbers of its config.json (transformers' DeepseekV3Config
# defaults). Its multi-token-prediction module (num_nextn_predict_layers = 1) is not part of the
# model here: 671B parameters without it, as the paper counts them. Both configs' aux_loss_alpha is
# 0.001 (the weight of the sequence-wise loss; the paper trained V3 with 1e-4). 16B: the same
# architecture as Moonshot AI's Moonlight-16B-A3B publishes it (config.json: no query latent, 64
# experts of 1408, top-6, 2 shared, 1 dense block, no groups). The debug model: 4 blocks (1 dense),
# 16 experts in 4 groups, top-4 within 2 groups, a query latent, a small YaRN so every part runs.
def _deepseek(dim: int, n_layers: int, n_heads: int, ffn: int, *, experts: int, expert_ffn: int,
              top_k: int, groups: int, topk_groups: int, shared: int, dense: int, scaling: float,
              q_lora: int, kv_lora: int = 512, nope: int = 128, rope: int = 64, v: int = 128,
              theta: float = 10000.0, eps: float = 1e-6, context: int = 4096, yarn: Yarn | None = None,
              v2: bool = False) -> ModelArgs:
    return ModelArgs(dim=dim, n_layers=n_layers, n_heads=n_heads, ffn_dim=ffn, norm_eps=eps,
                     rope_theta=theta, max_seq_len=context, num_experts=experts, top_k=top_k,
                     moe_hidden_dim=expert_ffn, router="softmax" if v2 else "sigmoid", norm_topk=not v2,
                     expert_groups=groups,
                     topk_groups=topk_groups, routed_scaling=scaling, shared_experts=shared,
                     dense_layers=dense, kv_lora_rank=kv_lora, q_lora_rank=q_lora, qk_nope_head_dim=nope,
                     qk_rope_head_dim=rope, v_head_dim=v, yarn=yarn, aux_loss_weight=0.001)


deepseek_v3_configs = {
    "debugmodel": _deepseek(256, 4, 16, 768, experts=16, expert_ffn=96, top_k=4, groups=4, topk_groups=2,
                            shared=1, dense=1, scaling=2.5, q_lora=128, kv_lora=64, nope=32, rope=16,
                            v=32, context=2048, yarn=Yarn(factor=4.0, original_max_position_embeddings=512)),
    "16B": _deepseek(2048, 27, 16, 11264, experts=64, expert_ffn=1408, top_k=6, groups=1, topk_groups=1,
                     shared=2, dense=1, scaling=2.446, q_lora=0, theta=50000.0, eps=1e-5, context=8192),
    "671B": _deepseek(7168, 61, 128, 18432, experts=256, expert_ffn=2048, top_k=8, groups=8, topk_groups=4,
                      shared=1, dense=3, scaling=2.5, q_lora=1536, context=163840, yarn=Yarn()),
}

# DeepSeek-V2 (DeepSeek-AI, 2024): the same latent attention and shared experts, routed by softmax
# without renormalising the top-k (times routed_scaling), the groups ranked by their best expert
# ("group_limited_greedy"), no bias; YaRN with mscale 0.707. 16B: DeepSeek-V2-Lite's config.json
# (15.7B, 2.4B active); 236B: DeepSeek-V2's (236B, 21B active). The debug model: V3's with V2's router.
_V2_YARN = Yarn(mscale=0.707, mscale_all_dim=0.707)
deepseek_v2_configs = {
    "debugmodel": _deepseek(256, 4, 16, 768, experts=16, expert_ffn=96, top_k=4, groups=4, topk_groups=2,
                            shared=1, dense=1, scaling=2.0, q_lora=128, kv_lora=64, nope=32, rope=16, v=32,
                            context=2048, v2=True, yarn=Yarn(factor=4.0, original_max_position_embeddings=512,
                                                             mscale=0.707, mscale_all_dim=0.707)),
    "16B": _deepseek(2048, 27, 16, 10944, experts=64, expert_ffn=1408, top_k=6, groups=1, topk_groups=1,
                     shared=2, dense=1, scaling=1.0, q_lora=0, context=163840, yarn=_V2_YARN, v2=True),
    "236B": _deepseek(5120, 60, 128, 12288, experts=160, expert_ffn=1536, top_k=6, groups=8, topk_groups=3,
                      shared=2, dense=1, scaling=16.0, q_lora=1536, context=163840, yarn=_V2_YARN, v2=True),
}


# Gemma 3 (Google, 2025), its text model: GeGLU, four norms per block with (1 + weight), query and
# key norms, embeddings scaled by sqrt(dim) and tied, five local blocks (a 512 / 1024-token window,
# RoPE base 1e4) per global one (base 1e6, 4B-27B linearly scaled by 8). The numbers of the
# checkpoints' config.json (27B: 168 as the query scale's base); vocabulary from the tokenizer
# (262,144; the multimodal 4B-27B checkpoints carry 64 more rows). The debug model: every option on,
# 6 blocks (one global), a 16-token window, a scaled global RoPE and a query scale of its own.
def _gemma3(dim: int, n_layers: int, n_heads: int, n_kv_heads: int, ffn: int, *, head_dim: int = 256,
            window: int = 1024, linear: float = 8.0, context: int = 131072,
            query_scalar: float | None = None) -> ModelArgs:
    return ModelArgs(dim=dim, n_layers=n_layers, n_heads=n_heads, n_kv_heads=n_kv_heads, ffn_dim=ffn,
                     head_dim_override=head_dim, qk_norm=True, rope_theta=1e6, rope_local_theta=1e4,
                     rope_linear_factor=linear, norm_eps=1e-6, max_seq_len=context, tie_embeddings=True,
                     sliding_window=window, sliding_window_pattern=6, norm_offset=1.0, sandwich_norm=True,
                     ffn_act="gelu_tanh", embed_scale=True, query_pre_attn_scalar=query_scalar)


gemma3_configs = {  # dim, layers, heads, kv heads, FFN size
    "debugmodel": _gemma3(256, 6, 4, 2, 768, head_dim=64, window=16, linear=4.0, context=2048,
                          query_scalar=48),
    "1B": _gemma3(1152, 26, 4, 1, 6912, window=512, linear=1.0, context=32768),
    "4B": _gemma3(2560, 34, 8, 4, 10240),
    "12B": _gemma3(3840, 48, 16, 8, 15360),
    "27B": _gemma3(5376, 62, 32, 16, 21504, head_dim=128, query_scalar=168),
}


# gpt-oss (OpenAI, 2025): 64 query heads of 64 over 8 KV heads with biases and sinks, every other
# block local (128 tokens, the first one), YaRN (factor 32, untruncated) on base 150000, experts in
# every block (32 / 128 of 2880, top-4 by the softmax of the chosen logits, which the renormalised
# softmax router equals) with biases and the clamped SwiGLU. The numbers of the checkpoints'
# config.json (router_aux_loss_coef 0.9); vocabulary from the tokenizer (201,088 rows). The debug
# model: 4 blocks, an 8-token window, 8 experts narrower than dim (a transposed layout fails
# loudly), a small YaRN, every option on.
def _gpt_oss(dim: int, n_layers: int, experts: int, hidden: int, *, heads: int = 64, kv_heads: int = 8,
             head_dim: int = 64, window: int = 128, context: int = 131072,
             yarn: Yarn | None = None) -> ModelArgs:
    return ModelArgs(dim=dim, n_layers=n_layers, n_heads=heads, n_kv_heads=kv_heads,
                     head_dim_override=head_dim, ffn_dim=hidden, num_experts=experts, top_k=4,
                     moe_hidden_dim=hidden, ffn_act="swiglu_clamp", attn_bias=True, attn_sinks=True,
                     moe_bias=True, sliding_window=window, sliding_window_pattern=2, rope_theta=150000.0,
                     max_seq_len=context, aux_loss_weight=0.9,
                     yarn=yarn or Yarn(factor=32.0, original_max_position_embeddings=4096, mscale_all_dim=0.0,
                                       truncate=False))


gpt_oss_configs = {  # dim, layers, experts, their hidden size
    "debugmodel": _gpt_oss(256, 4, 8, 192, heads=8, kv_heads=2, head_dim=32, window=8, context=2048,
                           yarn=Yarn(factor=4.0, original_max_position_embeddings=512, mscale_all_dim=0.0,
                                     truncate=False)),
    "20B": _gpt_oss(2880, 24, 32, 2880),
    "120B": _gpt_oss(2880, 36, 128, 2880),
}


# The registry: `[model] name` -> its flavors.
models_config = {"llama2": llama2_configs, "llama3": llama3_configs, "mixtral": mixtral_configs,
                 "qwen3": qwen3_configs, "deepseek_v2": deepseek_v2_configs,
                 "deepseek_v3": deepseek_v3_configs, "gemma3": gemma3_configs, "gpt_oss": gpt_oss_configs}
