"""Llama, Mixtral, Qwen3 and DeepSeek-V2/V3 weights between this project's (Meta's) names and layout and
HuggingFace `transformers`'.

Two differences: the names, and RoPE's layout. Meta rotates interleaved pairs (x0,x1),(x2,x3)...;
HF rotates the first half of each head against the second ("rotate_half"), in Llama, Mixtral and
Qwen3 alike. The rows of wq and wk are permuted so that both compute the same attention, and so
are Qwen3's per-head query/key norm weights (one head's worth of entries, in the same order).

Mixture-of-experts blocks are written as Mixtral's checkpoints hold them and as transformers 5's
MixtralForCausalLM.save_pretrained writes them (from_pretrained fuses them on load): one tensor per
expert, `model.layers.N.block_sparse_moe.experts.E.w1|w2|w3.weight`, and the router
`model.layers.N.block_sparse_moe.gate.weight`. Reading also takes transformers 5's in-memory layout
(`mlp.gate.weight`, `mlp.experts.gate_up_proj` [E, 2 * hidden, dim] = w1 then w3, and
`mlp.experts.down_proj` [E, dim, hidden]), as a MixtralForCausalLM's own state_dict() holds it.

DeepSeek-V2/V3 (multi-head latent attention) keep RoPE's interleaved layout in HF too (V3's
`rope_interleave`): no permutation; its experts are named as Qwen3-MoE's, its shared experts
`mlp.shared_experts.*`, its selection bias `mlp.gate.e_score_correction_bias`.
"""

from __future__ import annotations

import re
from typing import Any

import torch

from torchtitan_xla.models.llama.args import ModelArgs

_LAYER_MAP = {
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attention.q_norm.weight": "self_attn.q_norm.weight",
    "attention.k_norm.weight": "self_attn.k_norm.weight",
}
# Multi-head latent attention (mla.py; its `wq` and `wo` are named as Llama's) and DeepSeek's
# shared experts and expert bias.
_MLA_MAP = {
    "attention.wq_a.weight": "self_attn.q_a_proj.weight",
    "attention.q_norm.weight": "self_attn.q_a_layernorm.weight",
    "attention.wq_b.weight": "self_attn.q_b_proj.weight",
    "attention.wkv_a.weight": "self_attn.kv_a_proj_with_mqa.weight",
    "attention.kv_norm.weight": "self_attn.kv_a_layernorm.weight",
    "attention.wkv_b.weight": "self_attn.kv_b_proj.weight",
    "feed_forward.shared_experts.w1.weight": "mlp.shared_experts.gate_proj.weight",
    "feed_forward.shared_experts.w3.weight": "mlp.shared_experts.up_proj.weight",
    "feed_forward.shared_experts.w2.weight": "mlp.shared_experts.down_proj.weight",
}
# Gemma 3's four norms per block: HF's post_attention_layernorm normalises the attention's output,
# pre_feedforward_layernorm is Llama's post_attention_layernorm (our ffn_norm).
_SANDWICH_MAP = {
    "ffn_norm.weight": "pre_feedforward_layernorm.weight",
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "post_ffn_norm.weight": "post_feedforward_layernorm.weight",
}
_EXPERT_BIAS = ("feed_forward.expert_bias", "mlp.gate.e_score_correction_bias")
_TOP_MAP = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


def _interleaved_to_half(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    rows, cols = w.view(w.shape[0], -1).shape  # a norm's vector as one column
    return w.view(n_heads, rows // n_heads // 2, 2, cols).transpose(1, 2).reshape(w.shape)


def _half_to_interleaved(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    rows, cols = w.view(w.shape[0], -1).shape
    return w.view(n_heads, 2, rows // n_heads // 2, cols).transpose(1, 2).reshape(w.shape)


# Ours (stacked over experts) -> the per-expert HF name, with {} for the expert's index; and the
# router's. Mixtral's names, and Qwen3-MoE's (Qwen2-MoE's: the dense MLP's names per expert).
_MIXTRAL_EXPERTS = {f"feed_forward.{w}": f"block_sparse_moe.experts.{{}}.{w}.weight"
                    for w in ("w1", "w2", "w3")}
_QWEN3_EXPERTS = {f"feed_forward.{w}": f"mlp.experts.{{}}.{hf}.weight"
                  for w, hf in (("w1", "gate_proj"), ("w2", "down_proj"), ("w3", "up_proj"))}
_ROUTER = "feed_forward.router.weight"
_MOE_PREFIXES = ("block_sparse_moe.", "mlp.gate.", "mlp.experts.")  # HF names within a layer


def _layer_map(args: ModelArgs) -> dict[str, str]:
    if args.sandwich_norm:
        return {**_LAYER_MAP, **_SANDWICH_MAP}
    if not args.mla:
        return _LAYER_MAP
    mha_only = ("attention.wk.weight", "attention.wv.weight", "attention.q_norm.weight",
                "attention.k_norm.weight")
    return {**{k: v for k, v in _LAYER_MAP.items() if k not in mha_only}, **_MLA_MAP}


def _expert_names(args: ModelArgs) -> tuple[dict[str, str], str]:
    if args.qk_norm or args.mla:
        return _QWEN3_EXPERTS, "mlp.gate.weight"
    return _MIXTRAL_EXPERTS, "block_sparse_moe.gate.weight"


def _moe_to_hf(layer: str, name: str, t: torch.Tensor, args: ModelArgs) -> dict[str, torch.Tensor]:
    experts, router = _expert_names(args)
    if name == _ROUTER:
        return {f"model.layers.{layer}.{router}": t}
    if name == _EXPERT_BIAS[0]:
        return {f"model.layers.{layer}.{_EXPERT_BIAS[1]}": t}
    return {f"model.layers.{layer}.{experts[name].format(e)}": t[e] for e in range(t.shape[0])}


def _moe_from_hf(layers: dict[str, dict[str, torch.Tensor]], args: ModelArgs) -> dict[str, torch.Tensor]:
    """{layer: {HF name within the layer: tensor}} of the mixture-of-experts weights -> ours."""
    experts, router = _expert_names(args)
    out = {}
    for layer, tensors in layers.items():
        ours = f"layers.{layer}.feed_forward"
        for name in (router, "mlp.gate.weight"):  # on disk, in memory
            if name in tensors:
                out[f"{ours}.router.weight"] = tensors.pop(name)
        if _EXPERT_BIAS[1] in tensors:
            out[f"{ours}.expert_bias"] = tensors.pop(_EXPERT_BIAS[1])
        # transformers 5's in-memory layout: w1 and w3 of every expert in one tensor, then w2.
        if "mlp.experts.gate_up_proj" in tensors:
            w1, w3 = tensors.pop("mlp.experts.gate_up_proj").chunk(2, dim=1)
            out[f"{ours}.w1"], out[f"{ours}.w3"] = w1.contiguous(), w3.contiguous()
        if "mlp.experts.down_proj" in tensors:
            out[f"{ours}.w2"] = tensors.pop("mlp.experts.down_proj")
        for name, hf in experts.items():  # on disk: one tensor per expert
            per_expert = [tensors.pop(hf.format(e), None) for e in range(args.num_experts)]
            if all(t is None for t in per_expert):
                continue
            if any(t is None for t in per_expert):
                raise KeyError(f"model.layers.{layer}.{hf.format('E')} is missing for some of the "
                               f"{args.num_experts} experts")
            out[f"layers.{layer}.{name}"] = torch.stack(per_expert)
        if tensors:  # e.g. more experts than args.num_experts
            name = next(iter(tensors))
            raise KeyError(f"unexpected HuggingFace mixture-of-experts weight model.layers.{layer}.{name}")
    return out


def _permute_for(name: str, args: ModelArgs):
    if args.mla:  # DeepSeek's HF weights are interleaved as ours
        return None
    if name.endswith("attention.wq.weight"):
        return args.n_heads
    if name.endswith("attention.wk.weight"):
        return args.kv_heads
    if name.endswith(("attention.q_norm.weight", "attention.k_norm.weight")):
        return 1
    return None


def to_hf(state_dict: dict[str, torch.Tensor], args: ModelArgs) -> dict[str, torch.Tensor]:
    """Our names and layout -> HF's. LoRA adapters (`...wq.lora_A.weight`) get peft's names under
    the HF module (`...q_proj.lora_A.weight`); B's rows are wq's / wk's rows, permuted likewise."""
    from torchtitan_xla.lora import split_adapter

    out = {}
    for name, t in state_dict.items():
        if name in _TOP_MAP:
            out[_TOP_MAP[name]] = t
            continue
        base, adapter = split_adapter(name)
        m = re.fullmatch(r"layers\.(\d+)\.(.+)", base)
        if m and adapter is None and m.group(2) in (*_expert_names(args)[0], _ROUTER, _EXPERT_BIAS[0]):
            out.update(_moe_to_hf(m.group(1), m.group(2), t, args))
            continue
        if not m or m.group(2) not in _layer_map(args):
            raise KeyError(f"no HuggingFace name for parameter {name!r}")
        hf = f"model.layers.{m.group(1)}.{_layer_map(args)[m.group(2)]}"
        if adapter is not None:
            hf = hf.removesuffix(".weight") + f".{adapter}.weight"
        heads = _permute_for(base, args) if adapter != "lora_A" else None
        out[hf] = _interleaved_to_half(t, heads) if heads else t
    return out


def from_hf(hf_state_dict: dict[str, torch.Tensor], args: ModelArgs) -> dict[str, torch.Tensor]:
    top = {v: k for k, v in _TOP_MAP.items()}
    layer = {v: k for k, v in _layer_map(args).items()}
    out = {}
    moe: dict[str, dict[str, torch.Tensor]] = {}  # gathered per layer, then stacked over experts
    for name, t in hf_state_dict.items():
        # A multimodal Gemma 3 folder: its text model's weights under these prefixes, beside the
        # vision tower's and the projector's, which are not part of this model.
        if name.startswith(("vision_tower.", "multi_modal_projector.", "model.vision_tower.",
                            "model.multi_modal_projector.")):
            continue
        name = re.sub(r"^(language_model\.model\.|model\.language_model\.)", "model.", name)
        name = name.removeprefix("language_model.")  # language_model.lm_head.weight
        if name in top:
            if not (name == "lm_head.weight" and args.tie_embeddings):  # tied: the embedding's
                out[top[name]] = t
            continue
        m = re.fullmatch(r"model\.layers\.(\d+)\.(.+)", name)
        if m and args.mla and int(m.group(1)) >= args.n_layers:
            continue  # DeepSeek-V3's multi-token-prediction module (its layer 61): not in this model
        if m and args.num_experts and m.group(2).startswith(_MOE_PREFIXES):
            moe.setdefault(m.group(1), {})[m.group(2)] = t
            continue
        if not m or m.group(2) not in layer:
            if name.endswith("rotary_emb.inv_freq"):  # a buffer some old exports carry
                continue
            raise KeyError(f"unexpected HuggingFace Llama weight {name!r}")
        ours = f"layers.{m.group(1)}.{layer[m.group(2)]}"
        heads = _permute_for(ours, args)
        out[ours] = _half_to_interleaved(t, heads) if heads else t
    out.update(_moe_from_hf(moe, args))
    return out


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
