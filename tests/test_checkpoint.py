"""Checkpoints: bit-exact resume in a new process, resharding, a save killed midway, preemption,
damaged checkpoints and seed checkpoints (HuggingFace interop: test_hf_export.py).

Every run is a fresh process (tests/checkpoint_helpers.py): the debug model cut to 2 blocks, 6 steps
with a checkpoint every 3.
"""

import json
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from checkpoint_helpers import (
    CKPT,
    KILLED_AT_SAVE,
    SLOW_SAVE,
    TWO_BLOCKS,
    all_tensors,
    args,
    run,
    train_py_two_blocks,
)
from helpers import REPO, event_scalars, losses_of, tiny_args, train_many, train_process

from torchtitan_xla.checkpoint import COMMIT_FILE, committed_steps, read_model_state
from torchtitan_xla.config import ConfigError
from torchtitan_xla.goodput import goodput, read_attempts


def _copy_up_to(src: Path, dst: Path, step: int) -> Path:
    """A copy of a run's folder that has only its checkpoints up to `step`: a run stopped there."""
    shutil.copytree(src, dst)
    for s in committed_steps(dst / "checkpoint"):
        if s > step:
            shutil.rmtree(dst / "checkpoint" / f"step-{s}")
    return dst


# A warning as Python prints it, from torch.distributed.checkpoint: none of those it gives at a save
# or a load here applies (commit.quiet_dcp), and a user reads them as errors.
DCP_WARNING = re.compile(r"torch/distributed/checkpoint/\S+\.py:\d+: \w*Warning: .*")


def test_resume_in_a_new_process_is_bit_exact_on_one_device(straight, resumed):
    folder, losses, saved_log = straight
    assert committed_steps(folder / "checkpoint") == [3, 6]
    run = resumed["from_step_3"]  # the first run of its process
    log = "\n".join(run["log"])
    assert "Resumed from" in log and "step-3" in log
    assert sorted(run["losses"]) == [4, 5, 6]
    assert run["losses"] == {s: losses[s] for s in (4, 5, 6)}  # identical floats
    # Saves (steps 3 and 6) and a load (then the step-6 save again) without DCP's warnings.
    assert DCP_WARNING.findall(saved_log) == [] and DCP_WARNING.findall(log) == []


# The step-3 async write starts only once the loop has finished step 4, whose update donated the
# step-3 buffers of the parameters and of Adam's state (and incremented Adam's host-side `step`).
# Also reports the sharding of every XLA tensor in the device snapshot next to its original's.
DELAYED_ASYNC_WRITE = """
import json, sys, time
import torch, torch_xla
from torch.utils._pytree import tree_flatten
import torchtitan_xla.checkpoint as ckpt
import torchtitan_xla.runtime.xla.checkpointing as checkpointing
_write_snapshot, _device_snapshot = ckpt.CheckpointManager._write_snapshot, checkpointing.device_snapshot
def write_snapshot(self, step, snapshot, model_only):
    while step == 3 and self.train_state.step < 4:
        time.sleep(0.05)
    print(f"WRITE step-{step} after step {self.train_state.step}", file=sys.stderr, flush=True)
    _write_snapshot(self, step, snapshot, model_only)
def device_snapshot(states):
    copy = _device_snapshot(states)
    spec = torch_xla._XLAC._get_xla_sharding_spec
    pairs = [(spec(a), spec(b)) for a, b in zip(tree_flatten(states)[0], tree_flatten(copy)[0])
             if isinstance(a, torch.Tensor) and a.device.type == "xla"]
    print("SNAPSHOT SHARDINGS " + json.dumps(pairs), file=sys.stderr, flush=True)
    return copy
ckpt.CheckpointManager._write_snapshot, checkpointing.device_snapshot = write_snapshot, device_snapshot
"""


def test_async_save_on_fsdp4_tp2_holds_its_step_and_resumes_bit_exact(tmp_path):
    mesh = ["--training.local_batch_size", "2", "--parallelism.tensor_parallel_degree", "2"]
    losses, log = run(tmp_path / "a", *mesh, "--checkpoint.async_mode", "async", devices=8,
                      prelude=DELAYED_ASYNC_WRITE)
    assert "Checkpoint step-3: staged" in log and "loop blocked" in log
    # A trial snapshot at start (before step 1), so a device too small for async saves fails
    # there; then one per save (3 and 6).
    lines = log.splitlines()
    snapshots = [i for i, ln in enumerate(lines) if ln.startswith("SNAPSHOT SHARDINGS ")]
    first_step = next(i for i, ln in enumerate(lines) if re.search(r"step:\s+1 ", ln))
    assert len(snapshots) == 3 and snapshots[0] < first_step < snapshots[1]
    assert "a trial snapshot fits" in log
    assert int(re.search(r"WRITE step-3 after step (\d+)", log).group(1)) >= 4
    # The snapshot is sharded like the state (each host writes only its own shards).
    shardings = json.loads(next(ln for ln in log.splitlines() if ln.startswith("SNAPSHOT SHARDINGS "))
                           .split(" ", 2)[2])
    assert all(original == copy for original, copy in shardings)
    assert sum("devices=" in original for original, _ in shardings) >= 3 * 2 * 9  # weights + Adam
    # The step-3 write ran after step 4 and still holds exactly the step-3 state: every tensor
    # (weights, Adam's moments and step counts, RNG states) equals a synchronous save's.
    run(tmp_path / "s", *mesh, devices=8)
    async_state = all_tensors(tmp_path / "a" / "checkpoint" / "step-3")
    sync_state = all_tensors(tmp_path / "s" / "checkpoint" / "step-3")
    assert async_state.keys() == sync_state.keys()
    assert sum(k.endswith(".step") for k in async_state) == 2 + 2 * 9 + 1
    assert all(torch.equal(async_state[k], sync_state[k]) for k in sync_state), \
        [k for k in sync_state if not torch.equal(async_state[k], sync_state[k])]
    # Every parameter is in the checkpoint, also the norms, which are replicated over tp (torch_xla's
    # planner alone drops such tensors: see runtime/checkpointing.save_planner).
    state, _ = read_model_state(tmp_path / "a" / "checkpoint" / "step-3")
    assert len(state) == 2 + 2 * 9 + 1 and "layers.1.ffn_norm.weight" in state
    resumed_folder = _copy_up_to(tmp_path / "a", tmp_path / "b", 3)
    resumed, resumed_log = run(resumed_folder, *mesh, "--checkpoint.async_mode", "async", devices=8)
    assert resumed == {s: losses[s] for s in (4, 5, 6)}
    # Async saves write in a thread: DCP's warnings are ignored there too.
    assert DCP_WARNING.findall(log) == [] and DCP_WARNING.findall(resumed_log) == []


@pytest.mark.parametrize("device_error", [
    "Out of memory allocating 2147483648 bytes.",  # the XLA CPU client
    "RESOURCE_EXHAUSTED: Error allocating device buffer: Attempting to allocate 2.00G.",  # TPU
])
def test_async_mode_without_memory_for_the_snapshot_is_one_clear_line(monkeypatch, device_error):
    # The out-of-memory itself cannot be provoked on the CPU backend without gigabytes of state;
    # the device's error is injected where the trial snapshot would raise it.
    import torchtitan_xla.checkpoint as ckpt
    import torchtitan_xla.runtime.xla.checkpointing as checkpointing

    def no_memory(states):
        raise RuntimeError(device_error)

    monkeypatch.setattr(checkpointing, "device_snapshot", no_memory)
    manager = object.__new__(ckpt.CheckpointManager)  # only the trial snapshot, no model
    manager._states = lambda model_only: {}
    with pytest.raises(ConfigError) as e:
        manager._rehearse_snapshot()
    assert str(e.value) == (
        '[checkpoint] async_mode = "async" needs device memory for a second copy of the state, and '
        f'a trial copy did not fit; use async_mode = "disabled" (device said: {device_error})')
    # Any other failure is not a memory problem and is not dressed up as one.
    def other_failure(states):
        raise RuntimeError("Check failed: tensor_data")

    monkeypatch.setattr(checkpointing, "device_snapshot", other_failure)
    with pytest.raises(RuntimeError, match="^Check failed: tensor_data$"):
        manager._rehearse_snapshot()


def test_sigkill_during_a_save_keeps_the_previous_checkpoint(straight, tmp_path):
    _, losses, _ = straight
    folder = tmp_path / "k"
    proc = train_process(args(folder, "--training.local_batch_size", "8", "--checkpoint.keep_latest_k", "1"),
                         model_overrides=TWO_BLOCKS, prelude=SLOW_SAVE)
    for line in proc.stdout:  # wait until the step-6 save is under way
        if line.startswith("SAVING"):
            break
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    ckpt = folder / "checkpoint"
    assert committed_steps(ckpt) == [3]  # keep_latest_k=1 never deleted the only complete one
    # The half-written step is there without its commit record: absent for every reader.
    assert (ckpt / "step-6").is_dir() and not (ckpt / "step-6" / COMMIT_FILE).exists()
    resumed, log = run(folder, "--training.local_batch_size", "8", "--checkpoint.keep_latest_k", "1")
    assert "Resumed from" in log and "step-3" in log and "error" not in log.lower()
    assert resumed == {s: losses[s] for s in (4, 5, 6)}
    assert committed_steps(ckpt) == [6] and sorted(p.name for p in ckpt.iterdir()) == ["step-6"]


def _train_py(folder: Path, *extra: str, file_size_limit: int | None = None) -> subprocess.CompletedProcess:
    """train.py's command line with a checkpoint every 3 steps; with `file_size_limit`, no file it
    writes may grow past that many bytes (RLIMIT_FSIZE: a full disk, reproducibly; Python ignores
    SIGXFSZ, so the write fails with EFBIG)."""
    import resource

    def limit():
        resource.setrlimit(resource.RLIMIT_FSIZE, (file_size_limit, file_size_limit))

    return train_py_two_blocks(tiny_args(folder, *CKPT, *extra), preexec_fn=limit if file_size_limit else None)


def test_a_failed_write_is_one_line_exit_1_and_keeps_the_previous_checkpoint(tmp_path):
    folder = tmp_path / "w"
    assert _train_py(folder, "--training.steps", "3").returncode == 0
    step3 = folder / "checkpoint" / "step-3"
    before = {f.name: f.read_bytes() for f in step3.iterdir()}
    # The logs fit in 1 MB; the step-6 checkpoint (~34 MB) does not. In both modes the same line:
    # async mode reports the background write's failure when the loop next waits for it.
    for mode in ("disabled", "async"):
        p = _train_py(folder, "--training.steps", "6", "--checkpoint.async_mode", mode, file_size_limit=2**20)
        assert p.returncode == 1, p.stderr[-2000:]
        errors = [ln for ln in p.stderr.splitlines() if ln.startswith("error:")]
        assert errors == [f"error: checkpoint step-6 could not be written in {folder / 'checkpoint'}: "
                          f"OSError: [Errno 27] File too large; step-3 is the newest checkpoint"], mode
        assert "Traceback" not in p.stderr and "Resumed from" in p.stderr
        assert committed_steps(folder / "checkpoint") == [3]
        assert not (folder / "checkpoint" / "step-6").exists()  # its space is given back
        assert {f.name: f.read_bytes() for f in step3.iterdir()} == before


def test_sigterm_saves_the_current_step_and_exits_0(straight, tmp_path):
    _, losses, _ = straight
    folder = tmp_path / "t"
    proc = train_process(tiny_args(folder, "--training.steps", "40", *CKPT, "--training.local_batch_size", "8"),
                         model_overrides=TWO_BLOCKS)
    for line in proc.stderr:
        if "step:     2" in line:
            proc.send_signal(signal.SIGTERM)
            break
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-2000:]
    assert "Preempted: stopped after step" in err
    stopped = max(losses_of(out))
    assert 2 <= stopped < 40
    assert committed_steps(folder / "checkpoint")[-1] == stopped  # saved at the interrupted step
    more, log = run(folder, "--training.local_batch_size", "8", "--training.steps", str(stopped + 2))
    assert min(more) == stopped + 1 and f"step-{stopped}" in log
    # Goodput: a preempted attempt loses nothing; the second resumed where it stopped.
    report = goodput(str(folder))
    assert report.restarts == [(1, stopped, stopped)] and report.wasted_steps == 0


def _step_work(events: list[dict], steps) -> float:
    """The ledger's training time of these steps: each one's span less its data wait and compiles."""
    return sum(e["end"] - e["start"] - e["data"] - e["compile"] for e in events
               if e["event"] == "step" and e["step"] in steps)


def test_goodput_counts_the_steps_each_kill_wasted_over_three_attempts(tmp_path):
    """9 steps saved every 3: killed (SIGKILL) while saving step 6, so steps 4-6 are lost and the
    second attempt resumes after step 3; killed again while saving step 9 (7-9 lost, resumed
    after 6); the third finishes. `python -m torchtitan_xla.goodput` counts the 6 wasted steps, the
    kept steps' time as productive, and accounts for all of the time; TensorBoard gets the same."""
    folder = tmp_path / "g"
    flags = args(folder, "--training.local_batch_size", "8", "--training.steps", "9", "--metrics.enable_tensorboard")
    for kill_at in (6, 9):
        proc = train_process(flags, model_overrides=TWO_BLOCKS, prelude=KILLED_AT_SAVE,
                             env={"KILL_AT_SAVE": str(kill_at)})
        _, err = proc.communicate(timeout=600)
        assert proc.returncode == -signal.SIGKILL, err[-2000:]
    _, log = run(folder, "--training.local_batch_size", "8", "--training.steps", "9", "--metrics.enable_tensorboard")
    assert "Resumed from" in log and "step-6" in log
    p = subprocess.run([sys.executable, "-m", "torchtitan_xla.goodput", str(folder), "--json"], cwd=REPO,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    report = json.loads(p.stdout)
    assert report["attempts"] == 3 and report["last_step"] == 9
    assert report["restarts"] == [[1, 6, 3], [2, 9, 6]] and report["wasted_steps"] == 6
    first, second, third = read_attempts(str(folder))
    kept = _step_work(first, range(1, 4)) + _step_work(second, range(4, 7)) + _step_work(third, range(7, 10))
    wasted = _step_work(first, range(4, 7)) + _step_work(second, range(7, 10))
    assert report["productive"] == pytest.approx(kept, rel=1e-9)
    assert report["badput"]["wasted progress"] == pytest.approx(wasted, rel=1e-9)
    assert report["productive"] + sum(report["badput"].values()) == pytest.approx(report["total"], abs=1e-6)
    assert all(report["badput"][k] > 0 for k in ("initialization", "checkpoint restore", "compile",
                                                 "checkpoint save", "between attempts"))
    # Each attempt's TensorBoard run ends with the goodput so far; the last one's is the report's,
    # but for the few seconds between that write and the run's end.
    scalars = event_scalars(sorted((folder / "tb").iterdir())[-1])
    assert scalars["goodput/wasted_steps"][-1] == (9, 6)
    assert scalars["goodput/goodput(%)"][-1][1] == pytest.approx(100 * report["goodput"], abs=2)


def test_a_ledger_that_cannot_be_written_stops_recording_not_training(tmp_path):
    """A full disk (or a lost bucket) under the ledger: one warning, no more events, no error."""
    import logging
    import time

    from helpers import capture_logs

    from torchtitan_xla.goodput import Ledger

    class FullDisk:
        def write(self, text):
            raise OSError(28, "No space left on device")

    ledger = Ledger(time.time())
    ledger.open(str(tmp_path))
    ledger._file = FullDisk()
    with capture_logs() as log:
        ledger.record("ready", step=1)
        ledger.record("step", step=1, start=0.0, end=1.0, data=0.0, compile=0.0)
    [warning] = log.messages(logging.WARNING)
    assert warning == (f"goodput ledger {ledger.path}: [Errno 28] No space left on device; no more "
                       f"events are recorded")
    assert not ledger.writer and [e["event"] for e in read_attempts(str(tmp_path))[0]] == ["start"]


def test_a_run_without_restarts_wastes_nothing_and_a_cut_ledger_line_is_skipped(straight, tmp_path):
    folder, _, _ = straight
    report = goodput(str(folder))
    assert report.attempts == 1 and report.restarts == [] and report.wasted_steps == 0
    assert report.badput["wasted progress"] == 0 and report.last_step == 6 and 0 < report.goodput < 1
    # A process killed while writing an event leaves part of a line: the reader skips it, and keeps
    # every line before it.
    ledger = next((folder / "goodput").glob("attempt-*.jsonl"))
    copy = tmp_path / "cut" / "goodput"
    copy.mkdir(parents=True)
    text = ledger.read_text()
    (copy / ledger.name).write_text(text + text.splitlines()[-2][:25])
    assert read_attempts(str(copy.parent)) == read_attempts(str(folder))
    # No ledger, or only an attempt killed before its first line was whole: one line, exit 2.
    (tmp_path / "empty" / "goodput").mkdir(parents=True)
    (tmp_path / "empty" / "goodput" / "attempt-20261201T000000-1-0.jsonl").write_text('{"event": "st')
    for where in (tmp_path / "none", tmp_path / "empty"):
        p = subprocess.run([sys.executable, "-m", "torchtitan_xla.goodput", str(where)], cwd=REPO,
                           capture_output=True, text=True, timeout=120)
        assert (p.returncode, p.stdout) == (2, "")
        assert p.stderr == (f"error: {where}: no goodput ledger (goodput/attempt-*.jsonl); is it a "
                            f"run's [job] dump_folder, run with [metrics] goodput = true?\n")


def _truncate_data(step_dir: Path) -> None:
    data = next(step_dir.glob("*.distcp"))
    data.write_bytes(data.read_bytes()[: data.stat().st_size // 2])


def _garble_data(step_dir: Path) -> None:
    """The same size (the commit record's check passes), its first record's header unreadable."""
    data = next(step_dir.glob("*.distcp"))
    raw = data.read_bytes()
    data.write_bytes(bytes(b ^ 0xFF for b in raw[:200]) + raw[200:])


@pytest.fixture(scope="module")
def resumed(straight, tmp_path_factory):
    """Copies of the straight run resumed in one process, the resume from its step 3 first; then
    its step 6 truncated or garbled (resume from step 6 asked for, step 3 what happens); then
    `load_step` 3 with keep_latest_k 1. Each run's results and its "folder"."""
    folder, _, _ = straight
    root = tmp_path_factory.mktemp("resumed")
    folders = {"from_step_3": _copy_up_to(folder, root / "r", 3)}
    for name, damage in (("truncated", _truncate_data), ("garbled", _garble_data)):
        folders[name] = _copy_up_to(folder, root / name, 6)
        damage(folders[name] / "checkpoint" / "step-6")
    folders["load_step"] = _copy_up_to(folder, root / "l", 6)
    flags = {"load_step": ["--checkpoint.load_step", "3", "--checkpoint.keep_latest_k", "1"]}
    results = train_many({name: args(path, "--training.local_batch_size", "8", *flags.get(name, []))
                          for name, path in folders.items()}, devices=1, model_overrides=TWO_BLOCKS)
    return {name: result | {"folder": folders[name]} for name, result in results.items()}


@pytest.mark.parametrize("damage, found_by", [("truncated", "__0_0.distcp has"), ("garbled", "UnpicklingError")])
def test_damaged_checkpoint_falls_back_to_the_previous_one(straight, resumed, damage, found_by):
    _, losses, _ = straight
    run = resumed[damage]
    damaged = [ln for ln in run["log"] if "is damaged" in ln]
    assert len(damaged) == 1
    assert f"checkpoint {run['folder'] / 'checkpoint' / 'step-6'} is damaged: {found_by}" in damaged[0]
    assert "falling back to step-3" in damaged[0]
    assert run["losses"] == {s: losses[s] for s in (4, 5, 6)}


def test_damaged_checkpoint_stops_the_run_when_asked_or_when_nothing_older(straight, tmp_path):
    # Through train.py itself, for the exit code; the damage is found by the size check of the
    # commit record, before any weight is read.
    folder, _, _ = straight
    copy = _copy_up_to(folder, tmp_path / "e", 6)
    _truncate_data(copy / "checkpoint" / "step-6")
    p = subprocess.run([sys.executable, str(REPO / "train.py"), *args(copy, "--checkpoint.on_damaged", "error")],
                       capture_output=True, text=True, env={**_cpu_env(), "CPU_NUM_DEVICES": "1"})
    assert p.returncode == 2
    errors = [ln for ln in p.stderr.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1 and "step-6 is damaged" in errors[0] and "Traceback" not in p.stderr
    # Only a damaged checkpoint: never silently start from scratch.
    shutil.rmtree(copy / "checkpoint" / "step-3")
    p = subprocess.run([sys.executable, str(REPO / "train.py"), *args(copy)],
                       capture_output=True, text=True, env={**_cpu_env(), "CPU_NUM_DEVICES": "1"})
    assert p.returncode == 2
    assert "no older checkpoint to fall back to" in p.stderr


def _cpu_env():
    import os

    return dict(os.environ, PJRT_DEVICE="CPU")


def test_a_missing_initial_load_path_stops_a_resuming_run_before_anything_is_written(straight, tmp_path):
    """The run would resume from its own step-3 and never read initial_load_path: a typo there is
    still found at start (else it surfaces only at the next fresh start)."""
    folder, _, _ = straight
    copy = _copy_up_to(folder, tmp_path / "r", 3)
    before = {p: p.read_bytes() for p in copy.rglob("*") if p.is_file()}
    missing = tmp_path / "no-such-folder"
    p = train_py_two_blocks(args(copy, "--checkpoint.initial_load_path", str(missing)))
    assert p.returncode == 2
    assert p.stderr.strip().splitlines()[-1] == (
        f"error: command line: --checkpoint.initial_load_path: not a folder: {missing}")
    assert "Traceback" not in p.stderr and "Resumed" not in p.stderr
    assert {p: p.read_bytes() for p in copy.rglob("*") if p.is_file()} == before


def test_load_step_and_keep_latest_k(straight, resumed):
    _, losses, _ = straight
    copy = resumed["load_step"]["folder"]
    assert resumed["load_step"]["losses"] == {s: losses[s] for s in (4, 5, 6)}
    assert committed_steps(copy / "checkpoint") == [6]
    p = subprocess.run([sys.executable, str(REPO / "train.py"), *args(copy, "--checkpoint.load_step", "4")],
                       capture_output=True, text=True, env={**_cpu_env(), "CPU_NUM_DEVICES": "1"})
    assert p.returncode == 2 and "error: command line: --checkpoint.load_step = 4: no committed checkpoint step-4" in p.stderr


def test_seed_checkpoint_makes_runs_start_identical(tmp_path):
    seed_folder = tmp_path / "seed"
    run(seed_folder, "--checkpoint.create_seed_checkpoint", "--debug.seed", "1")
    assert committed_steps(seed_folder / "checkpoint") == [0]
    starts = []
    for seed in ("2", "3"):  # different seeds would give different initial weights
        folder = tmp_path / f"run{seed}"
        shutil.copytree(seed_folder / "checkpoint", folder / "checkpoint")
        losses, log = run(folder, "--training.steps", "1", "--debug.seed", seed)
        assert "step-0" in log
        starts.append(losses[1])
    # Without the seed checkpoint these seeds give different losses (test_train checks seeds matter).
    assert starts[0] == starts[1]


def test_a_checkpoint_of_another_model_is_one_line_not_a_damaged_one(straight, tmp_path):
    """Resuming a folder whose checkpoints another model wrote (here: the run without LoRA, resumed
    with it) stops with one line saying so, instead of calling every step damaged and falling back
    through all of them."""
    from checkpoint_helpers import TWO_BLOCKS
    from helpers import train_process

    from torchtitan_xla.checkpoint.commit import model_mismatch

    folder, _, _ = straight
    copy = _copy_up_to(folder, tmp_path / "other", 6)
    p = train_process(args(copy, "--lora.rank", "4", "--checkpoint.on_damaged", "fallback"),
                      model_overrides=TWO_BLOCKS)
    _, err = p.communicate(timeout=600)
    assert p.returncode != 0 and "damaged" not in err, err[-3000:]
    assert err.strip().splitlines()[-1] == (
        f"torchtitan_xla.errors.ConfigError: "
        f"[checkpoint] folder: {copy / 'checkpoint' / 'step-6'} holds another model's weights (28 of "
        f"this model's 49 tensors are not in it, e.g. layers.0.attention.wq.lora_A.weight); resume with "
        f"the config that wrote it, or start in a new [job] dump_folder")
    assert committed_steps(copy / "checkpoint") == [3, 6]  # nothing touched

    class Meta:  # DCP's TensorStorageMetadata: its size
        def __init__(self, *size):
            self.size = torch.Size(size)

    state = {"w": torch.zeros(4, 2), "b": torch.zeros(4)}
    assert model_mismatch({"model.w": Meta(4, 2), "model.b": Meta(4)}, state) is None
    assert model_mismatch({"model.w": Meta(4, 3), "model.b": Meta(4)}, state) == (
        "1 tensors have other shapes, e.g. w (4, 3) against (4, 2)")
