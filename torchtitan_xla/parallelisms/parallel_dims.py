"""Parallel degrees, their validation, and the one named SPMD mesh they describe.

Mesh axes, outermost first: `pp` (pipeline stages: only activations pass between them, one
collective permute per microbatch and stage, so in a multi-slice run with pipeline parallelism the
slices are the outer part of this axis), `dp_replicate` (HSDP replicas; without pipeline
parallelism the slices are the outer part of this axis, so only gradient all-reduces cross the slow
DCN links), `fsdp` (parameters
sharded), `ep` (experts split; these devices are data-parallel ranks too, and dense parameters are
sharded over fsdp and ep together, as torchtitan's EP borrows from its FSDP dimension), `cp`
(context parallel: each sequence split over these devices; for the weights they are FSDP ranks
too, as in torchtitan), `tp` (tensor parallel, innermost so a TP group is made of neighbouring
devices; `cp` and `ep` next, so the key/value gathers and the all-to-alls stay among near
devices). Every axis always exists, with size 1 when unused, so a partition spec means the same
thing on every mesh.

All checks run before anything is compiled and each fails with one line naming the keys involved.
"""

from __future__ import annotations

from dataclasses import dataclass

from torchtitan_xla.config.run_sections import Parallelism
from torchtitan_xla.errors import ConfigError

MESH_AXES = ("pp", "dp_replicate", "fsdp", "ep", "cp", "tp")
# The batch is split over every data-parallel axis.
BATCH_AXES = ("dp_replicate", "fsdp", "ep")
# Axes that shard a dense parameter (FSDP); an expert weight, already split over `ep`, uses the others.
SHARD_AXES = ("fsdp", "ep", "cp")


@dataclass(frozen=True)
class ParallelDims:
    dp_replicate: int
    dp_shard: int
    tp: int
    num_slices: int = 1
    ep: int = 1
    cp: int = 1
    cp_load_balance: bool = True
    cp_rotate: str = "allgather"  # how attention reaches the other devices' keys: allgather or ring
    pp: int = 1
    pp_microbatches: int = 1
    pp_repeats: int = 1  # rounds of the stages per microbatch: 1 (GPipe), more (circular)

    @classmethod
    def from_config(cls, cfg: Parallelism, num_devices: int) -> ParallelDims:
        """Resolve `data_parallel_shard_degree = -1` and check the degrees fill the devices."""
        rep, shard, tp, ep, cp, pp = (cfg.data_parallel_replicate_degree, cfg.data_parallel_shard_degree,
                                      cfg.tensor_parallel_degree, cfg.expert_parallel_degree,
                                      cfg.context_parallel_degree, cfg.pipeline_parallel_degree)
        if pp > 1 and pp % cfg.num_slices:
            raise ConfigError(
                f"[parallelism] pipeline_parallel_degree ({pp}) must be a multiple of num_slices "
                f"({cfg.num_slices}): with pipeline parallelism slices hold pipeline stages")
        if pp == 1 and rep % cfg.num_slices:
            raise ConfigError(
                f"[parallelism] data_parallel_replicate_degree ({rep}) must be a multiple of "
                f"num_slices ({cfg.num_slices}): slices hold model replicas")
        fixed = pp * rep * ep * cp * tp
        if shard == -1:
            if num_devices % fixed:
                raise ConfigError(f"[parallelism] {_product(pp, rep, None, ep, cp, tp)} = {fixed} does "
                                  f"not divide the {num_devices} devices")
            shard = num_devices // fixed
        if shard * fixed != num_devices:
            raise ConfigError(f"[parallelism] {_product(pp, rep, shard, ep, cp, tp)} = "
                              f"{shard * fixed}, but there are {num_devices} devices")
        circular = cfg.pipeline_schedule == "circular"
        return cls(dp_replicate=rep, dp_shard=shard, tp=tp, num_slices=cfg.num_slices, ep=ep, cp=cp,
                   cp_load_balance=cfg.context_parallel_load_balance,
                   cp_rotate=cfg.context_parallel_rotate_method, pp=pp,
                   pp_microbatches=cfg.pipeline_microbatches or pp,
                   pp_repeats=cfg.pipeline_repeats if circular and pp > 1 else 1)

    @property
    def world_size(self) -> int:
        return self.pp * self.dp_replicate * self.dp_shard * self.ep * self.cp * self.tp

    @property
    def dp_degree(self) -> int:
        """Number of data-parallel ranks: each sees its own `local_batch_size` sequences."""
        return self.dp_replicate * self.dp_shard * self.ep

    @property
    def shard_degree(self) -> int:
        """Devices a dense parameter is sharded over (FSDP over `fsdp` x `ep` x `cp`)."""
        return self.dp_shard * self.ep * self.cp

    @property
    def seq_axis(self) -> str | None:
        """The mesh axis splitting each sequence: `cp` when context parallel, else none (a
        sequence is whole on its data-parallel rank, bar sequence parallelism inside a TP group)."""
        return "cp" if self.cp > 1 else None

    @property
    def mesh_shape(self) -> tuple[int, ...]:
        return (self.pp, self.dp_replicate, self.dp_shard, self.ep, self.cp, self.tp)

    @property
    def slice_axis(self) -> int:
        """The mesh axis whose outer part the slices are: `pp` if pipelined, else `dp_replicate`."""
        return MESH_AXES.index("pp" if self.pp > 1 else "dp_replicate")

    def check_model(self, n_heads: int, n_kv_heads: int, dim: int, ffn_hidden_dim: int,
                    num_experts: int = 0, n_layers: int = 0) -> None:
        """Tensor parallelism splits heads and hidden sizes evenly over `tp` devices, expert
        parallelism the experts over `ep` (for a model read from a checkpoint: the config's
        [moe] checks ran on the flavor)."""
        for what, size in (("n_heads", n_heads), ("n_kv_heads", n_kv_heads), ("dim", dim),
                           ("FFN hidden size", ffn_hidden_dim)):
            if size % self.tp:
                raise ConfigError(
                    f"[parallelism] tensor_parallel_degree ({self.tp}) must divide the model's "
                    f"{what} ({size})")
        if self.ep > 1 and (num_experts % self.ep or not num_experts):
            raise ConfigError(f"[parallelism] expert_parallel_degree ({self.ep}) must divide the "
                              f"model's num_experts ({num_experts})")
        if self.pp > 1 and n_layers % (self.pp * self.pp_repeats):
            repeats = f" x pipeline_repeats ({self.pp_repeats})" if self.pp_repeats > 1 else ""
            raise ConfigError(f"[parallelism] pipeline_parallel_degree ({self.pp}){repeats} must divide "
                              f"the model's n_layers ({n_layers}): every stage holds as many layers")

    def check_batch(self, global_batch: int, local_batch: int, seq_len: int, num_hosts: int) -> int:
        """Validate the batch shape; returns the gradient-accumulation steps per optimizer step."""
        per_step = local_batch * self.dp_degree
        if self.pp > 1 and local_batch % self.pp:
            raise ConfigError(
                f"[training] local_batch_size ({local_batch}) must be a multiple of "
                f"pipeline_parallel_degree ({self.pp}): outside the pipeline (embedding, loss) each "
                f"stage's devices take an equal share of every data-parallel rank's sequences")
        if local_batch % self.pp_microbatches:
            raise ConfigError(
                f"[parallelism] pipeline_microbatches ({self.pp_microbatches}) must divide [training] "
                f"local_batch_size ({local_batch}): each microbatch takes the same share of every "
                f"data-parallel rank's sequences")
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
        if self.cp > 1:
            chunks = 2 * self.cp if self.cp_load_balance else self.cp
            why = (f"2 x context_parallel_degree ({self.cp}): load balancing gives each device two "
                   f"of {chunks} equal chunks" if self.cp_load_balance
                   else f"context_parallel_degree ({self.cp})")
            if seq_len % (chunks * self.tp):
                tp = f" x tensor_parallel_degree ({self.tp})" if self.tp > 1 else ""
                raise ConfigError(f"[training] seq_len ({seq_len}) must be a multiple of {why}{tp}")
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
                                  num_slices=self.num_slices, slice_axis=self.slice_axis)


def _product(pp: int, rep: int, shard: int | None, ep: int, cp: int, tp: int) -> str:
    """The degrees' product as the error messages name it (pipeline, expert and context
    parallelism only when used)."""
    terms = [("pipeline_parallel_degree", pp if pp > 1 else None),
             ("data_parallel_replicate_degree", rep), ("data_parallel_shard_degree", shard),
             ("expert_parallel_degree", ep if ep > 1 else None),
             ("context_parallel_degree", cp if cp > 1 else None), ("tensor_parallel_degree", tp)]
    return " x ".join(f"{k} ({v})" for k, v in terms if v is not None)
