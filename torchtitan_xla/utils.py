"""Small helpers of the training loop: determinism, host memory, the garbage-collection schedule,
device memory running out."""

from __future__ import annotations

import contextlib
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


@contextlib.contextmanager
def out_of_memory_as_one_line(steps_done, is_out_of_memory):
    """The device running out of memory in the training loop as one line: before any step has
    finished (`steps_done()` 0: XLA allocates every step's buffers at its first), the job does not
    fit and is bad input (exit 2; the plan would have said so); later, a failed run (exit 1)."""
    from torchtitan_xla.errors import ConfigError, RunError, first_line

    try:
        yield
    except RuntimeError as e:
        if not is_out_of_memory(e):
            raise
        what = f"the device ran out of memory ({first_line(e, typed=False, limit=160)})"
        if steps_done():
            raise RunError(f"{what} after {steps_done()} step(s)") from None
        raise ConfigError(f"{what}: the training step does not fit; lower [training] local_batch_size or "
                          f"seq_len, or see what fits with ./run_train.sh --plan") from None
