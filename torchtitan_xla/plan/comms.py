"""The bytes each device sends per training step, by collective: what FSDP, HSDP and tensor
parallelism need in theory, what the compiled step does (from its optimized HLO), and the audit
that compares them.

Volumes are per device with ring algorithms on a group of n devices: an all-gather producing R
bytes sends (n-1)/n R, a reduce-scatter producing R sends (n-1) R, an all-reduce of R sends
2 (n-1)/n R, an all-to-all of R sends (n-1)/n R, a collective-permute sends R.
"""

from __future__ import annotations

import math
from collections import defaultdict

KINDS = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all", "collective-permute")
GRAD_BYTES = 4  # gradients are reduced in float32


def sent_bytes(kind: str, result_bytes: float, group: int) -> float:
    if group <= 1:
        return 0.0
    if kind == "reduce-scatter":
        return (group - 1) * result_bytes
    if kind == "all-reduce":
        return 2 * (group - 1) / group * result_bytes
    if kind == "collective-permute":
        return float(result_bytes)
    return (group - 1) / group * result_bytes


def theory(model, parallel_dims, *, tokens: int, seq_len: int, microbatches: int, policy: str,
           param_bytes: int = 4, act_bytes: int = 4) -> dict[str, float]:
    """Bytes sent per device per step, by kind, for the model's parameters under `param_specs`.

    FSDP (per microbatch): every sharded parameter gathered for the forward and again for the
    backward (the embedding only for the forward; a third time for a fully recomputed block) and
    its gradient reduce-scattered; a parameter FSDP cannot shard has its gradient all-reduced.
    HSDP: the gradient shard all-reduced over the replicas. Tensor parallelism with sequence
    parallelism, per block: the sequence gathered before attention and the MLP and reduce-scattered
    after them, forward, and the transposes backward, where XLA reduces the input gradient of each
    of wq, wk, wv, w1, w3 separately (Megatron sums them first: 3 fewer per block); one gather
    forward and one reduce-scatter backward for the output layer; the embedding's feature-sharded
    output moved to sequence shards by an all-to-all, forward and backward; parameters tensor
    parallelism leaves whole (the norms) all-reduce their gradient over the sequence shards.
    Parameters are gathered in their storage dtype (`param_bytes`: autocast converts after the
    gather); activations move in the compute dtype (`act_bytes`).

    Expert parallelism: dense parameters are sharded (gathered, reduce-scattered) over fsdp x ep,
    expert weights over fsdp alone (each ep device keeps its experts: the tokens come to them), and
    each MoE block moves its expert-side tensor [experts, sequences, slots, dim] by all-to-all over
    ep twice forward (to the experts and back) and twice backward (twice more when recomputed).
    The activation collectives of MoE blocks under tensor parallelism are not modelled."""
    from torchtitan_xla.models.llama.moe import MoE
    from torchtitan_xla.parallelisms import MESH_AXES
    from torchtitan_xla.parallelisms.parallelize_llama import fsdp_axes, param_specs

    from .memory import shard_shape

    out: dict[str, float] = defaultdict(float)
    r, t, e, a = parallel_dims.dp_replicate, parallel_dims.tp, parallel_dims.ep, microbatches
    sizes = dict(zip(MESH_AXES, parallel_dims.mesh_shape))
    specs = param_specs(model, parallel_dims)
    for name, p in model.named_parameters():
        spec = specs[name]
        grad_bytes = GRAD_BYTES if p.requires_grad else 0  # a frozen (LoRA base) weight has none
        axes = {x for s in spec for x in ((s,) if isinstance(s, str) else (s or ()))}
        # Without FSDP's axis: the tp / ep split, which stays. FSDP's group (fsdp, and ep for a
        # dense weight) gathers it or, if it could not shard it, all-reduces its gradient.
        kept = tuple(None if "fsdp" in ((s,) if isinstance(s, str) else (s or ())) else s for s in spec)
        whole = math.prod(shard_shape(tuple(p.shape), kept, sizes))  # elements per tp / ep shard
        n = fsdp_axes(kept, parallel_dims)[1]
        if "fsdp" in axes:
            gathers = 1 if "tok_embeddings" in name else 2 + (policy == "full" and "layers." in name)
            out["all-gather"] += a * gathers * sent_bytes("all-gather", whole * param_bytes, n)
            out["reduce-scatter"] += a * sent_bytes("reduce-scatter", whole * grad_bytes / n, n)
        else:
            out["all-reduce"] += a * sent_bytes("all-reduce", whole * grad_bytes, n)
        if "tp" not in axes:
            out["all-reduce"] += a * sent_bytes("all-reduce", whole * grad_bytes, t)
        local = whole / n if "fsdp" in axes else whole
        out["all-reduce"] += a * sent_bytes("all-reduce", local * grad_bytes, r)
    blocks = len(model.layers)
    recompute = 2 * blocks if policy == "full" else 0
    dim = model.tok_embeddings.weight.shape[1]
    sequence = tokens * dim * act_bytes  # [tokens, dim]
    out["all-gather"] += a * (4 * blocks + 1 + recompute) * sent_bytes("all-gather", sequence, t)
    out["reduce-scatter"] += a * (7 * blocks + 1 + recompute) * sent_bytes("reduce-scatter", sequence / t, t)
    out["all-to-all"] += a * 2 * sent_bytes("all-to-all", sequence / t, t)
    for moe in (m for m in model.modules() if isinstance(m, MoE)):
        slots = tokens // seq_len * moe.capacity(seq_len) * moe.num_experts  # expert-side rows
        moves = 4 + 2 * (policy == "full")
        out["all-to-all"] += a * moves * sent_bytes("all-to-all", slots * dim * act_bytes, e)
    return {k: out.get(k, 0.0) for k in KINDS}


def measured(ops: list[tuple[str, int, int, str]]) -> dict[str, float]:
    """Bytes sent per device by kind, from `runtime.compiled.collective_ops` of the step."""
    out = dict.fromkeys(KINDS, 0.0)
    for kind, size, group, _ in ops:
        out[kind] += sent_bytes(kind, size, group)
    return out


def parameters_by_shape(model) -> dict[tuple[int, ...], list[str]]:
    """Parameter names by their dimensions in either order (XLA may hold a gradient transposed)."""
    out: dict[tuple[int, ...], list[str]] = {}
    for name, p in model.named_parameters():
        out.setdefault(tuple(sorted(p.shape)), []).append(name)
    return out


def _dims(shape: str) -> tuple[int, ...]:
    inside = shape.split("[", 1)[1].split("]", 1)[0] if "[" in shape else ""
    return tuple(sorted(int(d) for d in inside.split(",") if d))


def audit(ops: list[tuple[str, int, int, str]], expected: dict[str, float], *,
          parameters: dict[tuple[int, ...], list[str]] | None = None, tolerance: float = 0.05,
          ignore_below: int = 1 << 16) -> list[str]:
    """One line per finding: a kind whose volume differs from the theory by more than `tolerance`,
    every collective of a kind the theory does not expect, and every all-reduce of a parameter's
    whole shape (`parameters`: from `parameters_by_shape`), the gradient of a parameter FSDP does
    not shard, with the parameters of that shape. Volumes and collectives under `ignore_below`
    bytes sent (the loss's and norms' scalars) are left out."""
    found = measured(ops)
    lines = []
    for kind in KINDS:
        want, got = expected.get(kind, 0.0), found[kind]
        if max(want, got) >= ignore_below and abs(got - want) > tolerance * want:
            lines.append(f"{kind}: {got / 1e6:.3f} MB sent per device, theory {want / 1e6:.3f} MB")
    for kind, size, group, shape in ops:
        if sent_bytes(kind, size, group) < ignore_below:
            continue
        names = (parameters or {}).get(_dims(shape), [])
        if names and kind == "all-reduce":
            lines.append(f"all-reduce {shape} over {group} devices: a whole gradient reduced where "
                         f"FSDP reduce-scatters (one of {', '.join(names)})")
        elif expected.get(kind, 0.0) < ignore_below:
            lines.append(f"{kind} {shape} over {group} devices: not in the theory")
    return lines
