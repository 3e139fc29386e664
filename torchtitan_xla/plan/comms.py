"""The bytes each device sends per training step, by collective: what FSDP, HSDP, tensor, expert
and context parallelism need in theory, what the compiled step does (from its optimized HLO), and the audit
that compares them.

Volumes are per device with ring algorithms on a group of n devices: an all-gather producing R
bytes sends (n-1)/n R, a reduce-scatter producing R sends (n-1) R, an all-reduce of R sends
2 (n-1)/n R, an all-to-all of R sends (n-1)/n R, a collective-permute sends R.
"""

from __future__ import annotations

import math
from collections import defaultdict

KINDS = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all", "collective-permute")
GRAD_BYTES = 4  # float32 gradients' bytes per element
RESIDUAL_BYTES = 4  # the residual stream stays float32 under autocast


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


def recomputed(policy: str, block: int) -> bool:
    """Whether activation checkpointing reruns block `block`'s forward in the backward (apply_ac:
    every block under full, the (i+1)-th of every N under every-N)."""
    if policy == "full":
        return True
    return policy.startswith("every-") and (block + 1) % int(policy.removeprefix("every-")) == 0


def _block(name: str) -> int | None:
    return int(name.split(".")[1]) if name.startswith("layers.") else None


def dtype_bytes(training) -> tuple[int, int]:
    """Bytes per element of the compute dtype and of the dtype the weight matrices' gradients are
    reduced in, for the config's [training] section."""
    if training.mixed_precision_param != "bfloat16":
        return 4, 4
    return 2, 2 if training.mixed_precision_reduce == "bfloat16" else 4


def theory(model, parallel_dims, *, tokens: int, seq_len: int, microbatches: int, policy: str,
           act_bytes: int = 4, reduce_bytes: int = GRAD_BYTES) -> dict[str, float]:
    """Bytes sent per device per step, by kind, for the model's parameters under `param_specs`;
    `tokens` per data-parallel rank and microbatch.

    FSDP (per microbatch): every sharded parameter gathered for the forward and again for the
    backward (the embedding only for the forward; once more for a recomputed block) and its
    gradient reduce-scattered; a parameter FSDP cannot shard has its gradient all-reduced.
    HSDP: the gradient shard all-reduced over the replicas. Tensor parallelism with sequence
    parallelism, per block: the sequence gathered before attention and the MLP and reduce-scattered
    after them, forward, and the transposes backward, where XLA reduces the input gradient of each
    of wq, wk, wv, w1, w3 separately (Megatron sums them first: 3 fewer per block); one gather
    forward and one reduce-scatter backward for the output layer; the embedding's feature-sharded
    output moved to sequence shards by an all-to-all, forward and backward; parameters tensor
    parallelism leaves whole (the norms) all-reduce their gradient over the sequence shards.
    Matrices (every weight a matmul or the embedding reads) are gathered in the compute dtype
    (`act_bytes`): autocast casts the float32 shard and XLA's partitioner gathers the cast. Their
    gradients are reduced in `reduce_bytes` ([training] mixed_precision_reduce: the linear layers'
    weight-gradient dots give float32 results then, parallelisms/compute_dtype.py), the experts'
    stacked weights' in the compute dtype (autocast's einsums), the embedding's in float32
    (models/llama/layers.Embedding). Vectors (the norms) are
    read in float32 and so gathered and reduced in it. Sequence parallelism moves the compute dtype
    but for the final norm's gathered output and the embedding's all-to-all (float32: the residual
    stream);
    expert, pipeline and context parallelism's activations the compute dtype (audited in float32).

    Expert parallelism: dense parameters are sharded (gathered, reduce-scattered) over fsdp x ep,
    expert weights over fsdp alone (each ep device keeps its experts: the tokens come to them), and
    each MoE block moves its expert-side tensor [experts, sequences, slots, dim] by all-to-all over
    ep twice forward (to the experts and back) and twice backward (twice more when recomputed).
    The activation collectives of MoE blocks under tensor parallelism are not modelled.

    Context parallelism (`context_parallel`): FSDP's groups are fsdp x ep x cp, and each device
    holds 1/cp of every sequence, so sequence parallelism's collectives move tokens / cp."""
    from torchtitan_xla.models.llama.moe import MoE
    from torchtitan_xla.parallelisms import MESH_AXES
    from torchtitan_xla.parallelisms.parallelize_llama import fsdp_axes, param_specs

    from .memory import shard_shape

    out: dict[str, float] = defaultdict(float)
    r, t, e, a = parallel_dims.dp_replicate, parallel_dims.tp, parallel_dims.ep, microbatches
    cp = parallel_dims.cp
    sizes = dict(zip(MESH_AXES, parallel_dims.mesh_shape))
    specs = param_specs(model, parallel_dims)
    for name, p in model.named_parameters():
        spec = specs[name]
        param_bytes = act_bytes if p.dim() >= 2 else 4
        grad_bytes = 0 if not p.requires_grad else (  # a frozen (LoRA base) weight has none
            GRAD_BYTES if p.dim() < 2 or "tok_embeddings" in name else act_bytes if p.dim() > 2
            else reduce_bytes)
        axes = {x for s in spec for x in ((s,) if isinstance(s, str) else (s or ()))}
        # Without FSDP's axis: the tp / ep split, which stays. FSDP's group (fsdp, and ep for a
        # dense weight) gathers it or, if it could not shard it, all-reduces its gradient.
        kept = tuple(None if "fsdp" in ((s,) if isinstance(s, str) else (s or ())) else s for s in spec)
        whole = math.prod(shard_shape(tuple(p.shape), kept, sizes))  # elements per tp / ep shard
        n = fsdp_axes(kept, parallel_dims)[1]
        block = _block(name)
        # A pipeline stage gathers its layers' shards at every iteration that runs them (1 / pp of
        # the blocks, M R + S - 1 times per step against once): pipelining multiplies FSDP's bytes.
        uses = a * (pipeline_iterations(parallel_dims) / (parallel_dims.pp * parallel_dims.pp_repeats)
                    if block is not None and parallel_dims.pp > 1 else 1)
        if "fsdp" in axes and cp > 1 and "tok_embeddings" in name:
            pass  # context_parallel's
        elif "fsdp" in axes:
            # With cp the projections are einsums, which read a gathered weight in one layout
            # forward and backward: XLA gathers it once.
            gathers = (1 if "tok_embeddings" in name or cp > 1 else 2) + (
                block is not None and recomputed(policy, block))
            out["all-gather"] += uses * gathers * sent_bytes("all-gather", whole * param_bytes, n)
            out["reduce-scatter"] += uses * sent_bytes("reduce-scatter", whole * grad_bytes / n, n)
        else:
            out["all-reduce"] += uses * sent_bytes("all-reduce", whole * grad_bytes, n)
        if "tp" not in axes:
            out["all-reduce"] += uses * sent_bytes("all-reduce", whole * grad_bytes, t)
        local = whole / n if "fsdp" in axes else whole
        out["all-reduce"] += uses * sent_bytes("all-reduce", local * grad_bytes, r)
        if block is None:  # outside the stages each pp group is a data-parallel replica
            out["all-reduce"] += microbatches * sent_bytes("all-reduce", local * grad_bytes, parallel_dims.pp)
    blocks = len(model.layers)
    recompute = 2 * sum(recomputed(policy, i) for i in range(blocks))
    if parallel_dims.pp > 1:  # layer runs per device: K layers at each iteration, on tokens / M
        runs = pipeline_iterations(parallel_dims) / (parallel_dims.pp * parallel_dims.pp_repeats
                                                     * parallel_dims.pp_microbatches)
        blocks, recompute = blocks * runs, recompute * runs
    dim = model.tok_embeddings.weight.shape[1]
    sequence = tokens / cp * dim  # [tokens, dim] elements of this device's part of the sequences
    # In the compute dtype: the blocks' norm outputs (cast, then gathered: compute_dtype.py), the
    # gradients gathered backward, the reduce-scatters of matmul outputs and input gradients. In
    # float32: the final norm's output and the embedding's all-to-all (the residual stream's).
    out["all-gather"] += a * ((4 * blocks + recompute) * sent_bytes("all-gather", sequence * act_bytes, t)
                              + sent_bytes("all-gather", sequence * RESIDUAL_BYTES, t))
    out["reduce-scatter"] += a * (7 * blocks + 1 + recompute) * sent_bytes(
        "reduce-scatter", sequence * act_bytes / t, t)
    out["all-to-all"] += a * 2 * sent_bytes("all-to-all", sequence * RESIDUAL_BYTES / t, t)
    for moe in (m for m in model.modules() if isinstance(m, MoE)):
        slots = tokens // seq_len * moe.capacity(seq_len) * moe.num_experts  # expert-side rows
        moves = 4 + 2 * (policy == "full")
        out["all-to-all"] += a * moves * sent_bytes("all-to-all", slots * dim * act_bytes, e)
    if parallel_dims.pp > 1:
        for kind, sent in pipeline(model, parallel_dims, tokens=tokens, act_bytes=act_bytes).items():
            out[kind] += a * sent
    if cp > 1:
        for kind, sent in context_parallel(model, parallel_dims, tokens=tokens, policy=policy,
                                           act_bytes=act_bytes).items():
            out[kind] += a * sent
    return {k: out.get(k, 0.0) for k in KINDS}


def pipeline_iterations(parallel_dims) -> int:
    return parallel_dims.pp_microbatches * parallel_dims.pp_repeats + parallel_dims.pp - 1


def pipeline(model, parallel_dims, *, tokens: int, act_bytes: int = 4) -> dict[str, float]:
    """Bytes per device per (accumulation) microbatch that pipeline stages add to `theory`, as the
    compiled step does them (tests/test_pipeline_parallel.py): at every iteration but the first the
    activations [tokens / M, dim / tp of the sequence] move one stage on by a collective permute,
    forward and (their gradients) backward; each microbatch's output is all-reduced over pp from
    the last stage and its input gradient at the first stage; the embedding's output is gathered
    over pp entering the pipeline (outside it each pp group holds 1/pp of the sequences)."""
    pp, t = parallel_dims.pp, parallel_dims.tp
    dim = model.tok_embeddings.weight.shape[1]
    activation = tokens / parallel_dims.pp_microbatches * dim / t * act_bytes
    return {"collective-permute": 2 * (pipeline_iterations(parallel_dims) - 1) * activation,
            "all-reduce": 2 * parallel_dims.pp_microbatches * sent_bytes("all-reduce", activation, pp),
            "all-gather": sent_bytes("all-gather", tokens * dim / t * act_bytes, pp)}


def context_parallel(model, parallel_dims, *, tokens: int, policy: str, param_bytes: int = 4,
                     act_bytes: int = 4) -> dict[str, float]:
    """Bytes per device per microbatch that context parallelism adds to `theory`, as the compiled
    step does them (tests/test_plan.py, docs/plan.md).

    Keys and values: per block, those of the whole sequences [tokens, kv heads x (qk_head_dim +
    v_dim) / tp] all-gathered over cp in the forward pass and their gradients reduce-scattered in
    the backward; gathered again where the block's forward reruns (full, op: the gathers are not
    matmul outputs, recomputed blocks of every-N). Ring attention instead passes each device's
    chunk on cp - 1 times by collective permutes, with its positions and document ids (int64),
    and the gradients back the same way (the same bytes as the gathers).

    The embedding: tokens come whole to every cp device, and XLA looks them up in the vocabulary
    rows of the device's cp part rather than gather the table: the weight gathered over the rest
    of its FSDP group (fsdp x ep) to vocab / cp rows, after two collective-permutes of its shard
    (the rows re-laid from fsdp-major to cp-major order), the partial lookups [tokens, dim]
    reduce-scattered over cp (in the weight's dtype); backward, their gradient gathered over cp and
    the weight's gradient rows reduce-scattered over fsdp x ep."""
    from torchtitan_xla.parallelisms.parallelize_llama import fsdp_axes, param_specs

    out: dict[str, float] = defaultdict(float)
    cp, t = parallel_dims.cp, parallel_dims.tp
    args = model.args
    kv = tokens * args.kv_heads * (args.qk_head_dim + args.v_dim) / t * act_bytes
    ids = 2 * tokens / cp * 8  # positions and document ids of one chunk, int64
    for i in range(len(model.layers)):
        regathered = policy == "op" or recomputed(policy, i)
        if parallel_dims.cp_rotate == "ring":
            forward = (cp - 1) * sent_bytes("collective-permute", kv / cp + ids, 2)
            out["collective-permute"] += (1 + regathered) * forward + (cp - 1) * kv / cp
            continue
        out["all-gather"] += (1 + regathered) * sent_bytes("all-gather", kv, cp)
        out["reduce-scatter"] += sent_bytes("reduce-scatter", kv / cp, cp)
    table = model.tok_embeddings.weight
    spec = param_specs(model, parallel_dims)["tok_embeddings.weight"]
    if not any("fsdp" in ((s,) if isinstance(s, str) else (s or ())) for s in spec):
        return out  # a table FSDP cannot shard: looked up whole on every device (theory's all-reduce)
    rest = fsdp_axes((None,) * table.dim(), parallel_dims)[1] // cp  # the fsdp x ep part
    rows = table.numel() / t / cp  # elements of the vocab / cp rows (of this device's tp part)
    grad_bytes = GRAD_BYTES if table.requires_grad else 0  # a LoRA base table is frozen
    out["all-gather"] += sent_bytes("all-gather", rows * param_bytes, rest)
    if rest > 1 and parallel_dims.cp_rotate != "ring":
        # (Not in ring attention's steps: XLA lays the table out otherwise there; the embedding's
        # other collectives under ring attention are not audited.)
        out["collective-permute"] += 2 * sent_bytes("collective-permute", rows / rest * param_bytes, 2)
    out["reduce-scatter"] += sent_bytes("reduce-scatter", rows / rest * grad_bytes, rest)
    lookups = tokens * table.shape[1] / t * param_bytes
    out["reduce-scatter"] += sent_bytes("reduce-scatter", lookups / cp, cp)
    out["all-gather"] += sent_bytes("all-gather", lookups, cp)
    return out


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
