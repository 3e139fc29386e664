"""The runtime layer: one interface, two implementations, one folder each.

- `xla/`: torch_xla / XLA SPMD. One process per host drives all its devices; shardings are
  annotations on one named mesh and XLA partitions each step, one graph per step.
- `native/`: native PyTorch distributed. One process per device (TorchTPU's `tpu`, CUDA, or the
  CPU with gloo, where several processes really form one mesh); shardings are DTensor placements
  on a DeviceMesh with the same axis names; the step is a few torch.compile'd graphs, or
  compiled per block, or eager.

Everything else in torchtitan_xla is plain PyTorch: it asks `runtime.<name>` and the chosen
runtime answers, so no module outside this folder imports either implementation (or torch_xla;
tests/test_runtime_layer.py keeps it that way). `use(backend)` chooses, before the first question
(train.py does it from `[runtime] backend`); the default is "xla".

Both implementations have the same modules and names:
- `process`: before the runtime starts (no torch import): `configure`.
- `device`: start-up, device and process counts, syncs, transfers, RNG, compile counts, memory
  statistics, profiler traces.
- `sharding`: the mesh, partition specs applied to parameters (`mark_sharding`, `place`,
  `distribute_module`) and activations (`constraint`), input layout, per-device regions.
- `step`: the step (`build_step`), its compiled regions (`region`) and the recompile guard.
- `checkpointing`: DCP planners, device snapshots and host copies for checkpoints.
- `kernels`: attention and grouped-matmul kernels, the float32-result dot, checkpoint fences, scan.
`compiled` (the compiled step's HLO, for the plan) is the XLA runtime's only.

`from torchtitan_xla import runtime` is cheap; each name loads its module on first use.
"""

from __future__ import annotations

import importlib

BACKENDS = ("xla", "native")

_EXPORTS = {
    "device": ("init_devices", "current_device", "device_type", "device_count", "process_index",
               "process_count", "master_ip", "sync", "materialise", "wait", "to_device", "to_host",
               "set_seed", "rng_state", "set_rng_state", "compile_stats", "metrics_report",
               "memory_info", "accelerator_type", "slice_count", "start_trace", "stop_trace",
               "autocast_device_type", "initialising", "PROCESS_PER_DEVICE"),
    "process": ("configure", "STEP_COMPILERS", "launch_env"),
    "sharding": ("build_mesh", "mark_sharding", "place", "distribute_module", "constraint",
                 "input_sharding", "data_shard", "copy_sharding", "sharding_text", "per_shard",
                 "run_locally", "whole", "batched_over"),
    "step": ("build_step", "region", "CompileGuard"),
}
_MODULES = ("process", "device", "sharding", "step", "kernels", "checkpointing", "compiled")
_WHERE = {name: module for module, names in _EXPORTS.items() for name in names}
_backend = "xla"

# A partition spec: one mesh axis name, a tuple of them, or None per tensor dimension.
Spec = tuple


def use(backend: str) -> None:
    """Answer every later question from `backend`'s implementation ("xla" or "native")."""
    global _backend
    if backend not in BACKENDS:
        raise ValueError(f"unknown runtime {backend!r}; expected one of {BACKENDS}")
    _backend = backend


def backend() -> str:
    return _backend


def __getattr__(name: str):
    if name in _MODULES:
        return importlib.import_module(f"{__name__}.{_backend}.{name}")
    if name in _WHERE:
        return getattr(importlib.import_module(f"{__name__}.{_backend}.{_WHERE[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*_WHERE, *_MODULES, "use", "backend", "BACKENDS", "Spec"})
