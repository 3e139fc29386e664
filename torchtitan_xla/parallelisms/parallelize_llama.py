"""Parallelism for the Llama model, applied from outside by module name as XLA SPMD shardings.

Each `apply_*` does one thing to the same module; `parallelize_llama` calls them in order.
Shardings are annotations on the (still lazy) parameters: XLA partitions the whole step graph
from them and inserts the collectives.
"""

from __future__ import annotations

import torch
from torch import nn

from torchtitan_xla.config_manager import JobConfig
from torchtitan_xla.logging import logger
from torchtitan_xla.parallelisms.parallel_dims import ParallelDims

Spec = tuple  # a partition spec: one mesh-axis name (or None) per tensor dimension


def fsdp_spec(shape: torch.Size, base: Spec, degree: int) -> Spec:
    """Add the `fsdp` axis to `base` on the largest dimension that is not already sharded and
    divides evenly by `degree` (the lowest such dimension on ties); unchanged if there is none."""
    if degree == 1:
        return base
    candidates = [d for d in range(len(shape)) if base[d] is None and shape[d] % degree == 0]
    if not candidates:
        return base
    dim = max(candidates, key=lambda d: (shape[d], -d))
    return tuple("fsdp" if d == dim else a for d, a in enumerate(base))


def partition_spec(param: torch.Tensor) -> Spec:
    """The spec the apply_* functions gave this parameter (replicated if none)."""
    return getattr(param, "_partition_spec", (None,) * param.dim())


def shard_param(param: torch.Tensor, mesh, spec: Spec) -> None:
    """Annotate `param` with `spec` and remember it, so later transforms can extend it."""
    import torch_xla.distributed.spmd as xs

    if any(axis is not None for axis in spec):
        xs.mark_sharding(param, mesh, spec)
    param._partition_spec = spec


def apply_fsdp(model: nn.Module, mesh, parallel_dims: ParallelDims) -> None:
    """Per-parameter FSDP: shard every parameter over the `fsdp` axis, on top of its TP spec.

    Gradients and optimizer state take the parameter's sharding; XLA all-gathers each parameter
    where it is used and reduce-scatters its gradient."""
    unsharded = []
    for name, param in model.named_parameters():
        base = partition_spec(param)
        spec = fsdp_spec(param.shape, base, parallel_dims.dp_shard)
        if spec == base and parallel_dims.dp_shard > 1:
            unsharded.append(name)
        shard_param(param, mesh, spec)
    if unsharded:
        logger.info(f"FSDP: {len(unsharded)} parameters have no dimension divisible by "
                    f"{parallel_dims.dp_shard} and stay replicated: {', '.join(unsharded[:4])}...")


def parallelize_llama(model: nn.Module, mesh, parallel_dims: ParallelDims,
                      job_config: JobConfig) -> nn.Module:
    apply_fsdp(model, mesh, parallel_dims)
    return model
