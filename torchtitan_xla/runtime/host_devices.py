"""Which accelerator this host has, from its device files: TPU chips (`/dev/accel*` on v2-v4,
`/dev/vfio/<N>` from v5 on), or an NVIDIA GPU (its driver's `nvidia-smi`).

Standard library only: the set-up (scripts/setup_env.sh) runs this file with the system's Python,
before any package is installed, to choose what to install (`python host_devices.py` prints tpu,
cuda or cpu); the launchers use it to choose each runtime's device. `TTX_DEV_ROOT` moves the
folder the device files are looked for in (default /dev), so tests can point it at a stand-in.
"""

from __future__ import annotations

import glob
import os
import shutil
from collections.abc import Mapping

DEV_ROOT_VAR = "TTX_DEV_ROOT"


def tpu_chips(env: Mapping[str, str] = os.environ) -> list[str]:
    """This host's TPU chips' device files."""
    root = env.get(DEV_ROOT_VAR) or "/dev"
    accel = sorted(glob.glob(os.path.join(root, "accel*")))
    return accel or sorted(glob.glob(os.path.join(root, "vfio", "[0-9]*")))


def has_nvidia_gpu(env: Mapping[str, str] = os.environ) -> bool:
    """An NVIDIA driver is installed (`nvidia-smi` on the PATH; with TTX_DEV_ROOT, /dev/nvidia0
    under it instead)."""
    if env.get(DEV_ROOT_VAR):
        return os.path.exists(os.path.join(env[DEV_ROOT_VAR], "nvidia0"))
    return shutil.which("nvidia-smi") is not None


def host_accelerator(env: Mapping[str, str] = os.environ) -> str:
    """"tpu", "cuda" or "cpu"."""
    return "tpu" if tpu_chips(env) else "cuda" if has_nvidia_gpu(env) else "cpu"


if __name__ == "__main__":
    print(host_accelerator())
