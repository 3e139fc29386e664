"""What the process needs before the native runtime starts (imports no torch).

The native runtime's step compilers: `compile` (torch.compile per block) and `eager`. The config
maps the XLA default, `replay`, to `compile` (config/checks.py)."""

from __future__ import annotations

import glob
import os
import shutil
from collections.abc import Mapping, MutableMapping

from torchtitan_xla.errors import ConfigError

STEP_COMPILERS = ("compile", "eager")


def launch_env(cpu_devices: int, device: str, env: Mapping[str, str], hosts: int = 1) -> dict[str, str]:
    """What run_train.sh exports: TTX_RUNTIME=native (it then starts the processes with torchrun),
    NPROC_PER_NODE (unless set): one per GPU (torchrun's "gpu") or TPU chip, or on the CPU this
    host's share of the devices the parallel degrees ask for (`cpu_devices` over `hosts`); and
    OMP_NUM_THREADS, the host's cores shared between them (torchrun would give each one)."""
    chips = len(glob.glob("/dev/accel*")) or len(glob.glob("/dev/vfio/[0-9]*"))
    if device == "auto":  # as the processes will choose (they check again, with torch)
        device = "tpu" if chips else "cuda" if shutil.which("nvidia-smi") else "cpu"
    if device == "tpu" and not chips and not env.get("NPROC_PER_NODE"):
        raise ConfigError("[runtime] device = \"tpu\": this host has no TPU chips (/dev/accel*, "
                          "/dev/vfio); set NPROC_PER_NODE if they are elsewhere")
    if device == "cuda" and not shutil.which("nvidia-smi") and not env.get("NPROC_PER_NODE"):
        # (torchrun's "gpu" count would stop with a traceback.)
        raise ConfigError("[runtime] device = \"cuda\": this host has no NVIDIA GPU (no nvidia-smi); "
                          "set NPROC_PER_NODE if it has one")
    count = {"cuda": "gpu", "tpu": str(chips)}.get(device, str(max(1, cpu_devices // max(1, hosts))))
    out = {"TTX_RUNTIME": "native", "NPROC_PER_NODE": env.get("NPROC_PER_NODE") or count}
    if out["NPROC_PER_NODE"].isdigit():
        cores = os.cpu_count() or 1
        share = max(1, cores // max(1, int(out["NPROC_PER_NODE"])))
        out["OMP_NUM_THREADS"] = env.get("OMP_NUM_THREADS") or str(share)
    return out


def configure(step_compiler: str, env: MutableMapping[str, str] = os.environ) -> None:
    if step_compiler not in STEP_COMPILERS:
        raise ValueError(f"unknown step compiler {step_compiler!r} for the native runtime")
