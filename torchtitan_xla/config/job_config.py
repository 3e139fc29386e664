"""The job's configuration schema: one dataclass per TOML section.

TOML keys, command-line flags and attribute names are the same (`[training] steps` ==
`--training.steps` == `config.training.steps`). Each field carries its default, its help text (shown
by `--help` and docs/config.md) and optional numeric bounds; `manager.py` reads and checks values.

This module imports neither torch nor torch_xla, so launch scripts can read a config cheaply.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Literal

from torchtitan_xla.config.option import opt
from torchtitan_xla.config.post_sections import Generate, Grpo, Preference
from torchtitan_xla.config.run_sections import (
    ActivationCheckpoint,
    Checkpoint,
    Compile,
    Parallelism,
    Runtime,
)

# The datasets of preference pairs (datasets/preference.py), the only ones the preference
# objectives train on (config/checks.py).
PREFERENCE_DATASETS = ("preference", "python_docs_preference")
# The prompt sets of online RL (grpo/data.py), with answers for the rewards.
PROMPT_DATASETS = ("prompts", "larger_numbers")


@dataclass
class Job:
    config_file: str = opt("", "TOML file to read; command-line flags override its values.")
    dump_folder: str = opt(
        "./outputs", "Folder for everything the run writes (config, TensorBoard, checkpoints); may be "
        "a gs:// or s3:// URL (TensorBoard, W&B and traces then go to ./outputs/<scheme>/<path>).")
    description: str = opt("default job", "Free text describing the job; printed at start.")
    print_config: bool = opt(
        True, "Print the effective config at start (it is always saved to <dump_folder>/config.toml).")


@dataclass
class Model:
    name: Literal["llama2", "llama3", "mixtral", "qwen3", "deepseek_v2", "deepseek_v3", "gemma3",
                  "gpt_oss"] = opt(
        "llama3", "Model family (mixtral: Llama blocks with mixture-of-experts feed-forwards, docs/moe.md; "
        "qwen3: Llama blocks with per-head query/key norms, dense or with experts, docs/checkpoint.md; "
        "deepseek_v3: multi-head latent attention, shared and bias-balanced routed experts; deepseek_v2: "
        "the same with softmax routing; docs/moe.md; gemma3: Gemma 3's text model, sliding-window "
        "blocks, docs/checkpoint.md; gpt_oss: biased experts and attention with sinks, docs/moe.md).")
    flavor: str = opt("debugmodel", "Model size within the family (see docs/config.md for the list); "
                      "\"hf\": the architecture of the HuggingFace folder the run starts from "
                      "(checkpoint.initial_load_path with initial_load_in_hf).")
    attention: Literal["sdpa", "blockwise", "flash", "splash"] = opt(
        "sdpa", "Attention kernel: sdpa (the model's own einsums, compiled by XLA or torch.compile, "
        "any device); blockwise (causal attention in 4 query blocks that skip the masked keys, plain "
        "ops: faster on the XLA CPU backend; with context parallelism, only each device's causal "
        "chunk pairs); flash (XLA runtime: torch_xla's Pallas kernel, TPU "
        "only; native runtime: torch's fused scaled_dot_product_attention, any device); splash "
        "(torch_xla's Pallas kernel, TPU only). A kernel the device lacks falls back to sdpa with "
        "one warning.")
    tokenizer_path: str = opt(
        "",
        "Tokenizer file: a tiktoken BPE rank file (Llama 3), a sentencepiece model (Llama 2) or a "
        "HuggingFace tokenizer.json (Qwen3, Llama 3.2; or the model folder holding it). "
        "Empty: the project's own small tokenizer, trained from the embedded corpus and cached.")


@dataclass
class Optimizer:
    name: Literal["AdamW", "Adam", "Muon", "Lion", "Adafactor"] = opt(
        "AdamW", "Optimizer: AdamW, Adam; Muon (orthogonalised momentum for the 2-D hidden weights, "
        "AdamW for the rest); Lion; Adafactor (torch's definition). docs/optimizers.md.")
    lr: float = opt(8e-4, "Peak learning rate (Adafactor: the cap on its relative step size).", gt=0)
    beta1: float = opt(0.9, "Adam / Lion beta1 (Muon's AdamW group too).", ge=0, le=1)
    beta2: float = opt(0.95, "Adam / Lion beta2 (Muon's AdamW group too).", ge=0, le=1)
    eps: float = opt(1e-8, "Adam epsilon.", gt=0)
    weight_decay: float = opt(
        0.1, "Decoupled weight decay (AdamW, Muon, Lion, Adafactor) or L2 penalty (Adam).", ge=0)
    muon_lr: float | None = opt(
        None, "Muon: peak lr of the orthogonalised group; unset: lr (with muon_adjust_lr = "
        "match_rms_adamw the AdamW lr carries over).", gt=0)
    muon_momentum: float = opt(0.95, "Muon: Nesterov momentum.", ge=0, le=1)
    muon_ns_steps: int = opt(5, "Muon: Newton-Schulz iterations.", gt=0)
    muon_ns_dtype: Literal["bfloat16", "float32"] = opt(
        "bfloat16", "Muon: dtype of the Newton-Schulz iteration.")
    muon_adjust_lr: Literal["match_rms_adamw", "original"] = opt(
        "match_rms_adamw", "Muon: lr scale per matrix: 0.2 sqrt(max(rows, cols)) (Moonshot: the "
        "update's RMS matches AdamW's) or sqrt(max(1, rows / cols)) (Keller Jordan's).")
    adafactor_beta2_decay: float = opt(
        -0.8, "Adafactor: the second moment's decay, 1 - t^beta2_decay at step t.", le=0)
    adafactor_clip_threshold: float = opt(
        1.0, "Adafactor: updates are clipped to this RMS (d).", ge=1)
    offload: bool = opt(
        False, "Keep the optimizer's state, with a float32 copy of the weights it updates, in the "
        "host's memory and update there (AdamW, Adam; native runtime; MaxText's "
        "optimizer_memory_host_offload). docs/optimizers.md.")


@dataclass
class LRScheduler:
    warmup_steps: int = opt(200, "Steps of linear warmup from lr/(warmup_steps+1) to lr.", ge=0)
    decay_ratio: float | None = opt(
        None,
        "Fraction of the steps spent decaying at the end (warmup-stable-decay). "
        "Unset: decay over all steps after warmup.", ge=0, le=1)
    decay_type: Literal["linear", "sqrt", "cosine"] = opt("linear", "Shape of the decay.")
    min_lr_factor: float = opt(
        0.0, "The lr decays towards lr * min_lr_factor (never reaching exactly 0).", ge=0, le=1)


@dataclass
class Training:
    dataset: Literal["python_docs", "c4", "json", "parquet", "text", "hf", "synthetic", "chat",
                     "python_docs_chat", "preference", "python_docs_preference", "prompts",
                     "larger_numbers"] = opt(
        "python_docs",
        "Dataset (docs/datasets.md): python_docs is embedded and works offline; c4 streams "
        "allenai/c4 (en) from the Hub, or reads a local copy at dataset_path; json / parquet / "
        "text read local files; hf a save_to_disk folder or a Hub id; synthetic is random tokens. "
        "Fine-tuning (docs/finetune.md): chat reads JSON-lines conversations at dataset_path; "
        "python_docs_chat is an embedded question/answer set made from the Python docs. "
        "Preference pairs (docs/posttrain.md): preference reads JSON-lines {prompt, chosen, "
        "rejected}, or a save_to_disk folder of them, at dataset_path; python_docs_preference is "
        "embedded. Prompts for grpo: prompts reads JSON-lines {prompt or messages, answer, ...} "
        "(or a save_to_disk folder); larger_numbers is embedded (which of two numbers is larger).")
    dataset_path: str = opt(
        "", "File, folder or glob of the dataset (c4: the folder holding en/), local or a gs:// or "
        "s3:// URL; empty: the registry default.")
    dataset_split: str = opt(
        "train", "Split to read: train, or validation (python_docs holds out every tenth topic; c4 "
        "reads c4-validation.* files).")
    shuffle_buffer: int = opt(
        0, "Shuffle documents through a buffer of this many, seeded by debug.seed (0: source "
        "order). The buffer is saved with the data state, so resume stays exact.", ge=0)
    num_workers: int = opt(
        0, "Tokenizing worker processes per host (0: a background thread of the training "
        "process). Resume needs the same value.", ge=0)
    local_batch_size: int = opt(8, "Sequences per data-parallel rank per forward/backward pass.", gt=0)
    global_batch_size: int = opt(
        -1, "Sequences per optimizer step over all data-parallel ranks; a multiple of "
        "local_batch_size x data-parallel degree, the ratio being gradient-accumulation steps. "
        "-1: local_batch_size x data-parallel degree (no accumulation).")
    seq_len: int = opt(2048, "Tokens per sequence.", gt=0)
    max_norm: float = opt(1.0, "Clip gradients to this global L2 norm (0 disables clipping).", ge=0)
    skip_nonfinite_steps: bool = opt(
        True, "A step whose loss or gradient norm is NaN or inf leaves the weights, the optimizer "
        "state and the MoE bias as they were (decided inside the step, no host sync); the log line "
        "counts it. false: its update is applied as computed.")
    max_consecutive_nonfinite: int = opt(
        10, "Stop the run (one line, exit 1) when this many steps in a row were non-finite, checked "
        "at log and checkpoint steps; 0: never stop.", ge=0)
    steps: int = opt(10000, "Training steps.", gt=0)
    packing: bool = opt(
        True, "Chat and preference datasets: pack several conversations (or pairs, each whole) into "
        "each sequence, with attention that does not cross them and positions that restart at "
        "each; false: one conversation (or one answer of a pair) per sequence, padded. "
        "(Pre-training text is always one packed stream.)")
    objective: Literal["lm", "dpo", "ipo", "simpo", "orpo", "grpo"] = opt(
        "lm", "The loss (docs/posttrain.md): lm is next-token cross-entropy (pre-training, SFT); "
        "dpo, ipo, simpo and orpo are preference objectives on pairs of a preference dataset; "
        "grpo is online RL on the policy's own completions of a prompt dataset ([grpo]).")
    mixed_precision_param: Literal["float32", "bfloat16"] = opt(
        "bfloat16", "Compute dtype (autocast); parameters and optimizer state stay float32.")
    mixed_precision_reduce: Literal["float32", "bfloat16"] = opt(
        "float32", "Under bfloat16 compute: the dtype the weight matrices' gradients are summed "
        "across data-parallel devices in (torchtitan's mixed_precision_reduce). float32: each "
        "device's gradient is summed in float32; bfloat16 halves the reduce-scatters' bytes (as "
        "MaxText). The embedding's and the norms' are float32 either way (docs/parallelisms.md).")
    gc_freq: int = opt(50, "Run Python's garbage collector every this many steps.", gt=0)


@dataclass
class Loss:
    label_smoothing: float = opt(
        0.0, "Label smoothing eps: the target is (1 - eps) on the label plus eps spread evenly over "
        "the vocabulary (as F.cross_entropy).", ge=0, le=1)
    z_loss_weight: float = opt(
        0.0, "Weight of PaLM's z-loss, weight x logsumexp(logits)^2 per token (1e-4 in PaLM).", ge=0)
    chunk_size: int = opt(
        0, "0: the loss on full [tokens, vocab] logits. N: the output projection and the loss run "
        "over N tokens of every data-parallel rank at a time, forward and backward, so the full "
        "logits never exist (must divide local_batch_size x seq_len).", ge=0)


@dataclass
class MoE:
    num_experts: int = opt(
        0, "Experts per MoE block; 0: the flavor's (mixtral 8; qwen3 30B-A3B, 235B-A22B 128, debugmodel_moe "
        "8; others dense). > 0 on a dense flavor makes every moe_every-th block an MoE (GLaM).", ge=0)
    top_k: int = opt(0, "Experts each token is routed to; 0: the flavor's (mixtral 2, qwen3 8, its "
                        "debugmodel_moe 4).", ge=0)
    moe_every: int = opt(
        0, "One block in every this many is an MoE (1: all, as Mixtral; 2: every other, as GLaM); "
        "0: the flavor's.", ge=0)
    capacity_factor: float = opt(
        0.0, "0: dropless, every token reaches its top_k experts. c > 0: each expert takes at most "
        "c x top_k x seq_len / num_experts tokens of a sequence; the rest skip the block's "
        "feed-forward (the residual carries them) and the drop rate is logged.", ge=0)
    grouped_mm: bool = opt(
        False, "Run the experts on the routed tokens sorted by expert, as grouped matmuls (torch_xla's "
        "Pallas megablox gmm on TPU, not verified there; a PyTorch reference elsewhere) instead of "
        "GShard's dispatch into slots. Dropless only; not with expert or tensor parallelism yet.")
    expert_groups: int = opt(
        0, "Group-limited routing (DeepSeek-V3's sigmoid router): the experts in this many groups, "
        "each token's top_k chosen within its topk_groups best groups; 0: the flavor's (671B 8).", ge=0)
    topk_groups: int = opt(0, "Groups each token may route to; 0: the flavor's (671B 4).", ge=0)
    bias_update_rate: float = opt(
        1e-3, "Auxiliary-loss-free balancing (routers with an expert bias: deepseek_v3): after each "
        "step every expert's bias moves by this towards balance, up if it got fewer tokens than the "
        "mean, down if more. 0 freezes the bias. Other routers have no bias and ignore it.", ge=0)
    aux_loss_weight: float = opt(
        0.01, "Weight of the load-balancing loss (Switch / Mixtral form; deepseek_v3: its "
        "sequence-wise form, 1e-4 in its recipes), averaged over MoE blocks.", ge=0)
    z_loss_weight: float = opt(
        0.001, "Weight of the router z-loss (ST-MoE: mean logsumexp(router logits)^2), averaged over "
        "MoE blocks.", ge=0)


@dataclass
class LoRA:
    rank: int = opt(
        0, "LoRA rank r: 0 trains every weight; r > 0 freezes the model and trains low-rank "
        "adapters W + (alpha / r) B A on the target_modules (docs/finetune.md).", ge=0)
    alpha: float = opt(16.0, "LoRA alpha: the adapters' output is scaled by alpha / rank.", gt=0)
    dropout: float = opt(0.0, "Dropout on the adapters' input (as peft's lora_dropout).", ge=0, le=1)
    target_modules: list[Literal["wq", "wk", "wv", "wo", "w1", "w2", "w3"]] = opt(
        ["wq", "wk", "wv", "wo", "w1", "w2", "w3"],
        "Linear layers that get adapters, by name within a block (wq, wk, wv, wo, w1, w2, w3).")


@dataclass
class Validation:
    enable: bool = opt(False, "Compute the loss on held-out data during training (docs/evaluation.md).")
    freq: int = opt(500, "Validate after every this many training steps.", gt=0)
    steps: int = opt(
        10, "Batches per validation (each of local_batch_size x data-parallel degree sequences); "
        "-1: the whole split (its last partial batch left out), one host only.", ge=-1)
    dataset: Literal["", "python_docs", "c4", "json", "parquet", "text", "hf", "synthetic", "chat",
                     "python_docs_chat", "preference", "python_docs_preference", "prompts",
                     "larger_numbers"] = opt(
        "", "Dataset to validate on; empty: training.dataset. Preference pairs: the preference "
        "objective's loss and rewards (docs/posttrain.md).")
    dataset_path: str = opt(
        "", "Its file, folder or glob; empty: training.dataset_path when the dataset is training's, "
        "else the registry default.")
    dataset_split: str = opt(
        "validation", "Split to read (python_docs: every tenth topic, never trained on; c4: the "
        "c4-validation.* files).")


@dataclass
class Eval:
    tasks: list[str] = opt(
        [], "Tasks from local files, each kind:path with kind perplexity, lambada or "
        "multiple_choice (scored by log-likelihood), or generate_until (GSM8K-style questions "
        "answered by greedy generation; docs/evaluation.md).")
    checkpoint: str = opt(
        "", "python -m torchtitan_xla.eval: the weights, a checkpoint step folder or a HuggingFace "
        "folder; empty: the newest checkpoint in [checkpoint] folder.")
    batch_size: int = opt(8, "Sequences per scoring batch (a multiple of the data-parallel degree).", gt=0)
    output_file: str = opt(
        "eval_results.json", "Scores and per-request log-likelihoods (JSON), inside dump_folder.")
    at_end: bool = opt(False, "train.py: evaluate the tasks after the last step.")
    num_fewshot: int = opt(0, "generate_until: solved examples before each question.", ge=0)
    fewshot_path: str = opt("", "generate_until: JSON lines of solved examples, as the task's.")
    fewshot_sampler: Literal["default", "first_n"] = opt(
        "default", "generate_until: which examples each question gets, as lm-eval's samplers draw "
        "them: default, num_fewshot at random per question (seeded by fewshot_seed; the stock "
        "gsm8k task's); first_n, the first num_fewshot of fewshot_path for every question.")
    fewshot_seed: int = opt(1234, "generate_until: the default sampler's seed (lm-eval's fewshot seed).")
    until: list[str] = opt(["Question:", "</s>", "<|im_end|>"],
                           "generate_until: stop strings (GSM8K's; EOS always stops).")
    max_gen_toks: int = opt(256, "generate_until: tokens generated at most per question.", gt=0)


@dataclass
class Float8:
    enable_float8_linear: bool = opt(
        False, "Run the Linear layers' matmuls as float8 x float8 -> float32 dots (forward: e4m3 "
        "input and weight; backward: e5m2 output gradient), with dynamic tensorwise scales. The "
        "output projection stays in high precision. See docs/float8.md.")
    filter_fqns: list[str] = opt(
        [], "Keep Linear layers whose name contains any of these strings in high precision "
        "(e.g. attention.wo).")
    recipe_name: Literal["tensorwise"] = opt(
        "tensorwise", "Scaling recipe: tensorwise = one dynamic scale per tensor from its "
        "absolute maximum (global over shards).")


@dataclass
class Metrics:
    log_freq: int = opt(10, "Read the loss back and log every this many steps.", gt=0)
    enable_color_printing: bool = opt(True, "Colour the console line (only when printing to a terminal).")
    enable_tensorboard: bool = opt(False, "Write TensorBoard event files.")
    save_tb_folder: str = opt("tb", "TensorBoard folder, inside dump_folder.")
    enable_wandb: bool = opt(
        False, "Also log the scalars to Weights & Biases, into <dump_folder>/wandb (needs the "
        "wandb package: pip install 'torchtitan_xla[wandb]').")
    wandb_project: str = opt("torchtitan_xla", "W&B project.")
    wandb_run_name: str = opt("", "W&B run name; empty: W&B picks one.")
    wandb_mode: Literal["online", "offline"] = opt(
        "online", "online: send as the run goes (credentials as W&B reads them: WANDB_API_KEY or "
        "`wandb login`); offline: only write the run folder (`wandb sync` uploads it later).")
    rank_0_only: bool = opt(
        True, "On multi-host runs, only host 0 prints the step line and writes TensorBoard; "
        "false: every host does, each into <save_tb_folder>/<time>/rank_<host>.")
    peak_flops: float | None = opt(
        None, "Peak FLOP/s of one device, for MFU. Unset: the bf16 peak of the TPU generation "
        "(v4, v5e, v5p, v6e, v7); on other devices MFU is n/a.", gt=0)
    goodput: bool = opt(
        True, "Record where the run's time goes (start-up, compiles, data waits, checkpoints, "
        "steps) in <dump_folder>/goodput/, one file per attempt; `python -m torchtitan_xla.goodput "
        "DUMP_FOLDER` reports goodput over all attempts, and it goes to TensorBoard at the end.")
    goodput_freq: int = opt(
        0, "Also write goodput to TensorBoard every this many steps (0: only at the end).", ge=0)


@dataclass
class Profiling:
    enable_profiling: bool = opt(
        False, "Write XLA profiler traces (TensorBoard's profile plugin reads them).")
    save_traces_folder: str = opt(
        "profile_traces",
        "Trace folder, inside dump_folder; one iteration_<step> subfolder per trace.")
    profile_freq: int = opt(10, "Trace the steps ending at every multiple of this step.", gt=0)
    profiler_active: int = opt(1, "Steps per trace (at most profile_freq).", gt=0)
    save_xla_metrics_report: bool = opt(
        False, "When the run ends (or fails), write torch_xla's metrics report (compiles, "
        "transfers, executions, CPU fallbacks) to <dump_folder>/xla_metrics_report.txt.")


@dataclass
class Plan:
    tpu: str = opt(
        "", "The TPU slice the job is meant for (e.g. v5p-256, v6e-256): what `run_train.sh --plan` "
        "(python -m torchtitan_xla.plan) checks memory and speed against. Training ignores it.")


@dataclass
class Debug:
    seed: int | None = opt(None, "Seed for parameter init and data order; unset: a fixed default.")
    deterministic: bool = opt(False, "Use deterministic algorithms only (same config, same losses).")
    on_recompile: Literal["error", "warn"] = opt(
        "error", "What a graph compile after warm-up (step 2) does: stop the run, or log a warning.")


@dataclass
class JobConfig:
    job: Job = field(default_factory=Job)
    model: Model = field(default_factory=Model)
    optimizer: Optimizer = field(default_factory=Optimizer)
    lr_scheduler: LRScheduler = field(default_factory=LRScheduler)
    training: Training = field(default_factory=Training)
    loss: Loss = field(default_factory=Loss)
    preference: Preference = field(default_factory=Preference)
    grpo: Grpo = field(default_factory=Grpo)
    moe: MoE = field(default_factory=MoE)
    lora: LoRA = field(default_factory=LoRA)
    validation: Validation = field(default_factory=Validation)
    eval: Eval = field(default_factory=Eval)
    generate: Generate = field(default_factory=Generate)
    parallelism: Parallelism = field(default_factory=Parallelism)
    checkpoint: Checkpoint = field(default_factory=Checkpoint)
    activation_checkpoint: ActivationCheckpoint = field(default_factory=ActivationCheckpoint)
    runtime: Runtime = field(default_factory=Runtime)
    compile: Compile = field(default_factory=Compile)
    float8: Float8 = field(default_factory=Float8)
    metrics: Metrics = field(default_factory=Metrics)
    profiling: Profiling = field(default_factory=Profiling)
    plan: Plan = field(default_factory=Plan)
    debug: Debug = field(default_factory=Debug)

    def to_dict(self) -> dict[str, dict[str, Any]]:
        return dataclasses.asdict(self)

    def to_toml(self) -> str:
        import tomli_w

        # TOML has no null: an unset optional key is left out, which reads back as unset.
        clean = {s: {k: v for k, v in kv.items() if v is not None} for s, kv in self.to_dict().items()}
        return tomli_w.dumps(clean)
