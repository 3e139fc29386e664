"""A fine-tuning start: `[checkpoint] initial_load_path`, checked when the run starts and read
when it does not resume: HuggingFace weights (hf.py), or a checkpoint step of this project or of
torchtitan (torchtitan.py). Only the weights; LoRA adapters keep their initial values."""

from __future__ import annotations

import torch

from torchtitan_xla import runtime, storage
from torchtitan_xla.checkpoint import commit, torchtitan
from torchtitan_xla.checkpoint.commit import DamagedCheckpoint
from torchtitan_xla.checkpoint.manager import dcp_load
from torchtitan_xla.errors import ConfigError
from torchtitan_xla.logging import logger
from torchtitan_xla.lora import is_adapter


def check_initial_load_path(cfg) -> None:
    """`[checkpoint] initial_load_path` (of the [checkpoint] section `cfg`), at start: also when
    the run resumes from its own checkpoint and will not read it, where a typo would otherwise
    surface only at the next fresh start."""
    path = cfg.initial_load_path
    if not path:
        return
    if cfg.initial_load_in_hf and storage.is_url(path):
        raise ConfigError(f"[checkpoint] initial_load_path: {path}: HuggingFace weights are read "
                          f"from a local folder; copy them to one first")
    if not storage.isdir(path):
        raise ConfigError(f"[checkpoint] initial_load_path: not a folder: {path}")


def load_initial_weights(cfg, model: torch.nn.Module, model_args, mesh, process_group=None) -> None:
    """The weights at `cfg.initial_load_path` into `model` (sharded on `mesh`)."""
    from torch.distributed.checkpoint.api import CheckpointException

    from torchtitan_xla.checkpoint.hf import load_hf_into_model

    path = cfg.initial_load_path
    titan = None
    if cfg.initial_load_in_hf:
        load_hf_into_model(model, model_args, path, mesh)
    else:
        if commit.read_lora_settings(path) is not None:
            raise ConfigError(f"[checkpoint] initial_load_path: {path} holds LoRA adapters; start "
                              f"from its merged weights instead (scripts/convert_to_hf.py, then "
                              f"initial_load_in_hf = true), or resume it as a checkpoint")
        # LoRA adapters keep their initial values: the base checkpoint has none.
        base = {k: v for k, v in model.state_dict(keep_vars=True).items() if not is_adapter(k)}
        # torchtitan's step folder: its key of each tensor (None: a checkpoint of this project).
        titan = torchtitan.model_keys(path, {k: tuple(v.shape) for k, v in base.items()})
        runtime.materialise()  # as in a resume: a device error is not a damaged checkpoint
        try:
            if titan is None:
                commit.verify(path)
            states = {"model": base} if titan is None else {titan[k]: v for k, v in base.items()}
            dcp_load(states, path, process_group)
        except (Exception, CheckpointException) as e:
            reason = e if isinstance(e, DamagedCheckpoint) else commit.dcp_failure(e)
            raise ConfigError(
                f"[checkpoint] initial_load_path: {path} is not a usable checkpoint: {reason}") from None
        loaded = states["model"] if titan is None else {k: states[key] for k, key in titan.items()}
        model.load_state_dict(loaded, strict=False)
    kind = " (HuggingFace)" if cfg.initial_load_in_hf else " (torchtitan)" if titan else ""
    logger.info(f"Initial weights loaded from {path}{kind}")
