"""What the process needs before XLA starts: the torch_xla version check, the functionalization
switch that follows the step compiler, and the XLA CPU backend's compiler flags and host malloc.

Imports neither torch nor torch_xla: the launcher calls it to build each host's environment.
docs/performance.md has the measurements behind every CPU setting here.
"""

from __future__ import annotations

import ctypes.util
import importlib.metadata
import importlib.util
import os
import sys
from collections.abc import Mapping, MutableMapping

from torchtitan_xla.errors import ConfigError
from torchtitan_xla.runtime.host_devices import tpu_chips

# The torch_xla release this layer's private calls (torch_xla._XLAC) were written and tested for.
TORCH_XLA_VERSION = "2.9.0"

STEP_COMPILERS = ("replay", "lazy")


def installed_torch_xla() -> str | None:
    try:
        return importlib.metadata.version("torch_xla")
    except importlib.metadata.PackageNotFoundError:
        return None


def version_warning(installed: str | None) -> str | None:
    """One line when the installed torch_xla is not the release this layer was written for."""
    if installed is None or installed.split("+")[0] == TORCH_XLA_VERSION:
        return None
    return (f"torch_xla {installed} is installed; torchtitan_xla's runtime layer "
            f"(torchtitan_xla/runtime) was written and tested for {TORCH_XLA_VERSION}: the replayed "
            f"step and checkpoint helpers use private torch_xla calls that may have changed "
            f"(use [compile] step = \"lazy\" if the step fails)")


def configure(step_compiler: str, env: MutableMapping[str, str] = os.environ) -> None:
    """Set the process-wide switches before any XLA tensor exists.

    - torch_xla's functionalization follows the step compiler: off for `replay`, whose replayed
      graph rebinds tensors that functionalization's wrappers would not see; on (torch_xla's
      default) for `lazy`. torch_xla reads the variable whenever it makes a tensor, so this is the
      one place that sets it.
    - On the CPU backend, XLA's compiler flags (`cpu_xla_flags`); read when XLA starts.
    """
    if step_compiler not in STEP_COMPILERS:
        raise ValueError(f"unknown step compiler {step_compiler!r}")
    check_pjrt_device(env)
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # silence the per-compile GSPMD notice
    env["XLA_DISABLE_FUNCTIONALIZATION"] = "1" if step_compiler == "replay" else "0"
    if env.get("PJRT_DEVICE") == "CPU":
        count = env.get("CPU_NUM_DEVICES", "").strip()
        if not count:  # empty is unset, as run_train.sh reads it
            env.pop("CPU_NUM_DEVICES", None)
        elif not (count.isdigit() and int(count) > 0):  # XLA would start with no device
            raise ConfigError(f"CPU_NUM_DEVICES={count!r}: expected a positive integer (the number "
                              f"of virtual XLA CPU devices; unset, run_train.sh chooses)")
        env["XLA_FLAGS"] = cpu_xla_flags(env.get("XLA_FLAGS", ""), cpu_features())


def libtpu_found(env: Mapping[str, str] = os.environ) -> bool:
    """Whether torch_xla will find libtpu, where it looks (torch_xla/__init__.py): TPU_LIBRARY_PATH,
    a copy bundled in torch_xla/lib, or the `libtpu` package (torch_xla's `tpu` extra)."""
    if env.get("TPU_LIBRARY_PATH"):
        return True
    spec = importlib.util.find_spec("torch_xla")
    bundled = spec is not None and os.path.isfile(
        os.path.join(os.path.dirname(spec.origin), "lib", "libtpu.so"))
    return bundled or importlib.util.find_spec("libtpu") is not None


def check_pjrt_device(env: Mapping[str, str] = os.environ) -> None:
    """The device PJRT_DEVICE names can be reached: else one line naming what is missing, before
    torch_xla fails in a traceback (on a TPU VM whose Python lacks libtpu: `libtpu not found`)."""
    device = env.get("PJRT_DEVICE", "CPU")
    if device == "CPU":
        return
    if device != "TPU":
        raise ConfigError(f"PJRT_DEVICE={device}: the XLA runtime runs on TPU or CPU here (torch_xla "
                          f"{TORCH_XLA_VERSION} has no {device} backend); on a GPU use --runtime.backend "
                          f"native")
    if not libtpu_found(env):
        version = (installed_torch_xla() or TORCH_XLA_VERSION).split("+")[0]
        raise ConfigError(f"PJRT_DEVICE=TPU: this Python has no libtpu, the TPU runtime torch_xla loads; "
                          f"install it with: {sys.executable} -m pip install 'torch_xla[tpu]=={version}'")
    if not tpu_chips(env):
        raise ConfigError("PJRT_DEVICE=TPU: this host has no TPU chips (no /dev/accel* or /dev/vfio/N); "
                          "unset PJRT_DEVICE to run on the CPU")


# ---- the XLA CPU backend ------------------------------------------------------------------------


def cpu_xla_flags(xla_flags: str, cpu_features: set[str]) -> str:
    """`xla_flags` (the user's XLA_FLAGS) with ours added; a flag the user names is left as set.

    - Copy insertion with region analysis: fewer copies around the in-place updates of the donated
      parameter and optimizer buffers. No number changes.
    - No XNNPACK: with it (XLA CPU's default) the replayed step, whose state buffers are donated and
      updated in place, computed wrong losses from its second update on for Qwen3 and Mixtral on a
      Zen 3 EPYC (docs/runtime.md). XLA's own kernels are as fast here (docs/performance.md).
    - 512-bit vectors for XLA's own kernels where the CPU has AVX-512 (LLVM prefers 256-bit);
      reductions vectorise in another order, so floats can differ in the last bit. Not where the
      user's `--xla_cpu_max_isa` caps XLA below AVX-512 (an AVX2-only host emulated): LLVM would
      still vectorise 16 floats wide, in two 256-bit halves, and sum in the AVX-512 host's order.
    """
    ours = {"xla_cpu_copy_insertion_use_region_analysis": "true", "xla_cpu_use_xnnpack": "false"}
    if "avx512f" in cpu_features and not _isa_capped_below_avx512(xla_flags):
        ours["xla_cpu_prefer_vector_width"] = "512"
    added = [f"--{name}={value}" for name, value in ours.items() if f"--{name}=" not in xla_flags]
    return " ".join([xla_flags, *added]).strip()


# XLA's `--xla_cpu_max_isa` values below AVX-512 (XLA reads them in any case).
ISAS_BELOW_AVX512 = ("SSE4_2", "AVX", "AVX2")


def _isa_capped_below_avx512(xla_flags: str) -> bool:
    """Whether `xla_flags` cap XLA's ISA below AVX-512 (the last `--xla_cpu_max_isa` counts)."""
    caps = [f.split("=", 1)[1] for f in xla_flags.split() if f.startswith("--xla_cpu_max_isa=")]
    return bool(caps) and caps[-1].strip("'\"").upper() in ISAS_BELOW_AVX512


def cpu_features() -> set[str]:
    """This CPU's feature flags (/proc/cpuinfo; empty where there is none)."""
    try:
        with open("/proc/cpuinfo") as fh:
            return next((set(line.split(":", 1)[1].split()) for line in fh
                         if line.startswith("flags")), set())
    except OSError:
        return set()


def cpu_model() -> str:
    """This CPU's model name (/proc/cpuinfo), for benchmark reports."""
    try:
        with open("/proc/cpuinfo") as fh:
            return next((line.split(":", 1)[1].strip() for line in fh
                         if line.startswith("model name")), "unknown CPU")
    except OSError:
        return "unknown CPU"


def vector_features(features: set[str]) -> str:
    """The vector extensions that decide XLA CPU's speed, e.g. "avx2 fma avx512f"."""
    wanted = ("avx2", "fma", "avx512f", "avx512bw", "avx512_bf16", "amx_bf16")
    return " ".join(f for f in wanted if f in features) or "none of avx2/avx512"


# XLA CPU mallocs each execution's large temporary buffer and frees it at the end; glibc hands a
# block that large back to the kernel, which faults and zeroes it again every step. tcmalloc keeps
# freed spans; glibc's transparent huge pages make the faults 2 MB at a time. Both are read when a
# process starts, hence variables for the launcher to export. Set either empty to turn ours off.
CPU_GLIBC_TUNABLES = "glibc.malloc.hugetlb=1"
TCMALLOC_NAMES = ("tcmalloc_minimal", "tcmalloc")


def launch_env(cpu_devices: int, device: str, env: Mapping[str, str], hosts: int = 1) -> dict[str, str]:
    """What run_train.sh exports for this runtime: the PJRT device, and on the CPU backend the
    virtual device count (`cpu_devices` unless CPU_NUM_DEVICES is set: each host's process has its
    own mesh) and the malloc variables. (`device` is the native runtime's.)"""
    if importlib.util.find_spec("torch_xla") is None:  # a GPU machine's or torch-tpu's Python
        raise ConfigError(f"[runtime] backend = \"xla\": this Python ({sys.executable}) has no torch_xla; "
                          "with torch-tpu or on a GPU use backend = \"native\"")
    pjrt = env.get("PJRT_DEVICE", "CPU")
    out = {"PJRT_DEVICE": pjrt}
    if pjrt == "CPU":
        out["CPU_NUM_DEVICES"] = env.get("CPU_NUM_DEVICES") or str(cpu_devices)
        out |= cpu_malloc_env(env)
    return out


def find_tcmalloc() -> str | None:
    """The installed tcmalloc's soname (what LD_PRELOAD needs), or None."""
    return next(filter(None, map(ctypes.util.find_library, TCMALLOC_NAMES)), None)


def cpu_malloc_env(env: Mapping[str, str]) -> dict[str, str]:
    """The malloc variables for a process on the CPU backend, given the environment `env` (whose
    variables win) and the tcmalloc installed here, if any. tcmalloc's "large alloc" report is
    switched off: XLA's temporaries are large by design."""
    out = {"GLIBC_TUNABLES": env.get("GLIBC_TUNABLES", CPU_GLIBC_TUNABLES)}
    if "LD_PRELOAD" not in env and (tcmalloc := find_tcmalloc()):
        out |= {"LD_PRELOAD": tcmalloc, "TCMALLOC_LARGE_ALLOC_REPORT_THRESHOLD": str(1 << 40)}
    return out
