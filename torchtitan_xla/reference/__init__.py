"""The reference model of the dpo and ipo objectives, and of grpo's KL penalty (objectives.py):
each step's row (grpo: token) log-probabilities under it, computed by a scoring graph of its own
before the training step, which reads them as data (so the training graph stays one graph and
holds no second model).

The reference is `[preference] reference`, else `[checkpoint] initial_load_path` (the weights
the policy starts from): a frozen copy, sharded on the training mesh as the policy is, its weights
read once. With LoRA and no reference given it is the policy itself with its adapters switched off
(the base model, peft's `disable_adapter()`): no second copy of the weights.
`python -m torchtitan_xla.reference` (__main__.py) scores the training pairs once and stores the
log-probabilities with them, for `[preference] precomputed_reference` (no reference at all).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from torchtitan_xla import runtime
from torchtitan_xla.batch import Batch
from torchtitan_xla.config import JobConfig
from torchtitan_xla.errors import ConfigError
from torchtitan_xla.objectives import copies_reference, document_logps

KEY = "[preference] reference"


def reference_source(job_config: JobConfig) -> str | None:
    """The folder the reference is read from, checked before the runtime starts; None where no
    copy is kept (an objective without a reference, LoRA's base: the adapters switched off, or
    log-probabilities stored with the pairs)."""
    return configured_reference(job_config) if copies_reference(job_config) else None


def configured_reference(job_config: JobConfig) -> str:
    """`[preference] reference`, else `[checkpoint] initial_load_path`, checked to be a readable
    checkpoint step or HuggingFace folder (training's copy and the scoring command read it)."""
    from torchtitan_xla.inference import weights_folder

    given = job_config.preference.reference or job_config.checkpoint.initial_load_path
    if not given:
        raise ConfigError(f"{KEY}: empty, and no [checkpoint] initial_load_path to use instead: "
                          f"{job_config.training.objective} compares the policy with a frozen "
                          f"reference model (simpo and orpo need none; grpo only with [grpo] beta > 0)")
    weights_folder(given, job_config, KEY)  # exists and is readable
    return given


def build_reference(job_config: JobConfig, policy: torch.nn.Module, loss_fn, *, tokenizer,
                    on: tuple) -> Callable[..., torch.Tensor]:
    """`reference(batch)` -> each document's summed completion log-probability [rows, slots] under
    the reference model, float32 (the batch's `reference_logps`), as one compiled graph.
    `loss_fn` is the plain loss function (no label smoothing or z-loss); `on` is (device, mesh,
    parallel_dims)."""
    import contextlib

    from torchtitan_xla.inference import inference_config, load_model, weights_folder
    from torchtitan_xla.lora import adapters_disabled

    source = reference_source(job_config)
    if source is None:
        model, switch = policy, lambda: adapters_disabled(policy)
    else:
        folder, is_hf = weights_folder(source, job_config, KEY)
        # No activation checkpointing or scan: it runs forward only, without gradients. The
        # policy's attention kernel and expert matmuls, so that at the start both compute the
        # same log-probabilities (float8 is left out: the reference runs its matmuls unscaled).
        model = load_model(inference_config(job_config), folder, is_hf, KEY, tokenizer=tokenizer,
                           on=on, prepare=lambda m: policy_kernels(m, job_config, on[1])).model
        _check_same_shapes(model, policy, source)
        model.requires_grad_(False)
        switch = contextlib.nullcontext
    return scoring_step(model, loss_fn, switch, job_config)


def scoring_step(model: torch.nn.Module, loss_fn, switch,
                 job_config: JobConfig) -> Callable[..., torch.Tensor]:
    """`score(batch)`: each document's summed completion log-probability [rows, slots] under
    `model` (inside the `switch()` context), float32, as one compiled graph; for grpo each
    token's [rows, seq] (0 where it is not a completion's)."""
    from torchtitan_xla.datasets.preference import document_slots

    slots = document_slots(job_config.training.seq_len, job_config.training.packing)
    per_token = job_config.training.objective == "grpo"

    @torch.no_grad()
    def score(batch: Batch):
        with switch():
            token_losses = loss_fn(model, batch.inputs, batch.labels, *batch.packing)
        if per_token:
            return -token_losses.reshape(batch.labels.shape)
        return document_logps(token_losses, batch, slots)[0]

    return runtime.build_step("lazy", score, [*model.parameters(), *model.buffers()],
                              name="reference_step")


def policy_kernels(model: torch.nn.Module, job_config: JobConfig, mesh) -> None:
    from torchtitan_xla.models.llama.attention_kernels import apply_attention_kernel
    from torchtitan_xla.models.llama.moe_kernels import apply_grouped_mm

    apply_attention_kernel(model, job_config.model.attention, mesh, runtime.device_type())
    apply_grouped_mm(model, job_config.moe.grouped_mm, mesh, runtime.device_type())


def _check_same_shapes(reference: torch.nn.Module, policy: torch.nn.Module, source: str) -> None:
    """The reference must be the policy's architecture: the same weights, of the same shapes."""
    from torchtitan_xla.lora import is_adapter

    theirs = {n: tuple(p.shape) for n, p in reference.named_parameters()}
    ours = {n: tuple(p.shape) for n, p in policy.named_parameters() if not is_adapter(n)}
    if theirs != ours:
        diff = sorted(set(theirs.items()) ^ set(ours.items()))
        name = diff[0][0]
        raise ConfigError(f"{KEY}: {source} is not the policy's architecture: {name} is "
                          f"{list(theirs.get(name, ())) or 'missing'} there, "
                          f"{list(ours.get(name, ())) or 'missing'} in the policy "
                          f"({len(diff)} weights differ)")
