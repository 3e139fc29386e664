"""Checks of a JobConfig's values against each other and the model they describe: each a
`ConfigError` of one line naming where the key was set (`sources`), before anything is built.
Imports neither torch nor torch_xla."""

from __future__ import annotations

import dataclasses

from torchtitan_xla.config.job_config import JobConfig
from torchtitan_xla.config.objective_checks import check_objective
from torchtitan_xla.errors import ConfigError


def check_combinations(cfg: JobConfig, sources) -> None:
    """Keys that are valid alone but not together (`sources`: config/sources.py)."""
    parts = {"model", "optimizer", "lr_scheduler", "dataloader", "train_state"}
    for part in cfg.checkpoint.exclude_from_loading:
        if part not in parts:
            raise ConfigError(
                f"{sources.describe('checkpoint', 'exclude_from_loading')}: unknown part {part!r}; "
                f"expected any of {', '.join(sorted(parts))}")
    ac = cfg.activation_checkpoint
    if ac.selective_ac_option != "op" and not (ac.selective_ac_option.isdigit()
                                               and int(ac.selective_ac_option) > 0):
        raise ConfigError(
            f"{sources.describe('activation_checkpoint', 'selective_ac_option')} = "
            f"{ac.selective_ac_option!r}: expected 'op' or a positive integer N (every N-th block)")
    if cfg.compile.scan_layers and not (
            ac.mode == "none" or (ac.mode == "selective" and ac.selective_ac_option == "op")):
        raise ConfigError(
            f"{sources.describe('compile', 'scan_layers')} = true cannot be combined with "
            f"[activation_checkpoint] mode = {ac.mode!r}"
            + (f", selective_ac_option = {ac.selective_ac_option!r}" if ac.mode == "selective" else "")
            + ": under scan use mode 'none' or selective 'op'")
    if cfg.optimizer.offload:
        _check_optimizer_offload(cfg, sources)
    if cfg.training.global_batch_size == 0 or cfg.training.global_batch_size < -1:
        raise ConfigError(
            f"{sources.describe('training', 'global_batch_size')} = "
            f"{cfg.training.global_batch_size}: must be -1 (no accumulation) or > 0")
    p = cfg.parallelism
    if p.data_parallel_shard_degree == 0 or p.data_parallel_shard_degree < -1:
        raise ConfigError(
            f"{sources.describe('parallelism', 'data_parallel_shard_degree')} = "
            f"{p.data_parallel_shard_degree}: must be -1 (all remaining devices) or > 0")
    t, chunk = cfg.training, cfg.loss.chunk_size
    if chunk and (t.local_batch_size * t.seq_len) % chunk:
        raise ConfigError(
            f"{sources.describe('loss', 'chunk_size')} = {chunk}: must divide the tokens of one "
            f"data-parallel rank per microbatch, local_batch_size x seq_len = "
            f"{t.local_batch_size} x {t.seq_len} = {t.local_batch_size * t.seq_len}")
    if cfg.validation.enable and cfg.validation.steps == 0:
        raise ConfigError(f"{sources.describe('validation', 'steps')} = 0: must be -1 (the whole "
                          f"split) or a number of batches > 0")
    lora = cfg.lora
    if lora.rank and not lora.target_modules:
        # LoRA freezes every base weight: with no target layer nothing would be left to train.
        raise ConfigError(f"{sources.describe('lora', 'target_modules')} is empty with "
                          f"[lora] rank = {lora.rank}: nothing would be trained; name the layers "
                          f"that get adapters (wq, wk, wv, wo, w1, w2, w3), or set rank = 0 to "
                          f"train every weight")
    if lora.rank and cfg.float8.enable_float8_linear:
        raise ConfigError(f"{sources.describe('lora', 'rank')} = {lora.rank}: LoRA cannot be combined "
                          f"with [float8] enable_float8_linear = true (adapters on float8 linears "
                          f"are not supported); turn one of them off")
    if lora.rank and lora.dropout and cfg.compile.step == "replay":
        # A replayed step reads the random seed as a frozen number: every step would drop the same
        # units. The lazy step draws new ones.
        raise ConfigError(f"{sources.describe('lora', 'dropout')} = {lora.dropout:g} needs "
                          f"[compile] step = \"lazy\" (a replayed step would reuse one dropout mask)")
    prof = cfg.profiling
    if prof.profiler_active > prof.profile_freq:
        raise ConfigError(
            f"{sources.describe('profiling', 'profiler_active')} = {prof.profiler_active}: "
            f"must be <= profiling.profile_freq ({prof.profile_freq}), so that one trace ends "
            f"before the next starts")
    check_objective(cfg, sources)
    args = _model_args(cfg, sources)
    if ac.offload:
        _check_offload(cfg, args, sources)
    _check_moe(cfg, args, sources)
    _check_attention(cfg, args, sources)
    _check_runtime(cfg, sources)


def _check_offload(cfg: JobConfig, args, sources) -> None:
    """Host offload of a block's input or its attention projections: the block is recomputed by the
    per-block checkpoint, which takes them back."""
    ac, where = cfg.activation_checkpoint, sources.describe("activation_checkpoint", "offload")
    if ac.mode != "full":
        raise ConfigError(f"{where} = {ac.offload!r} needs [activation_checkpoint] mode = \"full\" (each "
                          f"block recomputed in the backward pass from what it kept), not {ac.mode!r}")
    stages = cfg.parallelism.pipeline_parallel_degree
    if stages > 1:  # (scan refuses mode full itself)
        raise ConfigError(f"{where} = {ac.offload!r} cannot be combined with [parallelism] "
                          f"pipeline_parallel_degree = {stages}: the pipeline stages checkpoint their "
                          f"layers themselves")
    if "qkv_proj" not in ac.offload:
        return
    # The projections' gradients are computed from their kept outputs as a plain linear layer's.
    targets = cfg.lora.target_modules
    clash = [(section, key, value, why) for section, key, value, why in (
        ("float8", "enable_float8_linear", cfg.float8.enable_float8_linear, "float8 projections"),
        ("lora", "target_modules", cfg.lora.rank and sorted({"wq", "wk", "wv"} & set(targets)),
         "adapters on the projections"),
        ("model", "name", args.mla and cfg.model.name, "latent attention (its projections are "
         "wq_a / wkv_a ...)")) if value]
    if clash:
        section, key, value, why = clash[0]
        raise ConfigError(f"{where} = {ac.offload!r} keeps the outputs of plain wq, wk and wv linear "
                          f"layers; not with {sources.describe(section, key)} = {value!r} ({why})")


def _check_optimizer_offload(cfg: JobConfig, sources) -> None:
    """The optimizer on the host: an elementwise update of each process's blocks, on torch's native
    runtime (optimizer/offload.py)."""
    where = sources.describe("optimizer", "offload")
    if cfg.runtime.backend == "xla":
        raise ConfigError(f"{where} = true needs [runtime] backend = \"native\": torch_xla 2.9 has no "
                          f"API to keep tensors in the host's memory space (pytorch/xla#8049)")
    if cfg.optimizer.name not in ("AdamW", "Adam"):
        raise ConfigError(f"{where} = true updates with torch's fused AdamW or Adam on the host, not "
                          f"[optimizer] name = {cfg.optimizer.name!r}: Muon and Adafactor read each "
                          f"weight matrix whole, Lion has no host kernel that skips non-finite steps")


def _model_args(cfg: JobConfig, sources):
    """The ModelArgs of [model] name and flavor: a flavor's, or with flavor "hf" those of the
    config.json of the HF folder the run starts from (read now, so that every check below sees the
    real architecture)."""
    from torchtitan_xla.models import all_flavors, get_model_args  # torch-free registry of names
    from torchtitan_xla.models.llama.hf_folder import HF_FLAVOR, hf_folder_args

    if cfg.model.flavor == HF_FLAVOR:
        ckpt = cfg.checkpoint
        if not (ckpt.initial_load_in_hf and ckpt.initial_load_path):
            unset = "initial_load_path" if not ckpt.initial_load_path else "initial_load_in_hf"
            raise ConfigError(f"{sources.describe('model', 'flavor')} = \"hf\" takes the architecture of "
                              f"the HuggingFace folder the run starts from: it needs [checkpoint] "
                              f"initial_load_path (that folder) and initial_load_in_hf = true ({unset} is "
                              f"not set)")
        return hf_folder_args(cfg.model.name, ckpt, sources.describe("checkpoint", "initial_load_path"))
    registry = all_flavors()
    known = registry[cfg.model.name]
    if cfg.model.flavor not in known:
        elsewhere = [name for name, flavors in registry.items() if cfg.model.flavor in flavors]
        hint = f" ({cfg.model.flavor} is a flavor of {' and '.join(elsewhere)})" if elsewhere else ""
        raise ConfigError(
            f"{sources.describe('model', 'flavor')} = {cfg.model.flavor!r}: unknown flavor for "
            f"{cfg.model.name}; expected one of {', '.join(known)}{hint}, or \"hf\" (the architecture "
            f"of the HuggingFace folder the run starts from)")
    return get_model_args(cfg.model.name, cfg.model.flavor)


def _check_attention(cfg: JobConfig, args, sources) -> None:
    if args.mla and cfg.model.attention in ("flash", "splash"):
        raise ConfigError(f"{sources.describe('model', 'attention')} = {cfg.model.attention!r}: the flash "
                          f"and splash kernels take values as wide as the queries and keys, and the latent "
                          f"attention of {cfg.model.name} {cfg.model.flavor} has {args.v_dim} against "
                          f"{args.qk_head_dim} features per head; use sdpa or blockwise")
    if args.attn_sinks and cfg.model.attention in ("flash", "splash"):
        raise ConfigError(f"{sources.describe('model', 'attention')} = {cfg.model.attention!r}: the "
                          f"kernel has no attention sinks, and {cfg.model.name} {cfg.model.flavor} adds one "
                          f"logit per head to each softmax; use sdpa or blockwise")
    if args.sliding_window and cfg.model.attention == "flash" and cfg.runtime.backend == "xla":
        raise ConfigError(f"{sources.describe('model', 'attention')} = 'flash': torch_xla's Pallas flash "
                          f"kernel has no sliding window, and {cfg.model.name} {cfg.model.flavor} attends "
                          f"within {args.sliding_window} tokens; use splash, sdpa or blockwise")
    # Scan and the pipeline's stages run one block's code for a stack of blocks.
    stacked = [(s, k) for s, k, on in (("compile", "scan_layers", cfg.compile.scan_layers),
                                       ("parallelism", "pipeline_parallel_degree",
                                        cfg.parallelism.pipeline_parallel_degree > 1)) if on]
    if args.sliding_window and stacked:
        section, key = stacked[0]
        raise ConfigError(f"{sources.describe(section, key)} = {getattr(getattr(cfg, section), key)!r} runs "
                          f"every block as one, and {cfg.model.name} {cfg.model.flavor} has sliding-window "
                          f"blocks ({args.sliding_window} tokens): not supported yet")
    _check_context_parallel(cfg, args, sources)
    _check_pipeline_parallel(cfg, args, sources)


def _check_pipeline_parallel(cfg: JobConfig, args, sources) -> None:
    """What pipeline stages cannot run with yet, and the schedule's own arithmetic."""
    p = cfg.parallelism
    stages = p.pipeline_parallel_degree
    if stages == 1:
        return
    where = sources.describe("parallelism", "pipeline_parallel_degree")
    micro = p.pipeline_microbatches or stages
    if p.pipeline_schedule == "circular" and micro % stages:
        raise ConfigError(f"{sources.describe('parallelism', 'pipeline_microbatches')} = {micro} must be "
                          f"a multiple of pipeline_parallel_degree ({stages}) in the circular schedule: "
                          f"microbatches go round the stages in groups of {stages}")
    # The stage runs the block under torch.vmap: the Pallas kernels, a checkpoint inside the block
    # and the MoE's per-block statistics have no batching rule.
    clash = [(section, key, why) for section, key, on, why in (
        ("model", "attention", cfg.model.attention in ("flash", "splash"), "use sdpa or blockwise"),
        ("moe", "num_experts", cfg.moe.num_experts or args.num_experts, "a mixture of experts is not "
         "supported in a pipeline stage yet"),
        ("compile", "scan_layers", cfg.compile.scan_layers, "the pipeline is its own loop over the layers"),
        ("activation_checkpoint", "mode", cfg.activation_checkpoint.mode == "selective",
         "use full (each layer keeps its input) or none"),
        ("parallelism", "context_parallel_degree", p.context_parallel_degree > 1, "not combined yet"),
        ("lora", "rank", cfg.lora.rank, "not supported in a pipeline stage yet"),
        ("float8", "enable_float8_linear", cfg.float8.enable_float8_linear,
         "not supported in a pipeline stage yet"),
        ("optimizer", "name", cfg.optimizer.name in ("Muon", "Adafactor"), "its update reads each "
         "weight matrix whole, and a stage's are stacked; use AdamW, Adam or Lion"),
        ("eval", "at_end", cfg.eval.at_end, "evaluate the saved checkpoint with python -m "
         "torchtitan_xla.eval")) if on]
    if clash:
        section, key, why = clash[0]
        raise ConfigError(f"{sources.describe(section, key)} = {getattr(getattr(cfg, section), key)!r} "
                          f"cannot run with pipeline parallelism ({where} = {stages}): {why}")


def _check_context_parallel(cfg: JobConfig, args, sources) -> None:
    """What a sequence split over `cp` devices cannot run with yet."""
    cp = cfg.parallelism.context_parallel_degree
    if cp == 1:
        return
    cp_key = f"[parallelism] context_parallel_degree = {cp}"
    if cfg.moe.num_experts or args.num_experts:
        # The expert dispatch sorts a sequence's tokens into slots: not yet constrained to the split.
        raise ConfigError(f"{sources.describe('parallelism', 'context_parallel_degree')} = {cp}: context "
                          f"parallelism with a mixture of experts ({cfg.model.name} {cfg.model.flavor}) is "
                          f"not supported yet")
    if cfg.model.attention in ("flash", "splash"):  # (blockwise: parallelisms/chunk_pair_attention.py)
        raise ConfigError(f"{sources.describe('model', 'attention')} = {cfg.model.attention!r} cannot "
                          f"take context parallelism ({cp_key}): its causal mask is by index, not by "
                          f"the positions of a split sequence; use sdpa or blockwise")
    # Each of these flattens [batch, seq] into one token dimension (LoRA's and float8's matmuls,
    # the chunked loss's rows), which XLA can only do by gathering the split sequence.
    clash = [(section, key, why) for section, key, on, why in (
        ("loss", "chunk_size", cfg.loss.chunk_size, "each device's logits are already 1/cp of the "
         "sequence's; set chunk_size = 0"),
        ("lora", "rank", cfg.lora.rank, "LoRA's matmuls would gather the split sequence"),
        ("float8", "enable_float8_linear", cfg.float8.enable_float8_linear,
         "float8 matmuls would gather the split sequence")) if on]
    if clash:
        section, key, why = clash[0]
        raise ConfigError(f"{sources.describe(section, key)} = {getattr(getattr(cfg, section), key)!r} "
                          f"is not supported with context parallelism ({cp_key}) yet: {why}")


# What the native runtime does not run yet: each refused in one line, before anything is built.
_NOT_ON_NATIVE = (
    ("compile", "scan_layers", lambda v: v, "scan is torch_xla's (scan_layers)"),
    ("model", "attention", lambda v: v == "splash", "the Pallas splash kernel is torch_xla's (flash is "
     "torch's fused attention here)"),
    ("parallelism", "context_parallel_degree", lambda v: v > 1, "its key and value gathers are "
     "sharding annotations for XLA SPMD"),
    ("parallelism", "pipeline_parallel_degree", lambda v: v > 1, "its stages are one SPMD program "
     "(vmapped over a pp-split dimension)"),
    ("moe", "grouped_mm", lambda v: v, "its kernel is torch_xla's Pallas megablox (elsewhere a reference "
     "E times slower)"),
)


def _check_runtime(cfg: JobConfig, sources) -> None:
    """[runtime] against the keys whose meaning depends on it."""
    step, backend = cfg.compile.step, cfg.runtime.backend
    if backend == "xla":
        if step in ("compile", "blocks", "eager"):
            raise ConfigError(f"{sources.describe('compile', 'step')} = {step!r} is the native "
                              f"runtime's; with [runtime] backend = \"xla\" use replay or lazy")
        if cfg.runtime.device != "auto":
            raise ConfigError(f"{sources.describe('runtime', 'device')} = {cfg.runtime.device!r} is "
                              f"the native runtime's; with [runtime] backend = \"xla\" the device is "
                              f"torch_xla's (PJRT_DEVICE)")
        return
    if step == "lazy" or (step == "replay" and sources.origin("compile", "step") is not None):
        raise ConfigError(f"{sources.describe('compile', 'step')} = \"{step}\" is torch_xla's; with "
                          f"[runtime] backend = \"native\" use compile, blocks or eager")
    if step == "replay":  # the default, one compiled step: torch.compile here
        cfg.compile.step = "compile"
    if cfg.activation_checkpoint.offload and cfg.compile.step != "eager":
        raise ConfigError(f"{sources.describe('activation_checkpoint', 'offload')} = "
                          f"{cfg.activation_checkpoint.offload!r} runs with [compile] step = \"eager\" on "
                          f"the native runtime, not {cfg.compile.step!r}: the checkpoint whose saved input "
                          f"goes to the host is a reentrant one, which torch.compile cannot trace")
    refusal = native_refusal(cfg)
    if refusal:
        section, key, value, why = refusal
        raise ConfigError(f"{sources.describe(section, key)} = {value!r} is not available with "
                          f"[runtime] backend = \"native\" yet: {why}")


def native_refusal(cfg: JobConfig) -> tuple[str, str, object, str] | None:
    """The first key the native runtime cannot run yet, as (section, key, value, why); None if it
    runs the whole job."""
    for section, key, refused, why in _NOT_ON_NATIVE:
        value = getattr(getattr(cfg, section), key)
        if refused(value):
            return section, key, value, why
    return None


def _check_moe(cfg: JobConfig, args, sources) -> None:
    """[moe] against the model (`args`) it changes, before anything is built."""
    from torchtitan_xla.models import moe_overrides
    from torchtitan_xla.models.llama.hf_folder import HF_FLAVOR

    m, model = cfg.moe, f"{cfg.model.name} {cfg.model.flavor}"
    if cfg.model.flavor == HF_FLAVOR:
        # The folder's weights fix the experts and their routing: [moe] may restate them only.
        changed = [k for k in ("num_experts", "top_k", "moe_every", "expert_groups", "topk_groups")
                   if getattr(m, k) and getattr(m, k) != getattr(args, k)]
        if changed:
            raise ConfigError(f"{sources.describe('moe', changed[0])} = {getattr(m, changed[0])}: the "
                              f"HuggingFace folder's model has {changed[0]} {getattr(args, changed[0])}, "
                              f"and [model] flavor = \"hf\" takes its architecture")
    ep = cfg.parallelism.expert_parallel_degree
    if not (m.num_experts or args.num_experts):
        given = [k for k in ("top_k", "moe_every", "capacity_factor", "grouped_mm") if getattr(m, k)]
        if given:
            raise ConfigError(f"{sources.describe('moe', given[0])} = {getattr(m, given[0])!r}: the "
                              f"model {model} is dense (no experts); set [moe] num_experts, or use an "
                              f"MoE flavor (mixtral, qwen3 debugmodel_moe, 30B-A3B, 235B-A22B, deepseek_v2, "
                              f"deepseek_v3)")
        if ep > 1:
            raise ConfigError(f"{sources.describe('parallelism', 'expert_parallel_degree')} = {ep}: "
                              f"the model {model} is dense (no experts to split); set [moe] "
                              f"num_experts, or use an MoE flavor")
        return
    experts, top_k = m.num_experts or args.num_experts, m.top_k or args.top_k
    if experts % ep:
        raise ConfigError(f"{sources.describe('parallelism', 'expert_parallel_degree')} = {ep} must "
                          f"divide num_experts ({experts}) of {model}")
    if top_k == 1:
        raise ConfigError(f"{sources.describe('moe', 'top_k')} = 1: Mixtral's router renormalises "
                          f"the top_k probabilities, so one expert gets weight 1 and the router no "
                          f"gradient from the loss; use top_k >= 2")
    if top_k > experts:
        key = "top_k" if m.top_k else "num_experts"
        raise ConfigError(f"{sources.describe('moe', key)} = {getattr(m, key)}: top_k ({top_k}) cannot "
                          f"exceed num_experts ({experts}) of {model}")
    routed = dataclasses.replace(args, **moe_overrides(m))
    _check_groups(routed, m, model, sources)
    every = routed.moe_every
    if every > 1 and cfg.checkpoint.last_save_in_hf and not args.qk_norm:
        # Qwen3-MoE's decoder_sparse_step is this interleaving, with Qwen3's query/key norms.
        raise ConfigError(f"{sources.describe('checkpoint', 'last_save_in_hf')} = true: a Llama model with "
                          f"MoE in one block of every {every} (GLaM-style) has no HuggingFace architecture "
                          f"to export to (a qwen3 model has: Qwen3-MoE); keep the DCP checkpoints instead")
    if m.grouped_mm:
        p = cfg.parallelism
        if args.moe_bias or args.ffn_act != "silu":
            has = f"{'biases and ' if args.moe_bias else ''}the {args.ffn_act} gate"
            raise ConfigError(f"{sources.describe('moe', 'grouped_mm')} = true: the sorted experts compute "
                              f"SwiGLU without biases, and {model}'s experts have {has}; leave it off")
        clash = ([("moe", "capacity_factor", f"{m.capacity_factor:g}", "sorted experts are dropless")]
                 if m.capacity_factor else []) + [
            ("parallelism", k, str(getattr(p, k)), "not supported with it yet")
            for k in ("expert_parallel_degree", "tensor_parallel_degree") if getattr(p, k) > 1]
        if clash:
            section, key, value, why = clash[0]
            raise ConfigError(f"{sources.describe('moe', 'grouped_mm')} = true cannot be combined with "
                              f"[{section}] {key} = {value}: {why}")
    if cfg.lora.rank:
        raise ConfigError(f"{sources.describe('lora', 'rank')} = {cfg.lora.rank}: LoRA adapters for "
                          f"mixture-of-experts models ({model}) are not supported yet")
    if cfg.float8.enable_float8_linear:
        raise ConfigError(f"{sources.describe('float8', 'enable_float8_linear')} = true: float8 is "
                          f"not supported with mixture-of-experts models ({model}) yet")
    if cfg.compile.scan_layers:
        raise ConfigError(f"{sources.describe('compile', 'scan_layers')} = true: scan is not "
                          f"supported with mixture-of-experts models ({model}) yet (the router's "
                          f"statistics are read from the blocks)")


def _check_groups(args, m, model: str, sources) -> None:
    """Group-limited routing (DeepSeek): the experts split into expert_groups groups (of at least two
    for V3, whose group score is its two best), each token's top_k within its topk_groups best."""
    groups, allowed, experts, top_k = args.expert_groups, args.topk_groups, args.num_experts, args.top_k

    def key(*names: str) -> str:  # the [moe] key that set it, or the flavor
        given = [k for k in names if getattr(m, k)]
        return f"{sources.describe('moe', given[0])} = {getattr(m, given[0])}" if given else \
            f"{sources.describe('model', 'flavor')} = {model.split()[-1]!r}"

    if groups > 1 and not args.mla:
        raise ConfigError(f"{key('expert_groups')}: group-limited routing is DeepSeek's (deepseek_v2, "
                          f"deepseek_v3); {model} routes over all its experts")
    least = 2 if args.router == "sigmoid" else 1  # V3 scores a group by its two best experts
    if experts % groups or (groups > 1 and experts // groups < least):
        raise ConfigError(f"{key('expert_groups', 'num_experts')}: the {experts} experts of {model} do "
                          f"not split into {groups} groups of at least {least}")
    if not 1 <= allowed <= groups:
        raise ConfigError(f"{key('topk_groups', 'expert_groups')}: topk_groups ({allowed}) must be in "
                          f"1..expert_groups ({groups}) of {model}")
    if top_k > allowed * (experts // groups):
        raise ConfigError(f"{key('top_k', 'topk_groups', 'expert_groups', 'num_experts')}: top_k ({top_k}) "
                          f"exceeds the {allowed * (experts // groups)} experts of the {allowed} group(s) a "
                          f"token may use ({experts // groups} experts per group) in {model}")
