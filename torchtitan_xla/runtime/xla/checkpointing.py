"""What torch.distributed.checkpoint needs from XLA: SPMD save/load planners (each host writes and
reads only its own shards, so a checkpoint loads onto any mesh), and the two copies an
asynchronous save makes (on the device, then to host memory)."""

from __future__ import annotations

from typing import Any

import torch

from torchtitan_xla.runtime.xla.device import materialise


def save_planner():
    """torch_xla's SPMD save planner, with one fix.

    For a partially replicated tensor (replicated over some mesh axis: every parameter under HSDP,
    the norms under FSDP x TP) a host's plan lists each chunk once per replica. torch's
    `dedup_tensors` then drops *every* copy of a chunk listed twice in one plan, and the tensor is
    silently missing from the checkpoint (torch_xla 2.9 + torch 2.9; the FSDP x TP resume test).
    Keeping one write item per chunk per host fixes it; across hosts torch keeps one."""
    import dataclasses

    import torch_xla.experimental.distributed_checkpoint as xc

    class SavePlanner(xc.SPMDSavePlanner):
        def set_up_planner(self, state_dict, storage_meta=None, is_coordinator: bool = False) -> None:
            # DCP's current signature (torch_xla 2.9's lacks storage_meta, which DCP warns about at
            # every save); the SPMD planner has no use for the storage metadata.
            super().set_up_planner(state_dict, is_coordinator)

        def create_local_plan(self):
            plan = super().create_local_plan()
            seen, items = set(), []
            for item in plan.items:
                key = (item.index.fqn, None if item.index.offset is None else tuple(item.index.offset))
                if key not in seen:
                    seen.add(key)
                    items.append(item)
            return dataclasses.replace(plan, items=items)

    return SavePlanner()


def load_planner():
    """torch_xla's SPMD load planner: loads in place into the (sharded) tensors of the state dict.
    They must be materialised first: it reads each shard's placement from the device data and
    fails on a tensor whose computation is still in flight."""
    import torch_xla.experimental.distributed_checkpoint as xc

    return xc.SPMDLoadPlanner()


def host_copy(states: dict[str, Any]) -> dict[str, Any]:
    """`states` (materialised) with this host's shards of every XLA tensor copied to host memory
    in one batch (torch_xla's helper for async checkpointing), so writing needs no device access.

    Safe on a background thread while the loop traces and runs the next step, because it only
    transfers buffers: sharded tensors shard by shard, replicated ones from their first copy. It
    must stay that way: a sync on the writer thread broke the training thread's step ("Check
    failed: tensor_data" while tracing), and whole-tensor transfers of sharded tensors compiled
    gather graphs there (caught by the loop's recompile check)."""
    from torch_xla.experimental.distributed_checkpoint._helpers import _sharded_cpu_state_dict

    return _sharded_cpu_state_dict(states)


def device_snapshot(states: dict[str, Any]) -> dict[str, Any]:
    """A copy of `states` the training loop cannot change: every XLA tensor cloned into new device
    buffers (each keeps its sharding, so every host still writes only its own shards), every host
    tensor cloned (the loop could change it in place), the containers rebuilt.

    Why on the device: each step donates the buffers of the parameters and the optimizer state to
    its outputs, so the step-N buffers stop existing while step N+1 runs; a copy to the host, the
    alternative, blocks for the whole transfer. The clone costs one device memcpy of the state and
    holds a second copy of it in device memory until the background thread has moved it."""
    from torch.utils._pytree import tree_flatten, tree_unflatten

    flat, spec = tree_flatten(states)
    with torch.no_grad():
        copies = [x.detach().clone() if isinstance(x, torch.Tensor) else x for x in flat]
    # A clone is lazy: until materialised it still reads the original's buffer, which the next
    # step donates. This makes the copies (and fails here if the device cannot hold them).
    materialise()
    return tree_unflatten(copies, spec)


# How an allocation failure reads: XLA's CPU client, and the TPU runtime's RESOURCE_EXHAUSTED.
OUT_OF_MEMORY = ("Out of memory", "RESOURCE_EXHAUSTED", "Ran out of memory")


def is_out_of_memory(e: BaseException) -> bool:
    return isinstance(e, RuntimeError) and any(m in str(e) for m in OUT_OF_MEMORY)
