"""ModelArgs from a HuggingFace config.json, importable without torch (config validation reads an
HF folder's architecture before XLA starts: `[model] flavor = "hf"`).

A config.json is read as transformers 5 reads it: a key it leaves out takes the default of its
config class (LlamaConfig, Qwen3Config, ...; transformers 5.24's values below), a key may be
spelled as transformers 5 writes it or as older files on the hub do (`num_local_experts` or
`num_experts`; `rope_theta` at the top or inside `rope_parameters` / `rope_scaling`), and anything
our model does not compute the same way is one ConfigError line ("config.json: ...").
"""

from __future__ import annotations

from torchtitan_xla.errors import ConfigError
from torchtitan_xla.models.llama.args import ModelArgs, RopeScaling, Yarn

# [model] name -> the model_type values of the HF configs it runs.
FAMILIES = {"llama2": ("llama",), "llama3": ("llama",), "mixtral": ("mixtral",),
            "qwen3": ("qwen3", "qwen3_moe"), "deepseek_v2": ("deepseek_v2",),
            "deepseek_v3": ("deepseek_v3",), "gemma3": ("gemma3_text", "gemma3"), "gpt_oss": ("gpt_oss",)}

# What transformers 5.24's config classes give for a key the file leaves out (None: derived, as
# their __post_init__ derives it). Only the keys read here.
_COMMON = {"num_key_value_heads": None, "head_dim": None, "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
           "hidden_act": "silu", "attention_bias": False, "rope_theta": 10000.0}
_DEEPSEEK = {**_COMMON, "kv_lora_rank": 512, "q_lora_rank": 1536, "qk_nope_head_dim": 128,
             "qk_rope_head_dim": 64, "v_head_dim": 128, "mlp_bias": False}
_DEFAULTS = {
    "llama": {**_COMMON, "vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 11008,
              "num_hidden_layers": 32, "num_attention_heads": 32, "max_position_embeddings": 2048,
              "mlp_bias": False},
    "qwen3": {**_COMMON, "vocab_size": 151936, "hidden_size": 4096, "intermediate_size": 22016,
              "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 32, "head_dim": 128,
              "max_position_embeddings": 32768, "use_sliding_window": False},
    "qwen3_moe": {**_COMMON, "vocab_size": 151936, "hidden_size": 2048, "intermediate_size": 6144,
                  "num_hidden_layers": 24, "num_attention_heads": 32, "num_key_value_heads": 4,
                  "max_position_embeddings": 32768, "use_sliding_window": False, "decoder_sparse_step": 1,
                  "moe_intermediate_size": 768, "num_experts_per_tok": 8, "num_experts": 128,
                  "norm_topk_prob": False, "router_aux_loss_coef": 0.001, "mlp_only_layers": None},
    "mixtral": {**_COMMON, "vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 14336,
                "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
                "max_position_embeddings": 4096 * 32, "rms_norm_eps": 1e-5, "rope_theta": 1e6,
                "sliding_window": None, "num_experts_per_tok": 2, "num_experts": 8,
                "router_aux_loss_coef": 0.001},
    "deepseek_v3": {**_DEEPSEEK, "vocab_size": 129280, "hidden_size": 7168, "intermediate_size": 18432,
                    "moe_intermediate_size": 2048, "num_hidden_layers": 61, "num_attention_heads": 128,
                    "n_shared_experts": 1, "num_experts": 256, "routed_scaling_factor": 2.5, "n_group": 8,
                    "topk_group": 4, "num_experts_per_tok": 8, "first_k_dense_replace": 3,
                    "norm_topk_prob": True, "max_position_embeddings": 4096, "rope_interleave": True},
    "deepseek_v2": {**_DEEPSEEK, "vocab_size": 102400, "hidden_size": 4096, "intermediate_size": 11008,
                    "num_hidden_layers": 32, "num_attention_heads": 32, "max_position_embeddings": 2048,
                    "first_k_dense_replace": 0, "n_group": None, "num_experts": 64, "n_shared_experts": 2,
                    "routed_scaling_factor": 1.0, "topk_group": None, "topk_method": "greedy",
                    "norm_topk_prob": False, "num_experts_per_tok": None, "moe_intermediate_size": 1407},
    # Gemma3TextConfig's (a multimodal gemma3 config's text_config is read with them too).
    "gemma3_text": {"vocab_size": 262208, "hidden_size": 2304, "intermediate_size": 9216,
                    "num_hidden_layers": 26, "num_attention_heads": 8, "num_key_value_heads": 4,
                    "head_dim": 256,
                    "hidden_activation": "gelu_pytorch_tanh", "max_position_embeddings": 131072,
                    "rms_norm_eps": 1e-6, "tie_word_embeddings": True, "attention_bias": False,
                    "query_pre_attn_scalar": 256, "sliding_window": 4096, "final_logit_softcapping": None,
                    "attn_logit_softcapping": None},
}
_DEFAULTS["gemma3"] = _DEFAULTS["gemma3_text"]
_DEFAULTS["gpt_oss"] = {  # GptOssConfig's (its rope_parameters: gpt-oss's YaRN, _gpt_oss_args)
    "num_hidden_layers": 36, "num_experts": 128, "vocab_size": 201088, "hidden_size": 2880,
    "intermediate_size": 2880, "head_dim": 64, "num_attention_heads": 64, "num_key_value_heads": 8,
    "sliding_window": 128, "tie_word_embeddings": False, "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-5, "num_experts_per_tok": 4, "swiglu_alpha": 1.702, "swiglu_limit": 7.0,
    "router_aux_loss_coef": 0.001, "attention_bias": True, "rope_theta": 150000.0}
# The routed experts' count under every name a config class takes it by (its field, and the
# names its attribute_map sends to that field): Mixtral and Qwen3-MoE write num_local_experts,
# older Qwen3-MoE files num_experts, DeepSeek n_routed_experts.
_EXPERTS = ("num_local_experts", "num_experts", "n_routed_experts")
_MISSING = object()


def _getter(cfg: dict, model_type: str):
    defaults = _DEFAULTS[model_type]

    def get(key: str):
        names = _EXPERTS if key == "num_experts" else (key,)
        for name in names:
            if name in cfg:
                return cfg[name]
        value = defaults.get(key, _MISSING)
        if value is _MISSING:  # a key we read always has a default above
            raise KeyError(key)
        return value

    return get


def _rope(cfg: dict, model_type: str, kinds: tuple[str, ...]) -> tuple[str, dict, float]:
    """(rope type, its parameters, rope_theta) as transformers 5 standardises them: rope_scaling
    (older files) else rope_parameters; rope_theta inside it, else at the top, else the class's."""
    scaling = cfg.get("rope_scaling") or cfg.get("rope_parameters") or {}
    scaling = scaling.get("full_attention", scaling)  # parameters per layer type: all are full here
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind not in kinds or scaling.get("partial_rotary_factor", 1.0) != 1.0:
        raise ConfigError(f"config.json: {model_type} with RoPE {kind!r}"
                          + (f" and partial_rotary_factor {scaling['partial_rotary_factor']}"
                             if scaling.get("partial_rotary_factor", 1.0) != 1.0 else "")
                          + f" is not supported (only {' or '.join(kinds)})")
    theta = scaling.get("rope_theta")
    if theta is None:
        theta = cfg.get("rope_theta")
    if theta is None:
        theta = _DEFAULTS[model_type]["rope_theta"]
    return kind, scaling, float(theta)


def model_args_from_hf_config(cfg: dict) -> ModelArgs:
    """ModelArgs computing what `LlamaForCausalLM` (or `MixtralForCausalLM`, `Qwen3ForCausalLM`,
    `Qwen3MoeForCausalLM`, `DeepseekV2ForCausalLM`, `DeepseekV3ForCausalLM`) with this config
    computes."""
    model_type = cfg.get("model_type", "llama")  # hand-written Llama configs may leave it out
    if model_type not in _DEFAULTS:
        raise ConfigError(f"config.json: model_type {model_type!r} is not supported: not a Llama, Mixtral, "
                          f"Qwen3, DeepSeek, Gemma 3 or gpt-oss config ({', '.join(_DEFAULTS)})")
    if model_type.startswith("gemma3"):
        return _gemma3_args(cfg.get("text_config") or {} if model_type == "gemma3" else cfg)
    if model_type == "gpt_oss":
        return _gpt_oss_args(cfg)
    get = _getter(cfg, model_type)
    if get("hidden_act") != "silu":
        raise ConfigError(f"config.json: hidden_act {get('hidden_act')!r} is not supported (only silu)")
    biases = [k for k in ("attention_bias", "mlp_bias") if k in _DEFAULTS[model_type] and get(k)]
    if biases:
        raise ConfigError(f"config.json: {model_type} with {biases[0]} is not supported (no biases here)")
    if model_type.startswith("deepseek"):
        return _deepseek_args(cfg, model_type, get)
    dim, heads = get("hidden_size"), get("num_attention_heads")
    qwen3 = model_type in ("qwen3", "qwen3_moe")
    head_dim = get("head_dim") or dim // heads  # null: derived (Llama's, Mixtral's __post_init__)
    if qwen3 and get("use_sliding_window"):
        raise ConfigError("config.json: Qwen3 with use_sliding_window is not supported")
    kind, scaling, theta = _rope(cfg, model_type, ("default", "llama3"))
    rope_scaling = None
    if kind == "llama3":
        rope_scaling = RopeScaling(scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"],
                                   scaling.get("original_max_position_embeddings",
                                               get("max_position_embeddings")))
    moe = {}
    if model_type == "mixtral":
        if get("sliding_window") is not None:
            raise ConfigError("config.json: sliding-window attention (sliding_window) is not supported")
        # Every block has experts of intermediate_size; top-k renormalised, dropless (Mixtral).
        moe = dict(num_experts=get("num_experts"), top_k=get("num_experts_per_tok"),
                   moe_hidden_dim=get("intermediate_size"), aux_loss_weight=get("router_aux_loss_coef"))
    if model_type == "qwen3_moe":
        # Experts of moe_intermediate_size in every decoder_sparse_step-th block, dense blocks of
        # intermediate_size between; our router renormalises its top-k (norm_topk_prob).
        if not get("norm_topk_prob") or get("mlp_only_layers"):
            raise ConfigError("config.json: Qwen3-MoE without norm_topk_prob, or with mlp_only_layers, "
                              "is not supported")
        moe = dict(num_experts=get("num_experts"), top_k=get("num_experts_per_tok"),
                   moe_hidden_dim=get("moe_intermediate_size"), moe_every=get("decoder_sparse_step"),
                   aux_loss_weight=get("router_aux_loss_coef"))
    kv_heads = get("num_key_value_heads")
    # The FFN size is given directly (ffn_dim): any intermediate_size, not only Llama's 8/3 rule's.
    return ModelArgs(dim=dim, n_layers=get("num_hidden_layers"), n_heads=heads,
                     n_kv_heads=heads if kv_heads is None else kv_heads, vocab_size=get("vocab_size"),
                     ffn_dim=get("intermediate_size"), norm_eps=get("rms_norm_eps"), rope_theta=theta,
                     rope_scaling=rope_scaling,
                     max_seq_len=get("max_position_embeddings"),  # and context_len
                     qk_norm=qwen3, head_dim_override=head_dim if head_dim != dim // heads else None,
                     tie_embeddings=bool(get("tie_word_embeddings")), **moe)


def _gemma3_args(cfg: dict) -> ModelArgs:
    """Gemma 3's text model (Gemma3ForCausalLM's config, or a multimodal folder's text_config): every
    p-th block global, the global blocks' RoPE default or linearly scaled, the local ones' default."""
    get = _getter(cfg, "gemma3_text")
    unsupported = [k for k, ok in (("hidden_activation", "gelu_pytorch_tanh"), ("attention_bias", False),
                                   ("attn_logit_softcapping", None), ("final_logit_softcapping", None))
                   if get(k) != ok]
    if cfg.get("use_bidirectional_attention"):
        unsupported.append("use_bidirectional_attention")
    layers, dim, heads = get("num_hidden_layers"), get("hidden_size"), get("num_attention_heads")
    every = _global_every(cfg, layers, cfg.get("sliding_window_pattern", 6))
    if every is None:
        unsupported.append("layer_types")
    kinds = cfg.get("rope_parameters") or {}
    full, local = dict(kinds.get("full_attention") or {}), dict(kinds.get("sliding_attention") or {})
    full.update(cfg.get("rope_scaling") or {})
    if full.get("rope_type", full.get("type", "default")) not in ("default", "linear") or \
            local.get("rope_type", "default") != "default":
        unsupported.append("rope_parameters")
    if unsupported:
        raise ConfigError(f"config.json: Gemma 3 with this {unsupported[0]} ({cfg.get(unsupported[0])!r}) "
                          f"is not supported")
    head_dim, scalar = get("head_dim"), get("query_pre_attn_scalar")
    return ModelArgs(dim=dim, n_layers=layers, n_heads=heads, n_kv_heads=get("num_key_value_heads"),
                     vocab_size=get("vocab_size"), ffn_dim=get("intermediate_size"),
                     norm_eps=get("rms_norm_eps"),
                     head_dim_override=head_dim if head_dim != dim // heads else None, qk_norm=True,
                     rope_theta=float(full.get("rope_theta", cfg.get("rope_theta", 1e6))),
                     rope_local_theta=float(local.get("rope_theta", cfg.get("rope_local_base_freq", 1e4))),
                     rope_linear_factor=float(full.get("factor", 1.0)),
                     max_seq_len=get("max_position_embeddings"),
                     tie_embeddings=bool(get("tie_word_embeddings")), sliding_window=get("sliding_window"),
                     sliding_window_pattern=every, norm_offset=1.0, sandwich_norm=True, ffn_act="gelu_tanh",
                     embed_scale=True, query_pre_attn_scalar=None if scalar == head_dim else scalar)


def _global_every(cfg: dict, layers: int, pattern: int) -> int | None:
    """Every how many blocks one is global (sliding_window_pattern: 0 none) by `layer_types`
    (absent: every `pattern`-th, transformers' default); None when the list is not so regular."""
    types = cfg.get("layer_types") or ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention"
                                       for i in range(layers)]
    every = types.index("full_attention") + 1 if "full_attention" in types else 0
    regular = ["full_attention" if every and (i + 1) % every == 0 else "sliding_attention"
               for i in range(layers)]
    return every if types == regular else None


def _gpt_oss_args(cfg: dict) -> ModelArgs:
    """GptOssForCausalLM's config: biased attention with sinks, every block's experts biased with the
    clamped SwiGLU, top-k softmax routing, YaRN or plain RoPE, local blocks by layer_types. Its
    published MXFP4 expert weights are dequantized on reading (state_dict_adapter.py)."""
    get = _getter(cfg, "gpt_oss")
    layers = get("num_hidden_layers")
    unsupported = [(k, get(k), f"only {ok}") for k, ok in (("swiglu_alpha", 1.702), ("swiglu_limit", 7.0))
                   if get(k) != ok]
    every = _global_every(cfg, layers, 2)
    if every is None:
        unsupported.append(("layer_types", cfg["layer_types"], "only every p-th block full_attention, the "
                            "others sliding_attention"))
    quantization = cfg.get("quantization_config") or {}
    if quantization and quantization.get("quant_method") != "mxfp4":
        unsupported.append(("quantization_config", quantization, "only unquantized or mxfp4"))
    kind, scaling, theta = _rope(cfg, "gpt_oss", ("default", "yarn"))
    if cfg.get("rope_scaling") is None and cfg.get("rope_parameters") is None:  # GptOssConfig's default
        kind, scaling = "yarn", {"factor": 32.0, "original_max_position_embeddings": 4096, "truncate": False}
    if any(scaling.get(k) for k in ("mscale", "mscale_all_dim", "attention_factor")):
        key = "rope_scaling" if cfg.get("rope_scaling") else "rope_parameters"
        unsupported.append((key, scaling, "only YaRN without mscale, mscale_all_dim or attention_factor"))
    if unsupported:
        key, value, expected = unsupported[0]
        raise ConfigError(f"config.json: gpt-oss with this {key} ({value!r}) is not supported ({expected})")
    yarn = None
    if kind == "yarn":  # cos and sin scaled by 0.1 ln(factor) + 1: mscale(1) over mscale(0)
        yarn = Yarn(factor=scaling["factor"], original_max_position_embeddings=scaling.get(
                        "original_max_position_embeddings", 4096), beta_fast=scaling.get("beta_fast") or 32.0,
                    beta_slow=scaling.get("beta_slow") or 1.0, mscale=1.0, mscale_all_dim=0.0,
                    truncate=scaling.get("truncate", True))
    dim, heads = get("hidden_size"), get("num_attention_heads")
    experts = get("intermediate_size")  # every block's (no dense FFN)
    return ModelArgs(dim=dim, n_layers=layers, n_heads=heads, n_kv_heads=get("num_key_value_heads"),
                     vocab_size=get("vocab_size"), head_dim_override=get("head_dim"), ffn_dim=experts,
                     norm_eps=get("rms_norm_eps"), rope_theta=theta, yarn=yarn,
                     max_seq_len=get("max_position_embeddings"),
                     tie_embeddings=bool(get("tie_word_embeddings")), num_experts=get("num_experts"),
                     top_k=get("num_experts_per_tok"), moe_hidden_dim=experts,
                     aux_loss_weight=get("router_aux_loss_coef"), ffn_act="swiglu_clamp",
                     attn_bias=bool(get("attention_bias")), attn_sinks=True, moe_bias=True,
                     sliding_window=get("sliding_window") or 0, sliding_window_pattern=every)


def _deepseek_args(cfg: dict, model_type: str, get) -> ModelArgs:
    """DeepSeek-V3's config.json (and Moonlight's, the same architecture), or DeepSeek-V2's: its
    router must be one moe.py has (V3: sigmoid, bias, renormalised top-k; V2: softmax, top-k not
    renormalised, transformers' greedy or group-limited greedy), every block after the dense ones.
    Keys transformers 5 no longer has (scoring_func, topk_method for V3, moe_layer_freq) are checked
    where older files carry them."""
    v3 = model_type == "deepseek_v3"

    def value(key: str, ok=None):  # a key of transformers 5's class, else an older file's (or ok)
        return get(key) if key in _DEFAULTS[model_type] else cfg.get(key, ok)

    required = ((("scoring_func", "sigmoid"), ("topk_method", "noaux_tc"), ("norm_topk_prob", True),
                 ("rope_interleave", True)) if v3 else
                (("scoring_func", "softmax"), ("norm_topk_prob", False))) + (("moe_layer_freq", 1),)
    unsupported = [k for k, ok in required if value(k, ok) != ok]
    if not v3 and get("topk_method") not in ("greedy", "group_limited_greedy"):
        unsupported.append("topk_method")
    version = "V3" if v3 else "V2"
    kind, scaling, theta = _rope(cfg, model_type, ("default", "yarn"))
    mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
    if (bool(mscale) != bool(mscale_all_dim) or scaling.get("attention_factor")
            or scaling.get("truncate", True) is False):
        unsupported.append("rope_scaling")
    if unsupported:
        key = unsupported[0]
        there = scaling if key == "rope_scaling" else value(key)
        raise ConfigError(f"config.json: DeepSeek-{version} with this {key} ({there!r}) is not supported")
    yarn = None
    if kind == "yarn":  # without mscale / mscale_all_dim: cos and sin scaled by mscale(1), not the softmax
        original = scaling.get("original_max_position_embeddings") or get("max_position_embeddings")
        # No factor: transformers takes the ratio of the context to the pre-training one.
        yarn = Yarn(factor=scaling.get("factor") or get("max_position_embeddings") / original,
                    original_max_position_embeddings=original,
                    beta_fast=scaling.get("beta_fast") or 32.0, beta_slow=scaling.get("beta_slow") or 1.0,
                    mscale=mscale or 1.0, mscale_all_dim=mscale_all_dim or 0.0)
    dim, experts = get("hidden_size"), get("num_experts") or 0  # null: dense blocks only
    top_k = get("num_experts_per_tok")
    if experts and top_k is None:
        raise ConfigError(f"config.json: DeepSeek-{version} with experts needs num_experts_per_tok")
    grouped = v3 or get("topk_method") == "group_limited_greedy"  # V2's greedy ignores n_group
    moe = dict(num_experts=experts, top_k=top_k or 1, moe_hidden_dim=get("moe_intermediate_size"),
               router="sigmoid" if v3 else "softmax", norm_topk=v3,
               aux_loss_weight=cfg.get("aux_loss_alpha", 0.0) if experts else 0.0,
               expert_groups=get("n_group") or 1 if grouped else 1,
               topk_groups=get("topk_group") or 1 if grouped else 1,
               routed_scaling=get("routed_scaling_factor"),
               shared_experts=get("n_shared_experts") or 0,
               dense_layers=get("first_k_dense_replace") or 0)
    mla = dict(kv_lora_rank=get("kv_lora_rank"), q_lora_rank=get("q_lora_rank") or 0,
               qk_nope_head_dim=get("qk_nope_head_dim"), qk_rope_head_dim=get("qk_rope_head_dim"),
               v_head_dim=get("v_head_dim"), yarn=yarn)
    return ModelArgs(dim=dim, n_layers=get("num_hidden_layers"), n_heads=get("num_attention_heads"),
                     vocab_size=get("vocab_size"), ffn_dim=get("intermediate_size"),
                     norm_eps=get("rms_norm_eps"), rope_theta=theta,
                     max_seq_len=get("max_position_embeddings"),
                     tie_embeddings=bool(get("tie_word_embeddings")), **moe, **mla)
