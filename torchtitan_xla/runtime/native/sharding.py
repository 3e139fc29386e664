"""Partition specs as DTensor placements: the same specs the XLA runtime gives XLA as annotations.

A spec names one mesh axis (or a tuple of axes, or None) per tensor dimension; on a DeviceMesh
with the same axis names it is one placement per mesh axis: Shard(d) for the axes on dimension d,
Replicate for the rest. Axes sharing one dimension split it in mesh order, as XLA's tuple does.

Parameters (`distribute_module`) become DTensors of their stored spec. Where the spec shards a
parameter over data-parallel axes (FSDP), reading it gives its compute spec instead: an
all-gather in the forward pass whose backward is the gradient's reduce-scatter (the gradient of
a batch-sharded computation is partial on those axes). This is torchtitan's SimpleFSDP: the
gather is plain DTensor code that torch.compile sees whole, and each parameter keeps its own
spec, dimension and all, so the specs of `parallelisms/` apply unchanged (FSDP2's `fully_shard`
groups parameters per module and pads dimension 0). The model and its names stay as they are:
the gather is a property on the module's class, `_parameters` still holds the DTensor.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.utils._python_dispatch import TorchDispatchMode

from torchtitan_xla.errors import ConfigError


def placements(mesh, spec: Sequence) -> list:
    """One placement per mesh axis for `spec` (an axis of one device, absent from the mesh or
    not, replicates: DTensor would refuse views across a dimension "sharded" over it)."""
    out: list = [Replicate()] * mesh.ndim
    for dim, axes in enumerate(spec):
        for axis in (axes,) if isinstance(axes, str) else (axes or ()):
            if _size(mesh, axis) > 1:
                out[mesh.mesh_dim_names.index(axis)] = Shard(dim)
    return out


def _size(mesh, axis: str) -> int:
    """Devices along `axis`: 1 for an axis the mesh leaves out (build_mesh)."""
    names = mesh.mesh_dim_names
    return mesh.size(names.index(axis)) if axis in names else 1


def build_mesh(shape: Sequence[int], axis_names: Sequence[str], *, device_type: str,
               num_slices: int = 1, slice_axis: int = 0):
    """The DeviceMesh of the axes longer than one device (one axis if none is): DTensor's
    sharding propagation enumerates strategies over every mesh axis, per op while torch.compile
    traces (no cache there): with six axes, five of one device, that was most of a compile."""
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

    _register_op_rules()
    mesh = ", ".join(f"{a} {n}" for a, n in zip(axis_names, shape))
    kept = [i for i, n in enumerate(shape) if n > 1] or [len(shape) - 1]
    names, sizes = tuple(axis_names[i] for i in kept), tuple(shape[i] for i in kept)
    if device_type.lower() == "tpu":
        # TorchTPU's rank layout for the slice's topology (axes ordered by growing traffic, as
        # MESH_AXES are); several slices split axis `slice_axis` (dp_replicate) over the
        # data-centre network, as the XLA runtime's HybridMesh. Not verified on a TPU.
        from torch.tpu.distributed import topology_aware_mesh

        dcn = (tuple(num_slices if i == slice_axis else 1 for i in range(len(shape)))
               if num_slices > 1 else None)
        try:
            ranks = topology_aware_mesh(tuple(shape), dcn_mesh_shape=dcn)
        except (ValueError, RuntimeError) as e:
            first = (str(e).strip().splitlines() or [type(e).__name__])[0]
            raise ConfigError(f"[parallelism] the mesh ({mesh}) does not fit this TPU slice "
                              f"({num_slices} slice(s)): torch-tpu says: {first}") from None
        return DeviceMesh("tpu", torch.as_tensor(ranks).reshape(sizes), mesh_dim_names=names)
    if num_slices > 1:
        raise ConfigError(f"[parallelism] num_slices = {num_slices}: several slices are TPU "
                          f"slices; this run's devices are {device_type}")
    return init_device_mesh(device_type.lower(), sizes, mesh_dim_names=names)


def mark_sharding(t: torch.Tensor, mesh, spec: Sequence, *, compute: Sequence | None = None) -> None:
    """Parameters are recorded, not changed: `distribute_module` makes them DTensors once every
    transform has given its spec (the caller keeps it in `_partition_spec`)."""
    if compute is not None:
        t._compute_spec = tuple(compute)


def place(t: torch.Tensor, mesh, spec: Sequence) -> torch.Tensor:
    """`t`, the whole value on every process, as a DTensor of `spec` (each keeps its block; no
    communication)."""
    return distribute_tensor(t, mesh, placements(mesh, spec), src_data_rank=None)


_gathering = True  # off while initialising: init writes the stored parameter, not a gathered copy


class _Gathered:
    """The property that gives a parameter in its compute layout (`module._compute[name]`) when
    the module reads it."""

    def __init__(self, name: str):
        self.name = name

    def __get__(self, module, owner=None):
        if module is None:
            return self
        param = module._parameters[self.name]
        if not _gathering:
            return param
        mesh, target = module._compute[self.name]
        kind = param.device.type
        if param.dim() < 2 or not torch.is_autocast_enabled(kind):
            return param.redistribute(mesh, target)
        # A matrix under autocast: cast where it is sharded and gathered in the compute dtype; its
        # gradient cast to the reduce dtype before it is reduce-scattered ([training]
        # mixed_precision_reduce: parallelisms/compute_dtype.py; the embedding's float32:
        # models/llama/layers.py), as torchtitan's FSDP2 MixedPrecisionPolicy does.
        dtype = torch.get_autocast_dtype(kind)
        embedding = isinstance(module, nn.Embedding)
        reduce = param.dtype if embedding else getattr(module, "_reduce_dtype", param.dtype)
        return param.redistribute(mesh, target, forward_dtype=dtype, backward_dtype=reduce)

    def __set__(self, module, value):
        module._parameters[self.name] = value


# One subclass per (class, parameter names), shared by every module of that kind: torch.compile
# guards on a module's class, and a class per module gave each block its own graph (the 9th
# block then hit dynamo's recompile limit).
_CLASSES: dict[tuple, type] = {}


def _gathering_class(cls: type, names: tuple[str, ...]) -> type:
    key = (cls, names)
    if key not in _CLASSES:
        _CLASSES[key] = type(cls.__name__, (cls,), {n: _Gathered(n) for n in names})
    return _CLASSES[key]


def distribute_module(model: nn.Module, mesh) -> None:
    """Every parameter becomes a DTensor Parameter of its `_partition_spec` (replicated if none),
    read in its `_compute_spec` layout where it has one (FSDP's gather)."""
    for module in list(model.modules()):
        compute = {}
        for name, p in list(module._parameters.items()):
            if p is None or isinstance(p, DTensor):
                continue
            spec = getattr(p, "_partition_spec", (None,) * p.dim())
            d = nn.Parameter(place(p.detach(), mesh, spec), requires_grad=p.requires_grad)
            d._partition_spec = spec
            module._parameters[name] = d
            # Read through a redistribute even where the layout stays: its backward brings the
            # gradient to the parameter's layout (a replicated norm weight's gradient is otherwise
            # left partial over tp, and every tensor of its optimizer step with it).
            compute[name] = (mesh, placements(mesh, getattr(p, "_compute_spec", None) or spec))
        if compute:
            module._compute = compute
            module.__class__ = _gathering_class(module.__class__, tuple(compute))


def constraint(mesh, spec: Sequence, *, gradient: bool = True) -> Callable[[torch.Tensor], torch.Tensor]:
    """An activation laid out by `spec` (its gradient follows: redistribute's backward, whatever
    `gradient` says: a DTensor's layout is its own)."""
    target = placements(mesh, spec)
    return lambda t: t.redistribute(mesh, target) if isinstance(t, DTensor) else t


def batched_over(axis: str):
    """(XLA's: constraints on vmap-batched pipeline stages.) Pipeline parallelism runs on the XLA
    runtime only (config/checks.py refuses it here): nothing to do."""
    return contextlib.nullcontext()


def input_sharding(mesh, spec: Sequence, *, hosts: int = 1) -> Callable[[torch.Tensor], torch.Tensor]:
    """Batches as DTensors of `spec`: each process loads its own block (`data_shard`) of the
    `hosts` blocks of the global batch; with `hosts` = 1 every process holds the whole batch (as
    evaluation loads it) and keeps its block, with no communication."""
    target = placements(mesh, spec)
    if hosts == 1:
        return lambda t: distribute_tensor(t, mesh, target, src_data_rank=None)
    return lambda t: DTensor.from_local(t, mesh, target, run_check=False)


def data_shard(mesh, axes: Sequence[str], hosts) -> tuple[int, int]:
    """(which block of the global batch this process loads, how many blocks): its coordinate
    over the batch `axes`; processes that differ only on other axes (tp) load the same block."""
    rank, count = 0, 1
    for axis in (a for a in axes if _size(mesh, a) > 1):
        size = _size(mesh, axis)
        rank, count = rank * size + mesh.get_local_rank(axis), count * size
    return rank, count


def whole(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Each DTensor as a plain tensor holding its whole value (partial sums reduced, blocks
    gathered): values of different layouts can then be stacked."""
    return [t.full_tensor() if isinstance(t, DTensor) else t for t in tensors]


def copy_sharding(src: torch.Tensor, dst: torch.Tensor) -> None:
    """A DTensor's layout travels with it (`zeros_like` keeps it): nothing to copy."""


def sharding_text(t: torch.Tensor) -> str:
    return f"{t.placements}" if isinstance(t, DTensor) else ""


def per_shard(fn: Callable, mesh, specs: Sequence, out_spec: Sequence, sum_axes: Sequence):
    """`fn` on every process's own blocks (torch's local_map, as jax's shard_map); inputs are
    redistributed to `specs` first. The gradient of an input replicated over a `sum_axes` axis is
    that axis's partial sum (each process saw its block of the batch)."""
    from torch.distributed.tensor import Partial
    from torch.distributed.tensor.experimental import local_map

    def grad_placements(spec):
        split = {a for axes in spec for a in ((axes,) if isinstance(axes, str) else (axes or ()))}
        return tuple(Partial() if axis in sum_axes and axis not in split and mesh.size(i) > 1 else p
                     for i, (axis, p) in enumerate(zip(mesh.mesh_dim_names, placements(mesh, spec))))

    return local_map(fn, out_placements=placements(mesh, out_spec),
                     in_placements=tuple(placements(mesh, s) for s in specs),
                     in_grad_placements=tuple(grad_placements(s) for s in specs), device_mesh=mesh,
                     redistribute_inputs=True)


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose gradient is made contiguous. Redistribute's backward gives the gradient the
    strides of its input (here a transposed view) over a block that is contiguous; the transpose's
    backward then makes a DTensor whose strides disagree with its block, and the view after it
    fails (torch 2.9)."""

    @staticmethod
    def forward(ctx, t):
        return t.view_as(t)

    @staticmethod
    def backward(ctx, grad):
        return grad.contiguous()


def run_locally(module: nn.Module, mesh, specs: Sequence, out_spec: Sequence,
                keyword_specs: dict[str, Sequence] | None = None) -> None:
    """`module`'s forward on each process's own blocks of its tensor arguments (laid out by
    `specs`, one per argument, and `keyword_specs` by keyword), returning blocks of `out_spec`:
    torch's local_map. For code that is independent per block (attention per sequence and head)
    and whose ops DTensor has no rules for."""
    module._local = (mesh, [placements(mesh, s) for s in specs], placements(mesh, out_spec),
                     {k: placements(mesh, s) for k, s in (keyword_specs or {}).items()})
    module.__class__ = _local_class(module.__class__)


_LOCAL_CLASSES: dict[type, type] = {}


def _local_class(cls: type) -> type:
    """`cls` with its forward run by local_map; one per class, shared by every block, and reading
    its layouts from the instance (a per-module closure gave each block its own compiled graph)."""
    if cls not in _LOCAL_CLASSES:
        from torch.distributed.tensor.experimental import local_map

        def forward(self, *args, **kwargs):
            mesh, ins, out, keyword_ins = self._local
            names, n = list(kwargs), len(args)  # local_map takes positional arguments only
            local = local_map(lambda *a: cls.forward(self, *a[:n], **dict(zip(names, a[n:]))),
                              out_placements=out, device_mesh=mesh, redistribute_inputs=True,
                              in_placements=tuple(ins[:n]) + tuple(keyword_ins[k] for k in names))
            return local(*(_ContiguousGrad.apply(a) if isinstance(a, DTensor) else a
                           for a in (*args, *kwargs.values())))

        _LOCAL_CLASSES[cls] = type(cls.__name__, (cls,), {"forward": forward})
    return _LOCAL_CLASSES[cls]


class FullTensorInit(TorchDispatchMode):
    """Random initialisation of a DTensor as if it were one tensor on one device: the whole
    tensor is drawn on the host from torch's generator and each process keeps its block. (DTensor's
    own random ops draw per block, from a per-device generator the CPU lacks: every block of a
    sharded parameter got the same numbers.) One parameter's full size at a time on the host."""

    def __enter__(self):
        global _gathering
        _gathering = False
        return super().__enter__()

    def __exit__(self, *exc):
        global _gathering
        _gathering = True
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        target = args[0] if args else None
        if torch.Tag.nondeterministic_seeded in func.tags and isinstance(target, DTensor):
            if not func._schema.name.endswith("_"):  # only in-place fills have a target to cut
                raise NotImplementedError(f"{func} on a DTensor while initialising: use an "
                                          f"in-place init (nn.init.*)")
            with torch.no_grad():
                full = torch.empty(target.shape, dtype=target.dtype)
                func(full, *args[1:], **kwargs)
                local = distribute_tensor(full, target.device_mesh, target.placements,
                                          src_data_rank=None).to_local()
                target.to_local().copy_(local)
            return target
        return func(*args, **kwargs)


# DTensor sharding rules that the shared code needs and torch's DTensor lacks or gets wrong, given
# through its public `register_sharding` (once, by `build_mesh`), so that the model stays plain
# PyTorch. `logsumexp` has no rule in torch 2.9 (the MoE router's z-loss; 2.11 has one), nor has
# `logsigmoid` (the preference objectives' loss; pointwise, its saved buffer placed as its input). `select`
# (`x[..., 0]`) on a DTensor replicated on every axis rewrites the *input's* shape to the output's
# in torch 2.9 (its rule returns the input spec, then fills in the output's shape:
# pytorch/pytorch#179290; right in 2.11), so any later use of that tensor fails. Each rule: the
# reduced or selected dimension whole, any other may stay sharded.
_rules_registered = False


def _sharded_dims_kept(ndim: int, removed: set[int], keepdim: bool):
    """One rule per dimension that may stay sharded: ([output placement], [input placement, ...])."""
    rules, shift = [([Replicate()], [Replicate(), None, None])], 0
    for d in range(ndim):
        if d in removed:
            shift += 0 if keepdim else 1
        else:
            rules.append(([Shard(d - shift)], [Shard(d), None, None]))
    return rules


def _pointwise(ndim: int, outputs: int, inputs: int):
    """Every output and input placed alike: replicated, or sharded on the same dimension."""
    return [([p] * outputs, [p] * inputs) for p in (Replicate(), *(Shard(d) for d in range(ndim)))]


def _register_op_rules() -> None:
    global _rules_registered
    if _rules_registered:
        return
    from torch.distributed.tensor._op_schema import RuntimeSchemaInfo
    from torch.distributed.tensor.experimental import register_sharding

    aten, propagator = torch.ops.aten, DTensor._op_dispatcher.sharding_propagator
    if aten.logsumexp.default not in propagator.op_strategy_funcs:
        register_sharding(aten.logsumexp.default)(lambda x, dim, keepdim=False: _sharded_dims_kept(
            x.ndim, {d % x.ndim for d in ((dim,) if isinstance(dim, int) else dim)}, keepdim))
        # register_sharding keys its cache on the arguments from the first int one on; `dim` is
        # a list, so one dim's rule would serve another: key on every argument after x.
        propagator.op_to_schema_info[aten.logsumexp.default] = RuntimeSchemaInfo(1)
    if aten.log_sigmoid_forward.default not in propagator.op_strategy_funcs:
        register_sharding(aten.log_sigmoid_forward.default)(lambda x: _pointwise(x.ndim, 2, 1))
        register_sharding(aten.log_sigmoid_backward.default)(lambda grad, x, buffer: _pointwise(x.ndim, 1, 3))
    if torch.torch_version.TorchVersion(torch.__version__) < (2, 11):
        register_sharding(aten.select.int)(
            lambda x, dim, index: _sharded_dims_kept(x.ndim, {dim % x.ndim}, keepdim=False))
    _rules_registered = True
