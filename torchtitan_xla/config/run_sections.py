"""The sections of how a job runs rather than what it trains: the mesh's degrees, checkpoints,
activation checkpointing, the runtime and the step compiler (part of the schema of job_config.py;
torch-free)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from torchtitan_xla.config.option import opt


@dataclass
class Parallelism:
    data_parallel_replicate_degree: int = opt(
        1, "Replicas of the model (HSDP replicate / DDP dimension).", gt=0)
    data_parallel_shard_degree: int = opt(
        -1, "FSDP dimension: parameters, gradients and optimizer state are sharded over it. "
        "-1: all devices not used by the other degrees.")
    tensor_parallel_degree: int = opt(
        1, "Tensor (Megatron) parallel degree, with sequence parallelism between blocks.", gt=0)
    expert_parallel_degree: int = opt(
        1, "Expert parallel degree (mixture-of-experts models): the experts are split over this "
        "many devices, which are also data-parallel ranks (dense weights are sharded over "
        "data_parallel_shard_degree x expert_parallel_degree). Must divide num_experts.", gt=0)
    context_parallel_degree: int = opt(
        1, "Context parallel degree: each sequence is split over this many devices (every "
        "activation on its sequence dimension), which gather the keys and values of the whole "
        "sequence for attention. They are FSDP ranks for the weights (sharded over "
        "data_parallel_shard_degree x context_parallel_degree). Needs [model] attention = \"sdpa\"; "
        "XLA runtime only.", gt=0)
    context_parallel_load_balance: bool = opt(
        True, "Causal load balancing for context parallelism: the sequence is cut into 2 x "
        "context_parallel_degree chunks and device i holds chunks i and 2 x degree - 1 - i, so "
        "every device has the same share of the causal attention (positions and the attention "
        "mask follow the tokens). seq_len must then be a multiple of 2 x the degree.")
    context_parallel_rotate_method: Literal["allgather", "ring"] = opt(
        "allgather", "How attention reaches the keys and values of the whole sequence with context "
        "parallelism: allgather (each block's keys and values gathered over the cp devices) or ring "
        "(they are passed around the cp devices in cp steps by collective permutes, with an online "
        "softmax: no device holds the whole sequence's).")
    pipeline_parallel_degree: int = opt(
        1, "Pipeline stages: the blocks are split into this many stages of consecutive layers "
        "(circular: every S-th layer group), each held by its own devices; only activations pass "
        "between stages (collective permutes). Needs [model] attention = \"sdpa\"; XLA runtime only.",
        gt=0)
    pipeline_microbatches: int = opt(
        0, "Microbatches each data-parallel batch is cut into for the pipeline (0: one per stage). "
        "Must divide local_batch_size; the idle fraction of a stage (the bubble) is "
        "(S - 1) / (microbatches x repeats + S - 1) for S stages.", ge=0)
    pipeline_schedule: Literal["gpipe", "circular"] = opt(
        "gpipe", "gpipe: stage s holds layers s x n_layers / S onward, each microbatch passes the "
        "stages once. circular: stage s holds every S-th group of layers, each microbatch goes round "
        "the stages pipeline_repeats times (a smaller bubble); microbatches must be a multiple of S.")
    pipeline_repeats: int = opt(
        2, "Rounds of the stages per microbatch in the circular schedule (layer groups per stage); "
        "S x repeats must divide n_layers.", gt=0)
    num_slices: int = opt(
        1, "TPU slices joined over DCN (multi-slice). Slices hold model replicas (the outer part of "
        "data_parallel_replicate_degree, which must be a multiple of it) or, with pipeline "
        "parallelism, pipeline stages (pipeline_parallel_degree must be a multiple of it).", gt=0)


@dataclass
class Checkpoint:
    enable: bool = opt(False, "Save checkpoints, and resume from the newest one at start.")
    folder: str = opt("checkpoint", "Checkpoint folder, inside dump_folder unless absolute or a gs:// "
                      "or s3:// URL; holds step-<N> folders.")
    interval: int = opt(500, "Save every this many steps (and after the last step).", gt=0)
    async_mode: Literal["disabled", "async"] = opt(
        "disabled", "async: copy the state on the device (the loop waits only for that), then move "
        "it to host memory and write it in the background while training continues; needs device "
        "memory for a second copy of the saved state until it reaches the host.")
    keep_latest_k: int = opt(
        10, "Keep this many newest checkpoints (0: all). Old ones are deleted only after a newer "
        "one is complete.", ge=0)
    load_step: int = opt(-1, "Resume from this step's checkpoint; -1: the newest usable one.", ge=-1)
    last_save_model_only: bool = opt(
        False, "Make the save after the last step model weights only (for export), in export_dtype.")
    export_dtype: Literal["float32", "bfloat16", "float16"] = opt(
        "float32", "dtype of model-only saves and of the HuggingFace export.")
    exclude_from_loading: list[str] = opt(
        [], "Parts not to restore on resume: any of model, optimizer, lr_scheduler, dataloader, "
        "train_state.")
    on_damaged: Literal["fallback", "error"] = opt(
        "fallback", "A checkpoint that fails to load: fall back to the previous one, or stop.")
    initial_load_path: str = opt(
        "", "With no checkpoint to resume from, start from these weights: a checkpoint step folder, "
        "or a HuggingFace Llama folder (with initial_load_in_hf).")
    initial_load_in_hf: bool = opt(False, "initial_load_path is a HuggingFace safetensors folder.")
    last_save_in_hf: bool = opt(
        False, "After the last step also export HuggingFace safetensors + config.json to "
        "<folder>/step-<N>-hf.")
    create_seed_checkpoint: bool = opt(
        False, "Initialise the model, save it as step-0 (weights only) and exit: every run of an "
        "experiment can then start from identical weights.")


@dataclass
class ActivationCheckpoint:
    mode: Literal["none", "full", "selective"] = opt(
        "selective", "Recompute activations in the backward pass instead of keeping them: none, "
        "full (every block), or selective (see selective_ac_option).")
    selective_ac_option: str = opt(
        "2", "For mode selective: an integer N checkpoints every N-th block; 'op' keeps the "
        "outputs of the weight matmuls and recomputes everything else (norms, RoPE, attention "
        "scores, activations).")
    offload: list[Literal["decoder_layer_input", "qkv_proj"]] = opt(
        [], "Activations kept in the host's memory between the forward and backward passes, with "
        "mode full: decoder_layer_input (each block's input, from which the block is recomputed), "
        "qkv_proj (the attention's query, key and value projections, then not recomputed). XLA: "
        "torch_xla's place_to_host / place_to_device (the XLA CPU backend leaves values in place); "
        "native: pinned host memory, with [compile] step = eager.")


@dataclass
class Runtime:
    backend: Literal["xla", "native"] = opt(
        "xla", "xla: torch_xla SPMD, one process per host. native: PyTorch distributed (DTensor, "
        "torch.compile), one process per device: TorchTPU, CUDA, or the CPU with gloo.")
    device: Literal["auto", "cpu", "cuda", "tpu"] = opt(
        "auto", "The native runtime's device; auto: tpu where torch-tpu finds one, else cuda, else cpu.")


@dataclass
class Compile:
    step: Literal["replay", "lazy", "compile", "blocks", "eager"] = opt(
        "replay", "How a step runs. XLA runtime, one graph per step: replay traces the first two "
        "steps, then runs the compiled graph directly; lazy traces every step "
        "(torch_xla.compile). Native runtime: compile (what replay means there: each "
        "microbatch's forward, loss and backward one torch.compile'd graph, the update another), "
        "blocks (torch.compile per block, the rest eager: for models whose whole graph compiles "
        "too slowly) or eager.")
    scan_layers: bool = opt(
        False, "Run the blocks as one XLA while loop over stacked weights (torch_xla scan_layers): "
        "compile time stops growing with depth. With scan, activation_checkpoint mode must be "
        "'none' or selective 'op' (done by the min-cut partitioner).")
