"""Activation checkpointing per block, applied from outside: full recompute (optionally with each
block's input kept in the host's memory), every N-th block, or op-level selective (keep the weight
matmuls' outputs, recompute the rest)."""

from __future__ import annotations

import functools

import torch
from torch import nn

from torchtitan_xla import runtime
from torchtitan_xla.config.run_sections import ActivationCheckpoint
from torchtitan_xla.float8 import FLOAT8_DOT_OP
from torchtitan_xla.logging import logger


def _checkpoint_block(block: nn.Module, offload_input: bool = False) -> None:
    """Full recompute: keep only the block's input, recompute its forward in the backward pass.
    `offload_input`: that input waits for the backward pass in the host's memory (MaxText's
    `decoder_layer_input: offload`)."""
    original = block.forward  # a bound method: torch_xla's checkpoint also fences its weights
    if any(not p.requires_grad for p in block.parameters()):
        # Frozen weights (LoRA's base) are not fenced: the fence writes them, and a replayed step
        # would then have to donate and rebind weights it never changes (it failed to replay).
        # The block's input is still fenced, which keeps the recomputation apart.
        original = functools.partial(original)
    checkpoint = runtime.kernels.offload_checkpoint if offload_input else runtime.kernels.checkpoint
    block.forward = lambda *args: checkpoint(original, *args)


# Outputs kept by op-level selective checkpointing: the weight matmuls (Linear layers lower to
# aten.mm; float8 linears to torchtitan_xla.float8_dot, whose output is the layer's output in the
# compute dtype, so the same tensors are kept either way). Norms, RoPE, attention scores and
# softmax, and the SwiGLU activation are recomputed; like MaxText's "minimal" remat policy, so the
# S x S attention scores are never stored.
_SAVED_OPS = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default, FLOAT8_DOT_OP}


def _save_matmuls_policy(ctx, op, *args, **kwargs):
    from torch.utils.checkpoint import CheckpointPolicy

    return CheckpointPolicy.MUST_SAVE if op in _SAVED_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def _selective_op_block(block: nn.Module) -> None:
    """Op-level selective checkpointing with torch's selective-checkpoint policy API."""
    from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts

    runtime.kernels.enable_torch_checkpoint()
    original = block.forward
    context_fn = functools.partial(create_selective_checkpoint_contexts, _save_matmuls_policy)

    def forward(*args):
        calls = 0

        def run(*inner):
            nonlocal calls
            calls += 1
            if calls > 1:
                # The recomputation, inside the backward pass. Without a barrier XLA would see the
                # same expressions as in the forward pass and merge them, silently undoing the
                # checkpointing (torch_xla's own checkpoint fences its inputs the same way).
                runtime.kernels.optimization_barrier_([t for t in inner if isinstance(t, torch.Tensor)])
            return original(*inner)

        return checkpoint(run, *args, use_reentrant=False, preserve_rng_state=False,
                          context_fn=context_fn)

    block.forward = forward


def apply_ac(model: nn.Module, cfg: ActivationCheckpoint) -> None:
    """Activation checkpointing per block: "full" (with `offload = ["decoder_layer_input"]`, each
    block's input kept on the host), "selective" every N-th block, or "selective" op-level (keep
    matmul outputs, recompute the rest)."""
    if cfg.mode == "none":
        return
    blocks = list(model.layers.values())
    if cfg.mode == "full":
        for block in blocks:
            _checkpoint_block(block, offload_input="decoder_layer_input" in cfg.offload)
    elif cfg.selective_ac_option == "op":
        for block in blocks:
            _selective_op_block(block)
    else:
        every = int(cfg.selective_ac_option)  # validated with the config
        for i, block in enumerate(blocks):
            if (i + 1) % every == 0:
                _checkpoint_block(block)
    logger.info(f"Activation checkpointing: {cfg.mode}"
                + (f" ({cfg.selective_ac_option})" if cfg.mode == "selective" else "")
                + (f", offloaded to the host: {', '.join(cfg.offload)}" if cfg.offload else ""))
