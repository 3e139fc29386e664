"""Requests one resume makes to a bucket, counted by the server: the tests' Cloud Storage emulator
(through gcsfs) and moto's S3 server (through s3fs) on loopback (tests/object_storage.py).

    python bench/bench_resume_requests.py [--layers 8] [--seq-len 64] [--disk] [--list]

The debug model (debug_model.toml, `--layers` blocks) trains 2 steps on one XLA CPU device and
saves step 2 (model, Adam state, schedule, loader, RNG); then the same command runs again: it
resumes from step 2 and has no step left to train, so every request of that second run is the
resume's (plus the writable check at start: one upload and one delete). Printed per store: the
requests of the resume by kind, the data files' size and the resume's time as train.py logs it.
`--disk`: the emulator keeps its objects in files (in memory otherwise), as a user's emulator may.
The times are those of Python servers on loopback: they say nothing about a real bucket.
"""

from __future__ import annotations

import argparse
import collections
import re
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO), str(REPO / "tests")]

from helpers import tiny_args, train_run  # noqa: E402
from object_storage import GCS_BUCKET, S3_BUCKET, gcs_server, requests, s3_server  # noqa: E402


def kind(method: str, path: str) -> str:
    if method in ("GET", "HEAD") and ".distcp" in path:
        if "alt=media" in path or method == "GET" and "/storage/v1/" not in path:
            return f"{method} data file (bytes)"
        return f"{method} data file (info)"
    if method in ("GET", "HEAD") and ".metadata" in path:
        return f"{method} .metadata"
    return f"{method} other"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--list", action="store_true", help="print every request of the resume")
    ap.add_argument("--disk", action="store_true", help="the Cloud Storage emulator keeps objects on disk")
    opts = ap.parse_args()
    overrides = {"n_layers": opts.layers}
    for server, url in ((gcs_server, f"gs://{GCS_BUCKET}/bench"), (s3_server, f"s3://{S3_BUCKET}/bench")):
        with tempfile.TemporaryDirectory() as tmp, server(
                *([f"{tmp}/objects"] if opts.disk and server is gcs_server else [])) as env:
            args = tiny_args(Path(tmp), "--training.steps", "2", "--training.seq_len", str(opts.seq_len),
                             "--checkpoint.enable", "--checkpoint.interval", "2",
                             "--checkpoint.folder", url)
            train_run(args, model_overrides=overrides, env=env)
            before = len(requests(env))
            _, log = train_run(args, model_overrides=overrides, env=env)
            made = requests(env)[before:]
        resumed = re.search(r"Resumed from \S+ \(step 2\): ([0-9.]+) GB in ([0-9.]+)s", log)
        assert resumed, log[-3000:]
        counts = collections.Counter(kind(m, p) for m, p, _ in made)
        print(f"{url.split(':')[0]}:// ({server.__name__}): {len(made)} requests for one resume of "
              f"{float(resumed[1]) * 1e3:.1f} MB in {resumed[2]}s:")
        for name, n in sorted(counts.items()):
            print(f"  {n:6d}  {name}")
        if opts.list:
            print("".join(f"    {m} {p} {status}\n" for m, p, status in made), end="")


if __name__ == "__main__":
    main()
