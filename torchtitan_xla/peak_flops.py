"""The peak FLOP/s that MFU is measured against: per TPU generation and GPU model, from the
name the runtime gives the device."""

from __future__ import annotations

import re

from torchtitan_xla import runtime

# Dense bf16 FLOP/s per device, torchtitan's table. A TPU7x chip shows up as two devices, so its
# per-chip peak is halved (torchtitan's convention too).
PEAK_BF16_FLOPS = {
    "v4": 275e12,
    "v5e": 197e12,
    "v5p": 459e12,
    "v6e": 918e12,
    "v7": 2307e12 / 2,
}


def tpu_generation(kind: str) -> str | None:
    """The `PEAK_BF16_FLOPS` key for any name a TPU generation goes by: a PJRT device kind
    ("TPU v5 lite", "TPU v6 lite", "TPU7x") or an accelerator type ("v5litepod-16", "v5p-8",
    "v6e-8", "tpu7x-8"); None when it is not one of the table's generations."""
    name = kind.lower().replace(" ", "").split("-")[0].removeprefix("tpu")
    m = re.fullmatch(r"v?(\d)([a-z]*)", name)
    if not m:
        return None
    generation, variant = m.groups()
    return {
        ("4", ""): "v4",
        ("5", "lite"): "v5e", ("5", "litepod"): "v5e", ("5", "e"): "v5e",
        ("5", ""): "v5p", ("5", "p"): "v5p",
        ("6", "lite"): "v6e", ("6", "e"): "v6e",
        ("7", ""): "v7", ("7", "x"): "v7",
    }.get((generation, variant))


# Dense bf16 FLOP/s of a GPU, by the name torch.cuda reports ("NVIDIA H100 80GB HBM3"): the
# vendors' datasheets (torchtitan's table). The first key found in the name wins, so the longer
# names come first. Not verified on a GPU beyond the H200 (docs/performance.md).
GPU_PEAK_BF16_FLOPS = {
    "H100 NVL": 835e12,
    "H100 PCIe": 756e12,
    "H100": 989e12,  # SXM
    "H200": 989e12,
    "GB200": 2.5e15,
    "B200": 2.25e15,
    "A100": 312e12,
    "L40S": 362e12,
    "MI300X": 1307e12,
    "MI325X": 1307e12,
    "MI355X": 2500e12,
}


def detect_device_kind() -> str:
    """What the device is, as precisely as the runtime tells: "CPU"; for TPUs the accelerator
    type ("v5p-128"), "TPU" if even that is unknown (MFU is then n/a; not verified on TPU); for
    GPUs the device's name ("NVIDIA H200")."""
    device_type = runtime.device_type()
    if device_type == "CPU":
        return device_type
    return runtime.accelerator_type() or device_type


def resolve_peak_flops(device_kind: str, override: float | None, *,
                       float8: bool = False) -> tuple[float | None, str]:
    """(peak FLOP/s per device for MFU, where it comes from). None means MFU is shown as n/a.

    `override` (`metrics.peak_flops`) always wins. `float8` is the hook for float8 training: a
    bf16 peak is the wrong yardstick for float8 matmuls, so MFU is n/a unless overridden.
    """
    if override is not None:
        return override, f"metrics.peak_flops = {override:.4g}"
    if float8:
        return None, "float8 matmuls (set metrics.peak_flops to compare against a peak)"
    gpu = next((name for name in GPU_PEAK_BF16_FLOPS if name.lower() in device_kind.lower()), None)
    if gpu is not None:
        peak = GPU_PEAK_BF16_FLOPS[gpu]
        return peak, f"{gpu} bf16 peak {peak / 1e12:g} TFLOP/s per device"
    generation = tpu_generation(device_kind)
    if generation is None:
        return None, f"no peak FLOP/s known for {device_kind!r} (set metrics.peak_flops)"
    peak = PEAK_BF16_FLOPS[generation]
    return peak, f"TPU {generation} bf16 peak {peak / 1e12:g} TFLOP/s per device"
