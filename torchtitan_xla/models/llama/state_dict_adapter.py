"""Llama weights between this project's (Meta's) names and layout and HuggingFace `transformers`'.

Two differences: the names, and RoPE's layout. Meta rotates interleaved pairs (x0,x1),(x2,x3)...;
HF rotates the first half of each head against the second ("rotate_half"). The rows of wq and wk
are permuted so that both compute the same attention.
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
}
_TOP_MAP = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


def _interleaved_to_half(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    rows, cols = w.shape
    return w.view(n_heads, rows // n_heads // 2, 2, cols).transpose(1, 2).reshape(rows, cols)


def _half_to_interleaved(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    rows, cols = w.shape
    return w.view(n_heads, 2, rows // n_heads // 2, cols).transpose(1, 2).reshape(rows, cols)


def _permute_for(name: str, args: ModelArgs):
    if name.endswith("attention.wq.weight"):
        return args.n_heads
    if name.endswith("attention.wk.weight"):
        return args.kv_heads
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
        if not m or m.group(2) not in _LAYER_MAP:
            raise KeyError(f"no HuggingFace name for parameter {name!r}")
        hf = f"model.layers.{m.group(1)}.{_LAYER_MAP[m.group(2)]}"
        if adapter is not None:
            hf = hf.removesuffix(".weight") + f".{adapter}.weight"
        heads = _permute_for(base, args) if adapter != "lora_A" else None
        out[hf] = _interleaved_to_half(t, heads) if heads else t
    return out


def from_hf(hf_state_dict: dict[str, torch.Tensor], args: ModelArgs) -> dict[str, torch.Tensor]:
    top = {v: k for k, v in _TOP_MAP.items()}
    layer = {v: k for k, v in _LAYER_MAP.items()}
    out = {}
    for name, t in hf_state_dict.items():
        if name in top:
            out[top[name]] = t
            continue
        m = re.fullmatch(r"model\.layers\.(\d+)\.(.+)", name)
        if not m or m.group(2) not in layer:
            if name.endswith("rotary_emb.inv_freq"):  # a buffer some old exports carry
                continue
            raise KeyError(f"unexpected HuggingFace Llama weight {name!r}")
        ours = f"layers.{m.group(1)}.{layer[m.group(2)]}"
        heads = _permute_for(ours, args)
        out[ours] = _half_to_interleaved(t, heads) if heads else t
    return out


def hf_config(args: ModelArgs, *, bos_id: int | None = None, eos_id: int | None = None,
              dtype: str = "float32") -> dict[str, Any]:
    """The `config.json` with which `LlamaForCausalLM` computes what our model computes."""
    cfg: dict[str, Any] = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": args.dim,
        "intermediate_size": args.ffn_hidden_dim,
        "num_hidden_layers": args.n_layers,
        "num_attention_heads": args.n_heads,
        "num_key_value_heads": args.kv_heads,
        "head_dim": args.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": args.norm_eps,
        "rope_theta": args.rope_theta,
        "vocab_size": args.vocab_size,
        "max_position_embeddings": args.max_seq_len,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "mlp_bias": False,
        "torch_dtype": dtype,
    }
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
