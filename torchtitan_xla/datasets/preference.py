"""Preference pairs for the preference objectives (`[training] objective = "dpo"`, ...): records,
sources and the training rows.

Records (`[training] dataset = "preference"`: JSON lines at dataset_path, a file, folder or glob,
local or a URL; `"python_docs_preference"`: embedded, offline), TRL's two explicit-prompt forms:

    {"prompt": "...", "chosen": "...", "rejected": "..."}                     (plain text)
    {"prompt": [{"role": "user", "content": "..."}, ...],                    (conversational)
     "chosen": [{"role": "assistant", "content": "..."}],
     "rejected": [{"role": "assistant", "content": "..."}]}

A plain prompt is one user turn (optionally with "system"); a conversational prompt is chat.py's
conversation ending with the user's turn. Both answers are rendered after the prompt in the
tokenizer's chat format (chat.py), so the chosen and the rejected sequence share the prompt's ids.
A record may also carry the reference model's summed log-probabilities of its two answers,
"ref_chosen_logps" and "ref_rejected_logps" (TRL's columns), which `[preference]
precomputed_reference = true` reads instead of running a reference model.

Rows (PreferenceDataset), in chat.py's four columns (inputs, labels, positions, document_ids):
labels are -100 except on the final answer's tokens (its content and end-of-turn token), so the
summed log-probability of a sequence is that of its completion given the prompt. Each pair gives
two sequences, the chosen one then the rejected one:
- unpacked (`[training] packing = false`): one row each, padded: a batch's rows 2i and 2i + 1 are
  pair i. A completion that does not fit seq_len is cut at its end (a warning, once).
- packed: pairs fill each row greedily as consecutive documents (1 and 2 the first pair's
  chosen and rejected, 3 and 4 the next's, ...); a pair never spans rows, and a row holds at most
  `document_slots(seq_len)` documents. A pair longer than seq_len has its completions cut so that
  it fits: the longer one first, neither below half the row unless the other is shorter.
A prompt that leaves no room for any completion token stops the run, naming the record. With the
stored reference log-probabilities, a fifth float32 column [slots] holds each document's in its
slot (document d in slot d - 1; one slot when unpacked), 0 where a row has no document.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch

from torchtitan_xla.datasets import chat
from torchtitan_xla.datasets.packing import ChatDataset
from torchtitan_xla.errors import ConfigError
from torchtitan_xla.logging import logger
from torchtitan_xla.losses import IGNORE_INDEX

if TYPE_CHECKING:
    import datasets

    from torchtitan_xla.datasets.tokenizer import Tokenizer

# (prompt messages ending with the user's, chosen, rejected, the reference's log-probabilities of
# chosen and rejected where the record carries them)
Pair = tuple[list[chat.Message], str, str, tuple[float, float] | None]
REFERENCE_KEYS = ("ref_chosen_logps", "ref_rejected_logps")  # TRL's columns


def parse_pair(record: object) -> Pair:
    """A JSON record (decoded) -> (prompt messages, chosen, rejected, the stored reference
    log-probabilities or None); a ConfigError says what is wrong (the reader adds the file and
    line)."""
    if not isinstance(record, dict):
        raise ConfigError(f"not a preference pair: expected an object, found {type(record).__name__}")
    missing = [k for k in ("prompt", "chosen", "rejected") if k not in record]
    if missing:
        raise ConfigError(f"not a preference pair: no {' or '.join(repr(k) for k in missing)} "
                          f"(expected 'prompt', 'chosen' and 'rejected'; found: "
                          f"{', '.join(record) or 'an empty object'})")
    prompt = record["prompt"]
    if isinstance(prompt, str):
        conversation: object = {"prompt": prompt, "completion": ""}
        if "system" in record:
            conversation["system"] = record["system"]
        messages = chat.parse_conversation(conversation)[:-1]
    elif isinstance(prompt, list):
        messages = chat.parse_conversation({"messages": prompt}, final="user")
    else:
        raise ConfigError(f"'prompt' is a {type(prompt).__name__}, expected a string or a list of messages")
    return messages, _answer(record, "chosen"), _answer(record, "rejected"), _reference(record)


def _answer(record: dict, key: str) -> str:
    value = record[key]
    if isinstance(value, str):
        return value
    if (isinstance(value, list) and len(value) == 1 and isinstance(value[0], dict)
            and value[0].get("role") == "assistant" and isinstance(value[0].get("content"), str)):
        return value[0]["content"]
    raise ConfigError(f"{key!r}: expected a string or a list of one assistant message")


def _reference(record: dict) -> tuple[float, float] | None:
    given = [k for k in REFERENCE_KEYS if k in record]
    if not given:
        return None
    if len(given) == 1:
        raise ConfigError(f"{given[0]!r} without {(set(REFERENCE_KEYS) - set(given)).pop()!r}")
    for key in REFERENCE_KEYS:
        value = record[key]
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise ConfigError(f"{key!r}: expected a finite number (a summed log-probability), "
                              f"found {value!r}")
    return float(record[REFERENCE_KEYS[0]]), float(record[REFERENCE_KEYS[1]])


def embedded_pairs(topics: list[list[list[chat.Message]]]) -> list[Pair]:
    """The embedded set's pairs: each conversation's last answer is chosen over the answer at the
    same place in the next topic, left unfinished: about something else and cut mid-sentence, so the
    preference is clear, and a small model can learn one half of it (an answer ends a sentence)
    on the topics held out too."""
    pairs = []
    for t, topic in enumerate(topics):
        other = topics[(t + 1) % len(topics)]
        for k, messages in enumerate(topic):
            pairs.append((messages[:-1], messages[-1]["content"],
                          _unfinished(other[k % len(other)][-1]["content"]), None))
    return pairs


def _unfinished(answer: str) -> str:
    """The answer cut after about half its words, never after one that ends a sentence or
    announces what follows, and always short of its end (a one-word answer: by characters)."""
    ends = (".", ":", "?", "!")
    words = list(re.finditer(r"\S+", answer))
    cut = max(len(words) // 2, 1)
    while cut > 1 and words[cut - 1].group().endswith(ends):
        cut -= 1
    text = answer[:words[cut - 1].end()] if words else answer
    if text == answer or text.endswith(ends):
        text = answer[:len(answer) // 2].rstrip().rstrip("".join(ends))
    return text


def encode_pairs(pairs) -> Iterator[dict[str, str]]:
    for pair in pairs:
        yield {"pair": json.dumps(list(pair))}


def completion_row(prompt: list[chat.Message], answer: str,
                   tokenizer: Tokenizer) -> tuple[list[int], list[int], int]:
    """(inputs, labels, prompt length in tokens) of the prompt answered by `answer`, uncut; labels
    are -100 except on the final answer's tokens."""
    ids, trained = chat.render([*prompt, {"role": "assistant", "content": answer}], tokenizer)
    # Only the final answer: earlier assistant turns of a conversational prompt are context.
    start = len(trained) - 1
    while start > 0 and not trained[start]:
        start -= 1
    while start > 0 and trained[start - 1]:
        start -= 1
    labels = [t if keep and i >= start else IGNORE_INDEX
              for i, (t, keep) in enumerate(zip(ids[1:], trained[1:]), 1)]
    return ids[:-1], labels, start


def document_slots(seq_len: int, packing: bool) -> int:
    """The most documents a row of pairs holds, the static size of the per-document sums
    (objectives.py): 1 unpacked; packed, two per 16 tokens of the row (a pair of chat sequences is
    longer than that), at least one pair."""
    return 2 * max(1, seq_len // 16) if packing else 1


class PreferenceDataset(ChatDataset):
    """This host's share of the pairs (the "pair" column: JSON [prompt, chosen, rejected,
    reference]) as rows, unpacked or packed (module docstring): each pair is a record of two
    documents for ChatDataset's rows. With `reference`, each row also carries its documents' stored
    reference log-probabilities (a float32 [slots] column, the batch's `reference_logps`), and a
    pair without them stops the run."""

    column = "pair"
    records = "pairs"

    def __init__(self, pairs: datasets.IterableDataset, tokenizer: Tokenizer, seq_len: int, *,
                 packing: bool = False, reference: bool = False, **stream):
        super().__init__(pairs, tokenizer, seq_len, packing=packing, **stream)
        self._reference = reference
        self._slots = self._max_documents = document_slots(seq_len, packing)

    def _render(self, text: str) -> list[tuple]:
        """(inputs, labels[, reference log-probability]) of the chosen and the rejected sequence."""
        prompt, chosen, rejected, reference = json.loads(text)
        whole = [completion_row(prompt, answer, self._tokenizer) for answer in (chosen, rejected)]
        limits = self._limits(len(whole[0][0]), len(whole[1][0]))
        rows = [self._fit(*row, limit) for row, limit in zip(whole, limits)]
        if not self._reference:
            return rows
        if reference is None:
            raise ConfigError(f"dataset {self.name}: no {' or '.join(map(repr, REFERENCE_KEYS))}, which "
                              f"[preference] precomputed_reference = true reads in every pair")
        return [(*rows[0], reference[0]), (*rows[1], reference[1])]

    def _limits(self, chosen: int, rejected: int) -> tuple[int, int]:
        """The most tokens kept of each sequence: seq_len unpacked; packed, what lets the pair fit
        one row, cut from the longer first."""
        n = self._seq_len
        if not self._packing or chosen + rejected <= n:
            return n, n
        kept = min(chosen, max(n // 2, n - rejected))
        return kept, n - kept

    def _emit(self, next_row=()) -> tuple[torch.Tensor, ...]:
        references = [document[2] for document in self._row] if self._reference else None
        columns = super()._emit(next_row)
        if references is None:
            return columns
        slots = torch.zeros(self._slots, dtype=torch.float32)
        slots[:len(references)] = torch.tensor(references, dtype=torch.float32)
        return (*columns, slots)

    def _fit(self, inputs: list[int], labels: list[int], prompt_len: int,
             limit: int) -> tuple[list[int], list[int]]:
        n = self._seq_len
        if prompt_len > limit:
            room = (f"[training] seq_len {n:,}" if limit == n else f"the {limit:,} tokens its pair "
                    f"leaves it in a packed row of [training] seq_len {n:,}")
            raise ConfigError(f"dataset {self.name}: a prompt of {prompt_len:,} tokens leaves no "
                              f"room for its answer in {room}")
        if len(inputs) > limit and not self._warned:
            self._warned = True
            what = (f"an answer ends past seq_len {n:,} and is cut there" if not self._packing else
                    f"a pair is longer than seq_len {n:,}: its answers are cut so that it fits a packed row")
            logger.warning(f"dataset {self.name} ({self._where}): {what} (logged once)")
        return inputs[:limit], labels[:limit]

    def check_documents(self, workers: int, where: str) -> None:
        """ChatDataset's check, then every pair of a local or embedded source rendered now, so a
        prompt too long for seq_len stops the run before it starts."""
        super().check_documents(workers, where)
        for batch in self._source.iter(batch_size=1):
            try:
                self._render(batch[self.column][0])
            except ConfigError as e:
                prompt = json.loads(batch[self.column][0])[0][-1]["content"]
                raise ConfigError(f"{where}: the pair whose prompt ends {prompt[-40:]!r}: "
                                  f"{str(e).partition(': ')[2]}") from None

    def _load_extra_state(self, state: dict[str, Any]) -> None:
        super()._load_extra_state(state)
        if any((len(d) > 2) != self._reference for d in self._row + self._pending):
            raise ConfigError(f"dataset {self.name}: the checkpoint holds pairs read with "
                              f"[preference] precomputed_reference = {str(not self._reference).lower()}; "
                              f"resume with the same setting")
