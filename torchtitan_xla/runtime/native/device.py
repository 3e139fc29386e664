"""The native runtime's device and process group: one process per device, torch.distributed's
default group over all of them (gloo on the CPU, NCCL on CUDA, torch-tpu's backend on a TPU, with
gloo beside the last two for host-side collectives)."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import torch

from torchtitan_xla.errors import ConfigError
from torchtitan_xla.logging import logger

_kind = "cpu"  # the device kind init_devices chose
PROCESS_PER_DEVICE = True  # (several processes per host)


def _tpu_available() -> bool:
    try:
        import torch_tpu  # noqa: F401  (registers the `tpu` device)
    except ImportError:
        return False
    return torch.accelerator.is_available() and torch.accelerator.current_accelerator().type == "tpu"


def resolve_device(device: str) -> str:
    """The device kind `[runtime] device` asks for, checked; "auto": tpu, else cuda, else cpu."""
    if device == "auto":
        return "tpu" if _tpu_available() else "cuda" if torch.cuda.is_available() else "cpu"
    if device == "tpu" and not _tpu_available():
        try:
            import torch_tpu  # noqa: F401
            why = "torch-tpu is installed but finds no TPU on this machine"
        except ImportError:
            why = "torch-tpu is not installed (pip install torch-tpu; it needs torch >= 2.11)"
        raise ConfigError(f"[runtime] device = \"tpu\": {why}")
    if device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("[runtime] device = \"cuda\": torch sees no CUDA GPU "
                          f"(torch {torch.__version__}, CUDA build: {torch.version.cuda or 'no'})")
    return device


def world_size_from_env() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def init_devices(device: str = "auto") -> torch.device:
    """Join (or, alone, make) the default process group and return this process's device."""
    import torch.distributed as dist

    global _kind
    _kind = resolve_device(device)
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if _kind == "cuda":  # (TorchTPU gives each process its one chip, as index 0)
        torch.accelerator.set_device_index(local_rank)
    dev = torch.device("cpu")
    if _kind != "cpu":
        dev = torch.device(_kind, torch.accelerator.current_device_index())
    if not dist.is_initialized():
        backend = "gloo" if _kind == "cpu" else \
            f"cpu:gloo,{_kind}:{dist.Backend.default_device_backend_map.get(_kind, _kind)}"
        if "WORLD_SIZE" in os.environ:  # torchrun's variables
            dist.init_process_group(backend)
        else:  # one process on its own: a group of one, no rendezvous
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    logger.info(f"native runtime: process {dist.get_rank()} of {dist.get_world_size()} on {dev}")
    return dev


def current_device() -> torch.device:
    if _kind == "cpu":
        return torch.device("cpu")
    return torch.device(_kind, torch.accelerator.current_device_index())


def device_type() -> str:
    """"CPU", "CUDA", "TPU": upper case, as the XLA runtime reports its devices."""
    return _kind.upper()


def autocast_device_type() -> str:
    return _kind


def device_count() -> int:
    """Devices in the mesh: one per process."""
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_initialized() else world_size_from_env()


def process_index() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", "0"))


def process_count() -> int:
    return device_count()


def master_ip() -> str:
    return os.environ.get("MASTER_ADDR", "127.0.0.1")


def sync() -> None:
    """Eager PyTorch runs as it goes: nothing to cut."""


def wait() -> None:
    if _kind != "cpu":
        torch.accelerator.synchronize()


materialise = wait


def to_device(tensors: list[torch.Tensor], dev: torch.device, sharding=None) -> list[torch.Tensor]:
    """Host tensors onto the device; with `sharding` (an `input_sharding`) each is this process's
    block of a DTensor laid out by it."""
    moved = [t.to(dev, non_blocking=True) for t in tensors]
    return moved if sharding is None else [sharding(t) for t in moved]


def to_host(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Whole values on the host (a DTensor is gathered)."""
    from torch.distributed.tensor import DTensor

    return [(t.full_tensor() if isinstance(t, DTensor) else t).cpu() for t in tensors]


def set_seed(seed: int) -> None:
    torch.manual_seed(seed)  # seeds every device's generator too


def rng_state() -> int:
    """Checkpoints keep the XLA runtime's device RNG seed under this key; here the host
    generator (saved beside it) is the one that matters."""
    return torch.initial_seed()


def set_rng_state(state: int) -> None:
    """The host generator's state is restored from its own key; nothing to do here."""


@contextlib.contextmanager
def initialising() -> Iterator[None]:
    """Random initialisation of sharded parameters as on one device: see sharding.py."""
    from torchtitan_xla.runtime.native.sharding import FullTensorInit

    with FullTensorInit():
        yield


def compile_stats() -> tuple[int, float]:
    """(graphs torch.compile has compiled in this process, their compile seconds: dynamo's frames
    with their forward graphs, and the backward graphs AOTAutograd compiles at their first call)."""
    from torch._dynamo.utils import compilation_time_metrics, counters

    seconds = sum(sum(times) for key, times in compilation_time_metrics.items()
                  if key == "_compile.compile_inner" or key.endswith("bw_compiler"))
    return int(counters["stats"]["unique_graphs"]), seconds


def metrics_report() -> str:
    from torch._dynamo.utils import compile_times

    return compile_times(repr="str")


def memory_info(dev: torch.device) -> dict[str, int]:
    if _kind == "cpu":
        raise RuntimeError("the CPU keeps no device allocator statistics")
    stats = torch.accelerator.memory_stats(dev)
    limit = torch.cuda.get_device_properties(dev).total_memory if _kind == "cuda" else 0
    return {"bytes_used": stats.get("allocated_bytes.all.current", 0),
            "peak_bytes_used": stats.get("allocated_bytes.all.peak", 0), "bytes_limit": limit}


def accelerator_type() -> str | None:
    """The accelerator's model, for the MFU peak: a GPU's name ("NVIDIA H200"); a TPU slice's type
    from GKE's variable, else torch-tpu's chip name (not verified on TPU); None on the CPU."""
    if _kind == "cuda":
        return torch.cuda.get_device_name(torch.cuda.current_device())
    if _kind == "tpu":
        return os.environ.get("TPU_ACCELERATOR_TYPE") or torch.tpu.get_device_name()  # "TPU v6e"
    return None


def slice_count() -> int:
    """TPU slices of the job: libtpu's multi-slice setting (MEGASCALE_NUM_SLICES, set per slice by
    GKE's JobSet or the launcher); one elsewhere."""
    return int(os.environ.get("MEGASCALE_NUM_SLICES", "1")) if _kind == "tpu" else 1


_profiler = None


def start_trace(folder: str) -> None:
    global _profiler
    activities = [torch.profiler.ProfilerActivity.CPU]
    if _kind == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    _profiler = torch.profiler.profile(
        activities=activities, on_trace_ready=torch.profiler.tensorboard_trace_handler(folder))
    _profiler.start()


def stop_trace() -> None:
    global _profiler
    wait()
    if _profiler is not None:
        _profiler.stop()
        _profiler = None
