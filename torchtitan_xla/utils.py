"""Small runtime helpers shared by train.py, the benchmarks and the tests."""

from __future__ import annotations

import gc
import os
import resource

import torch


def compile_stats() -> tuple[int, float]:
    """(number of XLA graph compiles so far in this process, total compile seconds)."""
    import torch_xla.debug.metrics as met

    data = met.metric_data("CompileTime")
    return (0, 0.0) if data is None else (int(data[0]), data[1] / 1e9)


def set_determinism(seed: int | None, deterministic: bool) -> int:
    """Seed torch (host) and XLA (device) RNGs; returns the seed used."""
    import torch_xla.core.xla_model as xm

    seed = 0 if seed is None else seed
    torch.manual_seed(seed)
    xm.set_rng_state(seed)
    if deterministic:
        torch.use_deterministic_algorithms(True)
    return seed


def host_memory_gib() -> tuple[float, float]:
    """(current, peak) resident memory of this process in GiB (what the CPU backend uses)."""
    with open("/proc/self/statm") as fh:
        rss_pages = int(fh.read().split()[1])
    current = rss_pages * os.sysconf("SC_PAGE_SIZE") / 2**30
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # ru_maxrss is KiB on Linux
    return current, peak


class GarbageCollection:
    """Python's automatic gc pauses at random steps; collect on a fixed schedule instead."""

    def __init__(self, gc_freq: int):
        self.gc_freq = gc_freq
        gc.disable()
        gc.collect(1)

    def run(self, step: int) -> None:
        if step % self.gc_freq == 0:
            gc.collect(1)
