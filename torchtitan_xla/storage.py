"""Where the run reads and writes: a local folder, or a `gs://bucket/path` / `s3://bucket/path`
URL, through fsspec (gcsfs, s3fs). Paths are plain strings; local ones stay on the os module's
fast paths, URLs go through their fsspec file system. Credentials are the libraries' own (the
environment, the metadata server, ~/.aws): nothing here stores any.

Object stores have no rename and no folders: a "folder" is a key prefix, a file appears whole
when its upload completes (the checkpoint commit protocol builds on that, checkpoint/commit.py).
"""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
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


@contextmanager
def _implementation(url: str):
    """A missing package or an unknown URL scheme raised inside is one line naming the extra."""
    scheme = url.split("://", 1)[0]
    try:
        yield
    except ConfigError:  # already one line (a ValueError too)
        raise
    except ImportError:
        package, extra = _PACKAGES.get(scheme, (f"an fsspec implementation of {scheme}://", None))
        hint = f" (pip install 'torchtitan_xla[{extra}]')" if extra else ""
        raise ConfigError(f"{url}: reading and writing {scheme}:// needs {package}{hint}") from None
    except ValueError as e:  # an unknown protocol
        raise ConfigError(f"{url}: {first_line(e, typed=False)}") from None


def filesystem(url: str):
    """(fsspec file system, its path) of a URL; a missing package is one line naming the extra.
    The first use of each bucket in a process checks, in a child process given CHECK_SECONDS,
    that it answers: without a network or credentials the libraries retry for a minute or more
    and print pages of warnings and tracebacks before their error."""
    from fsspec.core import url_to_fs
    from fsspec.registry import get_filesystem_class

    with _implementation(url):
        if _bucket(url) not in _REACHED:
            get_filesystem_class(url.split("://", 1)[0])  # a missing package: said without a child
            # Before url_to_fs here: making the file system already looks for credentials.
            reason = _probe(url, "read")
            if reason is not None:
                raise ConfigError(f"{url}: cannot reach the storage: {reason}")
            _REACHED.add(_bucket(url))
        return url_to_fs(url)


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
    tmp = f"{path}.{os.getpid()}.tmp"  # processes sharing the folder write the same file
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


# A URL's first read and its write check run in a child process, given up on after CHECK_SECONDS:
# without a network the libraries retry for a minute or more (gcsfs 6 times over ~35 s, google-auth
# asks the metadata server), and log, warn and print tracebacks as they go (the child's stderr is
# dropped). What the child found comes back on its stdout, one JSON object a line after _MARK.
CHECK_SECONDS = 20
_MARK = "ttx-storage-check "
_REACHED: set[str] = set()  # the buckets this process has reached
_PROBE = f"""
import json, logging, sys
def say(**report):
    print({_MARK!r} + json.dumps(report), flush=True)
class Errors(logging.Handler):  # what the libraries retry on: the reason if time runs out
    def emit(self, record):
        text = record.getMessage().strip()
        if text and (record.exc_info or "error" in text.lower() or "exception" in text.lower()):
            say(logged=text.splitlines()[0][:200])
logging.getLogger().addHandler(Errors())
for name in ("gcsfs", "s3fs"):
    logging.getLogger(name).setLevel(logging.DEBUG)
try:
    from fsspec.core import url_to_fs
    fs, path = url_to_fs(sys.argv[1])
    if sys.argv[2] == "write":
        fs.pipe_file(path, b"")
        fs.rm_file(path)
    else:
        fs.info(path)
    say(ok=True)
except Exception as e:
    say(error=type(e).__name__, text=str(e), missing=isinstance(e, FileNotFoundError),
        denied=isinstance(e, PermissionError))
"""


def _reason(report: dict) -> str:
    """One line for the failed write the child reported. The object-store libraries put the reason
    (no such bucket, access denied) in the message of a FileNotFoundError / PermissionError / OSError;
    objects need no parent folders, so only a missing bucket makes a write "not found"."""
    text = report["text"].strip().splitlines()[0][:200] if report["text"].strip() else ""
    if report["missing"]:
        return "no such bucket"
    if report["denied"]:
        return f"permission denied ({text})" if text else "permission denied"
    return f"{report['error']}: {text}" if text else report["error"]


def _bucket(url: str) -> str:
    scheme, rest = url.split("://", 1)
    return f"{scheme}://{rest.split('/', 1)[0]}"


def _probe(url: str, op: str) -> str | None:
    """None if `op` succeeds on `url` ("write": an empty object written and deleted; "read": its
    metadata, where an object that is missing or forbidden counts as an answer, which the caller's
    own call then reports); otherwise why not, in a line."""
    with tempfile.TemporaryFile("w+") as out:
        child = subprocess.Popen([sys.executable, "-c", _PROBE, url, op], stdin=subprocess.DEVNULL,
                                 stdout=out, stderr=subprocess.DEVNULL)
        try:
            child.wait(timeout=CHECK_SECONDS)
            timed_out = False
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()
            timed_out = True
        out.seek(0)
        reports = [json.loads(line.split(_MARK, 1)[1]) for line in out if _MARK in line]
    outcome = next((r for r in reports if "ok" in r or "error" in r), None)
    if outcome is not None:
        answered = op == "read" and (outcome.get("missing") or outcome.get("denied"))
        return None if "ok" in outcome or answered else _reason(outcome)
    logged = [r["logged"] for r in reports if "logged" in r]
    if timed_out:
        return (f"gave up after {CHECK_SECONDS} s" +
                (f" (last error: {logged[-1]})" if logged else " (no answer)"))
    return f"the check exited with code {child.returncode}" + (f" ({logged[-1]})" if logged else "")


def check_writable(folder: str | Path, key: str) -> None:
    """ConfigError naming the config `key` unless files can be created in `folder` (or where it
    will be created). Run at start, so that a bad location is not found at the first checkpoint,
    after the training before it; nothing is left behind. A URL gets a probe object written and
    deleted (its bucket must exist: buckets are not created), in a child process given
    CHECK_SECONDS; what the storage libraries log or print meanwhile is not shown."""
    folder = str(folder)
    if is_url(folder):
        from fsspec.registry import get_filesystem_class

        try:
            with _implementation(folder):  # a missing package: found here, without a child
                get_filesystem_class(folder.split("://", 1)[0])
        except ConfigError as e:
            raise ConfigError(f"{key}: {e}") from None
        reason = _probe(join(folder, f".write-check-{uuid.uuid4().hex}"), "write")
        if reason is not None:
            raise ConfigError(f"{key}: cannot write to {folder}: {reason}")
        _REACHED.add(_bucket(folder))
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
