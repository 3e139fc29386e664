"""Documents -> tokens -> packed [seq_len + 1] windows, sharded per host and resumable exactly.

The source library provides the three hard parts: host sharding (`split_dataset_by_node`: by shard
when the shard count divides the host count, otherwise every host keeps one document in
`host_count`), worker sharding (by shard, inside each DataLoader worker) and the resumable position
in the stream (`IterableDataset.state_dict()`). `PackedTextDataset` adds what it cannot: the token
buffer, epochs, and a shuffle buffer whose contents and random state are part of the state, so a
restored run continues bit for bit.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch
from torch.utils.data import IterableDataset, get_worker_info

from torchtitan_xla.datasets.tokenizer import Tokenizer
from torchtitan_xla.errors import ConfigError
from torchtitan_xla.logging import logger

if TYPE_CHECKING:
    import datasets


class PackedTextDataset(IterableDataset):
    """This host's share of `documents`, tokenized (BOS + text + EOS) and cut into windows of
    seq_len + 1 tokens: inputs are window[:-1], labels window[1:]. No padding, no token lost.

    Each reader (a host, or a DataLoader worker of a host) is one node of `split_dataset_by_node`
    over hosts x workers: whole shards when their count divides evenly, otherwise one document in
    every hosts x workers. The stream is read with `IterableDataset.iter`, not `iter()`: inside a
    worker the latter re-shards by worker on its own, and in datasets 5.2 a state restored there
    lands on the wrong shards.

    With `shuffle_buffer` > 0 documents pass through a buffer of that many and leave it in a
    seeded random order (the buffer's contents and random state are saved with the state)."""

    def __init__(self, documents: datasets.IterableDataset, tokenizer: Tokenizer, seq_len: int, *,
                 host_rank: int = 0, host_count: int = 1, shuffle_buffer: int = 0, seed: int = 0,
                 infinite: bool = True, name: str = ""):
        self.name = name
        self._source = documents
        self._host_rank, self._host_count = host_rank, host_count
        self._tokenizer = tokenizer
        self._window = seq_len + 1
        self._infinite = infinite
        self._shuffle_size = shuffle_buffer
        self._seed = seed
        # The state: position in the source (held by `_documents` once iterating), epoch, tokens
        # read but not yet emitted, and the shuffle buffer with its random state.
        self._documents: datasets.IterableDataset | None = None
        self._source_state: dict | None = None  # loaded, not yet iterated from
        self._epoch = 0
        self._tokens: list[int] = []
        self._shuffle: list[str] = []
        self._rng: random.Random | None = None
        self._where = f"host {host_rank} of {host_count}"

    # -- the stream ------------------------------------------------------------------------

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
                if "text" not in batch:
                    raise ConfigError(f"dataset {self.name}: documents have no 'text' field "
                                      f"(fields: {', '.join(batch)})")
                yield batch["text"][0]
            if count == 0 and not resumed:
                raise ConfigError(f"dataset {self.name}: no documents for {self._where} (the "
                                  f"dataset is empty, or has fewer documents than readers)")
            if not self._infinite:
                return
            self._epoch += 1
            logger.warning(f"dataset {self.name} ({self._where}): end of data, re-looping from the "
                           f"start (epoch {self._epoch})")

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

    def __iter__(self):
        texts = self._texts()
        if self._shuffle_size:
            texts = self._shuffled(texts)
        window = self._window
        for text in texts:
            self._tokens.extend(self._tokenizer.encode(text, bos=True, eos=True))
            while len(self._tokens) >= window:
                w = torch.tensor(self._tokens[:window], dtype=torch.long)
                del self._tokens[:window]
                yield w[:-1], w[1:]

    # -- checkpointing ---------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        iterating = self._documents is not None and self._source_state is None
        source = self._documents.state_dict() if iterating else self._source_state
        return {"epoch": self._epoch, "source": source, "token_buffer": list(self._tokens),
                "shuffle_buffer": list(self._shuffle),
                "rng": self._rng.getstate() if self._rng is not None else None}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._epoch = state["epoch"]
        self._source_state = state["source"]
        self._tokens = list(state["token_buffer"])
        self._shuffle = list(state["shuffle_buffer"])
        if state["rng"] is not None:
            self._rng = random.Random()
            self._rng.setstate(state["rng"])


class SyntheticDataset(IterableDataset):
    """Uniform random tokens for benchmarks: no I/O, no tokenizer work. Window i of a host and
    worker is a pure function of (seed, host, worker, i), so the state is one counter."""

    def __init__(self, vocab_size: int, seq_len: int, *, host_rank: int = 0, seed: int = 0,
                 split: str = "train"):
        self._vocab_size, self._window = vocab_size, seq_len + 1
        self._seed = f"{split}/{seed}/{host_rank}"
        self._index = 0

    def __iter__(self):
        worker = get_worker_info()
        prefix = f"{self._seed}/{worker.id if worker else 0}/"
        g = torch.Generator()
        while True:
            digest = hashlib.blake2b((prefix + str(self._index)).encode(), digest_size=8).digest()
            g.manual_seed(int.from_bytes(digest, "little") >> 1)
            w = torch.randint(self._vocab_size, (self._window,), generator=g)
            self._index += 1
            yield w[:-1], w[1:]

    def state_dict(self) -> dict[str, Any]:
        return {"index": self._index}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._index = state["index"]
