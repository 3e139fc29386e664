"""Attention kernels that can replace a block's `attention.sdpa` module (`[model] attention`):

- sdpa: the model's own module, softmax(q k^T) v as einsums, compiled by XLA or torch.compile on
  any device;
- blockwise: causal attention in query blocks that skip the masked keys (blockwise_attention.py),
  plain tensor ops, faster on the XLA CPU backend;
- flash: the runtime's fused kernel: torch_xla's Pallas flash attention on TPU (XLA runtime; not
  verified on TPU by this project), torch's `F.scaled_dot_product_attention` on the native runtime
  (FlashAttention on CUDA, its flash kernel on the CPU);
- splash: torch_xla's Pallas splash attention, TPU only (not verified on TPU).
Where the runtime has no such kernel for the device, the run keeps sdpa, with one warning.
"""

from __future__ import annotations

import torch
from torch import nn

from torchtitan_xla import runtime
from torchtitan_xla.logging import logger
from torchtitan_xla.models.llama.blockwise_attention import BlockwiseCausalAttention
from torchtitan_xla.models.llama.layers import repeat_kv
from torchtitan_xla.parallelisms.parallel_dims import BATCH_AXES

# [batch, heads, seq, head_dim]: batch over the data-parallel axes, heads over tensor parallel,
# as apply_tp constrains the heads.
HEADS_SPEC = (BATCH_AXES, "tp", None, None)


class KernelAttention(nn.Module):
    """The runtime's flash or splash attention kernel, sharded like the heads."""

    def __init__(self, kind: str, mesh, spec=HEADS_SPEC, window: int = 0):
        super().__init__()
        self.kind, self.mesh, self.spec, self.window = kind, mesh, spec, window

    def forward(self, q, k, v, document_ids=None, positions=None):
        # Masked by index and segment: positions in index order (context parallelism is refused).
        kernels = runtime.kernels
        kernel = kernels.flash_attention if self.kind == "flash" else kernels.splash_attention
        k, v = repeat_kv(k, q.shape[1]), repeat_kv(v, q.shape[1])
        segments = None if document_ids is None else document_ids.to(torch.int32)
        return kernel(q, k, v, mesh=self.mesh, spec=self.spec, segment_ids=segments, window=self.window)


def apply_attention_kernel(model: nn.Module, kind: str, mesh, device_type: str) -> None:
    """Swap every block's attention module for the `kind` kernel (no parameters change)."""
    if kind == "sdpa":
        return
    if kind == "blockwise":
        for block in model.layers.values():
            block.attention.sdpa = BlockwiseCausalAttention(window=block.attention.sdpa.window)
        logger.info("Attention: blockwise causal (4 query blocks, more with a sliding window)")
        return
    kernel = runtime.kernels.attention_kernel(kind, device_type)
    if kernel is None:
        logger.warning(f"[model] attention = {kind!r}: torch_xla's Pallas kernels run only on TPU; "
                       f"this {device_type} run uses sdpa")
        return
    for block in model.layers.values():
        block.attention.sdpa = KernelAttention(kind, mesh, window=block.attention.sdpa.window)
    logger.info(f"Attention: {kernel}")
