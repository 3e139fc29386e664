"""Mixed precision across devices: sequence parallelism's gather of the norms' outputs in the
compute dtype, and the dtype the weights' gradients are summed in.

Under autocast the residual stream and the norms stay float32, and the column-parallel layers
after a norm read its output in bfloat16. Gathering it whole along the sequence in float32 (where
the partitioner puts the gather otherwise) moves twice the bytes the layers read: cast first,
gather, and hand the layers the float32 of the bf16 values (which they cast back, exactly). The
gradient passes in float32 (autograd's own cast would round the layers' summed input gradient).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from torchtitan_xla import runtime
from torchtitan_xla.models.llama.model import TiedOutput


class _GatherIn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, dtype: torch.dtype, gather: Callable,
                scatter: Callable) -> torch.Tensor:
        ctx.scatter = scatter
        # The cast held in the input's layout, or XLA's partitioner gathers before casting.
        return gather(scatter(x.to(dtype))).to(x.dtype)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return ctx.scatter(grad), None, None, None


def gather_in_compute_dtype(gather: Callable, scatter: Callable) -> Callable[[torch.Tensor], torch.Tensor]:
    """`gather` (a constraint to the gathered layout) applied to the cast of its input under
    autocast; `scatter` (a constraint to the input's layout) applied to the gradient. Without
    autocast, `gather` itself."""

    def apply(x: torch.Tensor) -> torch.Tensor:
        kind = x.device.type
        if not torch.is_autocast_enabled(kind) or x.dtype != torch.float32:
            return gather(x)
        return _GatherIn.apply(x, torch.get_autocast_dtype(kind), gather, scatter)

    return apply


@torch.library.custom_op("torchtitan_xla::dot_f32", mutates_args=())
def dot_f32(a: torch.Tensor, b: torch.Tensor, a_dims: list[int], b_dims: list[int]) -> torch.Tensor:
    """`a` and `b` contracted over `a_dims` / `b_dims` with a float32 result. One dispatcher op, so
    that AOTAutograd (scan) traces it; this body, the reference off XLA, upcasts the operands."""
    return torch.tensordot(a.float(), b.float(), dims=(a_dims, b_dims))


@dot_f32.register_kernel("xla")
def _dot_f32_xla(a, b, a_dims, b_dims):
    """On XLA: one HLO dot of the operands as they are, with a float32 result."""
    return runtime.kernels.dot_f32(a, b, a_dims, b_dims)


@dot_f32.register_fake
def _dot_f32_fake(a, b, a_dims, b_dims):
    shape = ([n for d, n in enumerate(a.shape) if d not in a_dims]
             + [n for d, n in enumerate(b.shape) if d not in b_dims])
    return a.new_empty(shape, dtype=torch.float32)


class _WeightGradIn(torch.autograd.Function):
    """A projection in the compute dtype, as autocast computes it, whose weight gradient is the
    float32 result of one dot of the same bf16 operands (`dot_f32`): XLA's partitioner sums the
    weight-gradient dot's own output across the batch shards, so that sum is float32 too
    (autocast's bf16 dot would be summed in bf16). `tokens_apart`: [batch, seq] kept as two
    dimensions (context parallelism's einsum) rather than flattened (F.linear)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, dtype: torch.dtype, tokens_apart: bool):
        xc, wc = x.to(dtype), weight.to(dtype)
        ctx.save_for_backward(xc, wc)
        ctx.dtypes, ctx.tokens_apart = (x.dtype, weight.dtype), tokens_apart
        return torch.einsum("bsi,oi->bso", xc, wc) if tokens_apart else F.linear(xc, wc)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        xc, wc = ctx.saved_tensors
        g = grad.to(xc.dtype)
        gx = gw = None
        if ctx.needs_input_grad[0]:
            gx = (torch.einsum("bso,oi->bsi", g, wc) if ctx.tokens_apart else g @ wc).to(ctx.dtypes[0])
        if ctx.needs_input_grad[1]:
            lead = list(range(g.dim() - 1))
            gw = dot_f32(g, xc, lead, lead).to(ctx.dtypes[1])
        return gx, gw, None, None


def project(layer: nn.Module, x: torch.Tensor, *, tokens_apart: bool = False) -> torch.Tensor:
    """`layer(x)` for a linear layer (or the tied output): F.linear of its weight (and bias), or with
    `tokens_apart` the einsum over [batch, seq, in]. Under autocast with the gradients reduced in
    float32 (`apply_reduce_dtype`) and a float32 weight, through `_WeightGradIn`. A weight handed
    in the compute dtype (the native runtime's gather casts it) takes autocast's path: the
    gather's backward sums its gradient in the reduce dtype."""
    weight, bias, kind = layer.weight, getattr(layer, "bias", None), x.device.type  # read once
    if (getattr(layer, "_reduce_dtype", None) == torch.float32 and weight.dtype == torch.float32
            and torch.is_autocast_enabled(kind)):
        out = _WeightGradIn.apply(x, weight, torch.get_autocast_dtype(kind), tokens_apart)
    elif tokens_apart:
        out = torch.einsum("bsi,oi->bso", x, weight)
    else:
        return F.linear(x, weight, bias)
    return out if bias is None else out + bias.to(out.dtype)


_REDUCING: dict[type, type] = {}


def is_plain_linear(module: nn.Module) -> bool:
    """nn.Linear, or the class `apply_reduce_dtype` gave one (not float8's or LoRA's)."""
    return type(module) is nn.Linear or type(module) is _REDUCING.get(nn.Linear)


def apply_reduce_dtype(model: nn.Module, dtype: torch.dtype) -> None:
    """Under autocast, the weight matrices' gradients summed across data-parallel devices in
    `dtype` ([training] mixed_precision_reduce). Every module records it (the native runtime's
    gather casts its backward to it); in float32, the linear layers and the tied output project
    through `project`. The experts' stacked weights keep autocast's bf16 products on the XLA
    runtime (docs/parallelisms.md)."""
    for module in model.modules():
        module._reduce_dtype = dtype
        cls = type(module)
        if dtype == torch.float32 and (cls is nn.Linear or cls is TiedOutput):
            if cls not in _REDUCING:
                _REDUCING[cls] = type(cls.__name__, (cls,), {"forward": project})
            module.__class__ = _REDUCING[cls]
