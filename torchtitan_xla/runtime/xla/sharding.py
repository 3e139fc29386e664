"""SPMD shardings: the device mesh, partition-spec annotations on tensors, and constraints on
activations. A partition spec names one mesh axis (or a tuple of axes, or None) per dimension;
XLA partitions the whole graph from these annotations and inserts the collectives."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence

import numpy as np
import torch

from torchtitan_xla.runtime import Spec


def build_mesh(shape: Sequence[int], axis_names: Sequence[str], *, device_type: str,
               num_slices: int = 1, slice_axis: int = 0):
    """The device mesh. On TPU, torch_xla's HybridMesh orders devices by the physical (ICI)
    topology and puts the slices on the outer part of axis `slice_axis`; elsewhere an ordinary
    mesh of the same logical shape, slices being consecutive blocks of devices."""
    import torch_xla.distributed.spmd as xs

    if device_type == "TPU":
        dcn = tuple(num_slices if i == slice_axis else 1 for i in range(len(shape)))
        ici = tuple(n // d for n, d in zip(shape, dcn))
        return xs.HybridMesh(ici_mesh_shape=ici, dcn_mesh_shape=dcn, axis_names=tuple(axis_names))
    return xs.Mesh(np.arange(int(np.prod(shape))), tuple(shape), tuple(axis_names))


def mark_sharding(t: torch.Tensor, mesh, spec: Spec, *, compute: Spec | None = None) -> None:
    """Annotate `t` with `spec`. An earlier annotation is cleared first: without functionalization
    torch_xla refuses to overwrite one. (`compute`, the layout a use needs, is XLA's to find.)"""
    import torch_xla.distributed.spmd as xs

    if is_sharded(t):
        xs.clear_sharding(t)
    if any(axis is not None for axis in spec):
        xs.mark_sharding(t, mesh, spec)


def place(t: torch.Tensor, mesh, spec: Spec) -> torch.Tensor:
    """`t` (the whole value) annotated with `spec`."""
    mark_sharding(t, mesh, spec)
    return t


def distribute_module(model: torch.nn.Module, mesh) -> None:
    """The parameters carry their annotations already."""


def whole(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """The tensors as they are: a whole value is what every XLA tensor means."""
    return tensors


def run_locally(module: torch.nn.Module, mesh, specs: Sequence[Spec], out_spec: Spec,
                keyword_specs: dict[str, Spec] | None = None) -> None:
    """XLA partitions any module by itself: it stays as it is."""


def data_shard(mesh, axes: Sequence[str], hosts) -> tuple[int, int]:
    """(which block of the global batch this process loads, how many blocks): one per host; the
    input sharding spreads a host's block over its devices."""
    return hosts.rank, hosts.count


def is_sharded(t: torch.Tensor) -> bool:
    import torch_xla

    return torch_xla._XLAC._get_xla_op_sharding(t) is not None


def copy_sharding(src: torch.Tensor, dst: torch.Tensor) -> None:
    """Give `dst` (a fresh tensor of the same shape) the sharding of `src`, if any."""
    import torch_xla

    if src.device.type != "xla":
        return
    sharding = torch_xla._XLAC._get_xla_op_sharding(src)
    if sharding is not None:
        torch_xla._XLAC._xla_mark_sharding(dst, sharding)


def sharding_text(t: torch.Tensor) -> str:
    """The sharding as XLA prints it ("{devices=[4,1,2]0,2,4,6,1,3,5,7 last_tile_dim_replicate}";
    "" for an unannotated tensor not yet materialised)."""
    import torch_xla

    return torch_xla._XLAC._get_xla_sharding_spec(t)


def constraint(mesh, spec: Spec, *, gradient: bool = True) -> Callable[[torch.Tensor], torch.Tensor]:
    """A sharding constraint on an activation, and on its gradient in the backward pass unless
    `gradient` is false (the gradient is then left to the partitioner). Inside `batched_over`,
    a tensor batched by torch.vmap has its vmapped dimension split over that axis."""
    import torch_xla.distributed.spmd as xs

    def constrain(t: torch.Tensor) -> torch.Tensor:
        if _vmapped_axis and torch._C._functorch.is_batchedtensor(t):
            return _BatchedConstraint.apply(t, mesh, spec, gradient)
        # A traced stand-in (scan traces the block through a tensor subclass) takes only the op.
        if gradient or type(t) is not torch.Tensor:
            return xs.mark_sharding_with_gradients(t, mesh, spec)
        xs.mark_sharding(t, mesh, spec)
        return t

    return constrain


_vmapped_axis: list[str] = []


@contextlib.contextmanager
def batched_over(axis: str):
    """Constraints met inside this block on tensors batched by torch.vmap (pipeline stages: the
    vmapped dimension is the stage) split that dimension over mesh axis `axis`."""
    _vmapped_axis.append(axis)
    try:
        yield
    finally:
        _vmapped_axis.pop()


class _BatchedConstraint(torch.autograd.Function):
    """A constraint under torch.vmap: its `vmap` rule annotates the whole tensor, the vmapped
    dimension first and split over the `batched_over` axis (torch_xla's annotation has no rule)."""

    @staticmethod
    def forward(t, mesh, spec, gradient):
        import torch_xla.distributed.spmd as xs

        return xs.mark_sharding_with_gradients(t, mesh, spec)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.mesh, ctx.spec, ctx.gradient = inputs[1:]

    @staticmethod
    def backward(ctx, grad):
        import torch_xla.distributed.spmd as xs

        if ctx.gradient:
            grad = xs.mark_sharding_with_gradients(grad, ctx.mesh, ctx.spec)
        return grad, None, None, None

    @staticmethod
    def vmap(info, in_dims, t, mesh, spec, gradient):
        whole = t.movedim(in_dims[0], 0)
        return _BatchedConstraint.apply(whole, mesh, (_vmapped_axis[-1], *spec), gradient), 0


def input_sharding(mesh, spec: Spec, *, hosts: int = 1):
    """How batches are laid out when they reach the device (`runtime.device.to_device`): with
    several hosts each one holds only its slice of the first dimension."""
    import torch_xla.distributed.spmd as xs

    return xs.ShardingSpec(mesh, spec, minibatch=hosts > 1)


def per_shard(fn: Callable, mesh, specs: Sequence[Spec], out_spec: Spec, sum_axes: Spec):
    """`fn` run by every device on its own shards, as jax's shard_map: each input enters as the
    local block of `specs` (a replicated spec: the whole tensor on every device), the output leaves
    as the blocks of `out_spec`. For code the SPMD partitioner cannot split (a Pallas kernel) or
    should not (a sort over the local batch only). Differentiable: the backward pass recomputes
    `fn` on the same blocks; the gradient of a replicated input, partial on each device, is summed
    over the `sum_axes` that split the batch."""
    import torch_xla.distributed.spmd as xs

    def manual(t, spec):
        # A new value (`clone` would alias a parameter's data, whose own sharding this would
        # change; the product inherits the annotation, which is cleared).
        t = t * 1
        if is_sharded(t):
            xs.clear_sharding(t)
        return xs.enable_manual_sharding(t, spec, mesh=mesh).global_tensor

    def full(t, spec, shape):
        return xs.disable_manual_sharding(t, spec, shape, mesh=mesh).global_tensor

    class PerShard(torch.autograd.Function):
        @staticmethod
        def forward(ctx, *tensors):
            ctx.save_for_backward(*tensors)
            # The recomputation in backward runs outside the step's autocast: it re-enters it.
            ctx.autocast = dict(device_type="xla", enabled=torch.is_autocast_enabled("xla"),
                                dtype=torch.get_autocast_dtype("xla"))
            out = fn(*(manual(t, s) for t, s in zip(tensors, specs)))
            return full(out, out_spec, _full_shape(out.shape, out_spec, mesh))

        @staticmethod
        def backward(ctx, grad):
            tensors = ctx.saved_tensors
            local = [manual(t, s).detach().requires_grad_(t.is_floating_point() and ctx.needs_input_grad[i])
                     for i, (t, s) in enumerate(zip(tensors, specs))]
            with torch.enable_grad(), torch.autocast(**ctx.autocast):
                out = fn(*local)
            wanted = [t for t in local if t.requires_grad]
            grads = iter(torch.autograd.grad(out, wanted, manual(grad, out_spec)))
            result = []
            for t, s, loc in zip(tensors, specs, local):
                if not loc.requires_grad:
                    result.append(None)
                elif any(a is not None for a in s):
                    result.append(full(next(grads), s, t.shape))
                else:  # one partial sum per device of the batch axes, added up by the partitioner
                    g = next(grads).unsqueeze(0)
                    shape = (_full_shape((1,), (sum_axes,), mesh)[0], *t.shape)
                    result.append(full(g, (sum_axes, *(None,) * t.dim()), shape).sum(0))
            return tuple(result)

    return lambda *tensors: PerShard.apply(*tensors)


def _full_shape(local: Sequence[int], spec: Spec, mesh) -> tuple[int, ...]:
    sizes = dict(zip(mesh.axis_names, mesh.mesh_shape))
    out = []
    for n, axes in zip(local, spec):
        names = (axes,) if isinstance(axes, str) else (axes or ())
        out.append(n * int(np.prod([sizes[a] for a in names])))
    return tuple(out)
