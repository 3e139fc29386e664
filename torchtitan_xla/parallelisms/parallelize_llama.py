"""Parallelism for the Llama model, applied from outside by module name as partition specs.

Each `apply_*` does one thing to the same module; `parallelize_llama` calls them in order: tensor
parallel -> expert parallel -> activation checkpointing -> FSDP -> scan -> compile. (The attention
kernel is chosen before, beside the model: models/llama/attention_kernels.py.) Every parameter
gets a spec, and activations get specs at module boundaries; the runtime applies them: XLA as
annotations on the (still lazy) tensors, partitioning the whole step from them; the native runtime
as DTensor placements (runtime/native/sharding.py). Nothing here changes a parameter name.
"""

from __future__ import annotations

import fnmatch
import functools

import torch
from torch import nn

from torchtitan_xla import runtime
from torchtitan_xla.config import JobConfig
from torchtitan_xla.config.run_sections import ActivationCheckpoint
from torchtitan_xla.logging import logger
from torchtitan_xla.parallelisms.activation_checkpoint import apply_ac
from torchtitan_xla.parallelisms.chunk_pair_attention import apply_chunk_pair_attention
from torchtitan_xla.parallelisms.compute_dtype import gather_in_compute_dtype
from torchtitan_xla.parallelisms.context_parallel import einsum_linear, project_on_sequence_shards
from torchtitan_xla.parallelisms.parallel_dims import BATCH_AXES, SHARD_AXES, ParallelDims
from torchtitan_xla.parallelisms.pipeline_parallel import apply_pipeline
from torchtitan_xla.parallelisms.ring_attention import apply_ring_attention
from torchtitan_xla.runtime import Spec

# Megatron layout by parameter name. Column-parallel layers split their output features over `tp`,
# row-parallel layers their input features, so each attention / MLP block needs one reduction.
TP_PLAN: dict[str, Spec] = {
    # Hidden dim split, vocab left for FSDP. (The transpose, vocab over tp, gave NaN gradients in
    # TorchPrime's torch_xla runs.)
    "tok_embeddings.weight": (None, "tp"),
    "layers.*.attention.wq.weight": ("tp", None),
    "layers.*.attention.wk.weight": ("tp", None),
    "layers.*.attention.wv.weight": ("tp", None),
    "layers.*.attention.wo.weight": (None, "tp"),
    # gpt-oss: the column-parallel projections' biases and the sinks split by head (wo's bias whole).
    "layers.*.attention.wq.bias": ("tp",),
    "layers.*.attention.wk.bias": ("tp",),
    "layers.*.attention.wv.bias": ("tp",),
    "layers.*.attention.sinks": ("tp",),
    # Latent attention (DeepSeek): the up-projections from the latents split by head like wq; the
    # down-projections to the latents (wq_a, wkv_a) and the latents' norms stay whole.
    "layers.*.attention.wq_b.weight": ("tp", None),
    "layers.*.attention.wkv_b.weight": ("tp", None),
    "layers.*.feed_forward.shared_experts.w1.weight": ("tp", None),
    "layers.*.feed_forward.shared_experts.w3.weight": ("tp", None),
    "layers.*.feed_forward.shared_experts.w2.weight": (None, "tp"),
    "layers.*.feed_forward.w1.weight": ("tp", None),
    "layers.*.feed_forward.w3.weight": ("tp", None),
    "layers.*.feed_forward.w2.weight": (None, "tp"),
    # Mixture-of-experts blocks: every expert's SwiGLU split like the dense one, on its hidden dim
    # (stacked [expert, out, in]); the router stays whole.
    "layers.*.feed_forward.w1": (None, "tp", None),
    "layers.*.feed_forward.w3": (None, "tp", None),
    "layers.*.feed_forward.w2": (None, None, "tp"),
    "layers.*.feed_forward.b1": (None, "tp"),
    "layers.*.feed_forward.b3": (None, "tp"),
    # Vocab-parallel logits: the loss is computed on vocab shards, never on full logits.
    "output.weight": ("tp", None),
}
# The stacked expert weights [expert, ...] that expert parallelism splits on their first dimension.
EXPERT_WEIGHTS = tuple(f"layers.*.feed_forward.{w}" for w in ("w1", "w2", "w3", "b1", "b2", "b3"))


def tp_spec(name: str, ndim: int) -> Spec:
    from torchtitan_xla.lora import split_adapter

    base, adapter = split_adapter(name)
    if adapter is not None:
        # A LoRA adapter splits like its layer: A [r, in] on the layer's input split, B [out, r]
        # on its output split, so the rank-r path needs only the reduction the layer already has.
        out_axis, in_axis = tp_spec(base, 2)
        return (None, in_axis) if adapter == "lora_A" else (out_axis, None)
    for pattern, spec in TP_PLAN.items():
        if fnmatch.fnmatchcase(name, pattern):
            return spec
    return (None,) * ndim  # norms: replicated over tp


def ep_spec(name: str, base: Spec) -> Spec:
    """`base` with the expert dimension of a stacked expert weight on the `ep` axis."""
    if any(fnmatch.fnmatchcase(name, pattern) for pattern in EXPERT_WEIGHTS):
        return ("ep", *base[1:])
    return base


def fsdp_spec(shape: torch.Size, base: Spec, degree: int, axis: str | tuple = "fsdp") -> Spec:
    """Add `axis` (of `degree` devices) to `base` on the largest dimension that is not already
    sharded and divides evenly by `degree` (the lowest such dimension on ties); unchanged if there
    is none."""
    if degree == 1:
        return base
    candidates = [d for d in range(len(shape)) if base[d] is None and shape[d] % degree == 0]
    if not candidates:
        return base
    dim = max(candidates, key=lambda d: (shape[d], -d))
    return tuple(axis if d == dim else a for d, a in enumerate(base))


def fsdp_axes(base: Spec, parallel_dims: ParallelDims) -> tuple[str | tuple, int]:
    """(FSDP's axis, its size) for a parameter with spec `base`: `fsdp` x `ep` x `cp` for dense
    weights, `fsdp` x `cp` for expert weights, which `ep` already splits (axes of one device left
    out, so a spec names only the axes that split it)."""
    sizes = {"fsdp": parallel_dims.dp_shard, "ep": parallel_dims.ep, "cp": parallel_dims.cp}
    axes = [a for a in SHARD_AXES if a == "fsdp" or (sizes[a] > 1 and a not in base)]
    degree = 1
    for a in axes:
        degree *= sizes[a]
    return (axes[0] if len(axes) == 1 else tuple(axes)), degree


def param_specs(model: nn.Module, parallel_dims: ParallelDims) -> dict[str, Spec]:
    """The spec of every parameter, computed from names and shapes only (works on meta tensors):
    what apply_tp + apply_ep + apply_fsdp assign. Used by the memory estimate and the tests."""
    specs = {}
    for name, p in model.named_parameters():
        base = tp_spec(name, p.dim()) if parallel_dims.tp > 1 else (None,) * p.dim()
        if parallel_dims.ep > 1:
            base = ep_spec(name, base)
        axis, degree = fsdp_axes(base, parallel_dims)
        specs[name] = fsdp_spec(p.shape, base, degree, axis)
    return specs


def partition_spec(param: torch.Tensor) -> Spec:
    """The spec the apply_* functions gave this parameter (replicated if none)."""
    return getattr(param, "_partition_spec", (None,) * param.dim())


def shard_param(param: torch.Tensor, mesh, spec: Spec, *, compute: Spec | None = None) -> None:
    """Give `param` `spec` (replacing an earlier transform's: FSDP extends TP's) and remember it, so
    later transforms can extend it. `compute`: the layout the forward pass reads it in, where that
    differs (FSDP: gathered over its data-parallel axes; XLA finds this itself)."""
    runtime.mark_sharding(param, mesh, spec, compute=compute)
    param._partition_spec = spec


def apply_tp(model: nn.Module, mesh, parallel_dims: ParallelDims) -> None:
    """Megatron tensor parallelism: parameters follow TP_PLAN (attention on head shards, logits on
    vocab shards). Sequence parallelism between blocks comes from `apply_activation_sharding`."""
    for name, param in model.named_parameters():
        shard_param(param, mesh, tp_spec(name, param.dim()))


def apply_ep(model: nn.Module, mesh) -> None:
    """Expert parallelism: each stacked expert weight split over `ep` on its expert dimension (on
    top of TP's split of its hidden dimension), and the tokens moved to their experts' devices.

    The MoE layer dispatches each device's own tokens into [expert, batch, slot, dim] slots
    (`expert_inputs`); constraining that tensor first as the batch is split (every expert's slots
    of this device's sequences), then by expert over `ep` (this device's experts, the slots of
    every sequence of its `ep` group) is a reshard the SPMD partitioner makes an all-to-all. The
    experts' outputs go back the same way (`expert_outputs`), and the gradients in reverse."""
    from torchtitan_xla.models.llama.moe import MoE

    for name, param in model.named_parameters():
        spec = ep_spec(name, partition_spec(param))
        if spec != partition_spec(param):
            shard_param(param, mesh, spec)
    non_expert = tuple(a for a in BATCH_AXES if a != "ep")
    by_batch = runtime.constraint(mesh, (None, BATCH_AXES, None, None))
    by_expert = runtime.constraint(mesh, ("ep", non_expert, None, None))
    for moe in (m for m in model.modules() if isinstance(m, MoE)):
        moe.expert_inputs.register_forward_hook(lambda m, args, out: by_expert(by_batch(out)))
        moe.expert_outputs.register_forward_hook(lambda m, args, out: by_batch(by_expert(out)))


def apply_activation_sharding(model: nn.Module, mesh, seq: str | None = None, ring: bool = False,
                              pp: bool = False) -> None:
    """Constrain activations at module boundaries, on every mesh: the batch over the data-parallel
    axes; the residual stream between blocks split along the sequence over `tp` (norms and residual
    adds then run on sequence shards, and XLA turns the row-parallel reductions into
    reduce-scatters); attention's q, k, v on head shards; logits on vocab shards.

    Without them XLA's sharding propagation is free to give a projection of an FSDP-sharded weight
    a feature-sharded output, which it then computes by all-gathering the activations of the whole
    global batch instead of the weight (the collectives audit, docs/plan.md, found this for wk).

    Context parallelism (`seq` = "cp"): every activation is split along the sequence over `cp` as
    well (outside `tp`'s split), except the keys and values attention reads, whole on every device:
    XLA all-gathers them over `cp` in the forward pass and reduce-scatters their gradients. With
    `ring` attention they stay split too: the attention module passes them around (ring_attention.py).

    Pipeline parallelism (`pp`): outside the stages each stage's devices take 1/pp of every rank's
    sequences (replicated, XLA split the output layer's weights over the idle pp devices)."""
    # [batch, seq, dim]
    seq_sharded = runtime.constraint(mesh, (BATCH_AXES, (seq, "tp") if seq else "tp", None))
    # The norms feed column-parallel layers, which need whole sequences: Megatron-SP's all-gather.
    seq_whole = gather_in_compute_dtype(runtime.constraint(mesh, (BATCH_AXES, seq, None)), seq_sharded)
    # [batch, heads, seq, head_dim]: the queries (and the output) on this device's part of the
    # sequence, the keys and values of all of it.
    queries = runtime.constraint(mesh, (BATCH_AXES, "tp", seq, None))
    # Whole keys and values in the forward pass only: their gradients, partial sums over the cp
    # devices, are reduce-scattered where the projections' outputs are constrained to sequence
    # shards. (A constraint on the gradient here made XLA all-reduce them whole, and under
    # grouped-query attention at the repeated heads' width.)
    keys = queries if ring else runtime.constraint(mesh, (BATCH_AXES, "tp", None, None), gradient=not seq)
    outer = (*BATCH_AXES, "pp") if pp else BATCH_AXES  # the batch outside the blocks
    vocab_sharded = runtime.constraint(mesh, (outer, seq, "tp"))  # [batch, seq, vocab]
    for block in model.layers.values():
        block.register_forward_pre_hook(lambda m, args: (seq_sharded(args[0]), *args[1:]))
        block.register_forward_hook(lambda m, args, out: seq_sharded(out))
        for norm in (block.attention_norm, block.ffn_norm):
            norm.register_forward_hook(lambda m, args, out: seq_whole(out))
        # The row-parallel outputs, partial sums, are reduce-scattered over the sequence before
        # the residual add (and their gradient all-gathered).
        for sublayer in (block.attention, block.feed_forward):
            sublayer.register_forward_hook(lambda m, args, out: seq_sharded(out))
        block.attention.sdpa.register_forward_pre_hook(
            lambda m, args: (queries(args[0]), keys(args[1]), keys(args[2]), *args[3:]))
        if seq:
            block.attention.sdpa.register_forward_hook(lambda m, args, out: queries(out))
            project_on_sequence_shards(block, mesh, seq, tp_spec)
    embedded, outer_whole = (runtime.constraint(mesh, (outer, s, None)) for s in ("tp", seq))
    if pp:
        model.tok_embeddings.register_forward_hook(lambda m, args, out: embedded(out))
    model.norm.register_forward_hook(lambda m, args, out: outer_whole(out))
    model.output.register_forward_hook(lambda m, args, out: vocab_sharded(out))
    if seq:  # nn.Linear or the tied embedding's TiedOutput: both flatten the tokens
        model.output.forward = functools.partial(einsum_linear, model.output)


def apply_local_attention(model: nn.Module, mesh) -> None:
    """Attention (whichever kernel) computes each sequence's heads on their own: the runtime may
    run it on each device's blocks of the batch and heads (native: local tensors, any kernel's
    ops; XLA partitions it by itself)."""
    heads = (BATCH_AXES, "tp", None, None)  # q, k, v and the output: [batch, heads, seq, head_dim]
    tokens = (BATCH_AXES, None)  # document ids and positions
    for block in model.layers.values():  # (gpt-oss's sinks [heads] by keyword)
        runtime.run_locally(block.attention.sdpa, mesh, [heads] * 3 + [tokens] * 2, heads, {"sinks": ("tp",)})


def apply_fsdp(model: nn.Module, mesh, parallel_dims: ParallelDims) -> None:
    """Per-parameter FSDP: shard every parameter over the `fsdp` axis (dense ones over `fsdp` x
    `ep`), on top of its TP / EP spec.

    Gradients and optimizer state take the parameter's sharding; XLA all-gathers each parameter
    where it is used and reduce-scatters its gradient. Over `dp_replicate` parameters are
    replicated (HSDP). The batch is split over every data-parallel axis by the input sharding."""
    unsharded = []
    for name, param in model.named_parameters():
        base = partition_spec(param)
        axis, degree = fsdp_axes(base, parallel_dims)
        spec = fsdp_spec(param.shape, base, degree, axis)
        if spec == base and degree > 1:
            unsharded.append(name)
        shard_param(param, mesh, spec, compute=base)
    if unsharded:
        logger.info(f"FSDP: {len(unsharded)} parameters have no dimension divisible by their "
                    f"shard count and stay replicated: {', '.join(unsharded[:4])}...")


# ---- scan --------------------------------------------------------------------------------------


class _CarryRope(nn.Module):
    """Adapts a block to scan's carry convention: (h, cos, sin[, document_ids, positions]) in and out."""

    def __init__(self, block: nn.Module):
        super().__init__()
        self.block = block

    def forward(self, h, *rest):
        return self.block(h, *rest), *rest


def apply_scan(model: nn.Module, cfg: ActivationCheckpoint) -> None:
    """Run the blocks as one XLA while loop over their stacked weights (torch_xla's scan_layers):
    one block is traced and compiled whatever the depth. Activation checkpointing then happens
    inside the scan through its partitioner: mode "none" saves everything; selective "op" uses the
    min-cut rematerialisation partitioner (keeps matmul outputs, recomputes cheap ops). The config
    rejects other modes with scan."""
    from functorch.compile import default_partition, min_cut_rematerialization_partition

    runtime.kernels.check_torchax()

    partition_fn = default_partition if cfg.mode == "none" else min_cut_rematerialization_partition
    # Created once: scan caches the traced block by the identity of the first one.
    carriers = [_CarryRope(block) for block in model.layers.values()]

    def forward(h, cos, sin, *mask):
        # The carry holds float tensors only (scan differentiates it); ids and positions compare
        # exactly as floats (below 2^24).
        h, *_ = runtime.kernels.scan_layers(carriers, (h, cos, sin, *(t.float() for t in mask)),
                                            partition_fn)
        return h

    model.layers.forward = forward
    logger.info(f"Scanning {len(carriers)} blocks ({partition_fn.__name__})")


def apply_compile(model: nn.Module, backend: str = "inductor") -> None:
    """torch.compile each block (`[compile] step = "blocks"`, the native runtime's; the step
    runs eagerly around them, as in torchtitan): the blocks share one static graph per shape, as
    on XLA (automatic dynamic shapes cannot trace the blockwise attention under DTensor)."""
    for block in model.layers.values():
        block.compile(fullgraph=True, dynamic=False, backend=backend)
    logger.info(f"Compiling {len(model.layers)} blocks (torch.compile)")


def parallelize_llama(model: nn.Module, mesh, parallel_dims: ParallelDims,
                      job_config: JobConfig) -> nn.Module:
    if parallel_dims.tp > 1:
        apply_tp(model, mesh, parallel_dims)
    if parallel_dims.ep > 1:
        apply_ep(model, mesh)
    ring = parallel_dims.cp > 1 and parallel_dims.cp_rotate == "ring"
    if ring:  # (whichever kernel [model] attention names: the ring is the attention over cp)
        apply_ring_attention(model, mesh, parallel_dims.cp)
    elif parallel_dims.cp > 1 and job_config.model.attention == "blockwise":
        apply_chunk_pair_attention(model, mesh, parallel_dims.cp, parallel_dims.cp_load_balance)
    if parallel_dims.world_size > 1:
        apply_activation_sharding(model, mesh, parallel_dims.seq_axis, ring, parallel_dims.pp > 1)
    apply_local_attention(model, mesh)
    ac, pipelined = job_config.activation_checkpoint, parallel_dims.pp > 1
    if not job_config.compile.scan_layers and not pipelined:  # scan's partitioner / the pipeline do it
        apply_ac(model, ac)
    apply_fsdp(model, mesh, parallel_dims)
    if job_config.compile.scan_layers:
        apply_scan(model, ac)
    if pipelined:  # in checkpoints each layer is split over pp as well, as FSDP would
        apply_pipeline(model, mesh, parallel_dims, full_ac=ac.mode == "full",
                       saved_spec=lambda shape, spec, stages: fsdp_spec(shape, spec, stages, "pp"))
    # Parameters take their specs (native: they become DTensors; XLA: annotated already).
    runtime.distribute_module(model, mesh)
    if job_config.compile.step == "blocks":
        apply_compile(model)
    return model
