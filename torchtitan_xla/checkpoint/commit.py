"""The commit protocol that keeps checkpoints from ever being half-read.

A checkpoint step is written into `step-<N>.partial`, then a commit file (`COMMITTED`, listing every
file and its size) is written, then the folder is renamed to `step-<N>`. Only folders with a commit
file whose files are all present with the recorded sizes count as checkpoints, so a process killed
mid-save leaves the previous checkpoint as the newest one. Old steps are deleted only after a newer
one is committed.

Also here: reading and writing weights-only step folders with plain DCP on the host (the
conversion scripts), which need no XLA device and no process group.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path
from typing import Any

from torchtitan_xla.errors import ConfigError, first_line

COMMIT_FILE = "COMMITTED"
MODEL_ARGS_FILE = "model_args.json"
PARTIAL = ".partial"


class DamagedCheckpoint(Exception):
    pass


def step_folder(folder: Path, step: int) -> Path:
    return folder / f"step-{step}"


def partial_folder(folder: Path, step: int) -> Path:
    return folder / f"step-{step}{PARTIAL}"


def _step_of(path: Path) -> int | None:
    name = path.name
    if not name.startswith("step-") or not name[5:].isdigit():
        return None
    return int(name[5:])


def committed_steps(folder: Path) -> list[int]:
    """Steps with a committed checkpoint folder, ascending (integrity is checked on load)."""
    if not folder.is_dir():
        return []
    steps = [_step_of(p) for p in folder.iterdir() if (p / COMMIT_FILE).is_file()]
    return sorted(s for s in steps if s is not None)


def write_commit(path: Path, step: int, contents: list[str]) -> None:
    """The commit record of a fully written `path`: every file and its size."""
    files = {str(f.relative_to(path)): f.stat().st_size for f in sorted(path.rglob("*")) if f.is_file()}
    record = {"step": step, "contents": contents, "files": files, "time": time.time()}
    tmp = path / (COMMIT_FILE + ".tmp")
    tmp.write_text(json.dumps(record, indent=1))
    os.replace(tmp, path / COMMIT_FILE)


def publish(partial: Path, final: Path) -> None:
    """Rename a committed partial folder to its final name, replacing an older save of the step."""
    if final.exists():
        shutil.rmtree(final)
    os.replace(partial, final)


def verify(path: Path) -> dict[str, Any]:
    """The commit record, after checking every listed file exists with its recorded size."""
    try:
        record = json.loads((path / COMMIT_FILE).read_text())
    except (OSError, ValueError) as e:
        raise DamagedCheckpoint(f"unreadable {COMMIT_FILE} ({e})") from None
    for name, size in record["files"].items():
        f = path / name
        if not f.is_file():
            raise DamagedCheckpoint(f"missing file {name}")
        if f.stat().st_size != size:
            raise DamagedCheckpoint(f"{name} has {f.stat().st_size} bytes, {size} were written")
    return record


def purge(folder: Path, keep_latest_k: int) -> None:
    """Delete all but the newest `keep_latest_k` committed steps (0: keep all)."""
    steps = committed_steps(folder)
    if keep_latest_k > 0 and len(steps) > keep_latest_k:
        for old in steps[:-keep_latest_k]:  # the newest (just committed) always stays
            shutil.rmtree(step_folder(folder, old), ignore_errors=True)


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


def writer(path: Path):
    import torch.distributed.checkpoint as dcp

    # per_thread_copy_ahead=0: the overlapping loader asks the device module for CUDA-style
    # streams, which XLA tensors do not have (the state is on the host by then anyway).
    return dcp.FileSystemWriter(str(path), per_thread_copy_ahead=0)


# ---- weights-only step folders on the host -----------------------------------------------------


def read_model_state(step_dir: str | Path):
    """(full model tensors on the host, ModelArgs) of a checkpoint step folder, with plain DCP on
    the CPU: no XLA device or process group needed (used by the conversion scripts)."""
    import torch
    import torch.distributed.checkpoint as dcp

    from torchtitan_xla.checkpoint.hf import model_args_from_json

    path = Path(step_dir)
    try:
        verify(path)
    except DamagedCheckpoint as e:
        raise ConfigError(f"checkpoint {path}: {e}") from None
    metadata = dcp.FileSystemReader(str(path)).read_metadata()
    states = {"model": {}}
    for key, meta in metadata.state_dict_metadata.items():
        if key.startswith("model."):
            states["model"][key[len("model."):]] = torch.empty(meta.size, dtype=meta.properties.dtype)
    dcp.load(states, storage_reader=dcp.FileSystemReader(str(path)), no_dist=True)
    return states["model"], model_args_from_json((path / MODEL_ARGS_FILE).read_text())


def write_model_checkpoint(state_dict, args, step_dir: str | Path, step: int = 0) -> None:
    """A weights-only checkpoint step folder from host tensors (seed / converted checkpoints)."""
    import torch.distributed.checkpoint as dcp

    from torchtitan_xla.checkpoint.hf import model_args_to_json

    final = Path(step_dir)
    partial = final.with_name(final.name + PARTIAL)
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    dcp.save({"model": state_dict}, storage_writer=writer(partial), no_dist=True)
    (partial / MODEL_ARGS_FILE).write_text(model_args_to_json(args))
    write_commit(partial, step, ["model"])
    publish(partial, final)
