"""The sections of post-training: the preference objectives and generation (part of the schema
of job_config.py; torch-free)."""

from __future__ import annotations

from dataclasses import dataclass

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
