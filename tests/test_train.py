"""The training loop end to end: the default job learns, runs are reproducible, and a recompile
after warm-up is caught. (8 devices giving the losses of 1: tests/test_parallelisms.py.)"""

import logging

import pytest
from helpers import REPO, capture_logs, run_train, tiny_args, train_losses, train_many

from torchtitan_xla.config import parse_args

# The debug model cut to 2 blocks: the same code paths, compiles 4x faster.
TWO_BLOCKS = {"n_layers": 2}


@pytest.fixture(scope="module")
def one_device(tmp_path_factory):
    """The same run with the configured seed and with another, in one process."""
    out = tmp_path_factory.mktemp("one")
    runs = {"seed 42": [], "seed 7": ["--debug.seed", "7"]}
    return train_many({k: tiny_args(out / k, "--training.local_batch_size", "8", *v) for k, v in runs.items()},
                      devices=1, model_overrides=TWO_BLOCKS)


@pytest.fixture(scope="module")
def one_device_losses(one_device):
    return one_device["seed 42"]["losses"]


def test_default_job_learns_through_run_train_sh(tmp_path):
    """./run_train.sh with no CONFIG_FILE runs train_configs/debug_model.toml."""
    dump = tmp_path / "default"
    run = run_train(["--training.steps", "20", "--lr_scheduler.warmup_steps", "5", "--metrics.log_freq", "5",
                     "--job.dump_folder", str(dump), "--job.no-print_config"],
                    script="run_train.sh", env={"CPU_NUM_DEVICES": None, "PJRT_DEVICE": None})
    assert run.returncode == 0, run.stderr[-3000:]
    losses = run.losses
    assert sorted(losses) == [1, 5, 10, 15, 20]
    assert losses[20] < losses[1] - 1.0, losses  # measured: 8.16 -> 6.81
    assert "mesh {'pp': 1, 'dp_replicate': 1, 'fsdp': 1, 'ep': 1, 'cp': 1, 'tp': 1}" in run.stderr  # 1 device by default
    # One compile for init, one for the training step; none after.
    assert "Training completed: 2 compiles in total" in run.stderr
    saved = parse_args(["--job.config_file", str(dump / "config.toml")])
    assert saved.training.steps == 20 and saved.model.flavor == "debugmodel"


def test_same_config_gives_identical_losses(tmp_path, one_device_losses):
    again = train_losses(tiny_args(tmp_path, "--training.local_batch_size", "8"), devices=1,
                         model_overrides=TWO_BLOCKS)
    assert again == one_device_losses  # bit for bit


def test_a_different_seed_gives_different_losses(one_device, one_device_losses):
    assert one_device["seed 7"]["losses"][1] != one_device_losses[1]


def _run_in_process(tmp_path, *extra):
    import train

    history = train.main(parse_args(tiny_args(tmp_path, "--training.steps", "6", *extra)),
                         model_overrides=TWO_BLOCKS)
    return {s.step: s.loss for s in history}


class _ShorterBatchesFromStep4:
    """A data loader whose batches lose 8 tokens from step 4 on: a new shape, so a new graph."""

    def __init__(self, loader):
        self.loader = loader

    def __getattr__(self, name):
        return getattr(self.loader, name)

    def __iter__(self):
        for step, (inputs, labels) in enumerate(self.loader, start=1):
            yield (inputs[:, :-8], labels[:, :-8]) if step >= 4 else (inputs, labels)


def _shorter_batches_from_step_4(monkeypatch):
    import torchtitan_xla.datasets

    real = torchtitan_xla.datasets.build_data_loader
    monkeypatch.setattr(torchtitan_xla.datasets, "build_data_loader",
                        lambda *a, **kw: _ShorterBatchesFromStep4(real(*a, **kw)))


def test_recompile_after_warmup_stops_the_run(tmp_path, monkeypatch, xla_device):
    _shorter_batches_from_step_4(monkeypatch)
    with pytest.raises(RuntimeError, match=r"step 4: XLA compiled a new graph after warm-up"):
        _run_in_process(tmp_path, "--training.seq_len", "48")


def test_recompile_after_warmup_can_be_a_warning(tmp_path, monkeypatch, xla_device):
    _shorter_batches_from_step_4(monkeypatch)
    with capture_logs() as log:
        losses = _run_in_process(tmp_path, "--training.seq_len", "40", "--debug.on_recompile", "warn")
    assert sorted(losses) == [1, 2, 3, 4, 5, 6]
    warnings = log.messages(logging.WARNING)
    assert any(w.startswith("step 4: XLA compiled a new graph after warm-up") for w in warnings)


def test_no_compile_after_warmup_through_warmup_and_decay(tmp_path, xla_device):
    """lr changes every step (warmup, then cosine decay to the end): never a new graph."""
    from torchtitan_xla.runtime import compile_stats

    before, _ = compile_stats()
    losses = _run_in_process(tmp_path, "--training.seq_len", "56", "--lr_scheduler.decay_type",
                             "cosine", "--lr_scheduler.min_lr_factor", "0")
    assert len(losses) == 6
    assert compile_stats()[0] - before == 2  # init graph + the step graph


def test_run_train_sh_resolves_bare_config_names_and_device_count(tmp_path):
    """A bare CONFIG_FILE resolves in train_configs/, and the device count follows the config."""
    dump = tmp_path / "o"
    run = run_train([*tiny_args(dump)[2:], "--training.steps", "1",
                     "--parallelism.data_parallel_shard_degree", "2"],
                    script="run_train.sh", env={"CONFIG_FILE": "debug_model.toml", "CPU_NUM_DEVICES": None, "PJRT_DEVICE": None})
    assert run.returncode == 0, run.stderr[-3000:]
    assert "2 CPU devices" in run.stderr
    assert "mesh {'pp': 1, 'dp_replicate': 1, 'fsdp': 2, 'ep': 1, 'cp': 1, 'tp': 1}" in run.stderr
    assert (dump / "config.toml").exists()
    assert str(REPO)  # the script found train.py from any working directory


@pytest.mark.parametrize("key", ["dump_folder", "checkpoint_folder"])
def test_an_unwritable_output_folder_stops_the_run_before_step_1(tmp_path, key):
    """A folder the run cannot write is found at start (one line, exit 2), not at the first
    checkpoint after hours of training. (A path under a regular file: as root, permissions would
    not stop the write.)"""
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    bad = blocker / "out"
    if key == "dump_folder":
        extra, message = ["--job.dump_folder", str(bad)], f"command line: --job.dump_folder: cannot write to {bad}"
    else:
        extra = ["--job.dump_folder", str(tmp_path / "dump"), "--checkpoint.enable",
                 "--checkpoint.folder", str(bad)]
        message = f"command line: --checkpoint.folder: cannot write to {bad}"
    run = run_train([*tiny_args(tmp_path / "dump"), *extra])
    assert run.returncode == 2, run.stderr[-2000:]
    assert [ln for ln in run.stderr.splitlines() if ln.startswith("error:")] == [
        f"error: {message} (Not a directory: {blocker})"]
    assert "Traceback" not in run.stderr and "step:" not in run.stderr
    assert "devices" not in run.stderr  # XLA never started
    assert blocker.read_text() == "not a folder"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-file"]  # nothing written


def test_a_step_that_does_not_fit_the_device_is_one_line_exit_2(tmp_path):
    """64 sequences of 2048 tokens through sdpa: XLA asks for about 300 GB at the first step. One
    line naming what to change, exit 2, no traceback; what the run wrote before (its config) is
    kept. (The address space is capped at 64 GiB, so the allocation fails whatever the machine's
    memory and overcommit policy.)"""
    import shlex
    import subprocess
    import sys

    from helpers import _env

    args = tiny_args(tmp_path / "out", "--training.local_batch_size", "64", "--training.seq_len", "2048",
                     "--model.attention", "sdpa", "--training.steps", "2")
    command = shlex.join([sys.executable, str(REPO / "train.py"), *args])
    run = subprocess.run(["bash", "-c", f"ulimit -v {64 << 20} && exec {command}"], capture_output=True,
                         text=True, env=_env(1, None), timeout=600)
    assert run.returncode == 2, run.stderr[-3000:]
    line = run.stderr.strip().splitlines()[-1]
    assert line.startswith("error: the device ran out of memory (Error preparing computation: Out of memory "
                           "allocating "), line
    assert line.endswith(" bytes.): the training step does not fit; lower [training] local_batch_size or "
                         "seq_len, or see what fits with ./run_train.sh --plan"), line
    assert "Traceback" not in run.stderr and (tmp_path / "out" / "config.toml").exists()
