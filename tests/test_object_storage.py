"""Checkpoints and datasets in buckets (gs://, s3://), against real servers on loopback started
here (tests/object_storage.py): a Cloud Storage emulator through gcsfs, moto's S3 server through
s3fs. The runs are the checkpoint tests' short ones (checkpoint_helpers.py).
"""

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from checkpoint_helpers import PARAMETERS_IN_FLIGHT, SLOW_SAVE, TWO_BLOCKS, args, run
from helpers import REPO, free_port, tiny_args, train_process
from object_storage import (
    GCS_BUCKET,
    S3_BUCKET,
    environment,
    gcs_server,
    reads,
    requests,
    s3_server,
)

from torchtitan_xla import storage
from torchtitan_xla.checkpoint import COMMIT_FILE, committed_steps, read_model_state
from torchtitan_xla.errors import ConfigError


@pytest.fixture(scope="module")
def gcs():
    with gcs_server() as env:
        yield env


@pytest.fixture(scope="module")
def s3():
    with s3_server() as env:
        yield env


def _assert_read_once(read, step: str) -> None:
    """A resume from `step` read its one data file with one request, and DCP's metadata once for each
    time it is asked for (the host count, then the load). DCP's fsspec reader alone made 2,784 ranged
    requests of that file (gcsfs) and 8 (s3fs); docs/checkpoint.md."""
    assert {k: n for k, n in read.items() if k.endswith(".distcp")} == {f"{step}/__0_0.distcp": 1}, read
    assert read[f"{step}/.metadata"] == 2, read


def test_gcs_async_save_killed_midway_resumes_bit_exact_and_keeps_latest_k(straight, gcs, tmp_path):
    """Async saves to the emulated bucket; the step-6 save is killed (SIGKILL) after its data is
    uploaded and before its commit record; the same command resumes from step 3."""
    folder, losses, _ = straight
    url = f"gs://{GCS_BUCKET}/killed"
    same = ("--training.local_batch_size", "8", "--checkpoint.folder", url,
            "--checkpoint.async_mode", "async", "--checkpoint.keep_latest_k", "1")
    proc = train_process(args(tmp_path, *same), model_overrides=TWO_BLOCKS, prelude=SLOW_SAVE, env=gcs)
    for line in proc.stdout:  # the step-6 save is under way
        if line.startswith("SAVING"):
            break
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    with environment(gcs):
        assert committed_steps(url) == [3]  # keep_latest_k = 1 never deleted the only complete one
        assert storage.listdir(url) == ["step-3", "step-6"]
        half = storage.file_sizes(f"{url}/step-6")
        assert "__0_0.distcp" in half and COMMIT_FILE not in half  # written, never committed
    before = len(requests(gcs))
    resumed, log = run(tmp_path, *same, "--checkpoint.last_save_in_hf", env=gcs)
    assert f"Resumed from {url}/step-3 (step 3)" in log and "error" not in log.lower()
    assert resumed == {s: losses[s] for s in (4, 5, 6)}  # identical floats
    _assert_read_once(reads(gcs, before), "killed/step-3")
    with environment(gcs):
        # Step 3 gone (keep_latest_k), step 6 rewritten, and the HuggingFace export beside it.
        assert storage.listdir(url) == ["step-6", "step-6-hf"]
        weights, _ = read_model_state(f"{url}/step-6")
        exported = storage.read_bytes(f"{url}/step-6-hf/model.safetensors")
    assert exported == (folder / "checkpoint" / "step-6-hf" / "model.safetensors").read_bytes()
    local, _ = read_model_state(folder / "checkpoint" / "step-6")
    assert weights.keys() == local.keys() and all(torch.equal(weights[k], local[k]) for k in local)
    # python -m torchtitan_xla.eval (and .generate) find the newest step in the bucket, or take a
    # step's URL.
    from torchtitan_xla.config import parse_args
    from torchtitan_xla.inference import weights_folder

    def weights(*flags):
        cfg = parse_args(list(flags))
        return weights_folder(cfg.eval.checkpoint, cfg, "[eval] checkpoint")

    with environment(gcs):
        assert weights("--checkpoint.folder", url) == (f"{url}/step-6", False)
        assert weights("--eval.checkpoint", f"{url}/step-6") == (f"{url}/step-6", False)


def test_s3_resume_reshards_4_to_8_devices_past_a_step_without_its_record(s3, tmp_path):
    """Saved on 4 devices (fsdp=4), resumed on 8 (fsdp=4 x tp=2) with its parameters in flight
    (PARAMETERS_IN_FLIGHT), from the last step with a commit record."""
    url = f"s3://{S3_BUCKET}/reshard"
    losses, _ = run(tmp_path / "a", "--training.local_batch_size", "2", "--checkpoint.folder", url,
                    devices=4, env=s3)
    with environment(s3):
        assert committed_steps(url) == [3, 6]
        storage.remove(f"{url}/step-6/{COMMIT_FILE}")  # as if killed before its record
        assert committed_steps(url) == [3]
    before = len(requests(s3))
    resumed, log = run(tmp_path / "b", "--training.local_batch_size", "2", "--checkpoint.folder", url,
                       "--parallelism.tensor_parallel_degree", "2", devices=8, env=s3,
                       prelude=PARAMETERS_IN_FLIGHT)
    assert f"Resumed from {url}/step-3 (step 3)" in log
    _assert_read_once(reads(s3, before), "reshard/step-3")
    # Same state on fsdp=4 x tp=2: only the reduction order differs (as on a local folder).
    for step in (4, 5, 6):
        assert resumed[step] == pytest.approx(losses[step], rel=2e-6)
    with environment(s3):
        assert committed_steps(url) == [3, 6]


def test_the_goodput_ledger_in_a_bucket_is_rewritten_whole_and_read_back(gcs):
    """A dump folder in a bucket: an object store cannot append, so an attempt's object is
    rewritten whole at each save, at the end, and at most every 30 s between; the report reads it
    back as it reads a local folder."""
    from torchtitan_xla.goodput import Ledger, goodput, read_attempts

    url = f"gs://{GCS_BUCKET}/ledger"
    with environment(gcs):
        t = time.time()
        ledger = Ledger(t - 10)
        ledger.record("devices", t=t - 8)
        ledger.open(url)
        ledger.record("ready", t=t - 5, step=1)
        ledger.record("step", t=t - 3, step=1, start=t - 5, end=t - 3, data=0.5, compile=1.0)
        ledger.record("save", t=t - 2, step=1, seconds=1.0)
        assert [e["event"] for e in read_attempts(url)[0]] == ["start", "devices", "ready", "step", "save"]
        ledger.record("step", t=t - 1, step=2, start=t - 2, end=t - 1, data=0.0, compile=0.0)
        assert len(read_attempts(url)[0]) == 5  # within 30 s of the last write: not yet
        ledger.close(2)
        report = goodput(url)
    assert report.attempts == 1 and report.last_step == 2 and report.restarts == []
    assert report.productive == pytest.approx(0.5 + 1.0) and report.badput["compile"] == pytest.approx(1.0)
    assert report.badput["initialization"] == pytest.approx(2.0)
    assert report.productive + sum(report.badput.values()) == pytest.approx(report.total)


def test_a_bucket_checkpoint_is_read_in_merged_ranges_one_request_each(gcs, monkeypatch):
    """The reader's ranges made small (a range holds two items): every tensor comes back exact,
    with one request per range; a load of two far-apart tensors reads only their two ranges."""
    import torch.distributed.checkpoint as dcp

    from torchtitan_xla.checkpoint import commit

    tensors = {f"w{i}": torch.randn(64, 64) for i in range(12)}
    url = f"gs://{GCS_BUCKET}/ranges/step-0"
    monkeypatch.setattr(commit, "_MAX_BLOCK", 40_000)
    monkeypatch.setattr(commit, "_MAX_GAP", 0)
    commit.quiet_dcp()
    with environment(gcs):
        dcp.save({"model": tensors}, storage_writer=commit.writer(url), no_dist=True)
        lengths = [s.length for s in commit.reader(url).read_metadata().storage_data.values()]
        assert len(lengths) == 12 and 2 * max(lengths) <= 40_000 < 3 * min(lengths)  # 2 a range
        for keys, ranges in ((sorted(tensors), 6), (["w0", "w11"], 2)):
            before = len(requests(gcs))
            out = {"model": {k: torch.empty(64, 64) for k in keys}}
            dcp.load(out, storage_reader=commit.reader(url), no_dist=True)
            assert all(torch.equal(out["model"][k], tensors[k]) for k in keys)
            assert reads(gcs, before)["ranges/step-0/__0_0.distcp"] == ranges


def _rows(ds) -> list[str]:
    return [row["text"] for row in ds]


def test_datasets_read_from_buckets_equal_the_local_files(gcs, s3, tmp_path):
    from torchtitan_xla.datasets.sources import load_documents

    texts = [f"document {i}: " + "word " * i for i in range(1, 40)]
    (tmp_path / "json").mkdir()
    (tmp_path / "json" / "a.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts[:20]))
    (tmp_path / "json" / "b.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts[20:]))
    (tmp_path / "parquet").mkdir()
    pq.write_table(pa.table({"text": texts, "n": list(range(len(texts)))}), tmp_path / "parquet" / "p.parquet")
    (tmp_path / "text").mkdir()
    (tmp_path / "text" / "t.txt").write_text("\n\n".join(texts))
    for env, bucket in ((gcs, f"gs://{GCS_BUCKET}"), (s3, f"s3://{S3_BUCKET}")):
        with environment(env):
            for kind in ("json", "parquet", "text"):
                fs, root = storage.filesystem(f"{bucket}/data/{kind}")
                fs.put(str(tmp_path / kind) + "/", root, recursive=True)
                local = _rows(load_documents(kind, str(tmp_path / kind)))
                assert _rows(load_documents(kind, f"{bucket}/data/{kind}")) == local == texts, (bucket, kind)
            # A glob and a single file too; a path that does not exist is one line.
            assert _rows(load_documents("json", f"{bucket}/data/json/*.jsonl")) == texts
            assert _rows(load_documents("json", f"{bucket}/data/json/b.jsonl")) == texts[20:]
            with pytest.raises(Exception, match=rf"^\[training\] dataset_path: not found: {bucket}/nothing$"):
                load_documents("json", f"{bucket}/nothing")
            # A bucket that does not exist: the library's error as one line (storage.describe).
            missing = f"{bucket.split('://')[0]}://no-such-bucket-ttx/data/*.jsonl"
            with pytest.raises(ConfigError) as e:
                load_documents("json", missing)
            assert str(e.value) == {  # gcsfs raises on the bucket, s3fs lists nothing
                "gs": f"[training] dataset_path: {missing}: not found (b/no-such-bucket-ttx/o)",
                "s3": f"[training] dataset_path: no .json / .jsonl / .json.gz / .jsonl.gz files in {missing}",
            }[bucket[:2]]


def _train_py(folder, env, *extra) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(REPO / "train.py"), *tiny_args(folder, *extra)],
                          capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PJRT_DEVICE": "CPU", **env})


def test_a_bucket_that_cannot_be_written_is_one_line_exit_2_at_start(gcs, tmp_path):
    p = _train_py(tmp_path, gcs, "--checkpoint.enable", "--checkpoint.folder", "gs://no-such-bucket/run")
    assert p.returncode == 2 and "Traceback" not in p.stderr
    assert p.stderr.strip().splitlines()[-1] == ("error: command line: --checkpoint.folder: cannot "
                                                 "write to gs://no-such-bucket/run: no such bucket")
    assert "step:" not in p.stderr  # before any training
    with s3_server(auth=True) as denied:
        p = _train_py(tmp_path, denied, "--job.dump_folder", f"s3://{S3_BUCKET}/run")
    assert p.returncode == 2 and "Traceback" not in p.stderr
    assert p.stderr.strip().splitlines()[-1] == (
        f"error: command line: --job.dump_folder: cannot write to s3://{S3_BUCKET}/run: permission "
        "denied (The AWS Access Key Id you provided does not exist in our records.)")


def _offline(home, closed: int, silent: int) -> dict[str, str]:
    """This environment without credentials or a network: every endpoint the libraries would reach
    (the store, Google's metadata server, AWS's instance metadata) is a loopback port, `closed`
    (nothing listens) or `silent` (accepts connections, never answers). Nothing leaves the host."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "FSSPEC_", "GOOGLE_", "GCE_"))}
    return {**env, "PJRT_DEVICE": "CPU", "HOME": str(home), "CLOUDSDK_CONFIG": str(home / "gcloud"),
            "STORAGE_EMULATOR_HOST": f"http://127.0.0.1:{closed}",
            "GCE_METADATA_HOST": f"127.0.0.1:{closed}", "GCE_METADATA_IP": f"127.0.0.1:{closed}",
            "AWS_ENDPOINT_URL": f"http://127.0.0.1:{silent}", "AWS_ACCESS_KEY_ID": "testing",
            "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1",
            "AWS_EC2_METADATA_SERVICE_ENDPOINT": f"http://127.0.0.1:{closed}",
            "AWS_CONFIG_FILE": str(home / "aws-config"), "AWS_SHARED_CREDENTIALS_FILE": str(home / "aws-creds")}


CHECK_BOUND = 20  # seconds: storage.CHECK_SECONDS, as docs/checkpoint.md states it


def _timed_train(folder, env, *flags) -> tuple[int, list[str], float, float]:
    """train.py with `flags`, killed after 120 s: (exit code, stderr lines, seconds from its last
    log line (the one before the bucket check) to its last line (the error), seconds from that line
    to the process's end)."""
    p = subprocess.Popen([sys.executable, str(REPO / "train.py"), *tiny_args(folder, *flags)],
                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)
    killer = threading.Timer(120, p.kill)
    killer.start()
    lines, logged = [], time.perf_counter()
    for line in p.stderr:
        lines.append(line.rstrip("\n"))
        last = time.perf_counter()
        if line.startswith("[titan-xla "):
            logged = last
    p.wait()
    killer.cancel()
    return p.returncode, lines, last - logged, time.perf_counter() - last


# Seconds a run may take beyond the bound: importing the file system's package and starting the
# check's child before it, two runs sharing 2 cores with the other test worker (CI once took 6.7 s
# from the log line to the exit). Without the bound gcsfs alone retries for about 35 s.
BEFORE_CHECK_S, AFTER_ERROR_S = 10, 10


def test_an_unreachable_bucket_is_one_line_exit_2_within_the_bound(tmp_path):
    """No credentials and no network: gs:// (gcsfs retries, google-auth's metadata server) and an
    s3:// endpoint that never answers. One line, nothing else on stderr, within the bound."""
    from concurrent.futures import ThreadPoolExecutor

    (tmp_path / "home").mkdir()
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(64)  # never accepted: connections open, requests are never answered
        env = _offline(tmp_path / "home", free_port(), silent.getsockname()[1])
        with ThreadPoolExecutor(2) as pool:
            runs = list(pool.map(lambda url: _timed_train(tmp_path / url[:2], env, "--checkpoint.enable",
                                                          "--checkpoint.folder", url),
                                 ["gs://bucket/run", "s3://bucket/run"]))
    for url, (code, lines, to_error, to_exit) in zip(["gs://bucket/run", "s3://bucket/run"], runs):
        # Only the project's own "Starting job" log line before the one error line (no warnings,
        # no tracebacks), and the check gave up within its bound (plus the process's exit).
        assert code == 2 and len(lines) == 2 and "] Starting job: " in lines[0], (url, lines)
        assert lines[1].startswith(f"error: command line: --checkpoint.folder: cannot write to {url}: "
                                   f"gave up after {CHECK_BOUND} s"), (url, lines)
        assert to_error < CHECK_BOUND + BEFORE_CHECK_S and to_exit < AFTER_ERROR_S, (url, to_error, to_exit)
    # gs://: the reason it kept retrying is in the line.
    assert "(last error: _request retrying after exception: Cannot connect to host 127.0.0.1" in runs[0][1][1]
    assert storage.CHECK_SECONDS == CHECK_BOUND


def test_reading_an_unreachable_bucket_is_one_line_exit_2_within_the_bound(tmp_path):
    """The first read of a bucket (initial weights, a dataset) is checked like a write: one line
    naming the flag, the libraries' retries and warnings not shown, within the bound."""
    from concurrent.futures import ThreadPoolExecutor

    (tmp_path / "home").mkdir()
    cases = [("--checkpoint.initial_load_path", "gs://bucket/ck/step-3", []),
             ("--training.dataset_path", "s3://bucket/data/*.jsonl", ["--training.dataset", "json"])]
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(64)
        env = _offline(tmp_path / "home", free_port(), silent.getsockname()[1])
        env.pop("XLA_USE_SPMD", None)  # this test process's (conftest); torch_xla warns about it
        with ThreadPoolExecutor(2) as pool:
            runs = list(pool.map(lambda c: _timed_train(tmp_path / c[1][:2], env, c[0], c[1], *c[2]), cases))
    for (flag, url, _), (code, lines, to_error, to_exit) in zip(cases, runs):
        assert code == 2 and all(line.startswith("[titan-xla ") for line in lines[:-1]), (url, [ln for ln in lines if not ln.startswith("[titan-xla ")])
        assert lines[-1].startswith(f"error: command line: {flag}: {url}: cannot reach the storage: "
                                    f"gave up after {CHECK_BOUND} s"), (url, lines)
        # The bound, plus what runs between the last log line and the read (the model's init
        # before initial weights load: a few more seconds).
        assert to_error < CHECK_BOUND + BEFORE_CHECK_S + 5 and to_exit < AFTER_ERROR_S, (url, to_error, to_exit)
