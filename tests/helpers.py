"""Running train.py (or run_train.sh) in a subprocess and reading back what it logged."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
STEP_LINE = re.compile(r"step:\s+(\d+)\s+loss:\s+([0-9.]+)")


@dataclass
class Run:
    returncode: int
    stdout: str
    stderr: str

    @property
    def losses(self) -> dict[int, float]:
        return {int(s): float(v) for s, v in STEP_LINE.findall(self.stderr)}


def _env(devices: int, extra: dict[str, str | None] | None) -> dict[str, str]:
    """This environment on the CPU backend with `devices` devices; `extra` values of None unset."""
    env = dict(os.environ, PJRT_DEVICE="CPU", CPU_NUM_DEVICES=str(devices))
    for k, v in (extra or {}).items():
        if v is None:
            env.pop(k, None)
        else:
            env[k] = v
    return env


def run_train(args: list[str], *, devices: int = 1, script: str = "train.py",
              env: dict[str, str | None] | None = None, timeout: int = 600) -> Run:
    """train.py (or run_train.sh) with `devices` virtual XLA CPU devices."""
    full_env = _env(devices, env)
    full_env["PYTHON"] = sys.executable  # run_train.sh: use this interpreter, install nothing
    if script == "train.py":
        cmd = [sys.executable, str(REPO / "train.py"), *args]
    else:
        cmd = [str(REPO / script), *args]
    p = subprocess.run(cmd, capture_output=True, text=True, env=full_env, timeout=timeout)
    return Run(p.returncode, p.stdout, p.stderr)


def tiny_args(dump_folder: Path, *extra: str) -> list[str]:
    """The debug model at a small size that compiles and steps in seconds."""
    return ["--job.config_file", str(REPO / "train_configs" / "debug_model.toml"),
            "--job.dump_folder", str(dump_folder), "--job.no-print_config",
            "--training.seq_len", "64", "--training.steps", "5", "--metrics.log_freq", "1",
            "--lr_scheduler.warmup_steps", "2", *extra]


_DRIVER = """
import json, sys
sys.path.insert(0, {repo!r})
import train
from torchtitan_xla.config_manager import parse_args
history = train.main(parse_args(sys.argv[1:]))
print("LOSSES " + json.dumps({{s.step: s.loss for s in history}}))
"""


def train_losses(args: list[str], *, devices: int = 1, env: dict[str, str | None] | None = None,
                 timeout: int = 600) -> dict[int, float]:
    """Run train.main in a fresh process with `devices` virtual devices; the exact losses."""
    full_env = _env(devices, env)
    p = subprocess.run([sys.executable, "-c", _DRIVER.format(repo=str(REPO)), *args],
                       capture_output=True, text=True, env=full_env, timeout=timeout)
    if p.returncode != 0:
        raise AssertionError(f"training failed ({p.returncode}):\n{p.stderr[-4000:]}")
    line = next(ln for ln in p.stdout.splitlines() if ln.startswith("LOSSES "))
    return {int(k): v for k, v in json.loads(line[len("LOSSES "):]).items()}
