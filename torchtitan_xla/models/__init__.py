"""Model registry: `model.name` -> model class and flavors."""

import dataclasses

from torchtitan_xla.models.llama import ModelArgs, Transformer, llama2_configs, llama3_configs

model_name_to_cls = {"llama2": Transformer, "llama3": Transformer}
models_config = {"llama2": llama2_configs, "llama3": llama3_configs}


def flavors_of(name: str) -> list[str]:
    return list(models_config.get(name, {}))


def all_flavors() -> dict[str, list[str]]:
    return {name: list(flavors) for name, flavors in models_config.items()}


def get_model_args(name: str, flavor: str, **overrides) -> ModelArgs:
    """A fresh copy of a flavor's args (the registry itself is never mutated)."""
    return dataclasses.replace(models_config[name][flavor], **overrides)
