"""The CPU-side (gloo) host group: checkpoint barriers, the preemption agreement, and the
`--check-hosts` launch check. Imports torch only inside its functions."""

from __future__ import annotations

import os
import socket

from torchtitan_xla.config import JobConfig
from torchtitan_xla.errors import ConfigError
from torchtitan_xla.launch.hosts import Hosts, check_slices, resolve_hosts
from torchtitan_xla.logging import logger


def init_host_group(hosts: Hosts, timeout_s: float = 1800):
    """The CPU-side (gloo) process group over all hosts, for checkpoint barriers and small host
    collectives; checks that every host agrees on the job's shape. Returns the group."""
    from datetime import timedelta

    import torch.distributed as dist

    if dist.is_initialized():  # the native runtime's group of every process: the hosts' too
        return dist.group.WORLD
    addr = hosts.master_addr
    if not addr:
        from torchtitan_xla import runtime

        addr = runtime.master_ip()  # a TPU pod configured by its metadata server: process 0's IP
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
    tokenizer = build_tokenizer(job_config.model.tokenizer_path, job_config.model.name)
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
