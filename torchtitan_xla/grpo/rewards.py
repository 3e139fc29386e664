"""The rewards of online RL (`[grpo] reward_functions`, weighted by `reward_weights`): built-in
verifiable ones, or any `module:function`, called as TRL calls its reward functions:

    f(prompts=[...], completions=[...], completion_ids=[...], **columns) -> one float per completion

where `prompts` are the rows' prompts (text or messages), `completions` the completions' text (cut
before a stop string), `completion_ids` their token ids, and every other column of the prompt
rows (e.g. `answer`) a list aligned with them. None marks a completion a function does not score
(it counts as 0 in the weighted sum, as TRL's nansum).

- `accuracy`: 1 where the last match of `answer_pattern` in the completion (its first group,
  commas dropped) equals the row's `answer` (numbers compared as numbers; GSM8K's "... #### 72"
  form gives 72), else 0.
- `format`: 1 where the whole completion matches `format_pattern`, else 0.
- `length`: minus the share of max_completion_length the completion used (a length penalty).
"""

from __future__ import annotations

import importlib
import math
import numbers
import re
from collections.abc import Callable, Sequence

from torchtitan_xla.errors import ConfigError

KEY = "[grpo] reward_functions"


def _number(text: str) -> float | None:
    try:
        return float(text.replace(",", "").strip())
    except ValueError:
        return None


def _normalised_answer(answer: object) -> str:
    text = str(answer)
    return text.split("####")[-1].strip().replace(",", "")


def _answers_equal(extracted: str, answer: object) -> bool:
    expected = _normalised_answer(answer)
    a, b = _number(extracted), _number(expected)
    return a == b if a is not None and b is not None else extracted.strip() == expected


def accuracy(pattern: str) -> Callable:
    regex = re.compile(pattern)

    def reward(completions, answer, **_):
        out = []
        for text, expected in zip(completions, answer):
            matches = list(regex.finditer(text))
            found = (matches[-1].group(1) if regex.groups else matches[-1].group(0)) if matches else None
            out.append(float(found is not None and _answers_equal(found.replace(",", ""), expected)))
        return out

    return reward


def format_match(pattern: str) -> Callable:
    regex = re.compile(pattern)

    def reward(completions, **_):
        return [float(regex.fullmatch(text) is not None) for text in completions]

    return reward


def length_penalty(max_completion_length: int) -> Callable:
    def reward(completion_ids, **_):
        return [-len(ids) / max_completion_length for ids in completion_ids]

    return reward


def _imported(name: str) -> Callable:
    module, _, attr = name.partition(":")
    if not module or not attr:
        raise ConfigError(f"{KEY}: {name!r}: expected accuracy, format, length or module:function")
    try:
        fn = getattr(importlib.import_module(module), attr)
    except Exception as e:  # noqa: BLE001 - any import failure is the user's module's
        raise ConfigError(f"{KEY}: {name}: cannot be imported ({type(e).__name__}: {e})") from None
    if not callable(fn):
        raise ConfigError(f"{KEY}: {name}: not a function")
    return fn


class Rewards:
    """`rewards(prompts, completions, completion_ids, columns)` -> ([completions, functions]
    rewards, NaN where a function gave None; their weighted sum per completion)."""

    def __init__(self, names: Sequence[str], weights: Sequence[float], *, answer_pattern: str,
                 format_pattern: str, max_completion_length: int):
        builtin = {"accuracy": lambda: accuracy(answer_pattern),
                   "format": lambda: format_match(format_pattern),
                   "length": lambda: length_penalty(max_completion_length)}
        for key, pattern in (("answer_pattern", answer_pattern), ("format_pattern", format_pattern)):
            try:
                re.compile(pattern)
            except re.error as e:
                raise ConfigError(f"[grpo] {key} = {pattern!r}: not a regular expression ({e})") from None
        self.names = list(names)
        self.labels = [n.rpartition(":")[2] for n in self.names]  # metrics' names: the function's, as TRL's
        self.functions = [builtin[n]() if n in builtin else _imported(n) for n in self.names]
        self.weights = list(weights) or [1.0] * len(self.names)

    def check_columns(self, records: Sequence[dict], where: str) -> None:
        """The accuracy reward compares with each row's answer: one line if a row has none."""
        if "accuracy" in self.names:
            for n, record in enumerate(records):
                if record.get("answer") is None:
                    raise ConfigError(f"{KEY}: accuracy compares with each prompt's \"answer\"; {where} "
                                      f"row {n} has none")

    def __call__(self, prompts: list, completions: list[str], completion_ids: list[list[int]],
                 columns: dict[str, list]) -> tuple[list[list[float]], list[float]]:
        per_function = []
        for name, fn in zip(self.names, self.functions):
            try:
                values = fn(prompts=prompts, completions=completions, completion_ids=completion_ids,
                            **columns)
            except Exception as e:  # noqa: BLE001 - the user's function: one line naming it
                raise ConfigError(f"{KEY}: {name} raised {type(e).__name__}: {e}") from None
            if hasattr(values, "tolist"):  # a numpy array or a tensor
                values = values.tolist()
            if (not isinstance(values, (list, tuple)) or len(values) != len(completions)
                    or not all(v is None or isinstance(v, numbers.Real) for v in values)):
                got = (f"{len(values)} values" if isinstance(values, (list, tuple))
                       else type(values).__name__)
                raise ConfigError(f"{KEY}: {name} returned {got}; expected a list of {len(completions)} "
                                  f"numbers (or None), one per completion")
            per_function.append([math.nan if v is None else float(v) for v in values])
        rows = [list(r) for r in zip(*per_function)]
        totals = [sum(w * v for w, v in zip(self.weights, r) if not math.isnan(v)) for r in rows]
        return rows, totals
