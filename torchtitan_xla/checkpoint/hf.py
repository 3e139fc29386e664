"""HuggingFace interop: export to a folder `transformers` loads whole (`model.safetensors` +
`config.json` for `LlamaForCausalLM`, `MixtralForCausalLM`, Qwen3's, DeepSeek-V2's / V3's, and the
tokenizer for `AutoTokenizer`), LoRA adapters as a folder `peft` loads, and import the same HF
weights as initial weights.

Names and the RoPE q/k layout are converted by models/llama/state_dict_adapter.py; this module does
the file I/O and moves whole tensors between host memory and the (sharded) device parameters, one
parameter at a time so only one full tensor is ever on the host.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import torch

from torchtitan_xla import runtime, storage
from torchtitan_xla.errors import ConfigError
from torchtitan_xla.lora import is_adapter, merge
from torchtitan_xla.models.llama.args import ModelArgs, RopeScaling, Yarn, ffn_sizing
from torchtitan_xla.models.llama.state_dict_adapter import from_hf, hf_config, to_hf

SAFETENSORS_INDEX = "model.safetensors.index.json"
PEFT_WEIGHTS, PEFT_CONFIG = "adapter_model.safetensors", "adapter_config.json"


def model_args_to_json(args: ModelArgs) -> str:
    return json.dumps(dataclasses.asdict(args), indent=1)


def model_args_from_json(text: str) -> ModelArgs:
    d = json.loads(text)
    if d.get("rope_scaling"):
        d["rope_scaling"] = RopeScaling(**d["rope_scaling"])
    if d.get("yarn"):
        d["yarn"] = Yarn(**d["yarn"])
    return ModelArgs(**d)


def model_args_from_hf_config(cfg: dict) -> ModelArgs:
    """ModelArgs computing what `LlamaForCausalLM` (or `MixtralForCausalLM`, `Qwen3ForCausalLM`,
    `Qwen3MoeForCausalLM`, `DeepseekV3ForCausalLM`) with this config computes."""
    if cfg.get("model_type") in ("deepseek_v2", "deepseek_v3"):
        return _deepseek_args(cfg)
    dim, heads = cfg["hidden_size"], cfg["num_attention_heads"]
    qwen3 = cfg.get("model_type") in ("qwen3", "qwen3_moe")
    head_dim = cfg.get("head_dim") or dim // heads  # transformers 5 writes null for "derived"
    if head_dim != dim // heads and not qwen3:
        raise ConfigError("config.json: head_dim != hidden_size / num_attention_heads is not supported")
    if qwen3 and (cfg.get("attention_bias") or cfg.get("use_sliding_window")):
        raise ConfigError("config.json: Qwen3 with attention_bias or use_sliding_window is not supported")
    scaling = cfg.get("rope_scaling") or cfg.get("rope_parameters") or {}
    rope_scaling = None
    if scaling.get("rope_type", scaling.get("type")) == "llama3":
        rope_scaling = RopeScaling(scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"],
                                   scaling["original_max_position_embeddings"])
    moe, multiplier = {}, None
    if cfg.get("model_type") == "mixtral":
        if cfg.get("sliding_window") is not None:
            raise ConfigError("config.json: sliding-window attention (sliding_window) is not supported")
        # Every block has experts of intermediate_size; top-k renormalised, dropless (Mixtral).
        # (router_aux_loss_coef: transformers' default when the config leaves it out.)
        moe = dict(num_experts=cfg.get("num_local_experts", 8), top_k=cfg.get("num_experts_per_tok", 2),
                   moe_hidden_dim=cfg["intermediate_size"],
                   aux_loss_weight=cfg.get("router_aux_loss_coef", 0.001))
        # The dense FFN size (unused: every block has experts) is made intermediate_size as well.
        multiplier = ffn_sizing(dim, cfg["intermediate_size"])["ffn_dim_multiplier"]
    if cfg.get("model_type") == "qwen3_moe":
        # Experts of moe_intermediate_size in every decoder_sparse_step-th block, dense blocks of
        # intermediate_size between; our router renormalises its top-k (norm_topk_prob).
        if not cfg.get("norm_topk_prob") or cfg.get("mlp_only_layers"):
            raise ConfigError("config.json: Qwen3-MoE without norm_topk_prob, or with mlp_only_layers, "
                              "is not supported")
        moe = dict(num_experts=cfg.get("num_experts", 128), top_k=cfg.get("num_experts_per_tok", 8),
                   moe_hidden_dim=cfg["moe_intermediate_size"], moe_every=cfg.get("decoder_sparse_step", 1),
                   aux_loss_weight=cfg.get("router_aux_loss_coef", 0.001))
    # transformers' default rope_theta: Mixtral's when the config leaves it out.
    theta = cfg.get("rope_theta", scaling.get("rope_theta", 1e6 if moe else 10000.0))
    # The FFN size is given directly; pick multiple_of so that ModelArgs reproduces it exactly.
    return ModelArgs(dim=dim, n_layers=cfg["num_hidden_layers"], n_heads=heads,
                     n_kv_heads=cfg.get("num_key_value_heads", heads), vocab_size=cfg["vocab_size"],
                     multiple_of=cfg["intermediate_size"], ffn_dim_multiplier=multiplier,
                     norm_eps=cfg["rms_norm_eps"], rope_theta=theta, rope_scaling=rope_scaling,
                     max_seq_len=cfg.get("max_position_embeddings", 2048),  # and context_len
                     qk_norm=qwen3, head_dim_override=head_dim if head_dim != dim // heads else None,
                     tie_embeddings=bool(cfg.get("tie_word_embeddings")), **moe)


def _deepseek_args(cfg: dict) -> ModelArgs:
    """DeepSeek-V3's config.json (and Moonlight's, the same architecture), or DeepSeek-V2's: its
    router must be one moe.py has (V3: sigmoid, bias, renormalised top-k; V2: softmax, top-k not
    renormalised, transformers' greedy or group-limited greedy), every block after the dense ones."""
    v3 = cfg["model_type"] == "deepseek_v3"
    required = ((("scoring_func", "sigmoid"), ("topk_method", "noaux_tc"), ("norm_topk_prob", True),
                 ("rope_interleave", True)) if v3 else
                (("scoring_func", "softmax"), ("norm_topk_prob", False))) + (
        ("moe_layer_freq", 1), ("attention_bias", False))
    unsupported = [k for k, ok in required if cfg.get(k, ok) != ok]
    if not v3 and cfg.get("topk_method", "greedy") not in ("greedy", "group_limited_greedy"):
        unsupported.append("topk_method")
    version = "V3" if v3 else "V2"
    scaling = cfg.get("rope_scaling") or cfg.get("rope_parameters") or {}
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
    if (kind not in ("default", "yarn") or bool(mscale) != bool(mscale_all_dim)
            or scaling.get("attention_factor")):
        unsupported.append("rope_scaling")
    if unsupported:
        raise ConfigError(f"config.json: DeepSeek-{version} with this {unsupported[0]} "
                          f"({cfg.get(unsupported[0])!r}) is not supported")
    yarn = None
    if kind == "yarn":  # without mscale / mscale_all_dim: cos and sin scaled by mscale(1), not the softmax
        yarn = Yarn(factor=scaling["factor"],
                    original_max_position_embeddings=scaling["original_max_position_embeddings"],
                    beta_fast=scaling.get("beta_fast") or 32.0, beta_slow=scaling.get("beta_slow") or 1.0,
                    mscale=mscale or 1.0, mscale_all_dim=mscale_all_dim or 0.0)
    dim, experts = cfg["hidden_size"], cfg.get("n_routed_experts") or 0
    grouped = v3 or cfg.get("topk_method") == "group_limited_greedy"  # V2's greedy ignores n_group
    moe = dict(num_experts=experts, top_k=cfg.get("num_experts_per_tok", 8),
               moe_hidden_dim=cfg["moe_intermediate_size"], router="sigmoid" if v3 else "softmax",
               norm_topk=v3,
               aux_loss_weight=cfg.get("aux_loss_alpha", 0.0) if experts else 0.0,
               expert_groups=cfg.get("n_group") or 1 if grouped else 1,
               topk_groups=cfg.get("topk_group") or 1 if grouped else 1,
               routed_scaling=cfg.get("routed_scaling_factor", 1.0),
               shared_experts=cfg.get("n_shared_experts") or 0,
               dense_layers=cfg.get("first_k_dense_replace") or 0)
    mla = dict(kv_lora_rank=cfg["kv_lora_rank"], q_lora_rank=cfg.get("q_lora_rank") or 0,
               qk_nope_head_dim=cfg["qk_nope_head_dim"], qk_rope_head_dim=cfg["qk_rope_head_dim"],
               v_head_dim=cfg["v_head_dim"], yarn=yarn)
    return ModelArgs(dim=dim, n_layers=cfg["num_hidden_layers"], n_heads=cfg["num_attention_heads"],
                     vocab_size=cfg["vocab_size"], **ffn_sizing(dim, cfg["intermediate_size"]),
                     norm_eps=cfg["rms_norm_eps"],
                     rope_theta=cfg.get("rope_theta", scaling.get("rope_theta", 10000.0)),
                     max_seq_len=cfg.get("max_position_embeddings", 4096),
                     tie_embeddings=bool(cfg.get("tie_word_embeddings")), **moe, **mla)


# What decides what a checkpoint's weights compute, by our name and config.json's.
_ARCHITECTURE = (("dim", "hidden_size"), ("n_layers", "num_hidden_layers"),
                 ("n_heads", "num_attention_heads"), ("kv_heads", "num_key_value_heads"),
                 ("head_dim", "head_dim"), ("qk_norm", "query/key norms"),
                 ("tie_embeddings", "tie_word_embeddings"), ("num_experts", "experts"),
                 ("top_k", "num_experts_per_tok"), ("expert_hidden_dim", "the experts' size"),
                 ("moe_every", "decoder_sparse_step"), ("ffn_hidden_dim", "intermediate_size"),
                 ("norm_eps", "rms_norm_eps"), ("rope_theta", "rope_theta"), ("rope_scaling", "rope_scaling"),
                 ("kv_lora_rank", "kv_lora_rank"), ("q_lora_rank", "q_lora_rank"),
                 ("qk_nope_head_dim", "qk_nope_head_dim"), ("qk_rope_head_dim", "qk_rope_head_dim"),
                 ("v_head_dim", "v_head_dim"), ("router", "scoring_func"),
                 ("norm_topk", "norm_topk_prob"), ("shared_experts", "n_shared_experts"),
                 ("dense_layers", "first_k_dense_replace"),
                 ("expert_groups", "n_group"), ("topk_groups", "topk_group"),
                 ("routed_scaling", "routed_scaling_factor"), ("yarn", "rope_scaling"))


def _architecture_difference(theirs: ModelArgs, ours: ModelArgs) -> tuple[str, object, object] | None:
    dense_blocks = any(not ours.is_moe_layer(i) for i in range(ours.n_layers))
    for field, hf_name in _ARCHITECTURE:
        if field == "ffn_hidden_dim" and not dense_blocks:
            continue  # unused: every block has experts
        if getattr(theirs, field) != getattr(ours, field):
            return hf_name, getattr(theirs, field), getattr(ours, field)
    return None


def match_initial_hf_weights(cfg, args: ModelArgs, model: str) -> ModelArgs:
    """A fine-tuning start from HF weights ([checkpoint] `cfg` with initial_load_in_hf) against the
    run's model `args` ("name flavor"), before anything is built: the run takes the weights'
    vocabulary (Qwen's embedding has rows past its tokenizer's ids), and any other difference in
    architecture is one line, naming the flavor the folder holds if it is one of ours."""
    path = Path(cfg.initial_load_path) / "config.json"
    if not cfg.initial_load_in_hf or storage.is_url(cfg.initial_load_path) or not path.is_file():
        return args  # a missing folder is reported where the weights are read
    try:
        theirs = model_args_from_hf_config(json.loads(path.read_text()))
    except (ConfigError, KeyError, ValueError) as e:  # "config.json: ...", a missing key, bad JSON
        why = str(e).removeprefix("config.json: ") if isinstance(e, ConfigError) else (
            f"no {e}: not a Llama, Mixtral, Qwen3 or DeepSeek config" if isinstance(e, KeyError)
            else f"not JSON ({e})")
        raise ConfigError(f"[checkpoint] initial_load_path: {path}: {why}") from None
    difference = _architecture_difference(theirs, args)
    if difference is None:
        return dataclasses.replace(args, vocab_size=theirs.vocab_size)
    from torchtitan_xla.models import models_config

    same = [f"{name} {flavor}" for name, flavors in models_config.items()
            for flavor, candidate in flavors.items() if _architecture_difference(theirs, candidate) is None]
    hint = f"; it holds {' or '.join(same)}: set [model] name and flavor to it" if same else ""
    key, there, here = difference
    raise ConfigError(f"[checkpoint] initial_load_path: {path} is not the run's model {model}: {key} {there} "
                      f"there, {here} here{hint}")


# ---- files ------------------------------------------------------------------------------------


def read_hf_state_dict(hf_dir: str | Path) -> dict[str, torch.Tensor]:
    """All tensors of a HF checkpoint folder (one `model.safetensors` or an index of shards)."""
    from safetensors.torch import load_file

    hf_dir = Path(hf_dir)
    index = hf_dir / SAFETENSORS_INDEX
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    elif (hf_dir / "model.safetensors").is_file():
        files = ["model.safetensors"]
    else:
        raise ConfigError(f"[checkpoint] initial_load_path: no model.safetensors or {SAFETENSORS_INDEX} "
                          f"in {hf_dir}")
    out: dict[str, torch.Tensor] = {}
    for name in files:
        out.update(load_file(str(hf_dir / name)))
    return out


def write_hf(tensors: dict[str, torch.Tensor], config: dict, out_dir: str | Path,
             max_shard_bytes: int = 5 * 2**30) -> None:
    """safetensors files of at most `max_shard_bytes` (with an index when there are several)."""
    from safetensors.torch import save_file

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t.contiguous()
        size += nbytes
    if len(shards) == 1:
        save_file(shards[0], str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    else:
        weight_map = {}
        for i, shard in enumerate(shards, 1):
            fname = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
            save_file(shard, str(out_dir / fname), metadata={"format": "pt"})
            weight_map.update({k: fname for k in shard})
        total = sum(t.numel() * t.element_size() for t in tensors.values())
        (out_dir / SAFETENSORS_INDEX).write_text(json.dumps(
            {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1))
    (out_dir / "config.json").write_text(json.dumps(config, indent=1))


# ---- between host tensors and the model --------------------------------------------------------


def gather_state_dict(model: torch.nn.Module, dtype: torch.dtype | None = None, *,
                      keep: bool = True) -> dict[str, torch.Tensor]:
    """Full host copies of the model's parameters (each one gathered from its shards, one at a
    time). With a process per device every process takes part in each gather; those with `keep`
    false drop the copies (only the writer needs them)."""
    out = {}
    for name, t in model.state_dict().items():
        (t,) = runtime.whole([t.detach()])
        if keep:
            t = t.cpu()
            out[name] = t.to(dtype) if dtype is not None else t
    return out


def export_hf(state_dict: dict[str, torch.Tensor], args: ModelArgs, out_dir: str | Path, *,
              dtype: torch.dtype = torch.float32, tokenizer=None, lora: dict | None = None) -> None:
    """Weights and config.json; with `tokenizer`, also its HF files and its BOS/EOS ids. A model
    with LoRA adapters (`lora`: the [lora] section as a dict) is exported merged, W + (alpha/r) B A.
    A mixture-of-experts model is written as Mixtral, with its training's aux_loss_weight as
    router_aux_loss_coef (only experts in every block have a HuggingFace architecture: hf_config
    raises otherwise). All but the token ids and the dtype come from `args` (hf_config)."""
    # The config first: a model transformers has no architecture for fails before any conversion.
    bos, eos = (tokenizer.bos_id, tokenizer.eos_id) if tokenizer is not None else (None, None)
    config = hf_config(args, bos_id=bos, eos_id=eos, dtype=str(dtype).removeprefix("torch."))
    if lora is not None:
        state_dict = merge(state_dict, lora["alpha"])
    elif any(is_adapter(k) for k in state_dict):
        raise ValueError("the weights hold LoRA adapters: export_hf needs their [lora] settings")
    tensors = {k: v.to(dtype) for k, v in to_hf(state_dict, args).items()}
    write_hf(tensors, config, out_dir)
    if tokenizer is not None:
        tokenizer.save_pretrained(out_dir)


def base_model_reference(base_model: str | Path | None) -> str | None:
    """adapter_config.json's base_model_name_or_path for the base weights `base_model`: a local
    folder by its absolute path (peft resolves it from any working directory), a URL or a hub id as
    given; None when there is no HF base (a run that did not start from an HF folder)."""
    if not base_model:
        return None
    base_model = str(base_model)
    if storage.is_url(base_model) or not os.path.isdir(base_model):  # not a folder here: a hub id
        return base_model
    return os.path.abspath(base_model)


def export_peft(state_dict: dict[str, torch.Tensor], args: ModelArgs, lora: dict, out_dir: str | Path,
                *, dtype: torch.dtype = torch.float32, base_model: str | Path | None = None) -> None:
    """The LoRA adapters of `state_dict` as a PEFT adapter folder, which
    `peft.PeftModel.from_pretrained(<the base LlamaForCausalLM>, out_dir)` loads, and with
    `base_model` (the HF folder the base weights came from) `AutoPeftModelForCausalLM
    .from_pretrained(out_dir)` alone: the adapters under HF module names in
    adapter_model.safetensors, and adapter_config.json. The config is written here, not by peft's
    LoraConfig: peft is not a dependency of training (the tests load the folder with peft)."""
    from safetensors.torch import save_file

    adapters = to_hf({k: v for k, v in state_dict.items() if is_adapter(k)}, args)
    tensors = {f"base_model.model.{k}": v.to(dtype).contiguous() for k, v in adapters.items()}
    modules = sorted({k.split(".")[-3] for k in adapters})  # ...self_attn.q_proj.lora_A.weight
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / PEFT_WEIGHTS), metadata={"format": "pt"})
    config = {
        "peft_type": "LORA", "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model_reference(base_model),
        "r": lora["rank"], "lora_alpha": lora["alpha"], "lora_dropout": lora["dropout"],
        "target_modules": modules, "bias": "none", "fan_in_fan_out": False, "use_rslora": False,
        "use_dora": False, "init_lora_weights": True, "modules_to_save": None, "inference_mode": True,
    }
    (out / PEFT_CONFIG).write_text(json.dumps(config, indent=1))


@torch.no_grad()
def load_into_model(model: torch.nn.Module, state_dict: dict[str, torch.Tensor], mesh, *,
                    source: str) -> None:
    """Copy full host tensors into the model's parameters and saved buffers (DeepSeek's expert
    bias), keeping each one's sharding. LoRA adapters keep their initial values (a base model has
    none)."""
    from torchtitan_xla.parallelisms.parallelize_llama import partition_spec

    params = {k: p for k, p in model.state_dict(keep_vars=True).items() if not is_adapter(k)}
    missing = sorted(set(params) - set(state_dict))
    unexpected = sorted(set(state_dict) - set(params))
    if missing or unexpected:
        raise ConfigError(f"{source}: weights do not match the model (missing: {missing[:3]}, "
                          f"unexpected: {unexpected[:3]})")
    for name, param in params.items():
        full = state_dict[name]
        if tuple(full.shape) != tuple(param.shape):
            raise ConfigError(f"{source}: {name} has shape {list(full.shape)}, the model expects "
                              f"{list(param.shape)} (check model.flavor and the tokenizer's vocabulary)")
        # Transfer, then shard before it is used: copying a host tensor straight into a sharded
        # parameter would leave the parameter replicated.
        t = full.to(device=param.device, dtype=param.dtype)
        param.copy_(runtime.place(t, mesh, partition_spec(param)))


def load_hf_into_model(model: torch.nn.Module, args: ModelArgs, hf_dir: str | Path, mesh) -> None:
    hf = read_hf_state_dict(hf_dir)
    try:
        ours = from_hf(hf, args)
    except KeyError as e:
        raise ConfigError(f"[checkpoint] initial_load_path: {hf_dir}: {e.args[0]}") from None
    load_into_model(model, ours, mesh, source=f"[checkpoint] initial_load_path {hf_dir}")
