"""Where the run reads and writes: a local folder, or a `gs://bucket/path` / `s3://bucket/path`
URL, through fsspec (gcsfs, s3fs). Paths are plain strings; local ones stay on the os module's
fast paths, URLs go through their fsspec file system. Credentials are the libraries' own (the
environment, the metadata server, ~/.aws): nothing here stores any.

Object stores have no rename and no folders: a "folder" is a key prefix, a file appears whole
when its upload completes (the checkpoint commit protocol builds on that, checkpoint/commit.py).
"""

from __future__ import annotations

import errno
import os
import tempfile
import uuid
from contextlib import contextmanager
from pathlib import Path

from torchtitan_xla.errors import ConfigError, first_line

# The packages behind each URL scheme, and the extra that installs them.
_PACKAGES = {"gs": ("gcsfs", "gcs"), "gcs": ("gcsfs", "gcs"), "s3": ("s3fs", "s3")}


def is_url(path: str | Path) -> bool:
    return "://" in str(path)


def join(base: str | Path, *names: str) -> str:
    """`base/name/...`; a name that is itself a URL or an absolute path replaces what precedes it."""
    out = str(base)
    for name in names:
        name = str(name)
        if is_url(name) or os.path.isabs(name):
            out = name
        elif is_url(out):
            out = out.rstrip("/") + "/" + name
        else:
            out = os.path.join(out, name)
    return out


def name(path: str) -> str:
    return str(path).rstrip("/").rsplit("/", 1)[-1]


def filesystem(url: str):
    """(fsspec file system, its path) of a URL; a missing package is one line naming the extra."""
    from fsspec.core import url_to_fs

    scheme = url.split("://", 1)[0]
    try:
        return url_to_fs(url)
    except ImportError:
        package, extra = _PACKAGES.get(scheme, (f"an fsspec implementation of {scheme}://", None))
        hint = f" (pip install 'torchtitan_xla[{extra}]')" if extra else ""
        raise ConfigError(f"{url}: reading and writing {scheme}:// needs {package}{hint}") from None
    except ValueError as e:  # an unknown protocol
        raise ConfigError(f"{url}: {first_line(e, typed=False)}") from None


def _fresh(url: str):
    """The file system and path, with fsspec's listing cache for it dropped: another process (or
    host) may have written since the last listing."""
    fs, path = filesystem(url)
    fs.invalidate_cache(path)
    return fs, path


def exists(path: str) -> bool:
    if not is_url(path):
        return os.path.exists(path)
    fs, p = _fresh(path)
    return fs.exists(p)


def isdir(path: str) -> bool:
    if not is_url(path):
        return os.path.isdir(path)
    fs, p = _fresh(path)
    return fs.isdir(p)


def listdir(folder: str) -> list[str]:
    """Names directly in `folder` (files and sub-folders); [] when it does not exist."""
    if not is_url(folder):
        return sorted(os.listdir(folder)) if os.path.isdir(folder) else []
    fs, p = _fresh(folder)
    try:
        return sorted(name(entry) for entry in fs.ls(p, detail=False))
    except FileNotFoundError:
        return []


def file_sizes(folder: str) -> dict[str, int]:
    """Every file under `folder` (recursively, '/'-separated relative names) and its size."""
    if not is_url(folder):
        root = Path(folder)
        return {f.relative_to(root).as_posix(): f.stat().st_size
                for f in sorted(root.rglob("*")) if f.is_file()}
    fs, p = _fresh(folder)
    prefix = p.rstrip("/") + "/"
    found = fs.find(p, detail=True)
    return {k[len(prefix):]: int(v["size"]) for k, v in sorted(found.items()) if k.startswith(prefix)}


def read_bytes(path: str) -> bytes:
    if not is_url(path):
        return Path(path).read_bytes()
    fs, p = filesystem(path)
    return fs.cat_file(p)


def read_text(path: str) -> str:
    return read_bytes(path).decode("utf-8")


def write_text(path: str, text: str) -> None:
    """All or nothing: a reader sees the old file or the whole new one. An object store's upload is
    atomic by itself; a local file is written beside its name and renamed onto it."""
    data = text.encode("utf-8")
    if is_url(path):
        fs, p = filesystem(path)
        fs.pipe_file(p, data)
        return
    tmp = f"{path}.tmp"
    Path(tmp).write_bytes(data)
    os.replace(tmp, path)


def makedirs(folder: str) -> None:
    """Create a local folder; object stores have none to create."""
    if folder and not is_url(folder):
        os.makedirs(folder, exist_ok=True)


def remove(path: str) -> None:
    """Delete a file or a folder and everything in it; nothing if it does not exist."""
    if not is_url(path):
        if os.path.isdir(path):
            import shutil

            shutil.rmtree(path, ignore_errors=True)
        elif os.path.exists(path):
            os.remove(path)
        return
    fs, p = _fresh(path)
    try:
        fs.rm(p, recursive=True)
    except FileNotFoundError:
        pass
    fs.invalidate_cache(p)


@contextmanager
def local_folder(path: str):
    """A local folder to write into that ends up at `path`: itself, or for a URL a temporary
    folder uploaded to it at the end (for writers that need local files: safetensors, tokenizers)."""
    if not is_url(path):
        os.makedirs(path, exist_ok=True)
        yield Path(path)
        return
    with tempfile.TemporaryDirectory(prefix="ttx-upload-") as tmp:
        yield Path(tmp)
        fs, p = filesystem(path)
        for f in sorted(Path(tmp).rglob("*")):
            if f.is_file():
                fs.put_file(str(f), p.rstrip("/") + "/" + f.relative_to(tmp).as_posix())


def local_outputs(dump_folder: str) -> str:
    """Where outputs that need a local file system go (TensorBoard and W&B files, traces): the dump
    folder itself, or for a URL the same path under ./outputs (gs://b/run -> ./outputs/gs/b/run)."""
    if not is_url(dump_folder):
        return dump_folder
    scheme, rest = dump_folder.split("://", 1)
    return os.path.join("outputs", scheme, rest.strip("/"))


def describe(e: BaseException) -> str:
    """One line for a failed storage call. The object-store libraries put the reason (no such
    bucket, access denied) in the message of a FileNotFoundError / PermissionError / OSError."""
    if isinstance(e, PermissionError):
        return f"permission denied ({first_line(e, typed=False, limit=200)})"
    if isinstance(e, FileNotFoundError):
        return f"not found ({first_line(e, typed=False, limit=200)})"
    return first_line(e, limit=200)


def check_writable(folder: str | Path, key: str) -> None:
    """ConfigError naming the config `key` unless files can be created in `folder` (or where it
    will be created). Run at start, so that a bad location is not found at the first checkpoint,
    after the training before it; nothing is left behind. A URL gets a probe object written and
    deleted (its bucket must exist: buckets are not created)."""
    folder = str(folder)
    if is_url(folder):
        probe = join(folder, f".write-check-{uuid.uuid4().hex}")
        try:
            fs, p = filesystem(probe)
            fs.pipe_file(p, b"")
            fs.rm_file(p)
        except ConfigError as e:
            raise ConfigError(f"{key}: {e}") from None
        except Exception as e:  # each library raises its own types for a bucket, auth or network error
            # Objects need no parent folders: only a missing bucket makes a write "not found".
            reason = "no such bucket" if isinstance(e, FileNotFoundError) else describe(e)
            raise ConfigError(f"{key}: cannot write to {folder}: {reason}") from None
        return
    existing = Path(folder)
    while not existing.exists() and existing.parent != existing:
        existing = existing.parent
    try:
        if not existing.is_dir():
            raise NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), str(existing))
        with tempfile.NamedTemporaryFile(dir=existing, prefix=".write-check-"):
            pass
    except OSError as e:
        reason = (e.strerror or type(e).__name__) + (f": {existing}" if str(existing) != folder else "")
        raise ConfigError(f"{key}: cannot write to {folder} ({reason})") from None
