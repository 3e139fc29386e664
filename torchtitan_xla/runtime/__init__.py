"""The runtime layer: the only part of torchtitan_xla that imports torch_xla.

Everything else is plain PyTorch and reaches XLA through the names below, so a torch_xla upgrade
or another backend (TorchTPU) is this one folder. tests/test_runtime_layer.py keeps it that way: no
module outside it imports torch_xla or sets XLA's environment variables.

- `process`: before XLA starts (no torch import): the torch_xla version check, functionalization
  per step compiler, the XLA CPU backend's compiler flags and host malloc.
- `device`: SPMD start-up, device and host counts, syncs, transfers, RNG, compile counts, memory
  statistics, profiler traces.
- `sharding`: the mesh, partition-spec annotations, activation constraints, input sharding,
  per-device regions (`per_shard`, as jax's shard_map).
- `step`: the step compilers (`replay`, `lazy`) and the recompile guard.
- `checkpointing`: DCP's SPMD planners, device snapshots and host copies for checkpoints.
- `kernels`: Pallas attention and grouped matmul, the float32-result dot, activation-checkpoint fences, scan.

`from torchtitan_xla import runtime` is cheap; each name loads its module on first use.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "device": ("init_spmd", "current_device", "device_type", "device_count", "process_index",
               "process_count", "master_ip", "sync", "materialise", "wait", "to_device", "to_host",
               "set_seed", "rng_state", "set_rng_state", "compile_stats", "metrics_report", "memory_info",
               "tpu_accelerator_type", "slice_count", "start_trace", "stop_trace"),
    "process": ("configure", "TORCH_XLA_VERSION", "STEP_COMPILERS"),
    "sharding": ("build_mesh", "mark_sharding", "constraint", "input_sharding", "copy_sharding",
                 "sharding_text", "per_shard", "Spec"),
    "step": ("build_step", "CompileGuard", "LazyStep", "ReplayedStep"),
}
_WHERE = {name: module for module, names in _EXPORTS.items() for name in names}


def __getattr__(name: str):
    if name in _WHERE:
        return getattr(importlib.import_module(f"{__name__}.{_WHERE[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(_WHERE)
