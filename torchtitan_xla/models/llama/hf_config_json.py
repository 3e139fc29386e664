"""The `config.json` of an HF export: the transformers architecture (and its settings) that computes
what a model of these ModelArgs computes (LlamaForCausalLM, MixtralForCausalLM, Qwen3ForCausalLM,
Qwen3MoeForCausalLM, DeepseekV2/V3ForCausalLM, Gemma3ForCausalLM, GptOssForCausalLM).
Importable without torch."""

from __future__ import annotations

from typing import Any

from torchtitan_xla.models.llama.args import ModelArgs


def hf_config(args: ModelArgs, *, bos_id: int | None = None, eos_id: int | None = None,
              dtype: str = "float32") -> dict[str, Any]:
    """The `config.json` with which `LlamaForCausalLM`, with experts `MixtralForCausalLM`, with
    query/key norms `Qwen3ForCausalLM` (and experts `Qwen3MoeForCausalLM`) computes what our model
    computes, and which describes it as trained: its context length (the flavor's, or the positions
    training reached beyond it) and, with experts, the load-balancing loss's weight."""
    moe, qwen3 = args.num_experts > 0, args.qk_norm
    if args.mla:
        return _deepseek_config(args, bos_id, eos_id, dtype)
    if args.sandwich_norm:
        return _gemma3_config(args, bos_id, eos_id, dtype)
    if args.attn_sinks or args.moe_bias:
        return _gpt_oss_config(args, bos_id, eos_id, dtype)
    if args.router != "softmax" or not args.norm_topk or args.routed_scaling != 1.0 or args.shared_experts:
        raise ValueError("no transformers architecture has Llama attention with DeepSeek's routing: "
                         "export to HuggingFace needs a deepseek_v2 or deepseek_v3 model (latent attention)")
    if moe and args.moe_every != 1 and not qwen3:
        # Qwen3-MoE interleaves dense and MoE blocks as moe_every does (decoder_sparse_step), but
        # with query/key norms; Qwen2-MoE with q/k/v biases and a shared expert.
        raise ValueError(f"no transformers architecture has Llama blocks with experts in one block of every "
                         f"{args.moe_every} (moe_every={args.moe_every}): export to HuggingFace needs "
                         f"moe_every = 1, experts in every block (Mixtral), or a qwen3 model")
    cfg: dict[str, Any] = {
        "architectures": ["MixtralForCausalLM" if moe else "LlamaForCausalLM"],
        "model_type": "mixtral" if moe else "llama",
        "hidden_size": args.dim,
        "intermediate_size": args.ffn_hidden_dim,  # the dense blocks' (with moe_every > 1)
        "num_hidden_layers": args.n_layers,
        "num_attention_heads": args.n_heads,
        "num_key_value_heads": args.kv_heads,
        "head_dim": args.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": args.norm_eps,
        "rope_theta": args.rope_theta,
        "vocab_size": args.vocab_size,
        # Not RoPE's input (transformers' default and llama3 RoPE ignore it, as ours does): the
        # context, which max_seq_len (training's seq_len) alone would understate.
        "max_position_embeddings": max(args.context_len, args.max_seq_len),
        "attention_dropout": 0.0,
    }
    if moe:
        # transformers' MoE models are dropless: a model trained with a capacity factor computes
        # there what ours computes when no token is dropped. They add router_aux_loss_coef x their
        # balancing loss to the loss only with output_router_logits: on when training weighted it,
        # so training on goes on alike (its loss averages the layers' fractions first, moe.py; no
        # z-loss exists there).
        cfg.update({"num_experts_per_tok": args.top_k, "router_aux_loss_coef": args.aux_loss_weight,
                    "output_router_logits": args.aux_loss_weight > 0,
                    "tie_word_embeddings": args.tie_embeddings})
    if moe and qwen3:
        cfg.update({
            "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
            "num_experts": args.num_experts, "moe_intermediate_size": args.expert_hidden_dim,
            "decoder_sparse_step": args.moe_every, "mlp_only_layers": [],
            "norm_topk_prob": True,  # our router renormalises the top-k probabilities
            "attention_bias": False, "use_sliding_window": False, "sliding_window": None})
    elif moe:
        cfg.update({
            "sliding_window": None,  # Mixtral's attention is full (Mistral 7B's had a window)
            "num_local_experts": args.num_experts, "intermediate_size": args.expert_hidden_dim,
            "router_jitter_noise": 0.0,
        })
    elif qwen3:
        cfg.update({"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3",
                    "tie_word_embeddings": args.tie_embeddings, "attention_bias": False,
                    "use_sliding_window": False, "sliding_window": None, "max_window_layers": args.n_layers})
    else:
        cfg.update({"tie_word_embeddings": args.tie_embeddings, "attention_bias": False, "mlp_bias": False})
    cfg["torch_dtype"] = dtype
    if args.rope_scaling is not None:
        s = args.rope_scaling
        cfg["rope_scaling"] = {
            "rope_type": "llama3", "factor": s.factor, "low_freq_factor": s.low_freq_factor,
            "high_freq_factor": s.high_freq_factor,
            "original_max_position_embeddings": s.original_max_position_embeddings}
    if bos_id is not None:
        cfg["bos_token_id"] = bos_id
    if eos_id is not None:
        cfg["eos_token_id"] = eos_id
    return cfg


def _gemma3_config(args: ModelArgs, bos_id: int | None, eos_id: int | None, dtype: str) -> dict[str, Any]:
    """`Gemma3ForCausalLM`'s config.json (model_type gemma3_text): each block's attention type listed,
    the global blocks' RoPE base and linear scaling, the local ones' base."""
    gemma = (args.norm_offset == 1.0 and args.qk_norm and args.embed_scale and args.tie_embeddings
             and args.ffn_act == "gelu_tanh" and not args.num_experts and args.rope_scaling is None
             and args.yarn is None)
    if not gemma:
        raise ValueError("a model with Gemma's sandwich norms exports to HuggingFace as Gemma 3 only: "
                         "with the gemma3 flavors' other options (norm offset 1, query/key norms, GeGLU, "
                         "scaled and tied embeddings, no experts)")
    cfg: dict[str, Any] = {
        "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text",
        "hidden_size": args.dim, "intermediate_size": args.ffn_hidden_dim, "num_hidden_layers": args.n_layers,
        "num_attention_heads": args.n_heads, "num_key_value_heads": args.kv_heads, "head_dim": args.head_dim,
        "hidden_activation": "gelu_pytorch_tanh", "rms_norm_eps": args.norm_eps,
        "vocab_size": args.vocab_size,
        "max_position_embeddings": max(args.context_len, args.max_seq_len),
        "query_pre_attn_scalar": args.query_pre_attn_scalar or args.head_dim,
        "sliding_window": args.sliding_window,
        "layer_types": ["sliding_attention" if args.window(i) else "full_attention"
                        for i in range(args.n_layers)],
        "rope_theta": args.rope_theta, "rope_local_base_freq": args.rope_local_theta or args.rope_theta,
        "rope_scaling": ({"rope_type": "linear", "factor": args.rope_linear_factor}
                         if args.rope_linear_factor != 1.0 else None),
        "tie_word_embeddings": True, "attention_bias": False, "attention_dropout": 0.0,
        "attn_logit_softcapping": None, "final_logit_softcapping": None, "torch_dtype": dtype,
    }
    for key, value in (("bos_token_id", bos_id), ("eos_token_id", eos_id)):
        if value is not None:
            cfg[key] = value
    return cfg


def _deepseek_config(args: ModelArgs, bos_id: int | None, eos_id: int | None,
                     dtype: str) -> dict[str, Any]:
    """`DeepseekV3ForCausalLM`'s config.json (sigmoid router), or `DeepseekV2ForCausalLM`'s
    (softmax): interleaved RoPE as our weights, no multi-token prediction module (V3's default would
    expect one), experts after dense_layers blocks."""
    v3 = args.router == "sigmoid"
    if args.num_experts and (args.moe_every != 1 or args.norm_topk != v3):
        raise ValueError("DeepSeek's HF models have experts in every block after the dense ones, V3 "
                         "renormalising its top-k and V2 not: export to HuggingFace needs moe_every = 1 "
                         "and norm_topk as theirs")
    cfg: dict[str, Any] = {
        "architectures": ["DeepseekV3ForCausalLM" if v3 else "DeepseekV2ForCausalLM"],
        "model_type": "deepseek_v3" if v3 else "deepseek_v2",
        "hidden_size": args.dim, "intermediate_size": args.ffn_hidden_dim,
        "moe_intermediate_size": args.expert_hidden_dim, "num_hidden_layers": args.n_layers,
        "num_attention_heads": args.n_heads, "num_key_value_heads": args.n_heads,
        "n_routed_experts": args.num_experts, "num_experts_per_tok": args.top_k,
        "n_shared_experts": args.shared_experts, "routed_scaling_factor": args.routed_scaling,
        "n_group": args.expert_groups, "topk_group": args.topk_groups, "norm_topk_prob": args.norm_topk,
        "first_k_dense_replace": args.dense_layers if args.num_experts else args.n_layers,
        "moe_layer_freq": 1, "scoring_func": "sigmoid" if v3 else "softmax",
        "topk_method": "noaux_tc" if v3 else ("group_limited_greedy" if args.expert_groups > 1 else "greedy"),
        "aux_loss_alpha": args.aux_loss_weight, "seq_aux": True,
        "q_lora_rank": args.q_lora_rank or None, "kv_lora_rank": args.kv_lora_rank,
        "qk_nope_head_dim": args.qk_nope_head_dim, "qk_rope_head_dim": args.qk_rope_head_dim,
        "v_head_dim": args.v_head_dim, "hidden_act": "silu", "rms_norm_eps": args.norm_eps,
        "rope_theta": args.rope_theta, "max_position_embeddings": max(args.context_len, args.max_seq_len),
        "vocab_size": args.vocab_size, "tie_word_embeddings": args.tie_embeddings, "attention_bias": False,
        "attention_dropout": 0.0, "torch_dtype": dtype,
    }
    if v3:  # V2 always rotates interleaved pairs
        cfg.update({"rope_interleave": True, "num_nextn_predict_layers": 0})
    if args.yarn is not None:
        y = args.yarn
        cfg["rope_scaling"] = {"type": "yarn", "rope_type": "yarn", "factor": y.factor,
                               "original_max_position_embeddings": y.original_max_position_embeddings,
                               "beta_fast": y.beta_fast, "beta_slow": y.beta_slow, "mscale": y.mscale,
                               "mscale_all_dim": y.mscale_all_dim}
    for key, value in (("bos_token_id", bos_id), ("eos_token_id", eos_id)):
        if value is not None:
            cfg[key] = value
    return cfg


def _gpt_oss_config(args: ModelArgs, bos_id: int | None, eos_id: int | None, dtype: str) -> dict[str, Any]:
    """`GptOssForCausalLM`'s config.json: each block's attention type listed, YaRN (or plain RoPE),
    written unquantized (no quantization_config: the experts as their weights are)."""
    yarn = args.yarn
    gpt_oss = (args.attn_sinks and args.moe_bias and args.ffn_act == "swiglu_clamp" and args.num_experts
               and all(args.is_moe_layer(i) for i in range(args.n_layers)) and args.router == "softmax"
               and args.norm_topk and args.routed_scaling == 1.0 and not args.shared_experts
               and not (args.qk_norm or args.sandwich_norm or args.norm_offset or args.embed_scale)
               and args.rope_scaling is None and args.query_pre_attn_scalar is None
               and (yarn is None or (yarn.mscale, yarn.mscale_all_dim) == (1.0, 0.0)))
    if not gpt_oss:
        raise ValueError("a model with attention sinks or biased experts exports to HuggingFace as gpt-oss "
                         "only: with the gpt_oss flavors' other options (experts with the clamped SwiGLU in "
                         "every block, softmax routing, Llama's norms, YaRN without mscale)")
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": args.rope_theta}
    if yarn is not None:
        rope.update({"rope_type": "yarn", "factor": yarn.factor, "beta_fast": yarn.beta_fast,
                     "beta_slow": yarn.beta_slow, "truncate": yarn.truncate,
                     "original_max_position_embeddings": yarn.original_max_position_embeddings})
    cfg: dict[str, Any] = {
        "architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss",
        "hidden_size": args.dim, "intermediate_size": args.expert_hidden_dim,
        "num_hidden_layers": args.n_layers, "num_attention_heads": args.n_heads,
        "num_key_value_heads": args.kv_heads, "head_dim": args.head_dim,
        "num_local_experts": args.num_experts, "num_experts_per_tok": args.top_k,
        "rms_norm_eps": args.norm_eps, "vocab_size": args.vocab_size,
        "max_position_embeddings": max(args.context_len, args.max_seq_len),
        "sliding_window": args.sliding_window or None,
        "layer_types": ["sliding_attention" if args.window(i) else "full_attention"
                        for i in range(args.n_layers)],
        "rope_parameters": rope, "attention_bias": args.attn_bias, "swiglu_alpha": 1.702, "swiglu_limit": 7.0,
        "router_aux_loss_coef": args.aux_loss_weight, "output_router_logits": args.aux_loss_weight > 0,
        "tie_word_embeddings": args.tie_embeddings, "attention_dropout": 0.0, "torch_dtype": dtype,
    }
    for key, value in (("bos_token_id", bos_id), ("eos_token_id", eos_id)):
        if value is not None:
            cfg[key] = value
    return cfg
