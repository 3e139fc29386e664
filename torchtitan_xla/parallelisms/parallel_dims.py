"""Parallel degrees, their validation, and the one named SPMD mesh they describe.

Mesh axes, outermost first: `dp_replicate` (HSDP replicas; in a multi-slice run the slices are the
outer part of this axis, so only gradient all-reduces cross the slow DCN links), `fsdp` (parameters
sharded), `tp` (tensor parallel, innermost so a TP group is made of neighbouring devices). Every axis
always exists, with size 1 when unused, so a partition spec means the same thing on every mesh.

All checks run before anything is compiled and each fails with one line naming the keys involved.
"""

from __future__ import annotations

from dataclasses import dataclass

from torchtitan_xla.config.job_config import Parallelism
from torchtitan_xla.errors import ConfigError

MESH_AXES = ("dp_replicate", "fsdp", "tp")
# The batch is split over every data-parallel axis.
BATCH_AXES = ("dp_replicate", "fsdp")


@dataclass(frozen=True)
class ParallelDims:
    dp_replicate: int
    dp_shard: int
    tp: int
    num_slices: int = 1

    @classmethod
    def from_config(cls, cfg: Parallelism, num_devices: int) -> ParallelDims:
        """Resolve `data_parallel_shard_degree = -1` and check the degrees fill the devices."""
        rep, shard, tp = (cfg.data_parallel_replicate_degree, cfg.data_parallel_shard_degree,
                          cfg.tensor_parallel_degree)
        if rep % cfg.num_slices:
            raise ConfigError(
                f"[parallelism] data_parallel_replicate_degree ({rep}) must be a multiple of "
                f"num_slices ({cfg.num_slices}): slices hold model replicas")
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
        return cls(dp_replicate=rep, dp_shard=shard, tp=tp, num_slices=cfg.num_slices)

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

    def check_model(self, n_heads: int, n_kv_heads: int, dim: int, ffn_hidden_dim: int) -> None:
        """Tensor parallelism splits heads and hidden sizes evenly over `tp` devices."""
        for what, size in (("n_heads", n_heads), ("n_kv_heads", n_kv_heads), ("dim", dim),
                           ("FFN hidden size", ffn_hidden_dim)):
            if size % self.tp:
                raise ConfigError(
                    f"[parallelism] tensor_parallel_degree ({self.tp}) must divide the model's "
                    f"{what} ({size})")

    def check_batch(self, global_batch: int, local_batch: int, seq_len: int, num_hosts: int) -> int:
        """Validate the batch shape; returns the gradient-accumulation steps per optimizer step."""
        per_step = local_batch * self.dp_degree
        if global_batch % per_step:
            raise ConfigError(
                f"[training] global_batch_size ({global_batch}) must be a multiple of "
                f"local_batch_size ({local_batch}) x data-parallel degree ({self.dp_degree}) = {per_step}")
        if global_batch % num_hosts:
            raise ConfigError(
                f"[training] global_batch_size ({global_batch}) must divide evenly over the "
                f"{num_hosts} hosts")
        if self.tp > 1 and seq_len % self.tp:
            raise ConfigError(
                f"[training] seq_len ({seq_len}) must be a multiple of tensor_parallel_degree "
                f"({self.tp}): sequence parallelism splits the sequence over the TP devices")
        return global_batch // per_step

    def build_mesh(self, device_type: str = "CPU"):
        """The device mesh. On TPU, `HybridMesh` orders devices by the physical (ICI) topology and,
        with several slices, puts the slices on the outer part of `dp_replicate`. Elsewhere an
        ordinary mesh of the same logical shape, slices being consecutive blocks of devices."""
        from torchtitan_xla import runtime

        if device_type == "TPU" and runtime.slice_count() != self.num_slices:
            raise ConfigError(f"[parallelism] num_slices is {self.num_slices}, but the TPU "
                              f"runtime sees {runtime.slice_count()} slice(s)")
        return runtime.build_mesh(self.mesh_shape, MESH_AXES, device_type=device_type,
                                  num_slices=self.num_slices)
