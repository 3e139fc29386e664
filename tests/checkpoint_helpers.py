"""The checkpoint tests' short runs: the debug model cut to 2 blocks (every code path is the
same, compiles are faster), 6 steps with a checkpoint every 3, each in a fresh process."""

from __future__ import annotations

from pathlib import Path

from helpers import tiny_args, train_run

TWO_BLOCKS = {"n_layers": 2}
CKPT = ["--checkpoint.enable", "--checkpoint.interval", "3"]


def args(folder: Path, *extra: str) -> list[str]:
    return tiny_args(folder, "--training.steps", "6", *CKPT, *extra)


def run(folder: Path, *extra: str, devices: int = 1, **kw):
    return train_run(args(folder, *extra), devices=devices, model_overrides=TWO_BLOCKS, **kw)
