"""HuggingFace interop: export to a folder `transformers` loads whole (`model.safetensors` +
`config.json` for `LlamaForCausalLM`, `MixtralForCausalLM`, Qwen3's, DeepSeek-V2's / V3's, and the
tokenizer for `AutoTokenizer`), LoRA adapters as a folder `peft` loads, and import the same HF
weights as initial weights.

Names and the RoPE q/k layout are converted by models/llama/state_dict_adapter.py, config.json is
read by models/llama/hf_args.py (without torch: config validation reads it); this module does
the file I/O and moves whole tensors between host memory and the (sharded) device parameters:
loaded one parameter at a time, gathered for an export GATHER_BYTES at a time.
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
from torchtitan_xla.models.llama.args import ModelArgs, RopeScaling, Yarn
from torchtitan_xla.models.llama.hf_args import model_args_from_hf_config  # noqa: F401  (torch-free)
from torchtitan_xla.models.llama.hf_config_json import hf_config
from torchtitan_xla.models.llama.hf_folder import match_initial_hf_weights  # noqa: F401
from torchtitan_xla.models.llama.state_dict_adapter import from_hf, to_hf

SAFETENSORS_INDEX = "model.safetensors.index.json"
PEFT_WEIGHTS, PEFT_CONFIG = "adapter_model.safetensors", "adapter_config.json"


def model_args_to_json(args: ModelArgs) -> str:
    return json.dumps(dataclasses.asdict(args), indent=1)


def model_args_from_json(text: str) -> ModelArgs:
    """model_args_to_json's text back; older files lack the newer fields (ffn_dim), which then keep
    their defaults."""
    d = json.loads(text)
    if d.get("rope_scaling"):
        d["rope_scaling"] = RopeScaling(**d["rope_scaling"])
    if d.get("yarn"):
        d["yarn"] = Yarn(**d["yarn"])
    return ModelArgs(**d)


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


# Tensors brought to the host together: one transfer, and on XLA one graph for those that are views
# (a pipeline's per-layer slices of its stacked weights: one compile each, 104 for the 8-block debug
# model, when taken one at a time), with at most this many bytes of them on the devices at once.
GATHER_BYTES = 1 << 28


def gather_state_dict(model: torch.nn.Module, dtype: torch.dtype | None = None, *,
                      keep: bool = True) -> dict[str, torch.Tensor]:
    """Full host copies of the model's parameters, each one gathered from its shards, GATHER_BYTES
    of them at a time. With a process per device every process takes part in each gather; those
    with `keep` false drop the copies (only the writer needs them)."""
    out, group, size = {}, {}, 0

    def take() -> None:
        if keep and group:
            for name, t in zip(group, runtime.to_host(list(group.values()))):
                out[name] = t.to(dtype) if dtype is not None else t
        group.clear()

    for name, t in model.state_dict().items():
        (group[name],) = runtime.whole([t.detach()])
        size += t.numel() * t.element_size()
        if size >= GATHER_BYTES:
            take()
            size = 0
    take()
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
                    source: str, described_by: str | None = None) -> None:
    """Copy full host tensors into the model's parameters and saved buffers (DeepSeek's expert
    bias), keeping each one's sharding. LoRA adapters keep their initial values (a base model has
    none). `described_by`: the file the model's shape was read from (config.json,
    model_args.json), which a shape that differs contradicts; None: the run's flavor set it."""
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
            rows_only = full.shape[1:] == param.shape[1:]
            why = (f"its {described_by} does not describe these weights" if described_by else
                   "check the tokenizer's vocabulary" if rows_only and name in _VOCAB_ROWS else
                   "check [model] flavor")
            raise ConfigError(f"{source}: {name} has shape {list(full.shape)}, the model expects "
                              f"{list(param.shape)} ({why})")
        # Transfer, then shard before it is used: copying a host tensor straight into a sharded
        # parameter would leave the parameter replicated.
        t = full.to(device=param.device, dtype=param.dtype)
        param.copy_(runtime.place(t, mesh, partition_spec(param)))


_VOCAB_ROWS = ("tok_embeddings.weight", "output.weight")  # a row per token id


def load_hf_into_model(model: torch.nn.Module, args: ModelArgs, hf_dir: str | Path, mesh, *,
                       where: str = "[checkpoint] initial_load_path") -> None:
    """The weights of an HF folder, whose config.json gave `args` (directly, or through a flavor
    match_initial_hf_weights found equal to it)."""
    hf = read_hf_state_dict(hf_dir)
    try:
        ours = from_hf(hf, args)
    except KeyError as e:
        raise ConfigError(f"{where}: {hf_dir}: {e.args[0]}") from None
    load_into_model(model, ours, mesh, source=f"{where}: {hf_dir}", described_by="config.json")
