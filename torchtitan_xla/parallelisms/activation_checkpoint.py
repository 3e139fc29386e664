"""Activation checkpointing per block, applied from outside: full recompute (optionally with each
block's input, or its attention projections' outputs, kept in the host's memory), every N-th
block, or op-level selective (keep the weight matmuls' outputs, recompute the rest)."""

from __future__ import annotations

import contextlib
import functools
import inspect
import types

import torch
from torch import nn

from torchtitan_xla import runtime
from torchtitan_xla.config.run_sections import ActivationCheckpoint
from torchtitan_xla.float8 import FLOAT8_DOT_OP
from torchtitan_xla.logging import logger


def _checkpoint_block(block: nn.Module, offload: list[str] = ()) -> None:
    """Full recompute: keep only the block's input, recompute its forward in the backward pass.
    `offload` names what waits for the backward pass in the host's memory instead (MaxText's
    remat policies): "decoder_layer_input", the block's input; "qkv_proj", the attention's query,
    key and value projections, which the recomputation then takes back instead of multiplying."""
    original = block.forward  # a bound method: torch_xla's checkpoint also fences its weights
    if any(not p.requires_grad for p in block.parameters()):
        # Frozen weights (LoRA's base) are not fenced: the fence writes them, and a replayed step
        # would then have to donate and rebind weights it never changes (it failed to replay).
        # The block's input is still fenced, which keeps the recomputation apart.
        original = functools.partial(original)
    if not offload:
        _when_recording(block, lambda *args: runtime.kernels.checkpoint(original, *args))
        return
    kernels = runtime.kernels
    attention = block.attention
    projections = [attention.wq, attention.wk, attention.wv] if "qkv_proj" in offload else []

    def forward(*args):
        kept: list = []  # this call's projection outputs, on the host, in the order they were made
        calls = 0

        def run(*inner):
            nonlocal calls
            calls += 1
            with _projections_kept(projections, kept, again=calls > 1):
                return original(*inner)

        # The checkpoint fences the weights of a bound method's module (torch_xla's), as above.
        run_fn = types.MethodType(lambda _, *inner: run(*inner), block) if inspect.ismethod(original) else run
        on_host = "decoder_layer_input" in offload
        with _saved_on_host(args[0]) if on_host else contextlib.nullcontext():
            return kernels.reentrant_checkpoint(run_fn, *args)

    _when_recording(block, forward)


def _when_recording(block: nn.Module, checkpointed) -> None:
    """`block` runs as `checkpointed(*args)` while autograd records, as it was otherwise: without
    gradients (validation, reference scoring, generation with its KV cache, which is passed by
    keyword) nothing is kept for a backward pass, and nothing need be recomputed or offloaded."""
    plain = block.forward

    def forward(*args, **kwargs):
        if kwargs or not torch.is_grad_enabled():
            return plain(*args, **kwargs)
        return checkpointed(*args)

    block.forward = forward


def _saved_on_host(tensor: torch.Tensor):
    """Autograd keeps `tensor`, wherever it saves it for the backward pass in this context, in the
    host's memory (`runtime.kernels.offload`) and brings it back (`reload`); everything else as
    usual. Inside a reentrant checkpoint (the block's inputs saved by `ctx.save_for_backward`),
    this is MaxText's `decoder_layer_input: offload`."""
    kernels = runtime.kernels

    def pack(saved):
        return (True, kernels.offload(saved)) if saved is tensor else (False, saved)

    def unpack(packed):
        on_host, saved = packed
        return kernels.reload(saved) if on_host else saved

    return torch.autograd.graph.saved_tensors_hooks(pack, unpack)


@contextlib.contextmanager
def _projections_kept(projections: list[nn.Linear], kept: list, again: bool):
    """Within a checkpointed block: the first run (the forward pass, without gradients) keeps each
    projection's output on the host; the recomputation takes them back in the same order, and
    each projection then only computes its gradients (`_KeptLinear`)."""
    saved = [(p.forward, "forward" in p.__dict__) for p in projections]

    def keep(layer, forward, x):
        y = forward(x)
        kept.append(runtime.kernels.offload(y.detach()))
        return y

    def take_back(layer, forward, x):
        return _KeptLinear.apply(x, layer.weight, layer.bias, runtime.kernels.reload(kept.pop(0)))

    for p, (forward, _) in zip(projections, saved):
        p.forward = functools.partial(take_back if again else keep, p, forward)
    try:
        yield
    finally:
        for p, (forward, own) in zip(projections, saved):
            if own:
                p.forward = forward
            else:
                del p.forward


class _KeptLinear(torch.autograd.Function):
    """A linear layer whose output `y` was kept from the forward pass: returns it without the
    matmul; its backward is the layer's (the input's, weight's and bias's gradients)."""

    @staticmethod
    def forward(ctx, x, weight, bias, y):
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        # The backward's matmuls in the forward's autocast dtype, as the layer's own backward runs.
        device = runtime.autocast_device_type()
        ctx.autocast = device, torch.get_autocast_dtype(device), torch.is_autocast_enabled(device)
        return y.view_as(y)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        device, dtype, enabled = ctx.autocast
        needs_x, needs_weight, needs_bias, _ = ctx.needs_input_grad
        with torch.autocast(device, dtype=dtype, enabled=enabled):
            flat = grad.flatten(0, -2)  # only the gradients autograd asks for (LoRA's base: none)
            return (grad @ weight if needs_x else None, flat.t() @ x.flatten(0, -2) if needs_weight else None,
                    flat.sum(0) if needs_bias and ctx.has_bias else None, None)


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

    _when_recording(block, forward)


def apply_ac(model: nn.Module, cfg: ActivationCheckpoint) -> None:
    """Activation checkpointing per block: "full" (with `offload = ["decoder_layer_input"]`, each
    block's input kept on the host), "selective" every N-th block, or "selective" op-level (keep
    matmul outputs, recompute the rest)."""
    if cfg.mode == "none":
        return
    blocks = list(model.layers.values())
    if cfg.mode == "full":
        for block in blocks:
            _checkpoint_block(block, cfg.offload)
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
