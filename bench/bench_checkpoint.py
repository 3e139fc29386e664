"""Checkpoint throughput against the disk, and how long the training loop is blocked by a save,
synchronous vs asynchronous.

    python bench/bench_checkpoint.py [--dim 1024] [--layers 8] [--steps 24] [--interval 8]
                                     [--folder /tmp/ttx-bench-ckpt] [--buckets]

A model of about 100M parameters (debug flavor widened to `--dim`) trains on one XLA CPU device
and saves every `--interval` steps (parameters + Adam state, float32: ~1.3 GB per checkpoint),
three times: without checkpoints, with synchronous saves, with asynchronous saves. The interval
is long enough here for an async write to finish before the next save, so later async saves
show the steady state (the log says when a save waited for the previous one). Every number
comes from train.py's own log lines ("written: X GB in Ys", "loop blocked Ys", "step_time",
"Resumed ... in Ys"); the disk's own sequential write speed (with fsync, as DCP writes) is
measured in the same run on the same folder.

`--buckets` also saves (synchronously) and resumes the same model in gs:// and s3:// buckets served
on loopback by the tests' servers (a Cloud Storage emulator, moto's S3 server: tests/object_storage.py).
That measures the client path (DCP's fsspec writer, gcsfs, s3fs) plus those in-memory Python
servers, and says nothing about Cloud Storage's or S3's real speed.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def disk_write_speed(folder: Path, size: int = 2 * 2**30, chunk: int = 64 * 2**20) -> float:
    """GB/s of a sequential write of `size` bytes followed by fsync."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "disk-speed.bin"
    data = os.urandom(chunk)
    start = time.perf_counter()
    with open(path, "wb") as fh:
        for _ in range(size // chunk):
            fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())
    seconds = time.perf_counter() - start
    path.unlink()
    return size / 1e9 / seconds


def train(args: list[str], overrides: dict, env: dict | None = None) -> str:
    code = (f"import sys, json; sys.path.insert(0, {str(REPO)!r}); import train; "
            f"from torchtitan_xla.config import parse_args; "
            f"train.main(parse_args(sys.argv[2:]), model_overrides=json.loads(sys.argv[1]))")
    env = dict(os.environ, PJRT_DEVICE="CPU", CPU_NUM_DEVICES="1", TF_CPP_MIN_LOG_LEVEL="2", **(env or {}))
    p = subprocess.run([sys.executable, "-c", code, json.dumps(overrides), *args],
                       capture_output=True, text=True, env=env)
    if p.returncode:
        raise RuntimeError(p.stderr[-3000:])
    return p.stderr


def floats(pattern: str, log: str) -> list[float]:
    return [float(x) for x in re.findall(pattern, log)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dim", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--interval", type=int, default=8)
    ap.add_argument("--folder", type=Path, default=Path("/tmp/ttx-bench-ckpt"))
    ap.add_argument("--buckets", action="store_true", help="also gs:// and s3:// on loopback servers")
    opts = ap.parse_args()
    shutil.rmtree(opts.folder, ignore_errors=True)
    disk = disk_write_speed(opts.folder)
    overrides = {"dim": opts.dim, "n_layers": opts.layers, "n_heads": 16}
    base = ["--job.config_file", str(REPO / "train_configs/debug_model.toml"), "--job.no-print_config",
            "--training.seq_len", "64", "--training.local_batch_size", "1", "--training.steps",
            str(opts.steps), "--metrics.log_freq", "1"]
    ckpt = ["--checkpoint.enable", "--checkpoint.interval", str(opts.interval),
            "--checkpoint.keep_latest_k", "2"]
    results = {}
    for mode in ("none", "disabled", "async"):
        folder = opts.folder / mode
        extra = [] if mode == "none" else [*ckpt, "--checkpoint.async_mode", mode]
        log = train(base + ["--job.dump_folder", str(folder), *extra], overrides)
        results[mode] = {
            # (seconds blocked, of which waiting for the previous save's write) per save
            "blocked": [(float(b), float(w or 0)) for b, w in
                        re.findall(r"loop blocked ([0-9.]+)s(?:, of which ([0-9.]+)s waiting)?", log)],
            "to_host": floats(r"copied to host memory in ([0-9.]+)s", log),
            "trial": floats(r"a trial snapshot fits \(([0-9.]+)s\)", log),
            "written_gb": floats(r"written: ([0-9.]+) GB", log),
            "write_gbps": floats(r"written: [0-9.]+ GB in [0-9.]+s \(([0-9.]+) GB/s\)", log),
            # Wall time of the loop after the first (compiling) step, saves included.
            "loop": sum(floats(r"step_time: ([0-9.]+)s", log)[1:]),
        }
    # Resume from the newest async checkpoint: the load throughput.
    folder = opts.folder / "async"
    last = opts.folder / "async" / "checkpoint" / f"step-{opts.steps}"
    last.rename(last.with_name(last.name + ".moved"))
    log = train(base + ["--job.dump_folder", str(folder), *ckpt, "--training.steps", str(opts.steps - 1)],
                overrides)
    load = statistics.median(floats(r"Resumed from .*\(([0-9.]+) GB/s\)", log))
    none, sync, asyn = results["none"], results["disabled"], results["async"]
    print(f"machine: {os.cpu_count()} cores; folder {opts.folder}; disk sequential write + fsync "
          f"{disk:.2f} GB/s (measured)")
    print(f"checkpoint: {statistics.mean(sync['written_gb']):.2f} GB (model dim {opts.dim}, "
          f"{opts.layers} blocks, parameters + Adam state, float32); {opts.steps} steps, a save every "
          f"{opts.interval}")
    save = statistics.median(sync["write_gbps"])
    print(f"save: {save:.2f} GB/s = {100 * save / disk:.0f}% of the disk's write speed")
    print(f"load: {load:.2f} GB/s (files likely still in the page cache)")
    ref = statistics.median(b for b, _ in sync["blocked"])
    print(f"loop blocked by each save: sync {[b for b, _ in sync['blocked']]}, async "
          f"{[b for b, _ in asyn['blocked']]}, of which waiting for the previous write "
          f"{[w for _, w in asyn['blocked']]}")
    print(f"async vs the median sync save ({ref:.2f}s): "
          + ", ".join(f"{100 * b / ref:.0f}%" for b, _ in asyn["blocked"])
          + "; without the waiting: " + ", ".join(f"{100 * (b - w) / ref:.0f}%" for b, w in asyn["blocked"]))
    print(f"async trial snapshot at start (before step 1, not in the loop): {asyn['trial']} s")
    print(f"async background copy to host memory: {asyn['to_host']} s")
    print(f"loop time of steps 2..{opts.steps}, saves included: no checkpoint {none['loop']:.1f}s, "
          f"sync {sync['loop']:.1f}s, async {asyn['loop']:.1f}s")
    if opts.buckets:
        bucket_throughput(base, ckpt, overrides, opts, local=(save, load))


def bucket_throughput(base, ckpt, overrides, opts, local: tuple[float, float]) -> None:
    """Save and load throughput to each loopback bucket, next to the local folder's."""
    sys.path.insert(0, str(REPO / "tests"))
    from object_storage import GCS_BUCKET, S3_BUCKET, gcs_server, s3_server

    print(f"local folder: save {local[0]:.2f} GB/s, load {local[1]:.2f} GB/s")
    for server, url in ((gcs_server, f"gs://{GCS_BUCKET}/bench"), (s3_server, f"s3://{S3_BUCKET}/bench")):
        with server() as env:
            run = [*base, "--job.dump_folder", str(opts.folder / "bucket"), *ckpt,
                   "--checkpoint.folder", url, "--checkpoint.async_mode", "disabled"]
            log = train([*run, "--training.steps", str(opts.interval)], overrides, env)
            save = statistics.median(floats(r"written: [0-9.]+ GB in [0-9.]+s \(([0-9.]+) GB/s\)", log))
            log = train([*run, "--training.steps", str(opts.interval + 1)], overrides, env)
            load = statistics.median(floats(r"Resumed from .*\(([0-9.]+) GB/s\)", log))
        print(f"{url.split(':')[0]}:// on loopback ({server.__name__}): save {save:.2f} GB/s "
              f"({100 * save / local[0]:.0f}% of local), load {load:.2f} GB/s "
              f"({100 * load / local[1]:.0f}% of local)")


if __name__ == "__main__":
    main()
