"""User reward functions for tests/test_grpo.py, named as module:function
(`--grpo.reward_functions accuracy,tests.grpo_rewards:digit_share`)."""


def digit_share(completions, **columns):
    """The share of each completion's characters that are digits."""
    return [sum(c.isdigit() for c in text) / max(len(text), 1) for text in completions]


def starts_with_a_digit(completions, **columns):
    """1 where a completion's first character is a digit, else 0."""
    return [float(text[:1].isdigit()) for text in completions]
