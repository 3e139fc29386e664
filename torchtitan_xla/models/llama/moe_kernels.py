"""How MoE blocks run their experts (`[moe] grouped_mm`): GShard's dispatch into slots (the
model's own code, default), or the routed tokens sorted by expert and multiplied by grouped
matmuls (moe.sorted_experts): torch_xla's Pallas megablox kernel on TPU (not verified on TPU by
this project), the plain PyTorch reference elsewhere.

A sort over the whole global batch would move every token across the mesh, and the Pallas kernel
cannot be split by the SPMD partitioner, so on a mesh each device runs the sorted experts on its
own sequences (`runtime.per_shard`, gathering the expert weights as FSDP does); the CPU reference
runs inside the same region, so the region is what the CPU tests check.
"""

from __future__ import annotations

import functools

from torch import nn

from torchtitan_xla import runtime
from torchtitan_xla.logging import logger
from torchtitan_xla.models.llama.moe import MoE, grouped_mm_reference, sorted_experts
from torchtitan_xla.parallelisms.parallel_dims import BATCH_AXES


def apply_grouped_mm(model: nn.Module, enabled: bool, mesh, device_type: str) -> None:
    """Give every MoE block sorted experts with the device's grouped matmul (no parameters change)."""
    blocks = [m for m in model.modules() if isinstance(m, MoE)]
    if not enabled or not blocks:
        return
    if device_type == "TPU":
        from torchtitan_xla.runtime import kernels

        kernel, name = kernels.grouped_mm, "Pallas megablox gmm (not verified on TPU by this project)"
    else:
        kernel, name = grouped_mm_reference, f"the PyTorch reference grouped matmul on {device_type}"
    experts = functools.partial(sorted_experts, grouped_mm=kernel)
    if mesh.size() > 1:
        tokens = (BATCH_AXES, None, None)  # x [batch, seq, dim], experts and weights [batch, seq, k]
        whole = (None, None, None)  # the stacked expert weights
        experts = runtime.per_shard(experts, mesh, [tokens] * 3 + [whole] * 3, tokens, BATCH_AXES)
    for m in blocks:
        m.routed_experts = experts
    logger.info(f"MoE experts: sorted by expert, grouped matmuls with {name}")
