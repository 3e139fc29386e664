"""Profiler traces of chosen steps (the runtime's profiler), and torch_xla's metrics report.

    [profiling]
    enable_profiling = true
    profile_freq = 100      # trace the steps ending at 100, 200, ...
    profiler_active = 3     # ... three steps each: 98-100, 198-200, ...

Each trace goes to <dump_folder>/<save_traces_folder>/iteration_<last step>/plugins/profile/<time>/
as <host>.xplane.pb (what TensorBoard's profile plugin and XProf read) plus a Chrome-trace
<host>.trace.json.gz. torch_xla's profiler works on the CPU backend as well as on TPU; on CPU the
trace holds the host side only (Python, lazy tracing, XLA CPU execution threads). On the native
runtime each process writes torch.profiler's Chrome trace straight into iteration_<last step>/ as
<host>_<pid>.<time>.pt.trace.json (Perfetto and chrome://tracing read it).
"""

from __future__ import annotations

import collections
import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from torchtitan_xla import runtime
from torchtitan_xla.logging import logger
from torchtitan_xla.storage import local_outputs

if TYPE_CHECKING:
    from torchtitan_xla.config import JobConfig


class Profiler:
    """Starts and stops one trace per window of `active` steps ending at multiples of `freq`."""

    def __init__(self, trace_root: Path, freq: int, active: int):
        self.trace_root, self.freq, self.active = trace_root, freq, active
        self._window_end: int | None = None  # last step of the open trace

    def step(self, step: int) -> None:
        """Call at the start of every step, before its batch is fetched."""
        if self._window_end is not None and step > self._window_end:
            self._stop()
        if (step + self.active - 1) % self.freq == 0:
            self._start(step)

    def close(self) -> None:
        if self._window_end is not None:
            self._stop()

    def _start(self, step: int) -> None:
        self._window_end = step + self.active - 1
        runtime.start_trace(str(self.trace_root / f"iteration_{self._window_end}"))

    def _stop(self) -> None:
        # Steps run asynchronously: the trace ends once the window's last step has run on the
        # device. (This wait happens only when a trace ends.)
        runtime.stop_trace()
        where = self.trace_root / f"iteration_{self._window_end}"
        first = self._window_end - self.active + 1
        logger.info(f"Profiler: steps {first}-{self._window_end} traced to {where}")
        self._window_end = None


def write_xla_metrics_report(path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(runtime.metrics_report())
    logger.info(f"torch_xla metrics report written to {path}")


@contextlib.contextmanager
def maybe_enable_profiling(job_config: JobConfig) -> Iterator[Profiler | None]:
    """The run's Profiler (None when profiling is off). On leaving, also after an error, it ends an
    open trace and writes the metrics report if asked for: a recompile error is when it helps."""
    prof = job_config.profiling
    dump_folder = Path(local_outputs(job_config.job.dump_folder))  # traces are local files
    profiler = None
    if prof.enable_profiling:
        profiler = Profiler(dump_folder / prof.save_traces_folder, prof.profile_freq,
                            prof.profiler_active)
    try:
        yield profiler
    finally:
        if profiler is not None:
            profiler.close()
        if prof.save_xla_metrics_report:
            write_xla_metrics_report(dump_folder / "xla_metrics_report.txt")


COMPILED = "## Call CompiledFxGraph"


def eager_ops(trace: dict) -> tuple[collections.Counter, int]:
    """From a native process's Chrome trace: ({aten op: count} of the top-level aten CPU ops that
    ran outside compiled graphs, each a device dispatch on TorchTPU and a launch on a GPU), and the
    number of compiled-graph calls (inductor's `## Call CompiledFxGraph` ranges)."""
    threads: dict[int, list] = collections.defaultdict(list)
    for e in trace["traceEvents"]:
        if e.get("ph") == "X":
            threads[e["tid"]].append(e)
    ops, graphs = collections.Counter(), 0
    for events in threads.values():
        events.sort(key=lambda e: (e["ts"], -e["dur"]))
        open_ranges: list[dict] = []
        for e in events:
            while open_ranges and open_ranges[-1]["ts"] + open_ranges[-1]["dur"] <= e["ts"]:
                open_ranges.pop()
            name = e["name"]
            graphs += name.startswith(COMPILED)
            nested = any(r["name"].startswith((COMPILED, "aten::")) for r in open_ranges)
            if name.startswith("aten::") and e.get("cat") == "cpu_op" and not nested:
                ops[name] += 1
            open_ranges.append(e)
    return ops, graphs
