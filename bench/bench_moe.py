"""Mixture of experts against dense on this machine: the debug MoE (mixtral debugmodel: 4 blocks, 8
experts of SwiGLU hidden 384, top-2, 8 kv heads), dropless, with capacity 1.25 and with sorted
experts (grouped_mm, its CPU reference), against the dense
debug model cut to the same 4 blocks and 8 kv heads (SwiGLU hidden 768 = 2 x 384: the same active
FLOPs per token).

    python bench/bench_moe.py [--steps 20] [--batch 8] [--seq 256]

Each variant runs train.main in a fresh process on one XLA CPU device: `--steps` warm-up steps,
then `--steps` timed ones (one log per half, as a real run logs). Reported: the timed half's step
time and tokens/s, and MFU on active parameters against the XLA fp32 matmul peak measured in the
same process just before (bench_train.xla_matmul_peak); the CPU model names the machine.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
VARIANTS = {
    "dense (llama3 debugmodel, 4 blocks)": ["--model.name", "llama3"],
    "MoE dropless (mixtral debugmodel)": ["--model.name", "mixtral"],
    "MoE capacity 1.25": ["--model.name", "mixtral", "--moe.capacity_factor", "1.25"],
    "MoE grouped_mm (CPU reference)": ["--model.name", "mixtral", "--moe.grouped_mm"],
}

_WORKER = """
import json, sys, tempfile
sys.path[:0] = [{repo!r}, {bench!r}]
from bench_train import xla_matmul_peak
from torchtitan_xla import runtime
runtime.configure("replay")  # as train.py does, before the matmul peak starts XLA
runtime.init_devices()
peak = xla_matmul_peak()
import train
from torchtitan_xla.config import parse_args
steps = {steps}
with tempfile.TemporaryDirectory() as out:
    args = ["--job.config_file", {config!r}, "--job.dump_folder", out, "--job.no-print_config",
            "--training.steps", str(2 * steps), "--metrics.log_freq", str(steps),
            "--training.local_batch_size", "{batch}", "--training.seq_len", "{seq}",
            "--metrics.peak_flops", str(peak), *json.loads(sys.argv[1])]
    s = train.main(parse_args(args), model_overrides={{"n_layers": 4, "n_kv_heads": 8}})[-1]
print("RESULT " + json.dumps(dict(step_time=s.step_time, tps=s.tokens_per_second, mfu=s.mfu,
                                  loss=s.loss, peak=peak, router=s.router)))
"""


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "unknown CPU"


def run(flags: list[str], opts) -> dict:
    code = _WORKER.format(repo=str(REPO), bench=str(REPO / "bench"), steps=opts.steps,
                          config=str(REPO / "train_configs" / "debug_model.toml"), batch=opts.batch,
                          seq=opts.seq)
    env = dict(os.environ, PJRT_DEVICE="CPU", CPU_NUM_DEVICES="1")
    p = subprocess.run([sys.executable, "-c", code, json.dumps(flags)], capture_output=True, text=True,
                       env=env, timeout=3600)
    if p.returncode:
        raise SystemExit(p.stderr[-3000:])
    return json.loads(next(ln for ln in p.stdout.splitlines() if ln.startswith("RESULT "))[7:])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=256)
    opts = ap.parse_args()
    print(f"{cpu_model()}, {os.cpu_count()} cores; batch {opts.batch} x seq {opts.seq}, "
          f"{opts.steps} timed steps after {opts.steps} warm-up steps")
    print(f"{'variant':<38} {'step (s)':>9} {'tokens/s':>9} {'MFU':>7} {'dropped':>8}")
    for name, flags in VARIANTS.items():
        r = run(flags, opts)
        dropped = f"{100 * r['router'][2]:.1f}%" if r["router"] else "-"
        print(f"{name:<38} {r['step_time']:>9.3f} {r['tps']:>9,.0f} {r['mfu']:>6.2f}% {dropped:>8}"
              f"   (peak {r['peak'] / 1e9:.0f} GFLOP/s)")


if __name__ == "__main__":
    main()
