"""Model registry: `model.name` -> flavors (torch-free) and model class (imports torch)."""

import dataclasses

from torchtitan_xla.models.llama.args import ModelArgs, models_config
from torchtitan_xla.models.llama.hf_folder import HF_FLAVOR, HFFlavorArgs


def all_flavors() -> dict[str, list[str]]:
    return {name: list(flavors) for name, flavors in models_config.items()}


def get_model_args(name: str, flavor: str, **overrides) -> ModelArgs:
    """A fresh copy of a flavor's args (the registry itself is never mutated); flavor "hf": a
    stand-in that checkpoint/hf.py's match_initial_hf_weights replaces by the HF folder's args."""
    if flavor == HF_FLAVOR:
        return HFFlavorArgs(family=name, overrides=overrides)
    return dataclasses.replace(models_config[name][flavor], **overrides)


def moe_overrides(moe) -> dict:
    """ModelArgs overrides from a [moe] config section (any object with these attributes): each of
    num_experts, top_k, moe_every, capacity_factor, expert_groups, topk_groups that is not 0
    replaces the flavor's (0 keeps it; the flavors' capacity_factor is 0, dropless), and
    aux_loss_weight always (0 is a weight too): the weight training gives the load-balancing loss,
    which a Mixtral export's config carries."""
    keys = ("num_experts", "top_k", "moe_every", "capacity_factor", "expert_groups", "topk_groups")
    out = {k: getattr(moe, k) for k in keys if getattr(moe, k, 0)}
    return {**out, "aux_loss_weight": moe.aux_loss_weight}


def get_model_class(name: str) -> type:
    """The nn.Module class of `model.name`; every family here is the one Llama Transformer (Mixtral
    is Llama with mixture-of-experts blocks, Qwen3 with query/key norms, DeepSeek-V3 with latent
    attention and its router, chosen by its ModelArgs)."""
    from torchtitan_xla.models.llama.model import Transformer

    return {name: Transformer for name in models_config}[name]
