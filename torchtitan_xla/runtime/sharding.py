"""SPMD shardings: the device mesh, partition-spec annotations on tensors, and constraints on
activations. A partition spec names one mesh axis (or a tuple of axes, or None) per dimension;
XLA partitions the whole graph from these annotations and inserts the collectives."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch

Spec = tuple


def build_mesh(shape: Sequence[int], axis_names: Sequence[str], *, device_type: str,
               num_slices: int = 1):
    """The device mesh. On TPU, torch_xla's HybridMesh orders devices by the physical (ICI)
    topology and puts the slices on the outer part of the first axis; elsewhere an ordinary mesh
    of the same logical shape, slices being consecutive blocks of devices."""
    import torch_xla.distributed.spmd as xs

    if device_type == "TPU":
        dcn = (num_slices,) + (1,) * (len(shape) - 1)
        ici = (shape[0] // num_slices, *shape[1:])
        return xs.HybridMesh(ici_mesh_shape=ici, dcn_mesh_shape=dcn, axis_names=tuple(axis_names))
    return xs.Mesh(np.arange(int(np.prod(shape))), tuple(shape), tuple(axis_names))


def mark_sharding(t: torch.Tensor, mesh, spec: Spec) -> None:
    """Annotate `t` with `spec`. An earlier annotation is cleared first: without functionalization
    torch_xla refuses to overwrite one."""
    import torch_xla.distributed.spmd as xs

    if is_sharded(t):
        xs.clear_sharding(t)
    if any(axis is not None for axis in spec):
        xs.mark_sharding(t, mesh, spec)


def is_sharded(t: torch.Tensor) -> bool:
    import torch_xla

    return torch_xla._XLAC._get_xla_op_sharding(t) is not None


def copy_sharding(src: torch.Tensor, dst: torch.Tensor) -> None:
    """Give `dst` (a fresh tensor of the same shape) the sharding of `src`, if any."""
    import torch_xla

    sharding = torch_xla._XLAC._get_xla_op_sharding(src)
    if sharding is not None:
        torch_xla._XLAC._xla_mark_sharding(dst, sharding)


def sharding_text(t: torch.Tensor) -> str:
    """The sharding as XLA prints it ("{devices=[4,1,2]0,2,4,6,1,3,5,7 last_tile_dim_replicate}";
    "" for an unannotated tensor not yet materialised)."""
    import torch_xla

    return torch_xla._XLAC._get_xla_sharding_spec(t)


def constraint(mesh, spec: Spec) -> Callable[[torch.Tensor], torch.Tensor]:
    """A sharding constraint on an activation, and on its gradient in the backward pass."""
    import torch_xla.distributed.spmd as xs

    return lambda t: xs.mark_sharding_with_gradients(t, mesh, spec)


def input_sharding(mesh, spec: Spec, *, hosts: int = 1):
    """How batches are laid out when they reach the device (`runtime.device.to_device`): with
    several hosts each one holds only its slice of the first dimension."""
    import torch_xla.distributed.spmd as xs

    return xs.ShardingSpec(mesh, spec, minibatch=hosts > 1)
