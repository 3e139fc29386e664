"""The XLA device and the runtime's answers about it: SPMD start-up, the mesh's device count, which
host this is, syncs, RNG state, compile counts and memory statistics."""

from __future__ import annotations

import contextlib
import os

import torch

from torchtitan_xla.logging import logger
from torchtitan_xla.runtime.host_devices import host_accelerator
from torchtitan_xla.runtime.xla.process import installed_torch_xla, version_warning

PROCESS_PER_DEVICE = False  # one process drives every device of its host


def init_devices(device: str = "auto") -> torch.device:
    """Start XLA in SPMD mode (one process drives every device of its host, XLA partitions each
    graph over the mesh); returns the device every tensor goes to. Warns once when the installed
    torch_xla is not the release this layer was written for. (`device`: PJRT_DEVICE chooses.)"""
    import torch_xla
    import torch_xla.runtime as xr

    warning = version_warning(installed_torch_xla())
    if warning:
        logger.warning(warning)
    if os.environ.get("PJRT_DEVICE") == "CPU" and host_accelerator() == "cuda":
        logger.warning("this host has an NVIDIA GPU, which the XLA runtime cannot use (torch_xla 2.9 "
                       "has no CUDA backend): training on the CPU; --runtime.backend native uses the GPU")
    xr.use_spmd()
    return torch_xla.device()


def autocast_device_type() -> str:
    return "xla"


def initialising() -> contextlib.AbstractContextManager:
    """Initialisation needs nothing special: XLA's RNG draws each tensor whole."""
    return contextlib.nullcontext()


def current_device() -> torch.device:
    import torch_xla

    return torch_xla.device()


def device_type() -> str:
    """"CPU", "TPU", ... as the runtime reports it."""
    import torch_xla.runtime as xr

    return xr.device_type()


def device_count() -> int:
    """Devices in the global mesh (every host's)."""
    import torch_xla.runtime as xr

    return xr.global_runtime_device_count()


def process_index() -> int:
    import torch_xla.runtime as xr

    return xr.process_index()


def process_count() -> int:
    import torch_xla.runtime as xr

    return xr.process_count()


def master_ip() -> str:
    """Process 0's address on a TPU pod configured by its metadata server."""
    import torch_xla.runtime as xr

    return xr.get_master_ip()


def sync() -> None:
    """Cut the lazy graph here and start running it (returns before it finishes)."""
    import torch_xla

    torch_xla.sync()


def materialise() -> None:
    """Run every pending computation and wait for it."""
    import torch_xla
    import torch_xla.core.xla_model as xm

    torch_xla.sync()
    xm.wait_device_ops()


def wait() -> None:
    """Wait for everything already started on the device."""
    import torch_xla.core.xla_model as xm

    xm.wait_device_ops()


def to_device(tensors: list[torch.Tensor], dev: torch.device, sharding=None) -> list[torch.Tensor]:
    """Host tensors onto the device in one transfer, each laid out by `sharding` (an
    `input_sharding`) when given: every device receives only its part."""
    import torch_xla.core.xla_model as xm

    return xm.send_cpu_data_to_device(tensors, dev, sharding)


def to_host(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Whole values of device tensors on the host, in one transfer (running what they wait for
    first, in one graph). On one host a sharded tensor is put together from its devices' shards:
    fetched whole, torch_xla compiles a program that replicates it, at every call (a HuggingFace
    export of the debug model compiled 75)."""
    import torch_xla
    import torch_xla.core.xla_model as xm

    tensors = list(tensors)
    xm.unlazy(tensors)
    one_host = process_count() == 1
    sharded = [one_host and torch_xla._XLAC._get_xla_op_sharding(t) is not None for t in tensors]
    plain = [t for t, s in zip(tensors, sharded) if not s]
    plain = iter(torch_xla._XLAC._xla_get_cpu_tensors(plain) if plain else [])
    picked = [t for t, s in zip(tensors, sharded) if s]
    pieces = iter(zip(torch_xla._XLAC._get_local_shards(picked),
                      torch_xla._XLAC._get_local_shard_replica_and_indices(picked)) if picked else [])
    return [_assembled(t.shape, *next(pieces)) if s else next(plain) for t, s in zip(tensors, sharded)]


def _assembled(shape: torch.Size, shards: list, places: list) -> torch.Tensor:
    """The whole tensor from host copies of its shards ((data, device) each) and their places
    ((replica, index slices into the whole, or Ellipsis for a whole replica)); a shard may be
    padded at its ends."""
    whole = torch.empty(shape, dtype=shards[0][0].dtype)
    for (shard, _), (_, where) in zip(shards, places):
        if where is Ellipsis:
            return shard.clone()
        whole[tuple(where)] = shard[tuple(slice(0, w.stop - w.start) for w in where)]
    return whole


def set_seed(seed: int) -> None:
    """Seed torch's host RNG and the device RNG."""
    import torch_xla.core.xla_model as xm

    torch.manual_seed(seed)
    xm.set_rng_state(seed)


def rng_state() -> int:
    import torch_xla.core.xla_model as xm

    return xm.get_rng_state()


def set_rng_state(state: int) -> None:
    import torch_xla.core.xla_model as xm

    xm.set_rng_state(int(state))


def compile_stats() -> tuple[int, float]:
    """(number of XLA graph compiles so far in this process, total compile seconds)."""
    import torch_xla.debug.metrics as met

    data = met.metric_data("CompileTime")
    return (0, 0.0) if data is None else (int(data[0]), data[1] / 1e9)


def metrics_report() -> str:
    """torch_xla's report of compiles, transfers, executions and CPU fallbacks."""
    import torch_xla.debug.metrics as met

    return met.metrics_report()


def memory_info(dev: torch.device) -> dict[str, int]:
    """The device allocator's bytes_used / peak_bytes_used / bytes_limit. Raises RuntimeError with
    the reason in plain words where the runtime has none (torch_xla's own message is an internal
    `Check failed` assertion a user would read as a crash)."""
    import torch_xla.core.xla_model as xm
    import torch_xla.runtime as xr

    try:
        return xm.get_memory_info(dev)
    except Exception:  # the runtime's assertion text, whatever its type
        if xr.is_spmd():
            raise RuntimeError("torch_xla 2.9 gives none for the SPMD virtual device, "
                               "pytorch/xla#9022") from None
        raise RuntimeError(f"the {device_type()} runtime keeps no allocator statistics") from None


def accelerator_type() -> str | None:
    """The TPU slice's accelerator type ("v5p-128") from GKE's variable or the TPU VM metadata;
    None when neither says. (Under SPMD torch_xla 2.9's device-kind query fails.) Not verified on
    TPU."""
    accelerator = os.environ.get("TPU_ACCELERATOR_TYPE")
    if accelerator:
        return accelerator
    try:
        from torch_xla._internal import tpu

        return tpu.get_tpu_type()
    except Exception as e:  # no metadata server
        logger.debug(f"TPU accelerator type unknown: {e}")
        return None


def slice_count() -> int:
    """TPU slices the runtime sees (multi-slice over DCN)."""
    import torch_xla.runtime as xr

    return len({a.get("slice_index", 0) for a in xr.global_runtime_device_attributes()})


def start_trace(folder: str) -> None:
    import torch_xla.debug.profiler as xp

    xp.start_trace(folder)


def stop_trace() -> None:
    """End the profiler trace after the steps in it have run on the device."""
    import torch_xla.core.xla_model as xm
    import torch_xla.debug.profiler as xp

    xm.wait_device_ops()
    xp.stop_trace()
