"""What the run reports every `log_freq` steps: the console line (and, later, TensorBoard)."""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass

from torchtitan_xla.logging import logger
from torchtitan_xla.models.llama.model import ModelArgs
from torchtitan_xla.utils import compile_stats, host_memory_gib


def num_flops_per_token(args: ModelArgs, num_params_no_embedding: int, seq_len: int) -> int:
    """Training FLOPs per token: 6 per non-embedding parameter (2 forward, 4 backward) plus
    attention's two matmuls over the sequence, 12·L·H·Q·T (PaLM's convention; the causal mask's
    skipped half is not subtracted, so numbers compare with torchtitan's)."""
    return 6 * num_params_no_embedding + 12 * args.n_layers * args.n_heads * args.head_dim * seq_len


class _Colors:
    def __init__(self, enabled: bool):
        on = enabled and sys.stdout.isatty()
        self.cyan, self.green, self.yellow, self.blue, self.reset = (
            ("\033[36m", "\033[32m", "\033[33m", "\033[34m", "\033[39m") if on else ("",) * 5)


@dataclass
class StepStats:
    step: int
    loss: float
    grad_norm: float
    lr: float
    tokens_per_second: float
    step_time: float
    data_wait: float  # seconds per step spent waiting for the next batch


class MetricLogger:
    def __init__(self, *, flops_per_token: int, tokens_per_step: int, num_devices: int,
                 color: bool, peak_flops: float | None = None):
        self.flops_per_token = flops_per_token
        self.tokens_per_step = tokens_per_step
        self.num_devices = num_devices
        self.peak_flops = peak_flops
        self.colors = _Colors(color)
        self._last_step = 0
        self._last_time = time.perf_counter()
        self._data_wait = 0.0

    def reset_timer(self, step: int) -> None:
        self._last_step, self._last_time, self._data_wait = step, time.perf_counter(), 0.0

    def add_data_wait(self, seconds: float) -> None:
        """Time the loop spent waiting for a batch since the last log."""
        self._data_wait += seconds

    def log(self, step: int, loss: float, grad_norm: float, lr: float) -> StepStats:
        now = time.perf_counter()
        steps = step - self._last_step
        dt = (now - self._last_time) / max(steps, 1)
        data_wait = self._data_wait / max(steps, 1)
        self.reset_timer(step)
        tps = self.tokens_per_step / dt / self.num_devices  # per device, as torchtitan reports
        mfu = (f"{100 * self.flops_per_token * tps / self.peak_flops:.2f}%"
               if self.peak_flops else "n/a")
        mem, _ = host_memory_gib()
        compiles, compile_s = compile_stats()
        c = self.colors
        logger.info(
            f"{c.cyan}step: {step:>5}  {c.green}loss: {loss:8.4f}  {c.reset}grad_norm: {grad_norm:7.4f}  "
            f"lr: {lr:.2e}  {c.blue}tps: {tps:,.0f}  mfu: {mfu}  {c.yellow}memory: {mem:.2f}GiB(host)  "
            f"{c.reset}step_time: {dt:.3f}s  data_wait: {100 * data_wait / dt:.1f}%  "
            f"compiles: {compiles} ({compile_s:.1f}s){c.reset}")
        return StepStats(step, loss, grad_norm, lr, tps, dt, data_wait)
