"""Running train.py's main on the native runtime: real torchrun processes on the CPU with gloo
(tests/native_driver.py), and comparing their losses."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

from helpers import REPO, tiny_args

# Synthetic data: the global batch is the same whatever the number of processes
# (datasets/packing.py), so losses can be compared step by step.
# On the CPU (gloo) wherever the tests run, also on a machine with a GPU ("auto" would take it).
NATIVE = ["--runtime.backend", "native", "--runtime.device", "cpu", "--training.dataset", "synthetic",
          "--training.steps", "10", "--training.global_batch_size", "8"]
EAGER = ["--compile.step", "eager"]


def native_jobs(folder: Path, processes: int, jobs: dict[str, list[str]], *,
                model: dict | None = None, overrides: dict[str, dict] | None = None,
                timeout: int = 900) -> dict[str, dict]:
    """Each job (name: flags) in turn, in one set of `processes` torchrun processes, each in its own
    folder under `folder`: rank 0's losses, grad norms, parameter layouts and log lines, by job.
    `model`: ModelArgs fields for every job; `overrides`: more, by job name."""
    specs, results = [], {}
    for name, flags in jobs.items():
        sub = folder / re.sub(r"\W+", "_", name)
        sub.mkdir(parents=True, exist_ok=True)
        specs.append({"args": tiny_args(sub, *NATIVE, *flags), "out": str(sub / "result.json"),
                      "overrides": (model or {}) | (overrides or {}).get(name, {})})
        results[name] = {"folder": sub}
    # Each process's output in its own file, so that a failure shows the process that failed first.
    logs = folder / "torchrun_logs"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(processes),
           "--log-dir", str(logs), "--redirects", "3", str(REPO / "tests" / "native_driver.py")]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("XLA_", "PJRT_"))}
    p = subprocess.run(cmd, capture_output=True, text=True, env=dict(env, NATIVE_JOBS=json.dumps(specs)),
                       timeout=timeout)
    assert p.returncode == 0, p.stderr[-1500:] + "".join(
        f"\n--- {log.relative_to(logs)} ---\n{log.read_text(errors='replace')[-2500:]}"
        for log in sorted(logs.glob("**/std*.log")) if log.stat().st_size)
    for spec, result in zip(specs, results.values()):
        result |= json.loads(Path(spec["out"]).read_text())
    return results


def native(folder: Path, processes: int, *flags: str, overrides: dict | None = None) -> dict:
    """One job (see native_jobs), in `folder`."""
    return native_jobs(folder, processes, {"run": list(flags)}, overrides={"run": overrides or {}})["run"]


def close(got: dict, expected: dict, rtol: float) -> None:
    """The same steps, each loss within `rtol` of the expected one."""
    got, expected = ({str(k): v for k, v in d.items()} for d in (got, expected))
    assert got.keys() == expected.keys()
    for step, value in expected.items():
        assert abs(got[step] - value) <= rtol * abs(value), (step, got[step], value)
