"""The native runtime's answers to the model-side kernel calls: plain PyTorch ones. `flash` is
torch's fused attention; the splash and grouped-matmul Pallas kernels and scan over layers are
torch_xla's, and the config refuses them on this runtime before anything is built
(config/checks.py), so reaching one here is a bug."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from torchtitan_xla.runtime.common import python_scan as scan

__all__ = ["attention_kernel", "checkpoint", "check_torchax", "dot_f32", "enable_torch_checkpoint",
           "flash_attention", "grouped_mm", "offload", "optimization_barrier_", "reentrant_checkpoint",
           "reload", "scan",
           "scan_layers", "splash_attention", "total_norm"]


def _xla_only(name: str):
    def refuse(*args, **kwargs):
        raise NotImplementedError(f"{name} is the XLA runtime's ([runtime] backend = \"xla\")")
    return refuse


splash_attention = _xla_only("the Pallas splash attention kernel")
grouped_mm = _xla_only("the Pallas grouped matmul")
scan_layers = _xla_only("scan over layers")
check_torchax = _xla_only("scan over layers")


def attention_kernel(kind: str, device_type: str) -> str | None:
    """What runs for `[model] attention = kind` (flash or splash) here; None: no such kernel."""
    return "torch's fused scaled_dot_product_attention" if kind == "flash" else None


def flash_attention(q, k, v, *, mesh=None, spec=None, segment_ids=None, window: int = 0) -> torch.Tensor:
    """Causal attention over [batch, heads, seq, head_dim] (keys and values with as many heads),
    within the documents of `segment_ids` [batch, seq] if given and a sliding `window` if one,
    through torch's fused kernel (`F.scaled_dot_product_attention`: FlashAttention on CUDA, its
    flash kernel on the CPU; with documents or a window, a kernel that takes a mask). Each (row,
    head) attends on its own device, so DTensors sharded over batch and heads run on their local
    blocks (`mesh`, `spec`: the XLA kernel's)."""
    from torch.distributed.tensor import DTensor, Shard

    dtensor = q if isinstance(q, DTensor) else None
    if dtensor is not None:
        if any(isinstance(p, Shard) and p.dim > 1 for p in q.placements) or any(
                t.placements != q.placements for t in (k, v)):
            raise NotImplementedError(f"flash attention over placements {q.placements}, {k.placements}: "
                                      f"only batch and heads may be sharded, alike")
        q, k, v = q.to_local(), k.to_local(), v.to_local()
        if isinstance(segment_ids, DTensor):
            segment_ids = segment_ids.to_local()
    if segment_ids is None and not window:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    else:
        seq = torch.arange(q.shape[-2], device=q.device)
        mask = seq[None, :] <= seq[:, None]
        if window:
            mask = mask & (seq[None, :] > seq[:, None] - window)
        if segment_ids is not None:
            mask = (segment_ids[:, :, None] == segment_ids[:, None, :]) & mask
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None] if mask.dim() == 3 else mask)
    if dtensor is None:
        return out
    return DTensor.from_local(out, dtensor.device_mesh, dtensor.placements, shape=dtensor.shape,
                              stride=dtensor.stride())


def dot_f32(a: torch.Tensor, b: torch.Tensor, a_dims: list[int], b_dims: list[int]) -> torch.Tensor:
    """`a` and `b` contracted over `a_dims` / `b_dims`, in float32 (free dims of a, then of b)."""
    return torch.tensordot(a.float(), b.float(), dims=(a_dims, b_dims))


def total_norm(tensors: list[torch.Tensor]) -> torch.Tensor:
    """The 2-norm of all `tensors` together, as a sum of squares. (torch's get_total_norm stacks
    per-tensor norms whose DTensor placements differ, sharded and replicated over tp, and
    combined them wrongly: 0.1-0.2% off with tensor parallelism, torch 2.9.)"""
    total = sum(t.float().square().sum() for t in tensors)
    return total.sqrt()


def checkpoint(fn: Callable, *args):
    """Full activation checkpointing of `fn(*args)`: torch's non-reentrant checkpoint."""
    from torch.utils.checkpoint import checkpoint as torch_checkpoint

    return torch_checkpoint(fn, *args, use_reentrant=False, preserve_rng_state=False)


def reentrant_checkpoint(fn: Callable, *args):
    """Full checkpointing of `fn(*args)` by torch's reentrant checkpoint: it saves its inputs with
    `save_for_backward`, which saved-tensor hooks see (the non-reentrant one keeps them in its own
    closure), and runs `fn` without gradients first, then again in the backward pass. Not traceable
    by torch.compile, hence host offload runs with step eager only (config/checks.py)."""
    from torch.utils.checkpoint import checkpoint as torch_checkpoint

    return torch_checkpoint(fn, *args, use_reentrant=True, preserve_rng_state=False)


def offload(t: torch.Tensor):
    """A copy of `t` (of its local block, for a DTensor) in host memory, pinned so that the copy runs
    beside the compute, with what `reload` needs to bring it back; on the CPU `t` is already on the
    host."""
    from torch.distributed.tensor import DTensor

    if t.device.type == "cpu":
        return None, t
    local = t.to_local() if isinstance(t, DTensor) else t
    host = torch.empty(local.shape, dtype=local.dtype, device="cpu", pin_memory=True)
    layout = (t.device_mesh, t.placements, t.shape, t.stride()) if isinstance(t, DTensor) else None
    return (local.device, layout), host.copy_(local, non_blocking=True)


def reload(saved) -> torch.Tensor:
    """The tensor `offload` copied to the host, back on its device (a DTensor with its layout)."""
    from torch.distributed.tensor import DTensor

    where, t = saved
    if where is None:
        return t
    device, layout = where
    t = t.to(device, non_blocking=True)
    if layout is None:
        return t
    mesh, placements, shape, stride = layout
    return DTensor.from_local(t, mesh, placements, run_check=False, shape=shape, stride=stride)


def optimization_barrier_(tensors: list[torch.Tensor]) -> None:
    """Eager recomputation is never merged with the forward pass: nothing to fence."""


def enable_torch_checkpoint() -> None:
    """torch's checkpoint knows this runtime's devices."""
