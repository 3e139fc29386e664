"""What the run reports every `log_freq` steps: one console line and TensorBoard scalars.

Every number is computed on the host from values the training loop already has (the step's
loss / grad-norm tensor, read back once per log step, wall-clock times, the runtime's counters), so
logging adds no graph, no recompile and no host sync of its own. docs/metrics.md says what each
number means and how it is computed.
"""

from __future__ import annotations

import datetime
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from torchtitan_xla import runtime
from torchtitan_xla.errors import ConfigError, first_line
from torchtitan_xla.logging import logger
from torchtitan_xla.models.llama.args import ModelArgs
from torchtitan_xla.peak_flops import detect_device_kind, resolve_peak_flops
from torchtitan_xla.storage import local_outputs
from torchtitan_xla.utils import host_memory_gib

if TYPE_CHECKING:
    from torchtitan_xla.config import JobConfig


def num_flops_per_token(args: ModelArgs, num_params_no_embedding: int, seq_len: int,
                        frozen: int = 0) -> int:
    """Training FLOPs per token: 6 per non-embedding parameter (2 forward, 4 backward: the input's
    and the weight's gradients), 4 for the `frozen` ones among them (LoRA's base weights: no weight
    gradient), plus attention's two matmuls over the sequence, 6·L·H·(Q+V)·T with Q and V each
    head's query-key and value features (12·L·H·Q·T for Llama: PaLM's convention; the causal mask's
    skipped half is not subtracted, so numbers compare with torchtitan's)."""
    return (6 * num_params_no_embedding - 2 * frozen
            + 6 * args.n_layers * args.n_heads * (args.qk_head_dim + args.v_dim) * seq_len)


def max_rank_loss(token_losses, counted=None):
    """The largest of the data-parallel ranks' mean losses, inside the compiled step.

    `token_losses` and the boolean `counted` (the labels the loss counts; None: all) are [dp ranks,
    ...] (tokens, or rows x sequence): each rank's mean is over its counted tokens, as the training
    loss's is. Never reshaped: a sequence split over devices (context parallelism) stays split."""
    tokens = tuple(range(1, token_losses.dim()))
    if counted is None:
        return token_losses.mean(tokens).max()
    return (token_losses.sum(tokens) / counted.sum(tuple(range(1, counted.dim()))).clamp(min=1)).max()


# --------------------------------------------------------------------------------------------
# Memory
# --------------------------------------------------------------------------------------------


@dataclass
class Memory:
    used_gib: float
    peak_gib: float  # since the process started
    limit_gib: float | None
    source: str  # "HBM" (device allocator) or "host RSS" (this process's resident memory)

    def __str__(self) -> str:
        limit = f"/{self.limit_gib:.2f}" if self.limit_gib else ""
        return f"{self.used_gib:.2f}{limit}GiB({self.source}, peak {self.peak_gib:.2f})"

    def scalars(self) -> dict[str, float]:
        """TensorBoard scalars; device and host memory get different names so no dashboard
        ever plots one against the other."""
        if self.source == "HBM":
            out = {"memory/active(GiB)": self.used_gib, "memory/max_active(GiB)": self.peak_gib}
            if self.limit_gib:
                out["memory/max_active(%)"] = 100 * self.peak_gib / self.limit_gib
            return out
        return {"memory/host_rss(GiB)": self.used_gib, "memory/host_max_rss(GiB)": self.peak_gib}


class MemoryMonitor:
    """Device memory from `xm.get_memory_info` where the runtime provides it (TPU without SPMD);
    otherwise this process's resident memory, labelled "host RSS".

    The XLA CPU backend has no allocator statistics, and torch_xla 2.9 refuses them for the SPMD
    virtual device that train.py always uses (pytorch/xla#9022), so today the line shows host RSS
    everywhere. The first failure is logged once with its reason; the query is not retried.
    """

    def __init__(self, device=None):
        self.device = device
        self._device_ok = device is not None

    def read(self) -> Memory:
        if self._device_ok:
            try:
                info = runtime.memory_info(self.device)
                return Memory(info["bytes_used"] / 2**30, info["peak_bytes_used"] / 2**30,
                              info["bytes_limit"] / 2**30, "HBM")
            except Exception as e:
                self._device_ok = False
                logger.info(f"memory: showing this process's host RSS; device memory statistics "
                            f"are unavailable here ({first_line(e, typed=False)})")
        current, peak = host_memory_gib()
        return Memory(current, peak, None, "host RSS")


# --------------------------------------------------------------------------------------------
# The logger
# --------------------------------------------------------------------------------------------


class _Colors:
    """ANSI colours, only when the log goes to a terminal and not under CI."""

    def __init__(self, enabled: bool, stream=None):
        stream = sys.stderr if stream is None else stream  # where init_logger's handler writes
        on = enabled and stream.isatty() and not os.environ.get("CI")
        self.cyan, self.green, self.yellow, self.blue, self.magenta, self.reset = (
            ("\033[36m", "\033[32m", "\033[33m", "\033[34m", "\033[35m", "\033[39m") if on
            else ("",) * 6)


@dataclass
class StepStats:
    step: int
    loss: float  # mean over every token of the global batch
    max_loss: float  # largest per-data-parallel-rank mean loss (== loss with one rank)
    grad_norm: float
    lr: float
    tokens_per_second: float  # per device
    tflops: float  # achieved model TFLOP/s per device
    mfu: float | None  # percent; None when no peak is known
    step_time: float  # seconds per step, averaged since the previous log
    data_wait: float  # seconds per step spent waiting for the next batch
    memory: Memory
    eta_seconds: float
    validation_loss: float | None = None  # when [validation] ran after this step
    validation_metrics: dict[str, float] | None = None  # its preference metrics (held-out pairs)
    # MoE models: the router's load-balancing loss, z-loss, fraction of token choices dropped by
    # capacity and the experts' load max/min, each the mean over MoE blocks and microbatches.
    router: tuple[float, float, float, float] | None = None
    # Steps since the launch whose loss or gradient norm was not finite ([training]
    # skip_nonfinite_steps: their updates were skipped).
    nonfinite_steps: int = 0
    # Preference objectives: TRL's names (rewards/chosen, rewards/rejected, rewards/margins,
    # rewards/accuracies), each the mean over the step's pairs.
    objective: dict[str, float] | None = None


def _eta(seconds: float) -> str:
    return str(datetime.timedelta(seconds=round(seconds)))


class MetricLogger:
    """Turns the values read back at a log step into the console line and TensorBoard scalars.

    `enabled=False` (another host of a `rank_0_only` run) still returns the StepStats but prints
    and writes nothing.
    """

    def __init__(self, *, flops_per_token: int, tokens_per_step: int, num_devices: int,
                 color: bool, peak_flops: float | None = None, total_steps: int = 0,
                 dp_degree: int = 1, sinks: list | None = None, enabled: bool = True,
                 memory: MemoryMonitor | None = None, skip_nonfinite: bool = True):
        self.flops_per_token = flops_per_token
        self.tokens_per_step = tokens_per_step
        self.num_devices = num_devices
        self.peak_flops = peak_flops
        self.total_steps = total_steps
        self.dp_degree = dp_degree
        self.enabled = enabled
        self.memory = memory or MemoryMonitor()
        self.nonfinite = "skipped steps" if skip_nonfinite else "non-finite steps (applied)"
        self.colors = _Colors(color)
        self.sinks = list(sinks or []) if enabled else []  # TensorBoard, W&B: the same scalars
        self._last_step = 0
        self._last_time = time.perf_counter()
        self._data_wait = 0.0

    def reset_timer(self, step: int) -> None:
        self._last_step, self._last_time, self._data_wait = step, time.perf_counter(), 0.0

    def add_data_wait(self, seconds: float) -> None:
        """Time the loop spent waiting for a batch since the last log."""
        self._data_wait += seconds

    def log(self, step: int, loss: float, grad_norm: float, lr: float,
            max_loss: float | None = None, router: tuple[float, ...] | None = None,
            nonfinite_steps: float = 0, objective: dict[str, float] | None = None) -> StepStats:
        now = time.perf_counter()
        steps = max(step - self._last_step, 1)
        dt = (now - self._last_time) / steps
        data_wait = self._data_wait / steps
        self.reset_timer(step)
        tps = self.tokens_per_step / dt / self.num_devices  # per device, as torchtitan reports
        flops = self.flops_per_token * tps
        mfu = 100 * flops / self.peak_flops if self.peak_flops else None
        memory = self.memory.read()
        eta = dt * max(self.total_steps - step, 0)
        stats = StepStats(step=step, loss=loss, max_loss=loss if max_loss is None else max_loss,
                          grad_norm=grad_norm, lr=lr, tokens_per_second=tps, tflops=flops / 1e12,
                          mfu=mfu, step_time=dt, data_wait=data_wait, memory=memory,
                          eta_seconds=eta, router=router, nonfinite_steps=int(nonfinite_steps),
                          objective=objective)
        if self.enabled:
            self._print(stats)
            self._write(stats)
        return stats

    def log_validation(self, step: int, result) -> None:
        """The validation line and scalars; its time is left out of the next step time."""
        self._last_time += result.seconds
        if not self.enabled:
            return
        c = self.colors
        scalars = {"loss_metrics/validation_loss": result.loss, "time_metrics/validation(s)": result.seconds}
        if "reward" in result.metrics:  # grpo: rewards of completions of held-out prompts, no loss
            scalars = {"time_metrics/validation(s)": result.seconds,
                       **{f"validation/{name}": value for name, value in result.metrics.items()}}
            logger.info(f"{c.cyan}validation: step {step:>5}  {c.green}reward: {result.metrics['reward']:.3f}"
                        f"{c.reset}  ({result.batches} prompts, {result.seconds:.1f}s)")
            self.emit(scalars, step)
            return
        if result.metrics:  # a preference objective's loss: no perplexity
            shown = (f"accuracy: {result.metrics['rewards/accuracies']:.2f}  "
                     f"margin: {result.metrics['rewards/margins']:.4f}")
            scalars |= {f"validation/{name}": value for name, value in result.metrics.items()}
        else:
            shown = f"perplexity: {result.perplexity:,.2f}"
            scalars["loss_metrics/validation_perplexity"] = result.perplexity
        logger.info(f"{c.cyan}validation: step {step:>5}  {c.green}loss: {result.loss:8.4f}  "
                    f"{shown}{c.reset}  ({result.batches} batches, {result.tokens:,} tokens, "
                    f"{result.seconds:.1f}s)")
        self.emit(scalars, step)

    def emit(self, scalars: dict[str, float], step: int) -> None:
        """The same scalars to every sink (TensorBoard, W&B)."""
        for sink in self.sinks:
            sink.write(scalars, step)

    def _print(self, s: StepStats) -> None:
        c = self.colors
        compiles, compile_s = runtime.compile_stats()
        loss = f"loss: {s.loss:8.4f}"
        if self.dp_degree > 1:
            loss += f" (max {s.max_loss:.4f})"
        mfu = "n/a" if s.mfu is None else f"{s.mfu:.2f}%"
        if s.router is not None:
            aux, z, dropped, spread = s.router
            loss += (f"  router aux: {aux:.4f} z: {z:.3f} dropped: {100 * dropped:.1f}% "
                     f"load max/min: {spread:.2f}")
        if s.objective is not None and "reward" in s.objective:  # grpo
            loss += f"  reward: {s.objective['reward']:.3f}  kl: {s.objective['kl']:.4f}"
        elif s.objective is not None:
            loss += (f"  accuracy: {s.objective['rewards/accuracies']:.2f}  "
                     f"margin: {s.objective['rewards/margins']:.4f}")
        if s.nonfinite_steps:
            loss += f"  {c.yellow}{self.nonfinite}: {s.nonfinite_steps}{c.green}"
        logger.info(
            f"{c.cyan}step: {s.step:>5}  {c.green}{loss}  {c.reset}grad_norm: {s.grad_norm:7.4f}  "
            f"lr: {s.lr:.2e}  {c.yellow}memory: {s.memory}  "
            f"{c.blue}tps: {s.tokens_per_second:,.0f}  tflops: {s.tflops:.3g}  "
            f"{c.magenta}mfu: {mfu}  {c.reset}step_time: {s.step_time:.3f}s  "
            f"data_wait: {100 * s.data_wait / s.step_time:.1f}%  compiles: {compiles} "
            f"({compile_s:.1f}s)  eta: {_eta(s.eta_seconds)}{c.reset}")

    def _write(self, s: StepStats) -> None:
        compiles, compile_s = runtime.compile_stats()
        scalars = {
            "loss_metrics/global_avg_loss": s.loss,
            "loss_metrics/global_max_loss": s.max_loss,
            "grad_norm": s.grad_norm,
            "loss_metrics/nonfinite_steps": s.nonfinite_steps,
            "lr": s.lr,
            "throughput(tps)": s.tokens_per_second,
            "tflops": s.tflops,
            "time_metrics/end_to_end(s)": s.step_time,
            "time_metrics/data_loading(s)": s.data_wait,
            "time_metrics/data_loading(%)": 100 * s.data_wait / s.step_time,
            "xla/num_compiles": compiles,
            "xla/compile_time(s)": compile_s,
            **s.memory.scalars(),
        }
        if s.mfu is not None:  # no made-up number when the peak is unknown
            scalars["mfu(%)"] = s.mfu
        if s.router is not None:
            scalars.update(zip(("moe/aux_loss", "moe/z_loss", "moe/dropped(%)", "moe/load_max_over_min"),
                               (s.router[0], s.router[1], 100 * s.router[2], s.router[3])))
        scalars.update(s.objective or {})
        self.emit(scalars, s.step)

    def close(self) -> None:
        for sink in self.sinks:
            sink.close()
        self.sinks = []


class TensorBoardSink:
    def __init__(self, folder: Path):
        from torch.utils.tensorboard import SummaryWriter  # slow to import: only when used

        folder.mkdir(parents=True, exist_ok=True)
        self.writer = SummaryWriter(log_dir=str(folder))
        logger.info(f"TensorBoard: writing to {folder}")

    def write(self, scalars: dict[str, float], step: int) -> None:
        for tag, value in scalars.items():
            self.writer.add_scalar(tag, value, step)
        self.writer.flush()  # a TensorBoard watching the run sees each log step at once

    def close(self) -> None:
        self.writer.close()


class WandbSink:
    """Weights & Biases: the same scalars as TensorBoard, into a run under <dump_folder>/wandb
    (offline mode writes only there; `wandb sync` uploads it later)."""

    def __init__(self, job_config: JobConfig, name_suffix: str = ""):
        try:
            import wandb
        except ImportError:
            raise ConfigError("[metrics] enable_wandb = true: the wandb package is not installed "
                              "(pip install 'torchtitan_xla[wandb]')") from None
        m = job_config.metrics
        folder = Path(local_outputs(job_config.job.dump_folder))
        folder.mkdir(parents=True, exist_ok=True)
        self.run = wandb.init(project=m.wandb_project, name=(m.wandb_run_name or None) and
                              m.wandb_run_name + name_suffix, mode=m.wandb_mode, dir=str(folder),
                              config=job_config.to_dict())
        logger.info(f"W&B ({m.wandb_mode}): writing to {self.run.dir}")

    def write(self, scalars: dict[str, float], step: int) -> None:
        self.run.log(scalars, step=step)

    def close(self) -> None:
        self.run.finish()


def build_metric_logger(job_config: JobConfig, *, flops_per_token: int, tokens_per_step: int,
                        num_devices: int, dp_degree: int, host_rank: int, device=None,
                        float8: bool = False) -> MetricLogger:
    """The run's MetricLogger: which host logs, where TensorBoard writes, which peak MFU uses."""
    metrics = job_config.metrics
    enabled = host_rank == 0 or not metrics.rank_0_only
    sinks = []
    if enabled and metrics.enable_tensorboard:
        # One folder per launch, as torchtitan does: TensorBoard shows each launch as a run.
        tb_dir = (Path(local_outputs(job_config.job.dump_folder)) / metrics.save_tb_folder
                  / datetime.datetime.now().strftime("%Y%m%d-%H%M%S"))
        if not metrics.rank_0_only:
            tb_dir = tb_dir / f"rank_{host_rank}"
        sinks.append(TensorBoardSink(tb_dir))
    if enabled and metrics.enable_wandb:
        sinks.append(WandbSink(job_config, "" if metrics.rank_0_only else f"-rank{host_rank}"))
    device_kind = detect_device_kind()
    peak, source = resolve_peak_flops(device_kind, metrics.peak_flops, float8=float8)
    if enabled:
        if peak is None:
            logger.warning(f"MFU: n/a, {source}")
        else:
            logger.info(f"MFU against {source}")
    return MetricLogger(
        flops_per_token=flops_per_token, tokens_per_step=tokens_per_step, num_devices=num_devices,
        color=metrics.enable_color_printing, peak_flops=peak, total_steps=job_config.training.steps,
        dp_degree=dp_degree, sinks=sinks, enabled=enabled, memory=MemoryMonitor(device),
        skip_nonfinite=job_config.training.skip_nonfinite_steps)
