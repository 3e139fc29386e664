"""The TPU runtime's variables for each host of a multi-host job, where no metadata server
describes the slice (GKE, Slurm on bare hosts), and the MEGASCALE_* variables that join several
slices over the data-center network. Imports neither torch nor torch_xla."""

from __future__ import annotations

import re
from collections.abc import Mapping

from torchtitan_xla.errors import ConfigError
from torchtitan_xla.launch.hosts import Hosts

DEFAULT_MEGASCALE_PORT = 8081
_TPU_METADATA_URL = "http://metadata.google.internal/computeMetadata/v1/instance/attributes/"


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
