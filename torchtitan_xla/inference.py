"""A trained model for scoring or generation (`python -m torchtitan_xla.eval`, `.generate`): the
weights of a checkpoint step or a HuggingFace folder, the model's shape from them (the step's
model_args.json or the folder's config.json), on the mesh of the job's config."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from torchtitan_xla.config import JobConfig
from torchtitan_xla.errors import ConfigError


def weights_folder(given: str, job_config: JobConfig, key: str) -> tuple[str | Path, bool]:
    """(the folder to load, whether it is a HuggingFace folder) for the config value `given` of
    `key` ("[eval] checkpoint"), checked before the runtime starts; empty: the newest committed
    checkpoint of the config's run."""
    from torchtitan_xla import storage
    from torchtitan_xla.checkpoint import commit

    if not given:
        folder = storage.join(job_config.job.dump_folder, job_config.checkpoint.folder)
        steps = commit.committed_steps(folder)
        if not steps:
            raise ConfigError(f"{key}: empty and no committed checkpoint in {folder}")
        return commit.step_folder(folder, steps[-1]), False
    if storage.is_url(given):  # a checkpoint step in a bucket (HF folders are read locally)
        try:
            commit.verify(given)
        except commit.DamagedCheckpoint as e:
            raise ConfigError(f"{key}: {given}: not a usable checkpoint step ({e})") from None
        return given, False
    path = Path(given)
    if not path.is_dir():
        raise ConfigError(f"{key}: {path}: no such folder")
    if (path / "config.json").is_file():
        return path, True
    try:
        commit.verify(str(path))
    except commit.DamagedCheckpoint as e:
        raise ConfigError(f"{key}: {path}: neither a HuggingFace folder (no config.json) "
                          f"nor a usable checkpoint step ({e})") from None
    return path, False


def hf_eos_ids(folder: str | Path) -> list[int]:
    """The ids transformers' `generate` stops at for a HuggingFace folder: generation_config.json's
    eos_token_id, else config.json's (an id or a list; Llama 3.1 Instruct's include <|eot_id|>)."""
    import json

    for name in ("generation_config.json", "config.json"):
        file = Path(folder) / name
        if file.is_file():
            eos = json.loads(file.read_text()).get("eos_token_id")
            if eos is not None:
                return [eos] if isinstance(eos, int) else list(eos)
    return []


def inference_config(job_config: JobConfig) -> JobConfig:
    """The config without what only training needs: no activation checkpointing and no scan over
    the layers (generation runs each block with its cache as it is)."""
    return dataclasses.replace(
        job_config, compile=dataclasses.replace(job_config.compile, scan_layers=False),
        activation_checkpoint=dataclasses.replace(job_config.activation_checkpoint, mode="none"))


@dataclasses.dataclass
class Loaded:
    model: object
    tokenizer: object
    mesh: object
    parallel_dims: object
    device: object


def load_model(job_config: JobConfig, path: str | Path, is_hf: bool, key: str, *,
               parallelize: bool = True, tokenizer=None, on: tuple | None = None,
               prepare=None) -> Loaded:
    """The model of `path` in eval mode on the config's mesh (a LoRA run's checkpoint merged), with
    the config's tokenizer (built here unless the caller has it); `max_seq_len` is [training]
    seq_len. `on`: (device, mesh, parallel_dims) the caller has made already (train.py);
    `prepare(model)` runs on the model before it is materialised (kernels, as train.py applies)."""
    import torch

    from torchtitan_xla import runtime
    from torchtitan_xla.checkpoint.commit import read_lora_settings, read_model_state
    from torchtitan_xla.checkpoint.hf import load_hf_into_model, load_into_model
    from torchtitan_xla.datasets import build_tokenizer, check_vocab_size
    from torchtitan_xla.lora import merge
    from torchtitan_xla.models import get_model_class
    from torchtitan_xla.models.llama.hf_folder import read_hf_config
    from torchtitan_xla.parallelisms import ParallelDims, parallelize_llama

    if is_hf:
        model_args = read_hf_config(Path(path) / "config.json", key)[1]
        state = None
    else:
        state, model_args = read_model_state(path)
        lora = read_lora_settings(path)
        if lora is not None:  # a LoRA run's checkpoint: the adapted model
            state = merge(state, lora["alpha"])
    model_args = dataclasses.replace(model_args, max_seq_len=job_config.training.seq_len)

    if on is None:
        device = runtime.init_devices()
        parallel_dims = ParallelDims.from_config(job_config.parallelism, runtime.device_count())
        mesh = parallel_dims.build_mesh(runtime.device_type())
    else:
        device, mesh, parallel_dims = on
    tokenizer = tokenizer or build_tokenizer(job_config.model.tokenizer_path, job_config.model.name)
    check_vocab_size(tokenizer, model_args.vocab_size)
    parallel_dims.check_model(model_args.n_heads, model_args.kv_heads, model_args.dim,
                              model_args.ffn_hidden_dim, model_args.num_experts, model_args.n_layers)
    with torch.device("meta"):
        model = get_model_class(job_config.model.name)(model_args)
    if prepare is not None:
        prepare(model)
    model.to_empty(device=device)
    if parallelize:
        parallelize_llama(model, mesh, parallel_dims, job_config)
    model.init_weights()
    if is_hf:
        load_hf_into_model(model, model_args, path, mesh, where=key)
    else:
        load_into_model(model, state, mesh, source=f"{key}: {path}", described_by="model_args.json")
    model.eval()
    runtime.materialise()  # the weights as a graph of their own, before any the caller compiles
    return Loaded(model, tokenizer, mesh, parallel_dims, device)
