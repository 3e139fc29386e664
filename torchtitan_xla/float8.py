"""Float8 training: `nn.Linear` layers whose matmuls run as float8 x float8 -> float32 dots.

torchtitan's `[float8]` (torchao's Float8Linear, tensorwise dynamic scaling) rebuilt for XLA:

- forward   out = x @ w.T      with x and w cast to e4m3,
- backward  grad_x = g @ w     and grad_w = g.T @ x, with the output gradient g cast to e5m2,

each a single XLA `dot` with float8 operands and a float32 result (`preferred_element_type`), then
multiplied by the inverse scales. Each tensor gets one scale from its absolute maximum, computed on
the whole tensor: under SPMD the reduction spans every shard (XLA inserts it), so a sharded layer
uses exactly the scale of the unsharded one. The scale is `f8_max / amax`, torchao's tensorwise
recipe: the largest magnitude maps to the format's largest finite value.

On hardware with float8 matrix units the compiler can run these dots natively (not verified here);
the CPU backend rounds the operands to float8 and then multiplies in float32, which gives the same
numbers (products of float8 values are exact in float32). Off XLA the dot is `torch._scaled_mm`,
torchao's GEMM (float8 tensor cores on GPUs; not verified on a GPU; the CPU's gives the upcast
product), on each process's blocks under DTensor (the op's sharding rule). docs/float8.md has the
measurements.
"""

from __future__ import annotations

import math
import re
from typing import TYPE_CHECKING

import torch
from torch import nn
from torch.distributed.tensor import Partial, Replicate, Shard

from torchtitan_xla.errors import ConfigError
from torchtitan_xla.logging import logger

if TYPE_CHECKING:
    from torchtitan_xla.config.job_config import Float8

E4M3 = torch.float8_e4m3fn  # forward operands: 3 mantissa bits, max 448
E5M2 = torch.float8_e5m2  # output gradient: 2 mantissa bits, max 57344, a wider range
# Keeps the scale finite for an all-zero tensor (torchao uses the same floor).
AMAX_FLOOR = 1e-12
# Hardware float8 GEMMs need both dimensions of the weight in multiples of 16 (torchao's rule).
DIM_MULTIPLE = 16


# ---- scaling -----------------------------------------------------------------------------------


def tensorwise_scale(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The float32 scalar s = f8_max / amax(t): t * s fills `dtype`'s range exactly, its largest
    magnitude landing on the format's largest finite value (no margin, as torchao's and
    Transformer Engine's defaults: the amax is the current tensor's, so nothing can overflow)."""
    amax = t.detach().abs().max().float()  # (amax() with no dim reduces nothing on XLA)
    return torch.finfo(dtype).max / amax.clamp(min=AMAX_FLOOR)


def to_float8(t: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """t * scale in `dtype`, rounded to nearest even."""
    f8_max = torch.finfo(dtype).max
    # Saturate, as torchao does: the float32 product can round a hair past f8_max, and e4m3fn has
    # no infinity to overflow into.
    return (t.float() * scale).clamp(-f8_max, f8_max).to(dtype)


# ---- the float8 dot ----------------------------------------------------------------------------


def _float8_dot(dot, a, b, a_scale, b_scale, a_dims, b_dims, a_dtype, b_dtype, out_dtype):
    a8, b8 = to_float8(a, a_scale, a_dtype), to_float8(b, b_scale, b_dtype)
    return (dot(a8, b8, a_dims, b_dims) * (a_scale * b_scale).reciprocal()).to(out_dtype)


def _upcast_dot(a8: torch.Tensor, b8: torch.Tensor, a_dims: list[int], b_dims: list[int]) -> torch.Tensor:
    """The float8 operands upcast, multiplied in float32 (exact products; the reference off XLA)."""
    return torch.tensordot(a8.float(), b8.float(), dims=(a_dims, b_dims))


def _scaled_mm_dot(a8: torch.Tensor, b8: torch.Tensor, a_dims: list[int], b_dims: list[int]) -> torch.Tensor:
    """The same contraction as one `torch._scaled_mm` GEMM of [free, contracted] x [contracted,
    free] matrices (b column-major, as the GEMM takes it), float32 out. GPUs' float8 GEMMs take
    contracted and output widths in multiples of 16 only: any other shape is upcast."""
    a_free = [d for d in range(a8.dim()) if d not in a_dims]
    b_free = [d for d in range(b8.dim()) if d not in b_dims]
    a2 = a8.permute(*a_free, *a_dims).reshape(-1, math.prod(a8.shape[d] for d in a_dims))
    b2 = b8.permute(*b_free, *b_dims).reshape(-1, a2.shape[1])  # [free, contracted]: .t() column-major
    if a2.shape[1] % DIM_MULTIPLE or b2.shape[0] % DIM_MULTIPLE:
        return _upcast_dot(a8, b8, a_dims, b_dims)
    one = torch.ones((), dtype=torch.float32, device=a8.device)
    out = torch._scaled_mm(a2.contiguous(), b2.contiguous().t(), scale_a=one, scale_b=one,
                           out_dtype=torch.float32)
    return out.reshape(*(a8.shape[d] for d in a_free), *(b8.shape[d] for d in b_free))


@torch.library.custom_op("torchtitan_xla::float8_dot", mutates_args=())
def float8_dot(a: torch.Tensor, b: torch.Tensor, a_scale: torch.Tensor, b_scale: torch.Tensor,
               a_dims: list[int], b_dims: list[int], a_dtype: torch.dtype, b_dtype: torch.dtype,
               out_dtype: torch.dtype) -> torch.Tensor:
    """`tensordot(a, b, (a_dims, b_dims))` computed as a dot of float8 `a * a_scale` (in `a_dtype`)
    and float8 `b * b_scale` (in `b_dtype`), accumulated in float32, divided by both scales and
    returned in `out_dtype`.

    One dispatcher op, fed and returning high-precision tensors: activation-checkpoint policies and
    AOTAutograd (scan) see one matmul, and no float8 tensor is ever saved for the backward pass
    (scan cannot carry float8 residuals). This body upcasts the float8 operands: the reference
    used off XLA."""
    return _float8_dot(_upcast_dot, a, b, a_scale, b_scale, a_dims, b_dims, a_dtype, b_dtype, out_dtype)


@float8_dot.register_kernel("xla")
def _float8_dot_xla(a, b, a_scale, b_scale, a_dims, b_dims, a_dtype, b_dtype, out_dtype):
    """On XLA: one HLO `dot` with float8 operands and a float32 result."""
    from torchtitan_xla import runtime

    dot_f32 = runtime.kernels.dot_f32

    return _float8_dot(dot_f32, a, b, a_scale, b_scale, a_dims, b_dims, a_dtype, b_dtype, out_dtype)


@float8_dot.register_kernel("cuda")
def _float8_dot_scaled_mm(a, b, a_scale, b_scale, a_dims, b_dims, a_dtype, b_dtype, out_dtype):
    """On GPUs: torch._scaled_mm (the native runtime, on each process's blocks under DTensor). The
    CPU keeps the upcast body: its _scaled_mm is a reference loop, hundreds of times slower
    (docs/float8.md), with the same values."""
    return _float8_dot(_scaled_mm_dot, a, b, a_scale, b_scale, a_dims, b_dims, a_dtype, b_dtype, out_dtype)


@float8_dot.register_fake
def _float8_dot_fake(a, b, a_scale, b_scale, a_dims, b_dims, a_dtype, b_dtype, out_dtype):
    shape = ([n for d, n in enumerate(a.shape) if d not in a_dims]
             + [n for d, n in enumerate(b.shape) if d not in b_dims])
    return a.new_empty(shape, dtype=out_dtype)


# The op as dispatch modes (activation-checkpoint policies) see it.
FLOAT8_DOT_OP = torch.ops.torchtitan_xla.float8_dot.default


def _float8_dot_shardings(a, b, a_scale, b_scale, a_dims, b_dims, *dtypes):
    """DTensor's rule for the op, per mesh axis: a free dimension of either operand sharded (the
    other operand whole) gives the output sharded on it; both sharded on a contracted pair gives
    partial sums; the scales are whole-tensor values, replicated. Each process then runs the op's
    own kernel on its blocks (DTensor gathers what no rule takes)."""
    def inputs(pa, pb):
        return [pa, pb, Replicate(), Replicate(), None, None, None, None, None]

    a_free = [d for d in range(a.ndim) if d not in a_dims]
    b_free = [d for d in range(b.ndim) if d not in b_dims]
    return ([([Replicate()], inputs(Replicate(), Replicate()))]
            + [([Shard(i)], inputs(Shard(d), Replicate())) for i, d in enumerate(a_free)]
            + [([Shard(len(a_free) + i)], inputs(Replicate(), Shard(d))) for i, d in enumerate(b_free)]
            + [([Partial()], inputs(Shard(da), Shard(db))) for da, db in zip(a_dims, b_dims)])


def _register_float8_dot_sharding() -> None:
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._op_schema import RuntimeSchemaInfo
    from torch.distributed.tensor.experimental import register_sharding

    register_sharding(FLOAT8_DOT_OP)(_float8_dot_shardings)
    # register_sharding keys its rule cache on the tensors' layouts alone (it finds no int
    # argument): key it on the contracted dims and dtypes too.
    DTensor._op_dispatcher.sharding_propagator.op_to_schema_info[FLOAT8_DOT_OP] = RuntimeSchemaInfo(4)


_register_float8_dot_sharding()


class _Float8Matmul(torch.autograd.Function):
    """x @ weight.T with float8 operands in both passes; see the module docstring."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, out_dtype: torch.dtype):
        x_scale, w_scale = tensorwise_scale(x, E4M3), tensorwise_scale(weight, E4M3)
        # Like torchao, keep the high-precision operands (and their scales) for the backward pass.
        ctx.save_for_backward(x, weight, x_scale, w_scale)
        return float8_dot(x, weight, x_scale, w_scale, [x.dim() - 1], [1], E4M3, E4M3, out_dtype)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, weight, x_scale, w_scale = ctx.saved_tensors
        g_scale = tensorwise_scale(grad, E5M2)
        last = grad.dim() - 1
        grad_x = float8_dot(grad, weight, g_scale, w_scale, [last], [0], E5M2, E4M3, x.dtype)
        leading = list(range(last))  # batch and sequence: summed over for the weight gradient
        grad_w = float8_dot(grad, x, g_scale, x_scale, leading, leading, E5M2, E4M3, weight.dtype)
        return grad_x, grad_w, None


class Float8Linear(nn.Linear):
    """nn.Linear with float8 matmuls. Same parameters, names and state dict as nn.Linear, so
    sharding plans, checkpoints and HF export treat it as one."""

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> Float8Linear:
        with torch.device("meta"):
            new = cls(linear.in_features, linear.out_features, bias=False)
        new.weight = linear.weight  # the same Parameter objects, wherever they live
        new.bias = linear.bias
        return new

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Under autocast the output has the autocast dtype, as nn.Linear's would; the weight is
        # cast to float8 straight from float32.
        device_type = x.device.type
        out_dtype = (torch.get_autocast_dtype(device_type)
                     if torch.is_autocast_enabled(device_type) else x.dtype)
        out = _Float8Matmul.apply(x, self.weight, out_dtype)
        return out if self.bias is None else out + self.bias.to(out_dtype)

    def extra_repr(self) -> str:
        return super().extra_repr() + ", float8=tensorwise"


# ---- model conversion --------------------------------------------------------------------------


def _why_skipped(name: str, linear: nn.Linear, filter_fqns: list[str]) -> str | None:
    if name == "output":
        return "output projection kept in high precision"
    hits = [f for f in filter_fqns if f in name]
    if hits:
        return f"filter_fqns {hits[0]!r}"
    if linear.in_features % DIM_MULTIPLE or linear.out_features % DIM_MULTIPLE:
        return f"{linear.in_features}x{linear.out_features} not multiples of {DIM_MULTIPLE}"
    return None


def _pattern(name: str) -> str:
    return re.sub(r"(^|\.)\d+(?=\.|$)", r"\1*", name)  # layers.3.attention.wq -> layers.*.attention.wq


def _grouped(names: list[str], every: list[str]) -> str:
    """`names` for a log line: a pattern such as 'layers.*.attention.wq' when it stands for all
    the layers in `every` it matches, the names themselves otherwise."""
    out = []
    for pattern in dict.fromkeys(map(_pattern, names)):
        members = [n for n in names if _pattern(n) == pattern]
        if len(members) > 1 and len(members) == sum(_pattern(n) == pattern for n in every):
            out.append(pattern)
        else:
            out.extend(members)
    return ", ".join(out)


def convert_to_float8_training(model: nn.Module, config: Float8) -> list[str]:
    """Swap eligible nn.Linear layers of `model` for Float8Linear in place (works on the meta
    device); returns the converted names. Skips `output`, any layer whose name contains an entry
    of `config.filter_fqns`, and layers with a dimension that is not a multiple of 16. Logs one
    summary line; raises ConfigError if a filter matches nothing or no layer is left."""
    if not config.enable_float8_linear:
        return []
    linears = {n: m for n, m in model.named_modules() if type(m) is nn.Linear}
    for f in config.filter_fqns:
        if not any(f in n for n in linears):
            raise ConfigError(f"[float8] filter_fqns: {f!r} matches no linear layer (names look "
                              f"like {next(iter(linears), 'none')!r})")
    converted, skipped = [], {}
    for name, linear in linears.items():
        reason = _why_skipped(name, linear, config.filter_fqns)
        if reason:
            skipped.setdefault(reason, []).append(name)
            continue
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        setattr(parent, child, Float8Linear.from_linear(linear))
        converted.append(name)
    why = "; ".join(f"{_grouped(names, list(linears))} ({reason})" for reason, names in skipped.items())
    if not converted:
        raise ConfigError(f"[float8] enable_float8_linear = true but no linear layer is eligible: "
                          f"{why or 'the model has no nn.Linear'}")
    logger.info(f"Float8 ({config.recipe_name}): {len(converted)} of {len(linears)} linear layers "
                f"converted ({_grouped(converted, list(linears))})" + (f"; skipped {why}" if why else ""))
    return converted

