"""The checkpoint tests' short runs: the debug model cut to 2 blocks (every code path is the
same, compiles are faster), 6 steps with a checkpoint every 3, each in a fresh process."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from helpers import REPO, tiny_args, train_run

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


# A run killed (SIGKILL) while it saves step $KILL_AT_SAVE, after DCP has written its files and
# before the commit record: the step is lost, the run resumes from the checkpoint before it.
KILLED_AT_SAVE = """
import os, signal
import torchtitan_xla.checkpoint.commit as commit
_write_commit = commit.write_commit
def killed(path, step, contents):
    if step == int(os.environ["KILL_AT_SAVE"]):
        os.kill(os.getpid(), signal.SIGKILL)
    return _write_commit(path, step, contents)
commit.write_commit = killed
"""


# The parameters loaded into still in flight when the load starts, as train.py's initial sync leaves
# them (it does not wait): torch_xla's planner then failed on a loaded CI machine ("Trying to access
# XLA data ... while an async operation is in flight"). Launched behind a second of unrelated
# matmuls, the update of every parameter (by 0) is certain to be pending when the load starts.
PARAMETERS_IN_FLIGHT = """
import torch, torch_xla
import torchtitan_xla.checkpoint as ckpt
_load = ckpt.CheckpointManager.load
def load(self):
    x = torch.randn(1024, 1024, device=torch_xla.device())
    for _ in range(20):
        x = torch.tanh(x @ x)
    torch_xla.sync()
    zero = torch.zeros((), device=torch_xla.device())
    with torch.no_grad():
        for p in self.model.parameters():
            p.add_(zero)
    torch_xla.sync()  # queued behind the matmuls, not waited for
    return _load(self)
ckpt.CheckpointManager.load = load
"""


def args(folder: Path, *extra: str) -> list[str]:
    return tiny_args(folder, "--training.steps", "6", *CKPT, *extra)


def run(folder: Path, *extra: str, devices: int = 1, **kw):
    return train_run(args(folder, *extra), devices=devices, model_overrides=TWO_BLOCKS, **kw)


def all_tensors(step_dir: Path) -> dict:
    """Every tensor of a checkpoint step (model, optimizer, RNG states), whole, on the host."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from torchtitan_xla.checkpoint.commit import quiet_dcp

    quiet_dcp()
    metadata = dcp.FileSystemReader(str(step_dir)).read_metadata()
    tensors = {k: torch.empty(m.size, dtype=m.properties.dtype)
               for k, m in metadata.state_dict_metadata.items() if isinstance(m, TensorStorageMetadata)}
    dcp.load(tensors, storage_reader=dcp.FileSystemReader(str(step_dir)), no_dist=True)
    return tensors


# train.py's command line (its error handling and exit codes) on the debug model cut to two blocks.
_TRAIN_PY_TWO_BLOCKS = """
import dataclasses, sys
sys.path.insert(0, {repo!r})
from torchtitan_xla.models import models_config
models_config["llama3"]["debugmodel"] = dataclasses.replace(models_config["llama3"]["debugmodel"], n_layers=2)
import train
sys.argv[0] = "train.py"
sys.exit(train.run_main(train.cli))
"""


def train_py_two_blocks(argv: list[str], **kw) -> subprocess.CompletedProcess:
    """train.py with `argv` on one XLA CPU device, the llama3 debug model cut to two blocks
    (`kw`: subprocess.run's)."""
    return subprocess.run([sys.executable, "-c", _TRAIN_PY_TWO_BLOCKS.format(repo=str(REPO)), *argv],
                          capture_output=True, text=True, env=dict(os.environ, PJRT_DEVICE="CPU",
                                                                   CPU_NUM_DEVICES="1"), **kw)


def from_hf(straight) -> list[str]:
    """The flags that start a run from the shared run's (conftest.py's `straight`) HF export."""
    return ["--checkpoint.initial_load_path", str(straight[0] / "checkpoint" / "step-6-hf"),
            "--checkpoint.initial_load_in_hf"]
