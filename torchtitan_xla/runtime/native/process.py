"""What the process needs before the native runtime starts (imports no torch).

The native runtime's step compilers: `compile` (the step as a few torch.compile'd graphs),
`blocks` (torch.compile per block) and `eager`. The config
maps the XLA default, `replay`, to `compile` (config/checks.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Mapping, MutableMapping

from torchtitan_xla.errors import ConfigError
from torchtitan_xla.runtime.host_devices import has_nvidia_gpu, host_accelerator, tpu_chips

STEP_COMPILERS = ("compile", "blocks", "eager")


def launch_env(cpu_devices: int, device: str, env: Mapping[str, str], hosts: int = 1) -> dict[str, str]:
    """What run_train.sh exports: TTX_RUNTIME=native (it then starts the processes with torchrun),
    NPROC_PER_NODE (unless set): one per GPU (torchrun's "gpu") or TPU chip, or on the CPU this
    host's share of the devices the parallel degrees ask for (`cpu_devices` over `hosts`); and
    OMP_NUM_THREADS, the host's cores shared between them (torchrun would give each one)."""
    chips = len(tpu_chips(env))
    if device == "auto":  # as the processes will choose (they check again, with torch)
        device = host_accelerator(env)
    if device == "tpu" and not chips and not env.get("NPROC_PER_NODE"):
        raise ConfigError("[runtime] device = \"tpu\": this host has no TPU chips (/dev/accel*, "
                          "/dev/vfio); set NPROC_PER_NODE if they are elsewhere")
    if device == "cuda" and not has_nvidia_gpu(env) and not env.get("NPROC_PER_NODE"):
        # (torchrun's "gpu" count would stop with a traceback.)
        raise ConfigError("[runtime] device = \"cuda\": this host has no NVIDIA GPU (no nvidia-smi); "
                          "set NPROC_PER_NODE if it has one")
    count = {"cuda": "gpu", "tpu": str(chips)}.get(device, str(max(1, cpu_devices // max(1, hosts))))
    out = {"TTX_RUNTIME": "native", "NPROC_PER_NODE": env.get("NPROC_PER_NODE") or count}
    if device == "tpu" and chips:
        out |= tpu_launch_env(hosts, int(out["NPROC_PER_NODE"]), env)
    if out["NPROC_PER_NODE"].isdigit():
        cores = os.cpu_count() or 1
        share = max(1, cores // max(1, int(out["NPROC_PER_NODE"])))
        out["OMP_NUM_THREADS"] = env.get("OMP_NUM_THREADS") or str(share)
    return out


# torch-tpu's own launch setup, run in a child (it needs torch): the variables it sets, printed.
_TPU_LAUNCH = """
import json, os, sys
import torch.tpu.distributed as tpu_distributed
before = dict(os.environ)
tpu_distributed.set_tpu_launch_env(nnodes=int(sys.argv[1]), nproc_per_node=int(sys.argv[2]))
print(json.dumps({k: v for k, v in os.environ.items() if before.get(k) != v}))
"""


def tpu_launch_env(hosts: int, chips: int, env: Mapping[str, str]) -> dict[str, str]:
    """The variables TorchTPU's processes need before torchrun starts them (slice builder addresses,
    topology, the hosts' rendezvous): torch.tpu.distributed.set_tpu_launch_env's, which keeps what
    is already set. Not verified on a TPU (written against torch-tpu 0.2.0)."""
    p = subprocess.run([sys.executable, "-c", _TPU_LAUNCH, str(hosts), str(chips)], capture_output=True,
                       text=True, env=dict(env))
    if p.returncode:
        last = (p.stderr.strip().splitlines() or ["no output"])[-1]
        raise ConfigError(f"[runtime] device = \"tpu\": torch-tpu's launch setup failed: {last}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def configure(step_compiler: str, env: MutableMapping[str, str] = os.environ) -> None:
    if step_compiler not in STEP_COMPILERS:
        raise ValueError(f"unknown step compiler {step_compiler!r} for the native runtime")
