"""The checkpoint tests' short runs: the debug model cut to 2 blocks (every code path is the
same, compiles are faster), 6 steps with a checkpoint every 3, each in a fresh process."""

from __future__ import annotations

from pathlib import Path

from helpers import tiny_args, train_run

TWO_BLOCKS = {"n_layers": 2}
CKPT = ["--checkpoint.enable", "--checkpoint.interval", "3"]

# A save that takes long enough to be killed in the middle: the step-6 write prints SAVING and
# sleeps after DCP has written its files and before the commit record.
SLOW_SAVE = """
import time
import torchtitan_xla.checkpoint.commit as commit
_write_commit = commit.write_commit
def slow_commit(path, step, contents):
    if step == 6:
        print("SAVING", flush=True)
        time.sleep(120)
    return _write_commit(path, step, contents)
commit.write_commit = slow_commit
"""


def args(folder: Path, *extra: str) -> list[str]:
    return tiny_args(folder, "--training.steps", "6", *CKPT, *extra)


def run(folder: Path, *extra: str, devices: int = 1, **kw):
    return train_run(args(folder, *extra), devices=devices, model_overrides=TWO_BLOCKS, **kw)
