"""The launch plan: the variables each host's process runs with, and the dry run that shows them.
Imports neither torch nor torch_xla."""

from __future__ import annotations

import os
import shlex
from collections.abc import Mapping

from torchtitan_xla.config import JobConfig
from torchtitan_xla.launch.hosts import Hosts, check_slices, resolve_hosts
from torchtitan_xla.launch.tpu import tpu_env


def cpu_device_count(job_config: JobConfig) -> int:
    """Virtual XLA CPU devices the job's mesh needs: the product of the fixed parallel degrees
    (a `data_parallel_shard_degree` of -1 counts as 1, so the default job runs on one device)."""
    p = job_config.parallelism
    shard = max(p.data_parallel_shard_degree, 1)
    return p.data_parallel_replicate_degree * shard * p.tensor_parallel_degree



def host_env(hosts: Hosts, rank: int, job_config: JobConfig, env: Mapping[str, str], *,
             metadata: bool | None = None) -> dict[str, str]:
    """The variables run_train.sh sets for the process on host `rank` (the rest of the
    environment passes through unchanged)."""
    from torchtitan_xla import runtime

    runtime.use(job_config.runtime.backend)
    out = runtime.process.launch_env(cpu_device_count(job_config), job_config.runtime.device, env,
                                     hosts.count)
    if hosts.count > 1:
        # train.py reads these (torchrun's names) whatever the scheduler was.
        out |= {"NNODES": str(hosts.count), "NODE_RANK": str(rank),
                "MASTER_ADDR": hosts.master_addr or "", "MASTER_PORT": str(hosts.master_port)}
        if hosts.hostnames:
            out["HOSTNAMES"] = ",".join(hosts.hostnames)
    if out.get("PJRT_DEVICE") == "TPU":
        out |= tpu_env(hosts, rank, job_config.parallelism.num_slices, env, metadata=metadata)
    if out.get("TTX_RUNTIME") == "native" and out["NPROC_PER_NODE"].isdigit():
        check_mesh(job_config, int(out["NPROC_PER_NODE"]) * hosts.count)
    if out.get("TTX_RUNTIME") == "native":  # torchrun's rendezvous: the hosts', or a private one
        out["TTX_RDZV"] = shlex.join(
            ["--nnodes", str(hosts.count), "--node-rank", str(rank), "--master-addr", out["MASTER_ADDR"],
             "--master-port", out["MASTER_PORT"]] if hosts.count > 1 else ["--standalone"])
    return out


def check_mesh(job_config: JobConfig, devices: int) -> None:
    """The checks of the degrees against the devices, the batch and the model that train.py makes
    once its processes are up (parallel_dims.py), made before torchrun starts them: where each of
    one process per device would print the same error, the launcher prints it once. (Imports
    torch, through the parallelisms package, as torchrun itself does next.)"""
    from torchtitan_xla.models import get_model_args, models_config, moe_overrides
    from torchtitan_xla.parallelisms import ParallelDims

    dims = ParallelDims.from_config(job_config.parallelism, devices)
    t = job_config.training
    global_batch = t.global_batch_size if t.global_batch_size > 0 else t.local_batch_size * dims.dp_degree
    dims.check_batch(global_batch, t.local_batch_size, t.seq_len, dims.dp_degree)
    if job_config.model.flavor in models_config.get(job_config.model.name, {}):  # else read at start
        args = get_model_args(job_config.model.name, job_config.model.flavor, **moe_overrides(job_config.moe))
        dims.check_model(args.n_heads, args.kv_heads, args.dim, args.ffn_hidden_dim, args.num_experts,
                         args.n_layers)


def launch_command(command: list[str], variables: Mapping[str, str]) -> list[str]:
    """`command` ([python, train.py, args...]) as run_train.sh runs it with these variables: under
    torchrun for the native runtime (NPROC_PER_NODE processes, TTX_RDZV's rendezvous; launch/torchrun.py)."""
    if variables.get("TTX_RUNTIME") != "native":
        return command
    return [command[0], "-m", "torchtitan_xla.launch.torchrun", *shlex.split(variables["TTX_RDZV"]),
            "--nproc-per-node", variables["NPROC_PER_NODE"], *command[1:]]


def plan(job_config: JobConfig, env: Mapping[str, str] = os.environ, *,
         metadata: bool | None = None) -> tuple[Hosts, dict[str, str]]:
    """Resolve and check the hosts; this host's variables. Raises ConfigError on bad input."""
    hosts = resolve_hosts(env)
    check_slices(hosts, job_config.parallelism.num_slices)
    return hosts, host_env(hosts, hosts.rank, job_config, env, metadata=metadata)


# Variables a dry run shows even when they come unchanged from the environment.
_SHOWN = ("TPU_", "MEGASCALE_", "PJRT_", "XLA_", "LIBTPU_", "CPU_NUM_DEVICES", "MASTER_", "NNODES",
          "NODE_RANK", "HOSTNAMES", "NPROC_PER_NODE", "TTX_RUNTIME", "TTX_RDZV")


def dry_run_text(job_config: JobConfig, command: list[str], env: Mapping[str, str] = os.environ, *,
                 metadata: bool | None = None) -> str:
    """What `run_train.sh --dry-run` prints: for every host, the variables it sets and the
    command it runs; XLA is not started."""
    hosts = resolve_hosts(env, dry_run=True)
    check_slices(hosts, job_config.parallelism.num_slices)
    names = hosts.hostnames or ()
    lines = [f"# {hosts.count} host(s), from {hosts.source}; the same command runs on each"]
    for rank in range(hosts.count):
        where = f" ({names[rank]})" if rank < len(names) else ""
        this = "  <- this host" if rank == hosts.rank and hosts.count > 1 else ""
        lines.append(f"# host {rank}{where}{this}")
        variables = {k: v for k, v in env.items() if k.startswith(_SHOWN)}
        variables |= host_env(hosts, rank, job_config, env, metadata=metadata)
        for k, v in sorted(variables.items()):
            lines.append(f"{k}={shlex.quote(v)}")
        lines.append(shlex.join(launch_command(command, variables)))
    return "\n".join(lines)
