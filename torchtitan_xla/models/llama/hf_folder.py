"""The run's model against the HuggingFace folder it starts from (`[checkpoint] initial_load_path`
with initial_load_in_hf): its config.json read as ModelArgs (hf_args.py), flavor "hf" resolved to it,
and any difference in architecture one line. Importable without torch."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path

from torchtitan_xla import storage
from torchtitan_xla.errors import ConfigError
from torchtitan_xla.models.llama.args import ModelArgs, models_config
from torchtitan_xla.models.llama.hf_args import FAMILIES, model_args_from_hf_config

# [model] flavor = "hf": the architecture of the HuggingFace folder the run starts from.
HF_FLAVOR = "hf"

@dataclass
class HFFlavorArgs(ModelArgs):
    """What get_model_args gives for flavor "hf": a stand-in until match_initial_hf_weights reads
    the folder's config.json, keeping the run's model name and its overrides (seq_len, [moe]) to
    apply to the folder's args then."""

    family: str = ""
    overrides: dict = field(default_factory=dict)


def read_hf_config(path: Path, where: str = "[checkpoint] initial_load_path") -> tuple[dict, ModelArgs]:
    """(config.json as a dict, its ModelArgs); any problem one ConfigError line naming the file."""
    try:
        cfg = json.loads(path.read_text())
        if not isinstance(cfg, dict):
            raise ValueError("not an object")
        return cfg, model_args_from_hf_config(cfg)
    except (ConfigError, KeyError, ValueError, TypeError) as e:  # "config.json: ...", bad JSON or values
        why = str(e).removeprefix("config.json: ") if isinstance(e, ConfigError) else (
            f"not JSON ({e})" if isinstance(e, json.JSONDecodeError) else f"unusable ({e})")
        raise ConfigError(f"{where}: {path}: {why}" if where else f"{path}: {why}") from None


def hf_folder_args(family: str, checkpoint, where: str = "[checkpoint] initial_load_path") -> ModelArgs:
    """Flavor "hf": the ModelArgs of the config.json in `checkpoint` ([checkpoint] section)'s
    initial_load_path, which must be an HF folder of the family `family` ([model] name)."""
    if not (checkpoint.initial_load_in_hf and checkpoint.initial_load_path):
        raise ConfigError('[model] flavor = "hf" takes the architecture of the HuggingFace folder the '
                          'run starts from: set [checkpoint] initial_load_path to it and initial_load_in_hf '
                          '= true')
    if storage.is_url(checkpoint.initial_load_path):
        raise ConfigError(f"{where}: {checkpoint.initial_load_path}: HuggingFace weights are read from a "
                          f"local folder; copy them to one first")
    path = Path(checkpoint.initial_load_path) / "config.json"
    if not path.is_file():
        raise ConfigError(f'{where}: no such file {path} ([model] flavor = "hf" reads the architecture '
                          f'from it)')
    cfg, args = read_hf_config(path, where)
    model_type = cfg.get("model_type", "llama")
    if model_type not in FAMILIES.get(family, ()):
        names = " or ".join(name for name, types in FAMILIES.items() if model_type in types)
        raise ConfigError(f"{where}: {path} holds a {model_type} model, and the run's [model] name is "
                          f"{family}: set [model] name = {names} (flavor hf takes the folder's architecture, "
                          f"within the family of [model] name)")
    return args


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
                 ("routed_scaling", "routed_scaling_factor"), ("yarn", "rope_scaling"),
                 ("windows", "layer_types"),
                 ("sandwich_norm", "model_type"), ("ffn_act", "hidden_activation"),
                 ("attn_bias", "attention_bias"), ("attn_sinks", "model_type"), ("moe_bias", "model_type"),
                 ("query_pre_attn_scalar", "query_pre_attn_scalar"),
                 ("rope_local_theta", "rope_local_base_freq"), ("rope_linear_factor", "rope_scaling"))


def architecture_difference(theirs: ModelArgs, ours: ModelArgs) -> tuple[str, object, object] | None:
    """The first (config.json key, their value, ours) that makes the two compute differently."""
    dense_blocks = any(not ours.is_moe_layer(i) for i in range(ours.n_layers))
    for name, hf_name in _ARCHITECTURE:
        if name == "ffn_hidden_dim" and not dense_blocks:
            continue  # unused: every block has experts
        if getattr(theirs, name) != getattr(ours, name):
            return hf_name, getattr(theirs, name), getattr(ours, name)
    return None


def match_initial_hf_weights(cfg, args: ModelArgs, model: str) -> ModelArgs:
    """A fine-tuning start from HF weights ([checkpoint] `cfg` with initial_load_in_hf) against the
    run's model `args` ("name flavor"), before anything is built: the run takes the weights'
    vocabulary (Qwen's embedding has rows past its tokenizer's ids), and any other difference in
    architecture is one line, naming the flavor the folder holds if it is one of ours, else flavor
    "hf". With flavor "hf" (`args` an HFFlavorArgs) the run's args are the folder's, with the run's
    overrides (max_seq_len, [moe] capacity and loss weight) applied."""
    if isinstance(args, HFFlavorArgs):
        theirs = hf_folder_args(args.family, cfg)
        overrides = {k: v for k, v in args.overrides.items() if k != "vocab_size"}
        try:
            ours = dataclasses.replace(theirs, **overrides)
        except (TypeError, ValueError) as e:
            raise ConfigError(f"[model] flavor = \"hf\": the run's settings do not fit "
                              f"{cfg.initial_load_path}: {e}") from None
        difference = architecture_difference(theirs, ours)
        if difference is not None:
            key, there, here = difference
            raise ConfigError(f"[checkpoint] initial_load_path: {cfg.initial_load_path} has {key} {there}, "
                              f"the run's settings make it {here} ([model] flavor = \"hf\" takes the "
                              f"folder's architecture: leave [moe] num_experts, top_k, moe_every unset)")
        return ours
    path = Path(cfg.initial_load_path) / "config.json"
    if not cfg.initial_load_in_hf or storage.is_url(cfg.initial_load_path) or not path.is_file():
        return args  # a missing folder is reported where the weights are read
    hf, theirs = read_hf_config(path)
    difference = architecture_difference(theirs, args)
    if difference is None:
        return dataclasses.replace(args, vocab_size=theirs.vocab_size)
    same = [f"{name} {flavor}" for name, flavors in models_config.items()
            for flavor, candidate in flavors.items() if architecture_difference(theirs, candidate) is None]
    if same:
        hint = f"; it holds {' or '.join(same)}: set [model] name and flavor to it"
    else:
        family = model.split()[0] if model else ""
        names = [name for name, types in FAMILIES.items() if hf.get("model_type", "llama") in types]
        hint = ('; no flavor of ours has its architecture: set [model] flavor = "hf" to take it'
                + ("" if family in names or not names else f" (with [model] name = {' or '.join(names)})"))
    key, there, here = difference
    raise ConfigError(f"[checkpoint] initial_load_path: {path} is not the run's model {model}: {key} {there} "
                      f"there, {here} here{hint}")
