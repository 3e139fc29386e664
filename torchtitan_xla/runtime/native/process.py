"""What the process needs before the native runtime starts (imports no torch).

The native runtime's step compilers: `compile` (torch.compile per block) and `eager`. The config
maps the XLA default, `replay`, to `compile` (config/checks.py)."""

from __future__ import annotations

import glob
import os
import shutil
from collections.abc import Mapping, MutableMapping

STEP_COMPILERS = ("compile", "eager")


def launch_env(cpu_devices: int, device: str, env: Mapping[str, str]) -> dict[str, str]:
    """What run_train.sh exports: TTX_RUNTIME=native (it then starts the processes with torchrun)
    and NPROC_PER_NODE, the processes of this host, unless set: one per GPU (torchrun's "gpu") or
    TPU chip, or on the CPU as many as the parallel degrees ask for (`cpu_devices`)."""
    if device == "auto":
        device = ("tpu" if glob.glob("/dev/accel*") or glob.glob("/dev/vfio/[0-9]*")
                  else "cuda" if shutil.which("nvidia-smi") else "cpu")
    chips = len(glob.glob("/dev/accel*")) or len(glob.glob("/dev/vfio/[0-9]*"))
    count = {"cuda": "gpu", "tpu": str(chips)}.get(device, str(cpu_devices))
    return {"TTX_RUNTIME": "native", "NPROC_PER_NODE": env.get("NPROC_PER_NODE") or count}


def configure(step_compiler: str, env: MutableMapping[str, str] = os.environ) -> None:
    if step_compiler not in STEP_COMPILERS:
        raise ValueError(f"unknown step compiler {step_compiler!r} for the native runtime")
    # One process per device: each gets its share of the host's cores, not all of them.
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1)
                                              // max(1, int(env.get("LOCAL_WORLD_SIZE", "1"))))))
