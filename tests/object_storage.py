"""Real object-store servers on loopback for the tests: a Cloud Storage emulator
(gcp-storage-emulator, reached by gcsfs) and an S3 server (moto in server mode, reached by s3fs),
each its own process on a free port, and the environment that points the libraries at them.
The project's code sees only the libraries' usual environment variables, as against real buckets.
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

# gcp-storage-emulator lacks the objects.move API (GCS's rename, which gcsfs tries first and
# then retries for ~30 s before copying): served here as the copy plus delete it stands for.
_GCS_SERVER = """
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
server.create_server("127.0.0.1", int(sys.argv[1]), in_memory=True, default_bucket=sys.argv[2]).run()
"""

GCS_BUCKET = "ttx-gcs"
S3_BUCKET = "ttx-s3"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_up(url: str, proc: subprocess.Popen, timeout: float = 60) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{url}: the server exited: {proc.stderr.read()[-2000:]}")
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
    proc = subprocess.Popen([sys.executable, *args], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True, env={**os.environ, **(env or {})})
    try:
        _wait_up(f"http://127.0.0.1:{port}/", proc)
        yield
    finally:
        proc.kill()
        proc.wait()


@contextlib.contextmanager
def gcs_server():
    """The Cloud Storage emulator with one bucket: yields the environment that reaches it."""
    port = _free_port()
    with _server(["-c", _GCS_SERVER, str(port), GCS_BUCKET], port):
        # gcsfs: the emulator, no credentials; its gRPC bucket-type probe has no emulator.
        yield {"STORAGE_EMULATOR_HOST": f"http://127.0.0.1:{port}", "FSSPEC_GCS_TOKEN": "anon",
               "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false"}


@contextlib.contextmanager
def s3_server(*, auth: bool = False):
    """moto's S3 server with one bucket: yields the environment that reaches it. With `auth`, it
    checks credentials (moto's IAM emulation) and the test credentials have no access."""
    port = _free_port()
    env = {"AWS_ENDPOINT_URL_S3": f"http://127.0.0.1:{port}", "AWS_ACCESS_KEY_ID": "testing",
           "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}
    server_env = {"INITIAL_NO_AUTH_ACTION_COUNT": "0"} if auth else {}
    with _server(["-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)], port, server_env):
        if not auth:
            urllib.request.urlopen(urllib.request.Request(
                f"http://127.0.0.1:{port}/{S3_BUCKET}", method="PUT"), timeout=10)
        yield env


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
