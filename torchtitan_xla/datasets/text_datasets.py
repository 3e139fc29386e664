"""Documents -> tokens -> packed [seq_len + 1] windows, resumable exactly.

A host reads every `host_count`-th document starting at `host_rank`, so hosts are disjoint and
together cover each document exactly once per epoch. The state is the position in the host's
document list, the epoch, and the tokens already read but not yet emitted.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import IterableDataset

from torchtitan_xla.config_manager import ConfigError
from torchtitan_xla.datasets.tokenizer import Tokenizer
from torchtitan_xla.logging import logger


class _TextColumn(Sequence):
    """A column of a (memory-mapped) HF dataset as a sequence of strings, read row by row."""

    def __init__(self, dataset, column: str):
        self._dataset, self._column = dataset, column

    def __len__(self) -> int:
        return len(self._dataset)

    def __getitem__(self, i):
        return self._dataset[i][self._column]


def _load_json(path: str) -> Sequence[str]:
    """C4-format JSON lines (`{"text": ...}` per line; .json, .jsonl, optionally .gz), a file or
    a folder of them, through HF datasets (memory-mapped Arrow, so size is not limited by RAM)."""
    if not path:
        raise ConfigError("[training] dataset_path: the 'json' dataset needs a file or folder")
    p = Path(path)
    if not p.exists():
        raise ConfigError(f"[training] dataset_path: not found: {path}")
    files = sorted(str(f) for f in p.rglob("*.json*")) if p.is_dir() else [str(p)]
    if not files:
        raise ConfigError(f"[training] dataset_path: no .json / .jsonl files in {path}")
    import datasets

    ds = datasets.load_dataset("json", data_files=files, split="train")
    if "text" not in ds.column_names:
        raise ConfigError(f"[training] dataset_path: {path} has no 'text' field "
                          f"(fields: {', '.join(ds.column_names)})")
    return _TextColumn(ds, "text")


def load_documents(name: str, path: str) -> Sequence[str]:
    """The dataset registry: name (and optional local path) -> the documents' texts."""
    if name == "python_docs":
        from torchtitan_xla.datasets import python_docs

        return python_docs.documents()
    if name == "json":
        return _load_json(path)
    raise ConfigError(f"[training] dataset: unknown dataset {name!r}; expected one of: python_docs, json")


class PackedTextDataset(IterableDataset):
    def __init__(self, documents: Sequence[str], tokenizer: Tokenizer, seq_len: int, *,
                 host_rank: int = 0, host_count: int = 1, infinite: bool = True, name: str = ""):
        if len(documents) < host_count:
            raise ConfigError(f"[training] dataset: {name} has {len(documents)} documents, fewer "
                              f"than the {host_count} hosts reading it")
        self.name = name
        self._documents = documents
        self._indices = range(host_rank, len(documents), host_count)
        self._tokenizer = tokenizer
        self._window = seq_len + 1  # inputs are window[:-1], labels window[1:]
        self._infinite = infinite
        self._epoch = 0
        self._position = 0
        self._buffer: list[int] = []

    def __iter__(self):
        while True:
            while self._position < len(self._indices):
                text = self._documents[self._indices[self._position]]
                self._position += 1
                self._buffer.extend(self._tokenizer.encode(text, bos=True, eos=True))
                while len(self._buffer) >= self._window:
                    window = torch.tensor(self._buffer[:self._window], dtype=torch.long)
                    del self._buffer[:self._window]
                    yield window[:-1], window[1:]
            if not self._infinite:
                return
            self._epoch += 1
            self._position = 0
            logger.info(f"dataset {self.name}: end of data, starting epoch {self._epoch}")

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self._epoch, "position": self._position, "token_buffer": list(self._buffer)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._epoch = state["epoch"]
        self._position = state["position"]
        self._buffer = list(state["token_buffer"])
