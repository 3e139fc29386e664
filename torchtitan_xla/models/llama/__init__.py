"""Llama 2 and Llama 3 / 3.1. `args` (hyperparameters, flavors) imports without torch; the model
classes load on first use."""

from torchtitan_xla.models.llama.args import ModelArgs, RopeScaling, llama2_configs, llama3_configs

__all__ = ["ModelArgs", "RopeScaling", "Transformer", "llama2_configs", "llama3_configs"]


def __getattr__(name: str):
    if name == "Transformer":  # imports torch
        from torchtitan_xla.models.llama.model import Transformer

        return Transformer
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
