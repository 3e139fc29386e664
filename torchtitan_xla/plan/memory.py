"""Per-device memory of a training step, from a meta-device model: nothing is allocated.

State (parameters, gradients, optimizer state) comes from each parameter's shard shape under the
partition spec the parallelize code assigns (`param_specs`, the function apply_tp / apply_fsdp
use), so it follows the code. The step's temporaries (gradients, saved activations, one block's
backward working set, the loss's buffers, whole weights between an FSDP gather and their last use,
the optimizer's temporaries) come from a linear model per activation-checkpointing policy, on one
device or on a mesh, over `FEATURES`: per token, per block and once, multiples of dim, FFN hidden
size and heads x seq (the attention scores; none for Pallas flash / splash, whose memory is
O(seq)) divided over tensor parallelism; logits; and the weights' bytes. Its `COEFFICIENTS` were
fitted to XLA's own buffer assignment of 354 compiled steps on the CPU backend, in the regime of
real runs (activations outweigh the sharded weights): worst error 8.6%, on points the fit did not
see about 5% rms and up to 22% (docs/plan.md); tests/test_plan.py compiles a grid of shapes,
policies and meshes and holds the model within 10% of the compiler. Context parallelism divides
the tokens per device by cp; what it keeps of whole sequences (keys and values) and whole weights
beyond that is counted from shapes (`cp_excess`, `cp_held_weights`), as are MoE dispatch tensors.

On paper only (not verified on TPU): bfloat16 activations as half the float32 ones (the CPU
backend computes bfloat16 matmuls in float32, so it cannot measure them), flash / splash, scan as
unrolled blocks, and TPU's own scheduler and rematerialisation (XLA TPU may trade compute for
memory on its own when a program does not fit).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from torchtitan_xla.config import JobConfig

# float32 master weights and gradients; optimizer state tensors in float32, per parameter element.
BYTES_PARAM = BYTES_GRAD = BYTES_STATE = 4
OPTIMIZER_STATES = {"AdamW": 2, "Adam": 2, "Lion": 1, "Muon": 1, "Adafactor": 0}  # Adafactor: O(rows + cols)
# Vocabulary of the real tokenizers, used when the tokenizer file is not at hand.
DEFAULT_VOCAB = {"llama2": 32000, "llama3": 128256, "mixtral": 32000, "qwen3": 151936, "deepseek_v2": 102400,
                 "deepseek_v3": 129280, "gemma3": 262144, "gpt_oss": 201088}

# Per token, as multiples of (dim, FFN hidden size, heads x seq with sdpa, heads x seq with
# blockwise): what the blocks of each kind keep for their backward (times their number), and what
# one block's backward holds; then once per step: logits, and the weights' bytes.
FEATURES = (
    *(f"{kind} blocks x {x}" for kind in ("full", "kept", "op")
      for x in ("dim", "ffn", "scores sdpa", "scores blockwise")),
    "working dim", "working ffn", "working scores sdpa", "working scores blockwise",
    "T·vocab", "chunk·vocab", "vocabulary weights", "other weights", "gathered vocabulary weights",
    "gathered block weights", "chunked loss's weight gradient")
# What each policy's blocks can keep: a recomputed block only its input, an `op` block the outputs
# of its matmuls (no scores); everything else stays at 0, so the fit extrapolates as the code does.
_BLOCK = {"full": [0], "kept": [4, 5, 6, 7], "op": [8, 9]}
_STEP = list(range(12, 23))
USED = {"full": _BLOCK["full"] + _STEP, "none": _BLOCK["kept"] + _STEP, "op": _BLOCK["op"] + _STEP,
        "every-N": _BLOCK["full"] + _BLOCK["kept"] + _STEP}
# One fit per activation-checkpointing policy (every-N: any N, fitted on N = 2) on one device and
# on meshes (whose programs also gather weights and reduce gradients), by `python
# bench/bench_plan.py --fit bench/data/plan_grid.jsonl`: the first twenty in elements of the
# compute dtype, the rest in bytes per byte.
COEFFICIENTS: dict[str, tuple[float, ...]] = {
    "every-N, 1 device": (
        28.94, 0, 0, 0, 4.463, 4.227, 0.2257, 0.4639, 0, 0, 0, 0, 0, 0.3277, 3.753, 1.385,
        1.111, 8.685, 0, 0, 0, 0, 0),
    "every-N, mesh": (
        21.87, 0, 0, 0, 0, 5.796, 0.1221, 0, 0, 0, 0, 0, 0, 2.142, 4.05, 1.954, 2.095, 0, 0,
        2.065, 0, 0, 0),
    "full, 1 device": (
        7.389, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 4.609, 2.787, 1.465, 1.112, 0, 1.58, 0, 0, 0,
        0),
    "full, mesh": (
        1.445, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 10.29, 5.873, 2.711, 1.477, 1.96, 0, 0, 2.106,
        0, 0.1416, 0),
    "none, 1 device": (
        0, 0, 0, 0, 5.231, 4.758, 1.11, 0.769, 0, 0, 0, 0, 9.486, 1.07, 1.187, 0.2792, 1.728, 0,
        1.272, 0.1362, 0, 0, 0),
    "none, mesh": (
        0, 0, 0, 0, 3.859, 5.23, 0.9569, 0.6534, 0, 0, 0, 0, 0, 0.2764, 1.812, 0.663, 2.524, 0,
        0, 2.661, 0.8063, 0, 0),
    "op, 1 device": (
        0, 0, 0, 0, 0, 0, 0, 0, 5.332, 4.775, 0, 0, 0, 0, 2.578, 1.65, 1.758, 2.558, 1.259, 0,
        0, 0, 0),
    "op, mesh": (
        0, 0, 0, 0, 0, 0, 0, 0, 10.87, 4.213, 0, 0, 0, 0, 2.542, 1.456, 2.149, 0, 0, 0, 0, 0, 0),
}


@dataclass(frozen=True)
class Shape:
    """What the activation model reads: sizes per data-parallel rank and microbatch."""

    n_layers: int
    dim: int
    ffn: int
    heads: int
    vocab: int
    seq: int
    batch: int  # sequences per data-parallel rank per microbatch
    tp: int
    policy: str  # none | full | op | every-N (block-level selective)
    attention: str
    chunk: int  # loss chunk size, 0: full logits
    act_bytes: int  # 4 for float32, 2 for bfloat16 compute
    fsdp: int = 1
    devices: int = 1
    moe_blocks: int = 0  # blocks with a mixture of experts (GShard's dispatch)
    moe_sequence_bytes: float = 0.0  # what such a block holds per sequence beyond a dense one (moe_excess)
    cp: int = 1  # context parallel degree: each sequence split over this many devices
    kv_features: int = 0  # features per token of the keys and values attention reads (kv_features)

    @property
    def tokens(self) -> float:
        """Tokens per device per microbatch: the rank's sequences, split over `cp`."""
        return self.seq * self.batch / self.cp


@dataclass
class Memory:
    """Bytes per device."""

    parameters: int
    gradients: int
    optimizer: int
    temporaries: int  # the compiled step's temporary buffer; holds the gradients
    largest_shard: tuple[str, tuple[int, ...], tuple]  # name, local shape, partition spec
    reference: int = 0  # dpo / ipo / grpo with beta > 0: the frozen reference's weights (reference/)
    kv_cache: int = 0  # grpo: its rollouts' KV cache, live while generating (between steps)
    host: int = 0  # kept in the host's memory for this device: offloaded block inputs, optimizer

    @property
    def activations(self) -> int:
        """Temporaries beyond the gradients: saved activations, working set, loss, optimizer."""
        return self.temporaries - self.gradients

    @property
    def total(self) -> int:
        """The peak: the step's, or a rollout's (the weights, their state, the gradients the last
        step left and the KV cache), whichever is higher."""
        held = self.parameters + self.optimizer + self.reference
        return held + max(self.temporaries, self.gradients + self.kv_cache)


def rollout_kv_cache(job_config: JobConfig, args, parallel_dims, global_batch: int) -> int:
    """Bytes per device of grpo's KV cache: every row of the step's rollout (the generation's
    batch is not split over the data axes yet, docs/generation.md) x seq_len slots x each layer's
    keys and values (latent attention: its latent and rotated key part), heads split over tp,
    float32 (generation runs the float32 weights)."""
    if job_config.training.objective != "grpo":
        return 0
    per_token = (args.kv_lora_rank + args.qk_rope_head_dim if args.mla
                 else 2 * math.ceil(args.kv_heads / parallel_dims.tp) * args.head_dim)
    return args.n_layers * global_batch * job_config.training.seq_len * per_token * 4


def shard_shape(shape: tuple[int, ...], spec: tuple, axis_sizes: dict[str, int]) -> tuple[int, ...]:
    """Local shape of a tensor sharded by `spec` (XLA pads uneven shards: ceil division)."""
    out = []
    for size, axes in zip(shape, spec):
        names = (axes,) if isinstance(axes, str) else (axes or ())
        out.append(math.ceil(size / math.prod(axis_sizes[a] for a in names)))
    return tuple(out)


def model_args(job_config: JobConfig, vocab_size: int | None = None, **overrides):
    """The run's model args as train.py makes them, without reading the tokenizer: its flavor's,
    or with HF initial weights their folder's (`[model] flavor = "hf"` included)."""
    from torchtitan_xla.datasets.tokenizer.train_bpe import DEFAULT_VOCAB_SIZE
    from torchtitan_xla.models import get_model_args, moe_overrides
    from torchtitan_xla.models.llama.hf_folder import match_initial_hf_weights

    name, flavor = job_config.model.name, job_config.model.flavor
    if vocab_size is None:  # the tokenizer's, without reading it: the project's own, or Meta's
        vocab_size = (DEFAULT_VOCAB_SIZE + 256 if not job_config.model.tokenizer_path
                      else DEFAULT_VOCAB[name])
    args = get_model_args(name, flavor, **{
        "vocab_size": vocab_size, "max_seq_len": job_config.training.seq_len,
        **moe_overrides(job_config.moe), **overrides})
    return match_initial_hf_weights(job_config.checkpoint, args, f"{name} {flavor}")


def build_meta_model(job_config: JobConfig, vocab_size: int | None = None, **overrides):
    """(model args, the model on the meta device, with its LoRA adapters if any)."""
    import torch

    from torchtitan_xla.lora import apply_lora
    from torchtitan_xla.models import get_model_class

    args = model_args(job_config, vocab_size, **overrides)
    with torch.device("meta"):
        model = get_model_class(job_config.model.name)(args)
    apply_lora(model, job_config.lora)
    return args, model


def local_parameters(model, parallel_dims, trainable_only: bool = False
                     ) -> tuple[int, tuple[str, tuple[int, ...], tuple]]:
    """(parameter elements on the most loaded device, the largest shard: name, shape, spec); only
    of the parameters that train (not LoRA's frozen ones) with `trainable_only`."""
    from torchtitan_xla.parallelisms import MESH_AXES
    from torchtitan_xla.parallelisms.parallelize_llama import param_specs

    sizes = dict(zip(MESH_AXES, parallel_dims.mesh_shape))
    specs = param_specs(model, parallel_dims)
    total, largest = 0, ("", (), ())
    for name, p in model.named_parameters():
        if trainable_only and not p.requires_grad:
            continue
        local = shard_shape(tuple(p.shape), specs[name], sizes)
        # Pipeline stages: each device holds its stage's share of the blocks (n_layers / pp).
        total += math.prod(local) // (parallel_dims.pp if name.startswith("layers.") else 1)
        if math.prod(local) > math.prod(largest[1] or (0,)):
            largest = (name, local, specs[name])
    return total, largest


def activation_dim(args) -> int:
    """The width the fitted per-token "dim" features are counted at. A Llama block's attention
    tensors (q, k, v, output) are at most dim wide each; latent attention's (DeepSeek) are wider
    (V3: heads x 192 for q and k, x 128 for v and the output, against dim 7168): counted as a block
    of their mean width, which over-counts the residual stream's tensors (conservative; not
    calibrated against the compiler for latent attention). Its latents are small beside them. An
    MoE block's routed and shared experts are counted as the dense FFN (DeepSeek sizes them so:
    top_k + shared experts' hidden = intermediate_size)."""
    if not args.mla:
        return args.dim
    return max(args.dim, args.n_heads * (args.qk_head_dim + args.v_dim) // 2)


def moe_excess(args, seq: int, tp: int, act_bytes: int, grouped_mm: bool) -> float:
    """Bytes per sequence an MoE block with GShard's dispatch holds beyond the dense block the fit
    counts, not fitted: its float32 dispatch and combine tensors [seq, experts, slots] and the
    experts' inputs, SwiGLU activations and outputs for E x slots rows instead of the top_k x seq
    rows of a token's experts (dropless, slots = seq: E / top_k times as many). Against the
    compiler (docs/plan.md) this takes the MoE points from 0.45-0.89 of XLA's temporaries to
    0.87-1.23. Grouped matmuls have no slots: 0 (not measured)."""
    if not args.num_experts or grouped_mm:
        return 0.0
    e, k = args.num_experts, args.top_k
    slots = seq if args.capacity_factor == 0 else min(seq, math.ceil(args.capacity_factor * k * seq / e))
    dispatch = 2 * seq * e * slots * 4
    rows = max(e * slots - k * seq, 0)
    return dispatch + rows * (2 * args.dim + 3 * args.expert_hidden_dim / tp) * act_bytes


def kv_features(args) -> int:
    """Features per token of the keys and values attention's einsums read, together: kv heads x
    (qk_head_dim + v_dim) (grouped-query attention's einsums read the kv heads, never a repeated
    copy)."""
    return args.kv_heads * (args.qk_head_dim + args.v_dim)


def cp_excess(s: Shape) -> float:
    """Bytes per device a block with context parallelism holds beyond the fitted per-token terms
    (which count its tokens, 1/cp of each sequence), not fitted: the keys and values of the whole
    sequences, gathered over `cp` for attention and kept for its backward, of which the fitted
    terms count the device's own 1/cp. Each device's attention scores [heads, seq/cp, seq] need no
    term: the fitted scores feature is per token x heads x seq, the full key length."""
    if s.cp == 1:
        return 0.0
    return (1 - 1 / s.cp) * s.batch * s.seq * s.kv_features * s.act_bytes / s.tp


def cp_held_weights(s: Shape) -> float:
    """Bytes per device of whole block weights that context parallelism keeps beyond the one
    gathered block the fit counts, not fitted. Its projections are einsums, which read a weight in
    the same layout forward and backward, so XLA gathers each weight once per step and a block
    that keeps its activations (AC none, every-N's kept blocks) keeps its gathered weights from
    its forward to its backward (measured: 21 of 4 blocks' 28 gathered weights live at the compiled
    step's peak, docs/plan.md). Under op and full the step regathers (none held, measured)."""
    if s.cp == 1 or s.fsdp == 1 or not (s.policy == "none" or s.policy.startswith("every-")):
        return 0.0
    return (holding(s.n_layers, s.policy) - 1) * (4 * s.dim + 3 * s.ffn) * s.dim / s.tp * BYTES_PARAM


def activation_shape(job_config: JobConfig, args, parallel_dims, microbatch: int) -> Shape:
    """The activation model's sizes. A pipeline stage runs its n_layers / (S R) layers at each of
    the schedule's M R + S - 1 iterations on a microbatch of 1/M of the rank's sequences, and the
    unrolled loop keeps every iteration's activations for the backward: counted as that many
    blocks of that batch (1.04 and 1.00 of the compiler's temporaries without checkpointing,
    docs/plan.md). Under full checkpointing each layer should keep only its input, as counted; the
    compiled step on the CPU backend kept far more (the plan's count 0.32 and 0.21 of it), not
    understood: the plan warns."""
    dims = parallel_dims
    n_layers = args.n_layers
    if dims.pp > 1:
        iterations = dims.pp_microbatches * dims.pp_repeats + dims.pp - 1
        n_layers = iterations * args.n_layers // (dims.pp * dims.pp_repeats)
        microbatch //= dims.pp_microbatches
    ac = job_config.activation_checkpoint
    policy = ac.mode if ac.mode != "selective" else (
        "op" if ac.selective_ac_option == "op" else f"every-{ac.selective_ac_option}")
    act_bytes = 2 if job_config.training.mixed_precision_param == "bfloat16" else 4
    seq = job_config.training.seq_len
    return Shape(n_layers, activation_dim(args), args.ffn_hidden_dim, args.n_heads, args.vocab_size,
                 seq, microbatch, parallel_dims.tp, policy, job_config.model.attention,
                 job_config.loss.chunk_size, act_bytes, parallel_dims.shard_degree, parallel_dims.world_size,
                 sum(args.is_moe_layer(i) for i in range(args.n_layers)),
                 moe_excess(args, seq, parallel_dims.tp, act_bytes, job_config.moe.grouped_mm),
                 parallel_dims.cp, kv_features(args))


def features(s: Shape, parameter_bytes: int) -> list[float]:
    """`FEATURES` in bytes. Under FSDP a weight is whole on every device from its gather to its
    last use, and its gradient before the reduction."""
    t, e = s.tokens, s.act_bytes
    scores = s.heads * s.seq
    per_token = [x * t * e / s.tp for x in (s.dim, s.ffn, scores * (s.attention == "sdpa"),
                                             scores * (s.attention == "blockwise"))]
    full = (s.n_layers // int(s.policy.removeprefix("every-")) if s.policy.startswith("every-")
            else s.n_layers * (s.policy == "full"))
    op = s.n_layers * (s.policy == "op")
    blocks = [full, s.n_layers - full - op, op]
    vocabulary = 2 * s.vocab * s.dim / s.tp * BYTES_PARAM  # embedding and output, per tp shard
    block = (4 * s.dim + 3 * s.ffn) * s.dim / s.tp * BYTES_PARAM
    return ([n * x for n in blocks for x in per_token] + per_token
            + [t * s.vocab / s.tp * e * (s.chunk == 0), s.chunk * s.vocab * e, vocabulary / s.fsdp,
               parameter_bytes - vocabulary / s.fsdp, vocabulary * (s.fsdp > 1),
               block * (s.fsdp > 1), vocabulary / 2 * (s.chunk > 0)])


def fit_group(s: Shape) -> str:
    """Which coefficients: per policy (every-N for any N), one device or a mesh (whose program
    also gathers weights and reduces gradients)."""
    policy = "every-N" if s.policy.startswith("every-") else s.policy
    return f"{policy}, {'mesh' if s.devices > 1 else '1 device'}"


def holding(blocks: int, policy: str) -> int:
    """How many of `blocks` hold their activations at once: every one that keeps them, and the
    block whose backward runs where activation checkpointing recomputes them."""
    if policy == "none":
        return blocks
    if policy.startswith("every-"):
        return max(blocks - blocks // int(policy.removeprefix("every-")), min(blocks, 1))
    return min(blocks, 1)


def temporaries(s: Shape, parameter_bytes: int) -> int:
    """The compiled step's temporary bytes per device, from `COEFFICIENTS`, and beyond them, in
    every block that holds its activations (`holding`), the MoE blocks' dispatch (`moe_excess`, a
    sequence's share per device under cp: not measured) and context parallelism's gathered keys
    and values (`cp_excess`); and the gathered weights context parallelism keeps (`cp_held_weights`)."""
    c = COEFFICIENTS[fit_group(s)]
    fitted = sum(a * x for a, x in zip(c, features(s, parameter_bytes)))
    moe = holding(s.moe_blocks, s.policy) * s.batch / s.cp * s.moe_sequence_bytes
    return int(fitted + moe + holding(s.n_layers, s.policy) * cp_excess(s) + cp_held_weights(s))


def estimate(job_config: JobConfig, parallel_dims, vocab_size: int | None = None,
             **overrides) -> Memory:
    args, model = build_meta_model(job_config, vocab_size, **overrides)
    parallel_dims.check_model(args.n_heads, args.kv_heads, args.dim, args.ffn_hidden_dim, args.num_experts,
                              args.n_layers)
    elements, largest = local_parameters(model, parallel_dims)
    # Gradients and optimizer state exist only for what trains (LoRA: the adapters).
    trained, _ = local_parameters(model, parallel_dims, trainable_only=True)
    training = job_config.training
    global_batch = (training.global_batch_size if training.global_batch_size > 0
                    else training.local_batch_size * parallel_dims.dp_degree)
    parallel_dims.check_batch(global_batch, training.local_batch_size, training.seq_len, 1)
    shape = activation_shape(job_config, args, parallel_dims, training.local_batch_size)
    states = OPTIMIZER_STATES[job_config.optimizer.name]
    # The fitted temporaries hold every parameter's gradient: without the frozen ones' (LoRA; not
    # calibrated against the compiler).
    frozen_gradients = (elements - trained) * BYTES_GRAD
    # dpo / ipo (grpo with a KL) keep a frozen copy of the base weights, sharded as the policy's
    # (LoRA without a given reference switches its adapters off instead; stored log-probabilities
    # need none). Its scoring graph runs between steps:
    # its activations (no gradients) are far below the step's, so the peak is the step's.
    from torchtitan_xla.objectives import copies_reference

    base = elements - trained if job_config.lora.rank else elements
    reference = base * BYTES_PARAM if copies_reference(job_config) else 0
    inputs = offloaded_inputs(job_config, shape, args.dim)
    # The projections (qkv_proj) only add to the host's count: full checkpointing recomputes them.
    projections = offloaded_inputs(job_config, shape, args.n_heads * args.qk_head_dim + kv_features(args),
                                   name="qkv_proj")
    optimizer = trained * states * BYTES_STATE
    # Offloaded (optimizer/offload.py): the state, a float32 copy of the trained weights and a
    # buffer their gradients land in, all on the host; nothing of it on the device.
    on_host = optimizer + trained * (BYTES_PARAM + BYTES_GRAD) if job_config.optimizer.offload else 0
    return Memory(parameters=elements * BYTES_PARAM, gradients=trained * BYTES_GRAD,
                  optimizer=0 if on_host else optimizer,
                  temporaries=temporaries(shape, elements * BYTES_PARAM) - frozen_gradients
                  - inputs * (shape.n_layers - 1) // max(shape.n_layers, 1),
                  largest_shard=largest, reference=reference,
                  kv_cache=rollout_kv_cache(job_config, args, parallel_dims, global_batch),
                  host=inputs + projections + on_host)


def offloaded_inputs(job_config: JobConfig, s: Shape, dim: int, name: str = "decoder_layer_input") -> int:
    """Bytes of what `[activation_checkpoint] offload` keeps on the host per device under `name`
    (`dim` features per token): every block's, over `tp`. Of the block inputs the device holds one
    again while that block is recomputed; only the inputs themselves leave the device's count:
    what else the compiler keeps under full checkpointing (the fit's full-policy terms) stays."""
    if name not in job_config.activation_checkpoint.offload:
        return 0
    return int(s.n_layers * s.tokens * dim * s.act_bytes / s.tp)
