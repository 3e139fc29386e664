"""Multi-host launch: from the scheduler's variables to what each host's runtime needs.

Jobs are started the Slurm/torchrun way: the same command on every host. XLA SPMD runs one process
per host that drives all of the host's chips; the TPU runtime joins the hosts into one mesh. This
module decides, from the environment, how many hosts there are and which one this is, checks that
the answer is consistent, and says which variables each host's process needs. run_train.sh calls:

    python -m torchtitan_xla.launch --exports     [train.py options]  # `export` lines, for eval
    python -m torchtitan_xla.launch --dry-run     [train.py options]  # per host: command + env
    python -m torchtitan_xla.launch --check-hosts [train.py options]  # join the hosts, compare data
    python -m torchtitan_xla.launch --cpu-devices [train.py options]  # virtual CPU devices needed
    python -m torchtitan_xla.launch --dump-folder [train.py options]  # the job's output folder

Where the hosts come from (the first that is set):
  1. torchrun style: NNODES, NODE_RANK, MASTER_ADDR, MASTER_PORT (default 29500).
  2. Slurm, one task per node: SLURM_STEP_NUM_NODES / SLURM_JOB_NUM_NODES, SLURM_PROCID,
     SLURM_STEP_NODELIST / SLURM_JOB_NODELIST (the coordinator is its first host).
  3. Neither: one host, or a TPU VM pod whose metadata server tells the TPU runtime everything
     (`gcloud compute tpus tpu-vm ssh --worker=all`).

Inside train.py the XLA runtime has the last word on TPU (`host_identity`); on the CPU backend,
where processes cannot form one mesh, the launcher's variables give each process its host identity.
Everything above imports neither torch nor torch_xla; `init_host_group` and `check_hosts` do.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import socket
import subprocess
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from torchtitan_xla.config_manager import ConfigError, JobConfig, parse_args

DEFAULT_MASTER_PORT = 29500
DEFAULT_MEGASCALE_PORT = 8081
_TPU_METADATA_URL = "http://metadata.google.internal/computeMetadata/v1/instance/attributes/"


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


# --------------------------------------------------------------------------------------------
# TPU runtime variables
# --------------------------------------------------------------------------------------------

# Chips in a slice per unit of its accelerator-type suffix: v2/v3/v4/v5p count TensorCores (two
# per chip), v5e (v5litepod) and v6e count chips. Every multi-host slice of these has 4 chips
# per host (2x2x1); single hosts of v5e/v6e hold up to 8.
_CORES_PER_CHIP = {"v2": 2, "v3": 2, "v4": 2, "v5p": 2, "v5litepod": 1, "v5e": 1, "v6e": 1}
_CHIPS_PER_HOST_BOUNDS = (2, 2, 1)


def tpu_hosts_per_slice(accelerator_type: str) -> int | None:
    """Hosts in one slice of this accelerator type (e.g. v4-32: 16 chips, 4 hosts); None when
    the type is not in the table."""
    m = re.match(r"^(v\d+[a-z]*)-(\d+)$", accelerator_type)
    if not m or m.group(1) not in _CORES_PER_CHIP:
        return None
    chips = int(m.group(2)) // _CORES_PER_CHIP[m.group(1)]
    if m.group(1) in ("v5litepod", "v5e", "v6e") and chips <= 8:
        return 1
    return max(1, chips // 4)


def _bounds(text: str, what: str) -> tuple[int, int, int]:
    dims = [int(d) for d in re.split(r"[x,]", text)] if re.fullmatch(r"\d+([x,]\d+){1,2}", text) else []
    if not dims:
        raise ConfigError(f"{what}={text!r}: expected a shape like 2x2x4")
    return tuple((dims + [1, 1])[:3])  # type: ignore[return-value]


def metadata_server_answers(timeout: float = 1.0) -> bool:
    """True on a Cloud TPU VM, whose metadata server tells libtpu the slice's topology."""
    import urllib.request

    try:
        req = urllib.request.Request(_TPU_METADATA_URL, headers={"Metadata-Flavor": "Google"})
        with urllib.request.urlopen(req, timeout=timeout):
            return True
    except OSError:
        return False


def tpu_env(hosts: Hosts, rank: int, num_slices: int, env: Mapping[str, str], *,
            metadata: bool | None = None) -> dict[str, str]:
    """What libtpu needs on host `rank` of a multi-host job when no metadata server describes
    the slice (GKE, Slurm on bare hosts), plus the MEGASCALE_* variables joining several slices
    over the data-center network. Values the user set win. `metadata`: whether a metadata
    server answers (None: ask it, only if TPU_ACCELERATOR_TYPE is not given)."""
    out: dict[str, str] = {}
    if hosts.count == 1:
        return out
    per_slice = hosts.count // num_slices
    slice_id, worker = divmod(rank, per_slice)
    hostnames = hosts.hostnames
    if num_slices > 1 and "MEGASCALE_COORDINATOR_ADDRESS" not in env:
        if not hosts.master_addr:
            raise ConfigError("MASTER_ADDR is not set: a multi-slice job needs the coordinator's "
                              "address for MEGASCALE_COORDINATOR_ADDRESS")
        out |= {"MEGASCALE_COORDINATOR_ADDRESS": hosts.master_addr,
                "MEGASCALE_PORT": env.get("MEGASCALE_PORT", str(DEFAULT_MEGASCALE_PORT)),
                "MEGASCALE_NUM_SLICES": str(num_slices), "MEGASCALE_SLICE_ID": str(slice_id)}
    if env.get("TPU_WORKER_HOSTNAMES") or env.get("TPU_SKIP_MDS_QUERY"):
        # Set by the platform (GKE's TPU webhook): only check that it describes this job.
        given = [h for h in env.get("TPU_WORKER_HOSTNAMES", "").split(",") if h]
        if given and len(given) != per_slice:
            raise ConfigError(f"inconsistent host counts: TPU_WORKER_HOSTNAMES lists {len(given)} "
                              f"host(s), but {hosts.count} host(s) in {num_slices} slice(s) "
                              f"({hosts.source}) means {per_slice} per slice")
        return out
    accelerator = env.get("TPU_ACCELERATOR_TYPE")
    if not accelerator:
        if metadata is None:
            metadata = metadata_server_answers()
        if metadata:
            return out  # a TPU VM: libtpu reads the slice from the metadata server
        raise ConfigError("TPU_ACCELERATOR_TYPE is not set and no TPU metadata server answers: "
                          "a multi-host TPU job needs it (e.g. v4-32) and TPU_TOPOLOGY (e.g. 2x2x4)")
    expected = tpu_hosts_per_slice(accelerator)
    if expected is not None and expected != per_slice:
        raise ConfigError(
            f"inconsistent host counts: a {accelerator} slice has {expected} host(s); "
            f"{num_slices} slice(s) need {expected * num_slices}, but the job has {hosts.count} "
            f"({hosts.source})")
    if hostnames is None:
        raise ConfigError("TPU_WORKER_HOSTNAMES is not set: with NNODES/NODE_RANK the launcher "
                          "does not know the other hosts' names; set HOSTNAMES (all hosts, in "
                          "NODE_RANK order) or TPU_WORKER_HOSTNAMES (this slice's hosts)")
    slice_hosts = hostnames[slice_id * per_slice:(slice_id + 1) * per_slice]
    out |= {"TPU_SKIP_MDS_QUERY": "1", "TPU_ACCELERATOR_TYPE": accelerator,
            "TPU_WORKER_ID": str(worker), "TPU_WORKER_HOSTNAMES": ",".join(slice_hosts)}
    if per_slice == 1:
        host_bounds = (1, 1, 1)
        chip_bounds = _bounds(env["TPU_TOPOLOGY"], "TPU_TOPOLOGY") if env.get("TPU_TOPOLOGY") else None
    else:
        if not env.get("TPU_TOPOLOGY") and not env.get("TPU_HOST_BOUNDS"):
            raise ConfigError(f"TPU_TOPOLOGY is not set: the launcher needs the slice's chip "
                              f"topology (e.g. 2x2x4 for v4-32) to tell libtpu how the "
                              f"{per_slice} hosts are arranged")
        chip_bounds = _CHIPS_PER_HOST_BOUNDS
        if env.get("TPU_HOST_BOUNDS"):
            host_bounds = _bounds(env["TPU_HOST_BOUNDS"], "TPU_HOST_BOUNDS")
        else:
            topology = _bounds(env["TPU_TOPOLOGY"], "TPU_TOPOLOGY")
            if any(t % c for t, c in zip(topology, chip_bounds)):
                raise ConfigError(f"TPU_TOPOLOGY={env['TPU_TOPOLOGY']}: not made of 2x2x1 hosts")
            host_bounds = tuple(t // c for t, c in zip(topology, chip_bounds))  # type: ignore[assignment]
        if host_bounds[0] * host_bounds[1] * host_bounds[2] != per_slice:
            raise ConfigError(f"inconsistent host counts: TPU host bounds {host_bounds} hold "
                              f"{host_bounds[0] * host_bounds[1] * host_bounds[2]} hosts, the "
                              f"job has {per_slice} per slice")
    fmt = ",".join
    out |= {"TPU_HOST_BOUNDS": fmt(map(str, host_bounds)), "TPU_PROCESS_BOUNDS": fmt(map(str, host_bounds))}
    if chip_bounds is not None:
        out |= {"TPU_CHIPS_PER_HOST_BOUNDS": fmt(map(str, chip_bounds)),
                "TPU_CHIPS_PER_PROCESS_BOUNDS": fmt(map(str, chip_bounds))}
    return {k: v for k, v in out.items() if k not in env}


# --------------------------------------------------------------------------------------------
# The launch plan: what each host's process runs with
# --------------------------------------------------------------------------------------------


def cpu_device_count(job_config: JobConfig) -> int:
    """Virtual XLA CPU devices the job's mesh needs: the product of the fixed parallel degrees
    (a `data_parallel_shard_degree` of -1 counts as 1, so the default job runs on one device)."""
    p = job_config.parallelism
    shard = max(p.data_parallel_shard_degree, 1)
    return p.data_parallel_replicate_degree * shard * p.tensor_parallel_degree


# XLA CPU compiler flags train.py adds on the CPU backend (docs/performance.md); a flag that
# XLA_FLAGS already names is left as the user set it. Neither applies to TPU.
# - Copy insertion with region analysis: the step updates the parameters and Adam state in buffers
#   it donates, and XLA copies around those updates; with it the debug step has 450 instead of
#   700 copies and its graph ran 4-14% faster in three alternating runs. No number changes.
# - 512-bit vectors for XLA's own kernels (the fusions; the matmuls are library code), where the
#   CPU has AVX-512: LLVM's default prefers 256-bit ones. The debug step 2.5-4.2% faster in three
#   alternating runs; reductions are vectorised in another order, so floats can differ in the
#   last bit (losses within 1.4e-7 relative over 20 steps).
def cpu_xla_flags(xla_flags: str, cpu_features: set[str]) -> str:
    """`xla_flags` (the user's XLA_FLAGS) with ours added; `cpu_features` as in /proc/cpuinfo."""
    ours = {"xla_cpu_copy_insertion_use_region_analysis": "true"}
    if "avx512f" in cpu_features:
        ours["xla_cpu_prefer_vector_width"] = "512"
    added = [f"--{name}={value}" for name, value in ours.items() if f"--{name}=" not in xla_flags]
    return " ".join([xla_flags, *added]).strip()


def cpu_features() -> set[str]:
    """This CPU's feature flags (/proc/cpuinfo; empty where there is none)."""
    try:
        with open("/proc/cpuinfo") as fh:
            return next((set(line.split(":", 1)[1].split()) for line in fh
                         if line.startswith("flags")), set())
    except OSError:
        return set()


# Host malloc on the XLA CPU backend. XLA CPU mallocs each execution's temporary buffer (343 MB
# for the debug model's step) and frees it at the end; glibc returns a block that large to the
# kernel at once, so every step faults it in again and the kernel zeroes it (docs/performance.md,
# "Host memory"). Two remedies, both read only when a process starts, hence exported variables:
# - tcmalloc (gperftools), preloaded where it is installed (`apt-get install libtcmalloc-minimal4`):
#   it keeps freed spans and hands the same memory back next step. Debug step 2-11% faster than
#   with huge pages alone in A/Bs, rounds steadier. Its "large alloc" report (stderr, from 1 GiB)
#   is switched off: XLA's temporaries are large by design.
# - glibc's transparent huge pages (always set; what is left when tcmalloc is absent): the same
#   faults come 2 MB at a time. Debug step 27-32% faster than plain glibc, same losses.
# A GLIBC_TUNABLES or LD_PRELOAD already in the environment is left as it is: set either empty to
# turn ours off. Without transparent huge pages (/sys/kernel/mm/transparent_hugepage/enabled =
# never) the glibc setting changes nothing.
CPU_GLIBC_TUNABLES = "glibc.malloc.hugetlb=1"
TCMALLOC_NAMES = ("tcmalloc_minimal", "tcmalloc")


def find_tcmalloc() -> str | None:
    """The installed tcmalloc's soname (what LD_PRELOAD needs), or None."""
    import ctypes.util

    return next(filter(None, map(ctypes.util.find_library, TCMALLOC_NAMES)), None)


def cpu_malloc_env(env: Mapping[str, str]) -> dict[str, str]:
    """The malloc variables for a process on the CPU backend, given the environment `env` (whose
    variables win) and the tcmalloc installed here, if any."""
    out = {"GLIBC_TUNABLES": env.get("GLIBC_TUNABLES", CPU_GLIBC_TUNABLES)}
    if "LD_PRELOAD" not in env and (tcmalloc := find_tcmalloc()):
        out |= {"LD_PRELOAD": tcmalloc, "TCMALLOC_LARGE_ALLOC_REPORT_THRESHOLD": str(1 << 40)}
    return out


def host_env(hosts: Hosts, rank: int, job_config: JobConfig, env: Mapping[str, str], *,
             metadata: bool | None = None) -> dict[str, str]:
    """The variables run_train.sh sets for the process on host `rank` (the rest of the
    environment passes through unchanged)."""
    device = env.get("PJRT_DEVICE", "CPU")
    out = {"PJRT_DEVICE": device}
    if device == "CPU":
        out["CPU_NUM_DEVICES"] = env.get("CPU_NUM_DEVICES") or str(cpu_device_count(job_config))
        out |= cpu_malloc_env(env)
    if hosts.count > 1:
        # train.py reads these (torchrun's names) whatever the scheduler was.
        out |= {"NNODES": str(hosts.count), "NODE_RANK": str(rank),
                "MASTER_ADDR": hosts.master_addr or "", "MASTER_PORT": str(hosts.master_port)}
        if hosts.hostnames:
            out["HOSTNAMES"] = ",".join(hosts.hostnames)
    if device == "TPU":
        out |= tpu_env(hosts, rank, job_config.parallelism.num_slices, env, metadata=metadata)
    return out


def plan(job_config: JobConfig, env: Mapping[str, str] = os.environ, *,
         metadata: bool | None = None) -> tuple[Hosts, dict[str, str]]:
    """Resolve and check the hosts; this host's variables. Raises ConfigError on bad input."""
    hosts = resolve_hosts(env)
    check_slices(hosts, job_config.parallelism.num_slices)
    return hosts, host_env(hosts, hosts.rank, job_config, env, metadata=metadata)


# Variables a dry run shows even when they come unchanged from the environment.
_SHOWN = ("TPU_", "MEGASCALE_", "PJRT_", "XLA_", "LIBTPU_", "CPU_NUM_DEVICES", "MASTER_", "NNODES",
          "NODE_RANK", "HOSTNAMES")


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
        lines.append(shlex.join(command))
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------
# Inside the training process
# --------------------------------------------------------------------------------------------


def host_identity(xla_index: int, xla_count: int, device_type: str,
                  env: Mapping[str, str] = os.environ) -> Hosts:
    """This process's host rank and count: the XLA runtime's on a real multi-host mesh, the
    launcher's variables where XLA cannot know (the CPU backend: each process has its own mesh).
    ConfigError when the two disagree."""
    launcher = resolve_hosts(env)
    if xla_count > 1:
        if launcher.count > 1 and launcher.count != xla_count:
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


def init_host_group(hosts: Hosts, timeout_s: float = 1800):
    """The CPU-side (gloo) process group over all hosts, for checkpoint barriers and small host
    collectives; checks that every host agrees on the job's shape. Returns the group."""
    from datetime import timedelta

    import torch.distributed as dist

    addr = hosts.master_addr
    if not addr:
        import torch_xla.runtime as xr

        addr = xr.get_master_ip()  # a TPU pod configured by its metadata server: process 0's IP
    rank = hosts.rank if hosts.group_rank is None else hosts.group_rank
    dist.init_process_group("gloo", init_method=f"tcp://{addr}:{hosts.master_port}",
                            rank=rank, world_size=hosts.count, timeout=timedelta(seconds=timeout_s))
    me = {"rank": rank, "count": hosts.count, "coordinator": f"{addr}:{hosts.master_port}",
          "host": socket.gethostname(), "pid": os.getpid()}
    everyone: list[dict] = [{} for _ in range(hosts.count)]
    dist.all_gather_object(everyone, me)
    if sorted(h["rank"] for h in everyone) != list(range(hosts.count)) or any(
            (h["count"], h["coordinator"]) != (me["count"], me["coordinator"]) for h in everyone):
        raise ConfigError(f"the hosts disagree on the job's shape: {everyone}")
    from torchtitan_xla.logging import logger

    logger.info(f"Host group (gloo): {hosts.count} hosts, coordinator {me['coordinator']}; "
                + ", ".join(f"{h['rank']}={h['host']}:{h['pid']}" for h in everyone))
    return dist.group.WORLD


def check_hosts(job_config: JobConfig, *, sequences: int = 16) -> dict:
    """A launch check without XLA: join the host group and compare the first `sequences`
    training sequences each host's data loader yields. Fails when two hosts would train on the
    same data. Returns what rank 0 reports (printed as one JSON line by --check-hosts)."""
    import hashlib

    import torch.distributed as dist

    from torchtitan_xla.datasets import build_data_loader, build_tokenizer

    hosts = resolve_hosts()
    check_slices(hosts, job_config.parallelism.num_slices)
    if hosts.count > 1:
        init_host_group(hosts)
    tokenizer = build_tokenizer(job_config.model.tokenizer_path)
    loader = build_data_loader(job_config, tokenizer, batch_size=1, host_rank=hosts.rank,
                               host_count=hosts.count)
    fingerprints = []
    for _, (inputs, _labels) in zip(range(sequences), loader):
        fingerprints.append(hashlib.sha256(inputs.numpy().tobytes()).hexdigest()[:16])
    if hasattr(loader, "close"):
        loader.close()
    mine = {"rank": hosts.rank, "count": hosts.count,
            "coordinator": f"{hosts.master_addr}:{hosts.master_port}", "sequences": fingerprints}
    everyone = [mine]
    if hosts.count > 1:
        everyone = [{} for _ in range(hosts.count)]
        dist.all_gather_object(everyone, mine)
    if hosts.count > 1:
        dist.destroy_process_group()
    check_disjoint(everyone)
    return {"rank": hosts.rank, "hosts": everyone}


def check_disjoint(reports: list[dict]) -> None:
    """ConfigError if two hosts' reports share a sequence fingerprint."""
    seen: dict[str, int] = {}
    for h in reports:
        for f in h["sequences"]:
            if seen.setdefault(f, h["rank"]) != h["rank"]:
                raise ConfigError(f"hosts {seen[f]} and {h['rank']} read the same training "
                                  f"sequence: the data is not split between hosts")


# --------------------------------------------------------------------------------------------
# Command line (run_train.sh)
# --------------------------------------------------------------------------------------------


def main(argv: list[str]) -> int:
    modes = ("--cpu-devices", "--exports", "--dry-run", "--check-hosts", "--dump-folder")
    if not argv or argv[0] not in modes:
        print(__doc__.strip(), file=sys.stderr)
        return 2
    mode, args = argv[0], argv[1:]
    try:
        job_config = parse_args(args)
        if mode == "--cpu-devices":
            print(cpu_device_count(job_config))
        elif mode == "--dump-folder":
            print(job_config.job.dump_folder)
        elif mode == "--exports":
            _, variables = plan(job_config)
            print("\n".join(f"export {k}={shlex.quote(v)}" for k, v in sorted(variables.items())))
        elif mode == "--dry-run":
            command = [sys.executable, str(Path(__file__).resolve().parents[1] / "train.py"), *args]
            print(dry_run_text(job_config, command))
        else:
            import json

            print("CHECK_HOSTS " + json.dumps(check_hosts(job_config)), flush=True)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
