"""Small helpers of the training loop: determinism, host memory, the garbage-collection schedule."""

from __future__ import annotations

import gc
import os
import resource


def set_determinism(seed: int | None, deterministic: bool) -> int:
    """Seed torch (host) and XLA (device) RNGs; returns the seed used."""
    import torch

    from torchtitan_xla import runtime

    seed = 0 if seed is None else seed
    runtime.set_seed(seed)
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
