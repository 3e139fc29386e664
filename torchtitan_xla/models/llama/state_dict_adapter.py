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
# gpt-oss: biases on the four projections (wq's and wk's rows permuted as the weights'), the sinks.
_BIAS_MAP = {f"attention.{w}.bias": f"self_attn.{hf}_proj.bias" for w, hf in
             (("wq", "q"), ("wk", "k"), ("wv", "v"), ("wo", "o"))} | {"attention.sinks": "self_attn.sinks"}
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
_MOE_PREFIXES = ("block_sparse_moe.", "mlp.gate.", "mlp.experts.", "mlp.router.")  # HF names within a layer


def _layer_map(args: ModelArgs) -> dict[str, str]:
    if args.attn_bias or args.attn_sinks:
        return {**_LAYER_MAP, **_BIAS_MAP}
    if args.sandwich_norm:
        return {**_LAYER_MAP, **_SANDWICH_MAP}
    if not args.mla:
        return _LAYER_MAP
    mha_only = ("attention.wk.weight", "attention.wv.weight", "attention.q_norm.weight",
                "attention.k_norm.weight")
    return {**{k: v for k, v in _LAYER_MAP.items() if k not in mha_only}, **_MLA_MAP}


def _expert_names(args: ModelArgs) -> tuple[dict[str, str], str]:
    if args.moe_bias:  # gpt-oss: the experts fused (_gpt_oss_experts_to_hf)
        return {}, "mlp.router.weight"
    if args.qk_norm or args.mla:
        return _QWEN3_EXPERTS, "mlp.gate.weight"
    return _MIXTRAL_EXPERTS, "block_sparse_moe.gate.weight"


# gpt-oss's experts as GptOssForCausalLM holds them (and save_pretrained writes them unquantized):
# per block `mlp.router.weight|bias`, and over the experts `mlp.experts.gate_up_proj` [E, dim,
# 2 x hidden] (x @ W; gate and up interleaved: columns 0::2 and 1::2), `gate_up_proj_bias`
# [E, 2 x hidden] alike, `down_proj` [E, hidden, dim] and `down_proj_bias` [E, dim].
_GPT_OSS_EXPERTS = ("feed_forward.w1", "feed_forward.w2", "feed_forward.w3", "feed_forward.b1",
                    "feed_forward.b2", "feed_forward.b3", "feed_forward.router.bias")


def _gpt_oss_experts_to_hf(layer: str, ours: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    hf = f"model.layers.{layer}.mlp."
    w1, w3, b1, b3 = (ours[f"feed_forward.{n}"] for n in ("w1", "w3", "b1", "b3"))
    return {f"{hf}experts.gate_up_proj": torch.stack([w1, w3], 2).flatten(1, 2).transpose(1, 2).contiguous(),
            f"{hf}experts.gate_up_proj_bias": torch.stack([b1, b3], -1).flatten(1),
            f"{hf}experts.down_proj": ours["feed_forward.w2"].transpose(1, 2).contiguous(),
            f"{hf}experts.down_proj_bias": ours["feed_forward.b2"],
            f"{hf}router.bias": ours["feed_forward.router.bias"]}


def _gpt_oss_experts_from_hf(ours: str, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    def take(name: str) -> torch.Tensor:
        if name not in tensors:
            raise KeyError(f"model.{ours.removesuffix('.feed_forward')}.{name} is missing (a gpt-oss block's "
                           f"experts: {name}, or its MXFP4 {name}_blocks and _scales)")
        return tensors.pop(name)

    for kind in ("gate_up_proj", "down_proj"):  # the published files: MXFP4
        if f"mlp.experts.{kind}_blocks" in tensors:
            blocks = tensors.pop(f"mlp.experts.{kind}_blocks")
            tensors[f"mlp.experts.{kind}"] = dequantize_mxfp4(blocks, take(f"mlp.experts.{kind}_scales"))
            tensors[f"mlp.experts.{kind}"] = tensors[f"mlp.experts.{kind}"].transpose(1, 2)
    gate_up = take("mlp.experts.gate_up_proj").transpose(1, 2)  # [E, 2 x hidden, dim]
    bias = take("mlp.experts.gate_up_proj_bias")
    return {f"{ours}.w1": gate_up[:, 0::2].contiguous(), f"{ours}.w3": gate_up[:, 1::2].contiguous(),
            f"{ours}.b1": bias[:, 0::2].contiguous(), f"{ours}.b3": bias[:, 1::2].contiguous(),
            f"{ours}.w2": take("mlp.experts.down_proj").transpose(1, 2).contiguous(),
            f"{ours}.b2": take("mlp.experts.down_proj_bias"),
            f"{ours}.router.weight": take("mlp.router.weight"),
            f"{ours}.router.bias": take("mlp.router.bias")}


# OCP Microscaling FP4 (E2M1): the 16 values of a nibble, its top bit the sign.
_FP4_E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype=torch.bfloat16) -> torch.Tensor:
    """gpt-oss's published expert weights: `blocks` uint8 [..., out, groups, 16] (two FP4 values a
    byte, the low nibble first), `scales` uint8 [..., out, groups] (each group of 32 values times
    2^(scale - 127)) -> [..., out, groups x 32] in `dtype` (bfloat16 holds every value exactly). The
    format is the OCP MX specification's; transformers' mxfp4 integration reads it alike."""
    table = torch.tensor(_FP4_E2M1, dtype=torch.float32)

    def one(b: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
        values = torch.stack([table[(b & 0x0F).int()], table[(b >> 4).int()]], -1).flatten(-2)
        return torch.ldexp(values, s.to(torch.int32)[..., None] - 127).flatten(-2).to(dtype)

    # An expert at a time: the float32 intermediates of a whole block's experts would be 8 times
    # the result's bytes (transformers chunks its conversion too).
    if blocks.dim() < 4:
        return one(blocks, scales)
    return torch.stack([one(b, s) for b, s in zip(blocks, scales)])


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
        if args.moe_bias:
            out.update(_gpt_oss_experts_from_hf(ours, tensors))
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
    if name.endswith(("attention.wq.weight", "attention.wq.bias")):
        return args.n_heads
    if name.endswith(("attention.wk.weight", "attention.wk.bias")):
        return args.kv_heads
    if name.endswith(("attention.q_norm.weight", "attention.k_norm.weight")):
        return 1
    return None


def to_hf(state_dict: dict[str, torch.Tensor], args: ModelArgs) -> dict[str, torch.Tensor]:
    """Our names and layout -> HF's. LoRA adapters (`...wq.lora_A.weight`) get peft's names under
    the HF module (`...q_proj.lora_A.weight`); B's rows are wq's / wk's rows, permuted likewise."""
    from torchtitan_xla.lora import split_adapter

    out = {}
    if args.moe_bias:  # gpt-oss: each block's experts as fused tensors
        for layer in {name.split(".")[1] for name in state_dict if name.endswith("feed_forward.w1")}:
            prefix = f"layers.{layer}."
            ours = {n.removeprefix(prefix): t for n, t in state_dict.items() if n.startswith(prefix)}
            out.update(_gpt_oss_experts_to_hf(layer, ours))
        state_dict = {n: t for n, t in state_dict.items() if not n.endswith(_GPT_OSS_EXPERTS)}
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
