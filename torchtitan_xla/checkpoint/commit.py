"""The commit protocol that keeps checkpoints from ever being half-read, on a local folder or an
object store (gs://, s3://: no rename there, so none is used anywhere).

A step is written into `step-<N>/` and its commit record (`COMMITTED`: every file and its size)
is written last, in one atomic write. Only step folders with a record whose files all exist with
the recorded sizes are checkpoints: a step without its record (a save killed midway) is absent,
and is deleted once a newer step is committed. Re-saving a step deletes its record first, then
its files; deleting an old step does the same, so a step never looks complete while it is not.

Also here: reading and writing weights-only step folders with plain DCP on the host (the
conversion scripts), which need no XLA device and no process group.
"""

from __future__ import annotations

import bisect
import contextlib
import dataclasses
import io
import json
import os
import time
from typing import Any

from torchtitan_xla import storage
from torchtitan_xla.errors import ConfigError, first_line

COMMIT_FILE = "COMMITTED"
MODEL_ARGS_FILE = "model_args.json"
LORA_FILE = "lora.json"  # the [lora] settings of a checkpoint that holds LoRA adapters


class DamagedCheckpoint(Exception):
    pass


def step_folder(folder: str, step: int) -> str:
    return storage.join(folder, f"step-{step}")


def _step_of(name: str) -> int | None:
    if not name.startswith("step-") or not name[5:].isdigit():
        return None
    return int(name[5:])


def _steps(folder: str) -> dict[int, bool]:
    """Every step folder in `folder` -> whether it has its commit record."""
    steps = {}
    for name in storage.listdir(folder):
        step = _step_of(name)
        if step is not None:
            steps[step] = storage.exists(storage.join(folder, name, COMMIT_FILE))
    return steps


def committed_steps(folder: str) -> list[int]:
    """Steps with a committed checkpoint folder, ascending (integrity is checked on load)."""
    return sorted(step for step, committed in _steps(folder).items() if committed)


def delete_step(path: str) -> None:
    """Its record first: a step half deleted (a process killed meanwhile) is not a checkpoint."""
    storage.remove(storage.join(path, COMMIT_FILE))
    storage.remove(path)


def begin(path: str) -> None:
    """Clear `path` for a new save of its step (an earlier save of it, or one killed midway)."""
    delete_step(path)
    storage.makedirs(path)


def write_commit(path: str, step: int, contents: list[str]) -> dict[str, Any]:
    """Write (and return) the commit record of a fully written `path`: every file and its size."""
    files = storage.file_sizes(path)
    record = {"step": step, "contents": contents, "files": files, "time": time.time()}
    storage.write_text(storage.join(path, COMMIT_FILE), json.dumps(record, indent=1))
    return record


def verify(path: str) -> dict[str, Any]:
    """The commit record, after checking every listed file exists with its recorded size."""
    try:
        record = json.loads(storage.read_text(storage.join(path, COMMIT_FILE)))
    except (OSError, ValueError) as e:
        raise DamagedCheckpoint(f"unreadable {COMMIT_FILE} ({e})") from None
    found = storage.file_sizes(path)
    for name, size in record["files"].items():
        if name not in found:
            raise DamagedCheckpoint(f"missing file {name}")
        if found[name] != size:
            raise DamagedCheckpoint(f"{name} has {found[name]} bytes, {size} were written")
    return record


def purge(folder: str, keep_latest_k: int) -> None:
    """After a commit: delete every step without its record (no save is under way now) and all but
    the newest `keep_latest_k` committed steps (0: keep all)."""
    steps = _steps(folder)
    committed = sorted(s for s, ok in steps.items() if ok)
    old = committed[:-keep_latest_k] if keep_latest_k > 0 else []  # the newest always stays
    for step in sorted([s for s, ok in steps.items() if not ok] + old):
        delete_step(step_folder(folder, step))


def model_mismatch(saved: dict, model_state: dict) -> str | None:
    """Why a checkpoint's tensors (its DCP metadata, `saved`) cannot be the model's, in a few
    words; None when every tensor of `model_state` is there with its shape."""
    names = {name: saved.get(f"model.{name}") for name in model_state}
    missing = [name for name, meta in names.items() if meta is None]
    if missing:
        return f"{len(missing)} of this model's {len(names)} tensors are not in it, e.g. {missing[0]}"
    shapes = [f"{name} {tuple(meta.size)} against {tuple(model_state[name].shape)}"
              for name, meta in names.items()
              if hasattr(meta, "size") and tuple(meta.size) != tuple(model_state[name].shape)]
    return f"{len(shapes)} tensors have other shapes, e.g. {shapes[0]}" if shapes else None


def dcp_failure(e: BaseException) -> str:
    """One line for a failed DCP load or save. DCP wraps each rank's error in a
    CheckpointException, a BaseException whose own text is a traceback: report the first wrapped
    error instead; or the OSError under it, which a user can act on (torch.save reports a full
    disk as "unexpected pos 704 vs 598", raised while handling the OSError)."""
    from torch.distributed.checkpoint.api import CheckpointException

    if isinstance(e, CheckpointException) and e.failures:
        e = next(iter(e.failures.values()))[0]
    cause = e
    while cause is not None and not isinstance(cause, OSError):
        cause = cause.__cause__ or cause.__context__
    return first_line(cause or e)


# The UserWarnings torch.distributed.checkpoint gives at every save or load here, none of which
# applies: (message, the module that warns).
_DCP_WARNINGS = (
    # A host without a process group is a single-host run; DCP warns even when told (no_dist).
    ("torch.distributed is disabled, unavailable or uninitialized", r"state_dict_(saver|loader)"),
    # DCP's own check of each tensor's storage (filesystem.py) uses the deprecated accessor.
    ("TypedStorage is deprecated", "filesystem"),
)


def quiet_dcp() -> None:
    """Ignore exactly those warnings (by message, category and module), from now on. Filters that
    stay, rather than warnings.catch_warnings, which is not thread-safe (async saves write in a
    thread); adding one again only moves it to the front."""
    import re
    import warnings

    for message, module in _DCP_WARNINGS:
        warnings.filterwarnings("ignore", message=re.escape(message), category=UserWarning,
                                module=rf"torch\.distributed\.checkpoint\.{module}$")


def writer(path: str):
    """DCP's writer: its file-system one for a local folder, its fsspec one for a URL."""
    import torch.distributed.checkpoint as dcp

    if storage.is_url(path):
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

        # sync_files: an upload is durable when it completes; DCP would call os.sync() on the host.
        return FsspecWriter(path, sync_files=False, per_thread_copy_ahead=0)
    # per_thread_copy_ahead=0: the overlapping loader asks the device module for CUDA-style
    # streams, which XLA tensors do not have (the state is on the host by then anyway).
    return dcp.FileSystemWriter(path, per_thread_copy_ahead=0)


def reader(path: str):
    """DCP's reader: its file-system one for a local folder, its fsspec one for a URL, reading each
    data file in a few large ranges (`ranged_reader`)."""
    import torch.distributed.checkpoint as dcp

    if storage.is_url(path):
        return ranged_reader(path)
    return dcp.FileSystemReader(path)


# A bucket's data file is read in ranges merged from the items a load needs: gaps up to _MAX_GAP
# are read through (one more request costs more), and a range stops growing at _MAX_BLOCK bytes
# (the host memory it takes; an item larger than that is one range of its own).
_MAX_GAP = 4 * 2**20
_MAX_BLOCK = 256 * 2**20


class _Ranges:
    """One data file as the merged ranges of the items read from it; each range is fetched with
    one request when the first item in it is read, and replaces the one fetched before."""

    def __init__(self, fs, path: str, starts: list[int], ends: list[int]):
        self.fs, self.path, self.starts, self.ends = fs, path, starts, ends
        self.start, self.data = 0, b""

    def item(self, offset: int, length: int) -> io.BytesIO:
        if not (self.start <= offset and offset + length <= self.start + len(self.data)):
            i = bisect.bisect_right(self.starts, offset) - 1
            while i > 0 and self.ends[i] < offset + length:  # merged ranges may overlap
                i -= 1
            self.data = b""  # the previous range's memory first
            self.start = self.starts[i]
            self.data = self.fs.cat_file(self.path, start=self.start, end=self.ends[i])
        at = offset - self.start
        return io.BytesIO(memoryview(self.data)[at:at + length])


def ranged_reader(path: str):
    """DCP's FsspecReader, reading each file with one request per range. Through the file objects
    fsspec opens for it, DCP's reads of each item (a torch.save archive, read back and forth) were
    small ranged requests: 2,784 for one resume of the debug model from gcsfs (docs/checkpoint.md)."""
    from fsspec.utils import merge_offset_ranges
    from torch.distributed.checkpoint._fsspec_filesystem import FileSystem, FsspecReader

    class RangedFileSystem(FileSystem):
        def __init__(self):
            super().__init__()
            self.ranges: dict[str, tuple[list[int], list[int]]] = {}  # set by read_data

        @contextlib.contextmanager
        def create_stream(self, path, mode):
            path = os.fspath(path)
            if mode != "rb":
                with super().create_stream(path, mode) as stream:
                    yield stream
            elif path in self.ranges:
                yield _Ranges(self.fs, path, *self.ranges.pop(path))
            else:  # .metadata: the whole file
                yield io.BytesIO(self.fs.cat_file(path))

    class RangedReader(FsspecReader):
        def __init__(self, path):
            super().__init__(path)
            self.fs = RangedFileSystem()
            self.path = self.fs.init_path(path)

        def read_data(self, plan, planner):
            info = self.storage_data
            # In file order, so that each range is fetched once (DCP reads in the plan's order).
            items = sorted(plan.items, key=lambda r: (info[r.storage_index].relative_path,
                                                      info[r.storage_index].offset))
            stored = [info[r.storage_index] for r in items]
            paths, starts, ends = merge_offset_ranges(
                [self.fs.concat_path(self.path, s.relative_path) for s in stored],
                [s.offset for s in stored], [s.offset + s.length for s in stored],
                max_gap=_MAX_GAP, max_block=_MAX_BLOCK)
            for p in set(paths):
                self.fs.ranges[p] = ([s for q, s in zip(paths, starts) if q == p],
                                     [e for q, e in zip(paths, ends) if q == p])
            return super().read_data(dataclasses.replace(plan, items=items), planner)

        def _slice_file(self, file, sinfo):
            return file.item(sinfo.offset, sinfo.length)

    return RangedReader(path)


# ---- weights-only step folders on the host -----------------------------------------------------


def read_model_state(step_dir: str):
    """(full model tensors on the host, ModelArgs) of a checkpoint step folder, with plain DCP on
    the CPU: no XLA device or process group needed (used by the conversion scripts)."""
    import torch
    import torch.distributed.checkpoint as dcp

    from torchtitan_xla.checkpoint.hf import model_args_from_json

    path = str(step_dir)
    try:
        verify(path)
    except DamagedCheckpoint as e:
        raise ConfigError(f"checkpoint {path}: {e}") from None
    metadata = reader(path).read_metadata()
    states = {"model": {}}
    for key, meta in metadata.state_dict_metadata.items():
        if key.startswith("model."):
            states["model"][key[len("model."):]] = torch.empty(meta.size, dtype=meta.properties.dtype)
    quiet_dcp()
    dcp.load(states, storage_reader=reader(path), no_dist=True)
    return states["model"], model_args_from_json(storage.read_text(storage.join(path, MODEL_ARGS_FILE)))


def read_lora_settings(step_dir: str) -> dict | None:
    """The [lora] settings a checkpoint step with LoRA adapters was saved with (None: no adapters)."""
    import json

    path = storage.join(str(step_dir), LORA_FILE)
    return json.loads(storage.read_text(path)) if storage.exists(path) else None


def write_model_checkpoint(state_dict, args, step_dir: str, step: int = 0) -> None:
    """A weights-only checkpoint step folder from host tensors (seed / converted checkpoints)."""
    import torch.distributed.checkpoint as dcp

    from torchtitan_xla.checkpoint.hf import model_args_to_json

    path = str(step_dir)
    begin(path)
    quiet_dcp()
    dcp.save({"model": state_dict}, storage_writer=writer(path), no_dist=True)
    storage.write_text(storage.join(path, MODEL_ARGS_FILE), model_args_to_json(args))
    write_commit(path, step, ["model"])
