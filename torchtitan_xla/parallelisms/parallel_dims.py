"""Parallel degrees, their validation, and the one named SPMD mesh they describe.

Mesh axes, outermost first: `dp_replicate` (HSDP replicas; multi-slice runs put the slices here),
`fsdp` (parameters sharded), `tp` (tensor parallel, innermost so a TP group is made of neighbouring
devices). Every axis always exists, with size 1 when unused, so a partition spec means the same
thing on every mesh.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from torchtitan_xla.config_manager import ConfigError, Parallelism

MESH_AXES = ("dp_replicate", "fsdp", "tp")
# The batch is split over every data-parallel axis.
BATCH_AXES = ("dp_replicate", "fsdp")


@dataclass(frozen=True)
class ParallelDims:
    dp_replicate: int
    dp_shard: int
    tp: int

    @classmethod
    def from_config(cls, cfg: Parallelism, num_devices: int) -> ParallelDims:
        """Resolve `data_parallel_shard_degree = -1` and check the degrees fill the devices."""
        rep, shard, tp = (cfg.data_parallel_replicate_degree, cfg.data_parallel_shard_degree,
                          cfg.tensor_parallel_degree)
        fixed = rep * tp
        if shard == -1:
            if num_devices % fixed:
                raise ConfigError(
                    f"[parallelism] data_parallel_replicate_degree ({rep}) x tensor_parallel_degree "
                    f"({tp}) = {fixed} does not divide the {num_devices} devices")
            shard = num_devices // fixed
        if rep * shard * tp != num_devices:
            raise ConfigError(
                f"[parallelism] data_parallel_replicate_degree ({rep}) x data_parallel_shard_degree "
                f"({shard}) x tensor_parallel_degree ({tp}) = {rep * shard * tp}, but there are "
                f"{num_devices} devices")
        return cls(dp_replicate=rep, dp_shard=shard, tp=tp)

    @property
    def world_size(self) -> int:
        return self.dp_replicate * self.dp_shard * self.tp

    @property
    def dp_degree(self) -> int:
        """Number of data-parallel ranks: each sees its own `local_batch_size` sequences."""
        return self.dp_replicate * self.dp_shard

    @property
    def mesh_shape(self) -> tuple[int, int, int]:
        return (self.dp_replicate, self.dp_shard, self.tp)

    def build_mesh(self):
        import torch_xla.distributed.spmd as xs

        return xs.Mesh(np.arange(self.world_size), self.mesh_shape, MESH_AXES)
