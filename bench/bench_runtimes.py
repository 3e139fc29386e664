"""Tokens/s of the two runtimes at the same shape on this machine, one device each: the XLA
runtime's replayed step, the native runtime eager, compiled per block and compiled whole (its
default: each microbatch's forward-backward and the update as compiled graphs).

    python bench/bench_runtimes.py                     # debug model, batch 4 x seq 256, fp32
    python bench/bench_runtimes.py --rounds 5 --steps 20

Each round runs one train.py job per kind (the order rotates every round, so all see the same
machine load) on synthetic data; a job's tokens/s is the median of its step lines after warm-up
(step 4 on: the first steps compile). Reported: the median over rounds per kind and its ratio to
XLA's, with the CPU named. Steps are the loop's own (data, host syncs at each log line), as a
user's run sees them.
"""

from __future__ import annotations

import argparse
import re
import statistics
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
KINDS = {
    "xla (replay)": ["--runtime.backend", "xla"],
    "native eager": ["--runtime.backend", "native", "--compile.step", "eager"],
    "native blocks": ["--runtime.backend", "native", "--compile.step", "blocks"],
    "native compiled": ["--runtime.backend", "native", "--compile.step", "compile"],
}
STEP = re.compile(r"step:\s+(\d+) .*? tps: ([\d,]+)")


def job(kind: str, opts) -> float:
    args = ["--job.config_file", str(REPO / "train_configs" / "debug_model.toml"),
            "--job.dump_folder", f"/tmp/ttx-bench-runtimes/{kind.replace(' ', '_')}", "--job.no-print_config",
            "--training.dataset", "synthetic", "--training.local_batch_size", str(opts.batch),
            "--training.seq_len", str(opts.seq_len), "--training.steps", str(opts.steps),
            "--metrics.log_freq", "1", "--training.mixed_precision_param", "float32",
            "--checkpoint.enable", "false", *KINDS[kind]]
    # As run_train.sh starts either: the host malloc variables (tcmalloc where installed).
    env = {"PJRT_DEVICE": "CPU", "CPU_NUM_DEVICES": "1", "PATH": "/usr/bin:/bin", **opts.malloc}
    p = subprocess.run([sys.executable, str(REPO / "train.py"), *args], capture_output=True,
                       text=True, env=env)
    if p.returncode:
        raise SystemExit(f"{kind} failed:\n{p.stderr[-3000:]}")
    tps = [float(t.replace(",", "")) for s, t in STEP.findall(p.stderr) if int(s) >= 4]
    return statistics.median(tps)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=256)
    opts = parser.parse_args()
    sys.path.insert(0, str(REPO))
    from torchtitan_xla.runtime.xla.process import (
        cpu_features,
        cpu_malloc_env,
        cpu_model,
        vector_features,
    )

    opts.malloc = cpu_malloc_env({})

    kinds = list(KINDS)
    results: dict[str, list[float]] = {k: [] for k in kinds}
    for r in range(opts.rounds):
        for kind in kinds[r % len(kinds):] + kinds[:r % len(kinds)]:
            results[kind].append(job(kind, opts))
            print(f"round {r + 1}: {kind}: {results[kind][-1]:,.0f} tokens/s", flush=True)
    print(f"\n{cpu_model()} ({vector_features(cpu_features())}); debug model, batch {opts.batch} x "
          f"seq {opts.seq_len}, fp32, {opts.rounds} rounds; {opts.malloc}")
    base = statistics.median(results["xla (replay)"])
    for kind in kinds:
        median = statistics.median(results[kind])
        print(f"| {kind} | {median:,.0f} | {median / base:.2f}x |")


if __name__ == "__main__":
    main()
