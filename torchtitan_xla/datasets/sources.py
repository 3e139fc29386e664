"""Where documents come from: the dataset registry (`[training] dataset`).

Every source is a HuggingFace `datasets.IterableDataset` of `{"text": str}` rows, streamed (a
corpus is never loaded whole): the embedded Python docs, C4 (a copy or the Hub), JSON lines /
parquet / text files, and `save_to_disk` folders. Files and copies may be local or in a bucket
(gs://, s3://, read through fsspec: storage.py). packing.py turns them into training windows.
The chat datasets (CHAT_DATASETS) are streams of `{"messages": str}` rows instead: each a
conversation as a JSON list of {"role", "content"} messages (chat.py), for packing.ChatDataset.
"""

from __future__ import annotations

import fnmatch
import glob
import json
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

from torchtitan_xla import storage
from torchtitan_xla.errors import ConfigError, first_line

if TYPE_CHECKING:
    import datasets

T = TypeVar("T")
C4_HUB_ID = "allenai/c4"
DATASET_NAMES = ("python_docs", "c4", "json", "parquet", "text", "hf", "synthetic", "chat",
                 "python_docs_chat", "preference", "python_docs_preference")
CHAT_DATASETS = ("chat", "python_docs_chat")
JSON_SUFFIXES = (".json", ".jsonl", ".json.gz", ".jsonl.gz")
SAVED_MARKERS = ("dataset_dict.json", "dataset_info.json")  # what save_to_disk writes in its folder


# --------------------------------------------------------------------------------------------
# Readers (generators over a list of files: each file is one shard of the stream)
# --------------------------------------------------------------------------------------------


def open_text(file: str):
    import fsspec

    return fsspec.open(file, "rt", encoding="utf-8", compression="infer")


def _read_json_lines(files: list[str]) -> Iterator[dict[str, str]]:
    """C4's format: one JSON object with a "text" string per line. A bad line stops the run with
    its file and line number (a corrupt or truncated download should not train silently)."""
    for file in files:
        lineno = 0
        try:
            with open_text(file) as fh:
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
            with open_text(file) as fh:
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


def records_in(file: str, parse: Callable[[object], T]) -> Iterator[T]:
    """`parse` of each JSON line of a file (blank lines skipped); a bad line stops the run with
    its file, line number and what `parse` found wrong."""
    lineno = 0
    try:
        with open_text(file) as fh:
            for lineno, line in enumerate(fh, 1):  # noqa: B007
                if not line.strip():
                    continue
                try:
                    record = parse(json.loads(line))
                except json.JSONDecodeError as e:
                    raise ConfigError(f"{file}:{lineno}: not a JSON object ({e.msg})") from None
                except ConfigError as e:
                    raise ConfigError(f"{file}:{lineno}: {e}") from None
                yield record
    except (OSError, EOFError, UnicodeDecodeError) as e:
        raise ConfigError(f"{file}: unreadable after line {lineno} ({e})") from None


def _conversations_in(file: str) -> Iterator[list[dict[str, str]]]:
    """The conversations of a JSON-lines file (chat.py's records), each as its messages."""
    from torchtitan_xla.datasets.chat import parse_conversation

    return records_in(file, parse_conversation)


def _read_conversations(files: list[str]) -> Iterator[dict[str, str]]:
    for file in files:
        for messages in _conversations_in(file):
            yield {"messages": json.dumps(messages)}


def _yield_texts(texts: list[str]) -> Iterator[dict[str, str]]:
    for text in texts:
        yield {"text": text}


def _yield_conversations(conversations: list[list[dict[str, str]]]) -> Iterator[dict[str, str]]:
    for messages in conversations:
        yield {"messages": json.dumps(messages)}


# --------------------------------------------------------------------------------------------
# The registry: (name, path, split) -> a streamed datasets.IterableDataset, "text" column
# (the chat datasets: "messages")
# --------------------------------------------------------------------------------------------


def _from_generator(fn, column: str = "text", **shards: list) -> datasets.IterableDataset:
    """A stream of `column` strings over `fn(list)`; HF treats each list element as one shard."""
    import datasets

    features = datasets.Features({column: datasets.Value("string")})
    return datasets.IterableDataset.from_generator(fn, features=features, gen_kwargs=shards)


def _url_files(path: str, suffixes: tuple[str, ...]) -> list[str] | None:
    """_local_files for a URL (None: nothing there)."""
    fs, p = storage.filesystem(path)
    try:
        if any(ch in p for ch in "*?["):
            files = [f for f in fs.glob(p) if fs.isfile(f)]
        elif fs.isdir(p):
            files = [f for f in fs.find(p) if f.endswith(suffixes)]
        elif fs.isfile(p):
            files = [p]
        else:
            return None
    except Exception as e:  # each library has its own errors for a bucket, auth or network error
        raise ConfigError(f"[training] dataset_path: {path}: {storage.describe(e)}") from None
    return sorted(fs.unstrip_protocol(f) for f in files)


def _local_files(path: str, suffixes: tuple[str, ...], kind: str) -> list[str]:
    """A file, a folder (searched recursively) or a glob pattern, local or a URL -> sorted file list."""
    if not path:
        raise ConfigError(
            f"[training] dataset_path: the '{kind}' dataset needs a file, folder or glob")
    if storage.is_url(path):
        files = _url_files(path, suffixes)
        if files is None:
            raise ConfigError(f"[training] dataset_path: not found: {path}")
        if not files:
            raise ConfigError(f"[training] dataset_path: no {' / '.join(suffixes)} files in {path}")
        return files
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


def _held_out(items, name: str, split: str) -> list:
    """The embedded sets' splits: every tenth item (by topic name) is held out for validation."""
    if split not in ("train", "validation"):
        raise ConfigError(f"[training] dataset_split: {name} has splits train and validation, "
                          f"not {split!r}")
    return [x for i, x in enumerate(items) if (i % 10 == 9) == (split == "validation")]


def _python_docs(path: str, split: str) -> datasets.IterableDataset:
    from torchtitan_xla.datasets import python_docs

    texts = _held_out(python_docs.documents(), "python_docs", split)
    return _from_generator(_yield_texts, texts=texts)  # one shard per document


def _c4(path: str, split: str) -> datasets.IterableDataset:
    if split not in ("train", "validation"):
        raise ConfigError(
            f"[training] dataset_split: c4 has splits train and validation, not {split!r}")
    if not path:
        return _hub(C4_HUB_ID, split, config="en")
    root = path if storage.is_url(path) else str(Path(path).expanduser())
    if not storage.isdir(root):
        raise ConfigError(
            f"[training] dataset_path: not found: {path} (expected a copy of {C4_HUB_ID})")
    en = storage.join(root, "en") if storage.isdir(storage.join(root, "en")) else root
    files = [storage.join(en, name) for name in storage.listdir(en)
             if fnmatch.fnmatch(name, f"c4-{split}.*-of-*.json.gz")]
    if not files:
        raise ConfigError(f"[training] dataset_path: no en/c4-{split}.NNNNN-of-NNNNN.json.gz "
                          f"files in {path} (expected the layout of {C4_HUB_ID})")
    return _from_generator(_read_json_lines, files=files)


def _json(path: str, split: str) -> datasets.IterableDataset:
    _only_train("json", split)
    return _from_generator(_read_json_lines, files=_local_files(path, JSON_SUFFIXES, "json"))


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
                          f"({first_line(e, typed=False)})") from None
    return _text_column(ds, path)


def _hf(path: str, split: str) -> datasets.IterableDataset:
    """A dataset saved with `save_to_disk` (a folder), or a Hub dataset id (streamed; online)."""
    if not path:
        raise ConfigError(
            "[training] dataset_path: the 'hf' dataset needs a save_to_disk folder or a Hub id")
    folder = _saved_folder(path)
    if folder:
        ds = _saved_split(folder, path, split)
        # Many shards so that hosts and workers can each take whole shards.
        return _text_column(ds.to_iterable_dataset(num_shards=min(len(ds), 1024)), path)
    return _hub(path, split)


def _saved_folder(path: str) -> str | None:
    """`path` as a folder to give `load_from_disk`, or None where it is no folder."""
    folder = path if storage.is_url(path) else str(Path(path).expanduser())
    return folder if storage.isdir(folder) else None


def _saved_split(folder: str, path: str, split: str) -> datasets.Dataset:
    """The split `split` of a `save_to_disk` folder (a Dataset is the train split), not empty."""
    import datasets

    try:
        ds = datasets.load_from_disk(folder)
    except FileNotFoundError as e:
        raise ConfigError(f"[training] dataset_path: {path} is not a save_to_disk folder "
                          f"({first_line(e, typed=False)})") from None
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
    return ds


def _hub(repo_id: str, split: str, config: str | None = None) -> datasets.IterableDataset:
    """Stream a dataset from the Hugging Face Hub (needs the network; not verified offline)."""
    import datasets

    try:
        ds = datasets.load_dataset(repo_id, name=config, split=split, streaming=True)
    except Exception as e:  # offline, unknown repo, unknown split: all surface as one line
        raise ConfigError(
            f"[training] dataset: cannot stream {repo_id}{'/' + config if config else ''} split "
            f"{split!r} from the Hugging Face Hub ({first_line(e, typed=False)}); for offline use, set "
            f"[training] dataset_path to a local copy") from None
    return _text_column(ds, repo_id)


def _text_column(ds: datasets.IterableDataset, where: str) -> datasets.IterableDataset:
    columns = ds.column_names
    if columns is not None and "text" not in columns:
        raise ConfigError(f"[training] dataset_path: {where} has no 'text' column "
                          f"(columns: {', '.join(columns)})")
    return ds.select_columns(["text"]) if columns else ds


def _chat(path: str, split: str) -> datasets.IterableDataset:
    _only_train("chat", split)
    files = _local_files(path, JSON_SUFFIXES, "chat")
    # Every local record is checked now (one quick pass: fine-tuning sets are small), so a bad
    # line stops the run before it starts; files behind a URL are checked as they are streamed.
    for file in files:
        if not storage.is_url(file):
            for _ in _conversations_in(file):
                pass
    return _from_generator(_read_conversations, column="messages", files=files)


def _python_docs_chat(path: str, split: str) -> datasets.IterableDataset:
    from torchtitan_xla.datasets import python_docs

    # Held out by topic, so no validation topic is trained on.
    topics = _held_out(python_docs.conversations(), "python_docs_chat", split)
    conversations = [c for topic in topics for c in topic]
    return _from_generator(_yield_conversations, column="messages", conversations=conversations)


def _preference(path: str, split: str) -> datasets.IterableDataset:
    """JSON lines of pairs (files, a folder of them or a glob; one split), or a `save_to_disk`
    folder of them (TRL's columns prompt, chosen, rejected; its splits)."""
    from torchtitan_xla.datasets import preference

    folder = _saved_folder(path) if path else None
    if folder and any(storage.exists(storage.join(folder, f)) for f in SAVED_MARKERS):
        pairs = []
        for row, record in enumerate(_saved_split(folder, path, split)):
            try:
                pairs.append(preference.parse_pair(_without_nulls(record)))  # checked now
            except ConfigError as e:
                raise ConfigError(f"{path} ({split} split), row {row}: {e}") from None
    else:
        _only_train("preference", split)
        files = _local_files(path, JSON_SUFFIXES, "preference")
        pairs = [pair for file in files for pair in records_in(file, preference.parse_pair)]  # checked now
    return _from_generator(preference.encode_pairs, column="pair", pairs=pairs)


def _without_nulls(value):
    """A row as its JSON line would be: Arrow gives a key some rows lack (a system prompt, a
    message's name) to every row, as None where absent."""
    if isinstance(value, dict):
        return {k: _without_nulls(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_without_nulls(v) for v in value]
    return value


def _python_docs_preference(path: str, split: str) -> datasets.IterableDataset:
    from torchtitan_xla.datasets import preference, python_docs

    topics = _held_out(python_docs.conversations(), "python_docs_preference", split)
    return _from_generator(preference.encode_pairs, column="pair",
                           pairs=preference.embedded_pairs(topics))


_REGISTRY = {"python_docs": _python_docs, "c4": _c4, "json": _json, "parquet": _parquet,
             "text": _text, "hf": _hf, "chat": _chat, "python_docs_chat": _python_docs_chat,
             "preference": _preference, "python_docs_preference": _python_docs_preference}


def load_documents(name: str, path: str = "", split: str = "train") -> datasets.IterableDataset:
    """The dataset registry: name, local path and split -> a stream of {"text": ...} rows (of
    {"messages": ...} rows for the CHAT_DATASETS)."""
    if name not in _REGISTRY:
        raise ConfigError(f"[training] dataset: unknown dataset {name!r}; expected one of: "
                          f"{', '.join(DATASET_NAMES)}")
    return _REGISTRY[name](path, split)
