"""Real object-store servers on loopback for the tests: a Cloud Storage emulator
(gcp-storage-emulator, reached by gcsfs) and an S3 server (moto in server mode, reached by s3fs),
each its own process on a free port, and the environment that points the libraries at them.
The project's code sees only the libraries' usual environment variables, as against real buckets.
Each server logs every request it serves (`requests`: what a resume or a check asked of the store).
"""

from __future__ import annotations

import collections
import contextlib
import os
import re
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request

from helpers import free_port

# gcp-storage-emulator lacks the objects.move API (GCS's rename, which gcsfs tries first and
# then retries for ~30 s before copying): served here as the copy plus delete it stands for.
_GCS_SERVER = """
import logging
import sys
from gcp_storage_emulator import server
from gcp_storage_emulator.exceptions import NotFound
from gcp_storage_emulator.handlers import objects
from gcp_storage_emulator.settings import API_ENDPOINT

def move(request, response, storage, *args, **kwargs):
    p = request.params
    try:
        moved = objects._copy(request.base_url, storage, p["bucket_name"], p["object_id"],
                              p["bucket_name"], p["dest_object_id"])
    except NotFound:
        response.status = 404
        return
    objects._delete(storage, p["bucket_name"], p["object_id"])
    response.json(moved)

route = (rf"^{API_ENDPOINT}/b/(?P<bucket_name>[-.\\w]+)/o/(?P<object_id>.*[^/]+)/moveTo/o/"
         rf"(?P<dest_object_id>.*[^/]+)$", {"POST": move})
server.HANDLERS = (route, *server.HANDLERS)
logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(message)s")  # request lines
data_dir = sys.argv[3] if len(sys.argv) > 3 else None  # on disk there, else in memory
server.create_server("127.0.0.1", int(sys.argv[1]), in_memory=data_dir is None, default_bucket=sys.argv[2],
                     data_dir=data_dir).run()
"""

GCS_BUCKET = "ttx-gcs"
S3_BUCKET = "ttx-s3"
# In a server's environment: its log file (not read by the libraries).
LOG_KEY = "TTX_TEST_SERVER_LOG"
_REQUEST = re.compile(r'"([A-Z]+) (\S+) HTTP/[0-9.]+" (\d+)')


def _wait_up(url: str, proc: subprocess.Popen, log: str, timeout: float = 60) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            with open(log) as f:
                raise RuntimeError(f"{url}: the server exited: {f.read()[-2000:]}")
        try:
            urllib.request.urlopen(url, timeout=2)
            return
        except urllib.error.HTTPError:  # it answers
            return
        except OSError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"{url}: the server did not start in {timeout}s")


@contextlib.contextmanager
def _server(args: list[str], port: int, env: dict[str, str] | None = None):
    """The server's process; yields the file its log (one line per request) goes to. A file, not
    a pipe: a pipe nobody reads stops the server once its buffer is full."""
    with tempfile.NamedTemporaryFile("w", prefix="ttx-server-", suffix=".log") as log:
        proc = subprocess.Popen([sys.executable, *args], stdout=subprocess.DEVNULL, stderr=log,
                                env={**os.environ, **(env or {})})
        try:
            _wait_up(f"http://127.0.0.1:{port}/", proc, log.name)
            yield log.name
        finally:
            proc.kill()
            proc.wait()


def requests(env: dict[str, str]) -> list[tuple[str, str, int]]:
    """(method, path with its query, status) of every request the server of `env` has served."""
    with open(env[LOG_KEY]) as f:
        return [(m[1], m[2], int(m[3])) for m in map(_REQUEST.search, f) if m]


def reads(env: dict[str, str], start: int = 0) -> collections.Counter:
    """Object key -> how many requests read its bytes, among the server's requests from the
    `start`-th on: a media download on Cloud Storage, a GetObject (no query) on S3."""
    found: collections.Counter = collections.Counter()
    for method, path, _ in requests(env)[start:]:
        path = urllib.parse.unquote(path)
        if method != "GET":
            continue
        if path.startswith("/download/storage/v1/b/"):
            found[path.split("/o/", 1)[1].split("?", 1)[0]] += 1
        elif "?" not in path and path.count("/") >= 2 and not path.startswith("/storage/"):
            found[path.split("/", 2)[2]] += 1  # /bucket/key
    return found


@contextlib.contextmanager
def gcs_server(data_dir: str | None = None):
    """The Cloud Storage emulator with one bucket: yields the environment that reaches it. Objects
    are kept in memory, or in files under `data_dir` (each request then reads them from the disk)."""
    port = free_port()
    with _server(["-c", _GCS_SERVER, str(port), GCS_BUCKET, *([data_dir] if data_dir else [])], port) as log:
        # gcsfs: the emulator, no credentials; its gRPC bucket-type probe has no emulator.
        yield {"STORAGE_EMULATOR_HOST": f"http://127.0.0.1:{port}", "FSSPEC_GCS_TOKEN": "anon",
               "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false", LOG_KEY: log}


@contextlib.contextmanager
def s3_server(*, auth: bool = False):
    """moto's S3 server with one bucket: yields the environment that reaches it. With `auth`, it
    checks credentials (moto's IAM emulation) and the test credentials have no access."""
    port = free_port()
    env = {"AWS_ENDPOINT_URL_S3": f"http://127.0.0.1:{port}", "AWS_ACCESS_KEY_ID": "testing",
           "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}
    server_env = {"INITIAL_NO_AUTH_ACTION_COUNT": "0"} if auth else {}
    with _server(["-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)], port, server_env) as log:
        if not auth:
            urllib.request.urlopen(urllib.request.Request(
                f"http://127.0.0.1:{port}/{S3_BUCKET}", method="PUT"), timeout=10)
        yield {**env, LOG_KEY: log}


@contextlib.contextmanager
def environment(env: dict[str, str]):
    """`env` in this process too (fsspec reads its configuration at import; refreshed here), and
    a fresh file-system instance cache."""
    import fsspec.config

    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    fsspec.config.conf.clear()
    fsspec.config.set_conf_env(fsspec.config.conf)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        fsspec.config.conf.clear()
        fsspec.config.set_conf_env(fsspec.config.conf)
