"""Compile time against depth (with and without scan) and step time and peak memory per
activation-checkpointing mode, for the debug model on the XLA CPU backend (one device).

    python bench/bench_parallel.py [--steps 8] [--seq-len 256] [--batch 4]

Every configuration runs train.py's own loop (train.main) in a fresh process, so compile caches
and peak memory do not leak between them. Peak memory is the process's peak RSS: on the CPU
backend device buffers live in host memory, so activation savings show up there (together with
the fixed cost of torch + XLA).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

AC = "--activation_checkpoint."
AC_MODES = {
    "none": [AC + "mode", "none"],
    "full": [AC + "mode", "full"],
    "selective every 2nd block": [AC + "mode", "selective", AC + "selective_ac_option", "2"],
    "selective op": [AC + "mode", "selective", AC + "selective_ac_option", "op"],
    "scan, none": ["--compile.scan_layers", AC + "mode", "none"],
    "scan, selective op": ["--compile.scan_layers", AC + "mode", "selective",
                           AC + "selective_ac_option", "op"],
}


def child(args: list[str], n_layers: int) -> None:
    """Run one configuration and print its measurements as JSON."""
    sys.path.insert(0, str(REPO))
    import train
    from torchtitan_xla.config import parse_args
    from torchtitan_xla.runtime import compile_stats
    from torchtitan_xla.utils import host_memory_gib

    history = train.main(parse_args(args), model_overrides={"n_layers": n_layers})
    compiles, compile_s = compile_stats()
    steady = [s.step_time for s in history[3:]] or [history[-1].step_time]
    print("RESULT " + json.dumps({"compiles": compiles, "compile_s": compile_s,
                                  "step_s": statistics.median(steady), "peak_gib": host_memory_gib()[1],
                                  "final_loss": history[-1].loss}))


def run(args: list[str], n_layers: int) -> dict:
    env = dict(os.environ, PJRT_DEVICE="CPU", CPU_NUM_DEVICES="1", TF_CPP_MIN_LOG_LEVEL="2")
    p = subprocess.run([sys.executable, __file__, "--child", json.dumps(args), str(n_layers)],
                       capture_output=True, text=True, env=env)
    if p.returncode:
        raise RuntimeError(p.stderr[-3000:])
    return json.loads(next(ln for ln in p.stdout.splitlines() if ln.startswith("RESULT "))[7:])


def main() -> None:
    if sys.argv[1:2] == ["--child"]:
        return child(json.loads(sys.argv[2]), int(sys.argv[3]))
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--depths", default="8,16,32")
    opts = ap.parse_args()
    base = ["--job.config_file", str(REPO / "train_configs/debug_model.toml"), "--job.no-print_config",
            "--job.dump_folder", "/tmp/ttx-bench-parallel", "--training.steps", str(opts.steps),
            "--training.seq_len", str(opts.seq_len), "--training.local_batch_size", str(opts.batch),
            "--metrics.log_freq", "1", "--training.mixed_precision_param", "float32"]

    print(f"Compile time (both graphs: init + train step), debug model dim 256, batch {opts.batch} x "
          f"seq {opts.seq_len}, 1 XLA CPU device")
    print("| blocks | no scan: compile (s) | no scan: step (s) | scan: compile (s) | scan: step (s) |")
    print("|---|---|---|---|---|")
    for depth in map(int, opts.depths.split(",")):
        plain = run(base + AC_MODES["none"], depth)
        scan = run(base + AC_MODES["scan, none"], depth)
        print(f"| {depth} | {plain['compile_s']:.1f} | {plain['step_s']:.3f} | {scan['compile_s']:.1f} | "
              f"{scan['step_s']:.3f} |", flush=True)

    print(f"\nActivation checkpointing, debug model (8 blocks), batch {opts.batch} x seq {opts.seq_len}")
    print(f"| mode | step (s) | peak RSS (GiB) | loss after {opts.steps} steps |")
    print("|---|---|---|---|")
    for name, args in AC_MODES.items():
        r = run(base + args, 8)
        print(f"| {name} | {r['step_s']:.3f} | {r['peak_gib']:.2f} | {r['final_loss']:.4f} |", flush=True)


if __name__ == "__main__":
    main()
