"""Documents -> tokens -> packed [seq_len + 1] windows, sharded per host and resumable exactly.

Every text source in the registry is a HuggingFace `datasets.IterableDataset` of `{"text": str}`
rows, streamed (a corpus is never loaded whole). The source library provides the three hard parts:
host sharding (`split_dataset_by_node`: by shard when the shard count divides the host count,
otherwise every host keeps one document in `host_count`), worker sharding (by shard, inside each
DataLoader worker) and the resumable position in the stream (`IterableDataset.state_dict()`).
`PackedTextDataset` adds what it cannot: the token buffer, epochs, and a shuffle buffer whose
contents and random state are part of the state, so a restored run continues bit for bit.
"""

from __future__ import annotations

import glob
import gzip
import hashlib
import json
import os
import random
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch.utils.data import IterableDataset, get_worker_info

from torchtitan_xla.config_manager import ConfigError
from torchtitan_xla.datasets.tokenizer import Tokenizer
from torchtitan_xla.logging import logger

if TYPE_CHECKING:
    import datasets

C4_HUB_ID = "allenai/c4"
DATASET_NAMES = ("python_docs", "c4", "json", "parquet", "text", "hf", "synthetic")


# --------------------------------------------------------------------------------------------
# Readers (generators over a list of files: each file is one shard of the stream)
# --------------------------------------------------------------------------------------------


def _open_text(file: str):
    opener = gzip.open if file.endswith(".gz") else open
    return opener(file, "rt", encoding="utf-8")


def _read_json_lines(files: list[str]) -> Iterator[dict[str, str]]:
    """C4's format: one JSON object with a "text" string per line. A bad line stops the run with
    its file and line number (a corrupt or truncated download should not train silently)."""
    for file in files:
        lineno = 0
        try:
            with _open_text(file) as fh:
                for lineno, line in enumerate(fh, 1):  # noqa: B007 (lineno is used after the loop)
                    if not line.strip():
                        continue
                    try:
                        record = json.loads(line)
                    except json.JSONDecodeError as e:
                        raise ConfigError(f"{file}:{lineno}: not a JSON object ({e.msg})") from None
                    text = record.get("text") if isinstance(record, dict) else None
                    if not isinstance(text, str):
                        found = (", ".join(record) if isinstance(record, dict)
                                 else type(record).__name__)
                        raise ConfigError(
                            f"{file}:{lineno}: no 'text' string field (found: {found})")
                    yield {"text": text}
        except (OSError, EOFError, UnicodeDecodeError) as e:
            raise ConfigError(f"{file}: unreadable after line {lineno} ({e})") from None


def _read_paragraphs(files: list[str]) -> Iterator[dict[str, str]]:
    """Plain text: a document is a run of lines between blank lines."""
    for file in files:
        lineno = 0
        try:
            with _open_text(file) as fh:
                lines: list[str] = []
                for lineno, line in enumerate(fh, 1):  # noqa: B007
                    if line.strip():
                        lines.append(line)
                    elif lines:
                        yield {"text": "".join(lines).rstrip("\n")}
                        lines = []
                if lines:
                    yield {"text": "".join(lines).rstrip("\n")}
        except (OSError, EOFError, UnicodeDecodeError) as e:
            raise ConfigError(f"{file}: unreadable after line {lineno} ({e})") from None


def _yield_texts(texts: list[str]) -> Iterator[dict[str, str]]:
    for text in texts:
        yield {"text": text}


# --------------------------------------------------------------------------------------------
# The registry: (name, path, split) -> a streamed datasets.IterableDataset with a "text" column
# --------------------------------------------------------------------------------------------


def _from_generator(fn, **shards: list) -> datasets.IterableDataset:
    """A stream over `fn(list)`; HF treats each list element as one shard."""
    import datasets

    features = datasets.Features({"text": datasets.Value("string")})
    return datasets.IterableDataset.from_generator(fn, features=features, gen_kwargs=shards)


def _local_files(path: str, suffixes: tuple[str, ...], kind: str) -> list[str]:
    """A file, a folder (searched recursively) or a glob pattern -> sorted file list."""
    if not path:
        raise ConfigError(
            f"[training] dataset_path: the '{kind}' dataset needs a file, folder or glob")
    p = Path(path).expanduser()
    if any(ch in path for ch in "*?["):
        files = sorted(f for f in glob.glob(str(p), recursive=True) if os.path.isfile(f))
    elif p.is_dir():
        files = sorted(str(f) for f in p.rglob("*") if f.is_file() and f.name.endswith(suffixes))
    elif p.is_file():
        files = [str(p)]
    else:
        raise ConfigError(f"[training] dataset_path: not found: {path}")
    if not files:
        raise ConfigError(f"[training] dataset_path: no {' / '.join(suffixes)} files in {path}")
    return files


def _only_train(name: str, split: str) -> None:
    if split != "train":
        raise ConfigError(
            f"[training] dataset_split: '{name}' reads exactly the files at dataset_path and has "
            f"no '{split}' split; point dataset_path at those files instead")


def _python_docs(path: str, split: str) -> datasets.IterableDataset:
    from torchtitan_xla.datasets import python_docs

    docs = python_docs.documents()
    # Every tenth topic (by name) is held out for validation.
    if split == "train":
        texts = [d for i, d in enumerate(docs) if i % 10 != 9]
    elif split == "validation":
        texts = [d for i, d in enumerate(docs) if i % 10 == 9]
    else:
        raise ConfigError(f"[training] dataset_split: python_docs has splits train and "
                          f"validation, not {split!r}")
    return _from_generator(_yield_texts, texts=texts)  # one shard per document


def _c4(path: str, split: str) -> datasets.IterableDataset:
    if split not in ("train", "validation"):
        raise ConfigError(
            f"[training] dataset_split: c4 has splits train and validation, not {split!r}")
    if not path:
        return _hub(C4_HUB_ID, split, config="en")
    root = Path(path).expanduser()
    if not root.is_dir():
        raise ConfigError(
            f"[training] dataset_path: not found: {path} (expected a copy of {C4_HUB_ID})")
    en = root / "en" if (root / "en").is_dir() else root
    files = sorted(str(f) for f in en.glob(f"c4-{split}.*-of-*.json.gz"))
    if not files:
        raise ConfigError(f"[training] dataset_path: no en/c4-{split}.NNNNN-of-NNNNN.json.gz "
                          f"files in {path} (expected the layout of {C4_HUB_ID})")
    return _from_generator(_read_json_lines, files=files)


def _json(path: str, split: str) -> datasets.IterableDataset:
    _only_train("json", split)
    return _from_generator(_read_json_lines, files=_local_files(
        path, (".json", ".jsonl", ".json.gz", ".jsonl.gz"), "json"))


def _text(path: str, split: str) -> datasets.IterableDataset:
    _only_train("text", split)
    return _from_generator(_read_paragraphs, files=_local_files(path, (".txt", ".txt.gz"), "text"))


def _parquet(path: str, split: str) -> datasets.IterableDataset:
    import datasets

    _only_train("parquet", split)
    files = _local_files(path, (".parquet",), "parquet")
    try:
        ds = datasets.load_dataset("parquet", data_files=files, split="train", streaming=True)
    except Exception as e:  # pyarrow reports unreadable files with various exception types
        raise ConfigError(f"[training] dataset_path: {path}: not readable as Parquet "
                          f"({_first_line(e)})") from None
    return _text_column(ds, path)


def _hf(path: str, split: str) -> datasets.IterableDataset:
    """A dataset saved with `save_to_disk` (a folder), or a Hub dataset id (streamed; online)."""
    import datasets

    if not path:
        raise ConfigError(
            "[training] dataset_path: the 'hf' dataset needs a save_to_disk folder or a Hub id")
    if Path(path).expanduser().is_dir():
        try:
            ds = datasets.load_from_disk(str(Path(path).expanduser()))
        except FileNotFoundError as e:
            raise ConfigError(f"[training] dataset_path: {path} is not a save_to_disk folder "
                              f"({_first_line(e)})") from None
        if isinstance(ds, datasets.DatasetDict):
            if split not in ds:
                raise ConfigError(f"[training] dataset_split: {path} has splits "
                                  f"{', '.join(ds)}, not {split!r}")
            ds = ds[split]
        elif split != "train":
            raise ConfigError(f"[training] dataset_split: {path} holds a single split; "
                              f"{split!r} needs a DatasetDict")
        if len(ds) == 0:
            raise ConfigError(f"[training] dataset_path: {path} has no rows")
        # Many shards so that hosts and workers can each take whole shards.
        return _text_column(ds.to_iterable_dataset(num_shards=min(len(ds), 1024)), path)
    return _hub(path, split)


def _hub(repo_id: str, split: str, config: str | None = None) -> datasets.IterableDataset:
    """Stream a dataset from the Hugging Face Hub (needs the network; not verified offline)."""
    import datasets

    try:
        ds = datasets.load_dataset(repo_id, name=config, split=split, streaming=True)
    except Exception as e:  # offline, unknown repo, unknown split: all surface as one line
        raise ConfigError(
            f"[training] dataset: cannot stream {repo_id}{'/' + config if config else ''} split "
            f"{split!r} from the Hugging Face Hub ({_first_line(e)}); for offline use, set "
            f"[training] dataset_path to a local copy") from None
    return _text_column(ds, repo_id)


def _text_column(ds: datasets.IterableDataset, where: str) -> datasets.IterableDataset:
    columns = ds.column_names
    if columns is not None and "text" not in columns:
        raise ConfigError(f"[training] dataset_path: {where} has no 'text' column "
                          f"(columns: {', '.join(columns)})")
    return ds.select_columns(["text"]) if columns else ds


def _first_line(e: BaseException) -> str:
    text = str(e).strip() or type(e).__name__
    return text.splitlines()[0][:300]


_REGISTRY = {"python_docs": _python_docs, "c4": _c4, "json": _json, "parquet": _parquet,
             "text": _text, "hf": _hf}


def load_documents(name: str, path: str = "", split: str = "train") -> datasets.IterableDataset:
    """The dataset registry: name, local path and split -> a stream of {"text": ...} rows."""
    if name not in _REGISTRY:
        raise ConfigError(f"[training] dataset: unknown dataset {name!r}; expected one of: "
                          f"{', '.join(DATASET_NAMES)}")
    return _REGISTRY[name](path, split)


# --------------------------------------------------------------------------------------------
# Packing
# --------------------------------------------------------------------------------------------


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
