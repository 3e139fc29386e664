"""Documents -> tokens -> training rows, sharded per host and resumable exactly.

The source library provides the three hard parts: host sharding (`split_dataset_by_node`: by shard
when the shard count divides the host count, otherwise every host keeps one document in
`host_count`), worker sharding (by shard, inside each DataLoader worker) and the resumable position
in the stream (`IterableDataset.state_dict()`). `DocumentStream` adds what it cannot: epochs, and
a shuffle buffer whose contents and random state are part of the state. On top of it,
`PackedTextDataset` cuts pre-training text into packed windows and `ChatDataset` turns
conversations into padded or packed rows with label masks (chat.py); each adds what it holds
between rows to the state, so a restored run continues bit for bit.
"""

from __future__ import annotations

import hashlib
import json
import random
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch
from torch.utils.data import IterableDataset, get_worker_info

from torchtitan_xla.datasets import chat
from torchtitan_xla.datasets.tokenizer import Tokenizer
from torchtitan_xla.errors import ConfigError
from torchtitan_xla.logging import logger
from torchtitan_xla.losses import IGNORE_INDEX

if TYPE_CHECKING:
    import datasets


class DocumentStream(IterableDataset):
    """This host's share of `documents` (strings in the `column` column), epoch after epoch,
    optionally shuffled. Subclasses turn them into rows in `__iter__` and keep what they hold
    between rows in `_extra_state()` / `_load_extra_state()`.

    Each reader (a host, or a DataLoader worker of a host) is one node of `split_dataset_by_node`
    over hosts x workers: whole shards when their count divides evenly, otherwise one document in
    every hosts x workers. The stream is read with `IterableDataset.iter`, not `iter()`: inside a
    worker the latter re-shards by worker on its own, and in datasets 5.2 a state restored there
    lands on the wrong shards.

    With `shuffle_buffer` > 0 documents pass through a buffer of that many and leave it in a
    seeded random order (the buffer's contents and random state are saved with the state)."""

    column = "text"

    def __init__(self, documents: datasets.IterableDataset, *, host_rank: int = 0,
                 host_count: int = 1, shuffle_buffer: int = 0, seed: int = 0,
                 infinite: bool = True, name: str = ""):
        self.name = name
        self._source = documents
        self._host_rank, self._host_count = host_rank, host_count
        self._infinite = infinite
        self._shuffle_size = shuffle_buffer
        self._seed = seed
        # The state: position in the source (held by `_documents` once iterating), epoch, and
        # the shuffle buffer with its random state.
        self._documents: datasets.IterableDataset | None = None
        self._source_state: dict | None = None  # loaded, not yet iterated from
        self._epoch = 0
        self._shuffle: list[str] = []
        self._rng: random.Random | None = None
        self._where = f"host {host_rank} of {host_count}"

    # -- the stream ------------------------------------------------------------------------

    def _stream(self) -> Iterator[str]:
        """This reader's documents in training order."""
        texts = self._texts()
        return self._shuffled(texts) if self._shuffle_size else texts

    def _reader(self) -> tuple[int, int]:
        """This reader's rank and the number of readers over all hosts and workers."""
        worker = get_worker_info()
        wid, workers = (worker.id, worker.num_workers) if worker else (0, 1)
        if worker:
            self._where = f"host {self._host_rank} of {self._host_count}, worker {wid} of {workers}"
        return self._host_rank * workers + wid, self._host_count * workers

    def _texts(self) -> Iterator[str]:
        """This reader's documents, epoch after epoch."""
        from datasets.distributed import split_dataset_by_node

        rank, world = self._reader()
        self._documents = (split_dataset_by_node(self._source, rank, world) if world > 1
                           else self._source)
        if self._rng is None:
            self._rng = random.Random(f"{self._seed}/{rank}/{world}")
        while True:
            resumed = self._source_state is not None
            self._documents.set_epoch(self._epoch)  # HF restores a position for its epoch only
            if resumed:
                self._documents.load_state_dict(self._source_state)
                self._source_state = None
            count = 0
            for batch in self._documents.iter(batch_size=1):
                count += 1
                if self.column not in batch:
                    raise ConfigError(f"dataset {self.name}: documents have no '{self.column}' "
                                      f"field (fields: {', '.join(batch)})")
                yield batch[self.column][0]
            if count == 0 and not resumed:
                raise ConfigError(f"dataset {self.name}: no documents for {self._where} (the "
                                  f"dataset is empty, or has fewer documents than readers)")
            if not self._infinite:
                return
            self._epoch += 1
            logger.warning(f"dataset {self.name} ({self._where}): end of data, re-looping from the "
                           f"start (epoch {self._epoch})")

    def check_documents(self, workers: int, where: str) -> None:
        """Every reader of this host (one per worker) has a first document with the column, read
        now: an empty file is then found before the run writes anything, not at its first batch.
        The stream itself is untouched (each check reads a split of its own)."""
        from datasets.distributed import split_dataset_by_node

        workers = max(workers, 1)
        for worker in range(workers):
            readers = self._host_count * workers
            reader = f"host {self._host_rank} of {self._host_count}" + (
                f", worker {worker} of {workers}" if workers > 1 else "")
            split = split_dataset_by_node(self._source, self._host_rank * workers + worker, readers)
            first = next(iter(split.iter(batch_size=1)), None)
            if first is None:
                empty = readers == 1 or next(iter(self._source.iter(batch_size=1)), None) is None
                why = "is empty" if empty else f"has fewer documents than its {readers} readers"
                raise ConfigError(f"{where}: no documents for {reader} (the dataset {why})")
            if self.column not in first:
                raise ConfigError(f"{where}: documents have no '{self.column}' field (fields: "
                                  f"{', '.join(first)})")

    def _shuffled(self, texts: Iterator[str]) -> Iterator[str]:
        for text in texts:
            if len(self._shuffle) < self._shuffle_size:
                self._shuffle.append(text)
                continue
            i = self._rng.randrange(len(self._shuffle))
            out, self._shuffle[i] = self._shuffle[i], text
            yield out
        while self._shuffle:  # finite stream: drain the buffer in random order
            i = self._rng.randrange(len(self._shuffle))
            self._shuffle[i], self._shuffle[-1] = self._shuffle[-1], self._shuffle[i]
            yield self._shuffle.pop()

    # -- checkpointing ---------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        iterating = self._documents is not None and self._source_state is None
        source = self._documents.state_dict() if iterating else self._source_state
        return {"epoch": self._epoch, "source": source, **self._extra_state(),
                "shuffle_buffer": list(self._shuffle),
                "rng": self._rng.getstate() if self._rng is not None else None}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._epoch = state["epoch"]
        self._source_state = state["source"]
        self._load_extra_state(state)
        self._shuffle = list(state["shuffle_buffer"])
        if state["rng"] is not None:
            self._rng = random.Random()
            self._rng.setstate(state["rng"])

    def _extra_state(self) -> dict[str, Any]:
        return {}

    def _load_extra_state(self, state: dict[str, Any]) -> None:
        pass


class PackedTextDataset(DocumentStream):
    """This host's share of `documents`, tokenized (BOS + text + EOS) and cut into windows of
    seq_len + 1 tokens: inputs are window[:-1], labels window[1:]. No padding, no token lost."""

    def __init__(self, documents: datasets.IterableDataset, tokenizer: Tokenizer, seq_len: int,
                 **stream):
        super().__init__(documents, **stream)
        self._tokenizer = tokenizer
        self._window = seq_len + 1
        self._tokens: list[int] = []  # read but not yet emitted

    def __iter__(self):
        window = self._window
        for text in self._stream():
            self._tokens.extend(self._tokenizer.encode(text, bos=True, eos=True))
            while len(self._tokens) >= window:
                w = torch.tensor(self._tokens[:window], dtype=torch.long)
                del self._tokens[:window]
                yield w[:-1], w[1:]

    def _extra_state(self) -> dict[str, Any]:
        return {"token_buffer": list(self._tokens)}

    def _load_extra_state(self, state: dict[str, Any]) -> None:
        self._tokens = list(state["token_buffer"])


class ChatDataset(DocumentStream):
    """This host's share of `conversations` (each a JSON list of messages, see chat.py), rendered
    in the tokenizer's chat format and yielded as rows of four int64 [seq_len] tensors: (inputs,
    labels, positions, document_ids). Labels are -100 except on the assistant's tokens.

    A record gives one document or more (`_render`: a preference pair gives two), kept together:
    packing: records fill each row greedily in stream order, at most `_max_documents` documents to
    a row; one that does not fit starts the next row, the current one is padded. Otherwise every
    document has a row of its own."""

    column = "messages"
    records = "conversations"  # what the records are, in messages

    def __init__(self, conversations: datasets.IterableDataset, tokenizer: Tokenizer, seq_len: int,
                 *, packing: bool = True, **stream):
        super().__init__(conversations, **stream)
        chat.chat_format(tokenizer)  # an unsupported tokenizer fails now, not in a worker
        self._tokenizer = tokenizer
        self._seq_len = seq_len
        self._packing = packing
        self._max_documents = seq_len
        self._pad_id = chat.pad_id(tokenizer)
        self._warned = False
        # Documents (inputs, labels, ...) not yet emitted: of the row being filled; unpacked, the
        # rest of a record whose first rows are out.
        self._row: list[tuple] = []
        self._pending: list[tuple] = []

    def __iter__(self):
        while self._pending:  # resumed between the rows of one record
            self._row = [self._pending.pop(0)]
            yield self._emit()
        for text in self._stream():
            documents = self._render(text)
            if not self._packing:
                for k, document in enumerate(documents):
                    self._row, self._pending = [document], documents[k + 1:]
                    yield self._emit()  # the state at the yield holds the record's later rows
                continue
            if self._filled() + sum(len(d[0]) for d in documents) > self._seq_len:  # the next row's
                yield self._emit(next_row=documents)
            else:
                self._row += documents
            if self._filled() == self._seq_len or len(self._row) == self._max_documents:
                yield self._emit()
        if self._row:  # a finite stream's last, partly filled row
            yield self._emit()

    def _filled(self) -> int:
        return sum(len(document[0]) for document in self._row)

    def _render(self, text: str) -> list[tuple[list[int], list[int]]]:
        """One conversation's [(inputs, labels)]: the ids shifted by one, labels masked where the
        next token is not trained, truncated to seq_len."""
        ids, trained = chat.render(json.loads(text), self._tokenizer)
        inputs = ids[:-1]
        labels = [t if keep else IGNORE_INDEX for t, keep in zip(ids[1:], trained[1:])]
        if len(inputs) > self._seq_len:
            if not self._warned:
                self._warned = True
                logger.warning(
                    f"dataset {self.name} ({self._where}): a conversation of {len(inputs):,} "
                    f"tokens is longer than seq_len {self._seq_len:,}; its last "
                    f"{len(inputs) - self._seq_len:,} tokens are dropped (logged once: longer "
                    f"conversations are all truncated to seq_len)")
            inputs, labels = inputs[:self._seq_len], labels[:self._seq_len]
        return [(inputs, labels)]

    def _emit(self, next_row=()) -> tuple[torch.Tensor, ...]:
        """The pending documents as one row, padded, and `next_row` pending instead (set before
        the row is yielded, so that the state at the yield is the state after it). Positions
        restart at each document; padding is document 0 at position 0."""
        inputs, labels, positions, documents = [], [], [], []
        for doc, (x, y, *_) in enumerate(self._row, 1):
            inputs += x
            labels += y
            positions += range(len(x))
            documents += [doc] * len(x)
        self._row = list(next_row)
        pad = self._seq_len - len(inputs)
        columns = (inputs + [self._pad_id] * pad, labels + [IGNORE_INDEX] * pad,
                   positions + [0] * pad, documents + [0] * pad)
        return tuple(torch.tensor(c, dtype=torch.long) for c in columns)

    def _extra_state(self) -> dict[str, Any]:
        return {"row": _saved(self._row), "pending": _saved(self._pending)}

    def _load_extra_state(self, state: dict[str, Any]) -> None:
        self._row, self._pending = _restored(state.get("row", [])), _restored(state.get("pending", []))
        if self._pending if self._packing else self._row:
            raise ConfigError(f"dataset {self.name}: the checkpoint holds {self.records} read with "
                              f"[training] packing = {str(not self._packing).lower()}; resume with the "
                              f"same setting")


def _saved(documents: list[tuple]) -> list[list]:
    return [[list(d[0]), list(d[1]), *d[2:]] for d in documents]


def _restored(documents: list[list]) -> list[tuple]:
    return [(list(d[0]), list(d[1]), *d[2:]) for d in documents]


class SyntheticDataset(IterableDataset):
    """Uniform random tokens for benchmarks and parity tests: no I/O, no tokenizer work. Each row
    of the global batch is a pure function of (seed, split, its global position), and host r of
    H loads rows [r, r + 1) x `batch_size` of each step: the global batch is the same whatever the
    number of hosts, processes or loader workers. The state is one counter."""

    def __init__(self, vocab_size: int, seq_len: int, *, batch_size: int = 1, host_rank: int = 0,
                 host_count: int = 1, seed: int = 0, split: str = "train"):
        self._vocab_size, self._window = vocab_size, seq_len + 1
        self._batch, self._host_rank, self._host_count = batch_size, host_rank, host_count
        self._prefix = f"{split}/{seed}/"
        self._index = 0  # windows this worker has produced

    def __iter__(self):
        worker = get_worker_info()
        wid, workers = (worker.id, worker.num_workers) if worker else (0, 1)
        g = torch.Generator()
        while True:
            batch, row = divmod(self._index, self._batch)
            step = batch * workers + wid  # the loader's workers take turns, one batch each
            position = (step * self._host_count + self._host_rank) * self._batch + row
            digest = hashlib.blake2b((self._prefix + str(position)).encode(), digest_size=8).digest()
            g.manual_seed(int.from_bytes(digest, "little") >> 1)
            w = torch.randint(self._vocab_size, (self._window,), generator=g)
            self._index += 1
            yield w[:-1], w[1:]

    def state_dict(self) -> dict[str, Any]:
        return {"index": self._index}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._index = state["index"]

    def seek(self, batches: int) -> None:
        """Continue after `batches` global batches (one worker): on any number of hosts."""
        self._index = batches * self._batch
