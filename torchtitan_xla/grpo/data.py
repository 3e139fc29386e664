"""The prompts of online RL, read whole when the run starts (prompt sets are small: GSM8K's train
split is 7,473 rows), each a record of its own columns:

- `[training] dataset = "prompts"`: JSON lines at dataset_path (a file, folder or glob, local or a
  URL) or a `save_to_disk` folder (its splits). A record is TRL's prompt-only form,
  {"prompt": text} (encoded as text, with BOS) or {"prompt": [messages]} / {"messages": [...]}
  (a conversation ending with the user's turn, rendered in the tokenizer's chat format up to the
  assistant's header), with any other columns (the reward functions get them: "answer" for the
  accuracy reward).
- `"larger_numbers"`: embedded, offline: "Which is larger, 12 or 7?" as a user turn, with its
  answer (larger_numbers()).
"""

from __future__ import annotations

from torchtitan_xla.errors import ConfigError


def parse_prompt(record: object) -> dict:
    """A JSON record -> itself, checked: a prompt as text or as a conversation that ends with the
    user's turn."""
    from torchtitan_xla.datasets.chat import parse_conversation

    if not isinstance(record, dict):
        raise ConfigError("expected a JSON object with \"prompt\" or \"messages\"")
    prompt = record.get("prompt", record.get("messages"))
    if isinstance(prompt, str):
        if not prompt:
            raise ConfigError("an empty prompt")
        return record
    if not isinstance(prompt, list):
        raise ConfigError("no \"prompt\" (a string or a list of messages) or \"messages\"")
    parse_conversation({"messages": prompt}, final="user")
    return record


def prompt_of(record: dict) -> str | list:
    """What the reward functions get as the prompt: the text, or the messages."""
    return record["prompt"] if "prompt" in record else record["messages"]


def encode_prompt(record: dict, tokenizer) -> list[int]:
    from torchtitan_xla.datasets.chat import generation_prompt, parse_conversation

    prompt = prompt_of(record)
    if isinstance(prompt, str):
        return tokenizer.encode(prompt, bos=True, eos=False)
    return generation_prompt(parse_conversation({"messages": prompt}, final="user"), tokenizer)


def larger_numbers(split: str) -> list[dict]:
    """"Which is larger, 3 or 8?" for the 90 ordered pairs of different digits, each a user turn
    asking for a number, with its answer; every tenth pair is held out (9). A model that answers
    with one of the prompt's numbers is right half the time, so sampled groups differ in reward
    early, and the rest is learning which one."""
    if split not in ("train", "validation"):
        raise ConfigError(f"[training] dataset_split: 'larger_numbers' has splits train and validation, "
                          f"not {split!r}")
    pairs = [(a, b) for a in range(10) for b in range(10) if a != b]
    chosen = [p for i, p in enumerate(pairs) if (i % 10 == 9) == (split == "validation")]
    question = "Which is larger, {} or {}? Answer with the number only."
    return [{"prompt": [{"role": "user", "content": question.format(a, b)}], "answer": str(max(a, b))}
            for a, b in chosen]


def load_prompts(name: str, path: str, split: str) -> list[dict]:
    """The records of a prompt dataset (module docstring), every one checked now."""
    from torchtitan_xla import storage
    from torchtitan_xla.datasets.sources import (
        JSON_SUFFIXES,
        SAVED_MARKERS,
        _local_files,
        _only_train,
        _saved_folder,
        _saved_split,
        _without_nulls,
        records_in,
    )

    if name == "larger_numbers":
        return larger_numbers(split)
    folder = _saved_folder(path) if path else None
    if folder and any(storage.exists(storage.join(folder, f)) for f in SAVED_MARKERS):
        records = []
        for row, record in enumerate(_saved_split(folder, path, split)):
            try:
                records.append(parse_prompt(_without_nulls(record)))
            except ConfigError as e:
                raise ConfigError(f"{path} ({split} split), row {row}: {e}") from None
    else:
        _only_train("prompts", split)
        files = _local_files(path, JSON_SUFFIXES, "prompts")
        records = [r for file in files for r in records_in(file, parse_prompt)]
    if not records:
        raise ConfigError(f"[training] dataset_path: {path}: no prompts")
    return records
