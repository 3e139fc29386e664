"""torch_xla's own ops and kernels that the model-side code calls through here: the Pallas
attention and grouped-matmul kernels (TPU only), the float8 dot with a float32 result,
activation-checkpoint fences and host offload, and scan over layers (through torch_xla's JAX bridge)."""

from __future__ import annotations

import os
import types
from collections.abc import Callable

import torch

from torchtitan_xla.errors import ConfigError
from torchtitan_xla.runtime.common import python_scan


def attention_kernel(kind: str, device_type: str) -> str | None:
    """What runs for `[model] attention = kind` (flash or splash) here (TPUs only); None: nothing."""
    if device_type != "TPU":
        return None
    return f"torch_xla's Pallas {kind} attention kernel (not verified on TPU by this project)"


def flash_attention(q, k, v, *, mesh, spec, segment_ids=None, window: int = 0) -> torch.Tensor:
    """Causal Pallas flash attention over [batch, heads, seq, head_dim], sharded by `spec`, within
    the documents of `segment_ids` [batch, seq] if given. TPU only; not verified on TPU by this
    project. torch_xla 2.9's has no sliding window (the config refuses one)."""
    from torch_xla.experimental.custom_kernel import flash_attention as kernel

    if window:
        raise NotImplementedError("torch_xla's Pallas flash attention has no sliding window")

    return kernel(q, k, v, causal=True, q_segment_ids=segment_ids, kv_segment_ids=segment_ids,
                  sm_scale=q.shape[-1] ** -0.5, partition_spec=spec, mesh=mesh)


def splash_attention(q, k, v, *, mesh, spec, segment_ids=None, window: int = 0) -> torch.Tensor:
    """Causal Pallas splash attention, as `flash_attention`; a sliding `window` through its local
    mask, whose window (left, right) counts the keys besides the query's own: window - 1 to the
    left sees `window` keys. TPU only; not verified on TPU."""
    from torch_xla.experimental.splash_attention import SplashAttentionConfig
    from torch_xla.experimental.splash_attention import splash_attention as kernel

    block = min(2048, q.shape[-2])  # the kernel's default blocks, capped at the sequence
    blocks = {f: block for f in ("sa_block_q", "sa_block_kv", "sa_block_kv_compute", "sa_block_q_dkv",
                                 "sa_block_kv_dkv", "sa_block_kv_dkv_compute", "sa_block_q_dq",
                                 "sa_block_kv_dq")}
    config = SplashAttentionConfig(mesh=str(mesh), qkv_partition_spec=spec,
                                   segment_ids_partition_spec=(spec[0], None), **blocks,
                                   attentiontype_local_sliding=bool(window),
                                   slide_window_size=window - 1 if window else None)
    # The splash kernel does not scale the scores itself.
    return kernel(q * q.shape[-1] ** -0.5, k, v, config.to_json(), decoder_segment_ids=segment_ids,
                  causal=True)


def grouped_mm(lhs: torch.Tensor, rhs: torch.Tensor, group_sizes: torch.Tensor) -> torch.Tensor:
    """torch_xla's Pallas grouped matmul (megablox gmm, with its tgmm backward): rows of lhs [m, k]
    in consecutive groups of group_sizes [E] (int32), group e times rhs[e] [k, n]. TPU only; its
    tiles (512) must divide m. Not verified on TPU by this project."""
    from torch_xla.experimental.custom_kernel import GMM

    if torch.is_autocast_enabled("xla"):  # autocast does not reach into a custom autograd Function
        dtype = torch.get_autocast_dtype("xla")
        lhs, rhs = lhs.to(dtype), rhs.to(dtype)
    return GMM.apply(lhs, rhs, group_sizes)


def dot_f32(a: torch.Tensor, b: torch.Tensor, a_dims: list[int], b_dims: list[int]) -> torch.Tensor:
    """One HLO `dot` contracting `a_dims` with `b_dims`, accumulated and returned in float32
    whatever the operands' dtype (float8 operands stay float8 in the dot). torch.matmul on float8
    tensors rounds its result to float8, and torch._scaled_mm falls back to the CPU on XLA.

    On the XLA CPU backend, bfloat16 and float16 operands enter the dot as float32 (see
    `CPU_UPCAST_DOT_DTYPES`); on a TPU they stay 16-bit, the matrix units' bf16 x bf16 -> f32."""
    import torch_xla

    if a.dtype in CPU_UPCAST_DOT_DTYPES or b.dtype in CPU_UPCAST_DOT_DTYPES:
        if _on_cpu_backend():
            # 16-bit products are exact in f32, so this is the same sum (up to its order).
            a, b = a.float(), b.float()
    return torch_xla._XLAC._xla_dot_general(a, b, ((a_dims, b_dims), ()),
                                            preferred_element_type=torch.float32)


# XLA CPU (torch_xla 2.9) leaves a bf16 x bf16 -> f32 dot unconverted where it expects XNNPACK to
# run it (only on CPUs with AVX512_BF16), then may emit it as an Eigen DotThunk, which has kernels
# for same-type operands and result only: "Unsupported element type for DotThunk::Execute: BF16 x
# BF16 = F32" at run time (docs/optimizers.md). Upcast operands are what XLA CPU itself makes of
# such dots on every other CPU. Float16 likewise; float8 dots XLA CPU always upcasts itself.
# (XNNPACK is off by this runtime's XLA flags, process.py, unless XLA_FLAGS turns it on.)
CPU_UPCAST_DOT_DTYPES = (torch.bfloat16, torch.float16)


def _on_cpu_backend() -> bool:
    import torch_xla.runtime as xr

    return xr.device_type() == "CPU"


def total_norm(tensors: list[torch.Tensor]) -> torch.Tensor:
    """The 2-norm of all `tensors` together (torch's, as clip_grad_norm_ computes it)."""
    return torch.nn.utils.get_total_norm(tensors)


def checkpoint(fn: Callable, *args):
    """Full activation checkpointing of `fn(*args)` with torch_xla's checkpoint, which also fences
    the recomputation so XLA cannot merge it with the forward pass."""
    from torch_xla.utils.checkpoint import checkpoint as xla_checkpoint

    return xla_checkpoint(fn, *args)


def reentrant_checkpoint(fn: Callable, *args):
    """torch_xla's checkpoint is the reentrant kind already: its inputs saved with
    `save_for_backward` (which saved-tensor hooks see), `fn` run without gradients, then again in the
    backward pass."""
    return checkpoint(fn, *args)


# XLA's CPU compiler has no host-offload pass: it keeps the placement custom calls and then aborts
# the process while compiling them. On the CPU backend the values stay where they are, unless this
# is set (the tests compile the placements, in a process of their own, to read the optimized HLO).
PLACE_ON_CPU_BACKEND = "TORCHTITAN_XLA_COMPILE_HOST_PLACEMENTS"


def offload(t: torch.Tensor) -> torch.Tensor:
    """`t` in the host's memory: torch_xla's `place_to_host` custom call, which the TPU compiler's
    host-offload pass turns into a transfer to pinned host memory."""
    if _on_cpu_backend() and not os.environ.get(PLACE_ON_CPU_BACKEND):
        return t
    from torch_xla.experimental.stablehlo_custom_call import place_to_host

    return place_to_host(t)


def reload(t: torch.Tensor) -> torch.Tensor:
    """`offload`'s tensor back on the device (`place_to_device`)."""
    if _on_cpu_backend() and not os.environ.get(PLACE_ON_CPU_BACKEND):
        return t
    from torch_xla.experimental.stablehlo_custom_call import place_to_device

    return place_to_device(t)


def optimization_barrier_(tensors: list[torch.Tensor]) -> None:
    """XLA may not move computation across this point for these tensors (in place)."""
    import torch_xla.core.xla_model as xm

    xm.optimization_barrier_(tensors)


def enable_torch_checkpoint() -> None:
    """torch's non-reentrant checkpoint looks up `torch.<device type>`, which torch_xla does not
    register; its own error message asks for torch._register_device_module. Only RNG state would
    be read from it, and the callers do not preserve RNG state (the model has no dropout)."""
    if not hasattr(torch, "xla"):
        torch._register_device_module("xla", types.ModuleType("torch.xla"))


def check_torchax() -> None:
    """scan_layers reaches JAX through torchax. torch_xla 2.9's wheel ships an older torchax (0.0.6)
    into the same `torchax/` directory as the torchax wheel; if torch_xla was unpacked last, the
    installed metadata says one version while the old files run, and the scan crashes the process
    (SIGSEGV) instead of raising. Refuse up front with the fix."""
    import importlib.metadata

    try:
        installed = importlib.metadata.version("torchax")
    except importlib.metadata.PackageNotFoundError:
        raise ConfigError("compile.scan_layers = true needs jax and torchax: pip install "
                          "'torch_xla[pallas]==2.9.0' torchax==0.0.13") from None
    try:
        import torchax

        on_disk = torchax.__version__
    except ImportError as e:  # torch_xla's old copy imports flax, which is not installed
        on_disk = f"unimportable ({e})"
    if on_disk != installed:
        raise ConfigError(
            f"compile.scan_layers = true: the torchax files on disk are not the torchax {installed} "
            f"pip installed (torch_xla's wheel overwrote them; found: {on_disk}); restore them with: "
            f"pip install --force-reinstall --no-deps torchax=={installed}")


def scan_layers(layers: list[torch.nn.Module], carry: tuple, partition_fn: Callable) -> tuple:
    """Run structurally identical `layers` as one XLA while loop over their stacked weights; each
    layer maps the `carry` tuple to the next. Activation checkpointing inside is the partitioner's
    choice (`partition_fn`)."""
    from torch_xla.experimental.scan_layers import scan_layers as xla_scan_layers

    return xla_scan_layers(layers, carry, partition_fn=partition_fn, is_layer_pure=True)


def scan(fn: Callable, init, xs):
    """`carry, ys = fn(carry, x)` over the leading dimension of every tensor in `xs` (a tuple),
    outside autograd; ys stacked. On XLA one while loop (torch_xla's scan): one iteration's
    temporaries exist at a time, which an unrolled Python loop does not guarantee (XLA may merge
    or reorder the iterations' matmuls). Elsewhere the same loop in Python."""
    if any(t.device.type == "xla" for t in xs):
        from torch_xla.experimental.scan import scan as xla_scan

        return xla_scan(fn, init, xs)
    return python_scan(fn, init, xs)
