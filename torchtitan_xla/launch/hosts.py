"""Which hosts a job has and which one this is, from the scheduler's variables.

Where the hosts come from (the first that is set):
  1. torchrun style: NNODES, NODE_RANK, MASTER_ADDR, MASTER_PORT (default 29500).
  2. Slurm, one task per node: SLURM_STEP_NUM_NODES / SLURM_JOB_NUM_NODES, SLURM_PROCID,
     SLURM_STEP_NODELIST / SLURM_JOB_NODELIST (the coordinator is its first host).
  3. Neither: one host, or a TPU VM pod whose metadata server tells the TPU runtime everything
     (`gcloud compute tpus tpu-vm ssh --worker=all`).

Inside train.py the XLA runtime has the last word on TPU (`host_identity`); on the CPU backend,
where processes cannot form one mesh, the launcher's variables give each process its host identity.
Imports neither torch nor torch_xla.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass

from torchtitan_xla.errors import ConfigError

DEFAULT_MASTER_PORT = 29500


@dataclass(frozen=True)
class Hosts:
    """The hosts of a job, as the launcher sees them, from this host's point of view."""
    count: int
    rank: int
    master_addr: str | None = None  # coordinator of the CPU-side (gloo) group; host 0
    master_port: int = DEFAULT_MASTER_PORT
    hostnames: tuple[str, ...] | None = None  # every host's name in rank order, when known
    source: str = "single host"  # which variables said so (shown in messages)
    # This host's rank in the gloo group when it is not `rank`: the group's rank 0 must run on
    # MASTER_ADDR, which is NODE_RANK 0's host, while on TPU `rank` is the runtime's process
    # index (the two orders can differ when a metadata server numbers the workers).
    group_rank: int | None = None


# --------------------------------------------------------------------------------------------
# Slurm node lists
# --------------------------------------------------------------------------------------------

_RANGE = re.compile(r"^(\d+)(?:-(\d+))?$")


def parse_nodelist(nodelist: str) -> list[str]:
    """Expand a Slurm host list such as `tpu-[0-3,7],gpu01` or `rack[1-2]-n[01-02]` as Slurm does
    (zero padding follows the lower bound, several bracket groups expand left to right, nothing
    may follow the last bracket group)."""
    items, depth, start = [], 0, 0
    for i, c in enumerate(nodelist + ","):
        if c == "[":
            depth += 1
        elif c == "]":
            depth -= 1
        elif c == "," and depth == 0:
            items.append(nodelist[start:i].strip())
            start = i + 1
        if depth not in (0, 1):
            raise ConfigError(f"Slurm node list {nodelist!r}: unbalanced brackets")
    if depth:
        raise ConfigError(f"Slurm node list {nodelist!r}: unbalanced brackets")
    hosts: list[str] = []
    for item in items:
        if not item:
            continue
        if "]" in item and not item.endswith("]"):
            raise ConfigError(f"Slurm node list {nodelist!r}: text after the last ']' in {item!r}")
        names = [""]
        for literal, ranges in re.findall(r"([^\[\]]*)(?:\[([^\]]*)\])?", item):
            expanded = [literal]
            if ranges:
                numbers = []
                for part in ranges.split(","):
                    m = _RANGE.match(part.strip())
                    if not m:
                        raise ConfigError(f"Slurm node list {nodelist!r}: bad range {part!r}")
                    lo, hi = m.group(1), m.group(2) or m.group(1)
                    if int(hi) < int(lo):
                        raise ConfigError(f"Slurm node list {nodelist!r}: bad range {part!r}")
                    numbers += [str(n).zfill(len(lo)) for n in range(int(lo), int(hi) + 1)]
                expanded = [literal + n for n in numbers]
            names = [a + b for a in names for b in expanded]
        hosts += names
    return hosts


def expand_nodelist(nodelist: str, env: Mapping[str, str]) -> list[str]:
    """Slurm's own `scontrol show hostnames` where Slurm is configured, else `parse_nodelist`."""
    if shutil.which("scontrol") and (env.get("SLURM_CONF") or os.path.exists("/etc/slurm/slurm.conf")):
        p = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True,
                           text=True, env=dict(env), timeout=30)
        if p.returncode == 0 and p.stdout.split():
            return p.stdout.split()
    return parse_nodelist(nodelist)


# --------------------------------------------------------------------------------------------
# Which host is this
# --------------------------------------------------------------------------------------------


def _int(env: Mapping[str, str], name: str) -> int:
    try:
        return int(env[name])
    except ValueError:
        raise ConfigError(f"{name}={env[name]!r}: expected an integer") from None


def resolve_hosts(env: Mapping[str, str] = os.environ, *, dry_run: bool = False) -> Hosts:
    """The job's hosts from torchrun-style or Slurm variables (see the module doc); ConfigError
    with one line when they are missing or disagree. Only a `dry_run` (which describes every
    host) may leave NODE_RANK unset, or run in the batch script of a multi-node Slurm job."""
    port = _int(env, "MASTER_PORT") if env.get("MASTER_PORT") else DEFAULT_MASTER_PORT
    if env.get("NNODES") or env.get("NODE_RANK"):
        if dry_run and not env.get("NODE_RANK"):
            env = {**env, "NODE_RANK": "0"}
        if not env.get("NNODES") or not env.get("NODE_RANK"):
            missing = "NODE_RANK" if env.get("NNODES") else "NNODES"
            raise ConfigError(f"{missing} is not set: a multi-host launch needs both NNODES and "
                              f"NODE_RANK (this host's index, 0..NNODES-1)")
        count, rank = _int(env, "NNODES"), _int(env, "NODE_RANK")
        if count < 1 or not 0 <= rank < count:
            raise ConfigError(f"NODE_RANK={rank} with NNODES={count}: expected 0 <= NODE_RANK < NNODES")
        slurm_nodes = _slurm_nodes(env)
        if slurm_nodes is not None and slurm_nodes != count:
            raise ConfigError(f"inconsistent host counts: NNODES={count}, but the Slurm allocation "
                              f"has {slurm_nodes} node(s)")
        hostnames = None
        if env.get("HOSTNAMES"):
            hostnames = tuple(h for h in env["HOSTNAMES"].split(",") if h)
            if len(hostnames) != count:
                raise ConfigError(f"inconsistent host counts: NNODES={count}, but HOSTNAMES "
                                  f"lists {len(hostnames)} host(s)")
        master = env.get("MASTER_ADDR") or (hostnames[0] if hostnames else None)
        if count > 1 and not master:
            raise ConfigError(f"MASTER_ADDR is not set: NNODES={count} needs the coordinator's "
                              f"address (the host with NODE_RANK=0) on every host")
        return Hosts(count, rank, master, port, hostnames, "NNODES/NODE_RANK")

    nodes = _slurm_nodes(env)
    if nodes is not None:
        nodelist = (env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST")
                    or env.get("SLURM_NODELIST"))
        if not nodelist:
            raise ConfigError("SLURM_JOB_NODELIST is not set: cannot tell the coordinator of this "
                              "Slurm job")
        hostnames = tuple(expand_nodelist(nodelist, env))
        if len(hostnames) != nodes:
            raise ConfigError(f"inconsistent host counts: Slurm says {nodes} node(s), but its node "
                              f"list {nodelist!r} has {len(hostnames)}")
        in_step = "SLURM_STEP_ID" in env
        if nodes > 1 and not dry_run and not in_step:
            raise ConfigError(f"this is the batch script of a {nodes}-node Slurm job: start the "
                              f"training on every node with `srun --ntasks-per-node=1 run_train.sh` "
                              f"(see multinode_trainer.slurm)")
        tasks = env.get("SLURM_STEP_NUM_TASKS") if in_step else None
        if tasks and int(tasks) != nodes:
            raise ConfigError(f"inconsistent host counts: srun started {tasks} task(s) on {nodes} "
                              f"node(s); XLA needs one process per node (srun --ntasks-per-node=1)")
        rank = _int(env, "SLURM_PROCID") if in_step else 0
        master = env.get("MASTER_ADDR") or hostnames[0]
        return Hosts(nodes, rank, master, port, hostnames, "Slurm")

    return Hosts(1, 0, env.get("MASTER_ADDR"), port, None, "single host")


def _slurm_nodes(env: Mapping[str, str]) -> int | None:
    for name in ("SLURM_STEP_NUM_NODES", "SLURM_JOB_NUM_NODES", "SLURM_NNODES"):
        if env.get(name):
            return _int(env, name)
    return None


def check_slices(hosts: Hosts, num_slices: int) -> None:
    """Slices are groups of whole hosts: the host count must be a multiple of the slice count."""
    if num_slices > 1 and hosts.count % num_slices:
        raise ConfigError(f"[parallelism] num_slices = {num_slices}, but the job has "
                          f"{hosts.count} host(s) ({hosts.source}): expected a multiple of "
                          f"{num_slices} hosts, the same number per slice")


def host_identity(xla_index: int, xla_count: int, device_type: str,
                  env: Mapping[str, str] = os.environ, *, per_device: bool = False) -> Hosts:
    """This process's host rank and count: the XLA runtime's on a real multi-host mesh, the
    launcher's variables where XLA cannot know (the CPU backend: each process has its own mesh).
    ConfigError when the two disagree."""
    launcher = resolve_hosts(env)
    if xla_count > 1:
        # With a process per device (the native runtime) each host runs several.
        if launcher.count > 1 and (xla_count % launcher.count if per_device else
                                   launcher.count != xla_count):
            raise ConfigError(f"inconsistent host counts: the launcher says {launcher.count} host(s) "
                              f"({launcher.source}), the {device_type} runtime joined {xla_count}")
        return Hosts(xla_count, xla_index, launcher.master_addr, launcher.master_port,
                     launcher.hostnames, f"{device_type} runtime",
                     group_rank=launcher.rank if launcher.count > 1 else None)
    if launcher.count > 1 and device_type != "CPU":
        raise ConfigError(f"the launcher says {launcher.count} hosts ({launcher.source}), but the "
                          f"{device_type} runtime formed a mesh of this host alone: check the TPU "
                          f"variables with `run_train.sh --dry-run`")
    return launcher
