"""The sections of post-training: the preference objectives, online RL (GRPO) and generation (part
of the schema of job_config.py; torch-free)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from torchtitan_xla.config.option import opt


@dataclass
class Preference:
    beta: float = opt(
        0.1, "beta: the strength of the preference (DPO's KL weight; ORPO's lambda).", gt=0)
    label_smoothing: float = opt(
        0.0, "dpo, simpo: the probability that a pair's labels are flipped (conservative DPO).",
        ge=0, le=0.5)
    simpo_gamma: float = opt(0.5, "simpo: the target reward margin gamma.", ge=0)
    reference: str = opt(
        "", "dpo, ipo: the frozen reference model, a checkpoint step or HuggingFace folder; empty: "
        "[checkpoint] initial_load_path, or with LoRA the base model (the adapters switched off).")
    precomputed_reference: bool = opt(
        False, "dpo, ipo: each pair carries its reference log-probabilities (TRL's ref_chosen_logps and "
        "ref_rejected_logps, as its precompute_ref_log_probs stores them): no reference model is run.")
    reference_output: str = opt(
        "", "python -m torchtitan_xla.reference: the JSON lines file it writes, the training pairs "
        "each with the reference's log-probabilities (for precomputed_reference).")


@dataclass
class Generate:
    checkpoint: str = opt(
        "", "python -m torchtitan_xla.generate: the weights, a checkpoint step folder or a "
        "HuggingFace folder; empty: the newest checkpoint in [checkpoint] folder.")
    prompts: str = opt(
        "", "JSON lines, each {\"prompt\": text} or {\"messages\": [...]} (the chat template "
        "applied, ending with the assistant's header).")
    prompt: str = opt("", "One prompt, instead of a prompts file.")
    output: str = opt(
        "", "JSON lines: each input line with its \"completion\" (and \"finish\": eos, stop or "
        "length); empty: <dump_folder>/generations.jsonl.")
    max_new_tokens: int = opt(
        128, "Tokens generated at most per prompt; the padded prompt and these must fit "
        "[training] seq_len, the KV cache's size.", gt=0)
    temperature: float = opt(0.0, "0: greedy; else sample from softmax(logits / temperature).", ge=0)
    top_k: int = opt(0, "Sample among the k most likely tokens (0: all).", ge=0)
    top_p: float = opt(1.0, "Sample among the most likely tokens whose probability reaches top_p.",
                       gt=0, le=1)
    seed: int = opt(0, "Seed of the sampling (the same seed repeats the same completions).")
    stop: list[str] = opt([], "Stop strings: a completion ends before the first it contains.")
    batch_size: int = opt(8, "Prompts generated together (a multiple of the data-parallel degree).", gt=0)


@dataclass
class Grpo:
    num_generations: int = opt(
        8, "Completions sampled per prompt (a group); the step's rows, global_batch_size, are "
        "prompts x num_generations.", gt=0)
    max_prompt_length: int = opt(
        64, "Prompt tokens at most (a longer prompt stops the run); every prompt is padded to it "
        "for generation, so that one prefill graph serves every rollout.", gt=0)
    max_completion_length: int = opt(
        64, "Tokens generated at most per completion; max_prompt_length + this must fit [training] "
        "seq_len (the KV cache and the training rows).", gt=0)
    temperature: float = opt(
        1.0, "Sampling temperature of the rollouts; the policy's log-probabilities are taken at it "
        "too (TRL's).", gt=0)
    top_k: int = opt(0, "Sample among the k most likely tokens (0: all).", ge=0)
    top_p: float = opt(1.0, "Sample among the most likely tokens whose probability reaches top_p.",
                       gt=0, le=1)
    stop: list[str] = opt([], "Stop strings: a completion ends with the first it contains (its "
                              "reward sees the text before it).")
    num_iterations: int = opt(
        1, "Optimizer steps on each rollout (TRL's num_iterations, GRPO's mu); above 1 the "
        "old policy's log-probabilities are recorded at the rollout.", gt=0)
    epsilon: float = opt(0.2, "The clip range of the ratio: [1 - epsilon, 1 + epsilon_high].", ge=0)
    epsilon_high: float = opt(-1.0, "The upper clip bound (DAPO's clip-higher); -1: epsilon.")
    beta: float = opt(
        0.0, "Weight of the KL penalty to the reference model (the k3 estimator); 0 loads no "
        "reference (TRL's default).", ge=0)
    scale_rewards: Literal["group", "batch", "none"] = opt(
        "group", "Advantages: the reward minus its group's mean, divided by the group's std "
        "(group), the whole rollout's std (batch), or not divided (none: Dr. GRPO).")
    loss_type: Literal["grpo", "bnpo", "dapo", "dr_grpo"] = opt(
        "dapo", "Aggregation of the per-token losses: grpo: mean per sequence, then over sequences; "
        "bnpo: each data-parallel rank's microbatch's token mean, then their mean; dapo: the mean "
        "over every completion token of the step; dr_grpo: the sum over (rows x "
        "max_completion_length).")
    reward_functions: list[str] = opt(
        ["accuracy"], "Rewards (docs/posttrain.md): accuracy (the answer extracted by "
        "answer_pattern equals the row's answer), format (the completion matches format_pattern), "
        "length (minus the share of max_completion_length used), or module:function, called as "
        "TRL's: f(prompts=..., completions=..., **columns) -> one float per completion.")
    reward_weights: list[float] = opt([], "A weight per reward function; empty: 1 each.")
    answer_pattern: str = opt(
        r"(-?[0-9][0-9,]*(?:\.[0-9]+)?)", "accuracy: a regex whose last match in the completion "
        "(its first group, commas dropped) is compared with the row's answer.")
    format_pattern: str = opt(r"^\s*-?[0-9]+\s*$", "format: a regex the whole completion must match.")
    seed: int = opt(0, "Seed of the rollouts' sampling (each rollout draws from seed + its index).")
