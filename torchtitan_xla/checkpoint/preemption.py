"""Stopping on SIGTERM (a Cloud TPU preemption notice, Slurm's time limit or `scancel`) with a
checkpoint of the last finished step, the same step on every host.

The signal reaches the hosts at different times, possibly during different steps. Each host
therefore asks the others once per step, before deciding whether to save: one all-reduce (max) of
its flag on the CPU-side host group. Every host gets the same answer at the same step, so they all
enter the save's collectives together (or none does), save that step, and exit 0.
"""

from __future__ import annotations

import signal
import threading

import torch

from torchtitan_xla.logging import logger


class Preemption:
    def __init__(self, *, host_count: int = 1, process_group=None):
        self.host_count, self.process_group = host_count, process_group
        self._received = threading.Event()

    def install(self) -> None:
        """From now on SIGTERM asks the run to stop after the current step."""

        def on_sigterm(signum, frame):
            logger.warning("SIGTERM received: saving a checkpoint after this step, then exiting")
            self._received.set()

        signal.signal(signal.SIGTERM, on_sigterm)

    def agreed_stop(self) -> bool:
        """Whether any host has received SIGTERM. Every host calls it once per step, at the same
        point of the loop, and every host gets the same answer."""
        flag = self._received.is_set()
        if self.host_count > 1:
            import torch.distributed as dist

            t = torch.tensor([int(flag)])
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.process_group)
            flag = bool(t.item())
        return flag
