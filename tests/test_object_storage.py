"""Checkpoints and datasets in buckets (gs://, s3://), against real servers on loopback started
here (tests/object_storage.py): a Cloud Storage emulator through gcsfs, moto's S3 server through
s3fs. The runs are the checkpoint tests' short ones (checkpoint_helpers.py).
"""

import json
import os
import signal
import subprocess
import sys

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from checkpoint_helpers import SLOW_SAVE, TWO_BLOCKS, args, run
from helpers import REPO, tiny_args, train_process
from object_storage import GCS_BUCKET, S3_BUCKET, environment, gcs_server, s3_server

from torchtitan_xla import storage
from torchtitan_xla.checkpoint import COMMIT_FILE, committed_steps, read_model_state


@pytest.fixture(scope="module")
def gcs():
    with gcs_server() as env:
        yield env


@pytest.fixture(scope="module")
def s3():
    with s3_server() as env:
        yield env


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
    resumed, log = run(tmp_path, *same, "--checkpoint.last_save_in_hf", env=gcs)
    assert f"Resumed from {url}/step-3 (step 3)" in log and "error" not in log.lower()
    assert resumed == {s: losses[s] for s in (4, 5, 6)}  # identical floats
    with environment(gcs):
        # Step 3 gone (keep_latest_k), step 6 rewritten, and the HuggingFace export beside it.
        assert storage.listdir(url) == ["step-6", "step-6-hf"]
        weights, _ = read_model_state(f"{url}/step-6")
        exported = storage.read_bytes(f"{url}/step-6-hf/model.safetensors")
    assert exported == (folder / "checkpoint" / "step-6-hf" / "model.safetensors").read_bytes()
    local, _ = read_model_state(folder / "checkpoint" / "step-6")
    assert weights.keys() == local.keys() and all(torch.equal(weights[k], local[k]) for k in local)
    # python -m torchtitan_xla.eval finds the newest step in the bucket, or takes a step's URL.
    from torchtitan_xla.config import parse_args
    from torchtitan_xla.eval.__main__ import _weights

    with environment(gcs):
        assert _weights(parse_args(["--checkpoint.folder", url])) == (f"{url}/step-6", False)
        assert _weights(parse_args(["--eval.checkpoint", f"{url}/step-6"])) == (f"{url}/step-6", False)


def test_s3_resume_reshards_4_to_8_devices_past_a_step_without_its_record(s3, tmp_path):
    url = f"s3://{S3_BUCKET}/reshard"
    losses, _ = run(tmp_path / "a", "--training.local_batch_size", "2", "--checkpoint.folder", url,
                    devices=4, env=s3)
    with environment(s3):
        assert committed_steps(url) == [3, 6]
        storage.remove(f"{url}/step-6/{COMMIT_FILE}")  # as if killed before its record
        assert committed_steps(url) == [3]
    resumed, log = run(tmp_path / "b", "--training.local_batch_size", "2", "--checkpoint.folder", url,
                       "--parallelism.tensor_parallel_degree", "2", devices=8, env=s3)
    assert f"Resumed from {url}/step-3 (step 3)" in log
    # Same state on fsdp=4 x tp=2: only the reduction order differs (as on a local folder).
    for step in (4, 5, 6):
        assert resumed[step] == pytest.approx(losses[step], rel=2e-6)
    with environment(s3):
        assert committed_steps(url) == [3, 6]


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


def _train_py(folder, env, *extra) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(REPO / "train.py"), *tiny_args(folder, *extra)],
                          capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PJRT_DEVICE": "CPU", **env})


def test_a_bucket_that_cannot_be_written_is_one_line_exit_2_at_start(gcs, tmp_path):
    p = _train_py(tmp_path, gcs, "--checkpoint.enable", "--checkpoint.folder", "gs://no-such-bucket/run")
    assert p.returncode == 2 and "Traceback" not in p.stderr
    assert p.stderr.strip().splitlines()[-1] == (
        "error: [checkpoint] folder: cannot write to gs://no-such-bucket/run: no such bucket")
    assert "step:" not in p.stderr  # before any training
    with s3_server(auth=True) as denied:
        p = _train_py(tmp_path, denied, "--job.dump_folder", f"s3://{S3_BUCKET}/run")
    assert p.returncode == 2 and "Traceback" not in p.stderr
    assert p.stderr.strip().splitlines()[-1] == (
        f"error: [job] dump_folder: cannot write to s3://{S3_BUCKET}/run: permission denied "
        "(The AWS Access Key Id you provided does not exist in our records.)")
