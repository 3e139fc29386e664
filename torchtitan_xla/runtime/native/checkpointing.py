"""What torch.distributed.checkpoint needs on the native runtime: DCP's own planners, which save
and load DTensors shard by shard (each process writes its own blocks; any mesh loads them). An
asynchronous save writes a copy of each process's blocks made on its device (`device_snapshot`)
while training goes on; DCP copies to the host as it writes.

The planners flatten the state into keys as the XLA runtime's (torch_xla's) do, so that either
runtime reads the other's checkpoints: a dict or list with no tensor inside is one key
(`lr_scheduler`, `optimizer.param_groups`), where DCP's default would give each field its own."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch


def _holds_tensors(value) -> bool:
    if isinstance(value, torch.Tensor):
        return True
    items = value.values() if isinstance(value, Mapping) else value if isinstance(value, list) else ()
    return any(_holds_tensors(v) for v in items)


def flatten(state: dict[str, Any]) -> tuple[dict[str, Any], dict[str, tuple]]:
    """(flat state, key -> path): containers are entered only where they hold tensors."""
    flat: dict[str, Any] = {}
    paths: dict[str, tuple] = {}

    def visit(path: tuple, value) -> None:
        if isinstance(value, Mapping) and _holds_tensors(value):
            for k, v in value.items():
                visit((*path, str(k)), v)
        elif isinstance(value, list) and _holds_tensors(value):
            for i, v in enumerate(value):
                visit((*path, i), v)
        else:
            key = ".".join(map(str, path))
            flat[key], paths[key] = value, path

    for k, v in state.items():
        visit((k,), v)
    return flat, paths


def save_planner():
    from torch.distributed.checkpoint import DefaultSavePlanner

    class SavePlanner(DefaultSavePlanner):
        def set_up_planner(self, state_dict, storage_meta=None, is_coordinator: bool = False) -> None:
            flat, paths = flatten(state_dict)
            super().set_up_planner(flat, storage_meta, is_coordinator)
            self.mappings, self.flatten_state_dict = paths, True

    # (flatten_sharded_tensors rebuilds the state from its leaves: a container with none inside,
    # LambdaLR's lr_lambdas = [{}], would vanish. There are no ShardedTensors here.)
    return SavePlanner(flatten_state_dict=False, flatten_sharded_tensors=False)


def load_planner():
    from torch.distributed.checkpoint import DefaultLoadPlanner

    class LoadPlanner(DefaultLoadPlanner):
        def set_up_planner(self, state_dict, metadata=None, is_coordinator: bool = False) -> None:
            flat, paths = flatten(state_dict)
            super().set_up_planner(flat, metadata, is_coordinator)
            # Tensors load in place; other values are put back where `paths` says.
            self.original_state_dict, self.mappings, self.flatten_state_dict = state_dict, paths, True

    return LoadPlanner(flatten_state_dict=False, flatten_sharded_tensors=False)


def host_copy(states: dict[str, Any]) -> dict[str, Any]:
    """The state as it is: DCP copies each process's blocks to the host while writing."""
    return states


def device_snapshot(states: dict[str, Any]) -> Any:
    """A copy of every tensor in `states` on its device, a DTensor's block with its layout, for a
    save written while the training loop updates the originals."""
    from torch.distributed.tensor import DTensor

    def copy(value):
        if isinstance(value, DTensor):
            return DTensor.from_local(value.to_local().detach().clone(), value.device_mesh, value.placements,
                                      run_check=False, shape=value.shape, stride=value.stride())
        if isinstance(value, torch.Tensor):
            return value.detach().clone()
        if isinstance(value, Mapping):
            return {k: copy(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return type(value)(copy(v) for v in value)
        return value

    return copy(states)


def is_out_of_memory(e: BaseException) -> bool:
    return isinstance(e, torch.OutOfMemoryError)
