"""Checks of the objective against its data and settings (`[training] objective`, `[preference]`,
`[grpo]`): each a ConfigError of one line naming where the key was set. Torch-free."""

from __future__ import annotations

from torchtitan_xla.config.job_config import PREFERENCE_DATASETS, PROMPT_DATASETS, JobConfig
from torchtitan_xla.errors import ConfigError


def check_objective(cfg: JobConfig, sources) -> None:
    """Preference objectives train on pairs of rows of a preference dataset, and only there; grpo
    on the prompts of a prompt dataset, and only there."""
    t, v = cfg.training, cfg.validation
    if v.enable and v.dataset and (v.dataset in PROMPT_DATASETS) != (t.objective == "grpo"):
        raise ConfigError(f"{sources.describe('validation', 'dataset')} = {v.dataset!r} with "
                          f"{sources.describe('training', 'objective')} = {t.objective!r}: grpo validates "
                          f"on prompts (prompts or larger_numbers), and only it does")
    if t.objective == "grpo" or t.dataset in PROMPT_DATASETS:
        _check_grpo(cfg, sources)
        return
    objective, dataset = sources.describe("training", "objective"), sources.describe("training", "dataset")
    pairs = t.dataset in PREFERENCE_DATASETS
    if v.enable and v.dataset in PREFERENCE_DATASETS and not pairs:
        raise ConfigError(f"{sources.describe('validation', 'dataset')} = {v.dataset!r} with "
                          f"{objective} = {t.objective!r}: held-out preference pairs are scored by "
                          f"the preference objective the run trains with (dpo, ipo, simpo or orpo)")
    if (t.objective == "lm") == pairs:
        raise ConfigError(f"{objective} = {t.objective!r} with {dataset} = {t.dataset!r}: "
                          + ("preference pairs need a preference objective (dpo, ipo, simpo or orpo)"
                             if pairs else f"{t.objective} trains on preference pairs (dataset "
                             f"preference or python_docs_preference)"))
    if not pairs:
        return
    if t.local_batch_size % 2 and not t.packing:
        raise ConfigError(f"{sources.describe('training', 'local_batch_size')} = {t.local_batch_size}: "
                          f"{t.objective} needs an even number of rows (with packing = false each "
                          f"pair is two rows)")
    pref = cfg.preference
    stored = f"{sources.describe('preference', 'precomputed_reference')} = true"
    if pref.precomputed_reference and t.objective not in ("dpo", "ipo"):
        raise ConfigError(f"{stored} with {objective} = {t.objective!r}: only dpo and ipo compare with "
                          f"a reference model")
    if pref.precomputed_reference and pref.reference:
        raise ConfigError(f"{stored} with {sources.describe('preference', 'reference')} = "
                          f"{pref.reference!r}: the pairs' stored log-probabilities replace the "
                          f"reference model; set one of them")


def _check_grpo(cfg: JobConfig, sources) -> None:
    t, g = cfg.training, cfg.grpo
    objective, dataset = sources.describe("training", "objective"), sources.describe("training", "dataset")
    if t.objective != "grpo" or t.dataset not in PROMPT_DATASETS:
        raise ConfigError(f"{objective} = {t.objective!r} with {dataset} = {t.dataset!r}: grpo trains on "
                          f"the prompts of a prompt dataset (prompts or larger_numbers), and only it does")
    if g.num_generations < 2:
        raise ConfigError(f"{sources.describe('grpo', 'num_generations')} = {g.num_generations}: a group "
                          f"needs 2 completions or more (a completion's advantage is its reward against "
                          f"its group's)")
    need = g.max_prompt_length + g.max_completion_length
    if need > t.seq_len:
        raise ConfigError(f"{sources.describe('grpo', 'max_completion_length')} = "
                          f"{g.max_completion_length}: with max_prompt_length = {g.max_prompt_length} it "
                          f"needs {need} tokens of KV cache and training row; [training] seq_len is "
                          f"{t.seq_len}")
    if g.epsilon_high != -1 and g.epsilon_high < 0:
        raise ConfigError(f"{sources.describe('grpo', 'epsilon_high')} = {g.epsilon_high}: expected -1 "
                          f"(epsilon's value) or 0 and more")
    if g.reward_weights and len(g.reward_weights) != len(g.reward_functions):
        raise ConfigError(f"{sources.describe('grpo', 'reward_weights')}: {len(g.reward_weights)} weights "
                          f"for {len(g.reward_functions)} reward functions")
    if not g.reward_functions:
        raise ConfigError(f"{sources.describe('grpo', 'reward_functions')} is empty: name at least one")
    p = cfg.parallelism
    for key, degree in (("pipeline_parallel_degree", p.pipeline_parallel_degree),
                        ("context_parallel_degree", p.context_parallel_degree)):
        if degree > 1:
            raise ConfigError(f"{sources.describe('parallelism', key)} = {degree}: grpo's rollouts do not "
                              f"run on pipeline or context parallel meshes yet")
    if cfg.compile.scan_layers:
        raise ConfigError(f"{sources.describe('compile', 'scan_layers')} = true: grpo's rollouts do not "
                          f"run on scanned blocks yet")
