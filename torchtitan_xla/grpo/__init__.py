"""Online RL with verifiable rewards (`[training] objective = "grpo"`, `[grpo]`; docs/posttrain.md):
the policy's own completions of a prompt set (rollouts.py, generated on the training mesh with
generate/), scored (rewards.py), as batches of the same training loop and step, with TRL's GRPO
objective and its variants (objective.py)."""

from __future__ import annotations

from torchtitan_xla.config import JobConfig


def build_rollouts(job_config: JobConfig, tokenizer, *, batch_size: int, host_rank: int = 0,
                   host_count: int = 1, split: str | None = None, device=None, input_sharding=None,
                   **loader_options):
    """What build_data_loader is to the other objectives: this data rank (`host_rank` of
    `host_count`)'s rollouts of `batch_size` completions a step, the prompts read and the reward
    functions imported and checked now; `sample_from(model, loss_fn)` once the policy exists.
    (`loader_options`: the loader's that rollouts have no use for: they never end, and context
    parallelism does not run them.)"""
    from torchtitan_xla import runtime
    from torchtitan_xla.errors import ConfigError
    from torchtitan_xla.grpo.data import load_prompts
    from torchtitan_xla.grpo.rewards import Rewards
    from torchtitan_xla.grpo.rollouts import Rollouts

    t, g = job_config.training, job_config.grpo
    if host_count > 1 and not runtime.PROCESS_PER_DEVICE:
        raise ConfigError(f"[training] objective = \"grpo\" runs on one host of the XLA runtime for now "
                          f"(this job has {host_count}): its generation would take each host's rows as "
                          f"the whole batch")
    split = split or t.dataset_split
    records = load_prompts(t.dataset, t.dataset_path, split)
    rewards = Rewards(g.reward_functions, g.reward_weights, answer_pattern=g.answer_pattern,
                      format_pattern=g.format_pattern, max_completion_length=g.max_completion_length)
    rewards.check_columns(records, f"[training] dataset {t.dataset_path or t.dataset} ({split} split)")
    return Rollouts(job_config, records=records, tokenizer=tokenizer, rewards=rewards, rows=batch_size,
                    data_rank=host_rank, data_count=host_count, device=device, input_sharding=input_sharding)
